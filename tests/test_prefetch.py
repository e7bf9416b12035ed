"""Reading offloaded weights ahead (big_model/read_ahead.py): the next hooks' weights are looked up while
the one before runs, read from the disk on the background thread, outputs stay exact, memory stays
bounded, and errors, forks and copies behave."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import threading

import pytest
import torch
import torch.nn as nn

from notebook_accel import disk_offload
from notebook_accel.big_model import pages, read_ahead
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


@pytest.fixture
def offloaded(tmp_path, monkeypatch):
    from notebook_accel.big_model import hooks

    monkeypatch.setattr(hooks, "PREFETCH", "1")  # as by default, whatever the environment says
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        reference = model(x)
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    return model, x, reference, tmp_path / "offload"


class Running:
    """Which Linear's forward is running (a torch pre-hook runs before the offload hook reads), and
    which one each lookup of the weights map was made under."""

    def __init__(self, model, monkeypatch):
        self.now = None
        self.lookups = []  # (key, the Linear running)
        self.touched = []  # (key, thread name) of every pages.touch
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda m, a, name=name: setattr(self, "now", name))
        get = OffloadedWeightsLoader.mapped

        def mapped(loader, key):
            self.lookups.append((key, self.now))
            return get(loader, key)

        monkeypatch.setattr(OffloadedWeightsLoader, "mapped", mapped)  # the hooks' lookup
        touch = pages.touch

        def watched_touch(tensor):
            self.touched.append((tensor.data_ptr(), threading.current_thread().name))
            return touch(tensor)

        monkeypatch.setattr(pages, "touch", watched_touch)

    def ahead(self) -> list:
        """Keys looked up while another Linear was running: read ahead of their own forward."""
        return [key for key, now in self.lookups if now is None or not key.startswith(now + ".")]


def _file_system(path) -> str:
    """The type of the file system `path` is on (/proc/mounts, longest mount point that holds it)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def _needs_eviction(path) -> None:
    # tmpfs and ramfs pages are the files themselves: nothing can be read "from the disk" there.
    if _file_system(path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{path} is on {_file_system(path)}: its pages cannot leave memory to be read back")


def _huge_pages_possible() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _evict(folder) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean, unmapped pages leave the cache
        finally:
            os.close(fd)


@pytest.mark.timeout(60)
def test_the_next_hooks_weights_are_looked_up_while_the_one_before_runs(offloaded, monkeypatch):
    model, x, reference, _ = offloaded
    running = Running(model, monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(x), reference)  # the first forward learns the order
        first = len(running.lookups)
        assert running.ahead() == []
        assert torch.equal(model(x), reference)  # exact, every time
    per_forward = 4 * DEPTH  # two Linear layers per block, weight and bias each
    assert first == per_forward and len(running.lookups) == 2 * per_forward
    # Every Linear but the first of each forward was looked up ahead (the first when it runs).
    assert len(running.ahead()) == per_forward - 2, running.lookups[per_forward:]
    # In the page cache (just written), they were mapped then and there, not on the thread.
    assert running.touched and all(not t.startswith("notebook_accel-prefetch") for _, t in running.touched)


@pytest.mark.timeout(60)
def test_once_a_whole_pass_was_in_the_page_cache_the_read_ahead_steps_aside(offloaded, monkeypatch):
    # Warm, reading ahead only moves the forward's page faults earlier and costs bookkeeping.
    model, x, reference, folder = offloaded
    with torch.no_grad():
        for _ in range(2):  # learn the order; then a whole pass found every weight cached
            assert torch.equal(model(x), reference)
        running = Running(model, monkeypatch)
        assert torch.equal(model(x), reference)
    assert running.ahead() == [] and running.touched == []  # each looked up when its Linear runs
    assert len(running.lookups) == 4 * DEPTH


@pytest.mark.timeout(60)
def test_a_stepped_aside_read_ahead_wakes_up_when_the_weights_leave_the_page_cache(offloaded, monkeypatch):
    model, x, reference, folder = offloaded
    _needs_eviction(folder)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference)
        running = Running(model, monkeypatch)
        _evict(folder)
        assert torch.equal(model(x), reference)
        assert torch.equal(model(x), reference)  # read back in: cached again, a pass to step aside
    read = [t for _, t in running.touched if t.startswith("notebook_accel-prefetch")]
    # The first hook's probe (the third Linear's weight) missed: from the second Linear on, read
    # ahead on the thread again.
    assert len(read) == 2 * (2 * DEPTH - 1), running.touched
    assert len(running.ahead()) == 2 * (2 * DEPTH - 1) * 2, running.lookups


