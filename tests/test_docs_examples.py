"""README.md, CONTRIBUTING.md and docs/*.md as a user reads them: every ```python block runs as
written, in order, in one fresh kernel per file, on the CPU with the Hugging Face Hub offline (the
examples use no network); every link stays in the repository; the README stays short.

A ```python block is a notebook cell: it runs in a real IPython kernel, so `%load_ext`,
`%%accelerate` and other magics in it run too. An example that cannot run here (it needs a GPU, a TPU,
several machines or the network) is fenced as ```text, or marked with `<!-- not run: REASON -->` on
the line before its ```python fence. Both are counted per file in SKIPPED below, so a new one is a
visible change to this test. Other fences must name a language this file knows (LANGUAGES); a
```py or ```python3 fence would be neither run nor counted, so it fails.
"""

from __future__ import annotations

import re
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import notebook_header  # noqa: E402

DOCS = [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.exists()] + sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 250
RUN = "python"  # the one fence that runs
LANGUAGES = {RUN, "text", "bash", "yaml"}  # text: output, or an example that is not run
# path -> (```text blocks, ```python blocks marked `<!-- not run: ... -->`)
SKIPPED = {
    "README.md": (1, 0),
    "CONTRIBUTING.md": (0, 0),
    "docs/README.md": (0, 0),
    "docs/big-models.md": (0, 0),
    "docs/checkpoints.md": (0, 0),
    "docs/cells-and-sessions.md": (0, 0),
    "docs/cli-and-config.md": (0, 0),
    "docs/compatibility.md": (0, 0),
    "docs/fsdp.md": (0, 0),
    "docs/launching.md": (1, 1),
    "docs/panels-and-logs.md": (1, 0),
    "docs/ray.md": (1, 1),
    "docs/troubleshooting.md": (3, 0),
}
CELL_TIMEOUT_S = 60
# A kernel's idle prewarm imports, after the cell that imported notebook_accel, what forked ranks would
# otherwise each import again at every launch (torch._dynamo, ~1.7 s). The tests turn the prewarm off
# (conftest.py: it also boots a forkserver), so a file that launches gets that one import first.
LAUNCHES = re.compile(r"notebook_launcher|debug_launcher|%%accelerate|%accelerate start|Session\(")
PREWARM = (
    "from notebook_accel.launch import rank_imports\n"
    "rank_imports.import_all(respect_opt_out=False)  # what the kernel's idle prewarm does (off in the tests)"
)
FORBIDDEN = ("machine kind", "../shared")  # about the machine the project is built on, or outside it

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*not[\s_-]*run\b(?P<rest>.*?)-->\s*$", re.I)
REASON = re.compile(r"^\s*:\s*(?P<reason>\S.*?)\s*$")


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    end: int  # of the closing fence
    language: str
    source: str
    not_run: Optional[str] = None  # the reason, for a marked ```python block


