"""Rich output on a worker: mime bundles for a cell's result, display() calls and open figures.

A bundle is a dict mime type -> JSON value (images base64), like Jupyter's display data.
IPython's formatters are used when IPython is importable; otherwise text/plain is repr().
"""

from __future__ import annotations

import base64
import io
import json
import sys

BACKEND = "module://notebook_accel.session.mpl_backend"
pending: list = []  # bundles shown during the current cell, in order
_formatter = None


def bundle(obj) -> dict:
    if _is_figure(obj):
        return figure_bundle(obj)
    data = {}
    formatter = _display_formatter()
    if formatter is not None:
        try:
            data, _ = formatter.format(obj)
        except Exception:
            data = {}
    out = {}
    for mime, value in data.items():
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[mime] = value
    if "text/plain" not in out:
        out["text/plain"] = _safe_repr(obj)
    return out


def display(*objs) -> None:
    """Show objects in the cell's output (the worker's `display` builtin)."""
    for obj in objs:
        pending.append(bundle(obj))


def figure_bundle(fig) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return {"text/plain": _safe_repr(fig), "image/png": base64.b64encode(buf.getvalue()).decode("ascii")}


def capture_figures(skip=None) -> None:
    """Turn every open pyplot figure into a bundle and close it (what plt.show does here)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if fig is not skip:
                pending.append(figure_bundle(fig))
    finally:
        plt.close("all")


def take() -> list:
    shown = list(pending)
    pending.clear()
    return shown


def use_backend() -> None:
    """Figures render off-screen (Agg) and come back as PNG; a forked kernel's inline backend
    would talk to the kernel's sockets, so it is replaced too."""
    import os

    os.environ["MPLBACKEND"] = BACKEND
    if "matplotlib" in sys.modules:
        try:
            sys.modules["matplotlib"].use(BACKEND, force=True)
        except Exception:
            pass


def _is_figure(obj) -> bool:
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(obj, figure.Figure)


def _display_formatter():
    global _formatter
    if _formatter is None:
        try:
            from IPython.core.formatters import DisplayFormatter
        except Exception:
            _formatter = False
        else:
            _formatter = DisplayFormatter()
    return _formatter or None


def _safe_repr(obj) -> str:
    try:
        return repr(obj)
    except Exception as exc:
        return f"<{type(obj).__name__} object (repr failed: {exc})>"
