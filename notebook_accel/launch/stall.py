"""A stall report: where each rank is, and the disagreement in one sentence.

Built by watch.py from what each rank's worker server said (watch_probe.py) and what the monitor
knows (which ranks returned). Pure: tested without processes.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Optional

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.*)$')
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PATHS = sysconfig.get_paths()
_LIBRARY = tuple({os.path.realpath(_PATHS[k]) + os.sep for k in ("stdlib", "purelib", "platlib") if _PATHS.get(k)}) + (
    _PACKAGE,
)
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def mine(self) -> bool:
        """The user's code: neither this package, nor the standard library, nor installed packages."""
        if self.file.startswith("<frozen") or any(part in self.file for part in _INSTALLED):
            return False
        return not os.path.realpath(self.file).startswith(_LIBRARY)

    def where(self, label=None) -> str:
        """`Cell In[5], line 3, in train` for notebook code (with `label`), else `/path/x.py, line 3, in train`."""
        text = f'File "{self.file}", line {self.line}'
        labelled = label(text) if label else text
        if labelled == text:
            labelled = f"{self.file}, line {self.line}"
        return labelled if self.func == "<module>" else f"{labelled}, in {self.func}"

    @property
    def launcher(self) -> bool:
        """Our launch or session machinery: below it, a forked rank's stack is its parent's."""
        return self.file.startswith((_PACKAGE + "launch" + os.sep, _PACKAGE + "session" + os.sep))


@dataclass(frozen=True)
class Thread:
    name: str  # as the dump names it ("Thread 0x...", "Current thread 0x...")
    frames: tuple  # most recent call first


def parse_stacks(text: str) -> tuple:
    """faulthandler's dump (what torch's dump_traceback returns) -> Threads with Python frames."""
    threads, name, frames = [], None, []
    for line in text.splitlines():
        if line.endswith("(most recent call first):"):
            if name is not None and frames:
                threads.append(Thread(name, tuple(frames)))
            name, frames = line[: -len(" (most recent call first):")].strip(), []
            continue
        found = _FRAME.match(line)
        if found and name is not None and not (frames and frames[-1].launcher):
            frames.append(Frame(found["file"], int(found["line"]), found["func"]))
    if name is not None and frames:
        threads.append(Thread(name, tuple(frames)))
    # Drop the launcher's own frame that ended each stack.
    return tuple(Thread(t.name, t.frames[:-1] if t.frames[-1].launcher else t.frames) for t in threads)


@dataclass(frozen=True)
class RankWhere:
    """One rank at the time of the report. `state`: "returned", "waiting" (in a collective),
    "running" (in none), "idle" (a session worker between cells), "failed" (its session cell raised),
    "starting" (not yet in the function), "unknown" (its server did not answer)."""

    rank: int
    state: str
    waiting: tuple = ()  # watch_probe.Collective: the ones it is in
    last: tuple = ()  # the latest collective of each group
    threads: tuple = ()  # Thread, the one with the user's frames first

    def user_frame(self) -> Optional[Frame]:
        for thread in self.threads:
            for frame in thread.frames:
                if frame.mine:
                    return frame
        return None

    def doing(self, label=None) -> str:
        """What the rank does, for the sentence: "waits in all_reduce #12 (float32[4]) at Cell In[5], line 3"."""
        if self.state == "returned":
            return "returned from the function"
        if self.state == "idle":
            return "is idle (no cell running)"
        if self.state == "starting":
            return "is still starting (not yet in the function: importing, or unpickling it)"
        if self.state == "failed":
            return "failed this cell"
        frame = self.user_frame()
        at = f" at {frame.where(label)}" if frame else ""
        if self.state == "waiting":
            return "waits in " + " and ".join(c.describe() for c in self.waiting) + at
        if self.state == "running":
            last = "; its last collective " + ", ".join(c.describe() for c in self.last) if self.last else ""
            return f"is in no collective{at}{last}"
        return "did not answer (no stack or collective could be read)"

    def stack_text(self, label=None) -> str:
        """Each thread's frames, the user's with their source line, the library's counted."""
        out = []
        for thread in self.threads:
            out.append(f"{thread.name}:")
            hidden = 0
            for frame in thread.frames:
                if not frame.mine:
                    hidden += 1
                    continue
                if hidden:
                    out.append(f"    ... {hidden} library frame{'s' if hidden > 1 else ''}")
                    hidden = 0
                out.append(f"  {frame.where(label)}")
                source = linecache.getline(frame.file, frame.line).strip()
                if source:
                    out.append(f"    {source}")
            if hidden:
                out.append(f"    ... {hidden} library frame{'s' if hidden > 1 else ''}")
        return "\n".join(out)


