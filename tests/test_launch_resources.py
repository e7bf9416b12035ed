"""Per-rank resources sampled by the launcher (issue #19, part 3), on real processes: RankResources
while ranks run, peak RSS in RankFinished / RankFailed (exact from wait4 where we reap the rank,
sampled for forkserver ranks), and a rank the kernel OOM-kills inside a small memory cgroup
reported as out of memory for certain (its own limit, or its parent cgroup's), with the other rank
stopped."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import psutil
import pytest
from launch_targets import hold_memory, outgrow_cgroup

from notebook_accel.launch import LaunchFailedError, ListSink, notebook_launcher, oom
from notebook_accel.launch import events as ev
from notebook_accel.launch.warm import WarmServer

MiB = 1 << 20
HELD = 400  # MiB each rank touches and holds: above any rank's RSS before it allocates (about 200-340)


class _GoWhenSampled(ListSink):
    """Creates `go.RANK` once the launcher reported that rank's RSS above `rss` bytes."""

    def __init__(self, go: str, rss: int):
        super().__init__()
        self.go, self.rss = go, rss

    def handle(self, event):
        super().handle(event)
        if isinstance(event, ev.RankResources) and event.rss >= self.rss:
            Path(f"{self.go}.{event.rank}").touch()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver", "elastic"])
def test_ranks_resources_are_sampled_and_their_peaks_reported(method, tmp_path, no_orphans):
    sink = _GoWhenSampled(str(tmp_path / "go"), HELD * MiB)
    how = {"start_method": method} if method != "elastic" else {"max_restarts": 1}  # the agent's workers
    try:
        told = notebook_launcher(hold_memory, (HELD, str(tmp_path / "go")), num_processes=2, sinks=[sink], **how)
    finally:
        if method == "forkserver":
            WarmServer.shutdown()
    assert told == [True, True]  # each rank was sampled holding its memory, or it waited in vain
    samples = [e for e in sink.events if isinstance(e, ev.RankResources)]
    machine = psutil.virtual_memory().total
    for rank in (0, 1):
        mine = [s for s in samples if s.rank == rank]
        assert any(s.rss >= HELD * MiB for s in mine), mine
        assert all(0 < s.memory_limit <= machine for s in mine), mine
        assert all(s.cpu_percent >= 0 and s.device_memory is None for s in mine), mine  # no NVML here
    finished = {e.rank: e for e in sink.events if isinstance(e, ev.RankFinished)}
    for rank in (0, 1):
        assert finished[rank].peak_rss >= HELD * MiB, finished[rank]
        assert finished[rank].peak_rss < 4 << 30, finished[rank]  # bytes, not kilobytes scaled twice
    no_orphans()


def _cgroup_v1_memory() -> Path:
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    if not (root / "memory.limit_in_bytes").exists():
        pytest.skip(f"no cgroup v1 memory controller at {root}")
    return root


@pytest.fixture(params=["limited", "under a limited parent"])
def small_cgroup(request):
    """A fresh v1 memory cgroup limited to 200 MiB (memory and memory+swap), or an unlimited one
    inside such a parent; removed afterwards (children first)."""
    top = _cgroup_v1_memory() / f"notebook_accel_test_{secrets.token_hex(4)}"
    folders = [top] if request.param == "limited" else [top, top / "rank"]
    try:
        top.mkdir()
        (top / "memory.limit_in_bytes").write_text(str(200 * MiB))
        if (top / "memory.memsw.limit_in_bytes").exists():
            (top / "memory.memsw.limit_in_bytes").write_text(str(200 * MiB))
        if len(folders) > 1:
            folders[1].mkdir()
        yield folders[-1]
    finally:
        for folder in reversed(folders):
            _remove_cgroup(folder)


def _remove_cgroup(folder: Path) -> None:
    if not folder.exists():
        return
    for pid in (folder / "cgroup.procs").read_text().split():
        try:  # a survivor must not keep the folder busy
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(100):
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.05)


class _GoWhenInCgroup(ListSink):
    def __init__(self, go: Path, limit: int):
        super().__init__()
        self.go, self.limit = go, limit

    def handle(self, event):
        super().handle(event)
        if isinstance(event, ev.RankResources) and event.rank == 1 and event.memory_limit == self.limit:
            if not self.go.exists():
                self.rss_at_go = event.rss
                self.go.touch()


