"""What the stall watch costs a training step (issue #29): benchmarks/step_overhead.py's model and
Accelerator loop on 2 ranks, under three configurations measured in alternating blocks in one run:

    on        the default: each rank serves the watch, flight recorder at 256 entries
    off       stall_after=0: no server, torch's default flight recorder (2000 entries, recording)
    no-fr     stall_after=0 and TORCH_FR_BUFFER_SIZE=0: nothing recorded at all

    python benchmarks/watch_overhead.py [--sessions 6] [--rounds 18] [--steps 50] [--stall-after S] [--json PATH]

The watch is set per launch, so each session starts one launch per configuration (each launch in a
child process of its own, ranks forked) and keeps all three alive: their ranks wait on a socket to
this process, which tells one launch at a time to run a block of --steps steps (after a barrier) and
takes rank 0's time per step. Each round runs one block of every configuration, the order going
through all six permutations every six rounds, so background load falls on all three alike. Launch-to-launch
differences (memory layout, placement) stay inside a session; --sessions fresh sets of launches
show how large they are. Ratios: each block of "on" against the blocks of the other configuration in
the same round (the median over all rounds, with quartiles and min-max), and each session's median
against the other's (min-max over sessions).

--stall-after S gives "on" stall_after=S instead of the default 60 s: the launcher then reads every
rank's collectives each S/3 s of quiet (these ranks print nothing), a bound on what probing costs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from queue import Empty, Queue

import torch
from step_overhead import BATCH, FEATURES, HIDDEN, _accelerator_loop, _loader, _model

CONFIGS = ("on", "off", "no-fr")
DESCRIBE = {
    "on": "watch on (default): worker server, flight recorder 256",
    "off": "stall_after=0: no server, torch's default flight recorder",
    "no-fr": "stall_after=0, TORCH_FR_BUFFER_SIZE=0: no recording",
}
RATIOS = (("on", "off"), ("on", "no-fr"), ("off", "no-fr"))
START_TIMEOUT_S = 120


# -- inside a rank ---------------------------------------------------------------------------------


def rank_main(address, authkey: bytes, config: str, steps: int) -> dict:
    """Prepare the model, then run a block of `steps` steps whenever this process says so."""
    import torch.distributed as dist

    from notebook_accel import Accelerator
    from notebook_accel.launch import watch_rank

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_loader(rank, world, steps), batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    block = _accelerator_loop(accelerator, model, opt, loader)
    with Client(address, authkey=authkey) as conn:
        conn.send({"config": config, "rank": rank, "pid": os.getpid(),
                   "serves": os.path.exists(watch_rank.socket_path(os.getpid())),
                   "fr_buffer_size": os.environ.get("TORCH_FR_BUFFER_SIZE")})  # fmt: skip
        while conn.recv() == "run":
            dist.barrier()
            conn.send(block())
        entries = _recorded()
        conn.send({"recorded": entries})
    return {"rank": rank, "recorded": entries}


def _recorded():
    """How many collectives torch's flight recorder holds now (None: it could not say)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return len(json.loads(_dump_fr_trace_json()).get("entries") or [])
    except Exception:  # noqa: BLE001 - an old torch: the table says "?"
        return None


def launch_child(argv) -> int:
    """One launch of the configuration named in argv, in a process of its own."""
    from notebook_accel import notebook_launcher

    config, port, authkey, steps, stall_after = argv
    stall = None if config == "on" else 0  # None: the environment's (cleared) or the config's (none): 60
    if config == "on" and stall_after != "default":
        stall = float(stall_after)
    notebook_launcher(rank_main, (("127.0.0.1", int(port)), bytes.fromhex(authkey), config, int(steps)),
                      num_processes=2, use_port="auto", start_method="fork", stall_after=stall)  # fmt: skip
    return 0


# -- the driver ------------------------------------------------------------------------------------


