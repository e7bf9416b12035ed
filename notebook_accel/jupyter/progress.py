"""Recognising a tqdm progress bar in a line of a rank's output."""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

_NUM = r"\d+(?:\.\d+)?(?:\s?[kMGTPEZY])?"
_DESC = r"^(?:(?P<desc>.*?):)?\s*"
_TIMES = r"\[(?P<rest>\d+:\d\d[^\]]*)\]\s*$"  # tqdm's "[elapsed<remaining, rate, postfix]"
_KNOWN = re.compile(
    _DESC + rf"(?:(?P<pct>\d{{1,3}})%\|[^|]*\|)?\s*(?P<n>{_NUM})/(?P<total>{_NUM})\s*" + _TIMES
)
_UNKNOWN = re.compile(_DESC + rf"(?P<n>{_NUM})(?P<unit>[^\s\[\]\d]*)\s+" + _TIMES)
_SCALE = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}


class Bar(NamedTuple):
    desc: str
    fraction: Optional[float]  # None when tqdm does not know the total
    label: str  # "desc: n/total [elapsed<remaining, rate]"


def _number(text: str) -> Optional[float]:
    text = text.replace(" ", "")
    scale = _SCALE.get(text[-1:], 1.0)
    try:
        return float(text.rstrip("".join(_SCALE))) * scale
    except ValueError:
        return None


def parse_bar(text: str) -> Optional[Bar]:
    """The tqdm bar `text` shows, or None when it is not one."""
    text = ANSI.sub("", text).strip()
    m = _KNOWN.match(text)
    if m:
        n, total = _number(m["n"]), _number(m["total"])
        if n is not None and total:
            fraction = min(n / total, 1.0)
        else:
            fraction = int(m["pct"]) / 100 if m["pct"] else None
        count = f"{m['n']}/{m['total']}"
    else:
        m = _UNKNOWN.match(text)
        if not m:
            return None
        fraction, count = None, f"{m['n']}{m['unit']}"
    desc = (m["desc"] or "").strip()
    label = f"{desc}: {count} [{m['rest']}]" if desc else f"{count} [{m['rest']}]"
    return Bar(desc, fraction, label)
