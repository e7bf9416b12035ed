"""Launch latency of engine="ray" on a two-node Ray cluster, against Ray Train's TorchTrainer and the raw cost of Ray's actors, measured in the same run.

The cluster is Ray's own multi-node harness on this machine (ray.cluster_utils.Cluster, as
tests/test_ray_engine.py makes it): a head of 1 CPU and a second node of 1 CPU, this process
connected as the driver. Every configuration puts one process on each node (STRICT_SPREAD):

- ours: `notebook_launcher(fn, num_processes=2, engine="ray", placement="strict_spread",
  sinks=[a sink that drops every event])`; fn joins the gloo group through our `PartialState`,
  all_reduces one tensor and returns (the group is left when the rank ends).
- TorchTrainer: Ray Train's `TorchTrainer(fn, ScalingConfig(num_workers=2, use_gpu=False,
  placement_strategy="STRICT_SPREAD"), RunConfig(storage_path=a temp dir))`, the wall time of
  `fit()`; Ray Train joins the group before fn and leaves it after; fn all_reduces the same tensor.
- raw actors: the floor any actor-based launch pays: a STRICT_SPREAD placement group of 2 bundles,
  2 actors of a trivial class in it, one method call on each, the actors killed and the group
  removed, until Ray's available resources no longer show the group (what our launch waits for).
- raw actors + import torch: the same, the method importing torch (what every rank does here).

Our actors are NOT reused between launches: each launch creates its placement group and fresh
actors and kills them at the end (starters/ray_engine.py). The script checks it: the ranks' pids
over all our launches are counted.

After one untimed launch of each configuration, `--reps` rounds run every configuration once each
(round-robin, so background load spreads over all of them); between two samples the script waits,
untimed, until the cluster's CPUs are all free and no placement group is left, then 1 s more. One more launch of
ours with a sink that timestamps the events splits it into phases.

    python benchmarks/ray_engine.py [--reps 7] [--no-torch-floor] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import timing  # benchmarks/timing.py: run as `python benchmarks/NAME.py`

LAUNCH_TIMEOUT_S = 180
SETTLE_TIMEOUT_S = 60.0
PAUSE_S = 1.0  # untimed, after the cluster has settled: processes that a launch left exiting finish
TARGET = 0.5  # the bar: ours / TorchTrainer


# -- the work ---------------------------------------------------------------------------------
def reduce_one() -> dict:
    """The body both launchers run once the process group exists: all_reduce one tensor."""
    import ray
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size() == 2, t
    return {"rank": dist.get_rank(), "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}


def ours_work() -> dict:
    from notebook_accel import PartialState

    PartialState()  # joins the gloo group the launcher described
    return reduce_one()


def trainer_work() -> None:
    reduce_one()  # Ray Train has joined the group; a failed assert fails fit()


class FloorActor:
    def ping(self, with_torch: bool) -> int:
        if with_torch:
            import torch  # noqa: F401
        return os.getpid()


# -- launching --------------------------------------------------------------------------------
class DropSink:
    """A sink that drops every event: the launch's own cost, no console or panel."""

    def handle(self, event) -> None:
        pass

    def attach(self, control) -> None:
        pass

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass


class StampSink(DropSink):
    """Keeps each event's kind and the monotonic time it arrived (the phase breakdown)."""

    def __init__(self):
        self.stamps: list = []

    def handle(self, event) -> None:
        self.stamps.append((type(event).__name__, time.monotonic()))


def launch_ours(seen: list, sink=None) -> None:
    from notebook_accel import notebook_launcher

    out = notebook_launcher(
        ours_work, num_processes=2, engine="ray", placement="strict_spread", sinks=[sink or DropSink()]
    )
    assert [r["rank"] for r in out] == [0, 1] and out[0]["node"] != out[1]["node"], out
    seen.extend(r["pid"] for r in out)


def launch_trainer(storage: str, count: list) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    count.append(None)
    trainer = TorchTrainer(
        trainer_work,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name=f"bench-{len(count)}", storage_path=storage),
    )
    start = time.perf_counter()
    result = trainer.fit()
    elapsed = time.perf_counter() - start
    assert result.error is None, result.error
    return elapsed


def launch_raw_actors(ray, actor_class, with_torch: bool) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    ray.get(group.ready())
    actors = [
        actor_class.options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote()
        for i in range(2)
    ]
    ray.get([a.ping.remote(with_torch) for a in actors])
    for a in actors:
        ray.kill(a, no_restart=True)
    remove_placement_group(group)
    mark = group.id.hex()
    while any(mark in name for name in ray.available_resources()):
        time.sleep(0.01)


def timed(call) -> float:
    return timing.timed(call, LAUNCH_TIMEOUT_S)


def settle(ray) -> float:
    """Wait (untimed in the samples) until every CPU is free and no placement group is left."""
    from ray.util.placement_group import placement_group_table

    start = time.monotonic()
    while time.monotonic() - start < SETTLE_TIMEOUT_S:
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not groups and ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU"):
            break
        time.sleep(0.05)
    waited = time.monotonic() - start
    time.sleep(PAUSE_S)
    return waited


