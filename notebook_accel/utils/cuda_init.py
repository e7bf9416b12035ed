"""Where this process first initialised CUDA, so that a refused fork launch can name the line.

`install()` (the package root calls it on import) wraps `torch.cuda._lazy_init`, which every first
use of CUDA goes through (torch's C++ looks it up by name too). The wrapper notes the first calling
frame outside torch and notebook_accel, lets torch's own run, and once CUDA is up puts torch's own
back, so after the first initialisation it costs nothing. If torch is not imported yet, a one-shot
import hook wraps `torch.cuda` as it loads. If CUDA is already up when `install()` runs, that is
what is recorded: it happened before notebook_accel was imported.
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import NamedTuple, Optional


class Origin(NamedTuple):
    filename: str
    lineno: int
    source: str  # the line's text, "" where it is not known


BEFORE_IMPORT = "before notebook_accel was imported"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # notebook_accel/
_origin = None  # an Origin, BEFORE_IMPORT, or None (not initialised, or not seen)
_installed = False


def install() -> None:
    """Start recording (idempotent; imports nothing)."""
    global _installed
    if _installed:
        return
    _installed = True
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None:
        _wrap(cuda)
    else:
        sys.meta_path.insert(0, _TorchCudaHook())


def origin():
    """Where CUDA was first initialised here: an Origin, BEFORE_IMPORT, or None if not known."""
    return _origin


def record(frame=None) -> None:
    """Record a CUDA initialisation made from `frame` (default: the caller's), unless one is recorded."""
    global _origin
    if _origin is None:
        _origin = culprit(frame if frame is not None else sys._getframe(1))


def reset() -> None:
    """Forget what was recorded (tests)."""
    global _origin
    _origin = None


def culprit(frame) -> Origin:
    """The innermost frame from `frame` outwards that is neither torch's nor notebook_accel's code."""
    torch_dir = _torch_dir()
    first = frame
    while frame is not None:
        name = frame.f_code.co_filename
        ours = name.startswith(_PACKAGE) or (torch_dir and name.startswith(torch_dir))
        if not ours and not name.startswith("<frozen "):
            break
        frame = frame.f_back
    frame = frame or first
    name, line = frame.f_code.co_filename, frame.f_lineno
    return Origin(name, line, linecache.getline(name, line).strip())


def describe() -> str:
    """One sentence for a refused fork launch: where CUDA was initialised, and what to move; "" if
    not known. A notebook cell shows as `File "<its file>"`: the front end's labeller names it."""
    found = _origin
    if found is None:
        return ""
    if found == BEFORE_IMPORT:
        return (
            "CUDA was initialised before notebook_accel was imported, so the line is not known (import "
            "notebook_accel first to have it named). Either restart the kernel and keep CUDA calls inside "
            "the launched function"
        )
    code = f": {found.source}" if found.source else ""
    return (
        f'CUDA was first initialised at File "{found.filename}", line {found.lineno}{code}. Either restart '
        "the kernel and move that line into the launched function"
    )


def _torch_dir() -> str:
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else ""


def _wrap(cuda) -> None:
    global _origin
    try:
        up = cuda.is_initialized()
    except Exception:  # not torch.cuda as we know it: record nothing
        return
    if up:
        if _origin is None:
            _origin = BEFORE_IMPORT
        return
    original = getattr(cuda, "_lazy_init", None)
    if original is None or getattr(original, "_records_origin", False):
        return

    def _lazy_init(*args, **kwargs):
        global _origin
        seen: Optional[Origin] = None
        if _origin is None and not cuda.is_initialized():
            seen = culprit(sys._getframe(1))
        try:
            return original(*args, **kwargs)
        finally:
            if cuda.is_initialized():
                if seen is not None and _origin is None:
                    _origin = seen
                if getattr(cuda, "_lazy_init", None) is _lazy_init:
                    cuda._lazy_init = original  # recorded: torch's own again, at no cost

    _lazy_init._records_origin = True
    _lazy_init.__wrapped__ = original
    _lazy_init.__doc__ = original.__doc__
    cuda._lazy_init = _lazy_init


class _TorchCudaHook:
    """A meta-path finder for `torch.cuda` alone: the standard spec, wrapped once the module ran."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.cuda" or path is None:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)  # one shot; the import system is no longer looping over it
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec
