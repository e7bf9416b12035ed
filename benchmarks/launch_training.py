"""Launching a typical training function (issue #28, part 1): model, optimizer, loader and DDP
through `prepare`, one step. Its ranks need torch._dynamo (the optimizer's step, DDP's constructor)
and the training modules; where the launching process imported them first (launch/rank_imports.py),
forked ranks inherit them.

Every sample starts a fresh interpreter or kernel, since what a process imported is the thing being
measured. The baseline is the same launch from a parent that imported everything first
(`rank_imports.import_all()` and, in a kernel, the launch path too, before any launch).

- script: a fresh `python` imports torch and notebook_accel, then launches LAUNCHES times in a row
  (the first launch pays the one-time import once, in the parent); also with
  NOTEBOOK_ACCEL_PREWARM=0 (each rank imports, every launch: how it was before), and accelerate
  1.15's launcher on the same function written against accelerate (`Accelerator(cpu=True)`).
- kernel: a fresh kernel imports torch, then `import notebook_accel` in its own cell, stays idle
  PREWARM_WAIT_S, then launches (fork and forkserver, the first included) and runs the same
  function as a fork session's first cell; the kernel's RSS before and after the idle import.

Used by `python benchmarks/launch.py --training` (rows and ratios printed there).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
LAUNCHES = 4  # per fresh script: the first, then three more
PREWARM_WAIT_S = 5.0


def train_step(use_accelerate: bool = False) -> float:
    """The typical function: what the README's example does in one step."""
    import torch
    from torch import nn

    if use_accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)  # without cpu=True accelerate 1.15 runs each rank alone here
    else:
        from notebook_accel import Accelerator

        accelerator = Accelerator()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    x, y = next(iter(loader))
    loss = nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert accelerator.num_processes > 1, accelerator.num_processes
    return loss.item()


# -- in a fresh script ------------------------------------------------------------------------
SCRIPT = r"""
import json, sys, time
sys.path.insert(0, {bench!r})
import torch
import launch_training as bench
kind, method, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "accelerate":
    import contextlib, io
    from accelerate import notebook_launcher
else:
    from notebook_accel import notebook_launcher
    from notebook_accel.launch import rank_imports
    if kind == "baseline":
        rank_imports.import_all(respect_opt_out=False)
times = []
for _ in range({launches}):
    t = time.perf_counter()
    if kind == "accelerate":
        with contextlib.redirect_stdout(io.StringIO()):  # its banner
            notebook_launcher(bench.train_step, args=(True,), num_processes=world)
    else:
        notebook_launcher(bench.train_step, num_processes=world, start_method=method)
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def script_sample(kind: str, method: str, world: int) -> list:
    env = {k: v for k, v in os.environ.items() if k != "NOTEBOOK_ACCEL_PREWARM"}
    if kind == "prewarm off":
        env["NOTEBOOK_ACCEL_PREWARM"] = "0"
    code = SCRIPT.format(bench=BENCH, launches=LAUNCHES)
    out = subprocess.run(
        [sys.executable, "-c", code, kind, method, str(world)], env=env, capture_output=True, text=True, timeout=600
    )
    if out.returncode:
        raise RuntimeError(f"{kind} {method}/{world} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- in a fresh kernel ------------------------------------------------------------------------
IMPORT_CELL = """\
import json as _j, sys as _s, time as _t, psutil as _p
_s.path.insert(0, {bench!r})
_rss0 = _p.Process().memory_info().rss
import notebook_accel
if {baseline!r}:
    from notebook_accel.jupyter import ready as _ready
    from notebook_accel.launch import rank_imports as _ri
    _ready.import_launch_path(); _ri.import_all(respect_opt_out=False)
"""
LAUNCH_CELL = """\
_rss1 = _p.Process().memory_info().rss
import launch_training as _bench
from notebook_accel import notebook_launcher as _nl
_out = {{"rss_added": _rss1 - _rss0, "fork": [], "forkserver": []}}
for _method in ("fork", "forkserver", "fork", "forkserver"):
    _t0 = _t.perf_counter()
    _nl(_bench.train_step, num_processes={world}, start_method=_method)
    _out[_method].append(_t.perf_counter() - _t0)
from notebook_accel.session import Session as _S
with _S({world}, start_method="fork", cpu=True) as _sess:
    _sess.push({{"train_step": _bench.train_step}})
    _t0 = _t.perf_counter()
    _sess.run_cell("train_step()", check=True)
    _out["session_first_cell"] = _t.perf_counter() - _t0
