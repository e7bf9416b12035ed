"""A real install, anywhere: what `pip install` gives a newcomer, built and installed here.

From a fresh clone's files (what git tracks, so no node_modules and no built extension):
- `pip wheel` of the clone, as `pip install .` or `pip install git+...` on Colab, Kaggle and Binder:
  npm builds the extension and the wheel carries it;
- the clone's sdist carries the built extension, and a wheel built from it with no node on PATH too;
- a clone built with no node on PATH gives a wheel without the extension, and says so once.

The wheel goes into a fresh venv with nothing else but the pinned CPU torch (an unpinned one is a
multi-GB CUDA build). There, each notebook's install cell adds what the plain install lacks, and the
notebooks run in a kernel of that venv. fsdp runs its install cell and imports only: in full it is
the slowest notebook by far, and tests/test_notebook_fsdp.py runs it in the dev venv; so does
ray_cluster (its install cell adds Ray here), whose cluster runs in the ray tier alone (tests/test_ray_engine.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from notebook_accel.demo import cell_texts, run_notebook

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import labextension_build  # noqa: E402
import notebook_header  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FULL_RUNS = [p for p in NOTEBOOKS if p.stem not in ("fsdp", "ray_cluster")]
SHARE = "share/jupyter/labextensions/notebook-accel-labextension"
EXTRAS = ("matplotlib", "tqdm")  # the notebooks extra: what a plain install lacks
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
NO_NODE_PATH = os.path.dirname(sys.executable)  # this venv's scripts: python and pip, no node or npm


def _clone(dest: Path) -> Path:
    """The files a clone of this working tree would hold: tracked ones, and new ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _env(path: str | None = None) -> dict:
    """Without PYTHONPATH, which would put this checkout's notebook_accel before the installed one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        env["PATH"] = path
    return env


def _run(args, timeout=600, path=None, cwd=None) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=_env(path),
                          cwd=cwd)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{output[-6000:]}"
    return output


def _wheel_names(folder: Path) -> list:
    (wheel,) = folder.glob("notebook_accel-*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A fresh clone, its wheel (pip wheel, with node), and a fresh venv with that wheel installed."""
    work = tmp_path_factory.mktemp("fresh")
    clone = _clone(work / "clone")
    assert not (clone / "notebook_accel" / "labextension").exists() and not (clone / "extension" / "node_modules").exists()
    log = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", work / "dist", clone], timeout=900)
    (wheel,) = (work / "dist").glob("notebook_accel-*.whl")
    venv = work / "venv"
    _run([BASE_PYTHON, "-m", "venv", venv], timeout=120)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "torch==2.13.0", wheel], timeout=900)
    return SimpleNamespace(work=work, clone=clone, wheel=wheel, log=log, venv=venv, python=python)


@pytest.mark.timeout(1200)  # the module's set-up: npm ci and the extension's build, then the venv
def test_a_wheel_built_from_a_fresh_clone_carries_the_extension(fresh):
    assert "notebook_accel: npm run build" in fresh.log, fresh.log[-3000:]
    names = _wheel_names(fresh.wheel.parent)
    data = f"notebook_accel-0.1.0.data/data/{SHARE}"
    assert f"{data}/package.json" in names and any(n.startswith(f"{data}/static/remoteEntry.") for n in names)
    assert not [n for n in names if n.startswith("notebook_accel/labextension/")]  # only where JupyterLab looks
    # Installed, it lies where JupyterLab looks in that venv (tests/test_extension_package.py has
    # `jupyter labextension list` report such an install enabled).
    assert (fresh.venv / SHARE / "package.json").is_file()


@pytest.mark.timeout(1200)
def test_the_sdist_carries_the_built_extension_so_installing_it_needs_no_node(fresh):
    builder = fresh.work / "builder"
    _run([BASE_PYTHON, "-m", "venv", builder], timeout=120)
    _run([builder / "bin" / "python", "-m", "pip", "install", "-q", "build"], timeout=300)
    _run([builder / "bin" / "python", "-m", "build", "--sdist", "-o", fresh.work / "sdist", fresh.clone], timeout=600)
    (sdist,) = (fresh.work / "sdist").glob("notebook_accel-*.tar.gz")
    names = tarfile.open(sdist).getnames()
    top = "notebook_accel-0.1.0"
    assert f"{top}/notebook_accel/labextension/package.json" in names, names
    assert f"{top}/tools/labextension_build.py" in names and f"{top}/extension/src/index.ts" in names
    assert not [n for n in names if "/node_modules/" in n or n.startswith(f"{top}/extension/lib/")]

    assert shutil.which("node", path=NO_NODE_PATH) is None and shutil.which("npm", path=NO_NODE_PATH) is None
    log = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", fresh.work / "from-sdist", sdist],
               path=NO_NODE_PATH)  # fmt: skip
    assert labextension_build.SKIPPED not in log and "notebook_accel: npm" not in log, log[-3000:]
    assert f"notebook_accel-0.1.0.data/data/{SHARE}/package.json" in _wheel_names(fresh.work / "from-sdist")


@pytest.mark.timeout(600)
def test_without_node_the_wheel_goes_without_the_extension_and_says_so_once(tmp_path):
    clone = _clone(tmp_path / "clone")
    log = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", tmp_path / "dist", clone],
               path=NO_NODE_PATH)  # fmt: skip
    assert log.count(labextension_build.SKIPPED) == 1, log[-3000:]
    names = _wheel_names(tmp_path / "dist")
    assert "notebook_accel/__init__.py" in names and not [n for n in names if "labextensions" in n]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_install_cell_adds_what_a_plain_install_lacks(fresh, notebook, tmp_path, monkeypatch):
    """The notebook's own install cell, then an import of every module it needs, in a kernel of the
    fresh venv from which the notebooks extra was removed first (an earlier notebook installed it)."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    _run([fresh.python, "-m", "pip", "uninstall", "-y", "-q", *EXTRAS])
    lacking = _run([fresh.python, "-c", f"import importlib.util as u; print([m for m in {EXTRAS} if u.find_spec(m)])"])
    assert lacking.strip() == "[]", lacking
    needs = notebook_header.needs(notebook)
    cells = [
        [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"][0].source,
        "\n".join(f"import {m}" for m in needs) + "\nprint('FROM', notebook_accel.__file__)",
    ]
    path = tmp_path / notebook.name
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    nb, error = run_notebook(str(path), timeout=600, python=str(fresh.python))
    assert error is None, f"{notebook.name}'s install cell left an import failing:\n{error}"
    assert f"FROM {fresh.venv}/" in "".join(cell_texts(nb.cells[1])), nb.cells[1].outputs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("notebook", FULL_RUNS, ids=[p.stem for p in FULL_RUNS])
def test_the_notebook_runs_in_the_fresh_install(fresh, notebook, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    work = tmp_path / notebook.name  # a copy: a notebook may write files next to itself
    shutil.copy(notebook, work)
    nb, error = run_notebook(str(work), timeout=300, python=str(fresh.python))
    assert error is None, f"{notebook.name} failed in a fresh install of the wheel:\n{error}"
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    assert len(ran) == sum(c.cell_type == "code" for c in nb.cells)
