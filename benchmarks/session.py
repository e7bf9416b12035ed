"""Start time and cell round trip of notebook_accel's interactive sessions, against ipyparallel
measured in the same run.

Start time: every sample is a fresh Python process (this script with --child), so that imports
count as they would in a new kernel. Each one times `import torch`, the library's import and the
start of 4 workers that each have torch imported and a gloo process group up: our `Session(4,
cpu=True).start()` (fork, forkserver, spawn), and ipyparallel's `Cluster(n=4)` engines, then
`init_process_group("gloo")` on them. Configurations run round-robin, the order reversed every other
round. Round trip: one process holds a fork session and an ipyparallel cluster (both with torch and
a 4-rank gloo group) and times trivial cells on both, in alternating blocks.

    python benchmarks/session.py [--reps 4] [--floor-reps 2] [--calls 200] [--warmup 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

WORLD = 4
CHILD_TIMEOUT_S = 150  # one child (start, check, stop); the parent kills its session after this
STEP_TIMEOUT_S = 90  # one blocking step inside a child (SIGALRM)
CLUSTER_EXIT_WAIT_S = 15.0  # how long ipyparallel's processes get to exit after stop_cluster_sync
RESULT = "SESSION-BENCH-RESULT "
OURS_METHODS = ("fork", "forkserver", "spawn")


# -- helpers used in the children ---------------------------------------------------------------
class _Timeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Timeout(f"a step took more than {STEP_TIMEOUT_S} s")


def _guarded(call):
    """call() under SIGALRM, so that a hang becomes an error rather than a stuck benchmark."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(STEP_TIMEOUT_S)
    try:
        return call()
    finally:
        signal.alarm(0)