# -- the benchmark ----------------------------------------------------------------------------
def measure(ray, reps: int, torch_floor: bool, storage: str) -> dict:
    floor_actor = ray.remote(FloorActor)
    pids: list = []
    fits: list = []
    configs = {
        "ours": lambda: launch_ours(pids),
        "TorchTrainer": lambda: launch_trainer(storage, fits),
        "raw actors": lambda: launch_raw_actors(ray, floor_actor, False),
    }
    if torch_floor:
        configs["raw actors + import torch"] = lambda: launch_raw_actors(ray, floor_actor, True)
    samples: dict = {name: [] for name in configs}
    first: dict = {}
    settles: list = []
    errors: dict = {}
    for name, call in configs.items():  # one untimed launch of each (reported apart)
        try:
            first[name] = timed(call)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            errors[name] = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            )
        settles.append(settle(ray))
    print("warm-up done", file=sys.stderr, flush=True)
    for rep in range(reps):
        for name, call in configs.items():
            if name in errors:
                continue
            try:
                samples[name].append(timed(call))
            except BaseException as exc:  # keep measuring the others; report what went wrong
                if isinstance(exc, KeyboardInterrupt):
                    raise
                errors[name] = (
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                )
            settles.append(settle(ray))
        print(f"round {rep + 1} done", file=sys.stderr, flush=True)
    stamp = StampSink()
    start = time.monotonic()
    launch_ours(pids, stamp)
    end = time.monotonic()
    settle(ray)
    return {
        "samples": samples,
        "first": first,
        "errors": errors,
        "settle_s": settles,
        "rank_pids": pids,
        "phases": phases(stamp.stamps, start, end),
    }


def phases(stamps: list, start: float, end: float) -> dict:
    """Seconds between the call and the events of one launch of ours."""
    at = {}
    for name, t in stamps:
        at.setdefault(name, t)  # the first of each kind
    last_finished = max((t for name, t in stamps if name == "RankFinished"), default=None)
    out = {}
    if "LaunchStarted" in at:
        out["call -> LaunchStarted (connect, check the cluster fits)"] = at["LaunchStarted"] - start
    if "RankStarted" in at and "LaunchStarted" in at:
        out["-> first RankStarted (placement group, actors started, torch imported, where)"] = (
            at["RankStarted"] - at["LaunchStarted"]
        )
    if last_finished is not None and "RankStarted" in at:
        out["-> last RankFinished (port, run: join, all_reduce, leave; results)"] = (
            last_finished - at["RankStarted"]
        )
    if "LaunchFinished" in at and last_finished is not None:
        out["-> LaunchFinished (actors killed, group removed, resources freed)"] = (
            at["LaunchFinished"] - last_finished
        )
    if "LaunchFinished" in at:
        out["-> call returns"] = end - at["LaunchFinished"]
    out["total"] = end - start
    return out


def summarize(result: dict) -> dict:
    samples = result["samples"]
    med = {name: statistics.median(v) for name, v in samples.items() if v}
    ratios = []
    for num, den, target in (
        ("ours", "TorchTrainer", TARGET),
        ("ours", "raw actors", None),
        ("ours", "raw actors + import torch", None),
        ("TorchTrainer", "raw actors", None),
    ):
        if num in med and den in med:
            rounds = [a / b for a, b in zip(samples[num], samples[den])]
            ratios.append({
                "ratio": f"{num} / {den}", "value": med[num] / med[den], "target": target,
                "per_round_median": statistics.median(rounds), "per_round_min": min(rounds), "per_round_max": max(rounds),
            })  # fmt: skip
    pids = result["rank_pids"]
    return {
        "medians": med,
        "ratios": ratios,
        "distinct_rank_pids": len(set(pids)),
        "rank_pids_seen": len(pids),
    }


def markdown(result: dict, summary: dict) -> str:
    rows = [
        "| configuration (2 ranks, one per node) | runs | median (s) | min (s) | max (s) | untimed first launch (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, values in result["samples"].items():
        if values:
            first = result["first"].get(name)
            rows.append(
                f"| {name} | {len(values)} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} "
                f"| {first:.3f} |"
            )
    rows += [
        "",
        "| ratio | of medians | per round: median (min-max) | target | met |",
        "|---|---|---|---|---|",
    ]
    for r in summary["ratios"]:
        target = f"<= {r['target']}" if r["target"] else "-"
        met = ("yes" if r["value"] <= r["target"] else "NO") if r["target"] else "-"
        rows.append(
            f"| {r['ratio']} | {r['value']:.3f} | {r['per_round_median']:.3f} "
            f"({r['per_round_min']:.3f}-{r['per_round_max']:.3f}) | {target} | {met} |"
        )
    rows += ["", "| one launch of ours, by its events | s |", "|---|---|"]
    rows += [f"| {name} | {value:.3f} |" for name, value in result["phases"].items()]
    fresh = summary["distinct_rank_pids"] == summary["rank_pids_seen"]
    rows.append(
        f"\nOur actors are NOT reused between launches: each launch starts a placement group and fresh actors "
        f"and kills them at its end. Ranks' pids over our {summary['rank_pids_seen'] // 2} launches: "
        f"{summary['distinct_rank_pids']} distinct of {summary['rank_pids_seen']}"
        f"{' (every rank a fresh process)' if fresh else ' (SOME PIDS REPEAT)'}."
    )
    for name, error in result["errors"].items():
        rows.append(f"\nfailed: {name}: {error}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each configuration (>= 5)")
    parser.add_argument(
        "--no-torch-floor", action="store_true", help="skip the raw actors + import torch row"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every sample and ratio here")
    options = parser.parse_args(argv)

    import ray
    import torch
    from ray.cluster_utils import Cluster

    load0 = os.getloadavg()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        with tempfile.TemporaryDirectory(prefix="ray-train-bench-") as storage:
            result = measure(ray, options.reps, not options.no_torch_floor, storage)
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary = summarize(result)
    versions = (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, ray {ray.__version__}, {os.cpu_count()} CPUs; "
        "a two-node ray.cluster_utils.Cluster on this machine, 1 CPU a node"
    )
    load = f"load average (1 min) {load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    print(f"\nRay engine launch latency ({versions}; {load})\n")
    print(markdown(result, summary))
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"versions": versions, "load": load, **result, **summary}, f, indent=2)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
