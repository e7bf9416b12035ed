"""What a front end lends a launch, registered from above so that launch/ never imports it.

A launch asks here for its default sinks and for the way a traceback names notebook code. With
nothing registered (a script, a terminal, a worker) it gets rank-prefixed text and plain tracebacks.
`notebook_accel.jupyter` registers the live panel, the extension's comm sink, `Cell In[N]` labels
and the way IPython shows a launch error (without the library's frames).
"""

from __future__ import annotations

from typing import Callable, Optional

_sink_factory: Optional[Callable] = None
_traceback_labeller: Optional[Callable] = None
_traceback_renderer: Optional[Callable] = None
_path_labeller: Optional[Callable] = None


def register(
    sinks: Optional[Callable] = None,
    traceback_labeller: Optional[Callable] = None,
    traceback_renderer: Optional[Callable] = None,
    path_labeller: Optional[Callable] = None,
) -> None:
    """`sinks(show_after)` returns the sinks for one launch (None: the console's default);
    `traceback_labeller(text)` rewrites file names in a failure's text; `traceback_renderer(error)`
    returns the lines IPython shows for a launch error (errors.py); `path_labeller(text)` rewrites
    bare file paths, as pdb prints them (pdb_relay.py). Registering replaces."""
    global _sink_factory, _traceback_labeller, _traceback_renderer, _path_labeller
    if sinks is not None:
        _sink_factory = sinks
    if traceback_labeller is not None:
        _traceback_labeller = traceback_labeller
    if traceback_renderer is not None:
        _traceback_renderer = traceback_renderer
    if path_labeller is not None:
        _path_labeller = path_labeller


def traceback_renderer() -> Optional[Callable]:
    return _traceback_renderer


def default_sinks(show_after: float = 0.0) -> list:
    """The sinks a launch gets when its caller names none. `show_after`: a panel may wait this many
    seconds before it draws anything (session cells pass it, so a quick silent cell costs nothing)."""
    from .sinks import ConsoleSink

    if _sink_factory is not None:
        sinks = _sink_factory(show_after)
        if sinks is not None:
            return list(sinks)
    return [ConsoleSink()]


def label_traceback(text: str) -> str:
    return _label(_traceback_labeller, text)


def label_cell_paths(text: str) -> str:
    """pdb's `/tmp/ipykernel_1/123.py(4)f()` as `Cell In[5](4)f()`, where a front end knows the cell."""
    return _label(_path_labeller, text)


def _label(labeller: Optional[Callable], text: str) -> str:
    if labeller is None:
        return text
    try:
        return labeller(text)
    except Exception:  # a label is a nicety: never lose the text over it
        return text
