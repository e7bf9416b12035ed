"""Time per training step: an Accelerator loop against a hand-written DDP loop, same model, data
and ranks, alternating blocks in one run (and accelerate's Accelerator when it is installed).

    python benchmarks/step_overhead.py [--ranks 2] [--rounds 12] [--steps 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

BATCH, FEATURES, HIDDEN = 64, 256, 512


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 10),
    )  # fmt: skip


def _loader(rank: int, world: int, steps: int):
    g = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(steps * BATCH * world, FEATURES, generator=g),
                                          torch.randint(0, 10, (steps * BATCH * world,), generator=g))  # fmt: skip
    return data


def _time_block(step, batches) -> float:
    start = time.perf_counter()
    n = 0
    for x, y in batches:
        step(x, y)
        n += 1
    return (time.perf_counter() - start) / n


def _accelerator_loop(accelerator, model, opt, loader):
    """One block: an epoch of the loader through `accelerator` (ours or accelerate's); s/step."""

    def block() -> float:
        start = time.perf_counter()
        n = 0
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            n += 1
        return (time.perf_counter() - start) / n

    return block


def run(rounds: int, steps: int, with_accelerate: bool):
    import torch.distributed as dist

    from notebook_accel import Accelerator, PartialState

    state = PartialState()
    rank, world = state.process_index, state.num_processes
    data = _loader(rank, world, steps)

    # hand-written DDP: a DistributedSampler loader, iterated live as in any real loop
    raw_model = torch.nn.parallel.DistributedDataParallel(_model())
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    raw_batches = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)

    def raw_step(x, y):
        loss = torch.nn.functional.cross_entropy(raw_model(x), y)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()

    accelerator = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=BATCH))

    ours_block = _accelerator_loop(accelerator, model, opt, loader)

    blocks = {"ddp": [], "ours": []}
    theirs = None
    if with_accelerate:
        try:
            import accelerate

            theirs_acc = accelerate.Accelerator(cpu=True)
            t_model = _model()
            t_opt = torch.optim.SGD(t_model.parameters(), lr=0.01)
            t_model, t_opt, t_loader = theirs_acc.prepare(t_model, t_opt, torch.utils.data.DataLoader(data, batch_size=BATCH))

            theirs = _accelerator_loop(theirs_acc, t_model, t_opt, t_loader)
            blocks["accelerate"] = []
        except ImportError:
            theirs = None

    _time_block(raw_step, raw_batches)  # warm-up: one epoch of each
    ours_block()
    if theirs is not None:
        theirs()
    for _ in range(rounds):
        dist.barrier()
        blocks["ddp"].append(_time_block(raw_step, raw_batches))
        dist.barrier()
        blocks["ours"].append(ours_block())
        if theirs is not None:
            dist.barrier()
            blocks["accelerate"].append(theirs())
    return blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from notebook_accel import notebook_launcher

    results = notebook_launcher(run, (args.rounds, args.steps, not args.no_accelerate),
                                num_processes=args.ranks, use_port="auto", start_method="forkserver")  # fmt: skip
    rank0 = results[0]
    med = {k: statistics.median(v) for k, v in rank0.items() if v}
    print(f"\nStep time, {args.ranks} ranks, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-10, batch {BATCH}/rank, "
          f"{args.rounds} alternating blocks of {args.steps} steps (median ms/step, rank 0):\n")  # fmt: skip
    print("| loop | ms/step | ratio to hand-written DDP |\n|---|---|---|")
    for name, value in med.items():
        print(f"| {name} | {value * 1e3:.3f} | {value / med['ddp']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "blocks": rank0, "median": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
