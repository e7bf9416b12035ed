"""The one rank channel: frames and lines in, typed events out (launch/channel.py), and the hooks
a front end registers so that launch/ never imports it (launch/frontend.py)."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from notebook_accel.launch import events as ev
from notebook_accel.launch.channel import HEADER, FrameBuffer, RankChannel, encode


def test_frames_split_anywhere_come_out_whole_and_in_order():
    data = encode(("started", 11)) + encode(("result", b"x" * 70000)) + encode(("error", {"a": 1}))
    buf, out = FrameBuffer(), []
    for i in range(0, len(data), 7):
        out += buf.feed(data[i : i + 7])
    assert out == [("started", 11), ("result", b"x" * 70000), ("error", {"a": 1})]
    assert not buf.buf


def test_a_frame_is_a_length_then_a_pickle():
    frame = encode(("started", 5))
    (size,) = HEADER.unpack_from(frame)
    assert size == len(frame) - HEADER.size
    assert pickle.loads(frame[HEADER.size :]) == ("started", 5)


def test_a_rank_channel_turns_streams_into_events():
    chan = RankChannel(3)
    assert chan.feed("ctrl", encode(("started", 42))) == [ev.RankStarted(3, 42)]
    assert chan.feed("stdout", b"one\ntw") == [ev.RankOutput(3, "stdout", "one")]
    # a bare \r ends a redraw: shown as transient, replaced by the next line of that stream
    assert chan.feed("stderr", b"50%\r") == [ev.RankOutput(3, "stderr", "50%", True)]
    assert chan.outcome is None
    chan.feed("ctrl", encode(("result", pickle.dumps("r"), [])))
    assert chan.outcome == "result" and chan.load_result() == "r" and chan.pid == 42
    # a stream that ends gives up its partial line as a whole one
    assert chan.feed("stdout", b"") == [ev.RankOutput(3, "stdout", "tw")]
    assert chan.open == {"stderr", "ctrl"}


def test_a_rank_s_function_beginning_is_kept_and_told_once():
    """("calling",): the rank got past its start; no event, but the stall watch's progress, once."""
    chan = RankChannel(1)
    chan.feed("ctrl", encode(("started", 7)))
    assert not chan.calling and not chan.moved()
    assert chan.feed("ctrl", encode(("calling",))) == []
    assert chan.calling and chan.moved() and not chan.moved()


def test_a_result_s_buffers_follow_its_frame_in_any_split():
    from notebook_accel.launch.payload import dumps_result

    value = {"a": np.arange(1000, dtype=np.int64), "b": np.zeros(0), "c": "text"}
    body, buffers = dumps_result(value)
    stream = encode(("result", body, [len(b) for b in buffers])) + b"".join(bytes(b) for b in buffers)
    for step in (1, 7, 4096, len(stream)):
        chan = RankChannel(0)
        for i in range(0, len(stream), step):
            assert chan.outcome is None
            chan.feed("ctrl", stream[i : i + step])
        assert chan.outcome == "result"
        got = chan.load_result()
        assert got["a"].tolist() == list(range(1000)) and got["b"].shape == (0,) and got["c"] == "text"


def test_an_error_outcome_wins_and_keeps_its_report():
    chan = RankChannel(0)
    report = {"exc_type": "ValueError", "message": "bad", "traceback": "tb"}
    chan.feed("ctrl", encode(("error", report)))
    assert chan.outcome == "error" and chan.error == report


def test_the_frame_format_is_parsed_in_one_module_only():
    # Binary framing (struct) lives in launch/channel.py; session/protocol.py is the signed channel
    # between the kernel and its workers, a different format on purpose.
    package = os.path.join(os.path.dirname(ev.__file__), "..")
    framers = []
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                text = open(path).read()
                if (
                    "struct." in text
                    or "import struct" in text
                    or ".unpack(" in text
                    or "unpack_from(" in text
                ):
                    framers.append(os.path.relpath(path, package))
    assert sorted(framers) == [os.path.join("launch", "channel.py"), os.path.join("session", "protocol.py")]


