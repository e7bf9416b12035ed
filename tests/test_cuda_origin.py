"""A fork launch refused because CUDA is initialised names the line that initialised it.

There is no CUDA here: the recorder is fed an initialisation (called from a line in this file, or
from a kernel cell), and the wrapper is tried on a stand-in for `torch.cuda` whose `_lazy_init`
"initialises". What torch reports afterwards (`torch.cuda.is_initialized()`) is given directly, as
tests/test_launch_plan.py does. tools/gpu_check.py checks the real thing on a GPU.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import types

import pytest
import torch
from kernels import kernel, run  # noqa: F401  (kernel is a fixture)

from notebook_accel.launch import LaunchConfigError, ListSink, make_plan, notebook_launcher
from notebook_accel.utils import cuda_init

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def recorder():
    """A clean record for one test, and the one before it put back."""
    before = cuda_init._origin
    cuda_init.reset()
    yield cuda_init
    cuda_init._origin = before


def _here() -> int:
    return inspect.currentframe().f_back.f_lineno


def test_a_refused_fork_names_the_line_and_both_ways_out(recorder, monkeypatch):
    line = _here() + 1
    recorder.record()  # stands in for torch.zeros(1, device="cuda") on this line
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    sink = ListSink()
    with pytest.raises(LaunchConfigError) as info:
        notebook_launcher(os.getpid, num_processes=2, sinks=[sink])
    message = str(info.value)
    assert f'File "{__file__}", line {line}: recorder.record()' in message, message
    assert "restart the kernel and move that line into the launched function" in message
    assert "start_method='spawn'" in message and sink.events == []


def test_without_a_record_the_refusal_says_what_it_always_said(recorder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchConfigError) as info:
        make_plan(num_processes=2, use_port="auto")
    assert "start_method='spawn'" in str(info.value) and "first initialised" not in str(info.value)


def test_the_wrapper_records_the_first_initialisation_outside_the_library_then_steps_aside(recorder):
    cuda = types.ModuleType("stand_in_cuda")
    state = {"up": False, "calls": 0}

    def _lazy_init():
        state["calls"] += 1
        state["up"] = True

    cuda.is_initialized = lambda: state["up"]
    cuda._lazy_init = _lazy_init
    recorder._wrap(cuda)
    wrapper = cuda._lazy_init
    assert wrapper is not _lazy_init and wrapper.__wrapped__ is _lazy_init
    recorder._wrap(cuda)
    assert cuda._lazy_init is wrapper  # idempotent: one wrapper
    line = _here() + 1
    cuda._lazy_init()
    assert recorder.origin() == (__file__, line, "cuda._lazy_init()")
    assert cuda._lazy_init is _lazy_init and state["calls"] == 1  # torch's own again: no cost from now on


def test_a_failed_initialisation_records_nothing_and_keeps_watching(recorder):
    cuda = types.ModuleType("stand_in_cuda")
    cuda.is_initialized = lambda: False

    def _lazy_init():
        raise RuntimeError("Found no NVIDIA driver on your system.")

    cuda._lazy_init = _lazy_init
    recorder._wrap(cuda)
    with pytest.raises(RuntimeError, match="no NVIDIA driver"):
        cuda._lazy_init()
    assert recorder.origin() is None and cuda._lazy_init is not _lazy_init


def test_cuda_already_up_when_installed_is_said_so(recorder):
    cuda = types.ModuleType("stand_in_cuda")
    cuda.is_initialized = lambda: True
    cuda._lazy_init = lambda: None
    recorder._wrap(cuda)
    assert recorder.origin() == cuda_init.BEFORE_IMPORT
    assert "before notebook_accel was imported" in recorder.describe()


def test_torch_here_is_wrapped_and_no_cuda_records_nothing():
    assert getattr(torch.cuda._lazy_init, "_records_origin", False)
    with pytest.raises((AssertionError, RuntimeError)):  # torch without CUDA, or no driver
        torch.zeros(1, device="cuda")
    assert cuda_init.origin() is None


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_notebook_accel_before_torch_wraps_torch_cuda_as_it_loads():
    out = _python(
        "import sys\nimport notebook_accel\nassert 'torch' not in sys.modules\nimport torch\n"
        "print(getattr(torch.cuda._lazy_init, '_records_origin', False),"
        " any(type(f).__name__ == '_TorchCudaHook' for f in sys.meta_path))"
    )
    assert out.split() == ["True", "False"]  # wrapped, and the one-shot hook is gone


def test_cuda_initialised_before_notebook_accel_is_named_as_such():
    out = _python(
        "import torch\ntorch.cuda.is_initialized = lambda: True  # CUDA up before the import\n"
        "from notebook_accel.launch import make_plan\n"
        "try:\n    make_plan(num_processes=2, use_port='auto')\nexcept Exception as exc:\n    print(exc)"
    )
    assert "CUDA was initialised before notebook_accel was imported" in out, out
    assert "start_method='spawn'" in out


@pytest.mark.timeout(120)
def test_in_a_kernel_the_cell_and_line_are_named(kernel):  # noqa: F811
    _, kc = kernel
    assert not run(kc, "%load_ext notebook_accel")["errors"]
    culprit = run(
        kc,
        "import torch\nfrom notebook_accel.utils import cuda_init\n"
        "cuda_init.record()  # stands in for torch.zeros(1, device='cuda')\n"
        "torch.cuda.is_initialized = lambda: True",
    )
    assert not culprit["errors"], culprit
    launch = run(kc, "from notebook_accel import notebook_launcher\nnotebook_launcher(print, num_processes=2)")
    [error] = launch["errors"]
    assert error["ename"] == "LaunchConfigError"
    assert "CUDA was first initialised at Cell In[2], line 3: cuda_init.record()" in error["evalue"], error
    assert "start_method='spawn'" in error["evalue"]