print(_j.dumps(_out))
"""


def two_cells_in_a_fresh_kernel(env: dict, first: str, second: str, idle_s: float, timeout: float) -> dict:
    """A fresh real kernel (`env`) that imported torch runs `first`, stays idle `idle_s`, then runs
    `second`, whose last printed line is JSON: returned. (launch.py's forkserver rows use it too.)"""
    from notebook_accel.demo import _kernel_manager_class

    km = _kernel_manager_class()(kernel_name="python3")
    km.start_kernel(env=env, extra_arguments=["--IPKernelApp.log_level=ERROR"])
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        kc.execute_interactive("import torch", timeout=60)
        text: list = []
        for cell in (first, second):
            reply = kc.execute_interactive(
                cell, timeout=timeout, output_hook=lambda m: text.append(m["content"].get("text", ""))
            )
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"kernel sample failed: {reply['content'].get('evalue')}")
            if cell is first:
                time.sleep(idle_s)
        return json.loads("".join(text).strip().splitlines()[-1])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def kernel_sample(world: int, baseline: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NOTEBOOK_ACCEL_PREWARM"}
    env["NOTEBOOK_ACCEL_WIDGETS"] = "0"
    first = IMPORT_CELL.format(bench=BENCH, baseline=baseline)
    return two_cells_in_a_fresh_kernel(env, first, LAUNCH_CELL.format(world=world), PREWARM_WAIT_S, 600)


# -- the rows -----------------------------------------------------------------------------------
def measure(ranks: list, reps: int, with_accelerate: bool) -> dict:
    """Round-robin over the configurations, `reps` fresh processes each."""
    script_kinds = ["ours", "baseline", "prewarm off"] + (["accelerate"] if with_accelerate else [])
    configs = []
    for world in ranks:
        for method in ("fork", "forkserver"):
            for kind in script_kinds:
                if kind == "accelerate" and method == "forkserver":
                    continue  # accelerate's launcher forks
                configs.append(("script", kind, method, world))
        for kind in ("ours", "baseline"):
            configs.append(("kernel", kind, "", world))
    samples: dict = {c: [] for c in configs}
    errors: dict = {}
    for rep in range(reps):
        for c in configs:
            if c in errors:
                continue
            where, kind, method, world = c
            try:
                if where == "script":
                    samples[c].append(script_sample(kind, method, world))
                else:
                    samples[c].append(kernel_sample(world, kind == "baseline"))
            except Exception as exc:  # noqa: BLE001 - report it, keep measuring the rest
                errors[c] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"training launches: round {rep + 1} done", file=sys.stderr, flush=True)
    return {"samples": samples, "errors": errors}


def _med(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def markdown(result: dict, ranks: list) -> str:
    s = result["samples"]
    rows = [
        "| in a fresh script (median over runs) | ranks | runs | first launch (s) | later launches (s) |",
        "|---|---|---|---|---|",
    ]
    for (where, kind, method, world), runs in s.items():
        if where == "script" and runs:
            label = f"{kind}, {method}" if kind != "accelerate" else "accelerate 1.15 notebook_launcher (fork)"
            later = [t for run in runs for t in run[1:]]
            rows.append(f"| {label} | {world} | {len(runs)} | {_med([r[0] for r in runs]):.3f} | {_med(later):.3f} |")
    rows += ["", "| in a fresh kernel, 5 s after `import notebook_accel` (median) | ranks | runs | first fork (s) | "
             "later fork (s) | first forkserver (s) | later forkserver (s) | fork session's first cell (s) | "
             "kernel RSS added by the idle import (MiB) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (where, kind, _, world), runs in s.items():
        if where == "kernel" and runs:
            cols = [
                _med([r["fork"][0] for r in runs]),
                _med([r["fork"][1] for r in runs]),
                _med([r["forkserver"][0] for r in runs]),
                _med([r["forkserver"][1] for r in runs]),
                _med([r["session_first_cell"] for r in runs]),
            ]
            rss = _med([r["rss_added"] for r in runs]) / 2**20
            rows.append(f"| {kind} | {world} | {len(runs)} | " + " | ".join(f"{v:.3f}" for v in cols) + f" | {rss:.0f} |")
    rows += ["", "| ratio (medians), target <= 1.3 against the baseline | ranks | value | met |", "|---|---|---|---|"]
    for world in ranks:
        for method in ("fork", "forkserver"):
            ours, base = s.get(("script", "ours", method, world)), s.get(("script", "baseline", method, world))
            if ours and base:
                later = _med([t for run in ours for t in run[1:]]) / _med([t for run in base for t in run])
                rows.append(f"| script, {method}, launches after the first | {world} | {later:.2f} | {_met(later)} |")
            off = s.get(("script", "prewarm off", method, world))
            if off and base:
                v = _med([t for run in off for t in run[1:]]) / _med([t for run in base for t in run])
                rows.append(f"| (script, {method}, NOTEBOOK_ACCEL_PREWARM=0, later launches: how it was) | {world} | {v:.2f} | - |")
        acc, base = s.get(("script", "accelerate", "fork", world)), s.get(("script", "baseline", "fork", world))
        if acc and base:
            v = _med([t for run in acc for t in run[1:]]) / _med([t for run in base for t in run])
            rows.append(f"| (accelerate 1.15, later launches, against our baseline fork) | {world} | {v:.2f} | - |")
        ours, base = s.get(("kernel", "ours", "", world)), s.get(("kernel", "baseline", "", world))
        if ours and base:
            for key, i, label in (("fork", 0, "first fork"), ("fork", 1, "later fork"),
                                  ("forkserver", 0, "first forkserver"), ("forkserver", 1, "later forkserver"),
                                  ("session_first_cell", None, "fork session's first cell")):  # fmt: skip
                def pick(r, key=key, i=i):
                    return r[key] if i is None else r[key][i]

                v = _med([pick(r) for r in ours]) / _med([pick(r) for r in base])
                rows.append(f"| kernel, {label} | {world} | {v:.2f} | {_met(v)} |")
    for c, error in result["errors"].items():
        rows.append(f"\nfailed: {c}: {error}")
    return "\n".join(rows)


def _met(value: float) -> str:
    return "yes" if value <= 1.3 else "NO"
