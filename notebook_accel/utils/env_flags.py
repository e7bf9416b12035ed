"""Small helpers over os.environ with accelerate's names: truth values, flags, and temporary changes."""

from __future__ import annotations

import contextlib
import dataclasses
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


_PURGE_PREFIX = "ACCELERATE_"
_FORBIDDEN = (";", "\n", "<", ">", " ")


def convert_dict_to_env_variables(current_env: dict) -> list:
    """`KEY=VALUE\\n` lines for the entries safe to write to an environment file; entries with an empty
    key or value, or with any of ; < > space or a newline, are left out with a warning naming them."""
    import logging

    # Logged as accelerate logs it, under accelerate's module name: a logging setup written for
    # accelerate (and accelerate's tests) watches that logger.
    logger = logging.getLogger("accelerate.utils.environment")
    lines = []
    for key, value in current_env.items():
        key, value = str(key), str(value)
        if key and value and not any(c in key + value for c in _FORBIDDEN):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning(f"skipping {key}={value!r}: empty, or holds one of {_FORBIDDEN}")
    return lines


@contextlib.contextmanager
def _accelerate_variables_restored():
    saved = {k: v for k, v in os.environ.items() if k.startswith(_PURGE_PREFIX)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_PURGE_PREFIX)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls):
    """Decorate a function (or a test class: its `test*` methods) so the ACCELERATE_* variables it
    sets or changes are put back as they were when it returns."""
    import functools

    def wrap(function):
        if getattr(function, "_accelerate_environment_purged", False):
            return function

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _accelerate_variables_restored():
                return function(*args, **kwargs)

        wrapper._accelerate_environment_purged = True
        return wrapper

    if not isinstance(func_or_cls, type):
        if not callable(func_or_cls):
            raise TypeError(f"purge_accelerate_environment decorates a function or class, not {func_or_cls!r}")
        return wrap(func_or_cls)

    def wrap_tests(cls):
        for name, member in list(vars(cls).items()):
            if name.startswith("test") and callable(member):
                setattr(cls, name, wrap(member))
        return cls

    previous = func_or_cls.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(func_or_cls, cls).__init_subclass__(**kwargs)
        wrap_tests(cls)

    func_or_cls.__init_subclass__ = classmethod(init_subclass)
    return wrap_tests(func_or_cls)


@dataclasses.dataclass(frozen=True)
class CPUInformation:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def get_cpu_distributed_information() -> CPUInformation:
    """This process's rank and sizes as torchrun or an MPI launcher (Intel MPI, Open MPI, MVAPICH) set them."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(
            ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"], 0
        ),
        local_world_size=get_int_from_env(
            ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"], 1
        ),
    )
