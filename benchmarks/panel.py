"""What a chatty launch costs the launch panel: lines/s handle() takes, and widget updates sent.

A fake front end counts every value the panel's widgets send (one comm message each in a kernel).
The baseline is the console sink writing the same lines to an in-memory stream.

    python benchmarks/panel.py [--lines 200000] [--ranks 4]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from contextlib import redirect_stdout

from notebook_accel.jupyter.panel import LaunchPanel
from notebook_accel.launch import events as ev
from notebook_accel.launch.sinks import ConsoleSink


def feed(sink, lines: int, ranks: int) -> float:
    sink.handle(ev.LaunchStarted(ranks, "fork", ranks))
    for r in range(ranks):
        sink.handle(ev.RankStarted(r, 1000 + r))
    started = time.perf_counter()
    for i in range(lines):
        sink.handle(ev.RankOutput(i % ranks, "stdout", f"step {i} loss {1.0 / (i + 1):.6f}"))
    seconds = time.perf_counter() - started
    for r in range(ranks):
        sink.handle(ev.RankFinished(r, seconds))
    sink.handle(ev.LaunchFinished(True, seconds))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()

    panel = LaunchPanel(show=False, fps=10.0)
    updates = {"n": 0}
    for view in [*panel.views.values(), panel.status_table, panel.header]:
        view.observe(lambda change: updates.__setitem__("n", updates["n"] + 1), names="value")
    started = time.perf_counter()
    seconds = feed(panel, args.lines, args.ranks)
    panel.close()
    wall = time.perf_counter() - started

    with redirect_stdout(io.StringIO()):
        console_seconds = feed(ConsoleSink(), args.lines, args.ranks)

    print(f"{args.lines} lines from {args.ranks} ranks")
    print("| sink | lines/s into handle() | widget value updates sent | updates per second of feeding |")
    print("|---|---|---|---|")
    print(f"| launch panel (fps=10) | {args.lines / seconds:,.0f} | {updates['n']} | {updates['n'] / wall:.1f} |")
    print(f"| console sink (baseline, to memory) | {args.lines / console_seconds:,.0f} | - | - |")
    print(f"panel kept {len(panel.text('all').splitlines())} lines of the all-ranks view", file=sys.stderr)


if __name__ == "__main__":
    main()
