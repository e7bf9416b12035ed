"""Module-level functions the launch panel tests run on ranks (imported by reference in children)."""

from __future__ import annotations

import os
import sys


def print_lines(count: int) -> int:
    """`count` numbered lines on stdout and one on stderr, from each rank."""
    rank = int(os.environ["RANK"])
    for i in range(count):
        print(f"rank {rank} line {i}", flush=True)
    print(f"rank {rank} says <b>hi</b> on stderr", file=sys.stderr, flush=True)
    return rank


def tqdm_loop(steps: int) -> int:
    """A real tqdm bar on stderr, redrawn on every step (off a terminal, as in a launched rank)."""
    from tqdm import tqdm

    for _ in tqdm(range(steps), desc="train", mininterval=0, miniters=1):
        pass
    return steps


def flood(mb: int) -> int:
    """`mb` MB on stdout with no newline (lines.py cuts it into 256 KiB lines)."""
    sys.stdout.write("x" * (mb << 20))
    sys.stdout.flush()
    return 0


class FakeComm:
    """Stands for a JupyterLab page's comm (in comm._comms): keeps each message as the JSON sent."""

    def __init__(self):
        self.messages: list = []

    def send(self, message: dict) -> None:
        import json

        self.messages.append(json.dumps(message))
