"""Small helpers over os.environ with accelerate's names: truth values, flags, and temporary changes."""

from __future__ import annotations

import contextlib
import os

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value, to_bool: bool = False):
    """1 / 0 (True / False with `to_bool`) for y, yes, t, true, on, 1 / n, no, f, false, off, 0."""
    text = str(value).strip().lower()
    if text in _TRUE:
        return True if to_bool else 1
    if text in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"{value!r} is not a truth value: use one of {_TRUE} or {_FALSE}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The variable `key` read as a truth value, or `default` when it is not set."""
    return bool(str_to_bool(os.environ.get(key, str(default))))


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The variable `key` as set, or `default`."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys, default):
    """The first of the variables `env_keys` set to a non-negative integer, else `default`."""
    for key in env_keys:
        raw = os.environ.get(key)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
        if value >= 0:
            return value
    return default


@contextlib.contextmanager
def patch_environment(**kwargs):
    """Set the variables (names upper-cased, values as str) for the block; restore them after."""
    before = {}
    for key, value in kwargs.items():
        key = key.upper()
        before.setdefault(key, os.environ.get(key))
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment():
    """An empty os.environ for the block; the environment as it was comes back after."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
