"""Making room for the read-ahead (big_model/read_ahead.make_room): while a forward waits for weights
read from the disk, it computes with one torch thread fewer when torch has a thread per core,
and gets the thread back once no read is in flight, when its forward raises, or never loses it
when the reads keep ahead."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.nn as nn
from test_prefetch import offloaded  # noqa: F401  (a fixture)

from notebook_accel.big_model import pages, read_ahead

CORES = len(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(CORES < 2, reason=f"{CORES} core: there is no thread to give up")


@pytest.fixture
def every_core():
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    yield CORES
    read_ahead.give_room_back()
    torch.set_num_threads(before)


def threads_per_linear(model) -> list:
    """The torch thread count each Linear computed with (read as its forward ends: a torch pre-hook
    runs before the offload hook's lookup decides)."""
    seen = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, a, out: seen.append(torch.get_num_threads()))
    return seen


def slow_disk(monkeypatch, seconds: float) -> None:
    """Every read ahead goes to the thread (as from the disk) and takes `seconds`."""
    touch = pages.touch

    def slow_touch(tensor):
        time.sleep(seconds)
        return touch(tensor)

    monkeypatch.setattr(pages, "resident", lambda tensor, samples=4: False)
    monkeypatch.setattr(pages, "touch", slow_touch)


@needs_two_cores
@pytest.mark.timeout(60)
def test_a_forward_waiting_for_the_disk_gives_up_one_thread_until_the_reads_end(offloaded, monkeypatch, every_core):  # noqa: F811
    model, x, reference, _ = offloaded
    seen = threads_per_linear(model)
    with torch.no_grad():
        assert torch.equal(model(x), reference)  # learns the order
        slow_disk(monkeypatch, 0.02)
        seen.clear()
        assert torch.equal(model(x), reference)
    assert seen[0] == every_core  # nothing waited for yet
    assert every_core - 1 in seen, seen  # once it waited, with reads in flight
    assert seen[-1] == every_core, seen  # the last Linear: nothing left to read
    assert torch.get_num_threads() == every_core


@needs_two_cores
@pytest.mark.timeout(60)
def test_reads_that_keep_ahead_take_no_thread(offloaded, monkeypatch, every_core):  # noqa: F811
    model, x, reference, _ = offloaded
    seen = threads_per_linear(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):  # compute-bound: each Linear slower than a read
            module.register_forward_hook(lambda m, a, out: time.sleep(0.03))
    with torch.no_grad():
        assert torch.equal(model(x), reference)
        slow_disk(monkeypatch, 0.001)
        seen.clear()
        assert torch.equal(model(x), reference)
    assert seen and set(seen) == {every_core}, seen


@needs_two_cores
@pytest.mark.timeout(60)
def test_a_forward_that_raises_gives_the_thread_back(offloaded, monkeypatch, every_core):  # noqa: F811
    model, x, reference, _ = offloaded
    seen = threads_per_linear(model)
    fail_at = model.blocks[3].down

    def fail(module, args):
        if torch.get_num_threads() == every_core - 1:
            raise RuntimeError("a layer failed while reads were in flight")

    with torch.no_grad():
        assert torch.equal(model(x), reference)
        slow_disk(monkeypatch, 0.02)
        fail_at.register_forward_pre_hook(fail)
        seen.clear()
        with pytest.raises(RuntimeError, match="reads were in flight"):
            model(x)
    assert every_core - 1 in seen, seen  # it did fail with a thread given up
    assert torch.get_num_threads() == every_core


@needs_two_cores
def test_room_is_per_thread_and_a_count_set_meanwhile_is_kept(every_core):
    read_ahead.make_room(True)
    assert torch.get_num_threads() == every_core - 1 and read_ahead.room_made()
    read_ahead.make_room(True)  # made once
    assert torch.get_num_threads() == every_core - 1
    other = []
    worker = threading.Thread(target=lambda: other.append(read_ahead.room_made()))
    worker.start()
    worker.join()
    assert other == [False]
    read_ahead.make_room(False)
    assert torch.get_num_threads() == every_core and not read_ahead.room_made()

    read_ahead.make_room(True)
    torch.set_num_threads(every_core + 1)  # the forward chose its own count: left as it is
    read_ahead.give_room_back()
    assert torch.get_num_threads() == every_core + 1


@needs_two_cores
def test_no_room_is_made_with_a_core_already_free_or_when_turned_off(every_core, monkeypatch):
    torch.set_num_threads(every_core - 1)
    read_ahead.make_room(True)
    assert torch.get_num_threads() == every_core - 1 and not read_ahead.room_made()
    torch.set_num_threads(every_core)
    monkeypatch.setattr(read_ahead, "MAKE_ROOM", False)
    read_ahead.make_room(True)
    assert torch.get_num_threads() == every_core and not read_ahead.room_made()


@needs_two_cores
@pytest.mark.timeout(60)
def test_room_made_in_a_forward_is_given_back_when_the_forward_ends(offloaded, every_core):  # noqa: F811
    # As when the learned order runs past where this forward stopped: reads still in flight at
    # its last lookup. The outermost hooked forward gives the thread back however it ends.
    model, x, reference, _ = offloaded
    made = []

    def room_after_the_last_lookup(module, args, output):
        read_ahead.make_room(True)
        made.append(torch.get_num_threads())

    model.blocks[-1].down.register_forward_hook(room_after_the_last_lookup)
    with torch.no_grad():
        assert torch.equal(model(x), reference)
    assert made == [every_core - 1], made
    assert torch.get_num_threads() == every_core and not read_ahead.room_made()

    def fail_after(module, args, output):  # a forward hook runs after the offload hook's post_forward
        raise RuntimeError("a forward hook failed")

    model.blocks[2].down.register_forward_hook(fail_after)
    with torch.no_grad(), pytest.raises(RuntimeError, match="forward hook failed"):
        model(x)
    assert torch.get_num_threads() == every_core and not read_ahead.room_made()


@needs_two_cores
def test_align_module_device_gives_room_back(offloaded, every_core):  # noqa: F811
    from notebook_accel.utils import align_module_device

    model, *_ = offloaded
    with pytest.raises(RuntimeError, match="inside"), align_module_device(model.blocks[0].up):
        read_ahead.make_room(True)
        raise RuntimeError("inside")
    assert torch.get_num_threads() == every_core and not read_ahead.room_made()