def scan(text: str) -> tuple:
    """(blocks, problems) of a markdown text; a problem is a string naming its line."""
    lines = text.splitlines()
    blocks, problems = [], []
    marker = None  # (line, reason) of a `<!-- not run -->` waiting for its block
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        found = MARKER.match(line)
        if found:
            if marker is not None:
                problems.append(f"line {marker[0]}: a not-run marker with no ```python block after it")
            reason = REASON.match(found["rest"])
            if reason is None:
                problems.append(f"line {number}: write the reason: <!-- not run: REASON -->")
            marker = (number, reason["reason"] if reason else None)
            i += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and marker is not None:
                problems.append(f"line {marker[0]}: a not-run marker with no ```python block after it")
                marker = None
            i += 1
            continue
        info = fence["info"].strip()
        language = info.split()[0] if info else ""
        closing = re.compile(rf"^[ \t]*{re.escape(fence['fence'][0])}{{{len(fence['fence'])},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        if end is None:
            problems.append(f"line {number}: a code block that is never closed")
            break
        if language not in LANGUAGES:
            problems.append(f"line {number}: fence {fence['fence'] + info!r}: write one of {sorted(LANGUAGES)}")
        source = textwrap.dedent("\n".join(lines[i + 1 : end]))
        reason = None
        if marker is not None:
            if language != RUN:
                problems.append(f"line {marker[0]}: a not-run marker before a ```{language} block, not ```python")
            reason = marker[1] or "(no reason)"
            marker = None
        blocks.append(Block(number, end + 1, language, source, reason))
        i = end + 1
    if marker is not None:
        problems.append(f"line {marker[0]}: a not-run marker with no ```python block after it")
    return blocks, problems


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _counts(blocks: list) -> tuple:
    return sum(b.language == "text" for b in blocks), sum(b.not_run is not None for b in blocks)


def _runnable(path: Path) -> list:
    return [b for b in scan(path.read_text())[0] if b.language == RUN and b.not_run is None]


IDS = [_name(p) for p in DOCS]


def test_the_documents_are_there():
    names = set(IDS)
    assert {"README.md", "CONTRIBUTING.md", "docs/compatibility.md"} <= names
    assert names == set(SKIPPED), "add the new page to SKIPPED (or remove the one that went)"


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_fences_are_known_and_every_skipped_example_is_counted(path):
    blocks, problems = scan(path.read_text())
    assert problems == [], f"{_name(path)}:\n" + "\n".join(problems)
    assert _counts(blocks) == SKIPPED[_name(path)], (
        f"{_name(path)}: (```text blocks, not-run blocks) changed: update SKIPPED if that is meant"
    )


def test_the_scanner_can_fail():
    def problems(text):
        return scan(textwrap.dedent(text))[1]

    good = """
        <!-- not run: needs a GPU -->
        ```python
        x = 1
        ```
        """
    assert problems(good) == []
    blocks = scan(textwrap.dedent(good))[0]
    assert [(b.line, b.language, b.source, b.not_run) for b in blocks] == [(3, "python", "x = 1", "needs a GPU")]
    assert "write the reason" in problems(good.replace(": needs a GPU", ""))[0]
    assert "write the reason" in problems(good.replace("needs a GPU", " "))[0]
    assert "write one of" in problems(good.replace("```python", "```py"))[0]
    assert "write one of" in problems(good.replace("```python", "```python3"))[0]
    assert "write one of" in problems("```\nx = 1\n```\n")[0]
    assert "never closed" in problems("```python\nx = 1\n")[0]
    assert "not ```python" in problems(good.replace("```python", "```text"))[0]
    assert "no ```python block after it" in problems("<!-- not run: GPU -->\nsome text\n")[0]
    assert "no ```python block after it" in problems("text\n<!-- not run: GPU -->\n")[0]
    # indented fences (in a list item) are blocks too, dedented; a longer fence holds a shorter one
    nested = "- item:\n\n  ````python\n  ```\n  y = 2\n  ````\n"
    (block,), found = scan(nested)
    assert found == [] and (block.line, block.source) == (3, "```\ny = 2")
    assert _counts(scan("```text\nGPU only\n```\n" + good)[0]) == (1, 1)


def _cell_line(nb, error) -> tuple:
    """(line of the block that failed, its error text)."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                text = "\n".join(output.get("traceback", [])) or f"{output['ename']}: {output['evalue']}"
                return cell.metadata.get("line"), re.sub(r"\x1b\[[0-9;]*m", "", text)
    return None, str(error)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", [p for p in DOCS if _runnable(p)], ids=[_name(p) for p in DOCS if _runnable(p)])
def test_python_examples_run_in_order_in_one_kernel(path, tmp_path, monkeypatch):
    """Each file's ```python blocks as the cells of one notebook, run in a fresh kernel whose working
    folder is a new empty one (files an example writes land there), on the CPU, with the Hugging Face
    Hub offline, and without widgets (launches print `[rank N] line`)."""
    pytest.importorskip("nbclient")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import nbformat

    from notebook_accel.demo import run_notebook

    blocks = _runnable(path)
    cells = [nbformat.v4.new_code_cell(b.source, metadata={"line": b.line}) for b in blocks]
    if any(LAUNCHES.search(b.source) for b in blocks):
        cells.insert(0, nbformat.v4.new_code_cell(PREWARM, metadata={"line": "0 (the prewarm's import)"}))
    notebook = tmp_path / "examples.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), notebook)
    started = time.monotonic()
    nb, error = run_notebook(str(notebook), timeout=CELL_TIMEOUT_S)
    if error is not None:
        line, text = _cell_line(nb, error)
        pytest.fail(f"{_name(path)}: the ```python block at line {line} failed:\n{text}", pytrace=False)
    print(f"{_name(path)}: {len(blocks)} blocks in {time.monotonic() - started:.1f} s")


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_readme_names_the_two_commands_of_a_fresh_clone():
    text = (ROOT / "README.md").read_text()
    commands = [b.source for b in scan(text)[0] if b.language == "bash"]
    for command in ("make demo", "make test"):
        assert any(command in c for c in commands), f"README.md must show `{command}` in a ```bash block"
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # what CI runs is what the README says


def _outside_blocks(text: str) -> str:
    """The text with every code block's lines blanked (line numbers kept)."""
    lines = text.splitlines()
    for block in scan(text)[0]:
        for j in range(block.line - 1, block.end):
            lines[j] = ""
    return "\n".join(lines)


def _prose(text: str) -> str:
    """The text outside code blocks and code spans."""
    return re.sub(r"`[^`\n]*`", "", _outside_blocks(text))


LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)
AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>]*)>|(?<![\w(<])(https?://\S+)")


def _links(text: str) -> list:
    prose = _prose(text)
    rest = LINK.sub(" ", prose)  # what is left may hold bare addresses
    return [a or b for a, b in LINK.findall(prose)] + [a or b for a, b in AUTOLINK.findall(rest)]


def _anchors(text: str) -> set:
    """GitHub's ids for a markdown text's headings: lower case, punctuation dropped, spaces as -."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _outside_blocks(text), re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-") for h in headings}


def link_problems(path: Path, text: Optional[str] = None) -> list:
    """What is wrong with each link of the markdown file at `path` (its text, or `text`)."""
    problems = []
    for target in _links(path.read_text() if text is None else text):
        where, _, anchor = target.partition("#")
        if re.match(r"^[a-z][a-z0-9+.-]*:", where, re.I) or where.startswith("//"):
            problems.append(f"{target}: a link out of the repository")
            continue
        if where.startswith("/"):
            problems.append(f"{target}: write it relative to {_name(path)}")
            continue
        file = (path.parent / where).resolve() if where else path
        if ROOT not in file.parents:
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            problems.append(f"{target}: {_name(file)} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_links_resolve_inside_the_repository(path):
    problems = link_problems(path)
    assert problems == [], f"{_name(path)}: {problems}"


def test_the_link_check_can_fail():
    page = ROOT / "docs" / "page.md"  # never read: each case passes its text
    cases = {
        "[a](https://example.com)": "out of the repository",
        "<https://example.com>": "out of the repository",
        "see https://example.com for more": "out of the repository",
        "[a]: https://example.com": "out of the repository",
        "[a](../../elsewhere.md)": "outside the repository",
        "[a](no-such-page.md)": "no such file",
        "[a](/README.md)": "relative",
        "[a](launching.md#no-such-heading)": "no heading",
    }
    for text, words in cases.items():
        problems = link_problems(page, text)
        assert len(problems) == 1 and words in problems[0], (text, problems)
    assert link_problems(page, "[a](launching.md) and [b](../README.md#install), `[c](http://x)`") == []
    assert link_problems(page, "```bash\npip install git+https://example.com/x\n```\n") == []
    assert _anchors("# The `%%accelerate` cell, on N processes\n```text\n# not a heading\n```\n") == {
        "the-accelerate-cell-on-n-processes"
    }


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_nothing_about_the_build_machine(path):
    text = path.read_text().lower()
    assert [w for w in FORBIDDEN if w in text] == [], _name(path)


def test_the_install_line_is_real():
    """The README installs the package as the notebooks' install cells do, from the repository that
    pyproject.toml names, with an extra that pyproject.toml declares."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    bash = "\n".join(b.source for b in scan(readme)[0] if b.language == "bash")
    assert f'pip install "{notebook_header.PIP_NAMES["notebook_accel"]}"' in bash
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(re.findall(r"notebook_accel\[(\w+)\]", readme)) <= set(extras)
    assert "<repository>" not in readme