@pytest.mark.alone  # forked from a busy test process, the rank's inherited pages eat into the 200 MiB
@pytest.mark.timeout(120)
def test_a_rank_killed_in_its_memory_cgroup_is_reported_out_of_memory(small_cgroup, tmp_path, no_orphans):
    sink = _GoWhenInCgroup(tmp_path / "go", 200 * MiB)
    with pytest.raises(LaunchFailedError) as caught:
        notebook_launcher(
            outgrow_cgroup, (str(small_cgroup), str(tmp_path / "go")), num_processes=2, start_method="fork",
            sinks=[sink], timeout=100,
        )  # fmt: skip
    failure = caught.value.reports[1]
    assert failure.signal_name == "SIGKILL" and failure.oom == "certain", failure
    name = "/" + str(small_cgroup.relative_to(_cgroup_v1_memory()))  # as /proc/PID/cgroup names it
    summary = failure.summary()
    assert summary.startswith(
        f"rank 1 was killed (SIGKILL), out of memory: its memory cgroup {name} counted an OOM kill (limit 200.0 MiB)"
    ), summary
    assert f"its RSS peaked at {oom.human_bytes(failure.peak_rss)}" in summary
    assert failure.peak_rss >= sink.rss_at_go + 100 * MiB  # the kernel's peak: after it allocated
    assert summary in str(caught.value)
    stopped = [e for e in sink.events if isinstance(e, ev.RankStopped)]
    assert [e.rank for e in stopped] == [0], sink.events
    assert 0 not in caught.value.reports
    no_orphans()


@pytest.mark.timeout(120)
def test_an_elastic_worker_killed_in_its_memory_cgroup_is_reported_out_of_memory(small_cgroup, tmp_path, no_orphans):
    # The agent reaps elastic workers: the hub's samples give the peak and the cgroup's counter.
    sink = _GoWhenInCgroup(tmp_path / "go", 200 * MiB)
    with pytest.raises(LaunchFailedError) as caught:
        notebook_launcher(
            outgrow_cgroup, (str(small_cgroup), str(tmp_path / "go")), num_processes=2, max_restarts=0,
            rdzv_backend="c10d", sinks=[sink], timeout=100,
        )  # fmt: skip
    failure = caught.value.reports[1]
    assert failure.signal_name == "SIGKILL" and failure.oom == "certain", failure
    name = "/" + str(small_cgroup.relative_to(_cgroup_v1_memory()))
    assert failure.summary().startswith(
        f"rank 1 was killed (SIGKILL), out of memory: its memory cgroup {name} counted an OOM kill (limit 200.0 MiB)"
    ), failure.summary()
    assert failure.peak_rss >= sink.rss_at_go  # sampled: at least what it held when it was told to go
    assert 0 not in caught.value.reports  # rank 0 only met the agent's SIGTERM: stopped, not failed
    assert [e.rank for e in sink.events if isinstance(e, ev.RankStopped)] == [0], sink.events
    no_orphans()


def test_the_launchers_own_memory_cgroup_is_found_and_read():
    found = oom.cgroup_of(os.getpid())
    if found is None:
        pytest.skip("no memory cgroup mounted here")
    assert os.path.isdir(found.dirs[0]) and found.dirs[0].endswith(found.name.rstrip("/"))
    counters = found.counters()
    assert found.dirs[0] in counters and set(counters) <= set(found.dirs)
    limit = oom.effective_limit(found, psutil.virtual_memory().total)
    assert 0 < limit <= psutil.virtual_memory().total
    assert oom.counted_kill(found, counters) == ""  # nothing was killed since


def test_the_words_for_a_sigkilled_rank():
    gib = 1 << 30
    assert oom.diagnose(int(21.8 * gib), int(23.5 * gib), "") == (
        "likely",
        "most likely out of memory: its RSS peaked at 21.8 GiB of 23.5 GiB",
    )
    assert oom.diagnose(2 * gib, int(23.5 * gib), "") == ("", "")  # far from any limit: no guess
    assert oom.diagnose(None, int(23.5 * gib), "") == ("", "")
    certain = oom.diagnose(10 * MiB, 200 * MiB, "its memory cgroup /x counted an OOM kill")
    assert certain == (
        "certain",
        "out of memory: its memory cgroup /x counted an OOM kill (limit 200.0 MiB); its RSS peaked at 10.0 MiB",
    )
    failed = ev.RankFailed(1, 42, -9, signal_name="SIGKILL", oom="likely", memory_note="most likely out of memory: x")
    assert failed.summary() == "rank 1 was killed (SIGKILL), most likely out of memory: x"
    assert ev.RankFailed(1, 42, -9, signal_name="SIGKILL").summary() == "rank 1 died with SIGKILL"



