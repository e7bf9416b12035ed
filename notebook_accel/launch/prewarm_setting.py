"""NOTEBOOK_ACCEL_PREWARM: whether a kernel prepares launches early (the warm forkserver,
launch/prewarm.py, and the modules ranks import, launch/rank_imports.py). Read in one place that
both ask, so neither imports the other for it."""

from __future__ import annotations

import os
import warnings

ENV = "NOTEBOOK_ACCEL_PREWARM"
_ON = ("", "1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def wanted() -> bool:
    """NOTEBOOK_ACCEL_PREWARM read: on unless set to 0 (or false/no/off); a value it does not
    understand is named in a warning and read as off."""
    value = os.environ.get(ENV, "")
    text = value.strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    warnings.warn(
        f"{ENV}={value!r} is not understood, so nothing is prepared early (the warm forkserver, the "
        f"modules ranks import): set {ENV}=1 (the default) or {ENV}=0 (each launch prepares what it needs).",
        stacklevel=2,
    )
    return False
