"""Reading offloaded weights ahead (utils/prefetch.py): the next hook's weights are read on the
background thread, outputs stay exact, memory stays bounded, and errors, forks and copies behave."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import threading
import weakref

import pytest
import torch
import torch.nn as nn

from notebook_accel import disk_offload
from notebook_accel.utils import prefetch
from notebook_accel.utils.offload import OffloadedWeightsLoader

WIDTH, DEPTH = 64, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Watched:
    """Records, for each lookup of the disk-backed weights map, the thread and a weakref to the tensor."""

    def __init__(self, monkeypatch):
        self.lookups = []  # (key, thread name)
        self.tensors = []  # weakrefs
        self.lock = threading.Lock()
        get = OffloadedWeightsLoader.__getitem__
        watch = self

        def getitem(loader, key):
            tensor = get(loader, key)
            with watch.lock:
                watch.lookups.append((key, threading.current_thread().name))
                watch.tensors.append(weakref.ref(tensor))
            return tensor

        monkeypatch.setattr(OffloadedWeightsLoader, "__getitem__", getitem)

    def alive(self) -> int:
        with self.lock:
            return sum(1 for ref in self.tensors if ref() is not None)


@pytest.fixture
def offloaded(tmp_path, monkeypatch):
    from notebook_accel import hooks

    monkeypatch.setattr(hooks, "PREFETCH", "1")  # as by default, whatever the environment says
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        reference = model(x)
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    return model, x, reference, tmp_path / "offload"


@pytest.mark.timeout(60)
def test_the_next_hooks_weights_are_read_on_the_background_thread(offloaded, monkeypatch):
    model, x, reference, _ = offloaded
    watched = Watched(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference)  # exact, every time
    per_forward = 4 * DEPTH  # two Linear layers per block, weight and bias each
    assert len(watched.lookups) == 3 * per_forward
    later = watched.lookups[per_forward:]  # the first forward learns the order
    ahead = [key for key, thread in later if thread.startswith("notebook_accel-prefetch")]
    # Every hook but the first of each forward was read ahead (the first is read when it runs).
    assert len(ahead) == 2 * (per_forward - 2), later


def _mapped(folder) -> int:
    """How many of the offload folder's files this process has mapped now."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if str(folder) in line)


@pytest.mark.timeout(60)
def test_memory_is_bounded_to_the_running_hook_and_one_ahead(offloaded):
    model, x, reference, folder = offloaded
    seen = []

    def count(module, args):
        seen.append(_mapped(folder))

    for block in model.blocks:
        for layer in (block.up, block.down):
            layer.register_forward_pre_hook(count)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference)
    # Each Linear maps 2 files: its own, the next one's read ahead, and the one before while its
    # release waits its turn on the thread. Were nothing released, all 24 would stay mapped.
    assert 0 < max(seen) <= 3 * 2, seen
    assert _mapped(folder) <= 2 * 2  # between forwards: at most the last hook's, being released


@pytest.mark.timeout(60)
def test_a_read_that_fails_ahead_is_raised_by_the_forward_that_needs_it(offloaded):
    model, x, reference, folder = offloaded
    with torch.no_grad():
        assert torch.equal(model(x), reference)
        os.remove(folder / "blocks.3.up.weight.dat")
        with pytest.raises(ValueError, match=r"blocks\.3\.up\.weight\.dat .*it is missing"):
            model(x)


def _forward_in_child(model, x, reference, out):
    torch.set_num_threads(1)  # libgomp is not fork-safe (MACHINE-NOTES): as our ranks do
    with torch.no_grad():
        out.put(bool(torch.equal(model(x), reference)))


@pytest.mark.timeout(60)
def test_a_process_forked_after_a_forward_reads_ahead_on_its_own_thread(offloaded):
    model, x, reference, _ = offloaded
    with torch.no_grad():
        assert torch.equal(model(x), reference)  # the parent's thread is running now
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_forward_in_child, args=(model, x, reference, out))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert out.get(timeout=5) is True


@pytest.mark.timeout(60)
def test_a_copied_or_pickled_model_gets_its_own_prefetcher(offloaded):
    model, x, reference, _ = offloaded
    with torch.no_grad():
        model(x)
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(clone(x), reference)
            assert torch.equal(clone(x), reference)


