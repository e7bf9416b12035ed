"""Checks that need an NVIDIA GPU: run once on a CUDA machine, read the JSON afterwards.

    python tools/gpu_check.py [--out DIR]      # DIR defaults to $OUT; writes DIR/gpu_check.json

One line per check (PASS / FAIL / SKIP); exit code 1 if any check failed. Without CUDA every
CUDA check is skipped and the exit code is 0 (tests/test_gpu_check.py runs it that way).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout that is not installed, too

CHILD_TIMEOUT_S = 150
LAUNCH_TIMEOUT_S = 90  # inside a child: a hung rank becomes a LaunchTimeoutError, not a hung child
NO_CUDA = "no CUDA device"
RANKS_MODULE_NAME = "_gpu_check_ranks"

# Written to a temp folder: spawned ranks import it by reference (cloudpickle), forked ranks need no import.
RANKS_MODULE = '''
import os

import torch
import torch.distributed as dist

from notebook_accel import PartialState


def cuda_result():
    # A rank's return value with CUDA tensors inside containers and a module: all must arrive on the CPU.
    rank = PartialState().process_index
    layer = torch.nn.Linear(2, 2).to("cuda:0")
    with torch.no_grad():
        layer.weight.fill_(rank)
    return {"tensor": torch.arange(4.0, device="cuda:0") + rank, "nested": [(torch.ones(2, device="cuda:0"),)],
            "module": layer}


def fsdp_steps(offload):
    # FSDP2 with and without cpu_offload on two GPUs: the same losses, shards on the CPU when offloaded.
    import torch.nn.functional as F
    from notebook_accel import Accelerator
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=offload, auto_wrap_policy="size_based_wrap",
                                            min_num_params=1000)
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1 + accelerator.process_index))
    x = x.to(accelerator.device)
    losses = []
    for _ in range(5):  # one batch, again and again: the loss must fall
        loss = F.mse_loss(model(x), x)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    param = next(model.parameters())
    local = param.to_local() if hasattr(param, "to_local") else param
    return {"rank": accelerator.process_index, "type": str(accelerator.distributed_type),
            "param_device": str(local.device), "losses": losses}


def ddp_bf16_hook():
    # The BF16 communication hook (nccl only): gradients arrive rounded to bf16 after the all-reduce.
    import torch.nn.functional as F
    from notebook_accel import Accelerator
    from notebook_accel.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)
    accelerator = Accelerator(kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1 + accelerator.process_index)).to(accelerator.device)
    losses, rounded = [], []
    for _ in range(3):
        loss = F.mse_loss(model(x), x)
        accelerator.backward(loss)
        grad = model.module.weight.grad
        rounded.append(bool(torch.equal(grad, grad.to(torch.bfloat16).to(grad.dtype))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"rank": accelerator.process_index, "type": str(accelerator.distributed_type), "losses": losses,
            "grads_bf16_rounded": rounded}


def visible_devices():
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
            "name": torch.cuda.get_device_name(0)}


def hold_device_memory(mib, seconds):
    # Holds `mib` MiB on cuda:0 long enough for the launcher's once-a-second sampling to see it.
    import time
    block = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:0")
    block.fill_(1)
    torch.cuda.synchronize()
    time.sleep(seconds)
    return {"rank": PartialState().process_index, "pid": os.getpid(), "held": int(block.numel())}


def nccl_stall(two_gpus, shape):
    # Rank 0 is in an NCCL all_reduce that never completes, rank 1 in a barrier: the stall watch's case.
    import time
    state = PartialState()
    if two_gpus:
        group, device = None, state.device
    else:
        # nccl refuses two ranks on one GPU: the ranks are gloo, and rank 0 alone is an NCCL group.
        group, device = dist.new_group([0], backend="nccl", group_desc="nccl_rank0"), torch.device("cuda", 0)
    if state.process_index == 0:
        torch.cuda.set_device(device)
        dist.all_reduce(torch.ones(1, device=device), group=group)  # the communicator exists before the stall
        torch.cuda.synchronize()
        tensor = torch.ones(shape, device=device)
        if not two_gpus:
            torch.cuda._sleep(120_000_000_000)  # about a minute of spinning: the all_reduce waits behind it
        print("ready", flush=True)
        dist.all_reduce(tensor, group=group)
        torch.cuda.synchronize()  # NCCL returns at once: a rank blocks where it reads the result
    else:
        if two_gpus:
            dist.all_reduce(torch.ones(1, device=device))
            torch.cuda.synchronize()
        print("ready", flush=True)
        dist.barrier()
    time.sleep(600)  # had the mismatched pair completed after all, still no return: the report says so


def rank_report():
    state = PartialState()
    total = torch.tensor([float(state.process_index + 1)], device=state.device)
    if dist.is_initialized():
        dist.all_reduce(total)
    # With one GPU the ranks run gloo on the CPU; touching cuda:0 shows each child can still use it.
    gpu = state.device if state.device.type == "cuda" else torch.device("cuda", 0)
    cuda_sum = torch.ones(1024, device=gpu).sum().item()
    return {
        "rank": state.process_index, "pid": os.getpid(), "backend": state.backend,
        "distributed_type": getattr(state.distributed_type, "value", str(state.distributed_type)),
        "device": str(state.device), "current_device": torch.cuda.current_device(),
        "all_reduce": total.item(), "cuda_sum": cuda_sum,
    }
'''

REPORT_CHILD = r"""
import json
import torch
import notebook_accel
from notebook_accel import hardware

