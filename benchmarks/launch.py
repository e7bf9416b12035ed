"""Launch latency and log relay of notebook_accel's launcher, against baselines measured in the same run.

Every configuration does the same work on each rank: join a gloo process group on 127.0.0.1,
all_reduce one tensor, leave. Configurations run round-robin (not one block after another) so
that load from other programs on the machine spreads over all of them alike.

The forkserver's rows: "first" is this process's first launch, the server started by it; "5 s
after import, in a kernel" is a fresh real kernel (jupyter_client) that imported torch, then
`from notebook_accel import notebook_launcher` (which starts the server booting, launch/prewarm.py),
stays idle 5 s and launches; "NOTEBOOK_ACCEL_PREWARM=0" the same with the early start off. Those
samples run in the same rounds as the others.

A typical training function's launches (launch_training.py) follow: --training-reps, --no-training,
--only-training.

    python benchmarks/launch.py [--reps 10] [--spawn-reps 3] [--prewarm-reps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

import timing  # benchmarks/timing.py: run as `python benchmarks/NAME.py`
import torch  # the parent imports torch once, as a notebook kernel would; it runs no torch op

LAUNCH_TIMEOUT_S = 120
PREWARM_WAIT_S = 5.0  # the "5 s after the import"


# -- the work, one function per way of launching ----------------------------------------------
def raw_work(index: int, world: int, port: int) -> None:
    # First thing: a forked child must not use a multi-threaded OpenMP pool (MACHINE-NOTES "fork hang").
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world, t
    dist.destroy_process_group()


def ours_work():
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()  # joins the gloo group the launcher described
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == state.num_processes, t
    return state.process_index


def accelerate_work(report_dir: str, cpu: bool) -> None:
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState(cpu=cpu)
    t = torch.ones(1)
    if dist.is_initialized():
        dist.all_reduce(t)
    # accelerate's launcher returns nothing: each rank writes down what it saw.
    seen = {
        "process_index": state.process_index,
        "num_processes": state.num_processes,
        "distributed_type": str(state.distributed_type),
        "group": dist.is_initialized(),
        "sum": t.item(),
    }
    with open(os.path.join(report_dir, f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)


def relay_work(lines: int) -> int:
    from notebook_accel import PartialState

    rank = PartialState().process_index
    for i in range(lines):
        print(f"rank {rank} line {i}")
    return lines


# -- launching -------------------------------------------------------------------------------
def _port() -> int:
    from notebook_accel.launch.plan import free_port

    return free_port()


def launch_raw(world: int, method: str) -> None:
    import torch.multiprocessing as tmp

    tmp.start_processes(raw_work, args=(world, _port()), nprocs=world, join=True, start_method=method)


def launch_ours(world: int, method: str) -> None:
    from notebook_accel import notebook_launcher

    assert notebook_launcher(ours_work, num_processes=world, use_port="auto", start_method=method) == list(
        range(world)
    )


def launch_accelerate(world: int, cpu: bool, seen: list, said: set) -> None:
    from accelerate import notebook_launcher as accelerate_launcher

    with tempfile.TemporaryDirectory() as report_dir:
        # It prints a banner in the parent; keep it out of the table and report it once.
        banner = io.StringIO()
        with contextlib.redirect_stdout(banner):
            accelerate_launcher(
                accelerate_work, args=(report_dir, cpu), num_processes=world, use_port=str(_port())
            )
        said.update(line for line in banner.getvalue().splitlines() if line.strip())
        for name in sorted(os.listdir(report_dir)):
            with open(os.path.join(report_dir, name)) as f:
                seen.append(json.load(f))


def timed(call) -> float:
    return timing.timed(call, LAUNCH_TIMEOUT_S)


# -- the forkserver started early, in a real kernel: one fresh kernel per sample ---------------
# Two cells, as in a notebook: the import cell, then PREWARM_WAIT_S with the kernel idle (the
# server boots and, once the cell has ended, the launch path is imported: jupyter/ready.py), then
# the launch cell.
KERNEL_IMPORT_CELL = """\
import json as _j, os as _o, sys as _s, time as _t, psutil as _p
_s.path.insert(0, {bench!r})
_t0 = _t.perf_counter()
from notebook_accel import notebook_launcher  # a notebook's import cell: the server starts booting here
_t1 = _t.perf_counter()
_children = len(_p.Process().children())
"""
KERNEL_LAUNCH_CELL = """\
import launch as _bench
from notebook_accel.launch.warm import WarmServer as _W
_t2 = _t.perf_counter()
_W.get()  # the launch's own first step: waits for the server (or starts it, with prewarm off)
_t2b = _t.perf_counter()
_bench.launch_ours({world}, "forkserver")
_t3 = _t.perf_counter()
_bench.launch_ours({world}, "forkserver")
_t4 = _t.perf_counter()
_raw = []
for _ in range(3):  # the baseline where the launch runs: a fork of this kernel, torch's own launcher
    _t5 = _t.perf_counter()
    _bench.launch_raw({world}, "fork")
    _raw.append(_t.perf_counter() - _t5)
