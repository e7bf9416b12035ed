"""Experiment trackers: a built-in JSON-lines tracker, TensorBoard when installed, and your own.

Trackers log on the main process only: every method of a `GeneralTracker` subclass whose
`main_process_only` is True does nothing on the other ranks, so a training loop can call them
everywhere.
"""

from __future__ import annotations

import functools
import json
import numbers
import os
import time
from typing import Any, Optional

_GUARDED = ("store_init_configuration", "log", "finish")


def _is_main_process() -> bool:
    from .state import PartialState

    return PartialState().is_main_process


def _main_only(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(self, "main_process_only", False) and not _is_main_process():
            return None
        return method(self, *args, **kwargs)

    wrapper._main_only = True
    return wrapper


class GeneralTracker:
    """Base for trackers: subclass it, set `name` and `requires_logging_directory`, implement the methods.

    `init_trackers` builds each tracker as `cls(run_name, logging_dir, **init_kwargs)` on the main
    process (pass an instance to `log_with` for anything else).
    """

    name: str = "general"
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for attr in _GUARDED:
            method = cls.__dict__.get(attr)
            if callable(method) and not getattr(method, "_main_only", False):
                setattr(cls, attr, _main_only(method))

    @property
    def tracker(self):
        """The underlying writer or run object, for calls this class does not wrap."""
        return None

    def store_init_configuration(self, values: dict) -> None:
        """Record the run's hyperparameters once, at the start."""

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        """Record a dict of metrics at `step`."""

    def finish(self) -> None:
        """Flush and close."""


def _plain(key: str, value):
    """A JSON-ready copy of one logged value; TypeError naming the key otherwise."""
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d tensors and numpy scalars
        return value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(f"{key}[{i}]", v) for i, v in enumerate(value)]
    raise TypeError(
        f"Cannot log {key}={value!r}: a {type(value).__name__} is not a number, string, tensor, list or dict."
    )