report = hardware.report()
out = {"report": report.to_dict(), "summary": report.summary(), "initialized": torch.cuda.is_initialized(),
       "torch_device_count": torch.cuda.device_count()}
out["initialized_after_count"] = torch.cuda.is_initialized()
if out["torch_device_count"]:
    # Only now, after the answer above: what torch itself says, to compare with NVML's view.
    out["torch_names"] = [torch.cuda.get_device_name(i) for i in range(out["torch_device_count"])]
    out["torch_capabilities"] = [list(torch.cuda.get_device_capability(i))
                                 for i in range(out["torch_device_count"])]
print("RESULT " + json.dumps(out))
"""

LAUNCH_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from notebook_accel import notebook_launcher
import _gpu_check_ranks as ranks

# nccl refuses two ranks on one GPU: with one GPU, two gloo ranks that each use cuda:0.
cpu = torch.cuda.device_count() < 2
results = notebook_launcher(ranks.rank_report, num_processes=2, use_port="auto", cpu=cpu, timeout=float(sys.argv[2]))
print("RESULT " + json.dumps({"cpu": cpu, "results": results, "initialized": torch.cuda.is_initialized()}))
"""

FORK_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import psutil
import torch
from notebook_accel import notebook_launcher
import _gpu_check_ranks as ranks

cpu = torch.cuda.device_count() < 2
torch.zeros(1, device="cuda")
out = {"cpu": cpu, "initialized": torch.cuda.is_initialized()}


def attempt(**kwargs):
    try:
        return {"results": notebook_launcher(ranks.rank_report, use_port="auto", timeout=float(sys.argv[2]), **kwargs)}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def children():
    return [p.pid for p in psutil.Process().children(recursive=True)]


out["fork"] = attempt(num_processes=2, cpu=cpu)  # the default start method
out["children_after_fork"] = children()
out["spawn"] = attempt(num_processes=2, cpu=cpu, start_method="spawn")
out["children_after_spawn"] = children()
# One rank runs in this process, so nothing forks: it must run (a single-GPU notebook's case).
out["one_process_default"] = attempt(num_processes=1)
print("RESULT " + json.dumps(out))
"""


RAY_CHILD = r"""
import json, sys
import ray, torch
from notebook_accel import notebook_launcher


def where():  # defined in __main__: it travels to the actor by value
    import os
    import torch
    local = int(os.environ["LOCAL_RANK"])
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "local_rank": local,
            "count": torch.cuda.device_count(), "device": str(torch.ones(1, device=f"cuda:{local}").device),
            "type": os.environ.get("ACCELERATE_USE_CPU")}


ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
try:
    ranks = notebook_launcher(where, num_processes=1, engine="ray", resources_per_rank={"CPU": 1, "GPU": 1},
                              timeout=float(sys.argv[1]))
finally:
    ray.shutdown()
print("RESULT " + json.dumps({"ranks": ranks, "initialized": torch.cuda.is_initialized()}))
"""

RESULTS_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from notebook_accel import notebook_launcher
import _gpu_check_ranks as ranks

cpu = torch.cuda.device_count() < 2
results = notebook_launcher(ranks.cuda_result, num_processes=2, use_port="auto", cpu=cpu, timeout=float(sys.argv[2]))
out = {"initialized_after_results": torch.cuda.is_initialized()}
out["devices"] = sorted({str(t.device) for r in results
                         for t in (r["tensor"], r["nested"][0][0], *r["module"].parameters())})
out["values"] = [r["tensor"].tolist() for r in results] + [[r["module"].weight.sum().item()] for r in results]
chosen = notebook_launcher(ranks.visible_devices, num_processes=1, gpu_ids="0", use_port="auto",
                           timeout=float(sys.argv[2]))
out["gpu_ids"] = chosen[0]
out["initialized"] = torch.cuda.is_initialized()
print("RESULT " + json.dumps(out))
"""


RESOURCES_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from notebook_accel import notebook_launcher
from notebook_accel.launch import ListSink
from notebook_accel.launch import events as ev
import _gpu_check_ranks as ranks

sink = ListSink()
results = notebook_launcher(ranks.hold_device_memory, (512, 3.5), num_processes=2, use_port="auto", cpu=True,
                            timeout=float(sys.argv[2]), sinks=[sink])
