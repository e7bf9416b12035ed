"""Joining the process group without waiting for a rank that has gone.

`init_process_group` waits up to its timeout (30 minutes by default) for every rank. Under torch
elastic the agent's store outlives the workers, so a worker that returns from the function without
ever creating the state says so there (`say_left`), and a rank that creates the state later checks
for that while it waits for the others (`wait_for_peers`): such a group can never form, and an
error now lets the agent restart the workers instead of the launch hanging. Under our own
launcher, a rank tells it when it starts and ends joining (`listen` / `tell`), and the launcher's
monitor ends a launch whose group can no longer form (launch/monitor.py).
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
import weakref

_ARRIVED = "arrived"
_LEFT = "left_without_state"

joined = False  # set when this process starts joining a group; a worker that never did says so on exit
_listener = None  # a rank of our launcher: says "joining" / "joined" to it (launch/child.py)


def listen(callback) -> None:
    """`callback(word)` is told "joining" before this process joins the group and "joined" once
    it has: the launcher, seeing a rank joining after another returned without ever joining, ends
    the launch at once instead of leaving the rank to wait out init_process_group's timeout."""
    global _listener
    _listener = (os.getpid(), callback)


def tell(word: str) -> None:
    # Only the rank itself: a process it forked shares its socket, and two writers would tangle it.
    if _listener is not None and _listener[0] == os.getpid():
        try:
            _listener[1](word)
        except Exception:  # the launcher is gone: the rank is ending anyway
            pass


def attempt_store(world_size: int, timeout: datetime.timedelta | None):
    """This restart's view of the agent's store, or None when torch elastic lends no store.

    torch's static rendezvous keeps one agent store across restarts with no per-attempt prefix, so
    a restarted rank could read a dead peer's address: each attempt gets its own prefix."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    return dist.PrefixStore(f"/notebook_accel/attempt_{attempt}", store)


def _ours(store):
    import torch.distributed as dist

    return dist.PrefixStore("notebook_accel_peers", store)


def wait_for_peers(store, rank: int, world_size: int, timeout: datetime.timedelta | None) -> None:
    """Arrive, then wait until every rank has; raise at once if one returned without the state."""
    peers = _ours(store)
    arrived = peers.add(_ARRIVED, 1)
    deadline = time.monotonic() + (timeout or datetime.timedelta(minutes=30)).total_seconds()
    pause = 0.005
    while arrived < world_size:
        if peers.add(_LEFT, 0) > 0:
            gone = [r for r in range(world_size) if peers.check([f"{_LEFT}/{r}"])]
            names = ", ".join(str(r) for r in gone) or "another rank"
            raise RuntimeError(
                f"rank {rank} is joining the process group (PartialState() or Accelerator()), but "
                f"rank(s) {names} already returned from the function without creating the state, so "
                "the group can never form. Create the state on every rank, or on none. "
                "(Under max_restarts the workers are restarted.)"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: only {arrived} of {world_size} ranks joined the process group before "
                "the timeout; the others never created PartialState() or Accelerator()."
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
        arrived = peers.add(_ARRIVED, 0)


def say_left(rank: int, world_size: int) -> None:
    """Called as a worker ends: if it never joined, tell ranks still waiting to join (best effort)."""
    if joined:
        return
    try:
        store = attempt_store(world_size, datetime.timedelta(seconds=5))
        if store is None:
            return
        peers = _ours(store)
        peers.set(f"{_LEFT}/{rank}", "1")
        peers.add(_LEFT, 1)
    except Exception:
        pass  # the agent may be stopping the workers; a waiting rank then ends with them


def wait_for_listener(addr: str, port: int, seconds: float = 60.0) -> bool:
    """Wait until something on this machine listens on TCP `port` (rank 0's store), at most
    `seconds`; True once it does, False if not in time or when it cannot be told (`addr` is not
    an IPv4 address or "localhost": torch's own connect then, as before).

    A rank whose store client connects before rank 0's store listens is refused, and torch retries
    only after a back-off: 0.3-0.8 s lost in about one 2-rank launch in five on this machine kind
    (ranks forked together often reach the connect first). The probe binds the port as torch's store
    does (SO_REUSEADDR), which fails only once a socket listens there: it touches nothing of rank
    0's, and a store binding meanwhile is not stopped by it (as with the launcher's reservation)."""
    import ipaddress
    import socket

    if addr == "localhost":
        addr = "127.0.0.1"
    try:
        if ipaddress.ip_address(addr).version != 4:
            return False  # an IPv6 store may listen on IPv4 only (IPv6 off): no telling by a bind
    except ValueError:
        return False  # a host name: torch's own connect, as before
    deadline = time.monotonic() + seconds
    pause = 0.001  # longer after the first 0.1 s: a rank 0 busy for a minute costs a few thousand probes
    quick_until = time.monotonic() + 0.1
    while True:
        with socket.socket(socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((addr, port))
            except OSError:
                return True
        if time.monotonic() >= deadline:
            return False  # torch's own connect takes over, with its back-off
        time.sleep(pause)
        if time.monotonic() > quick_until:
            pause = min(pause * 1.5, 0.02)


_kept_group = None


def keep(group) -> None:
    """Hold `group` (a new default group) until the next one replaces it, long idle by then, or the
    process ends. torch 2.13 deadlocks when a gloo group's last reference goes while one of its
    worker threads frees a collective issued in a backward pass: that needs the GIL, which the thread
    freeing the group holds while it joins the worker. Scripts end that way: destroy_process_group(),
    then the DDP models, the group's other holders, are dropped (accelerate's test_sync main())."""
    global _kept_group
    if _kept_group is None and group is not None:
        atexit.register(_let_go)
    _kept_group = group


def _let_go() -> None:
    # At exit, while the interpreter is whole: freeing the group here joins gloo's threads with the
    # GIL released. A thread still letting go of a collective's tensors once the interpreter is
    # ending aborts the process ("terminate called without an active exception").
    global _kept_group
    group, _kept_group = _kept_group, None
    if group is None:
        return
    alive = weakref.ref(group)
    del group
    if alive() is not None:  # still held (a DDP model in a global): freed in the teardown, so
        threads_at_rest()  # give a late gloo thread the GIL and the time to finish first


def threads_at_rest(limit: float = 0.5) -> bool:
    """Wait, the GIL free, until every other thread of this process has been seen asleep twice in
    a row (Linux's /proc), at most `limit` seconds; True once they have."""
    me = str(threading.get_native_id())
    deadline = time.monotonic() + limit
    quiet = 0
    while quiet < 2:
        time.sleep(0.002)
        try:
            busy = any(_state(tid) == "R" for tid in os.listdir("/proc/self/task") if tid != me)
        except OSError:  # no /proc: a short pause is all we can give
            time.sleep(0.05)
            return False
        quiet = 0 if busy else quiet + 1
        if quiet < 2 and time.monotonic() > deadline:
            return False
    return True


def _state(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
