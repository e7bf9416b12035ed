"""Ranks on one machine join the group once rank 0's store listens (utils/peers.wait_for_listener):
a store client refused by a port nobody listens on yet waits out torch's back-off (0.2-0.4 s
measured with rank 0 0.3 s late)."""

from __future__ import annotations

import datetime
import socket

import pytest
from launch_targets import join_with_rank0_late

from notebook_accel import notebook_launcher
from notebook_accel.utils import peers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_the_probe_sees_a_listener_and_nothing_else():
    port = _free_port()
    assert peers.wait_for_listener("127.0.0.1", port, seconds=0.1) is False
    with socket.socket() as reservation:  # as the launcher holds a picked port: bound, not listening
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reservation.bind(("127.0.0.1", port))
        assert peers.wait_for_listener("127.0.0.1", port, seconds=0.1) is False
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen()
            assert peers.wait_for_listener("127.0.0.1", port, seconds=0.1) is True


@pytest.mark.timeout(60)
def test_a_probe_bound_while_rank_0s_store_binds_does_not_stop_it():
    import torch.distributed as dist

    port = _free_port()
    # The probe's socket held bound for the store's whole bind and listen (a probe holds it for
    # microseconds): the store still binds and listens, and the probe's next bind is refused.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=20))
    assert peers.wait_for_listener("127.0.0.1", port, seconds=1) is True
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_what_a_bind_cannot_tell_is_not_waited_for():
    port = _free_port()
    for addr in ("::1", "example.invalid"):  # IPv6 (a store may listen on IPv4 only), a host name
        assert peers.wait_for_listener(addr, port, seconds=30) is False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_ranks_wait_for_rank_0s_store_before_connecting(start_method, no_orphans):
    seen = notebook_launcher(join_with_rank0_late, (0.3,), num_processes=3, start_method=start_method)
    assert "listening" not in seen[0], seen  # rank 0 hosts the store: it does not wait for itself
    for rank in (1, 2):
        assert seen[rank]["listening"] is True, seen
        assert seen[rank]["at"] >= seen[0]["began"], seen  # they connected after rank 0 began joining
    no_orphans()