rows = [[e.rank, e.device_memory, e.device_util] for e in sink.events if isinstance(e, ev.RankResources)]
peaks = {e.rank: e.peak_device_memory for e in sink.events if isinstance(e, ev.RankFinished)}
print("RESULT " + json.dumps({"results": results, "rows": rows, "peaks": peaks,
                              "initialized": torch.cuda.is_initialized()}))
"""


TWO_GPU_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from notebook_accel import notebook_launcher
import _gpu_check_ranks as ranks

run = lambda fn, *args: notebook_launcher(fn, args, num_processes=2, use_port="auto", timeout=float(sys.argv[2]))
out = {"offload": run(ranks.fsdp_steps, True), "no_offload": run(ranks.fsdp_steps, False),
       "bf16_hook": run(ranks.ddp_bf16_hook), "initialized": torch.cuda.is_initialized()}
print("RESULT " + json.dumps(out))
"""


STALL_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from notebook_accel import notebook_launcher
from notebook_accel.launch import ListSink
from notebook_accel.launch import events as ev
import _gpu_check_ranks as ranks

two = torch.cuda.device_count() >= 2
sink = ListSink()
out = {"two_gpus": two, "error": None, "message": ""}
try:
    notebook_launcher(ranks.nccl_stall, (two, json.loads(sys.argv[2])), num_processes=2, use_port="auto",
                      cpu=not two, stall_after=3, timeout=20, sinks=[sink])
except Exception as exc:
    out["error"], out["message"] = type(exc).__name__, str(exc)[-4000:]
reports = [e.report for e in sink.events if isinstance(e, ev.LaunchStalled)]
out["reports"] = [{"sentence": r.sentence, "text": r.text(), "seconds": r.seconds,
                   "ranks": [{"rank": w.rank, "state": w.state, "waiting": [c.describe() for c in w.waiting]}
                             for w in r.ranks]} for r in reports]
out["output"] = [[e.rank, e.text] for e in sink.events if isinstance(e, ev.RankOutput)][-20:]
out["initialized"] = torch.cuda.is_initialized()
print("RESULT " + json.dumps(out))
"""


STALL_SHAPE = [256, 1024]  # the all_reduce's tensor, to be named in the report

# The line of FORK_CHILD that initialises CUDA: the refusal must name it (`python -c` calls it <string>).
FORK_CULPRIT_LINE = FORK_CHILD.splitlines().index('torch.zeros(1, device="cuda")') + 1
FORK_CULPRIT = f'File "<string>", line {FORK_CULPRIT_LINE}'


def _child(code: str, *argv: str) -> dict:
    """Run `code` in a fresh interpreter (nothing initialised yet); return the JSON it prints last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip() or done.stdout.strip())[-2000:]
        raise RuntimeError(f"child exited with {done.returncode}: {tail}")
    return json.loads(lines[-1][len("RESULT "):])


def skip(reason: str) -> dict:
    return {"ok": None, "detail": reason}


def verdict(problems: list, detail: str, **figures) -> dict:
    return {"ok": not problems, "detail": "; ".join(problems) or detail, **figures}


# -- 1-3: fresh interpreters, before this process touches CUDA ----------------------------------


def check_hardware_report(cuda: bool) -> dict:
    res = _child(REPORT_CHILD)
    devices = [d for d in res["report"]["accelerators"] if d["kind"] == "cuda"]
    problems = []
    if res["initialized"] or res["initialized_after_count"]:
        problems.append("hardware.report() (or device_count) initialised CUDA")
    if cuda:
        if len(devices) != res["torch_device_count"]:
            problems.append(f"report lists {len(devices)} CUDA devices, torch counts {res['torch_device_count']}")
        for d, name, cc in zip(devices, res.get("torch_names", []), res.get("torch_capabilities", [])):
            if d["compute_capability"] != cc:
                problems.append(f"device {d['index']}: report capability {d['compute_capability']}, torch {cc}")
            if d["name"] != name:
                problems.append(f"device {d['index']}: report name {d['name']!r}, torch {name!r}")
            if not d["total_memory"]:
                problems.append(f"device {d['index']}: no total memory in the report")
            if cc and d["supports_bf16"] != (tuple(cc) >= (8, 0)):
                problems.append(f"device {d['index']}: bf16 flag {d['supports_bf16']} for capability {cc}")
            if cc and d["supports_fp8"] != (tuple(cc) >= (8, 9)):
                problems.append(f"device {d['index']}: fp8 flag {d['supports_fp8']} for capability {cc}")
    fields = [
        {k: d[k] for k in ("index", "name", "total_memory", "free_memory", "compute_capability",
                           "supports_bf16", "supports_fp16", "supports_fp8")}
        for d in devices
    ]  # fmt: skip
    detail = f"{res['summary']}; torch.cuda.is_initialized() stayed False"
    return verdict(problems, detail, summary=res["summary"], devices=fields,
                   initialized_after_report=res["initialized"])  # fmt: skip


