"""Launch a function on N processes: plan -> start -> worker -> events -> sinks."""

from .errors import LaunchConfigError, LaunchFailedError, UnpicklableError
from .events import (
    LaunchFinished,
    LaunchStarted,
    RankFailed,
    RankFinished,
    RankOutput,
    RankStarted,
    RankStopped,
)
from .launcher import debug_launcher, notebook_launcher
from .plan import LaunchPlan, make_plan
from .sinks import ConsoleSink, ListSink, Sink

__all__ = [
    "ConsoleSink", "LaunchConfigError", "LaunchFailedError", "LaunchFinished", "LaunchPlan", "LaunchStarted",
    "ListSink", "RankFailed", "RankFinished", "RankOutput", "RankStarted", "RankStopped", "Sink",
    "UnpicklableError", "debug_launcher", "make_plan", "notebook_launcher",
]  # fmt: skip