_t.sleep(1.0)  # the server forks its spares again once idle
_server = _p.Process(_W._instance.proc.pid)
_m = _server.memory_full_info()
_sp = [c.memory_full_info() for c in _server.children() if c.name() == "accel-spare"]
print(_j.dumps({{"import_s": _t1 - _t0, "children_after_import": _children, "launch_s": _t3 - _t2,
                 "server_wait_s": _t2b - _t2, "raw_fork_s": sorted(_raw)[1],
                 "second_launch_s": _t4 - _t3, "server_pss": _m.pss, "server_uss": _m.uss, "server_rss": _m.rss,
                 "spares": len(_sp), "spares_pss": sum(m.pss for m in _sp), "spares_uss": sum(m.uss for m in _sp)}}))
"""


def kernel_sample(world: int, prewarm: str, details: list) -> float:
    """In a fresh real kernel that imported torch: `from notebook_accel import notebook_launcher`
    (NOTEBOOK_ACCEL_PREWARM=`prewarm`), PREWARM_WAIT_S idle, then, in the next cell, a timed
    forkserver launch (the sample), a second one, and the server's memory."""
    from launch_training import two_cells_in_a_fresh_kernel

    env = {**os.environ, "NOTEBOOK_ACCEL_PREWARM": prewarm, "NOTEBOOK_ACCEL_WIDGETS": "0"}
    bench = os.path.dirname(os.path.abspath(__file__))
    first, second = KERNEL_IMPORT_CELL.format(bench=bench), KERNEL_LAUNCH_CELL.format(world=world)
    sample = two_cells_in_a_fresh_kernel(env, first, second, PREWARM_WAIT_S, LAUNCH_TIMEOUT_S)
    details.append(sample)
    return sample["launch_s"]


def accelerate_available() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


# -- the benchmark ---------------------------------------------------------------------------
def measure_launches(ranks: list, reps: int, spawn_reps: int, with_accelerate: bool, prewarm_reps: int) -> dict:
    configs = {}  # name -> (call, repetitions)
    in_kernels: dict = {"1": [], "0": []}  # NOTEBOOK_ACCEL_PREWARM -> each kernel sample's details
    accelerate_seen: dict = {}
    accelerate_said: set = set()
    for world in ranks:
        configs[f"raw fork/{world}"] = (lambda w=world: launch_raw(w, "fork"), reps)
        configs[f"ours fork/{world}"] = (lambda w=world: launch_ours(w, "fork"), reps)
        configs[f"ours forkserver warm/{world}"] = (lambda w=world: launch_ours(w, "forkserver"), reps)
        if world == ranks[0]:
            for value, label in (("1", "5 s after import, in a kernel"), ("0", "5 s after import, in a kernel, NOTEBOOK_ACCEL_PREWARM=0")):
                configs[f"ours forkserver {label}/{world}"] = (
                    lambda w=world, v=value: kernel_sample(w, v, in_kernels[v]),
                    prewarm_reps,
                )
        configs[f"raw spawn/{world}"] = (lambda w=world: launch_raw(w, "spawn"), spawn_reps)
        configs[f"ours spawn/{world}"] = (lambda w=world: launch_ours(w, "spawn"), spawn_reps)
        if with_accelerate:
            for cpu in (False, True):
                seen = accelerate_seen.setdefault(f"{world}/cpu={cpu}", [])
                name = f"accelerate{' cpu=True' if cpu else ''}/{world}"
                configs[name] = (
                    lambda w=world, c=cpu, s=seen: launch_accelerate(w, c, s, accelerate_said),
                    reps,
                )

    samples = {name: [] for name in configs}
    errors = {}
    # The forkserver's first launch starts the server (interpreter + torch import): reported apart.
    first = {
        f"ours forkserver first/{w}": [timed(lambda w=w: launch_ours(w, "forkserver"))] for w in ranks[:1]
    }
    for rep in range(max(reps, spawn_reps, prewarm_reps)):
        for name, (call, count) in configs.items():
            if rep >= count or name in errors:
                continue
            try:
                samples[name].append(timed(call))
            except BaseException as exc:  # keep measuring the others; report what went wrong
                if isinstance(exc, KeyboardInterrupt):
                    raise
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"round {rep + 1} done", file=sys.stderr, flush=True)
    for name, values in first.items():
        samples[name] = values
    for key in accelerate_seen:
        accelerate_seen[key] = _distinct(accelerate_seen[key])
    return {
        "samples": samples,
        "errors": errors,
        "accelerate_seen": accelerate_seen,
        "accelerate_said": sorted(accelerate_said),
        "in_kernels": in_kernels,
    }