def _check_ranks(results: list, cpu: bool, problems: list, label: str) -> None:
    ranks = sorted(results, key=lambda r: r["rank"])
    backend = "gloo" if cpu else "nccl"
    if [r["rank"] for r in ranks] != [0, 1]:
        problems.append(f"{label}: ranks {[r['rank'] for r in ranks]}, expected [0, 1]")
    for r in ranks:
        expected_device = 0 if cpu else r["rank"]
        if r["backend"] != backend:
            problems.append(f"{label}: rank {r['rank']} backend {r['backend']}, expected {backend}")
        if r["current_device"] != expected_device:
            problems.append(f"{label}: rank {r['rank']} on cuda:{r['current_device']}, expected cuda:{expected_device}")
        if r["all_reduce"] != 3.0 or r["cuda_sum"] != 1024.0:
            problems.append(f"{label}: rank {r['rank']} all_reduce {r['all_reduce']}, cuda sum {r['cuda_sum']}")


def check_launcher(tmp: str) -> dict:
    res = _child(LAUNCH_CHILD, tmp, str(LAUNCH_TIMEOUT_S))
    problems = ["the launching process initialised CUDA"] if res["initialized"] else []
    _check_ranks(res["results"], res["cpu"], problems, "fork")
    backend = res["results"][0]["backend"] if res["results"] else None
    how = "2 gloo ranks each using cuda:0 (one GPU: nccl needs two)" if res["cpu"] else "2 nccl ranks"
    return verdict(problems, f"{how}; the parent's CUDA stayed uninitialised", backend=backend,
                   one_gpu_fallback=res["cpu"], results=res["results"])  # fmt: skip


def check_fork_refused(tmp: str) -> dict:
    res = _child(FORK_CHILD, tmp, str(LAUNCH_TIMEOUT_S))
    problems = [] if res["initialized"] else ["torch.zeros(device='cuda') left CUDA uninitialised"]
    fork = res["fork"]
    if fork.get("error") != "LaunchConfigError":
        problems.append(f"fork after CUDA init gave {fork.get('error') or 'no error'}, expected LaunchConfigError")
    elif not all(word in fork["message"] for word in ("spawn", "forkserver")):
        problems.append(f"the refusal does not name spawn and forkserver: {fork['message']!r}")
    elif FORK_CULPRIT not in fork["message"] or "move that line into the launched function" not in fork["message"]:
        problems.append(f"the refusal does not name the line that initialised CUDA ({FORK_CULPRIT}): {fork['message']!r}")
    if res["children_after_fork"]:
        problems.append(f"processes left after the refusal: {res['children_after_fork']}")
    if "results" in res["spawn"]:
        _check_ranks(res["spawn"]["results"], res["cpu"], problems, "spawn")
    else:
        problems.append(f"spawn after CUDA init failed: {res['spawn']['error']}: {res['spawn']['message'][-500:]}")
    if res["children_after_spawn"]:
        problems.append(f"processes left after the spawn launch: {res['children_after_spawn']}")
    one = res["one_process_default"]
    if "error" in one:
        problems.append(f"one process after CUDA init was refused: {one['error']}: {one['message'][-300:]}")
    return verdict(
        problems, "fork refused with LaunchConfigError naming the culprit line and spawn/forkserver; spawn then ran; "
        "no process left",
        refusal=fork.get("message"), one_gpu_fallback=res["cpu"],
        one_process_default_after_cuda_init=one.get("error") or "ran in the caller",
    )  # fmt: skip


def check_results_and_gpu_ids(tmp: str) -> dict:
    res = _child(RESULTS_CHILD, tmp, str(LAUNCH_TIMEOUT_S))
    problems = []
    if res["initialized_after_results"] or res["initialized"]:
        problems.append("CUDA tensors in the ranks' results initialised CUDA in the launching process")
    if res["devices"] != ["cpu"]:
        problems.append(f"result tensors arrived on {res['devices']}, expected only cpu")
    if res["values"] != [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [0.0], [4.0]]:
        problems.append(f"result values {res['values']}")
    chosen = res["gpu_ids"]
    if chosen["visible"] != "0" or chosen["count"] != 1:
        problems.append(f"gpu_ids='0': the rank saw CUDA_VISIBLE_DEVICES={chosen['visible']!r}, {chosen['count']} device(s)")
    return verdict(problems, "cuda:0 tensors, nested and in a module, arrived on the CPU without initialising CUDA "
                   "here; gpu_ids='0' gave the rank exactly that device", gpu_ids=chosen)  # fmt: skip


