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
    "big_model_offload", "multi_node_on_one_machine", "fsdp",
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_install_cell_asks_pip_for_valid_requirements(path):
    """Colab and Kaggle run the %pip line; here it is skipped (the package is installed), so at least
    every requirement on it must parse and the package must come from the project's repository."""
    import shlex

    from packaging.requirements import Requirement

    code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    line = next(x for x in "".join(code[0]["source"]).splitlines() if "%pip install" in x)
    words = [w for w in shlex.split(line.split("%pip install", 1)[1]) if not w.startswith("-")]
    requirements = [Requirement(w) for w in words]
    assert requirements[0].name == "notebook_accel", words
    assert requirements[0].url == f"git+https://github.com/{notebook_header.REPO}", words
    for extra in requirements[1:]:  # what the notebook needs beyond the package (plots)
        assert extra.url is None and extra.name.replace("-", "_").isidentifier(), words
