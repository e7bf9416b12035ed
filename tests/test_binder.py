"""Binder's environment: binder/requirements.txt resolves, on this machine, to what the notebooks
need: the CPU build of torch (none of the CUDA build's nvidia wheels) and this repository's package
with its notebooks and ray extras.

repo2docker installs that file in its Python 3.11 environment, which has node 20 on PATH, so
`pip install .` there builds the JupyterLab extension (tools/labextension_build.py); a build with and
without node, and the notebooks in a fresh install, are tests/test_fresh_install.py's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "binder" / "requirements.txt"


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.timeout(600)
def test_requirements_resolve_to_what_the_notebooks_import(tmp_path):
    lines = REQUIREMENTS.read_text().splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines  # Binder has no GPU
    assert any(line.startswith("torch==") and line.endswith("+cpu") for line in lines), lines
    assert ".[notebooks,ray]" in lines, lines
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    assert runtime == f"python-{sys.version_info.major}.{sys.version_info.minor}", runtime

    # This machine reaches PyPI and a local wheel store, where the same torch+cpu wheel lies: the
    # index line goes, every pin stays as Binder reads it. `.` is the checkout (pip runs from it).
    here = tmp_path / "requirements-here.txt"
    here.write_text("\n".join(x for x in lines if not x.strip().startswith(("--extra-index-url", "--index-url"))))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", str(report),
         "-r", str(here)],
        cwd=ROOT, capture_output=True, text=True, timeout=540, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    resolved = {_name(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert resolved["torch"].endswith("+cpu"), resolved.get("torch")
    assert not [n for n in resolved if n.startswith("nvidia-")], sorted(resolved)
    for needed in ("notebook-accel", "ipykernel", "ipywidgets", "matplotlib", "tqdm", "ray"):
        assert needed in resolved, (needed, sorted(resolved))