@pytest.mark.timeout(60)
def test_weights_not_in_the_page_cache_are_read_on_the_background_thread(offloaded, monkeypatch):
    model, x, reference, folder = offloaded
    _needs_eviction(folder)
    with torch.no_grad():
        assert torch.equal(model(x), reference)
        running = Running(model, monkeypatch)
        _evict(folder)
        assert torch.equal(model(x), reference)
    on_thread = [t for _, t in running.touched if t.startswith("notebook_accel-prefetch")]
    # All but the first Linear's weights and bias, read ahead from the disk on the thread.
    assert len(on_thread) == 2 * (2 * DEPTH - 1), running.touched


def _rss_of_folder(folder) -> int:
    return _rss_of_files([os.path.join(folder, n) for n in os.listdir(folder)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [0, 4])
def test_memory_is_bounded_to_the_running_hook_those_read_ahead_and_a_round_of_drops(offloaded, monkeypatch, batch):
    model, x, reference, folder = offloaded
    page = os.sysconf("SC_PAGE_SIZE")
    linear = -(-WIDTH * WIDTH * 4 // page) * page + page  # a weight's pages and a bias's page
    # Released pages wait for a round of DROP_BATCH bytes (0: each hook's at once).
    monkeypatch.setattr(pages, "DROP_BATCH", batch * linear)
    seen = []
    for block in model.blocks:
        for layer in (block.up, block.down):
            layer.register_forward_pre_hook(lambda m, a: seen.append(_rss_of_folder(folder)))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference)
        # After a forward: only those read ahead, and nothing of the round (dropped at its end).
        assert _rss_of_folder(folder) <= read_ahead.AHEAD * linear
        assert torch.equal(model(x), reference)  # the read-ahead has stepped aside (all cached)
    # The running Linear, the AHEAD after it and a round; were nothing released, all 12 would stay.
    assert 0 < max(seen) <= (1 + read_ahead.AHEAD + batch) * linear, seen
    if batch:  # pages of finished hooks were held for the round
        assert max(seen) > (1 + read_ahead.AHEAD) * linear, seen
    assert _rss_of_folder(folder) == 0  # nothing was mapped ahead, and the round was dropped


@pytest.mark.timeout(60)
def test_a_lookup_that_fails_ahead_is_raised_by_the_forward_that_needs_it(offloaded, monkeypatch):
    model, x, reference, folder = offloaded
    done = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, a, out, name=name: done.append(name))
    with torch.no_grad():
        assert torch.equal(model(x), reference)
        get = OffloadedWeightsLoader.mapped

        def mapped(loader, key):
            if key == "blocks.3.up.weight":
                raise OSError(f"cannot read {key}")
            return get(loader, key)

        monkeypatch.setattr(OffloadedWeightsLoader, "mapped", mapped)
        done.clear()
        with pytest.raises(OSError, match=r"cannot read blocks\.3\.up\.weight"):
            model(x)
    # It was looked up while blocks.2.up ran; the Linears before blocks.3.up all finished.
    assert done[-1] == "blocks.2.down", done


