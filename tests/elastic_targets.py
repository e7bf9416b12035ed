"""Functions launched by tests/test_launcher_elastic.py (module level, so every start method finds them)."""

import os


def ranks_and_sum():
    import torch

    from notebook_accel import PartialState

    state = PartialState()
    value = torch.tensor([float(state.process_index)])
    torch.distributed.all_reduce(value)
    print(f"rank {state.process_index} of {state.num_processes} on local rank {state.local_process_index}")
    return [state.process_index, state.local_process_index, state.num_processes, value.item(), str(state.distributed_type)]


def fail_once(marker_dir):
    """Rank 1 fails on the first attempt only; the restarted group succeeds."""
    from notebook_accel import PartialState

    state = PartialState()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if state.process_index == 1 and attempt == 0:
        open(os.path.join(marker_dir, "failed-once"), "w").close()
        raise RuntimeError("rank 1 fails on attempt 0")
    return (state.process_index, attempt)


def always_fail():
    from notebook_accel import PartialState

    state = PartialState()
    if state.process_index == 0:
        raise KeyError("no such key on rank 0")
    return state.process_index


if __name__ == "__main__":
    # One node of a simulated multi-node launch: python elastic_targets.py NODE_RANK PORT
    import json
    import sys

    from notebook_accel import notebook_launcher

    node_rank, port = int(sys.argv[1]), sys.argv[2]
    results = notebook_launcher(
        ranks_and_sum, num_processes=2, num_nodes=2, node_rank=node_rank,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="test-two-nodes",
    )  # fmt: skip
    print("RESULTS " + json.dumps(results), flush=True)


def take_the_token(queue, lock):
    """The rank that takes the token from an inherited fork-context queue fails; the restarted group
    finds the queue empty. `lock` (a threading.Lock, unpicklable) proves the arguments were inherited."""
    import queue as queue_module

    with lock:
        try:
            token = queue.get(timeout=1.0)
        except queue_module.Empty:
            token = None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"attempt {attempt} token {token}")
    if token is not None:
        raise RuntimeError(f"rank {os.environ['RANK']} took the token on attempt {attempt}")
    return int(os.environ["RANK"]), attempt


def only_rank_1_creates_the_state():
    """Rank 0 returns without the state; rank 1 creates it after that: the group can never form."""
    import time

    if os.environ["RANK"] == "0":
        return "left"
    time.sleep(1.0)  # rank 0 has returned by now
    from notebook_accel import PartialState

    PartialState()
    return "joined"


class SlowToPickle:
    """Pickled by the queue's feeder thread after put() returned: slow, so an exit that skips the
    flush loses it. Unpickles to a plain string."""

    def __init__(self, text):
        self.text = text

    def __reduce__(self):
        import time

        time.sleep(0.5)
        return (str, (self.text,))


def put_then_fail(queue):
    """Rank 0 puts one item in an inherited fork-context queue and fails at once; the others return
    (a second failing rank could be stopped by the agent in the middle of its own flush)."""
    if os.environ["RANK"] != "0":
        return None
    queue.put(SlowToPickle(f"from rank {os.environ['RANK']}"))
    raise RuntimeError("failing right after a put")
