"""FSDP2 on CPU ranks (gloo): memory each rank adds and time per step, our Accelerator against DDP,
a hand-written `fully_shard` loop and accelerate, on a ~100 M-parameter residual MLP with AdamW.

    python benchmarks/fsdp.py [--ranks 2 4] [--mem-steps 3] [--mem-rounds 1] [--rounds 3]
                              [--steps 1] [--no-accelerate] [--no-save] [--json PATH]

Memory: every configuration is a fresh launch (a forkserver child per rank). A thread in each rank
reads RssAnon from /proc/self/status every 2 ms; figures are the peak minus a baseline taken after
the process group exists and before the model does (pages the rank shares copy-on-write with the
server are in both, so they cancel). "prepare" is building the model and optimizer and preparing
(or wrapping / sharding) them; "train" is `--mem-steps` steps from the first. The FSDP launch then
times a sharded `accelerator.save_state` (peak added against the rank's shard: parameters plus
optimizer state it holds); the DDP launch times rank 0's `torch.save` of the full model and
optimizer state dicts, and our `save_state` of the DDP run.

Step time: one launch per rank count holds our FSDP model and a hand-written `fully_shard` model
(same init, data and wrapping: each residual block, then the root) and alternates blocks of
`--steps` steps for `--rounds` rounds; medians. Both run under the allocator setting our prepare
applies (process-wide), so the ratio is the library's own overhead; the cost of that setting is
the "fully_shard" against "fully_shard+fix" memory launches (the same hand loop without and with it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

WIDTH, HIDDEN, BLOCKS, BATCH = 1024, 2048, 24, 16
SAMPLE_S = 0.002
MIB = 2**20


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class ResidualMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model():
    torch.manual_seed(0)
    return ResidualMLP()


def _batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """RssAnon every SAMPLE_S in a thread, so peaks inside a step are seen, not only between steps."""

    def __init__(self):
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(SAMPLE_S):
            value = rss_anon()
            if value > self.peak:
                self.peak = value

    def phase(self) -> int:
        """Start a phase: the peak restarts from now; returns RssAnon now."""
        now = rss_anon()
        self.peak = now
        return now

    def close(self):
        self._stop.set()
        self._thread.join()


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _shard_bytes(model, optimizer) -> int:
    states = [v for s in optimizer.state.values() for v in s.values()]
    return _local_bytes(model.parameters()) + _local_bytes(states)


def _plugin():
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )


def _hand_fully_shard(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _build(config):
    """(model, optimizer, backward, accelerator or None) for one configuration, on this rank."""
    import torch.distributed as dist

    if config in ("ddp", "fsdp"):
        from notebook_accel import Accelerator

        accelerator = Accelerator(fsdp_plugin=_plugin() if config == "fsdp" else None)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # built before prepare, as users do
        model, opt = accelerator.prepare(model, opt)
        return model, opt, accelerator.backward, accelerator
    if config == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = accelerator.prepare(model, opt)
        return model, opt, accelerator.backward, accelerator
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if config == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(_model())
    else:  # fully_shard, fully_shard+fix
        model = _hand_fully_shard(_model())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Tensor.backward, None


def _init_group(config):
    """The process group (and accelerate's or our state) before the baseline, so it is not counted."""
    import torch.distributed as dist

    if config == "accelerate":
        from accelerate import PartialState

        PartialState(cpu=True)
    elif config in ("ddp", "fsdp"):
        from notebook_accel import PartialState

        PartialState()
    else:
        dist.init_process_group("gloo")
    if config == "fully_shard+fix":
        from notebook_accel import fsdp

        fsdp.return_freed_host_memory()
    dist.barrier()


def _step(model, opt, backward, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    backward(loss)
    opt.step()
    opt.zero_grad()


def run_memory(config: str, steps: int, save_dir):
    import torch.distributed as dist

    _init_group(config)
    rank = dist.get_rank()
    sampler = PeakSampler()
    base = sampler.phase()
    model, opt, backward, accelerator = _build(config)
    out = {"prepare_peak": sampler.peak - base, "after_prepare": rss_anon() - base}
    x, y = _batch(rank)
    dist.barrier()
    sampler.phase()
    times, ends, faults, system = [], [], [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        _step(model, opt, backward, x, y)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - before.ru_minflt)  # this process's, the sampler thread's included
        system.append(after.ru_stime - before.ru_stime)
        ends.append(rss_anon() - base)
    out.update(train_peak=sampler.peak - base, step_s=times, after_step=ends, shard=_shard_bytes(model, opt),
               minflt=faults, sys_s=system)  # fmt: skip
    if save_dir and config in ("ddp", "fsdp"):
        out.update(_save(config, model, opt, accelerator, sampler, save_dir, rank))
    sampler.close()
    return out


def _save(config, model, opt, accelerator, sampler, save_dir, rank):
    import torch.distributed as dist

    out = {}
    folder = os.path.join(save_dir, f"{config}-state")
    dist.barrier()
    before = sampler.phase()
    start = time.perf_counter()
    accelerator.save_state(folder)
    dist.barrier()
    out.update(save_state_s=time.perf_counter() - start, save_state_peak=sampler.peak - before)
    if config == "ddp":
        dist.barrier()
        if rank == 0:
            before = sampler.phase()
            start = time.perf_counter()
            state = {"model": accelerator.unwrap_model(model).state_dict(), "optimizer": opt.state_dict()}
            torch.save(state, os.path.join(save_dir, "full.pt"))
            out.update(torch_save_s=time.perf_counter() - start, torch_save_peak=sampler.peak - before)
            del state
        dist.barrier()
    return out


def run_timing(rounds: int, steps: int):
    """Our FSDP loop and a hand-written fully_shard loop in one launch, alternating blocks of steps."""
    import torch.distributed as dist

    _init_group("fsdp")
    rank = dist.get_rank()
    x, y = _batch(rank)
    ours = _build("fsdp")[:3]
    hand = _build("fully_shard")[:3]
    loops = {"ours": ours, "fully_shard": hand}
    for model, opt, backward in loops.values():  # warm-up
        _step(model, opt, backward, x, y)
    blocks = {name: [] for name in loops}
    for i in range(rounds):
        order = list(loops) if i % 2 == 0 else list(reversed(loops))
        for name in order:
            model, opt, backward = loops[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, opt, backward, x, y)
            blocks[name].append((time.perf_counter() - start) / steps)
    return blocks


def _launch(function, args, world):
    from notebook_accel import notebook_launcher
    from notebook_accel.launch.sinks import ListSink

    return notebook_launcher(function, args, num_processes=world, use_port="auto", cpu=True,
                             start_method="forkserver", sinks=[ListSink()])  # fmt: skip


def _mb(value) -> str:
    return f"{value / MIB:.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--mem-rounds", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    configs = ["ddp", "fsdp", "fully_shard", "fully_shard+fix", "torch_ddp"]
    if not args.no_accelerate:
        try:
            import accelerate  # noqa: F401

            configs.append("accelerate")
        except ImportError:
            pass
    params = sum(p.numel() for p in ResidualMLP().parameters())
    report = {"params": params, "ranks": {}}
    for world in args.ranks:
        mem = {c: [] for c in configs}
        for r in range(args.mem_rounds):
            for config in configs if r % 2 == 0 else reversed(configs):
                save_dir = None if args.no_save else tempfile.mkdtemp(prefix="fsdp-bench-")
                try:
                    mem[config].append(_launch(run_memory, (config, args.mem_steps, save_dir), world))
                finally:
                    if save_dir:
                        shutil.rmtree(save_dir, ignore_errors=True)
                print(f"  {world} ranks, {config}: done", flush=True)
        timing = _launch(run_timing, (args.rounds, args.steps), world)[0]
        report["ranks"][world] = {"memory": mem, "timing": timing}
        if args.json:  # after each rank count, so a failure later keeps what was measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        _print(world, params, mem, timing, args)
    return 0


def _print(world, params, mem, timing, args):
    def worst(config, key):
        values = [rank[key] for run in mem[config] for rank in run if key in rank]
        return max(v[-1] if isinstance(v, list) else v for v in values)

    def step_median(config, key="step_s"):  # steps after the first, every rank and round
        return statistics.median(t for run in mem[config] for rank in run for t in rank.get(key, [0, 0])[1:])

    print(f"\n{world} ranks, residual MLP {BLOCKS} x ({WIDTH}-{HIDDEN}-{WIDTH}), {params / 1e6:.1f} M parameters "
          f"({params * 4 / MIB:.0f} MiB fp32), AdamW, batch {BATCH}/rank; MiB of RssAnon added, worst rank, "
          f"{args.mem_steps} steps, {args.mem_rounds} launch(es) each:\n")  # fmt: skip
    print("| configuration | prepare peak | train peak | after last step | shard held | s/step | "
          "minor faults/step | system s/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for config in mem:
        print(f"| {config} | {_mb(worst(config, 'prepare_peak'))} | {_mb(worst(config, 'train_peak'))} | "
              f"{_mb(worst(config, 'after_step'))} | {_mb(worst(config, 'shard'))} | {step_median(config):.3f} | "
              f"{step_median(config, 'minflt'):.0f} | {step_median(config, 'sys_s'):.2f} |")  # fmt: skip
    print(
        "\n(s/step, faults and system time: medians over ranks of steps 2 and later; each rank's own figures)"
    )
    ratio = worst("fsdp", "train_peak") / worst("ddp", "train_peak")
    target = 0.6 if world == 2 else 0.4
    print(
        f"\n- train peak FSDP / DDP (ours): {ratio:.2f} (target <= {target}: {'met' if ratio <= target else 'NOT met'})"
    )
    print(f"- train peak hand fully_shard / DDP: {worst('fully_shard', 'train_peak') / worst('ddp', 'train_peak'):.2f}; "
          f"with the fix: {worst('fully_shard+fix', 'train_peak') / worst('ddp', 'train_peak'):.2f}")  # fmt: skip
    print(f"- step time hand fully_shard+fix / fully_shard (separate launches): "
          f"{step_median('fully_shard+fix') / step_median('fully_shard'):.2f}")  # fmt: skip
    med = {k: statistics.median(v) for k, v in timing.items()}
    r = med["ours"] / med["fully_shard"]
    print(f"- step time ours FSDP / hand fully_shard (one launch, {args.rounds} alternating blocks of {args.steps}): "
          f"{med['ours']:.3f} / {med['fully_shard']:.3f} s = {r:.3f} (target <= 1.05: {'met' if r <= 1.05 else 'NOT met'})")  # fmt: skip
    if not args.no_save and mem["fsdp"][0] and "save_state_s" in mem["fsdp"][0][0]:
        for run in mem["fsdp"][:1]:
            worst_ratio = max(rank["save_state_peak"] / rank["shard"] for rank in run)
            print(f"- FSDP save_state: {max(rank['save_state_s'] for rank in run):.2f} s, peak added "
                  f"{_mb(max(rank['save_state_peak'] for rank in run))} MiB = {worst_ratio:.2f}x the rank's shard "
                  f"(target <= 1.2: {'met' if worst_ratio <= 1.2 else 'NOT met'})")  # fmt: skip
        ddp0 = mem["ddp"][0][0]
        print(f"- rank 0 torch.save of the full model + optimizer state: {ddp0['torch_save_s']:.2f} s "
              f"(peak added {_mb(ddp0['torch_save_peak'])} MiB); our DDP save_state: {ddp0['save_state_s']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