class JSONLTracker(GeneralTracker):
    """Writes `{logging_dir}/{run_name}/metrics.jsonl`: one JSON object per `log` call.

    Each line is `{"step": step, "timestamp": unix_seconds, **values}`; read it back with
    `pandas.read_json(path, lines=True)`. The configuration goes to `config.json` beside it.
    """

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        if not logging_dir:
            raise ValueError(
                "JSONLTracker needs a logging_dir (ProjectConfiguration(logging_dir=...) or project_dir)."
            )
        self.run_name = run_name
        self.run_dir = os.path.join(str(logging_dir), str(run_name))
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self.config_path = os.path.join(self.run_dir, "config.json")
        self._file = None
        if not self.main_process_only or _is_main_process():
            os.makedirs(self.run_dir, exist_ok=True)
            # Appending: a resumed run continues the same file.
            self._file = open(self.metrics_path, "a", encoding="utf-8")

    @property
    def tracker(self):
        return self._file

    def store_init_configuration(self, values: dict) -> None:
        with open(self.config_path, "w", encoding="utf-8") as f:
            json.dump(values, f, indent=2, default=str)

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        if not isinstance(values, dict):
            raise TypeError(f"log() takes a dict of name -> value, not {type(values).__name__}.")
        reserved = [k for k in ("step", "timestamp") if k in values]
        if reserved:
            raise ValueError(
                f"{reserved} are written by the JSONL tracker itself; log the value under another name."
            )
        if self._file is None or self._file.closed:
            raise RuntimeError(
                f"The JSONL tracker for {self.run_dir!r} is finished; start new trackers to log again."
            )
        record = {"step": step, "timestamp": time.time()}
        record.update({str(k): _plain(str(k), v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a reader (or a crash) sees every line already logged

    def finish(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files to `{logging_dir}/{run_name}` (needs the tensorboard package)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        if not _tensorboard_available():
            raise ImportError("TensorBoardTracker needs the tensorboard package: pip install tensorboard")
        self.run_name = run_name
        self.logging_dir = os.path.join(str(logging_dir), str(run_name))
        self.writer = None
        if not self.main_process_only or _is_main_process():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict) -> None:
        # add_hparams takes only scalars and strings.
        flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in values.items()}
        self.writer.add_hparams(flat, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(
                    key, {k: _plain(k, v) for k, v in value.items()}, global_step=step, **kwargs
                )
            else:
                self.writer.add_scalar(key, _plain(key, value), global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


TRACKERS = {
    "jsonl": (JSONLTracker, lambda: True),
    "tensorboard": (TensorBoardTracker, _tensorboard_available),
}
# accelerate's other integrations: named so the error can say what to do instead.
_NOT_BUILT_IN = ("wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")


def _tracker_name(item) -> str:
    value = getattr(item, "value", item)  # accelerate's LoggerType enum members carry the name
    return str(value).lower()


def filter_trackers(log_with, logging_dir: Optional[str] = None) -> list:
    """Resolve `log_with` into tracker classes and instances.

    Accepts None, "all" (every built-in tracker installed here), "jsonl", "tensorboard",
    GeneralTracker instances or subclasses, or a list of those. Unknown names, trackers whose package
    is missing, and trackers that need a logging folder when none is set raise a ValueError.
    """
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    resolved = []
    for item in items:
        if isinstance(item, GeneralTracker) or (isinstance(item, type) and issubclass(item, GeneralTracker)):
            resolved.append(item)
            continue
        name = _tracker_name(item)
        if name == "all":
            resolved.extend(cls for cls, available in TRACKERS.values() if available())
            continue
        if name in _NOT_BUILT_IN and name not in TRACKERS:
            raise ValueError(
                f"log_with={name!r} is not built into notebook_accel. Subclass notebook_accel.tracking.GeneralTracker "
                f"around {name} and pass an instance, or use one of {sorted(TRACKERS)}."
            )
        if name not in TRACKERS:
            raise ValueError(
                f"Unknown tracker {item!r} in log_with: choose from {sorted(TRACKERS) + ['all']}, or pass a GeneralTracker."
            )
        cls, available = TRACKERS[name]
        if not available():
            raise ValueError(
                f"log_with={name!r} needs the {name} package, which is not installed: pip install {name}"
            )
        resolved.append(cls)
    unique = []
    for item in resolved:  # "all" plus a name must not log twice
        if item in unique:
            continue
        # An instance already has its folder; a class is built later with logging_dir.
        if isinstance(item, type) and item.requires_logging_directory and not logging_dir:
            raise ValueError(_no_dir_message(item.name))
        unique.append(item)
    return unique


def _no_dir_message(name: str) -> str:
    return (
        f"The {name!r} tracker writes files but no logging folder is set: pass Accelerator(project_dir=...) "
        "or ProjectConfiguration(logging_dir=...)."
    )


def make_trackers(
    run_name: str,
    trackers: list,
    logging_dir: Optional[str] = None,
    config: Optional[dict] = None,
    init_kwargs: Optional[dict] = None,
) -> list:
    """Instances for what `filter_trackers` returned, each given `config` when not None.

    `init_kwargs` maps a tracker name to extra keyword arguments for its constructor.
    """
    init_kwargs = init_kwargs or {}
    built = []
    for item in trackers:
        tracker = (
            item(run_name, logging_dir, **init_kwargs.get(item.name, {})) if isinstance(item, type) else item
        )
        if config is not None:
            tracker.store_init_configuration(config)
        built.append(tracker)
    return built


def on_main_process(function):
    """Decorate a tracker method so it runs only on the main process when the tracker's
    `main_process_only` is True (GeneralTracker subclasses get this for log, store_init_configuration
    and finish already)."""
    return _main_only(function)


def get_available_trackers() -> list:
    """The names `log_with` accepts here: built-in trackers whose package is installed, and registered ones."""
    return [name for name, (_, available) in TRACKERS.items() if available()]


def register_tracker_class(tracker_class) -> None:
    """Make a GeneralTracker subclass usable by its `name` in `Accelerator(log_with=...)`.

    It is built as `tracker_class(run_name, logging_dir, **init_kwargs[name])`; a class with
    `requires_logging_directory` needs a logging folder. Registering an existing name replaces it,
    with a warning.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class takes a GeneralTracker subclass, got {tracker_class!r}")
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name or name in (GeneralTracker.name, "all"):
        raise ValueError(f"{tracker_class.__name__} must set a `name` of its own (got {name!r})")
    if name in TRACKERS:
        import warnings

        warnings.warn(f"tracker {name!r} was registered already; {tracker_class.__name__} replaces it", stacklevel=2)
    TRACKERS[name] = (tracker_class, lambda: True)