def check_rank_device_memory(tmp: str) -> dict:
    """Part 3 of issue #19: the launcher samples each rank's device memory through NVML (ctypes)
    and reports its peak when the rank ends; the launching process never initialises CUDA."""
    res = _child(RESOURCES_CHILD, tmp, str(LAUNCH_TIMEOUT_S))
    problems = ["the launching process initialised CUDA"] if res["initialized"] else []
    held = 512 << 20
    for rank in (0, 1):
        seen = [used for r, used, _ in res["rows"] if r == rank and used is not None]
        if not seen:
            problems.append(f"rank {rank}: no RankResources row with device memory (NVML pids from "
                            "another pid namespace would do this)")  # fmt: skip
        elif max(seen) < held:
            problems.append(f"rank {rank}: device memory peaked at {max(seen)} bytes, under the {held} it held")
        peak = res["peaks"].get(str(rank))
        if peak is None or peak < held:
            problems.append(f"rank {rank}: RankFinished.peak_device_memory {peak}, expected >= {held}")
    return verdict(problems, "each rank's device memory sampled through NVML and its peak reported; CUDA "
                   "uninitialised in the launcher", rows=res["rows"][-6:], peaks=res["peaks"])  # fmt: skip


def check_two_gpus(tmp: str) -> dict:
    """FSDP2 cpu_offload (#17) and the BF16 DDP communication hook (#16) need nccl between two GPUs:
    nccl refuses two ranks on one GPU, and one process shards nothing and wraps no DDP."""
    import torch

    if torch.cuda.device_count() < 2:
        return skip(f"needs 2 CUDA GPUs (nccl refuses two ranks on one GPU); {torch.cuda.device_count()} here")
    res = _child(TWO_GPU_CHILD, tmp, str(LAUNCH_TIMEOUT_S))
    problems = ["the launching process initialised CUDA"] if res["initialized"] else []
    for r in res["offload"]:
        if r["type"] != "FSDP" or r["param_device"] != "cpu":
            problems.append(f"cpu_offload: rank {r['rank']} {r['type']}, shard on {r['param_device']} (expected FSDP, cpu)")
    for r in res["no_offload"]:
        if r["param_device"] != f"cuda:{r['rank']}":
            problems.append(f"no offload: rank {r['rank']} shard on {r['param_device']}")
    for a, b in zip(res["offload"], res["no_offload"]):
        if any(abs(x - y) > 1e-4 * max(1.0, abs(y)) for x, y in zip(a["losses"], b["losses"])):
            problems.append(f"rank {a['rank']}: losses with offload {a['losses']} differ from without {b['losses']}")
        if not a["losses"][-1] < a["losses"][0]:
            problems.append(f"rank {a['rank']}: the offloaded loss did not fall: {a['losses']}")
    for r in res["bf16_hook"]:
        if r["type"] != "MULTI_GPU" or not all(r["grads_bf16_rounded"]):
            problems.append(f"BF16 hook: rank {r['rank']} {r['type']}, gradients bf16-rounded: {r['grads_bf16_rounded']}")
    return verdict(problems, "FSDP2 cpu_offload keeps shards on the CPU and trains like no offload; the BF16 hook "
                   "rounds all-reduced gradients to bf16", **res)  # fmt: skip


