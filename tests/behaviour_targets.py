"""Functions run on 2 real gloo ranks by tests/test_behaviours.py (through notebook_launcher).

Each builds its own Accelerator and returns plain observations (tensors, lists, dicts, strings),
which the tests compare across ranks and against what accelerate's behaviour must give.
"""

import copy
import os
import pickle
import warnings

import torch
from accel_targets import make_data, make_model


def _reset_training_state():
    """A fresh Accelerator in the same process, keeping the process group (PartialState)."""
    from notebook_accel import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _gather_object(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RangeStream(torch.utils.data.IterableDataset):
    """0, 1, ..., n - 1 as one-element tensors: an iterable-style dataset."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.tensor([i]) for i in range(self.n))


# -- 1. join_uneven_inputs ------------------------------------------------------------------------


def join_with_override():
    """even_batches=True loaders, joined with even_batches=False: rank 0 gets one more batch."""
    from notebook_accel import Accelerator

    out = {}
    accelerator = Accelerator()  # even_batches=True
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = make_data(n=4 * 5)  # 5 batches of 4: 3 for rank 0 and 2 for rank 1 when uneven
    model, opt, train = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    dispatched = accelerator.prepare(torch.utils.data.DataLoader(RangeStream(8), batch_size=2))
    sharded = accelerator.prepare_data_loader(
        torch.utils.data.DataLoader(RangeStream(8), batch_size=2), device_placement=False
    )
    frozen = accelerator.prepare_model(make_model(seed=2), evaluation_mode=True)  # not DDP-wrapped
    out["loader_types"] = [type(dl).__name__ for dl in (train, dispatched, sharded)]
    out["train_len_before"] = len(train)
    out["even_before"] = train.batch_sampler.even_batches
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model, frozen], even_batches=False):
            out["even_inside"] = train.batch_sampler.even_batches
            out["train_len_inside"] = len(train)
            # The iterable loaders keep their (even) batching; read them while every rank is still in step.
            out["dispatched"] = [b.tolist() for b in dispatched]
            out["sharded"] = [b.tolist() for b in sharded]
            steps = 0
            for x, y in train:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
                steps += 1
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    out["steps"] = steps
    out["even_after"] = train.batch_sampler.even_batches
    out["train_len_after"] = len(train)
    out["accelerator_even_after"] = accelerator.even_batches
    out["params"] = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]

    # A multi-process run that is not DDP (accelerate's own test pretends FSDP): warned, block still runs.
    from notebook_accel.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP  # shadows the PartialState value
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with accelerator.join_uneven_inputs([model]):
                out["non_ddp_block_ran"] = True
    finally:
        del accelerator.state.distributed_type
    out["non_ddp_warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    return out


# -- 2. pickling an Accelerator -------------------------------------------------------------------


def pickle_round_trip():
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(32)), batch_size=4))
    restored = pickle.loads(pickle.dumps(accelerator))
    return {
        "equal": accelerator.state.__dict__ == restored.state.__dict__,
        "shared": restored.state.__dict__ is accelerator.state.__dict__,
        "gradient_shared": restored.gradient_state.__dict__ is accelerator.gradient_state.__dict__,
        "process_index": restored.process_index,
        "num_processes": restored.num_processes,
        "distributed_type": str(restored.distributed_type),
        "batches": [b.tolist() for b in restored._dataloaders[0]],
        "original_batches": [b.tolist() for b in loader],
    }


# -- 3. save_state / load_state with a folder per rank --------------------------------------------

EPOCHS = 2
STREAM_TAKEN = 2  # batches of each iterable loader read before the checkpoint


def _stateful_setup():
    from notebook_accel import Accelerator
    from notebook_accel.utils import DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = make_model(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train = torch.utils.data.DataLoader(make_data(n=40), batch_size=4, shuffle=True)  # 5 steps an epoch
    model, opt, train = accelerator.prepare(model, opt, train)
    dispatched = accelerator.prepare(torch.utils.data.DataLoader(RangeStream(24), batch_size=2))
    sharded = accelerator.prepare_data_loader(
        torch.utils.data.DataLoader(RangeStream(24), batch_size=2), device_placement=False
    )
    return accelerator, model, opt, train, [dispatched, sharded]


def _train(accelerator, model, opt, train, stop_after=None):
    """Train from wherever `train` stands; returns the batches seen (stops after stop_after steps)."""
    seen = []
    for _ in range(train.iteration, EPOCHS):
        for x, y in train:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            seen.append((x.clone(), round(loss.item(), 6)))
            if stop_after is not None and len(seen) == stop_after:
                return seen
    return seen


def _snapshot(accelerator, model, opt):
    return {
        "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
        "optimizer": copy.deepcopy(opt.state_dict()),  # its tensors are the live ones: copy them
    }


def per_rank_folders(base, stop_after):
    """Interrupted run (saves to base/rank{i} mid-epoch), resumed run, uninterrupted run."""
    out = {}
    rank = int(os.environ["RANK"])
    folder = os.path.join(base, f"rank{rank}")

    accelerator, model, opt, train, streams = _stateful_setup()
    out["stream_head"] = []
    for stream in streams:
        taken = []
        for batch in stream:
            taken.append(batch.tolist())
            if len(taken) == STREAM_TAKEN:
                break
        out["stream_head"].append(taken)
    out["first_part"] = _train(accelerator, model, opt, train, stop_after)
    out["saved_path"] = accelerator.save_state(folder)
    out["at_save"] = _snapshot(accelerator, model, opt)
    accelerator.wait_for_everyone()
    out["files"] = sorted(os.listdir(folder))

    _reset_training_state()
    accelerator, model, opt, train, streams = _stateful_setup()
    accelerator.load_state(folder)
    out["after_load"] = _snapshot(accelerator, model, opt)
    out["stream_rest"] = [[b.tolist() for b in stream] for stream in streams]
    out["second_part"] = _train(accelerator, model, opt, train)
    out["resumed_end"] = _snapshot(accelerator, model, opt)

    _reset_training_state()
    accelerator, model, opt, train, streams = _stateful_setup()
    out["stream_full"] = [[b.tolist() for b in stream] for stream in streams]
    out["full"] = _train(accelerator, model, opt, train)
    out["full_end"] = _snapshot(accelerator, model, opt)
    return out


# -- 4. DDP communication hooks -------------------------------------------------------------------


def _hook_accelerator(**handler):
    from notebook_accel import Accelerator
    from notebook_accel.utils import DistributedDataParallelKwargs

    return Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(**handler)])


def train_with_hook(handler, steps=12):
    """Train on rank-specific data with the hook `handler` names; grads gathered after each backward."""
    accelerator = _hook_accelerator(**handler)
    rank = accelerator.process_index
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    model, opt = accelerator.prepare(model, opt)
    data = make_data(n=64, seed=3)
    x_all, y_all = data.tensors
    x, y = x_all[rank * 32 : (rank + 1) * 32], y_all[rank * 32 : (rank + 1) * 32]

    def full_loss():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(accelerator.unwrap_model(model)(x_all), y_all).item()

    out = {"loss_before": full_loss(), "grads": [], "hooks": []}
    for hook, state in getattr(model, "_comm_hooks", []):  # private torch surface: [] means "cannot observe"
        out["hooks"].append(
            (
                getattr(hook, "__name__", type(hook).__name__),
                type(state).__name__,
                getattr(state, "matrix_approximation_rank", None),
                getattr(state, "start_powerSGD_iter", None),
            )
        )
        out["state"] = state
    for _ in range(steps):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        out["grads"].append(accelerator.gather(grads.unsqueeze(0)))
        opt.step()
        opt.zero_grad()
    out["loss_after"] = full_loss()
    state = out.pop("state", None)
    if hasattr(state, "compression_stats"):
        out["compressed_numel"] = state.compression_stats()[2]
    return out


def hook_errors(cases):
    """The error prepare() raises on this rank for each handler in `cases` (None: no error)."""
    out = []
    for handler in cases:
        _reset_training_state()
        accelerator = _hook_accelerator(**handler)
        try:
            accelerator.prepare(make_model())
            out.append(None)
        except Exception as exc:  # the test checks the type and the message
            out.append((type(exc).__name__, str(exc)))
    return out
