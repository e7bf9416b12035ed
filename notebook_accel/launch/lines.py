"""Split a rank's output bytes into lines. '\n' ends a line; a bare '\r' ends a transient one
(a progress bar redrawing itself), which the next line from the same stream replaces."""

from __future__ import annotations

import re

MAX_LINE = 1 << 18  # a stream that never ends a line is cut here rather than held in memory
_ENDS = re.compile(rb"\r\n|\n|\r")


class LineSplitter:
    def __init__(self):
        self.rest = b""

    def feed(self, data: bytes) -> list:
        """Complete segments in `data` as (text, transient) pairs; empty transient ones are dropped."""
        buf = self.rest + data
        if b"\r" not in buf:  # the common case, kept cheap
            *lines, self.rest = buf.split(b"\n")
            out = [(_text(line), False) for line in lines]
        else:
            out, start = [], 0
            for m in _ENDS.finditer(buf):
                if m.group() == b"\r" and m.end() == len(buf):
                    break  # may be the first half of '\r\n': wait for the next bytes
                line = buf[start : m.start()]
                transient = m.group() == b"\r"
                if line or not transient:
                    out.append((_text(line), transient))
                start = m.end()
            self.rest = buf[start:]
            peek = self.rest.rstrip(b"\r")
            if peek and b"\n" not in self.rest:
                # A redraw not yet ended (tqdm writes '\r' then the bar): show it now, as transient.
                out.append((_text(peek), True))
        if len(self.rest) > MAX_LINE:
            out.append((_text(self.rest), False))
            self.rest = b""
        return out

    def finish(self) -> list:
        """What is left when the stream closes, as a final line."""
        rest, self.rest = self.rest.rstrip(b"\r"), b""
        return [(_text(rest), False)] if rest else []


def cut(text: str, limit: int) -> str:
    """`text` shown in at most about `limit` characters: its start, then a note of what was cut."""
    if len(text) <= limit:
        return text
    rest = len(text[limit:].encode("utf-8", errors="replace"))
    return f"{text[:limit]} … {rest:,} bytes cut"


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")