def _quiet(*_line) -> None:
    """on_output for our sessions: worker output is dropped."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(result: dict) -> None:
    print(RESULT + json.dumps(result), flush=True)


def _ours_check(s) -> None:
    """Untimed: every rank sums over the group and knows its own rank."""
    s.run_cell(
        "import torch, torch.distributed as dist\n"
        "_t = torch.ones(1); dist.all_reduce(_t); assert _t.item() == dist.get_world_size() == 4\n"
        "_rank = dist.get_rank()",
        timeout=60, check=True,
    )  # fmt: skip
    ranks = [s.pull("_rank", rank=r) for r in range(WORLD)]
    assert ranks == list(range(WORLD)), ranks


def _ours_start(method: str):
    from notebook_accel.session import Session

    s = Session(WORLD, start_method=method, cpu=True, on_output=_quiet)
    s.start(timeout=STEP_TIMEOUT_S)
    return s


# ipyparallel's engines: the same state our workers reach (torch imported, a gloo group of 4).
def _engine_join(port: int, rank: int, world: int) -> int:
    import torch  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return rank


def _engine_check() -> tuple:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _ipp_start():
    """A 4-engine cluster and its client; (cluster, client, seconds until engines up, seconds of
    the torch + process group set-up on them)."""
    import logging

    import ipyparallel as ipp

    start = time.perf_counter()
    cluster = ipp.Cluster(n=WORLD, log_level=logging.ERROR)
    rc = cluster.start_and_connect_sync()
    try:
        rc.wait_for_engines(WORLD, timeout=STEP_TIMEOUT_S, interactive=False)
        up = time.perf_counter()
        view = rc[:]
        view.scatter("rank", list(range(WORLD)), flatten=True, block=True)  # rank = engine's place
        ranks = view.apply_async(_engine_join, _free_port(), ipp.Reference("rank"), WORLD).get(
            timeout=STEP_TIMEOUT_S
        )
        ready = time.perf_counter()
    except BaseException:
        _ipp_stop(cluster, rc, _descendants())
        raise
    assert sorted(ranks) == list(range(WORLD)), ranks
    seen = view.apply_async(_engine_check).get(timeout=60)  # untimed
    assert sorted(seen) == [(r, float(WORLD)) for r in range(WORLD)], seen
    return cluster, rc, up - start, ready - up


def _descendants() -> list:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append((p.pid, p.create_time(), " ".join(p.cmdline()[:4])))
        except psutil.Error:
            pass
    return out


def _ipp_stop(cluster, rc, procs: list) -> dict:
    """Stop the cluster; wait for every process it had (controller, nannies, engines) to exit;
    SIGKILL by pid whatever is still there after CLUSTER_EXIT_WAIT_S. Says what it did."""
    import psutil

    start = time.perf_counter()
    try:
        rc.close()
    except Exception:
        pass
    error = None
    try:
        _guarded(cluster.stop_cluster_sync)
    except Exception as exc:  # still reap below
        error = f"{type(exc).__name__}: {exc}"
    stopped = time.perf_counter() - start

    def alive() -> list:
        left = []
        for pid, created, cmd in procs:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    left.append((pid, created, cmd))
            except psutil.Error:
                pass
        return left

    deadline = time.monotonic() + CLUSTER_EXIT_WAIT_S
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for pid, _created, cmd in alive():
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(f"{pid} {cmd}")
        except ProcessLookupError:
            pass
    return {"stop_s": stopped, "all_gone_s": time.perf_counter() - start, "killed": killed,
            "stop_error": error, "pids": [pid for pid, _, _ in procs]}  # fmt: skip


# -- the children ---------------------------------------------------------------------------------
def child_ours(method: str) -> None:
    t0 = time.perf_counter()
    import torch  # noqa: F401  (what a notebook kernel has done before the session starts)

    t1 = time.perf_counter()
    import notebook_accel.session  # noqa: F401

    t2 = time.perf_counter()
    s = _guarded(lambda: _ours_start(method))
    t3 = time.perf_counter()
    _guarded(lambda: _ours_check(s))
    _guarded(s.stop)
    out = {"import_torch": t1 - t0, "import_lib": t2 - t1, "start": t3 - t2}
    if method == "forkserver":  # the server is up now: a second start in the same kernel
        t4 = time.perf_counter()
        s = _guarded(lambda: _ours_start(method))
        out["start_warm"] = time.perf_counter() - t4
        _guarded(lambda: _ours_check(s))
        _guarded(s.stop)
    _report(out)


def child_ipp() -> None:
    t0 = time.perf_counter()
    import ipyparallel  # noqa: F401  (the kernel needs no torch here: only the engines use it)

    t1 = time.perf_counter()
    cluster, rc, up, ready = _ipp_start()
    procs = _descendants()
    stop = _ipp_stop(cluster, rc, procs)
    _report({"import_lib": t1 - t0, "engines_up": up, "torch_pg": ready, "stop": stop})


def child_roundtrip(calls: int, warmup: int, block: int) -> None:
    import torch  # noqa: F401

    s = _guarded(lambda: _ours_start("fork"))
    _guarded(lambda: _ours_check(s))
    cluster, rc, _, _ = _ipp_start()
    procs = _descendants()
    try:
        view, engine0 = rc[:], rc[0]

        def ours(ranks):
            def call():
                replies = s.run_cell("pass", ranks=ranks, timeout=30)
                assert all(r.ok for r in replies.values()), replies

            return call

        configs = {
            f"ours, {WORLD} ranks": ours(None),
            "ours, rank 0": ours([0]),
            f"ipyparallel, {WORLD} engines": lambda: view.execute("pass", block=True),
            "ipyparallel, engine 0": lambda: engine0.execute("pass", block=True),
        }
        samples = {name: [] for name in configs}

        def measure():
            for call in configs.values():
                for _ in range(warmup):
                    call()
            for i in range(0, calls, block):
                names = list(configs) if (i // block) % 2 == 0 else list(reversed(configs))
                for name in names:
                    for _ in range(min(block, calls - i)):
                        start = time.perf_counter()
                        configs[name]()
                        samples[name].append(time.perf_counter() - start)

        _guarded(measure)
    finally:
        _guarded(s.stop)
        stop = _ipp_stop(cluster, rc, procs)
    _report({"samples": samples, "stop": stop})


# -- the parent -----------------------------------------------------------------------------------
def run_child(args: list, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """Run this script with --child ARGS in its own session; its result, or {"error": ...}. The
    session is killed on a timeout, and anything left in it after the child exits is killed too."""
    import psutil

    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"error": f"timed out after {timeout} s", "stderr": err[-2000:]}
    left = []
    for p in psutil.process_iter():  # same session as the child (ipyparallel's start their own)
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == proc.pid:
                left.append(p.pid)
        except (OSError, psutil.Error):
            pass
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit code {proc.returncode}", "stderr": err[-2000:], "left": left}
    result = json.loads(lines[-1][len(RESULT) :])
    result["left"] = left
    result["stop_killed"] = _still_there(result.get("stop", {}).get("pids", []))
    return result


def _still_there(pids: list) -> list:
    """ipyparallel's processes the child saw, if any is still alive now: killed by pid."""
    import psutil

    killed = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and "ipyparallel" in " ".join(p.cmdline()):
                p.kill()
                killed.append(pid)
        except psutil.Error:
            pass
    return killed