def _python(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_launch_outside_a_kernel_gets_the_console():
    out = _python(
        "from notebook_accel.launch import frontend\n"
        "print([type(s).__name__ for s in frontend.default_sinks()])\n"
        "print(frontend.label_traceback('File \"/tmp/ipykernel_1/2.py\"'))"
    )
    assert out.splitlines() == ["['ConsoleSink']", 'File "/tmp/ipykernel_1/2.py"']


def test_a_registered_front_end_chooses_the_sinks_and_labels():
    out = _python(
        "from notebook_accel.launch import frontend\n"
        "from notebook_accel.launch.sinks import ListSink\n"
        "frontend.register(sinks=lambda after: [ListSink()] if after else None,"
        " traceback_labeller=lambda t: t.upper())\n"
        "print([type(s).__name__ for s in frontend.default_sinks(0.5)])\n"
        "print([type(s).__name__ for s in frontend.default_sinks()])\n"
        "print(frontend.label_traceback('cell'))"
    )
    assert out.splitlines() == ["['ListSink']", "['ConsoleSink']", "CELL"]


def test_registering_in_a_kernel_stays_cheap():
    # `import notebook_accel` in a kernel registers the front end; it must not import torch,
    # IPython or ipywidgets (a kernel's first import, and every forked worker, would pay for it).
    out = _python(
        "import sys, types\n"
        "sys.modules['ipykernel'] = types.ModuleType('ipykernel')\n"
        "import notebook_accel\n"
        "from notebook_accel.launch import frontend\n"
        "print(frontend._sink_factory is not None)\n"
        "print(sorted(m for m in ('torch', 'IPython', 'ipywidgets') if m in sys.modules))"
    )
    assert out.splitlines() == ["True", "[]"]


_LARGE = """
import json, os, resource, sys
import torch
from notebook_accel.launch import notebook_launcher
from launch_targets import tensors_to_return
import notebook_accel.state, torch.distributed  # what a launch imports in the parent: not the result

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

# A small launch first: what any launch costs once (modules its result unpickles, threads, buffers of
# the allocator) is not the result's memory, and varies from one machine to another.
notebook_launcher(tensors_to_return, (1,), num_processes=2, start_method=sys.argv[1])
before = rss()
out = notebook_launcher(tensors_to_return, (100,), num_processes=2, start_method=sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
checks = []
for rank, o in enumerate(out):
    checks += [
        o["big"].shape == (100 << 18,), float(o["big"][0]) == rank, float(o["big"][-1]) == rank,
        o["head"].tolist() == [float(rank)] * 5,
        o["head"].data_ptr() == o["big"].data_ptr(),  # views share their storage again
        o["transposed"].data_ptr() == o["matrix"].data_ptr(), o["transposed"].tolist() == o["matrix"].t().tolist(),
        isinstance(o["param"], torch.nn.Parameter), o["param"].requires_grad, o["param"].dtype == torch.bfloat16,
        o["empty"].shape == (0, 3), o["array"].tolist() == list(range(10)), o["text"] == "x",
    ]
print(json.dumps({"checks": checks, "peak_added": peak, "result_bytes": 2 * (100 << 20)}))
"""


@pytest.mark.alone  # its peak memory grew by a copy when a parallel test process shared the 2 cores
@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_large_result_arrives_whole_without_copies(start_method):
    # 100 MB per rank: the old framing copied its buffer on every receive (minutes for this size)
    # and held the result about three times over in the parent.
    import json

    result = subprocess.run(
        [sys.executable, "-c", _LARGE, start_method],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=os.path.dirname(__file__),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(report["checks"]), report["checks"]
    # Less than one extra copy of any rank's 100 MB tensor (the old framing held three). The margin
    # is not a tighter ratio because the allocator's one-time costs vary between machines (CI once
    # counted 47 MB more than this machine); BENCHMARKS.md has the measured 1.01x for 1 GiB.
    assert report["peak_added"] < report["result_bytes"] + 0.9 * (100 << 20), report
