"""`stall_after`: how long no rank of a launch or session cell may go without progress before the
stall watch tells the user. Every spelling (notebook_launcher, %%accelerate, sessions, the CLI, the
config file) resolves here: the argument, else $NOTEBOOK_ACCEL_STALL_AFTER, else the config's
`stall_after`, else 60 s. 0 turns the watch off.

Imports no torch: the CLI's and the magic's argument parsers use `seconds` too.
"""

from __future__ import annotations

import math
import numbers
import os

STALL_AFTER_ENV = "NOTEBOOK_ACCEL_STALL_AFTER"
DEFAULT_STALL_AFTER = 60.0
HOW = "write a number of seconds, 0 to turn the watch off"


def seconds(value) -> float:
    """`value` (an int, a float, or a numeric string like "30" or "2.5") as seconds; 0.0 is off.
    Otherwise ValueError, whose text says what is wrong ("is not a number", "is negative", ...)."""
    if isinstance(value, bool):  # an int to Python, but True never means 1 second
        raise ValueError("is true or false, not a number")
    if not isinstance(value, (str, numbers.Real)):
        raise ValueError(f"is a {type(value).__name__}, not a number")
    try:
        number = float(value)
    except ValueError:  # "1m", "", "30s"
        raise ValueError("is not a number") from None
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ValueError("is not a finite number")
    if number < 0:
        raise ValueError("is negative")
    return number if number else 0.0  # -0.0 reads as off, and prints as 0.0


def resolve_stall_after(argument=None, config=None) -> float:
    """Seconds without progress before the stall watch speaks (0.0: off). `argument` (None: not
    given), else $NOTEBOOK_ACCEL_STALL_AFTER (empty: not set), else `config`'s stall_after (a
    config.ClusterConfig, or None for no config file), else DEFAULT_STALL_AFTER. A bad value raises
    LaunchConfigError naming the value and where it came from."""
    if argument is not None:
        return _checked(argument, f"stall_after={argument!r}")
    text = os.environ.get(STALL_AFTER_ENV, "")
    if text:
        return _checked(text, f"{STALL_AFTER_ENV}={text!r}")
    value = getattr(config, "stall_after", None)
    if value is not None:
        path = getattr(config, "path", None) or "<config>"
        return _checked(value, f"stall_after: {value!r} in the config file {path}")
    return DEFAULT_STALL_AFTER


def _checked(value, where: str) -> float:
    try:
        return seconds(value)
    except ValueError as exc:
        from .errors import LaunchConfigError  # imports torch: only when there is something to say

        raise LaunchConfigError(f"{where} {exc}: {HOW}.") from None
