"""How launch errors travel and show (issue #28, part 4): they survive pickle and copy, IPython's
rendering leaves the library's frames out of every exception in the chain, and a renderer that
fails still shows the whole traceback. The real kernel's view is in test_launcher_notebook.py."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import types

import pytest

from notebook_accel.jupyter import tracebacks
from notebook_accel.launch.errors import LaunchFailedError, LaunchTimeoutError, UnpicklableError
from notebook_accel.launch.events import RankFailed

PACKAGE = os.path.dirname(os.path.dirname(tracebacks.__file__))


def failed() -> LaunchFailedError:
    return LaunchFailedError([RankFailed(1, 42, 1, exc_type="ValueError", message="bad", traceback="Traceback: tb")])


def test_launch_errors_survive_pickle_and_copy():
    error = failed()
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is LaunchFailedError and str(again) == str(error)
        assert again.reports[1].traceback == "Traceback: tb" and sorted(again.failures) == [1]
    stopped = LaunchTimeoutError("timed out after 1 s")
    again = pickle.loads(pickle.dumps(stopped))
    assert type(again) is LaunchTimeoutError and str(again) == str(stopped) and again.reason == stopped.reason


def _raise_from_library():
    """An UnpicklableError raised `from` a cause, both through frames of this package."""
    import threading

    from notebook_accel.launch.payload import Payload

    Payload(lambda: None, (threading.Lock(),)).pickled()


def _files(tb) -> list:
    out = []
    while tb is not None:
        out.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return out


class _Shell:
    def __init__(self, fail=False):
        self.seen, self.fail = [], fail
        self.InteractiveTB = self

    def structured_traceback(self, etype, value, tb, tb_offset=0):
        if self.fail:
            raise RuntimeError("a formatter bug")
        link = value
        while link is not None:
            self.seen.append(_files(link.__traceback__))
            link = link.__cause__ or link.__context__
        return ["rendered"]


def test_every_exception_of_the_chain_is_shown_without_library_frames(monkeypatch):
    with pytest.raises(UnpicklableError) as caught:
        _raise_from_library()
    error = caught.value
    assert error.__cause__ is not None
    whole = (_files(error.__traceback__), _files(error.__cause__.__traceback__))
    assert any(f.startswith(PACKAGE) for f in whole[1]), whole  # the cause came through our frames
    shell = _Shell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert tracebacks.render(error) == ["rendered"]
    assert len(shell.seen) == 2, shell.seen
    for files in shell.seen:
        assert not any(f.startswith(PACKAGE) for f in files), shell.seen
    # The exception keeps every frame afterwards (%debug, a caller's own handler).
    assert (_files(error.__traceback__), _files(error.__cause__.__traceback__)) == whole


def test_a_failing_renderer_falls_back_to_the_whole_traceback(monkeypatch):
    with pytest.raises(UnpicklableError) as caught:
        _raise_from_library()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: _Shell(fail=True)))
    text = "".join(tracebacks.render(caught.value))
    assert "Traceback (most recent call last)" in text and "payload.py" in text, text
    assert "UnpicklableError" in text


SCRIPT = r"""
import sys, threading, time
import notebook_accel
from notebook_accel.launch import rank_imports
first = threading.Thread(target=rank_imports.import_all, kwargs={"respect_opt_out": False})
first.start()
time.sleep(0.2)  # the thread is inside `import torch._dynamo` now
busy = rank_imports.import_all(respect_opt_out=False, blocking=False)
done = rank_imports.import_all(respect_opt_out=False)  # waits for the thread's imports
spec = sys.modules["torch._dynamo"].__spec__
print(busy is None, getattr(spec, "_initializing", False), [n for n, _ in done][:1])
"""


@pytest.mark.timeout(120)
def test_a_second_caller_waits_for_the_first_so_nothing_forks_half_imported():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "['torch._dynamo']"], out.stdout
