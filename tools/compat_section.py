"""README's "Compatibility with accelerate" section, written from the measured public surface.

    python tools/compat_section.py          # rewrite the section between the markers in README.md
    python tools/compat_section.py --check  # exit 1 when README's section is out of date

The names come from accelerate 1.15.0's wheel (tests/conformance/surface.py), what is provided is
what resolves in notebook_accel, and what is not is tests/conformance/not_provided.py, grouped by
reason. tests/test_public_surface.py fails when the section is stale.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conformance import not_provided, surface  # noqa: E402

START = "<!-- compat:start (written by tools/compat_section.py; do not edit by hand) -->"
END = "<!-- compat:end -->"


def _where(namespace: str) -> str:
    return f"`accelerate.{namespace}`" if namespace else "`accelerate`"


def section() -> str:
    """The section's text, markers included."""
    names = surface.public_names()
    provided = {n for n in names if surface.resolve(n)}
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


def current(readme: str) -> str:
    """The section as README has it now (markers included); ValueError when the markers are missing."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no section between {START!r} and {END!r}")
    return readme[start : end + len(END)]


def main(argv: list) -> int:
    path = ROOT / "README.md"
    readme = path.read_text()
    fresh = section()
    if "--check" in argv:
        if current(readme) != fresh:
            print("README.md's compatibility section is out of date: run python tools/compat_section.py")
            return 1
        return 0
    path.write_text(readme.replace(current(readme), fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