@pytest.mark.timeout(60)
def test_prefetch_can_be_turned_off(offloaded, monkeypatch):
    from notebook_accel import hooks

    model, x, reference, folder = offloaded
    monkeypatch.setattr(hooks, "PREFETCH", "0")
    watched = Watched(monkeypatch)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference)
    assert {thread for _, thread in watched.lookups} == {threading.current_thread().name}


def test_touch_leaves_the_values_and_skips_what_it_cannot_read():
    t = torch.arange(10_000, dtype=torch.float32)
    assert prefetch.touch(t) is t and torch.equal(t, torch.arange(10_000, dtype=torch.float32))
    strided = t[::2]
    assert prefetch.touch(strided) is strided
    empty = torch.empty(0)
    assert prefetch.touch(empty) is empty
    meta = torch.empty(4, device="meta")
    assert prefetch.touch(meta) is meta


def test_it_is_on_unless_turned_off_or_planning_on_meta():
    assert prefetch.wanted("1", "cpu") and prefetch.wanted("1", "cuda:0") and prefetch.wanted("1", 0)
    assert prefetch.wanted("1", None)
    assert not prefetch.wanted("1", "meta") and not prefetch.wanted("0", "cpu")


def _resident(address: int, size: int) -> bool:
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    vector = (ctypes.c_ubyte * ((size + address - start + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, size + address - start, vector) == 0
    return all(b & 1 for b in bytes(vector))


def test_touch_reads_a_cold_mapping_in(tmp_path):
    from notebook_accel.utils.offload import load_offloaded_weight, offload_weight

    info = offload_weight(torch.arange(1 << 20, dtype=torch.float32), "w", str(tmp_path))["w"]
    mapped = load_offloaded_weight(str(tmp_path / "w.dat"), info)
    address, size = mapped.data_ptr(), mapped.numel() * mapped.element_size()
    fd = os.open(tmp_path / "w.dat", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache (clean pages)
    finally:
        os.close(fd)
    assert not _resident(address, size)
    assert prefetch.touch(mapped) is mapped
    assert _resident(address, size)  # read in
    assert torch.equal(mapped, torch.arange(1 << 20, dtype=torch.float32))


def _rss_of_files(paths) -> int:
    """Bytes of this process's RSS in mappings of `paths` (/proc/self/smaps)."""
    wanted, total, inside = {os.path.realpath(p) for p in paths}, 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                inside = len(fields) == 6 and fields[5] in wanted
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_dispatched_models_disk_blocks_leave_rss_after_their_forward(tmp_path, monkeypatch, setting):
    # Disk blocks read straight from safetensors shards are views of each shard's one mapping, kept
    # open: without release_pages every block a forward used stayed in RSS (448 MB of 470 in
    # benchmarks/offload.py's model).
    from safetensors.torch import save_file

    from notebook_accel import hooks, init_empty_weights, load_checkpoint_and_dispatch

    monkeypatch.setattr(hooks, "PREFETCH", setting)
    width, depth = 256, 16
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]).eval()
    x = torch.randn(2, width)
    with torch.no_grad():
        reference = model(x)
    state = model.state_dict()
    shards = [str(tmp_path / f"s{i}.safetensors") for i in range(2)]
    weight_map = {}
    for i, shard in enumerate(shards):
        keys = [k for k in state if (int(k.split(".")[0]) < depth // 2) == (i == 0)]
        save_file({k: state[k].contiguous() for k in keys}, shard)
        weight_map.update(dict.fromkeys(keys, os.path.basename(shard)))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with init_empty_weights():
        empty = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]).eval()
    block = (width * width + width) * 4
    dispatched = load_checkpoint_and_dispatch(
        empty, str(tmp_path), device_map="auto", max_memory={"cpu": 2 * block},
        offload_folder=str(tmp_path / "offload"),
    )  # fmt: skip
    on_disk = [name for name, where in dispatched.hf_device_map.items() if where == "disk"]
    assert len(on_disk) >= depth - 2, dispatched.hf_device_map
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(dispatched(x), reference)
            # The CPU block, the last block or two and pages mapped around them stay; without
            # release_pages all 16 blocks would (seen: at most 5 with it).
            assert _rss_of_files(shards) <= depth // 2 * block, _rss_of_files(shards)