@pytest.mark.timeout(60)
def test_the_loader_keeps_one_map_per_file_advised_for_2mb_folios(tmp_path):
    from notebook_accel.utils.offload import offload_weight

    weight = torch.randn(1024, 1024)  # 4 MB: worth 2 MB folios
    index = offload_weight(weight, "w", str(tmp_path))
    offload_weight(torch.randn(3), "b", str(tmp_path), index)
    loader = OffloadedWeightsLoader(save_folder=str(tmp_path), index=index)
    first, again = loader.mapped("w"), loader.mapped("w")
    assert first.data_ptr() == again.data_ptr() and torch.equal(first, weight)
    assert loader["w"].data_ptr() != first.data_ptr()  # a caller's lookup maps afresh
    if _huge_pages_possible():  # a kernel without transparent huge pages refuses the advice
        assert _vm_flags(first.data_ptr()) & {"hg"}  # MADV_HUGEPAGE
    assert "hg" not in _vm_flags(loader.mapped("b").data_ptr())  # under 2 MB: left alone
    first.mul_(0)  # written in place (copy-on-write: the file is untouched)
    loader.release_pages([first, loader.mapped("b")])
    assert torch.equal(loader.mapped("w"), weight)  # the release forgot the write, as a fresh map would
    assert not (tmp_path / "w.dat.part").exists() and sorted(os.listdir(tmp_path)) == ["b.dat", "w.dat"]


def _vm_flags(address: int) -> set:
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                low, high = (int(v, 16) for v in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return set(fields[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.timeout(60)
def test_offloading_again_to_the_same_folder_leaves_a_model_mapping_it_intact(offloaded):
    # Each file is replaced, not rewritten: a file cut short under a live map would fault (SIGBUS).
    from notebook_accel.utils.offload import offload_weight

    model, x, reference, folder = offloaded
    with torch.no_grad():
        assert torch.equal(model(x), reference)  # every file mapped now
        inodes = {n: os.stat(folder / n).st_ino for n in os.listdir(folder) if n.endswith(".dat")}
        for name, weight in Net().state_dict().items():  # other weights, same names
            offload_weight(weight, name, str(folder))
        assert all(os.stat(folder / n).st_ino != ino for n, ino in inodes.items())
        assert torch.equal(model(x), reference)


def test_a_tensor_a_caller_looks_up_is_its_own(offloaded):
    # The hooks share one map per file; loader[key] still gives a map of its own, so a caller's
    # write reaches neither the model nor the next caller, and no release undoes it.
    from notebook_accel.big_model.loading import get_state_dict_offloaded_model

    model, x, reference, _ = offloaded
    with torch.no_grad():
        assert torch.equal(model(x), reference)
        state = get_state_dict_offloaded_model(model)
        state["blocks.0.up.weight"].zero_()
        assert torch.equal(model(x), reference)
    assert bool((state["blocks.0.up.weight"] == 0).all())


@pytest.mark.timeout(60)
def test_the_maps_pages_are_released_when_the_module_used_copies(tmp_path):
    # Stored in fp16, run in fp32: the module's tensors are copies (as on a CUDA device), and the
    # pages of what the map gave must still be released after the forward.
    from notebook_accel.utils.offload import offload_state_dict

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, WIDTH)
    folder = tmp_path / "half"
    offload_state_dict(str(folder), {k: v.half() for k, v in model.state_dict().items()})
    with torch.no_grad():
        expected = Net().eval()
        expected.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
        reference = expected(x)
        disk_offload(model, str(folder), execution_device="cpu")
        for _ in range(2):
            assert torch.equal(model(x), reference)
            assert _rss_of_folder(folder) <= read_ahead.AHEAD * 2 * (WIDTH * WIDTH * 2 + 4096), _rss_of_folder(folder)


@pytest.mark.timeout(60)
def test_lookups_keep_no_file_descriptor_open(offloaded):
    model, x, reference, _ = offloaded
    before = len(os.listdir("/proc/self/fd"))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference)  # every one of the 24 files mapped and kept
    assert len(os.listdir("/proc/self/fd")) <= before


@pytest.mark.timeout(60)
def test_no_room_on_the_device_ahead_leaves_the_copy_to_the_hook(offloaded, monkeypatch):
    from notebook_accel.big_model import staging

    model, x, reference, _ = offloaded

    class Full(staging.PlainStager):
        def stage(self, tensors, release=None):
            raise torch.OutOfMemoryError("no room ahead")

    monkeypatch.setattr(staging, "stages", lambda device: str(device) == "cpu")
    monkeypatch.setattr(staging, "stager_for", lambda device: Full(device))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference)


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
    from notebook_accel.big_model import hooks

    model, x, reference, folder = offloaded
    monkeypatch.setattr(hooks, "PREFETCH", "0")
    running = Running(model, monkeypatch)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference)
            _evict(folder)
    assert len(running.lookups) == 2 * 4 * DEPTH and running.ahead() == [] and running.touched == []


