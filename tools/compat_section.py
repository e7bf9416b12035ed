"""The public-surface section of docs/compatibility.md and README's one-line headline, written from
the measured public surface.

    python tools/compat_section.py          # rewrite both, between their markers
    python tools/compat_section.py --check  # exit 1 when either is out of date

The names come from accelerate 1.15.0's wheel (tests/conformance/surface.py), what is provided is
what resolves in notebook_accel, and what is not is tests/conformance/not_provided.py, grouped by
reason. tests/test_public_surface.py fails when either text is stale.
"""

from __future__ import annotations

import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conformance import not_provided, surface  # noqa: E402

PAGE = ROOT / "docs" / "compatibility.md"  # the section
README = ROOT / "README.md"  # the headline
START = "<!-- compat:start (written by tools/compat_section.py; do not edit by hand) -->"
END = "<!-- compat:end -->"
HEADLINE_START = "<!-- compat:headline (written by tools/compat_section.py) -->"
HEADLINE_END = "<!-- compat:headline end -->"


def _where(namespace: str) -> str:
    return f"`accelerate.{namespace}`" if namespace else "`accelerate`"


@lru_cache(maxsize=1)
def measured() -> tuple:
    """(accelerate's public names, those notebook_accel provides at the same path)."""
    names = frozenset(surface.public_names())
    return names, frozenset(n for n in names if surface.resolve(n))


def headline() -> str:
    """README's one line, markers included."""
    names, provided = measured()
    return (
        f"{HEADLINE_START}notebook_accel provides **{len(provided)} of {len(names)}** of accelerate "
        f"{surface.wheel.VERSION}'s public names at the same path.{HEADLINE_END}"
    )


def section() -> str:
    """The section's text, markers included."""
    names, provided = measured()
    total, have = Counter(), Counter()
    for name in names:
        namespace = surface.module_of(name)
        total[namespace] += 1
        have[namespace] += name in provided
    listed = set(not_provided.NOT_PROVIDED)
    unaccounted = sorted(names - provided - listed)

    lines = [
        START,
        "",
        f"Measured against accelerate {surface.wheel.VERSION}'s public names, read from its wheel: what its",
        "package and `accelerate.utils` import from its own modules, the public functions, classes and",
        "constants of its main modules, and the public methods and properties of `Accelerator` and the three",
        f"state classes. notebook_accel provides **{len(provided)} of {len(names)}** at the same path",
        "(`tests/test_public_surface.py` checks each one).",
        "",
        "| namespace | provided |",
        "|---|---|",
    ]
    for namespace in sorted(total):
        lines.append(f"| {_where(namespace)} | {have[namespace]} / {total[namespace]} |")
    lines += ["", f"Not provided: {len(listed)} names, by reason (`tests/conformance/not_provided.py`):", ""]
    for reason, group in not_provided.GROUPS.values():
        lines.append(f"- {reason}: {len(group)}")
    lines += ["", "<details><summary>The names, by reason</summary>", ""]
    for reason, group in not_provided.GROUPS.values():
        lines.append(f"- {reason}: " + ", ".join(f"`{n}`" for n in sorted(group)))
    lines += ["", "</details>"]
    if unaccounted:
        lines += ["", f"Missing and not on that list ({len(unaccounted)}): " + ", ".join(f"`{n}`" for n in unaccounted)]
    lines += ["", END]
    return "\n".join(lines)


def _between(text: str, start_mark: str, end_mark: str, where: str) -> str:
    start = text.find(start_mark)
    end = text.find(end_mark, start + 1)
    if start < 0 or end < 0:
        raise ValueError(f"{where} has no text between {start_mark!r} and {end_mark!r}")
    return text[start : end + len(end_mark)]


def current(page: str) -> str:
    """The section as docs/compatibility.md has it now (markers included); ValueError when the
    markers are missing."""
    return _between(page, START, END, "docs/compatibility.md")


def current_headline(readme: str) -> str:
    """The headline as README.md has it now (markers included); ValueError when they are missing."""
    return _between(readme, HEADLINE_START, HEADLINE_END, "README.md")


def main(argv: list) -> int:
    targets = [(PAGE, current, section()), (README, current_headline, headline())]
    stale = []
    for path, find, fresh in targets:
        text = path.read_text()
        if find(text) == fresh:
            continue
        stale.append(path.relative_to(ROOT).as_posix())
        if "--check" not in argv:
            path.write_text(text.replace(find(text), fresh))
    if stale and "--check" in argv:
        print(f"{' and '.join(stale)}: the compatibility figures are out of date: run python tools/compat_section.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
