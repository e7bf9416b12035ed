"""What a launch's arguments and the config file choose together: marked defaults (an argument the
caller did not pass), the file's values for those, and its `engine: ray` (the plan's input,
launch/plan.py; the file itself is config.py)."""

from __future__ import annotations

from . import ray_plan


# Marked defaults: they print as the documented value, yet tell "not passed" from "passed", so the
# config file can supply what the caller left out and an explicit argument still wins.
class _Default:
    pass


class _DefaultStr(str, _Default):
    pass


class _DefaultInt(int, _Default):
    pass


def default(value):
    """A marked default for a launch argument (see is_default)."""
    return _DefaultInt(value) if isinstance(value, int) else _DefaultStr(value)


def is_default(value) -> bool:
    """True for None and marked defaults: the caller did not choose this value."""
    return value is None or isinstance(value, _Default)


def passed(value) -> bool:
    """The caller gave this argument (not its marked default, None, "", or False; 0 is given)."""
    return not is_default(value) and value is not None and value is not False and value != ""


CONFIGURABLE = (
    "num_processes",
    "mixed_precision",
    "use_port",
    "master_addr",
    "node_rank",
    "num_nodes",
    "cpu",
    "rdzv_backend",
    "max_restarts",
    "debug",
    "gpu_ids",
)


def engine_from_config(arguments: dict, config, notes: list) -> tuple:
    """(engine, ray_address, resources_per_rank, placement): the arguments, with a config file's
    `engine: ray` and its Ray keys where the caller chose none. Explicit arguments win: a caller that
    places its ranks itself (start_method, use_port, ...; an interactive session and debug_launcher
    pass ONE_MACHINE) stays on this machine, and the plan's notes say why the file's engine went unused."""
    names = ("engine", "ray_address", "resources_per_rank", "placement")
    values = {name: arguments[name] for name in names}
    if config is None or config.engine != "ray":
        return tuple(values[name] for name in names)
    given = placing(arguments)
    if given and values["engine"] is None:
        placed = ", ".join(given)
        notes.append(f"{config.path} says engine: ray, which this launch does not use: it places its ranks ({placed})")
        return tuple(values[name] for name in names)
    taken = {name: getattr(config, name) for name in names if getattr(config, name) is not None}
    taken = {name: value for name, value in taken.items() if is_default(values[name])}
    values.update(taken)
    if taken:
        notes.append(f"from {config.path}: " + ", ".join(f"{k}={v!r}" for k, v in taken.items()))
    return tuple(values[name] for name in names)


def placing(arguments: dict) -> list:
    return [name for name in ray_plan.PLACED_BY_RAY if passed(arguments.get(name))]


def on_ray(given: dict, config_file=None) -> bool:
    """Whether a launch with these arguments (notebook_launcher's) runs on Ray: `engine="ray"`, or
    the config file's `engine: ray` with none of the arguments that keep a launch here. For callers
    that must prepare before the plan is made (the cell magic pickles the cell for Ray, not for fork)."""
    if given.get("engine") is not None:
        return given["engine"] == "ray"
    from ..config import ConfigError

    try:
        config = load_config(config_file)
    except ConfigError:
        return False  # the launch itself says what is wrong with the file
    return config is not None and config.engine == "ray" and not placing(given)


def with_config(config_file, notes: list, given: dict) -> tuple:
    """`given` ({name in CONFIGURABLE: value}), with the config's values where the caller chose none;
    the variables the config sets for every rank (FSDP's); and the config itself (or None)."""
    config = load_config(config_file)
    if config is None:
        return given, {}, None
    values = dict(given)
    taken = {k: v for k, v in config.launch_defaults().items() if is_default(values[k])}
    shown = [
        f"{k}={v!r}" for k, v in taken.items() if v != values[k] and not (values[k] is None and v is False)
    ]
    if shown:
        notes.append(f"from {config.path}: {', '.join(shown)}")
    values.update(taken)
    return values, config.launch_env(), config


def load_config(config_file):
    """The launch config: `config_file` if given (it must exist), else the default file if present."""
    from .. import config

    return config.load_default() if config_file is None else config.load_config(config_file)