def _distinct(records: list) -> list:
    """Each different record once, with how many rank-runs reported it."""
    out: list = []
    for r in records:
        match = next((o for o in out if o["seen"] == r), None)
        if match is None:
            out.append({"seen": r, "reports": 1})
        else:
            match["reports"] += 1
    return out


def measure_relay(world: int, lines: int) -> dict:
    from notebook_accel.launch import ListSink, notebook_launcher

    sink = ListSink()
    start = time.perf_counter()
    notebook_launcher(relay_work, args=(lines,), num_processes=world, use_port="auto", sinks=[sink])
    elapsed = time.perf_counter() - start
    complete = all(sink.lines(r) == [f"rank {r} line {i}" for i in range(lines)] for r in range(world))
    total = world * lines
    return {
        "ranks": world,
        "lines_per_rank": lines,
        "seconds": elapsed,
        "lines_per_s": total / elapsed,
        "complete_and_ordered": complete,
        "received": sum(len(sink.lines(r)) for r in range(world)),
    }


# -- a large return value: 1 GiB from rank 0, against the same bytes through a socket pair ------
def large_result_work(nbytes: int):
    if os.environ["RANK"] != "0":
        return None
    return torch.ones(nbytes // 4)  # float32


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def large_result_sample(kind: str, nbytes: int) -> dict:
    """One sample, in a fresh interpreter (so ru_maxrss is this sample's peak)."""
    import resource
    import socket

    before = _rss()
    start = time.perf_counter()
    if kind == "socket pair":
        a, b = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            a.sendall(torch.ones(nbytes // 4).numpy())
            os._exit(0)
        buf, got = bytearray(nbytes), 0
        view = memoryview(buf)
        while got < nbytes:
            got += b.recv_into(view[got:])
        os.waitpid(pid, 0)
        ok = got == nbytes
    else:
        from notebook_accel import notebook_launcher

        out = notebook_launcher(large_result_work, (nbytes,), num_processes=2, use_port="auto")
        ok = out[1] is None and out[0].numel() * 4 == nbytes and bool(out[0][-1] == 1)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_added": peak - before, "ok": ok}


def measure_large_result(nbytes: int, reps: int) -> dict:
    import subprocess

    samples: dict = {"socket pair": [], "notebook_launcher": []}
    for _ in range(reps):
        for kind in samples:
            code = (
                f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import launch; "
                f"print(json.dumps(launch.large_result_sample({kind!r}, {nbytes})))"
            )
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            samples[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return samples


def large_result_markdown(samples: dict, nbytes: int) -> str:
    med = {k: statistics.median(s["seconds"] for s in v) for k, v in samples.items()}
    peak = {k: max(s["peak_added"] for s in v) for k, v in samples.items()}
    rows = [
        f"| {nbytes / 2**30:.1f} GiB from rank 0 | runs | median (s) | parent's peak added memory |",
        "|---|---|---|---|",
    ]
    for kind, values in samples.items():
        ok = "" if all(s["ok"] for s in values) else " (WRONG RESULT)"
        rows.append(f"| {kind}{ok} | {len(values)} | {med[kind]:.2f} | {peak[kind] / nbytes:.2f}x |")
    ratio = med["notebook_launcher"] / med["socket pair"]
    rows.append(
        f"\nTime ratio notebook_launcher / socket pair: {ratio:.2f} (target <= 1.5); the launcher's "
        f"peak added memory {peak['notebook_launcher'] / nbytes:.2f}x the result (target <= 1.2)."
    )
    return "\n".join(rows)


def summarize(result: dict, ranks: list) -> dict:
    med = {name: statistics.median(v) for name, v in result["samples"].items() if v}
    ratios = []
    for w in ranks:
        for num, den, target in (
            ("ours fork", "raw fork", 1.2),
            ("ours forkserver warm", "raw fork", 1.3),
            ("ours forkserver 5 s after import, in a kernel", "raw fork", 1.3),
            ("ours spawn", "raw spawn", 1.1),
            ("accelerate", "raw fork", None),
            ("accelerate cpu=True", "raw fork", None),
        ):
            a, b = med.get(f"{num}/{w}"), med.get(f"{den}/{w}")
            if a is not None and b is not None:
                ratios.append({"ranks": w, "ratio": f"{num} / {den}", "value": a / b, "target": target})
    paired = [k["launch_s"] / k["raw_fork_s"] for k in result["in_kernels"]["1"] if k.get("raw_fork_s")]
    if paired:  # the same kernel's own fork as the baseline: a kernel forks slower than this script
        ratios.append({
            "ranks": ranks[0], "value": statistics.median(paired), "target": 1.3,
            "ratio": "ours forkserver 5 s after import / raw fork, in the same kernel (median of per-kernel ratios)",
        })  # fmt: skip
    return {"medians": med, "ratios": ratios}


def markdown(result: dict, summary: dict, relay: dict) -> str:
    rows = ["| configuration | ranks | runs | median (s) | min (s) |", "|---|---|---|---|---|"]
    for name, values in result["samples"].items():
        if values:
            label, world = name.rsplit("/", 1)
            rows.append(
                f"| {label} | {world} | {len(values)} | {statistics.median(values):.3f} | {min(values):.3f} |"
            )
    rows += ["", "| ratio (medians) | ranks | value | target | met |", "|---|---|---|---|---|"]
    for r in summary["ratios"]:
        target = f"<= {r['target']}" if r["target"] else "-"
        met = ("yes" if r["value"] <= r["target"] else "NO") if r["target"] else "-"
        rows.append(f"| {r['ratio']} | {r['ranks']} | {r['value']:.3f} | {target} | {met} |")
    if any(result["in_kernels"].values()):
        rows.append("\n" + kernel_markdown(result["in_kernels"]))
    for name, error in result["errors"].items():
        rows.append(f"\nfailed: {name}: {error}")
    if result["accelerate_said"]:
        rows.append(f"\naccelerate's launcher printed: {result['accelerate_said']}")
    for key, seen in result["accelerate_seen"].items():
        world, cpu = key.split("/")
        for item in seen:
            rows.append(
                f"\naccelerate, {world} ranks launched, PartialState({cpu}): {item['reports']} rank-runs saw {item['seen']}"
            )
    rows += [
        "",
        "| log relay | value |",
        "|---|---|",
        f"| ranks x lines | {relay['ranks']} x {relay['lines_per_rank']} |",
        f"| lines received | {relay['received']} |",
        f"| complete, in per-rank order | {'yes' if relay['complete_and_ordered'] else 'NO'} |",
        f"| wall time (s) | {relay['seconds']:.2f} |",
        f"| lines/s | {relay['lines_per_s']:,.0f} |",
    ]
    return "\n".join(rows)


def kernel_markdown(in_kernels: dict) -> str:
    def mm(samples: list, key: str, scale: float = 1.0, digits: int = 3) -> str:
        values = [s[key] * scale for s in samples]
        if not values:
            return "-"
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    mib = 1 / 2**20
    on, off = in_kernels["1"], in_kernels["0"]
    rows = [
        f"| in fresh kernels (median (min-max)) | NOTEBOOK_ACCEL_PREWARM=1 ({len(on)}) | =0 ({len(off)}) |",
        "|---|---|---|",
        f"| `from notebook_accel import notebook_launcher` (s) | {mm(on, 'import_s')} | {mm(off, 'import_s')} |",
        "| child processes of the kernel right after it | "
        f"{sorted({s['children_after_import'] for s in on})} | {sorted({s['children_after_import'] for s in off})} |",
        f"| forkserver launch {PREWARM_WAIT_S:g} s after it (s) | {mm(on, 'launch_s')} | {mm(off, 'launch_s')} |",
        f"| of which waiting for the server to boot (s) | {mm(on, 'server_wait_s')} | {mm(off, 'server_wait_s')} |",
        f"| the next forkserver launch (s) | {mm(on, 'second_launch_s')} | {mm(off, 'second_launch_s')} |",
        f"| a raw fork launch in the same kernel, median of 3 (s) | {mm(on, 'raw_fork_s')} | {mm(off, 'raw_fork_s')} |",
        f"| the idle server's PSS after them (MiB) | {mm(on, 'server_pss', mib, 1)} | {mm(off, 'server_pss', mib, 1)} |",
        f"| its USS (MiB) | {mm(on, 'server_uss', mib, 1)} | {mm(off, 'server_uss', mib, 1)} |",
        f"| its RSS (MiB) | {mm(on, 'server_rss', mib, 1)} | {mm(off, 'server_rss', mib, 1)} |",
        f"| its idle spares (ranks forked ahead) | {mm(on, 'spares', 1, 0)} | {mm(off, 'spares', 1, 0)} |",
        f"| their PSS, all together (MiB) | {mm(on, 'spares_pss', mib, 1)} | {mm(off, 'spares_pss', mib, 1)} |",
        f"| their USS, all together (MiB) | {mm(on, 'spares_uss', mib, 1)} | {mm(off, 'spares_uss', mib, 1)} |",
    ]
    return "\n".join(rows)


def training_markdown(options) -> str:
    """The rows of launch_training.py: a typical training function, script and kernel, 2 and 4 ranks."""
    import launch_training

    with_accelerate = not options.no_accelerate and accelerate_available()
    result = launch_training.measure(options.ranks, options.training_reps, with_accelerate)
    head = "Launching a typical training function (model, optimizer, loader, DDP through prepare, one step)\n\n"
    return head + launch_training.markdown(result, options.ranks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=10, help="runs of each fast configuration")
    parser.add_argument("--spawn-reps", type=int, default=3, help="runs of each spawn configuration")
    parser.add_argument("--prewarm-reps", type=int, default=5, help="fresh kernels per early-start setting")
    parser.add_argument("--no-large-result", action="store_true", help="skip the large-result row")
    parser.add_argument("--lines", type=int, default=50_000, help="lines per rank in the log-relay check")
    parser.add_argument("--no-accelerate", action="store_true", help="skip accelerate even if installed")
    parser.add_argument("--json", metavar="PATH", help="also write every sample and ratio here")
    parser.add_argument("--large-result-gib", type=float, default=1.0, help="size of the large-result row")
    parser.add_argument("--large-result-reps", type=int, default=3)
    parser.add_argument("--only-large-result", action="store_true", help="measure only the large-result row")
    parser.add_argument("--training-reps", type=int, default=3, help="fresh processes per training-launch row")
    parser.add_argument("--no-training", action="store_true", help="skip the training-function rows")
    parser.add_argument("--only-training", action="store_true", help="measure only the training-function rows")
    options = parser.parse_args(argv)
    if options.only_training:
        print(training_markdown(options))
        return 0
    nbytes = int(options.large_result_gib * 2**30) // 4 * 4
    if options.only_large_result:
        print(large_result_markdown(measure_large_result(nbytes, options.large_result_reps), nbytes))
        return 0

    load0 = os.getloadavg()
    with_accelerate = not options.no_accelerate and accelerate_available()
    if not with_accelerate:
        print("accelerate is not importable here: its rows are skipped.", file=sys.stderr)
    result = measure_launches(options.ranks, options.reps, options.spawn_reps, with_accelerate, options.prewarm_reps)
    relay = measure_relay(4, options.lines)
    summary = summarize(result, options.ranks)
    versions = f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    if with_accelerate:
        import accelerate

        versions += f", accelerate {accelerate.__version__}"
    load = f"load average (1 min) {load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} after the launches"
    print(f"Launch latency ({versions}; {load})\n")
    print(markdown(result, summary, relay))
    if not options.no_training:
        print("\n" + training_markdown(options))
    large = {}
    if not options.no_large_result:
        large = measure_large_result(nbytes, options.large_result_reps)
        print("\n" + large_result_markdown(large, nbytes))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                {"versions": versions, **result, **summary, "relay": relay, "large_result": large},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