def test_touch_leaves_the_values_and_skips_what_it_cannot_read():
    t = torch.arange(10_000, dtype=torch.float32)
    assert pages.touch(t) is t and torch.equal(t, torch.arange(10_000, dtype=torch.float32))
    strided = t[::2]
    assert pages.touch(strided) is strided
    empty = torch.empty(0)
    assert pages.touch(empty) is empty
    meta = torch.empty(4, device="meta")
    assert pages.touch(meta) is meta


def test_it_is_on_unless_turned_off_or_planning_on_meta():
    assert read_ahead.wanted("1", "cpu") and read_ahead.wanted("1", "cuda:0") and read_ahead.wanted("1", 0)
    assert read_ahead.wanted("1", None)
    assert not read_ahead.wanted("1", "meta") and not read_ahead.wanted("0", "cpu")


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

    _needs_eviction(tmp_path)
    info = offload_weight(torch.arange(1 << 20, dtype=torch.float32), "w", str(tmp_path))["w"]
    mapped = load_offloaded_weight(str(tmp_path / "w.dat"), info)
    address, size = mapped.data_ptr(), mapped.numel() * mapped.element_size()
    fd = os.open(tmp_path / "w.dat", os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
    finally:
        os.close(fd)
    assert not _resident(address, size)
    assert pages.touch(mapped) is mapped
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
@pytest.mark.parametrize("setting, stored", [("1", "float32"), ("0", "float32"), ("1", "float16")])
def test_a_dispatched_models_disk_blocks_leave_rss_after_their_forward(tmp_path, monkeypatch, setting, stored):
    # Disk blocks read straight from safetensors shards are views of each shard's one mapping, kept
    # open: without release_pages every block a forward used stayed in RSS (448 MB of 470 in
    # benchmarks/offload.py's model).
    from safetensors.torch import save_file

    from notebook_accel import init_empty_weights, load_checkpoint_and_dispatch
    from notebook_accel.big_model import hooks

    monkeypatch.setattr(hooks, "PREFETCH", setting)
    reads = []  # the hooks' lookups that asked safetensors for a tensor
    from_shard = OffloadedWeightsLoader._from_safetensors
    monkeypatch.setattr(
        OffloadedWeightsLoader, "_from_safetensors", lambda self, info, key: reads.append(key) or from_shard(self, info, key)
    )
    width, depth = 256, 16
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]).eval()
    x = torch.randn(2, width)
    # float16: the shards hold half precision, loaded as float32 (each lookup converts: a copy).
    state = {k: v.to(getattr(torch, stored)) for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():
        reference = model(x)
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
        offload_folder=str(tmp_path / "offload"), dtype=torch.float32,
    )  # fmt: skip
    on_disk = [name for name, where in dispatched.hf_device_map.items() if where == "disk"]
    assert len(on_disk) >= depth - 2, dispatched.hf_device_map
    per_forward = []
    with torch.no_grad():
        for _ in range(3):
            reads.clear()
            assert torch.equal(dispatched(x), reference)
            per_forward.append(len(reads))
            # The CPU block, the last block or two and pages mapped around them stay; without
            # release_pages all 16 blocks would (seen: at most 5 with it).
            assert _rss_of_files(shards) <= depth // 2 * block, _rss_of_files(shards)
    # Views of a shard's mapping are kept after the first forward; converted copies are made anew.
    disk_tensors = 2 * len(on_disk)
    assert per_forward == ([disk_tensors, 0, 0] if stored == "float32" else [disk_tensors] * 3), per_forward
    # A pickled model (a spawn or forkserver launch's payload, deepcopy) carries no copy of them:
    # the copy maps the shards itself, and its pages are released as the original's are.
    from notebook_accel.utils.offload import root_loader

    loader = root_loader(next(m._hf_hook for m in dispatched.modules() if getattr(m, "_hf_hook", None) is not None and m._hf_hook.offload).weights_map)
    assert len(pickle.dumps(loader)) < width * width, len(pickle.dumps(loader))
    copied = copy.deepcopy(dispatched)
    with torch.no_grad():
        assert torch.equal(copied(x), reference)
    copied_loader = root_loader(next(m._hf_hook for m in copied.modules() if getattr(m, "_hf_hook", None) is not None and m._hf_hook.offload).weights_map)
    if stored == "float32":
        assert copied_loader._views and all(copied_loader._in_shard_map(t) for t in copied_loader._views.values())