def concurrent_torch_imports(n: int) -> float:
    """Wall time of n fresh interpreters that each `import torch`, all at once (spawn's floor). As
    in our spawned ranks: OMP_NUM_THREADS=1, no interpreter shutdown (about 0.5 s with torch), and
    each in its own session, which under Linux's autogroup scheduling is its own share of the CPU
    when other programs compete for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import os, torch; os._exit(0)"
    start = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True) for _ in range(n)
    ]
    for p in procs:
        try:
            p.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    if any(p.returncode for p in procs):
        raise RuntimeError("a bare `import torch` failed")
    return time.perf_counter() - start


def measure(reps: int, floor_reps: int, calls: int, warmup: int, block: int) -> dict:
    samples: dict = {}  # row -> {"a": [...], "b": [...]}
    child_wall: dict = {}  # configuration -> wall time of each child, start to exit (for the run time)
    notes: list = []
    errors: dict = {}

    def add(row: str, a: float, b=None) -> None:
        cell = samples.setdefault(row, {"a": [], "b": []})
        cell["a"].append(a)
        if b is not None:
            cell["b"].append(b)

    def ours(method: str):
        def go():
            r = run_child(["ours", method])
            if "error" not in r:
                label = {"fork": "fork", "forkserver": "forkserver, cold (first start in the kernel)",
                         "spawn": "spawn"}[method]  # fmt: skip
                add(f"ours {label}", r["start"], r["import_torch"] + r["import_lib"] + r["start"])
                add(TORCH_ONE, r["import_torch"])
                if "start_warm" in r:
                    add("ours forkserver, warm (second start in the same kernel)", r["start_warm"])
            return r

        return go

    def ipp():
        r = run_child(["ipp"])
        if "error" not in r:
            add("ipyparallel engines up", r["engines_up"], r["import_lib"] + r["engines_up"])
            add("ipyparallel engines up + torch + process group", r["engines_up"] + r["torch_pg"],
                r["import_lib"] + r["engines_up"] + r["torch_pg"])  # fmt: skip
            samples.setdefault("_ipp_stop", []).append(r["stop"]["stop_s"])
            samples.setdefault("_ipp_gone", []).append(r["stop"]["all_gone_s"])
        return r

    def floor():
        try:
            add(TORCH_FOUR, concurrent_torch_imports(WORLD))
            return {}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    configs = {**{f"ours {m}": ours(m) for m in OURS_METHODS}, "ipyparallel": ipp, "torch floor": floor}
    # Untimed: bring torch, notebook_accel and ipyparallel into the page cache.
    subprocess.run([sys.executable, "-c", "import torch, notebook_accel.session, ipyparallel"],
                   timeout=CHILD_TIMEOUT_S, check=True)  # fmt: skip
    for rep in range(reps):
        names = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in names:
            if name in errors or (name == "torch floor" and rep >= floor_reps):
                continue
            wall = time.perf_counter()
            r = configs[name]()
            child_wall.setdefault(name, []).append(time.perf_counter() - wall)
            if "error" in r:
                errors[name] = f"{r['error']}\n{r.get('stderr', '')}"
                continue
            for key in ("left", "stop_killed"):
                if r.get(key):
                    notes.append(
                        f"{name}, round {rep + 1}: killed processes left after the child ({key}): {r[key]}"
                    )
            if r.get("stop", {}).get("killed"):
                notes.append(
                    f"{name}, round {rep + 1}: killed after stop_cluster_sync: {r['stop']['killed']}"
                )
        print(f"round {rep + 1} done", file=sys.stderr, flush=True)

    wall = time.perf_counter()
    rt = run_child(["roundtrip", "--calls", str(calls), "--warmup", str(warmup), "--block", str(block)],
                   timeout=CHILD_TIMEOUT_S + 60)  # fmt: skip
    child_wall["round trip"] = [time.perf_counter() - wall]
    if "error" in rt:
        errors["round trip"] = f"{rt['error']}\n{rt.get('stderr', '')}"
        roundtrip = {}
    else:
        roundtrip = rt["samples"]
        for key in ("left", "stop_killed"):
            if rt.get(key):
                notes.append(f"round trip: killed processes left after the child ({key}): {rt[key]}")
        if rt["stop"]["killed"]:
            notes.append(f"round trip: killed after stop_cluster_sync: {rt['stop']['killed']}")
    ipp_stop = samples.pop("_ipp_stop", [])
    ipp_gone = samples.pop("_ipp_gone", [])
    return {"start": samples, "roundtrip": roundtrip, "errors": errors, "notes": notes,
            "ipp_stop_s": ipp_stop, "ipp_all_gone_s": ipp_gone, "child_wall_s": child_wall}  # fmt: skip


# -- the report -----------------------------------------------------------------------------------
START_TARGET_S = 3.0
RT_TARGET_MS, RT_STRETCH_MS = 20.0, 10.0
IPP_FULL = "ipyparallel engines up + torch + process group"
TORCH_ONE = "reference: `import torch` in a fresh interpreter (in the ours children)"
TORCH_FOUR = f"reference: {WORLD} fresh interpreters run `import torch` at once (1 thread each)"
ROWS = ["ours fork", "ours forkserver, cold (first start in the kernel)",
        "ours forkserver, warm (second start in the same kernel)", "ours spawn", "ipyparallel engines up",
        IPP_FULL, TORCH_ONE, TORCH_FOUR]  # fmt: skip


def _row_place(row: str) -> int:
    return ROWS.index(row) if row in ROWS else len(ROWS)


def _mm(values: list, scale: float = 1.0, digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * scale:.{digits}f}"
    return f"{statistics.median(values) * scale:.{digits}f} ({min(values) * scale:.{digits}f})"


def summarize(result: dict) -> dict:
    start, rt = result["start"], result["roundtrip"]
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    ratios = []
    ipp_a = med(start.get(IPP_FULL, {}).get("a", []))
    ipp_up = med(start.get("ipyparallel engines up", {}).get("a", []))
    for row, cell in start.items():
        if row.startswith("ours") and ipp_a:
            ratios.append({"ratio": f"start: {row} / {IPP_FULL}", "value": med(cell["a"]) / ipp_a})
    if ipp_up and "ours fork" in start:
        ratios.append({"ratio": "start: ours fork / ipyparallel engines up (no torch)",
                       "value": med(start["ours fork"]["a"]) / ipp_up})  # fmt: skip
    for ours, theirs in ((f"ours, {WORLD} ranks", f"ipyparallel, {WORLD} engines"),
                         ("ours, rank 0", "ipyparallel, engine 0")):  # fmt: skip
        if rt.get(ours) and rt.get(theirs):
            ratios.append(
                {"ratio": f"round trip: {ours} / {theirs}", "value": med(rt[ours]) / med(rt[theirs])}
            )
    targets = []
    for row, cell in start.items():
        if row.startswith("ours") and "warm" not in row:
            for col, what in (("a", "kernel had torch"), ("b", "incl. import torch")):
                if cell[col]:
                    v = med(cell[col])
                    targets.append({"what": f"start, {row}, {what}", "value": f"{v:.2f} s",
                                    "target": f"<= {START_TARGET_S:g} s",
                                    "met": "yes" if v <= START_TARGET_S else "NO"})  # fmt: skip
    for row in (f"ours, {WORLD} ranks", "ours, rank 0"):
        if rt.get(row):
            v = med(rt[row]) * 1e3
            met = "yes, stretch too" if v <= RT_STRETCH_MS else ("yes" if v <= RT_TARGET_MS else "NO")
            targets.append({"what": f"round trip, {row}", "value": f"{v:.2f} ms",
                            "target": f"<= {RT_TARGET_MS:g} ms (stretch {RT_STRETCH_MS:g})", "met": met})  # fmt: skip
    return {"ratios": ratios, "targets": targets}


def markdown(result: dict, summary: dict) -> str:
    rows = ["| start of 4 workers, s | runs | (a) start alone, kernel had torch: median (min) | "
            "(b) with `import torch` and the library's import: median (min) |", "|---|---|---|---|"]  # fmt: skip
    for row, cell in sorted(result["start"].items(), key=lambda kv: _row_place(kv[0])):
        rows.append(f"| {row} | {len(cell['a'])} | {_mm(cell['a'])} | {_mm(cell['b'])} |")
    if result["roundtrip"]:
        rows += ["", "| round trip of `pass`, ms | calls | median (min) |", "|---|---|---|"]
        for name, values in result["roundtrip"].items():
            rows.append(f"| {name} | {len(values)} | {_mm(values, 1e3, 2)} |")
    rows += ["", "| ratio of medians | value |", "|---|---|"]
    rows += [f"| {r['ratio']} | {r['value']:.3f} |" for r in summary["ratios"]]
    rows += ["", "| target | median | target | met |", "|---|---|---|---|"]
    rows += [f"| {t['what']} | {t['value']} | {t['target']} | {t['met']} |" for t in summary["targets"]]
    if result["ipp_stop_s"]:
        rows.append(
            f"\nipyparallel `stop_cluster_sync()` (not in the table): {_mm(result['ipp_stop_s'], 1, 2)} s; "
            f"until all its processes had exited: {_mm(result['ipp_all_gone_s'], 1, 2)} s"
        )
    rows.append("\nleft-over processes: " + ("; ".join(result["notes"]) if result["notes"] else "none"))
    for name, error in result["errors"].items():
        rows.append(f"\nfailed: {name}: {error}")
    return "\n".join(rows)


def _busy_elsewhere(seconds: float = 2.0) -> float:
    """Fraction of all CPUs busy over `seconds` while this benchmark runs nothing: how much other
    programs were using the machine just before (or after) the run."""

    def busy_and_total() -> tuple:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        total = sum(fields[:8])
        return total - fields[3] - fields[4], total  # all but idle and iowait

    b0, t0 = busy_and_total()
    time.sleep(seconds)
    b1, t1 = busy_and_total()
    return (b1 - b0) / max(1, t1 - t0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4, help="rounds of the start measurements")
    parser.add_argument("--floor-reps", type=int, default=2, help="rounds with the 4-import reference")
    parser.add_argument("--calls", type=int, default=200, help="timed round trips per configuration")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips before them")
    parser.add_argument("--block", type=int, default=20, help="round trips in a row before switching")
    parser.add_argument("--json", metavar="PATH", help="also write every sample here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)

    if options.child:
        kind, *rest = options.child
        if kind == "ours":
            child_ours(rest[0])
        elif kind == "ipp":
            child_ipp()
        else:
            child_roundtrip(options.calls, options.warmup, options.block)
        return 0

    import ipyparallel
    import torch

    busy0 = _busy_elsewhere()
    started = time.perf_counter()
    result = measure(options.reps, options.floor_reps, options.calls, options.warmup, options.block)
    elapsed = time.perf_counter() - started
    busy1 = _busy_elsewhere()
    summary = summarize(result)
    versions = (f"python {sys.version.split()[0]}, torch {torch.__version__}, ipyparallel "
                f"{ipyparallel.__version__}, {os.cpu_count()} CPUs")  # fmt: skip
    load = (f"{elapsed:.0f} s in all; other programs kept the CPUs {busy0:.0%} busy in the 2 s before "
            f"the run, {busy1:.0%} in the 2 s after")  # fmt: skip
    print(f"Interactive sessions ({versions}; {load})\n")
    print(markdown(result, summary))
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"versions": versions, "seconds": elapsed,
                       "busy_elsewhere": [busy0, busy1], **result,
                       **summary}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
