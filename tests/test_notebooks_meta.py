"""Every notebook as committed: no outputs, the open-in badges for its own path, the install cell,
and a line in the README."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import notebook_header  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {
    "quickstart", "cell_magic", "hardware_and_logs", "mixed_precision_and_accumulation", "checkpoint_and_resume",
    "big_model_offload", "multi_node_on_one_machine",
}  # fmt: skip


def test_every_notebook_the_issue_names_is_there():
    assert {p.stem for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs_with_badges_and_install_cell(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code), "strip the outputs"
    sources = ["".join(c["source"]) for c in nb["cells"]]
    assert notebook_header.badges(path.name) in sources, "run tools/notebook_header.py on it"
    assert sources[0].startswith("# "), "a title comes first"
    install = "".join(code[0]["source"])
    assert install.startswith(notebook_header.INSTALL_MARK) and "%pip install" in install


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_readme_links_the_notebook(path):
    readme = (ROOT / "README.md").read_text()
    assert f"(notebooks/{path.name})" in readme