def _stage_on_cpu(monkeypatch) -> list:
    """Give the CPU a stager, as CUDA has (PlainStager: CudaStager's logic with a plain copy);
    returns the list each staging appends (its thread's name, how many tensors) to."""
    from notebook_accel.big_model import staging

    calls: list = []

    class Recording(staging.PlainStager):
        def stage(self, tensors, release=None):
            calls.append((threading.current_thread().name, len(tensors)))
            return super().stage(tensors, release)

    monkeypatch.setattr(staging, "stages", lambda device: str(device) == "cpu")
    monkeypatch.setattr(staging, "stager_for", lambda device: Recording(device) if str(device) == "cpu" else None)
    return calls


@pytest.mark.timeout(60)
def test_weights_read_ahead_are_copied_to_the_device_ahead_and_their_pages_released(offloaded, monkeypatch):
    # What CudaStager does on a CUDA device (pinned copy, non_blocking on a side stream), done here
    # with PlainStager's plain copy: the forward uses the copies, the mapped pages are let go.
    model, x, reference, folder = offloaded
    staged_on = _stage_on_cpu(monkeypatch)
    folder_maps = []
    used = []
    linear = torch.nn.functional.linear

    def watched_linear(input, weight, bias=None):
        used.append(any(low <= weight.data_ptr() < high for low, high in folder_maps))
        return linear(input, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", watched_linear)
    with torch.no_grad():
        assert torch.equal(model(x), reference)  # learns the order; nothing staged yet
        assert staged_on == []
        folder_maps[:] = _maps_of(folder)  # the loader keeps one map per file from now on
        assert len(folder_maps) == 4 * DEPTH
        used.clear()
        for _ in range(2):
            assert torch.equal(model(x), reference)
            assert _rss_of_folder(folder) == 0  # every source released once copied
    linears = 2 * DEPTH
    assert len(staged_on) == 2 * (linears - 1) and all(t.startswith("notebook_accel-prefetch") for t, _ in staged_on)
    # The first Linear of each forward reads its own map; every other one used a staged copy.
    assert used == [True] + [False] * (linears - 1) + [True] + [False] * (linears - 1), used


def _maps_of(folder) -> list:
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if str(folder) in line:
                low, high = (int(v, 16) for v in line.split()[0].split("-"))
                found.append((low, high))
    return found


def test_only_a_cuda_device_is_staged():
    from notebook_accel.big_model import staging

    assert not staging.stages(None) and not staging.stages("cpu") and not staging.stages("meta")
    assert staging.stages("cuda:0") == staging.stages(0) == torch.cuda.is_available()
    assert staging.stager_for("cpu") is None


@pytest.fixture
def written_map(tmp_path):
    """A loader's copy-on-write map of a 6-page file, every page written in place: a page dropped
    reads the file again (0..), one kept reads -1."""
    from notebook_accel.utils.offload import offload_weight

    page = os.sysconf("SC_PAGE_SIZE")
    per_page = page // 4
    weight = torch.arange(6 * per_page, dtype=torch.float32)
    loader = OffloadedWeightsLoader(save_folder=str(tmp_path), index=offload_weight(weight, "w", str(tmp_path)))
    mapped = loader.mapped("w")
    assert mapped.data_ptr() % page == 0
    mapped.fill_(-1)

    def dropped() -> list:
        return [bool(mapped[i * per_page] == weight[i * per_page]) for i in range(6)]

    return mapped, page, dropped


@pytest.mark.timeout(60)
def test_ranges_released_in_a_forward_are_dropped_together_adjoining_ones_in_one_call(written_map, monkeypatch):
    mapped, page, dropped = written_map
    calls = []
    drop = pages.drop_pages
    monkeypatch.setattr(pages, "drop_pages", lambda start, end: calls.append((start, end)) or drop(start, end))
    monkeypatch.setattr(pages, "DROP_BATCH", 1 << 30)
    base = mapped.data_ptr()
    read_ahead.forward_entered()
    try:
        for first, last in ((2, 3), (0, 2), (4, 5)):  # pages [2, 3) and [0, 2) adjoin; 3 is a gap
            pages.drop_later(base + first * page, base + last * page, mapped)
        assert calls == [] and dropped() == [False] * 6  # held while the forward runs
    finally:
        read_ahead.forward_left()
    assert calls == [(base, base + 3 * page), (base + 4 * page, base + 5 * page)]
    assert dropped() == [True, True, True, False, True, False]  # never the gap, nor past the end


@pytest.mark.timeout(60)
def test_a_round_is_dropped_once_drop_batch_bytes_wait_and_at_once_outside_a_forward(written_map, monkeypatch):
    mapped, page, dropped = written_map
    monkeypatch.setattr(pages, "DROP_BATCH", 2 * page)
    base = mapped.data_ptr()
    pages.drop_later(base, base + page, mapped)  # no hooked forward running
    assert dropped()[0]
    read_ahead.forward_entered()
    try:
        pages.drop_later(base + page, base + 2 * page, mapped)
        assert dropped()[1:3] == [False, False]
        pages.drop_later(base + 2 * page, base + 3 * page, mapped)  # two pages wait: the round
        assert dropped()[1:3] == [True, True]
    finally:
        read_ahead.forward_left()


@pytest.mark.timeout(60)
def test_a_range_taken_again_in_the_same_forward_is_dropped_first(written_map, monkeypatch):
    # A module run twice in one forward (or a tied weight): its second run must see the file's
    # values, as a fresh map would, not what its first run wrote; so the held release of what it
    # takes again is dropped before it runs, and the rest waits for the round.
    mapped, page, dropped = written_map
    monkeypatch.setattr(pages, "DROP_BATCH", 1 << 30)
    base, per_page = mapped.data_ptr(), page // 4
    lower, upper = mapped[: 3 * per_page], mapped[4 * per_page :]  # two weights of one file
    read_ahead.forward_entered()
    try:
        pages.drop_later(base, base + 3 * page, lower)
        pages.drop_later(base + 4 * page, base + 6 * page, upper)
        pages.taking([mapped[4 * per_page :]])  # the second run looks the upper one up again
        assert dropped() == [False, False, False, False, True, True]
    finally:
        read_ahead.forward_left()
    assert dropped() == [True, True, True, False, True, True]  # the other range, in the round


def _prefetcher_of(model):
    from notebook_accel.utils.offload import root_loader

    hook = next(m._hf_hook for m in model.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False))
    return read_ahead.for_map(root_loader(hook.weights_map))


