"""Reading offloaded weights ahead (big_model/read_ahead.py): a disk-offloaded forward with the read-ahead
off and on, with torch on every core and with one core left free, against its floor, in one run.

The model is benchmarks/offload.py's (16 residual blocks of two 2048x2048 fp32 Linear, 537 MB),
offloaded with `disk_offload(model, folder, execution_device="cpu")`. The floor of an offloaded
forward is the larger of the same forward in RAM (compute) and a sequential read of the folder
(I/O: the faster of read() into a buffer and a populated map), all measured here at the same thread
count. Configurations alternate within each round;
each is a fresh model over the same folder. "added" is what the forward adds to the process's RSS
(anonymous and file-backed: `VmHWM` reset before the forward, minus `VmRSS` before it).

    python benchmarks/prefetch.py [--rounds 4] [--forwards 6] [--cold 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from notebook_accel import disk_offload, init_empty_weights  # noqa: E402
from notebook_accel.big_model import hooks, read_ahead  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from offload import BATCH, WIDTH, _model_classes  # noqa: E402
from offload import _read_folder as _read  # noqa: E402

MODES = ("0", "1")  # NOTEBOOK_ACCEL_PREFETCH: off, on (the default)
# Cold, also: on, but the forward keeps every torch thread while it waits for the disk (no room made)
COLD_MODES = (*MODES, "1-keep")


def _evict(folder: str) -> bool:
    """The folder's files out of the page cache, and nothing else: dropping every cache would also
    make the forward read torch's own code back from the disk, which the floor's reads do not."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _map_folder(folder: str) -> float:
    """Seconds to read every file of the folder the other way a file is read in sequence: map it
    with MADV_HUGEPAGE and ask for all of it at once (MADV_POPULATE_READ). Cold, this reads in 2 MB
    folios and beats read() into a buffer, so the floor takes the faster of the two."""
    import mmap

    names = sorted(n for n in os.listdir(folder) if n.endswith(".dat"))
    start = time.perf_counter()
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size:
                with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                    mapped.madvise(mmap.MADV_HUGEPAGE)
                    mapped.madvise(22)  # MADV_POPULATE_READ (Linux 5.14+)
    return time.perf_counter() - start


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def _offloaded(MLP, folder: str, mode: str):
    hooks.PREFETCH = mode.split("-")[0]  # read when each hook first runs: set before the first forward
    read_ahead.MAKE_ROOM = not mode.endswith("-keep")
    with init_empty_weights():
        model = MLP().eval()
    return disk_offload(model, folder, execution_device="cpu")


def _forwards(model, x, y, count: int, cold: str = "") -> tuple:
    times, added = [], []
    with torch.no_grad():
        model(x)  # warm-up: the read-ahead learns the order here
        for _ in range(count):
            if cold:
                _evict(cold)
            before = _status("VmRSS")
            hwm = _reset_hwm()
            start = time.perf_counter()
            out = model(x)
            times.append(time.perf_counter() - start)
            if hwm:
                added.append(_status("VmHWM") - before)
            if not torch.equal(out, y):
                raise AssertionError("an offloaded forward differs from the model in RAM")
    return times, added


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--forwards", type=int, default=6)
    parser.add_argument("--cold", type=int, default=3, help="cold forwards (the folder evicted from the page cache) per mode and round")
    parser.add_argument("--json", metavar="PATH")
    options = parser.parse_args(argv)

    MLP = _model_classes()
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(BATCH, WIDTH)
    with torch.no_grad():
        y = model(x)
    work = tempfile.mkdtemp(prefix="nba-prefetch-")
    folder = os.path.join(work, "offload")
    disk_offload(copy.deepcopy(model), folder, execution_device="cpu")  # `model` stays in RAM
    cores = len(os.sched_getaffinity(0))
    thread_counts = sorted({cores, max(1, cores - 1)}, reverse=True)
    samples: dict = {}
    began = time.perf_counter()
    for rnd in range(options.rounds):
        configs = [(t, m) for t in thread_counts for m in ("ram", "read", "map", *MODES)]
        for threads, mode in configs if rnd % 2 == 0 else list(reversed(configs)):
            torch.set_num_threads(threads)
            key = f"{threads}/{mode}"
            entry = samples.setdefault(key, {"s": [], "added": []})
            if mode == "ram":
                entry["s"] += _forwards(model, x, y, options.forwards)[0]
            elif mode == "read":
                entry["s"] += [_read(folder)[0] for _ in range(options.forwards)]
            elif mode == "map":
                entry["s"] += [_map_folder(folder) for _ in range(options.forwards)]
            else:
                times, added = _forwards(_offloaded(MLP, folder, mode), x, y, options.forwards)
                entry["s"] += times
                entry["added"] += added
        if options.cold:
            # The reads first: what a forward reads in (2 MB folios) is what the next round finds
            # in the page cache, as a user's next forward would; read() leaves small folios.
            for _ in range(options.cold):
                _evict(folder)
                samples.setdefault("cold/read", {"s": [], "added": []})["s"].append(_read(folder)[0])
                _evict(folder)
                samples.setdefault("cold/map", {"s": [], "added": []})["s"].append(_map_folder(folder))
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for mode in COLD_MODES if rnd % 2 == 0 else COLD_MODES[::-1]:
                    entry = samples.setdefault(f"cold{threads}/{mode}", {"s": [], "added": []})
                    times, added = _forwards(_offloaded(MLP, folder, mode), x, y, options.cold, cold=folder)
                    entry["s"] += times
                    entry["added"] += added
        print(f"round {rnd + 1}/{options.rounds} done", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - began

    def med(key):
        values = samples.get(key, {}).get("s")
        return statistics.median(values) if values else None

    def mb(key):
        values = samples.get(key, {}).get("added")
        return statistics.median(values) / 1e6 if values else None

    block = 2 * (WIDTH * WIDTH + WIDTH) * 4 / 1e6
    print(
        f"Disk-offloaded forward, read-ahead off and on (python {sys.version.split()[0]}, torch "
        f"{torch.__version__}, {cores} CPUs; {options.rounds} rounds, {seconds:.0f} s). ms: median; "
        f"added: median MB the forward adds to RSS (one block is {block:.1f} MB)\n"
    )
    print("| torch threads | in RAM (compute) | read the folder: read(), map | floor | read-ahead off | on (the default) | off / floor | on / floor | added: off, on (MB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [(str(t), f"{t}/ram", f"{t}/", [f"{t}/{m}" for m in MODES]) for t in thread_counts]
    for t in thread_counts:
        if med(f"cold{t}/0") is not None and med("cold/read") is not None:
            rows.append((f"{t}, cold cache", f"{t}/ram", "cold/", [f"cold{t}/{m}" for m in MODES]))
    for label, ram_key, read_key, keys in rows:
        ram, read, mapped = med(ram_key), med(read_key + "read"), med(read_key + "map")
        floor = max(ram, min(read, mapped))
        times = [med(k) for k in keys]
        cells = [f"{ram * 1e3:.1f}", f"{read * 1e3:.1f}, {mapped * 1e3:.1f}"]
        cells += [f"{v * 1e3:.1f}" for v in (floor, *times)]
        cells += [f"{v / floor:.2f}" for v in times]
        cells.append(", ".join(f"{mb(k):.0f}" for k in keys))
        print(f"| {label} | " + " | ".join(cells) + " |")
    for t in thread_counts:
        kept, cold_floor = med(f"cold{t}/1-keep"), max(med(f"{t}/ram") or 0, min(med("cold/read") or 0, med("cold/map") or 0))
        if kept is not None and cold_floor:
            print(
                f"\nCold, {t} torch threads, read-ahead on but every thread kept while the forward waits for the "
                f"disk (no room made): {kept * 1e3:.1f} ms, {kept / cold_floor:.2f}x the floor; added {mb(f'cold{t}/1-keep'):.0f} MB"
            )
    if options.json:
        with open(options.json, "w") as f:
            json.dump(samples, f)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
