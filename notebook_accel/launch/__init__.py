"""Launch a function on N processes: plan -> starter -> child -> channel -> events -> sinks.

Names load lazily, so a front end can register with `launch.frontend` without importing torch.
"""

from __future__ import annotations

from ..utils.lazy import lazy_exports

_EXPORTS = {
    "LaunchControl": "control",
    "LaunchConfigError": "errors",
    "LaunchFailedError": "errors",
    "LaunchStoppedError": "errors",
    "LaunchTimeoutError": "errors",
    "NodesMissingError": "errors",
    "UnpicklableError": "errors",
    "LaunchFinished": "events",
    "LaunchNotice": "events",
    "LaunchStarted": "events",
    "RankFailed": "events",
    "RankFinished": "events",
    "RankOutput": "events",
    "RankStarted": "events",
    "RankStopped": "events",
    "debug_launcher": "launcher",
    "notebook_launcher": "launcher",
    "LaunchPlan": "plan",
    "make_plan": "plan",
    "ConsoleSink": "sinks",
    "ListSink": "sinks",
    "Sink": "sinks",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(globals(), _EXPORTS)


def __dir__():
    return __all__
