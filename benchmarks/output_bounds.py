"""Output with no newline: what a launch panel and the extension's comm sink carry and hold.

Each rank writes `--mb` MB to stdout without a newline (lines.py cuts such a stream into 256 KiB
lines). The panel (autoflush off) is drawn every 0.1 s from a thread, as its flusher would; every
widget value it sets is counted (one comm message each in a kernel). The comm sink sends to a fake
comm that counts the JSON bytes of every message; the console sink (what a kernel with widgets off
sends as stream messages) writes to a stream that counts characters. "held" is the text the two models keep at the end.

    python benchmarks/output_bounds.py [--ranks 4] [--mb 50]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import sys
import threading
import time

from notebook_accel import notebook_launcher
from notebook_accel.jupyter import comm
from notebook_accel.jupyter.panel import LaunchPanel
from notebook_accel.launch.sinks import ConsoleSink

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from panel_targets import FakeComm, flood  # noqa: E402  (the test's rank function and fake comm)


class Counting(io.TextIOBase):
    def __init__(self):
        self.chars = 0

    def write(self, text: str) -> int:
        self.chars += len(text)
        return len(text)


def held(model) -> int:
    with model.lock:
        texts = [t for _, _, t in model.all.items]
        for r in model.ranks.values():
            texts += [t for _, t in r.log.items] + list(r.current.values())
    return sum(len(t) for t in texts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=int, default=50)
    args = parser.parse_args()

    fake = FakeComm()
    comm._comms["bench"] = fake
    panel = LaunchPanel(autoflush=False, show=False)
    sent = {"values": 0, "bytes": 0}

    def count(change) -> None:
        sent["values"] += 1
        sent["bytes"] += len(change["new"])

    for view in [panel.status_table, panel.header, panel.traceback]:
        view.observe(count, names="value")
    stop = threading.Event()

    def draw() -> None:
        observed: set = set()
        while not stop.wait(0.1):
            panel.flush()
            for view in panel.views.values():
                if id(view) not in observed:
                    observed.add(id(view))
                    view.observe(count, names="value")

    drawer = threading.Thread(target=draw, daemon=True)
    drawer.start()
    sink = comm.CommSink()
    started = time.perf_counter()
    console = Counting()
    with contextlib.redirect_stdout(console):
        notebook_launcher(
            flood,
            args=(args.mb,),
            num_processes=args.ranks,
            use_port="auto",
            cpu=True,
            sinks=[panel, sink, ConsoleSink()],
        )
    stop.set()
    drawer.join()
    panel.flush()
    wall = time.perf_counter() - started
    views = sum(len(v.value) for v in panel.views.values())
    print(f"{args.ranks} ranks x {args.mb} MB without a newline, {wall:.1f} s")
    print("| | panel | comm sink |")
    print("|---|---|---|")
    print(
        f"| bytes sent to the front end | {sent['bytes']:,} ({sent['values']} values) | {sum(map(len, fake.messages)):,} "
        f"({len(fake.messages)} messages) |"
    )
    print(f"| text held by the model at the end | {held(panel.model):,} | {held(sink.model):,} |")
    print(f"| size of the views' HTML at the end | {views:,} | - |")
    print(f"console sink wrote {console.chars:,} characters")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak RSS of this process: {peak / 1024:,.0f} MiB")


if __name__ == "__main__":
    main()