def _env(config: str) -> dict:
    env = dict(os.environ)
    env.pop("NOTEBOOK_ACCEL_STALL_AFTER", None)
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    env["NOTEBOOK_ACCEL_CONFIG_FILE"] = os.path.join(tempfile.gettempdir(), "no-such-watch-overhead-config.yaml")
    if config == "no-fr":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
    return env


def session(listener, authkey: bytes, args, index: int) -> dict:
    """Three launches alive together; `args.rounds` rounds of one block each. s/step per block."""
    accepted: Queue = Queue()

    def accept():
        for _ in range(2 * len(CONFIGS)):
            try:
                accepted.put(listener.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    launch_order = CONFIGS[index % 3 :] + CONFIGS[: index % 3]
    logs, children = {}, {}
    for config in launch_order:
        logs[config] = tempfile.TemporaryFile()
        children[config] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--launch", config, str(listener.address[1]), authkey.hex(),
             str(args.steps), str(args.stall_after)],
            env=_env(config), stdout=logs[config], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    conns, hello = {}, {}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while len(conns) < 2 * len(CONFIGS):
            try:
                conn = accepted.get(timeout=1.0)
            except Empty:
                _check_alive(children, logs, deadline)
                continue
            info = conn.recv()
            conns[info["config"], info["rank"]] = conn
            hello[info["config"], info["rank"]] = info

        def run(config: str) -> float:
            pair = (conns[config, 0], conns[config, 1])
            for conn in pair:
                conn.send("run")
            return [conn.recv() for conn in pair][0]  # rank 0's s/step

        for config in CONFIGS:  # warm-up: one block each
            run(config)
        blocks = {config: [] for config in CONFIGS}
        for r in range(args.rounds):
            order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
            for config in order if (r // 3) % 2 == 0 else order[::-1]:
                blocks[config].append(run(config))
        recorded = {}
        for (config, rank), conn in conns.items():
            conn.send("stop")
            recorded[config, rank] = conn.recv()["recorded"]
        for config, child in children.items():
            if child.wait(timeout=60) != 0:
                raise RuntimeError(f"the {config} launch exited with {child.returncode}:\n{_tail(logs[config])}")
    finally:
        for conn in conns.values():
            conn.close()
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        for log in logs.values():
            log.close()
    setup = {config: {"serves": [hello[config, r]["serves"] for r in (0, 1)],
                      "fr_buffer_size": hello[config, 0]["fr_buffer_size"],
                      "recorded": [recorded[config, r] for r in (0, 1)]} for config in CONFIGS}  # fmt: skip
    return {"blocks": blocks, "setup": setup}


def _check_alive(children: dict, logs: dict, deadline: float) -> None:
    for config, child in children.items():
        if child.poll() is not None:
            raise RuntimeError(f"the {config} launch exited with {child.returncode} before its ranks connected:\n"
                               f"{_tail(logs[config])}")  # fmt: skip
    if time.monotonic() > deadline:
        raise RuntimeError(f"the ranks did not connect within {START_TIMEOUT_S} s")


def _tail(log) -> str:
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-3000:]


def _quartiles(values: list) -> tuple:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _expected_problems(setup: dict) -> list:
    """Each configuration must be what its name says, or its row means nothing."""
    problems = []
    for config, seen in setup.items():
        serves = config == "on"
        if seen["serves"] != [serves, serves]:
            problems.append(f"{config}: ranks serving the watch {seen['serves']}, expected {[serves] * 2}")
        recorded = [n for n in seen["recorded"] if n is not None]
        if config == "no-fr" and any(recorded):
            problems.append(f"{config}: the flight recorder holds {seen['recorded']} entries, expected 0")
        if config != "no-fr" and recorded and not all(recorded):
            problems.append(f"{config}: the flight recorder holds {seen['recorded']} entries, expected some")
        if config == "on" and any(n > 256 for n in recorded):
            problems.append(f"on: the flight recorder holds {seen['recorded']} entries, expected at most 256")
    return problems


