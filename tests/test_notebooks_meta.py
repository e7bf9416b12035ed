"""Every notebook as committed: no outputs, the open-in badges for its own path, the install cell,
and a line in the README (its list of notebooks)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import notebook_header  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {
    "quickstart", "cell_magic", "hardware_and_logs", "mixed_precision_and_accumulation", "checkpoint_and_resume",
    "big_model_offload", "multi_node_on_one_machine", "fsdp", "ray_cluster",
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


def _install_cell(path) -> str:
    code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return "".join(code[0]["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_install_cell_checks_every_module_the_notebook_imports(path):
    """A notebook opened after a plain `pip install notebook_accel` (no matplotlib) or on Colab must
    not meet ModuleNotFoundError in a later cell: the install cell lists every import the notebook
    makes (tests/test_fresh_install.py runs these cells in a venv that lacks them)."""
    modules = notebook_header.needs(path)
    assert modules[0] == "notebook_accel", modules
    assert _install_cell(path) == notebook_header.install_cell(modules), "run tools/notebook_header.py on it"


def test_needs_finds_imports_anywhere_but_not_the_standard_library_or_written_files(tmp_path):
    nb = {"cells": [
        {"cell_type": "code", "source": ["import os, torch\n", "from tqdm.auto import tqdm\n"]},
        {"cell_type": "code", "source": ["%%accelerate -n 2\n", "    import matplotlib.pyplot as plt\n"]},
        {"cell_type": "code", "source": ["Path('helper.py').write_text('import psutil')\n", "import helper\n"]},
        {"cell_type": "markdown", "source": ["import yaml\n"]},
        {"cell_type": "code", "source": ["import notebook_accel\n"]},
    ]}  # fmt: skip
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    assert notebook_header.needs(path) == ["notebook_accel", "matplotlib", "torch", "tqdm"]
    nb["cells"].append({"cell_type": "code", "source": ["import sklearn\n"]})
    path.write_text(json.dumps(nb))
    with pytest.raises(SystemExit, match=r"x.ipynb imports \['sklearn'\]: add what pip installs"):
        notebook_header.needs(path)


def test_what_the_install_cells_ask_pip_for_is_valid_and_declared():
    """Each module maps to a valid requirement; beyond the package, each is a dependency of the package
    or in its `notebooks` extra, so `pip install "notebook_accel[notebooks]"` covers every notebook but
    ray_cluster, whose Ray is the `ray` extra's, as it installs it."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = {Requirement(r).name.lower() for r in project["dependencies"] + extras["notebooks"]}
    declared.add("ray")
    ray_extra = {(Requirement(r).name, frozenset(Requirement(r).extras)) for r in extras["ray"]}
    assert (Requirement(notebook_header.PIP_NAMES["ray"]).name, frozenset({"default"})) in ray_extra
    used = {m for path in NOTEBOOKS for m in notebook_header.needs(path)}
    package = Requirement(notebook_header.PIP_NAMES["notebook_accel"])
    assert (package.name, package.extras) == ("notebook_accel", {"notebooks"})
    assert package.url == f"git+https://github.com/{notebook_header.REPO}"
    for module in used - {"notebook_accel"}:
        requirement = Requirement(notebook_header.PIP_NAMES[module])
        assert requirement.url is None and (requirement.name.lower() in declared or module == "IPython"), module
    assert {"matplotlib", "tqdm"} <= used  # what a plain install lacks, so the extra is not empty for nothing


@pytest.mark.timeout(60)  # git ls-files
def test_the_repository_is_named_in_one_place():
    """pyproject.toml's Repository URL is the only source: every GitHub link in the notebooks is
    generated from it, the README's install line is checked against it, and no other tracked file
    spells the repository out."""
    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert url == f"https://github.com/{notebook_header.REPO}"
    for path in NOTEBOOKS:
        linked = set(re.findall(r"github(?:\.com)?/([\w.-]+/[\w.-]+?)(?:/blob|/main|\b\\?\")", path.read_text()))
        assert linked == {notebook_header.REPO}, (path.name, linked)
    # The README installs from it (the notebooks' own requirement, tests/test_docs_examples.py) and names no other.
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?(?=[\s\"'/)#]|$)", readme))
    assert named == {notebook_header.REPO}, f"README.md names {named}: install from pyproject.toml's Repository"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    spelled = [name for name in tracked.split() if not name.startswith(("notebooks/", "extension/package-lock"))
               and name not in ("pyproject.toml", "README.md") and (ROOT / name).is_file()
               and notebook_header.REPO in (ROOT / name).read_text(errors="replace")]  # fmt: skip
    assert spelled == [], f"the repository is spelled out in {spelled}: read it from pyproject.toml"
