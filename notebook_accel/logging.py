"""get_logger: standard `logging`, aware of which process it runs in (accelerate's interface).

    logger = get_logger(__name__)
    logger.info("once, from the main process")
    logger.info("from every rank", main_process_only=False)
    logger.info("from every rank, rank 0 first", in_order=True)

Records carry `process_index`, so a handler's format may use `%(process_index)s`. As with any
logger, nothing at INFO shows until a handler is set up (e.g. `logging.basicConfig(level="INFO")`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

LOG_LEVEL_ENV = "ACCELERATE_LOG_LEVEL"


def _state():
    from .state import PartialState

    if not PartialState._shared_state:
        raise RuntimeError(
            "get_logger's logger needs to know which process it runs in: create an Accelerator() or "
            "PartialState() before logging (or use logging.getLogger for process-unaware logging)."
        )
    return PartialState()


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose calls take `main_process_only=True` and `in_order=False`.

    main_process_only: log on the main process only (the default). in_order: log on every process,
    one after another in rank order (each rank waits for the one before; all ranks must call it).
    """

    def process(self, msg, kwargs):
        # Merge rather than replace the caller's `extra` (LoggerAdapter replaces it before 3.13).
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        state = _state()
        kwargs.setdefault("stacklevel", 3)  # point records at the caller, not this module
        kwargs["extra"] = {"process_index": state.process_index, **(kwargs.get("extra") or {})}
        if in_order:
            # Every rank joins every barrier, even if its logger drops this level, or the others hang.
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self._emit(level, msg, args, kwargs)
                state.wait_for_everyone()
            return
        if main_process_only and not state.is_main_process:
            return
        self._emit(level, msg, args, kwargs)

    def _emit(self, level, msg, args, kwargs):
        if self.isEnabledFor(level):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)
            for handler in self.logger.handlers:
                handler.flush()  # the next rank's line must land after this one

    @functools.lru_cache(maxsize=None)  # noqa: B019 - caches the message, once per process
    def warning_once(self, *args, **kwargs):
        """warning(), but each distinct message only the first time."""
        kwargs.setdefault("stacklevel", 4)  # one frame deeper than a plain warning()
        self.log(logging.WARNING, *args, **kwargs)


def get_logger(name: str, log_level: Optional[str] = None) -> MultiProcessAdapter:
    """A process-aware logger for `name`; `log_level` (or $ACCELERATE_LOG_LEVEL) sets its level."""
    if log_level is None:
        log_level = os.environ.get(LOG_LEVEL_ENV)
    logger = logging.getLogger(name)
    if log_level is not None:
        level = log_level.upper() if isinstance(log_level, str) else log_level
        try:
            logger.setLevel(level)
        except (ValueError, TypeError):
            raise ValueError(
                f"Unknown log level {log_level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL (or a number)."
            ) from None
    return MultiProcessAdapter(logger, {})
