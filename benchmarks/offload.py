"""Big-model loading and offload: notebook_accel against accelerate, same model and checkpoint, one run.

A ~512 MiB fp32 MLP (16 residual blocks of two 2048x2048 Linear layers) is generated with a fixed
seed and saved as sharded safetensors (an HF-style index json + 4 shards of 128 MiB) in a temp folder.
Every measurement runs in a fresh subprocess (`--child`), configurations round-robin:

- load: `load_checkpoint_and_dispatch(model_on_meta, ckpt, device_map="auto", max_memory={"cpu": "128MB"},
  offload_folder=..., no_split_module_classes=["Block"])`; peak anonymous memory (RssAnon) during the
  call, sampled by the parent from /proc/PID/status, then forward latency of the resulting mixed
  cpu+disk model;
- cpu_offload: `cpu_offload(model, execution_device="cpu")` of the loaded model; forward latency;
- disk_offload: `disk_offload(model_on_meta, folder, execution_device="cpu")` over a folder the same
  library wrote beforehand; forward latency with a warm page cache and, when the page cache can be
  dropped (root), with a cold one;
- read: reading every file of that offload folder sequentially, warm and cold (the throughput yardstick);
- plain: the model in RAM, no hooks (the compute floor).

    python benchmarks/offload.py [--rounds 4] [--forwards 4] [--cold-reps 2] [--no-cold]
                                 [--no-accelerate] [--json PATH] [--profile ROLE:LIB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WIDTH, DEPTH, BATCH = 2048, 16, 4
SHARD_BLOCKS = 4  # blocks per safetensors shard: 4 shards of 128 MiB
BUDGET = "128MB"
ATOL = 1e-5
CHILD_TIMEOUT_S = 300
SAMPLE_EVERY_S = 0.0005


# -- the model (children only import torch) --------------------------------------------------------
def _model_classes():
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.up = nn.Linear(width, width)
            self.down = nn.Linear(width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class MLP(nn.Module):
        def __init__(self, width: int = WIDTH, depth: int = DEPTH):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return MLP


def _status() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile", "VmHWM")}


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _api(lib: str):
    if lib == "ours":
        import notebook_accel.big_modeling as api
    else:
        import accelerate.big_modeling as api
    return api


def _shards(work: str) -> list:
    return sorted(os.path.join(work, "ckpt", n) for n in os.listdir(os.path.join(work, "ckpt")) if n.endswith(".safetensors"))  # fmt: skip


def _loaded_model(work: str):
    """The model with the checkpoint's weights in ordinary process memory, built with torch and
    safetensors alone (no library). Copied, not assigned: safetensors 0.8 returns tensors that map
    the file, and a plain model in RAM should not depend on the page cache."""
    import torch
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = _model_classes()()
    model.to_empty(device="cpu")
    for path in _shards(work):
        model.load_state_dict(load_file(path), strict=False)
    return model.eval()


def _forwards(model, x, count: int, reference, profile=None) -> dict:
    import torch

    times = []
    with torch.no_grad():
        out = model(x)  # warm-up
        diff = (out - reference).abs().max().item()
        if profile is not None:
            profile.enable()
        for _ in range(count):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
        if profile is not None:
            profile.disable()
    return {"forward_s": times, "max_abs_diff": diff}


def _cold_forwards(model, x, count: int) -> list:
    import torch

    times = []
    with torch.no_grad():
        for _ in range(count):
            if not _drop_caches():
                return []
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    return times


def _read_folder(folder: str) -> tuple:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".dat"))
    buffer = bytearray(max(os.path.getsize(os.path.join(folder, n)) for n in names))
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for name in names:
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return time.perf_counter() - start, total


def _folder_bytes(folder: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file()) if os.path.isdir(folder) else 0


# -- the children ---------------------------------------------------------------------------------
def child(spec: dict) -> dict:
    role, lib, work = spec["role"], spec.get("lib"), spec["work"]
    if role == "read":  # no torch: just the bytes
        folder = os.path.join(work, f"offload-{lib}")
        warm = [_read_folder(folder)[0] for _ in range(spec["forwards"])]
        cold = []
        for _ in range(spec["cold_reps"]):
            if not _drop_caches():
                break
            cold.append(_read_folder(folder)[0])
        return {"read_s": warm, "cold_read_s": cold, "bytes": _read_folder(folder)[1]}

    import torch

    torch.manual_seed(0)
    MLP = _model_classes()
    if role == "make":
        from safetensors.torch import save_file

        model = MLP().eval()
        state = model.state_dict()
        os.makedirs(os.path.join(work, "ckpt"))
        weight_map, count = {}, (DEPTH + SHARD_BLOCKS - 1) // SHARD_BLOCKS
        for i in range(count):
            shard = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            keys = [k for k in state if SHARD_BLOCKS * i <= int(k.split(".")[1]) < SHARD_BLOCKS * (i + 1)]
            save_file({k: state[k].contiguous() for k in keys}, os.path.join(work, "ckpt", shard), metadata={"format": "pt"})  # fmt: skip
            weight_map.update(dict.fromkeys(keys, shard))
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(os.path.join(work, "ckpt", "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        x = torch.randn(BATCH, WIDTH)
        with torch.no_grad():
            y = model(x)
        torch.save({"x": x, "y": y}, os.path.join(work, "ref.pt"))
        return {"bytes": total, "largest_tensor": max(t.numel() * t.element_size() for t in state.values())}

    ref = torch.load(os.path.join(work, "ref.pt"))
    x, y = ref["x"], ref["y"]
    profile = None
    if spec.get("profile"):
        import cProfile

        profile = cProfile.Profile()
    api = _api(lib) if lib != "torch" else None
    result: dict = {}

    if role == "prepare_disk":  # each library writes its own offload folder once
        model = _loaded_model(work)
        start = time.perf_counter()
        api.disk_offload(model, os.path.join(work, f"offload-{lib}"), execution_device="cpu")
        result["write_s"] = time.perf_counter() - start
        result.update(_forwards(model, x, 1, y))
    elif role == "load":
        with api.init_empty_weights():
            model = MLP()
        folder = os.path.join(work, f"load-{lib}-{spec['tag']}")
        import gc

        gc.collect()
        try:  # reset VmHWM to the current RSS: VmHWM after the call is then the call's peak RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")
            result["hwm_reset"] = True
        except OSError:
            result["hwm_reset"] = False
        result["baseline"] = _status()
        if profile is not None:
            profile.enable()
        result["t_begin"] = time.monotonic()
        model = api.load_checkpoint_and_dispatch(
            model, os.path.join(work, "ckpt"), device_map="auto", max_memory={"cpu": BUDGET},
            offload_folder=folder, no_split_module_classes=["Block"],
        )  # fmt: skip
        result["t_end"] = time.monotonic()
        if profile is not None:
            profile.disable()
            profile = None
        result["after"] = _status()
        result["load_s"] = result["t_end"] - result["t_begin"]
        result["device_map"] = {k: str(v) for k, v in model.hf_device_map.items()}
        result["offload_folder_bytes"] = _folder_bytes(folder)
        result.update(_forwards(model, x, spec["forwards"], y))
    elif role == "cpu_offload":
        model = api.cpu_offload(_loaded_model(work), execution_device="cpu")
        result.update(_forwards(model, x, spec["forwards"], y, profile))
    elif role == "disk_offload":
        with api.init_empty_weights():
            model = MLP().eval()
        model = api.disk_offload(model, os.path.join(work, f"offload-{lib}"), execution_device="cpu")
        result.update(_forwards(model, x, spec["forwards"], y, profile))
        if profile is None:
            result["cold_forward_s"] = _cold_forwards(model, x, spec["cold_reps"])
    elif role == "plain":
        result.update(_forwards(_loaded_model(work), x, spec["forwards"], y, profile))
    else:
        raise ValueError(role)
    if profile is not None:
        import pstats

        for key in ("tottime", "cumulative"):
            print(f"--- {role} {lib}: top functions by {key} ---", file=sys.stderr)
            pstats.Stats(profile, stream=sys.stderr).sort_stats(key).print_stats(25)
    return result


# -- the parent -----------------------------------------------------------------------------------
class AnonSampler:
    """Samples a process's RssAnon from /proc/PID/status every ~0.5 ms, in a thread of the parent."""

    def __init__(self, pid: int):
        self.samples: list = []  # (time.monotonic(), RssAnon bytes, RssFile bytes)
        self._pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            fd = os.open(f"/proc/{self._pid}/status", os.O_RDONLY)
        except OSError:
            return
        try:
            while not self._stop.is_set():
                try:
                    text = os.pread(fd, 4096, 0)
                except OSError:
                    break  # the process is gone
                at = text.find(b"RssAnon:")
                if at < 0:
                    break  # a zombie has no memory lines
                at_file = text.find(b"RssFile:", at)
                anon = int(text[at + 8 : text.index(b"kB", at)]) * 1024
                file = int(text[at_file + 8 : text.index(b"kB", at_file)]) * 1024
                self.samples.append((time.monotonic(), anon, file))
                time.sleep(SAMPLE_EVERY_S)
        finally:
            os.close(fd)

    def stop(self):
        self._stop.set()
        self._thread.join()

    def peak(self, begin: float, end: float) -> tuple:
        """(peak RssAnon, peak RssAnon + RssFile, number of samples) between begin and end."""
        inside = [(a, f) for t, a, f in self.samples if begin <= t <= end]
        if not inside:
            return None, None, 0
        return max(a for a, _ in inside), max(a + f for a, f in inside), len(inside)


