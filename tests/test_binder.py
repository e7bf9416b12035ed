"""Binder's environment: binder/requirements.txt installs into a fresh venv on this machine, and
every notebook runs top to bottom in a kernel of that venv (the notebooks' own tests check their
results in the dev venv; this checks that Binder's file is enough for them).

The venv is kept in .venv-binder and rebuilt when the requirements or pyproject.toml change."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from notebook_accel.demo import run_notebook

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-binder"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _fingerprint(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def binder_python() -> str:
    """The venv, rebuilt when Binder's files change; the package alone reinstalled when its code does."""
    python = VENV / "bin" / "python"
    env_stamp, code_stamp = VENV / ".requirements", VENV / ".code"
    env_print = _fingerprint(
        [ROOT / "binder" / "requirements.txt", ROOT / "binder" / "runtime.txt", ROOT / "pyproject.toml"]
    )
    code_print = _fingerprint(sorted((ROOT / "notebook_accel").rglob("*.py")))
    if not (python.exists() and env_stamp.exists() and env_stamp.read_text() == env_print):
        shutil.rmtree(VENV, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(VENV)], check=True, timeout=120)
        _pip(python, "-r", str(_reachable_requirements()))
        env_stamp.write_text(env_print)
        code_stamp.write_text(code_print)
    elif not (code_stamp.exists() and code_stamp.read_text() == code_print):
        _pip(python, "--no-deps", "--force-reinstall", ".")  # `.` is installed as a copy
        code_stamp.write_text(code_print)
    return str(python)


def _reachable_requirements() -> Path:
    """binder/requirements.txt without its index lines: this machine reaches PyPI and a local wheel
    store only, where the same torch+cpu wheel lies; every pin stays as Binder reads it."""
    lines = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    kept = [line for line in lines if not line.strip().startswith(("--extra-index-url", "--index-url"))]
    path = VENV / "requirements-here.txt"
    path.write_text("\n".join(kept) + "\n")
    return path


def _pip(python, *args) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, (
        f"pip install {' '.join(args)} failed in the Binder venv:\n{done.stdout}\n{done.stderr}"
    )


@pytest.mark.timeout(1000)
def test_requirements_install_what_the_notebooks_import(binder_python, tmp_path):
    code = "import notebook_accel, torch, ipykernel, ipywidgets, matplotlib, tqdm; print(notebook_accel.__file__)"
    # Away from the checkout, whose notebook_accel/ folder would shadow the installed one.
    out = subprocess.run(
        [binder_python, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    # The package itself, installed from the repository (not this checkout's editable install).
    assert str(VENV) in out.stdout, out.stdout
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    assert runtime == f"python-{sys.version_info.major}.{sys.version_info.minor}", runtime
    # Binder has no GPU: the CPU build of torch, and none of the CUDA build's nvidia wheels.
    requirements = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in requirements
    assert any(line.startswith("torch==") and line.endswith("+cpu") for line in requirements), requirements
    version = subprocess.run([binder_python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert version.stdout.strip().endswith("+cpu"), version
    listed = subprocess.run([binder_python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert not [p for p in listed.stdout.splitlines() if p.lower().startswith("nvidia-")], listed.stdout


@pytest.mark.timeout(400)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_the_binder_env(binder_python, notebook, tmp_path):
    work = tmp_path / notebook.name  # run a copy: a notebook may write files next to itself
    shutil.copy(notebook, work)
    nb, error = run_notebook(str(work), timeout=300, python=binder_python)
    assert error is None, f"{notebook.name} failed in the Binder environment:\n{error}"
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    assert len(ran) == sum(c.cell_type == "code" for c in nb.cells)
