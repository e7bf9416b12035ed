"""Functions run on real gloo ranks by tests/test_local_sgd_and_profile.py (through notebook_launcher).

Each builds its own Accelerator and returns plain observations for the test to compare across ranks.
"""

import os

import torch


def _params(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def local_sgd_run(local_sgd_steps: int, steps: int) -> dict:
    """Train one model with LocalSGD on rank-specific data; record the parameters after every step,
    and the mean across ranks of the parameters just before each step's averaging."""
    from notebook_accel import Accelerator
    from notebook_accel.local_sgd import LocalSGD

    accelerator = Accelerator()
    torch.manual_seed(0)  # the same start on every rank
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    generator = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    after, mean_before = [], []
    with LocalSGD(accelerator, model, local_sgd_steps=local_sgd_steps) as local_sgd:
        for _ in range(steps):
            x = torch.randn(8, 3, generator=generator)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            mean_before.append(accelerator.reduce(_params(model), reduction="mean"))
            local_sgd.step()
            after.append(_params(model))
    final = _params(model)
    return {"rank": rank, "after": after, "mean_before": mean_before, "final": final,
            "enabled": local_sgd.enabled, "num_steps": local_sgd.num_steps}


def profile_run(trace_dir: str) -> dict:
    """Profile a matmul under Accelerator.profile with a trace folder; report what the profiler saw."""
    from notebook_accel import Accelerator
    from notebook_accel.utils import ProfileKwargs

    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir=trace_dir)])
    with accelerator.profile() as prof:
        torch.mm(torch.ones(16, 16), torch.ones(16, 16))
    ops = {event.key for event in prof.key_averages()}
    return {"rank": accelerator.process_index, "saw_mm": "aten::mm" in ops,
            "files": sorted(os.listdir(trace_dir))}


def init_kwargs_run(rendezvous_file: str) -> dict:
    """Create the process group through InitProcessGroupKwargs; report what torch was given."""
    from datetime import timedelta

    import torch.distributed as dist

    from notebook_accel import Accelerator
    from notebook_accel.utils import InitProcessGroupKwargs

    assert not dist.is_initialized()
    handler = InitProcessGroupKwargs(backend="gloo", init_method=f"file://{rendezvous_file}", timeout=timedelta(seconds=55))
    accelerator = Accelerator(kwargs_handlers=[handler])
    out = {"rank": accelerator.process_index, "backend": dist.get_backend(),
           "file_used": os.path.exists(rendezvous_file)}
    group = dist.distributed_c10d._get_default_group()
    try:
        out["timeout"] = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # private torch surface: None means "cannot observe"
        out["timeout"] = None
    accelerator.wait_for_everyone()
    return out


def state_pre_hooks_run(folder: str) -> dict:
    """Save with a pre-hook that edits the weights and, on the main process, writes a file into the
    folder being written; then load with a pre-hook that reads it. Report what each hook saw."""
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    rank = accelerator.process_index
    seen = {"rank": rank}

    def save_hook(models, weights, output_dir):
        seen["save"] = (len(models), sorted(weights[0]), os.path.basename(output_dir), os.path.isdir(output_dir))
        weights[0]["bias"] = torch.tensor([7.0])
        if accelerator.is_main_process:
            with open(os.path.join(output_dir, "extra.txt"), "w") as f:
                f.write("written by the hook")

    def load_hook(models, input_dir):
        with open(os.path.join(input_dir, "extra.txt")) as f:
            seen["load"] = (len(models), input_dir == os.path.abspath(folder), f.read())

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_state(folder)
    seen["files"] = sorted(os.listdir(folder))
    accelerator.load_state(folder)
    seen["bias"] = accelerator.unwrap_model(model).bias.tolist()
    return seen