@dataclass(frozen=True)
class StallReport:
    """`seconds` without progress; `stalled` when some rank waits in a collective (else "no progress");
    `sentence` the disagreement; `ranks` each rank's RankWhere."""

    seconds: float
    stalled: bool
    sentence: str
    ranks: tuple

    def text(self, label=None) -> str:
        """The sentence, then each rank: what it does and its stacks (notebook files `Cell In[N]`)."""
        if label is None:
            from .frontend import label_traceback as label
        lines = [self.sentence]
        for r in self.ranks:
            lines += ["", f"rank {r.rank}: {r.doing(label)}"]
            stack = r.stack_text(label)
            if stack:
                lines.append(stack)
        return "\n".join(lines)


def build(seconds: float, ranks: list, label=None, asked: bool = False) -> StallReport:
    """The report for `ranks` (RankWhere, any order), with the sentence on top; `asked`: a snapshot
    taken on demand after `seconds`, which says where the ranks are, not that they stalled."""
    ranks = tuple(sorted(ranks, key=lambda r: r.rank))
    if asked:
        text = "where the ranks are now: " + "; ".join(_grouped(ranks, label))
        return StallReport(seconds, False, text, ranks)
    stalled = any(r.state == "waiting" for r in ranks)
    return StallReport(seconds, stalled, sentence(seconds, ranks, label), ranks)


def sentence(seconds: float, ranks: tuple, label=None) -> str:
    if any(r.state == "failed" for r in ranks):  # a session cell: the others wait for the failed ones
        return (
            f"stalled {seconds:.0f} s after a failure: " + "; ".join(_grouped(ranks, label)) + ". Ranks waiting "
            "for a failed one never return by themselves: interrupt the cell (ranks that do not stop are killed)"
        )
    head = f"no progress for {seconds:.0f} s"
    if not any(r.state == "waiting" for r in ranks):
        parts = _grouped(ranks, label)
        if parts and all(r.state == "starting" for r in ranks):
            return f"{head}: " + parts[0]
        return f"{head}: no rank is in a collective; " + "; ".join(parts) if parts else head
    waits = {(c.group, c.op, c.seq) for r in ranks if r.state == "waiting" for c in r.waiting}
    others = [r for r in ranks if r.state != "waiting"]
    if len(waits) == 1 and not others:
        return f"stalled for {seconds:.0f} s: {_who(ranks)} wait in the same collective, " + (
            ranks[0].waiting[0].describe() + " (a peer outside this launch, or a slow transport?)"
        )
    return f"stalled for {seconds:.0f} s: " + "; ".join(_grouped(ranks, label))


def _grouped(ranks: tuple, label) -> list:
    """ "rank 1 waits in barrier #12; ranks 0, 2 wait in all_reduce #12 ..." (waiting ones first)."""
    by_text: dict = {}
    for r in sorted(ranks, key=lambda r: (r.state not in ("failed", "waiting"), r.state != "failed", r.rank)):
        by_text.setdefault(r.doing(label), []).append(r.rank)
    out = []
    for text, numbers in by_text.items():
        if len(numbers) > 1:  # the verb agrees: "ranks 0, 2 wait in", "ranks 0, 1 are idle"
            text = re.sub(r"^waits ", "wait ", re.sub(r"^is ", "are ", text))
        out.append(f"{_numbers(numbers)} {text}")
    return out


def _who(ranks) -> str:
    return "every rank" if len(ranks) > 1 else f"rank {ranks[0].rank}"


def _numbers(numbers: list) -> str:
    return f"rank {numbers[0]}" if len(numbers) == 1 else "ranks " + ", ".join(str(n) for n in numbers)


def frames_of(text: str) -> tuple:
    """The dump's threads, those with the user's frames first (the main thread, usually)."""
    threads = parse_stacks(text)
    return tuple(sorted(threads, key=lambda t: not any(f.mine for f in t.frames)))


def group_cannot_form(left: list) -> str:
    """Why ranks waiting to join the process group are failed: said as the watch says things."""
    who = f"rank {left[0]}" if len(left) == 1 else "ranks " + ", ".join(map(str, left))
    return (
        f"it waits to join the process group (PartialState() or Accelerator()), but {who} returned from the "
        "function without creating the state, so the group can never form: create the state on every rank, "
        "or on none"
    )

