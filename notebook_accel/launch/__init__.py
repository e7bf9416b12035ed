"""Launch a function on N processes: plan -> start -> worker -> events -> sinks."""

from .control import LaunchControl
from .errors import (
    LaunchConfigError,
    LaunchFailedError,
    LaunchStoppedError,
    LaunchTimeoutError,
    NodesMissingError,
    UnpicklableError,
)
from .events import (
    LaunchFinished,
    LaunchNotice,
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
    "ConsoleSink", "LaunchConfigError", "LaunchControl", "LaunchStoppedError", "LaunchTimeoutError", "LaunchFailedError", "LaunchFinished", "LaunchNotice", "LaunchPlan",
    "LaunchStarted", "ListSink", "NodesMissingError", "RankFailed", "RankFinished", "RankOutput", "RankStarted", "RankStopped", "Sink",
    "UnpicklableError", "debug_launcher", "make_plan", "notebook_launcher",
]  # fmt: skip