def check_ray_gpu(tmp: str) -> dict:
    """Issue #31: a Ray rank with {"GPU": 1} sees exactly the GPU Ray gave its actor, as cuda:LOCAL_RANK."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return skip("ray is not installed (pip install 'notebook_accel[ray]')")
    res = _child(RAY_CHILD, str(LAUNCH_TIMEOUT_S))
    problems = ["the launching process initialised CUDA"] if res["initialized"] else []
    (rank,) = res["ranks"]
    if rank["visible"] != "0" or rank["count"] != 1 or rank["device"] != "cuda:0" or rank["local_rank"] != 0:
        problems.append(f"the rank saw {rank}, expected CUDA_VISIBLE_DEVICES '0', one device, cuda:0")
    if rank["type"] is not None:
        problems.append(f"ACCELERATE_USE_CPU={rank['type']!r} in a rank given a GPU")
    return verdict(problems, "a Ray rank given one GPU sees exactly it, as cuda:LOCAL_RANK", rank=rank)


def check_nccl_stall(tmp: str) -> dict:
    """Issue #29 on NCCL: rank 0 waits in an all_reduce its peer never joins, rank 1 in a barrier;
    launched with stall_after=3 and timeout=20, the LaunchStalled report must name the all_reduce
    with its shape, and each rank. With one GPU the all_reduce is on an NCCL group of rank 0 alone,
    kept from completing by a kernel ahead of it (nccl refuses two ranks on one GPU)."""
    res = _child(STALL_CHILD, tmp, json.dumps(STALL_SHAPE))
    problems = ["the launching process initialised CUDA"] if res["initialized"] else []
    if res["error"] != "LaunchTimeoutError":
        problems.append(f"the launch ended with {res['error'] or 'no error'}, expected LaunchTimeoutError: "
                        f"{res['message'][-500:]}")  # fmt: skip
    shape = "float32[" + ", ".join(str(n) for n in STALL_SHAPE) + "]"
    group = "" if res["two_gpus"] else " of group nccl_rank0"
    sentence = text = None
    if not res["reports"]:
        problems.append(f"no LaunchStalled event; last output {res['output'][-4:]}")
    else:
        report = res["reports"][0]
        sentence, text = report["sentence"], report["text"]
        rank0 = report["ranks"][0]
        if not any(w.startswith("all_reduce #") and w.endswith(f"{group} ({shape})") for w in rank0["waiting"]):
            problems.append(f"rank 0 is {rank0['state']} in {rank0['waiting']}, expected all_reduce{group} ({shape})")
        wanted = ["rank 0 waits in all_reduce #", f"{group} ({shape})", "rank 1 "]
        if not res["two_gpus"]:
            wanted.append("rank 1 waits in barrier #")  # gloo: it cannot complete without rank 0
        problems += [f"the sentence lacks {word!r}: {sentence}" for word in wanted if word not in sentence]
        if sentence not in res["message"]:
            problems.append("the timeout's error does not carry the report's sentence")
    how = "2 NCCL ranks, one GPU each" if res["two_gpus"] else "one GPU: gloo ranks, rank 0 alone in an NCCL group"
    return verdict(problems, f"{how}: {sentence}", mode=how, sentence=sentence, report=text,
                   reports=len(res["reports"]), error=res["error"])  # fmt: skip


# -- 4: training steps in this process ------------------------------------------------------------


def _reset_states() -> None:
    from notebook_accel.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _train(mixed_precision: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from notebook_accel import Accelerator

    accelerator = Accelerator(mixed_precision=mixed_precision)
    torch.manual_seed(0)
    x = torch.randn(1024, 256)
    y = x @ (torch.randn(256, 256) / 16)
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    # Multiples of 16 everywhere: torchao's fp8 matmuls need them.
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))  # after fp8 conversion
    seen = []
    hook = first.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    losses, times, skipped, out_dtype = [], [], 0, None
    for _ in range(5):
        for xb, yb in loader:
            start = time.perf_counter()
            out = model(xb)
            loss = F.mse_loss(out, yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
            losses.append(loss.item())
            skipped += accelerator.optimizer_step_was_skipped
            out_dtype = out_dtype or str(out.dtype)
    hook.remove()
    scaler = accelerator.scaler
    figures = {
        "device": str(accelerator.device), "linear_class": type(first).__name__,
        "inner_dtype": str(seen[0]) if seen else None, "output_dtype": out_dtype,
        "first_loss": sum(losses[:4]) / 4, "last_loss": sum(losses[-4:]) / 4, "steps": len(losses),
        "skipped_steps": skipped, "ms_per_step": statistics.median(times[-10:]),
        "grad_scaler": type(scaler).__name__ if scaler is not None else None,
        "scale": float(scaler.get_scale()) if scaler is not None else None,
    }  # fmt: skip
    del model, optimizer, loader, accelerator, first
    return figures


def check_training(mixed_precision: str, timings: dict) -> dict:
    import math

    import torch

    from notebook_accel.utils.imports import is_torchao_available

    _reset_states()
    try:
        capability = tuple(torch.cuda.get_device_capability(0))
        if mixed_precision == "fp8" and (capability < (8, 9) or not is_torchao_available()):
            # Both cases must be refused when the Accelerator is built, never run silently in fp32.
            from notebook_accel import Accelerator

            try:
                Accelerator(mixed_precision="fp8")
                refusal = None
            except ValueError as exc:
                refusal = str(exc)
            if refusal is None:
                return {"ok": False, "detail": f"fp8 on capability {capability} was accepted without torchao "
                        "or hardware support"}  # fmt: skip
            if capability < (8, 9):
                return {"ok": True, "detail": f"capability {capability}: refused: {refusal}", "refusal": refusal}
            return {**skip("torchao not installed"), "refusal": refusal}
        figures = _train(mixed_precision)
    finally:
        _reset_states()
        gc.collect()
        torch.cuda.empty_cache()
    timings[mixed_precision] = figures["ms_per_step"]
    if "no" in timings and mixed_precision != "no":
        figures["vs_fp32"] = figures["ms_per_step"] / timings["no"]
    expected = {"no": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(mixed_precision)
    problems = []
    if not (math.isfinite(figures["first_loss"]) and math.isfinite(figures["last_loss"])):
        problems.append(f"loss not finite: {figures['first_loss']} -> {figures['last_loss']}")
    elif figures["last_loss"] >= figures["first_loss"]:
        problems.append(f"loss did not decrease: {figures['first_loss']:.4f} -> {figures['last_loss']:.4f}")
    if figures["device"] != "cuda:0":
        problems.append(f"trained on {figures['device']}, expected cuda:0")
    if expected and figures["inner_dtype"] != expected:
        problems.append(f"first Linear returned {figures['inner_dtype']}, expected {expected}")
    if mixed_precision != "no" and figures["output_dtype"] != "torch.float32":
        problems.append(f"model output {figures['output_dtype']}, expected torch.float32")
    if (figures["grad_scaler"] is not None) != (mixed_precision == "fp16"):
        problems.append(f"grad scaler {figures['grad_scaler']} with {mixed_precision}")
    if mixed_precision == "fp8" and "Float8" not in figures["linear_class"]:
        problems.append(f"Linear layers not converted for fp8: {figures['linear_class']}")
    ratio = f", {figures['vs_fp32']:.2f}x fp32" if "vs_fp32" in figures else ""
    detail = (f"loss {figures['first_loss']:.4f} -> {figures['last_loss']:.4f}, inner {figures['inner_dtype']}, "
              f"{figures['ms_per_step']:.2f} ms/step{ratio}")  # fmt: skip
    return verdict(problems, detail, **figures)


# -- 5: device maps and offload onto cuda:0 -------------------------------------------------------


def _mlp(width: int, batch: int) -> tuple:
    """(build, a seeded reference model, an input, its output) for the offload checks."""
    import torch
    from torch import nn

    torch.set_float32_matmul_precision("highest")  # TF32 alone would miss atol=1e-4

    def build():
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])

    torch.manual_seed(0)
    reference = build().eval()
    x = torch.randn(batch, width)
    with torch.no_grad():
        expected = reference(x)
    return build, reference, x, expected


def check_dispatch() -> dict:
    import copy

    import torch
    from safetensors.torch import save_file

    from notebook_accel import (
        cpu_offload,
        dispatch_model,
        infer_auto_device_map,
        init_empty_weights,
        load_checkpoint_and_dispatch,
    )

    build, reference, x, expected = _mlp(1024, 4)
    full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    problems, figures = [], {"model_bytes": full_bytes}

    def run(label: str, model, base: int) -> None:
        with torch.no_grad():
            out = model(x)
        peak = torch.cuda.max_memory_allocated() - base
        figures[f"{label}_peak_bytes"] = peak
        figures[f"{label}_max_abs_diff"] = (out.cpu() - expected).abs().max().item()
        if not torch.allclose(out.cpu(), expected, atol=1e-4):
            problems.append(f"{label}: output differs by {figures[f'{label}_max_abs_diff']:.2e}")
        if peak >= full_bytes:
            problems.append(f"{label}: peak GPU memory {peak} bytes >= the whole model's {full_bytes}")

    def start() -> int:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "model.safetensors")
        save_file(reference.state_dict(), checkpoint)

        device_map = {"0": 0, "1": 0, "2": 0, "3": "cpu", "4": "cpu", "5": "disk", "6": "disk", "7": "disk"}
        base = start()
        with init_empty_weights():
            model = build()
        model = load_checkpoint_and_dispatch(model, checkpoint, device_map=device_map,
                                             offload_folder=os.path.join(tmp, "explicit"))  # fmt: skip
        placed = {name: str(model[int(name)].weight.device) for name in device_map}
        wanted = {name: "cuda:0" if d == 0 else "meta" for name, d in device_map.items()}
        if placed != wanted:
            problems.append(f"explicit map: parameters on {placed}, expected {wanted}")
        run("explicit_map", model, base)
        del model

        budget = {0: "13MiB", "cpu": "13MiB"}  # about 3 blocks each: some on the GPU, some on cpu and disk
        base = start()
        with init_empty_weights():
            model = build()
        model = load_checkpoint_and_dispatch(model, checkpoint, device_map="auto", max_memory=budget,
                                             offload_folder=os.path.join(tmp, "auto"))  # fmt: skip
        figures["auto_map"] = {k: str(v) for k, v in model.hf_device_map.items()}
        used = set(figures["auto_map"].values())
        if "0" not in used or not used & {"cpu", "disk"}:
            problems.append(f"auto map under {budget} did not split GPU/offload: {figures['auto_map']}")
        run("auto_map", model, base)
        del model

        base = start()
        model = copy.deepcopy(reference)
        planned = infer_auto_device_map(model, max_memory={0: "13MiB", "cpu": "1GiB"})
        figures["dispatch_model_map"] = {k: str(v) for k, v in planned.items()}
        run("dispatch_model", dispatch_model(model, planned), base)
        del model

        base = start()
        model = cpu_offload(copy.deepcopy(reference), execution_device=0)
        if any(p.device.type != "meta" for p in model.parameters()):
            problems.append("cpu_offload left parameters off the meta device")
        run("cpu_offload", model, base)
        del model

    detail = ("4 placements match the CPU reference; peak GPU memory (MiB) "
              + ", ".join(f"{k[:-11]} {v / 2**20:.1f}" for k, v in figures.items() if k.endswith("_peak_bytes"))
              + f" vs model {full_bytes / 2**20:.1f}")  # fmt: skip
    return verdict(problems, detail, **figures)


def check_staging() -> dict:
    """A disk-offloaded forward on cuda:0 with the read-ahead off and on: with it on, the next
    layer's weights are copied ahead (pinned memory, side stream: big_model/staging.py)."""
    import copy

    import torch

    from notebook_accel import disk_offload, init_empty_weights
    from notebook_accel.big_model import hooks, staging

    build, reference, x, expected = _mlp(2048, 8)
    staged = []
    stage = staging.CudaStager.stage

    def counted(self, tensors, release=None):
        staged.append(len(tensors))
        return stage(self, tensors, release)

    staging.CudaStager.stage = counted
    problems, figures = [], {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            disk_offload(copy.deepcopy(reference), os.path.join(tmp, "w"), execution_device=0)  # writes the folder
            for setting in ("0", "1", "0", "1"):
                hooks.PREFETCH = setting
                with init_empty_weights():
                    model = build().eval()
                model = disk_offload(model, os.path.join(tmp, "w"), execution_device=0)
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                times = []
                with torch.no_grad():
                    model(x)
                    for _ in range(5):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        out = model(x)
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                diff = (out.cpu() - expected).abs().max().item()
                if not torch.allclose(out.cpu(), expected, atol=1e-4):
                    problems.append(f"PREFETCH={setting}: output differs by {diff:.2e}")
                figures.setdefault(f"prefetch_{setting}_ms", []).append(1000 * statistics.median(times))
                figures[f"prefetch_{setting}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                del model
    finally:
        staging.CudaStager.stage = stage
        hooks.PREFETCH = os.environ.get("NOTEBOOK_ACCEL_PREFETCH", "1")
    figures["staged_calls"] = len(staged)
    if not staged:
        problems.append("the read-ahead never copied a layer to cuda:0 ahead")
    detail = (f"forward ms, read-ahead off {figures['prefetch_0_ms']}, on {figures['prefetch_1_ms']}; "
              f"peak GPU MiB off {figures['prefetch_0_peak_mib']:.1f}, on {figures['prefetch_1_peak_mib']:.1f}; "
              f"{len(staged)} layers staged")  # fmt: skip
    return verdict(problems, detail, **figures)


# -- running them ---------------------------------------------------------------------------------


def run_check(name: str, function, *args) -> dict:
    start = time.monotonic()
    try:
        result = function(*args)
    except Exception as exc:
        result = {"ok": False, "detail": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result = {"name": name, **result, "seconds": round(time.monotonic() - start, 2)}
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[result["ok"]]
    print(f"{word} {name}: {result['detail']}", flush=True)
    return result


def header(cuda: bool) -> dict:
    import torch

    from notebook_accel import hardware

    names = [d.name for d in hardware.accelerators() if d.kind == "cuda"]  # NVML: CUDA stays uninitialised
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
            "device_count": torch.cuda.device_count(), "devices": names, "python": sys.version.split()[0]}  # fmt: skip
    print(f"torch {info['torch']} | CUDA {info['cuda']} | {info['device_count']} device(s): "
          f"{', '.join(names) or 'none'}", flush=True)  # fmt: skip
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default: $OUT)")
    args = parser.parse_args(argv)
    # A developer's launch config file must not change what is checked.
    os.environ["NOTEBOOK_ACCEL_CONFIG_FILE"] = os.path.join(REPO, "no-such-gpu-check-config.yaml")
    import torch

    cuda = torch.cuda.is_available()
    info = header(cuda)
    timings: dict = {}

    def needs_cuda(function, *fargs):
        return (lambda: skip(NO_CUDA)) if not cuda else (lambda: function(*fargs))

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, RANKS_MODULE_NAME + ".py"), "w") as f:
            f.write(RANKS_MODULE)
        checks = [
            ("hardware_report_leaves_cuda_uninitialised", lambda: check_hardware_report(cuda)),
            ("launcher_leaves_cuda_uninitialised", needs_cuda(check_launcher, tmp)),
            ("fork_after_cuda_init_is_refused", needs_cuda(check_fork_refused, tmp)),
            ("results_arrive_on_cpu_and_gpu_ids_choose", needs_cuda(check_results_and_gpu_ids, tmp)),
            ("rank_device_memory_sampled_through_nvml", needs_cuda(check_rank_device_memory, tmp)),
            ("fsdp_cpu_offload_and_bf16_hook_on_two_gpus", needs_cuda(check_two_gpus, tmp)),
            ("stall_report_names_the_nccl_collective", needs_cuda(check_nccl_stall, tmp)),
            ("ray_rank_gets_its_own_gpu", needs_cuda(check_ray_gpu, tmp)),
            # Everything below initialises CUDA in this process, so it comes after the fresh children.
            ("training_step_fp32", needs_cuda(check_training, "no", timings)),
            ("training_step_bf16", needs_cuda(check_training, "bf16", timings)),
            ("training_step_fp16", needs_cuda(check_training, "fp16", timings)),
            ("training_step_fp8", needs_cuda(check_training, "fp8", timings)),
            ("dispatch_and_offload_to_cuda0", needs_cuda(check_dispatch)),
            ("offloaded_weights_copied_to_cuda0_ahead", needs_cuda(check_staging)),
        ]
        results = [run_check(name, function) for name, function in checks]

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump({"header": info, "checks": results}, f, indent=2, default=str)
    failed = [r["name"] for r in results if r["ok"] is False]
    print(f"{len(results) - len(failed)} of {len(results)} checks did not fail" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