def run_child(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", dir=spec["work"], delete=False) as out:
        path = out.name
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps({**spec, "out": path})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    sampler = AnonSampler(proc.pid)
    started = time.perf_counter()
    try:
        stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(
            f"{spec['role']}/{spec.get('lib')} exited {proc.returncode}: {stderr.strip()[-2000:]}"
        )
    with open(path) as f:
        result = json.load(f)
    os.unlink(path)
    result["wall_s"] = time.perf_counter() - started
    if "t_begin" in result:
        result["peak_anon"], result["peak_rss"], result["samples_in_window"] = sampler.peak(
            result["t_begin"], result["t_end"]
        )
    if spec.get("profile"):
        print(stderr, file=sys.stderr)
    return result


def _warm(paths) -> None:
    for path in paths:
        files = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
        for name in files:
            with open(name, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass


def measure(options, work: str, libs: list) -> dict:
    base = {"work": work, "forwards": options.forwards, "cold_reps": options.cold_reps if options.cold else 0}
    made = run_child({**base, "role": "make", "lib": "torch"})
    prepared = {lib: run_child({**base, "role": "prepare_disk", "lib": lib}) for lib in libs}
    configs = [(role, lib) for role in ("load", "cpu_offload", "disk_offload", "read") for lib in libs]
    configs.append(("plain", "torch"))
    runs: dict = {f"{role}/{lib}": [] for role, lib in configs}
    errors: dict = {}
    for rnd in range(options.rounds):
        order = configs if rnd % 2 == 0 else [(r, lib) for r, lib in reversed(configs)]
        for role, lib in order:
            name = f"{role}/{lib}"
            if name in errors:
                continue
            if role in ("load", "disk_offload", "read", "plain", "cpu_offload"):
                _warm([os.path.join(work, "ckpt")] + [os.path.join(work, f"offload-{x}") for x in libs])
            try:
                runs[name].append(run_child({**base, "role": role, "lib": lib, "tag": str(rnd)}))
            except Exception as exc:  # keep measuring the others; report what went wrong
                errors[name] = f"{type(exc).__name__}: {exc}"
            finally:
                if role == "load":
                    shutil.rmtree(os.path.join(work, f"load-{lib}-{rnd}"), ignore_errors=True)
        print(f"round {rnd + 1}/{options.rounds} done", file=sys.stderr, flush=True)
    return {"model": made, "prepared": prepared, "runs": runs, "errors": errors}


def _med(values):
    return statistics.median(values) if values else None


def summarize(result: dict, libs: list) -> dict:
    runs = result["runs"]

    def pooled(name, key):
        return [v for r in runs.get(name, []) for v in (r.get(key) or [])]

    def each(name, key):
        return [r[key] for r in runs.get(name, []) if r.get(key) is not None]

    s: dict = {"libs": {}}
    for lib in libs:
        load = runs.get(f"load/{lib}", [])
        peaks = [r["peak_anon"] for r in load if r.get("peak_anon")]
        deltas = [r["peak_anon"] - r["baseline"]["RssAnon"] for r in load if r.get("peak_anon")]
        s["libs"][lib] = {
            "peak_anon": _med(peaks), "peak_anon_max": max(peaks) if peaks else None,
            "peak_rss": _med(each(f"load/{lib}", "peak_rss")),
            "baseline_anon": _med([r["baseline"]["RssAnon"] for r in load]),
            "peak_minus_baseline": _med(deltas), "peak_minus_baseline_max": max(deltas) if deltas else None,
            "after_anon": _med([r["after"]["RssAnon"] for r in load]),
            "hwm_upper_bound": _med([r["after"]["VmHWM"] for r in load]),
            "hwm_reset": all(r.get("hwm_reset") for r in load),
            "load_s": _med(each(f"load/{lib}", "load_s")),
            "offload_folder_bytes": _med(each(f"load/{lib}", "offload_folder_bytes")),
            "device_map": load[0]["device_map"] if load else None,
            "samples_in_window": min(each(f"load/{lib}", "samples_in_window"), default=None),
            "dispatched_forward": pooled(f"load/{lib}", "forward_s"),
            "cpu_offload_forward": pooled(f"cpu_offload/{lib}", "forward_s"),
            "disk_offload_forward": pooled(f"disk_offload/{lib}", "forward_s"),
            "disk_offload_cold_forward": pooled(f"disk_offload/{lib}", "cold_forward_s"),
            "read": pooled(f"read/{lib}", "read_s"),
            "cold_read": pooled(f"read/{lib}", "cold_read_s"),
            "read_bytes": _med(each(f"read/{lib}", "bytes")),
            "max_abs_diff": max([r["max_abs_diff"] for role in ("load", "cpu_offload", "disk_offload")
                                 for r in runs.get(f"{role}/{lib}", [])], default=None),  # fmt: skip
            "write_s": result["prepared"][lib].get("write_s"),
        }  # fmt: skip
    s["plain_forward"] = pooled("plain/torch", "forward_s")
    # Ours / accelerate per round (the two subprocesses ran next to each other): robust to load drifting
    # over the run. The median of these is reported beside the ratio of pooled medians.
    s["paired"] = {}
    if "accelerate" in libs:
        for role, key in (("load", "forward_s"), ("cpu_offload", "forward_s"), ("disk_offload", "forward_s"),
                          ("disk_offload", "cold_forward_s")):  # fmt: skip
            pairs = [_med(o[key]) / _med(a[key]) for o, a in zip(runs.get(f"{role}/ours", []), runs.get(f"{role}/accelerate", []))
                     if o.get(key) and a.get(key)]  # fmt: skip
            s["paired"][f"{role}:{key}"] = pairs
    s["child_wall_s"] = {name: _med([r["wall_s"] for r in rs]) for name, rs in runs.items() if rs}
    return s


def _ms(values) -> str:
    return f"{1000 * statistics.median(values):.1f} ({1000 * min(values):.1f})" if values else "-"


def _mb(value) -> str:
    return f"{value / 1e6:.0f}" if value is not None else "-"


def markdown(result: dict, s: dict, libs: list) -> str:
    L = s["libs"]
    head = "| | " + " | ".join(libs) + " |"
    sep = "|---|" + "---|" * len(libs)
    out = [f"Model: {result['model']['bytes'] / 2**20:.1f} MiB fp32 in {(DEPTH + SHARD_BLOCKS - 1) // SHARD_BLOCKS} "
           f"safetensors shards; budget max_memory={{'cpu': '{BUDGET}'}}.", "",
           "Loading under the budget (MB = 10^6 bytes; medians over runs, max in brackets)", "", head, sep]  # fmt: skip
    rows = [
        ("anonymous memory before the call (imports + meta model)", lambda d: _mb(d["baseline_anon"])),
        ("peak anonymous memory during the call", lambda d: f"{_mb(d['peak_anon'])} ({_mb(d['peak_anon_max'])})"),
        ("peak RssAnon + RssFile during the call (mapped checkpoint pages count here)", lambda d: _mb(d["peak_rss"])),
        ("peak minus before (what loading adds)", lambda d: f"{_mb(d['peak_minus_baseline'])} ({_mb(d['peak_minus_baseline_max'])})"),
        ("anonymous memory after the call", lambda d: _mb(d["after_anon"])),
        ("VmHWM after the call, reset before it (exact peak RSS: anon + file)", lambda d: _mb(d["hwm_upper_bound"])),
        ("load time (s)", lambda d: f"{d['load_s']:.2f}" if d["load_s"] is not None else "-"),
        ("bytes written to offload_folder (MB)", lambda d: _mb(d["offload_folder_bytes"])),
        ("RssAnon samples in the window (fewest)", lambda d: str(d["samples_in_window"])),
    ]  # fmt: skip
    for label, fn in rows:
        out.append(f"| {label} | " + " | ".join(fn(L[lib]) for lib in libs) + " |")
    if not all(L[lib]["hwm_reset"] for lib in libs):
        out.append("\n/proc/self/clear_refs could not reset VmHWM: its row is the process's peak RSS so far.")
    for lib in libs:
        dm = L[lib]["device_map"] or {}
        kinds = {}
        for k, v in dm.items():
            kinds.setdefault(v, []).append(k)
        out.append(f"\n{lib} device map: " + "; ".join(f"{v}: {len(ks)} ({', '.join(ks[:3])}{', ...' if len(ks) > 3 else ''})" for v, ks in kinds.items()))  # fmt: skip

    out += [
        "",
        f"Forward latency, batch {BATCH}x{WIDTH}, ms: median (min) over every timed forward",
        "",
        head,
        sep,
    ]
    for label, key in (
        ("load_checkpoint_and_dispatch result (cpu + disk blocks)", "dispatched_forward"),
        ('cpu_offload(model, execution_device="cpu")', "cpu_offload_forward"),
        ('disk_offload(model, dir, execution_device="cpu"), warm page cache', "disk_offload_forward"),
        ("disk_offload, cold page cache (dropped before each forward)", "disk_offload_cold_forward"),
        ("read the offload folder's files sequentially, warm", "read"),
        ("same, cold page cache", "cold_read"),
    ):
        out.append(f"| {label} | " + " | ".join(_ms(L[lib][key]) for lib in libs) + " |")
    out.append("| plain model in RAM, no hooks (same for both) | " + " | ".join(_ms(s["plain_forward"]) for _ in libs) + " |")  # fmt: skip

    out += [
        "",
        "| ratio | value: pooled medians (median of per-round pairs) | target | met |",
        "|---|---|---|---|",
    ]
    for lib in libs:
        d = L[lib]
        for label, num, den in (("disk-offload forward throughput / sequential read, warm", "read", "disk_offload_forward"),
                                ("disk-offload forward throughput / sequential read, cold", "cold_read", "disk_offload_cold_forward")):  # fmt: skip
            if d[num] and d[den]:
                out.append(f"| {lib}: {label} | {_med(d[num]) / _med(d[den]):.2f} | - | - |")
    if "accelerate" in L and "ours" in L:
        o, a = L["ours"], L["accelerate"]
        if o["peak_minus_baseline"] is not None:
            out.append(f"| load peak added, ours (MB) | {_mb(o['peak_minus_baseline'])} | < 230 | {'yes' if o['peak_minus_baseline'] < 230e6 else 'NO'} |")  # fmt: skip
            out.append(f"| load peak absolute, ours (MB) | {_mb(o['peak_anon'])} | (< 230) | {'yes' if o['peak_anon'] < 230e6 else 'NO'} |")  # fmt: skip
            if a["peak_minus_baseline"]:
                out.append(f"| load peak added, ours / accelerate | {o['peak_minus_baseline'] / a['peak_minus_baseline']:.2f} | - | - |")  # fmt: skip
        for label, key, pair in (
            ("dispatched (cpu+disk) forward", "dispatched_forward", "load:forward_s"),
            ("cpu_offload forward", "cpu_offload_forward", "cpu_offload:forward_s"),
            ("disk_offload forward, warm", "disk_offload_forward", "disk_offload:forward_s"),
            ("disk_offload forward, cold", "disk_offload_cold_forward", "disk_offload:cold_forward_s"),
        ):
            if o[key] and a[key]:
                r = _med(o[key]) / _med(a[key])
                paired = s["paired"].get(pair)
                p = f" ({_med(paired):.2f})" if paired else ""
                out.append(
                    f"| {label}: ours / accelerate | {r:.2f}{p} | <= 1.0 | {'yes' if r <= 1.0 else 'NO'} |"
                )
    out.append("")
    for lib in libs:
        d = L[lib]
        out.append(f"{lib}: outputs match the plain model: max |diff| {d['max_abs_diff']:.2e} "
                   f"({'ok' if d['max_abs_diff'] is not None and d['max_abs_diff'] <= ATOL else 'FAIL'}); "
                   f"disk_offload wrote its folder ({_mb(d['read_bytes'])} MB) in {d['write_s']:.2f} s.")  # fmt: skip
    walls = ", ".join(f"{name} {sec:.1f}" for name, sec in s["child_wall_s"].items())
    out.append(f"Subprocess wall time, s (median): {walls}.")
    for name, error in result["errors"].items():
        out.append(f"\nfailed: {name}: {error}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="fresh subprocesses per configuration")
    parser.add_argument(
        "--forwards", type=int, default=4, help="timed forwards per subprocess (after a warm-up)"
    )
    parser.add_argument("--cold-reps", type=int, default=2, help="cold-cache forwards / reads per subprocess")
    parser.add_argument("--no-cold", dest="cold", action="store_false", help="skip dropping the page cache")
    parser.add_argument("--no-accelerate", action="store_true", help="skip accelerate even if installed")
    parser.add_argument("--json", metavar="PATH", help="also write every sample here")
    parser.add_argument(
        "--profile", metavar="ROLE:LIB", help="cProfile one child (e.g. disk_offload:ours) and exit"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)

    if options.child:
        spec = json.loads(options.child)
        result = child(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0

    try:
        import accelerate

        with_accelerate = not options.no_accelerate
        accelerate_version = accelerate.__version__
    except ImportError:
        with_accelerate, accelerate_version = False, None
        print("accelerate is not importable here: its rows are skipped.", file=sys.stderr)
    libs = ["ours"] + (["accelerate"] if with_accelerate else [])
    if options.cold and not _drop_caches():
        print("cannot drop the page cache (not root?): cold rows are skipped.", file=sys.stderr)
        options.cold = False

    with tempfile.TemporaryDirectory(prefix="offload-bench-") as work:
        if options.profile:
            role, lib = options.profile.split(":")
            base = {"work": work, "forwards": options.forwards, "cold_reps": 0}
            run_child({**base, "role": "make", "lib": "torch"})
            if role in ("disk_offload", "read"):
                run_child({**base, "role": "prepare_disk", "lib": lib})
            run_child({**base, "role": role, "lib": lib, "tag": "p", "profile": True})
            return 0
        start = time.perf_counter()
        result = measure(options, work, libs)
        elapsed = time.perf_counter() - start

    summary = summarize(result, libs)
    import torch

    versions = f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    if accelerate_version:
        versions += f", accelerate {accelerate_version}"
    print(f"Big-model loading and offload ({versions}; {options.rounds} rounds, {elapsed:.0f} s)\n")
    print(markdown(result, summary, libs))
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"versions": versions, **result, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