@pytest.mark.timeout(60)
def test_weights_copied_to_a_device_ahead_never_step_aside(offloaded, monkeypatch):
    # Stepping aside is for maps the page cache serves; a stager's copies are the point. One hook
    # looked up without a device (as a hook holding a tied weight is) must not change that.
    model, x, reference, _ = offloaded
    staged = _stage_on_cpu(monkeypatch)
    model.blocks[0].down._hf_hook.tied_params_names.add("weight")  # order[1]: no stager
    per_forward = []
    with torch.no_grad():
        for _ in range(6):
            staged.clear()
            assert torch.equal(model(x), reference)
            per_forward.append(len(staged))
    assert per_forward[0] == 0 and all(n == 2 * DEPTH - 2 for n in per_forward[1:]), per_forward
    assert not _prefetcher_of(model)._quiet


class _Rotary(nn.Module):
    """Holds only a non-persistent buffer: hooked, with no weights to look up."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((WIDTH,), 0.5), persistent=False)

    def forward(self, x):
        return x * self.scale


@pytest.mark.timeout(60)
def test_a_hook_without_weights_does_not_keep_waking_the_read_ahead(tmp_path, monkeypatch):
    from notebook_accel.big_model import hooks

    monkeypatch.setattr(hooks, "PREFETCH", "1")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), _Rotary())]).eval()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        reference = model(x)
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    assert all(getattr(m, "_hf_hook", None) is not None for m in model if isinstance(m, _Rotary))
    with torch.no_grad():
        quiet = []
        for _ in range(6):
            assert torch.equal(model(x), reference)
            quiet.append(_prefetcher_of(model)._quiet)
    assert quiet == [False, True, True, True, True, True], quiet


@pytest.mark.timeout(60)
def test_a_two_hook_model_wakes_its_read_ahead_when_evicted(tmp_path, monkeypatch):
    # With fewer than AHEAD + 1 hooks the weights "AHEAD on" are the next forward's first ones.
    from notebook_accel.big_model import hooks

    monkeypatch.setattr(hooks, "PREFETCH", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)).eval()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        reference = model(x)
    folder = tmp_path / "offload"
    disk_offload(model, str(folder), execution_device="cpu")
    _needs_eviction(folder)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference)
        assert _prefetcher_of(model)._quiet
        running = Running(model, monkeypatch)
        _evict(folder)
        assert torch.equal(model(x), reference)
    on_thread = [t for _, t in running.touched if t.startswith("notebook_accel-prefetch")]
    assert len(on_thread) == 2, running.touched  # the second Linear's weight and bias, read ahead


class _Doubling(nn.Linear):
    """Writes to its own weight in place, as some forwards do (a running normalisation)."""

    def forward(self, x):
        self.weight.data.mul_(2)
        return super().forward(x)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.shared = _Doubling(WIDTH * 32, WIDTH * 32)  # 16 MB: whole pages to drop
        self.down = nn.Linear(WIDTH * 32, WIDTH)
        self.up = nn.Linear(WIDTH, WIDTH * 32)

    def forward(self, x):
        h = self.shared(self.up(self.first(x)))
        return self.down(self.shared(h))  # the same module twice in one forward


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [0, 1 << 30])
def test_a_module_run_twice_in_a_forward_sees_the_files_weights_each_time(tmp_path, monkeypatch, batch):
    # Offloaded weights come fresh from the file at each run (accelerate reads them anew): what the
    # first run wrote to them must not reach the second, however released pages are batched.
    from notebook_accel.big_model import hooks

    monkeypatch.setattr(hooks, "PREFETCH", "1")
    monkeypatch.setattr(pages, "DROP_BATCH", batch)
    torch.manual_seed(0)
    model = _Twice().eval()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        weight = model.shared.weight.clone()
        h = model.up(model.first(x))
        expected = model.down(torch.nn.functional.linear(torch.nn.functional.linear(h, 2 * weight, model.shared.bias), 2 * weight, model.shared.bias))  # fmt: skip
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    with torch.no_grad():
        for _ in range(3):
            assert torch.allclose(model(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(60)
def test_a_range_released_twice_counts_once_toward_a_round(written_map, monkeypatch):
    # Two names for one weight release it twice: counted twice, rounds would come early and the
    # count, never quite given back, would end batching forward after forward.
    mapped, page, dropped = written_map
    monkeypatch.setattr(pages, "DROP_BATCH", 3 * page)
    base = mapped.data_ptr()
    for _ in range(3):
        read_ahead.forward_entered()
        try:
            pages.drop_later(base, base + 2 * page, mapped)
            pages.drop_later(base, base + 2 * page, mapped)  # the same, again: not a round yet
            assert dropped()[:2] == [False, False]
            pages.taking([mapped])
            assert dropped()[:2] == [True, True] and pages._room.held_bytes == 0
            mapped.fill_(-1)
        finally:
            read_ahead.forward_left()