# A stand-in libnvidia-ml, compiled here: NVML cannot run on this machine, and what must be right is
# the ctypes side (structure layouts, the size-retry protocol, the calls a driver lacks). Each line of
# the file $STANDIN_NVML is a device: "utilisation pid used pid used ...", or "x" for one that fails.
STANDIN_NVML_C = r"""
#include <stdio.h>
#include <stdlib.h>
typedef struct { unsigned gpu, memory; } util_t;
typedef struct { unsigned pid; unsigned long long used; } proc_t;  /* nvmlProcessInfo_v1_t */
/* What _v3 filled on drivers 535.43-535.86 (nvmlProcessInfo_v3_t, 32 bytes); others wrote 24. */
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; unsigned long long cc; } proc_v3_t;
static int device_line(long index, char *line, int size) {
    FILE *f = fopen(getenv("STANDIN_NVML"), "r");
    long i = 0;
    int found = 0;
    if (!f) return 0;
    while (fgets(line, size, f)) if (i++ == index) { found = 1; break; }
    fclose(f);
    return found;
}
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *count) {
    char line[4096];
    unsigned n = 0;
    while (device_line(n, line, sizeof line)) n++;
    *count = n;
    return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **handle) { *handle = (void *)(long)(index + 1); return 0; }
int nvmlDeviceGetUtilizationRates(void *handle, util_t *util) {
    char line[4096];
    if (!device_line((long)handle - 1, line, sizeof line) || line[0] == 'x') return 15;  /* GPU_IS_LOST */
    util->gpu = (unsigned)strtoul(line, NULL, 10);
    util->memory = 0;
    return 0;
}
static int running(void *handle, unsigned *count, proc_t *infos) {
    char line[4096], *at, *end;
    proc_t found[256];
    unsigned n = 0, i;
    if (!device_line((long)handle - 1, line, sizeof line)) return 15;
    strtoul(line, &at, 10);
    for (;;) {
        unsigned long pid = strtoul(at, &end, 10);
        if (end == at) break;
        at = end;
        found[n].pid = (unsigned)pid;
        found[n].used = strtoull(at, &at, 10);
        n++;
    }
    if (*count < n) { *count = n; return 7; }  /* INSUFFICIENT_SIZE */
    for (i = 0; i < n; i++) infos[i] = found[i];
    *count = n;
    return 0;
}
/* The unversioned call fills v1 entries; _v3 larger ones, their size by driver: a reader must use the first. */
int nvmlDeviceGetComputeRunningProcesses(void *h, unsigned *c, proc_t *i) { return running(h, c, i); }
int nvmlDeviceGetComputeRunningProcesses_v3(void *h, unsigned *c, proc_v3_t *infos) {
    proc_t found[256];
    unsigned n = *c < 256 ? *c : 256, i;
    int status = running(h, &n, found);
    *c = n;
    if (status == 0) for (i = 0; i < n; i++) { infos[i].pid = found[i].pid; infos[i].used = found[i].used; }
    return status;
}
"""


@pytest.fixture
def standin_nvml(tmp_path, monkeypatch):
    import subprocess

    source, library = tmp_path / "nvml.c", tmp_path / "libnvidia-ml.so.1"
    source.write_text(STANDIN_NVML_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    devices = tmp_path / "devices"
    monkeypatch.setenv("STANDIN_NVML", str(devices))
    return str(library), devices


@pytest.mark.timeout(60)
def test_device_memory_is_read_from_nvml_summed_over_a_ranks_devices_and_its_peak_kept(standin_nvml):
    import subprocess

    from notebook_accel.device_probes import NvmlProcesses
    from notebook_accel.launch.resources import ResourceSampler

    library, devices = standin_nvml
    sleepers = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        a, b, c = (p.pid for p in sleepers)
        crowd = " ".join(f"{100000 + i} {MiB}" for i in range(40))  # more than the first buffer holds
        unknown = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE
        devices.write_text(f"40 {a} {3 * MiB} {b} {unknown}\n90 {crowd} {a} {5 * MiB}\nx\n")
        sampler = ResourceSampler({0: a, 1: b, 2: c}, interval=0)
        sampler.nvml = NvmlProcesses.open(library)
        assert sampler.nvml is not None and len(sampler.nvml.handles) == 3
        rows = {r.rank: r for r in sampler.sample(time.monotonic(), [0, 1, 2])}
        assert (rows[0].device_memory, rows[0].device_util) == (8 * MiB, 90)  # both devices
        assert (rows[1].device_memory, rows[1].device_util) == (None, None)  # NVML could not tell
        assert (rows[2].device_memory, rows[2].device_util) == (None, None)  # on no device
        devices.write_text(f"10 {a} {MiB}\n")
        rows = {r.rank: r for r in sampler.sample(time.monotonic(), [0, 1, 2])}
        assert (rows[0].device_memory, rows[0].device_util) == (MiB, 10)
        assert sampler.peaks(0)[1] == 8 * MiB and sampler.peaks(1)[1] is None  # the peak is kept
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_without_nvml_there_is_no_reader(tmp_path):
    from notebook_accel.device_probes import NvmlProcesses

    assert NvmlProcesses.open(str(tmp_path / "no-such-libnvidia-ml.so")) is None
