"""The argparse `type=` validators the CLI's subcommands and the %%accelerate magic share, so a bad
value reads the same in a terminal and in a notebook."""

from __future__ import annotations

import argparse
from typing import Callable

from ..launch import stall_settings


def whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def at_least(minimum: int) -> Callable[[str], int]:
    """A validator for whole numbers >= `minimum`."""

    def check(text: str) -> int:
        value = whole(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value

    return check


positive = at_least(1)
non_negative = at_least(0)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def stall_seconds(text: str) -> float:
    """--stall-after: seconds without progress before the stall watch speaks; 0 turns it off."""
    try:
        return stall_settings.seconds(text)
    except ValueError as exc:  # worded as the launch's own error, which names its source
        raise argparse.ArgumentTypeError(f"{text!r} {exc}: {stall_settings.HOW}") from None


def port(text: str) -> str:
    """A TCP port (1..65535) or 'auto' (a free one)."""
    if text.lower() == "auto":
        return "auto"
    value = whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535 or 'auto', got {text!r}")
    return str(value)


def json_object(text: str) -> dict:
    """A command-line value such as '{"CPU": 1}' (resources_per_rank, runtime_env) as a dict; an
    argparse type: what is wrong is said in the ArgumentTypeError."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object, like '{{\"CPU\": 1}}' (quoted)")
    return value