def report(args, sessions: list, seconds: float) -> dict:
    pooled = {c: [b for s in sessions for b in s["blocks"][c]] for c in CONFIGS}
    median = {c: statistics.median(v) for c, v in pooled.items()}
    ratios = {}
    for a, b in RATIOS:
        per_round = [x / y for s in sessions for x, y in zip(s["blocks"][a], s["blocks"][b])]
        per_session = [statistics.median(s["blocks"][a]) / statistics.median(s["blocks"][b]) for s in sessions]
        ratios[f"{a}/{b}"] = {"per_round": per_round, "per_session": per_session,
                              "median": statistics.median(per_round), "quartiles": _quartiles(per_round),
                              "of_medians": median[a] / median[b]}  # fmt: skip
    setup = sessions[-1]["setup"]
    command = "python benchmarks/watch_overhead.py " + " ".join(sys.argv[1:])
    print(f"\nStall watch on vs off, 2 ranks, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-10, batch {BATCH}/rank, Accelerator "
          f"loop; {len(sessions)} sessions x {args.rounds} rounds x 3 blocks of {args.steps} steps, configurations "
          f"alternating (rank 0's ms/step). {seconds:.0f} s.\n\n    {command.strip()}\n")  # fmt: skip
    stall = "60 (default)" if args.stall_after == "default" else args.stall_after
    print("| configuration | ranks serve the watch | flight recorder entries at the end (last session, ranks 0, 1) "
          "| ms/step, median of blocks |\n|---|---|---|---|")  # fmt: skip
    for c in CONFIGS:
        label = DESCRIBE[c] + (f"; stall_after {stall}" if c == "on" else "")
        recorded = ", ".join("?" if n is None else str(n) for n in setup[c]["recorded"])
        print(f"| {c}: {label} | {'yes' if all(setup[c]['serves']) else 'no'} | {recorded} | {median[c] * 1e3:.3f} |")
    print("\n| ratio | median of per-round block ratios | quartiles | min - max | per-session medians, min - max "
          "| ratio of pooled medians |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, r in ratios.items():
        q1, q3 = r["quartiles"]
        print(f"| {name} | {r['median']:.4f} | {q1:.4f} - {q3:.4f} | {min(r['per_round']):.4f} - "
              f"{max(r['per_round']):.4f} | {min(r['per_session']):.4f} - {max(r['per_session']):.4f} "
              f"| {r['of_medians']:.4f} |")  # fmt: skip
    problems = [f"session {i}: {p}" for i, s in enumerate(sessions) for p in _expected_problems(s["setup"])]
    for p in problems:
        print(f"WARNING: {p}")
    verdict = ratios["on/off"]["median"] <= 1.01
    print(f"\nIssue #29's bar, median on/off <= 1.01: {'met' if verdict else 'NOT met'} "
          f"({ratios['on/off']['median']:.4f}); against no recording at all: {ratios['on/no-fr']['median']:.4f}")
    return {"median_s_per_step": median, "ratios": ratios, "problems": problems, "seconds": seconds}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:
        return launch_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6, help="fresh sets of three launches")
    parser.add_argument("--rounds", type=int, default=18,
                        help="rounds per session, one block of each configuration (6 rounds: every order once)")
    parser.add_argument("--steps", type=int, default=50, help="steps per block")
    parser.add_argument("--stall-after", default="default", help="stall_after for 'on' (default: 60 s)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.stall_after != "default" and not float(args.stall_after) > 0:
        parser.error("--stall-after must be positive: 'on' is the watch on")
    authkey = secrets.token_bytes(16)
    start = time.perf_counter()
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        sessions = []
        for index in range(args.sessions):
            sessions.append(session(listener, authkey, args, index))
            print(f"session {index + 1}/{args.sessions} done ({time.perf_counter() - start:.0f} s)", flush=True)
    found = report(args, sessions, time.perf_counter() - start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "sessions": sessions, **found}, f, indent=2, default=list)
    return 1 if found["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
