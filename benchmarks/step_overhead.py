"""Time per training step: an Accelerator loop against a hand-written DDP loop, same model, data
and ranks, alternating blocks in one run (and accelerate's Accelerator when it is installed).

    python benchmarks/step_overhead.py [--ranks 2] [--rounds 12] [--steps 40] [--json PATH]
    python benchmarks/step_overhead.py --panel [--pairs 4]    # the launch panel on vs off
    python benchmarks/step_overhead.py --panel-windows --rounds 150 --steps 10   # within one launch

--panel: launches alternate between "on" (a LaunchPanel sink redrawing 10 times a second, and the
launcher sampling every rank's resources once a second) and "off" (console sink, no sampling), so
what a live panel costs the ranks shows as the ratio of their step times.
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


def run(rounds: int, steps: int, with_accelerate: bool, stamps: bool = False):
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
    when = {name: [] for name in blocks}  # (start, end) wall clock of each block: --panel-windows
    for _ in range(rounds):
        for name, block in (("ddp", lambda: _time_block(raw_step, raw_batches)), ("ours", ours_block),
                            ("accelerate", theirs)):  # fmt: skip
            if block is None:
                continue
            dist.barrier()
            start = time.time()
            blocks[name].append(block())
            when[name].append((start, time.time()))
    return {"blocks": blocks, "when": when} if stamps else blocks


def panel_ab(args) -> dict:
    """Median step time per launch, panel on and off, launches alternating (off first)."""
    from notebook_accel import notebook_launcher
    from notebook_accel.jupyter.panel import LaunchPanel
    from notebook_accel.launch import ConsoleSink, resources

    sampling = resources.INTERVAL_S
    medians = {"off": [], "on": []}
    for pair in range(args.pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            resources.INTERVAL_S = sampling if mode == "on" else float("inf")
            sink = LaunchPanel(show=False) if mode == "on" else ConsoleSink()
            cpu, wall = time.process_time(), time.perf_counter()  # the parent's CPU: what it could take from ranks
            results = notebook_launcher(run, (args.rounds, args.steps, False), num_processes=args.ranks,
                                        use_port="auto", start_method="forkserver", sinks=[sink])  # fmt: skip
            sink.close()
            row = {k: statistics.median(v) for k, v in results[0].items() if v}
            row["parent_cpu"] = (time.process_time() - cpu) / (time.perf_counter() - wall)
            medians[mode].append(row)
    resources.INTERVAL_S = sampling
    print(f"\nPanel on vs off, {args.ranks} ranks, {args.pairs} pairs of launches, each {args.rounds} blocks "
          f"of {args.steps} steps (median over launches of the median ms/step, rank 0):\n")  # fmt: skip
    print("| loop | panel off | panel on | ratio on / off |\n|---|---|---|---|")
    for loop in ("ddp", "ours"):
        off = statistics.median(m[loop] for m in medians["off"])
        on = statistics.median(m[loop] for m in medians["on"])
        print(f"| {loop} | {off * 1e3:.3f} | {on * 1e3:.3f} | {on / off:.3f} |")
    cpu = {mode: statistics.median(m["parent_cpu"] for m in medians[mode]) for mode in medians}
    print(f"\nThe launching process's CPU while the ranks train (% of one core): off {cpu['off'] * 100:.2f}, "
          f"on {cpu['on'] * 100:.2f}")  # fmt: skip
    return medians


def panel_windows(args) -> dict:
    """One launch with the panel: its redraws and the resource sampling are switched off and on
    every WINDOW_S seconds by the launching process, and each block of steps is counted under the
    window it ran in (blocks that straddle a switch are left out). Both halves share the launch,
    so launch-to-launch differences (+-10 % on this machine) do not enter the ratio."""
    import threading

    from notebook_accel import notebook_launcher
    from notebook_accel.jupyter.panel import LaunchPanel
    from notebook_accel.launch import resources

    on = threading.Event()
    switches = []  # (wall time, on after it)
    flush, sample = LaunchPanel.flush, resources.ResourceSampler.sample

    def sample_when_on(self, now, live):
        if on.is_set():
            return sample(self, now, live)
        self.next_at = now + self.interval  # skipped, but due() must not stay true: the loop would spin
        return []

    LaunchPanel.flush = lambda self: flush(self) if on.is_set() else None
    resources.ResourceSampler.sample = sample_when_on
    finished = threading.Event()

    def switch():
        while not finished.is_set():
            if on.is_set():
                on.clear()
            else:
                on.set()
            switches.append((time.time(), on.is_set()))
            finished.wait(args.window)

    toggler = threading.Thread(target=switch, daemon=True)
    toggler.start()
    sink = LaunchPanel(show=False)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        out = notebook_launcher(run, (args.rounds, args.steps, False, True), num_processes=args.ranks,
                                use_port="auto", start_method="forkserver", sinks=[sink])[0]  # fmt: skip
    finally:
        finished.set()
        toggler.join()
        sink.close()
        LaunchPanel.flush, resources.ResourceSampler.sample = flush, sample
    parent_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
    ends = [t for t, _ in switches[1:]] + [float("inf")]
    windows = [(t, end, state) for (t, state), end in zip(switches, ends)]
    split: dict = {}
    by_window: dict = {}  # loop -> window index -> s/step of its blocks
    for loop, spans in out["when"].items():
        for (start, end), seconds in zip(spans, out["blocks"][loop]):
            inside = [(i, state) for i, (low, high, state) in enumerate(windows) if low <= start and end <= high]
            if inside:
                split.setdefault(loop, {"on": [], "off": []})["on" if inside[0][1] else "off"].append(seconds)
                by_window.setdefault(loop, {}).setdefault(inside[0][0], []).append(seconds)
    # Each "on" window against the "off" windows either side of it: slow drifts cancel out.
    paired: dict = {}
    for loop, found in by_window.items():
        for i, (_, _, state) in enumerate(windows):
            sides = [statistics.median(found[j]) for j in (i - 1, i + 1) if j in found]
            if state and i in found and sides:
                paired.setdefault(loop, []).append(statistics.median(found[i]) / statistics.mean(sides))
    print(f"\nPanel on vs off within one launch, {args.ranks} ranks, switched every {args.window:g} s; "
          f"{args.rounds} rounds of {args.steps}-step blocks (median ms/step over the blocks in each, rank 0):\n")  # fmt: skip
    print("| loop | blocks off, on | panel off | panel on | ratio on / off | median ratio, each on window / the off windows beside it |")
    print("|---|---|---|---|---|---|")
    for loop, halves in split.items():
        off, on_ = statistics.median(halves["off"]), statistics.median(halves["on"])
        pairs = paired.get(loop, [])
        near = f"{statistics.median(pairs):.3f} ({len(pairs)} windows)" if pairs else "-"
        print(f"| {loop} | {len(halves['off'])}, {len(halves['on'])} | {off * 1e3:.3f} | {on_ * 1e3:.3f} | {on_ / off:.3f} | {near} |")
    print(f"\nThe launching process's CPU over the launch (% of one core, both halves): {parent_cpu * 100:.2f}")
    return {"split": split, "paired": paired, "switches": switches, "parent_cpu": parent_cpu}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--panel", action="store_true", help="the launch panel on vs off, alternating launches")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--panel-windows", action="store_true",
                        help="the panel switched off and on every --window s within one launch")  # fmt: skip
    parser.add_argument("--window", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.panel_windows:
        found = panel_windows(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": args.ranks, **found}, f, indent=2)
        return 0
    if args.panel:
        medians = panel_ab(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": args.ranks, "panel": medians}, f, indent=2)
        return 0
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
