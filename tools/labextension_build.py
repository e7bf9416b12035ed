"""The JupyterLab extension's build, called by hatch-jupyter-builder's hook in every sdist and wheel
build (pyproject.toml, `[tool.hatch.build.hooks.jupyter-builder]`).

- Built and newer than its sources (an sdist, or a checkout after `make labextension`): nothing to do,
  so installing an sdist needs no node.
- Else, with node and npm on PATH: `npm ci` (the lock file as committed) + `npm run build` in extension/ (what
  `pip install .` or `pip install git+...` does on Colab, Kaggle and Binder, which have node).
- Else: the package builds without the extension, and says so once; the magics and widgets work
  without it.

Editable installs build nothing: `make labextension-dev` builds the extension and links it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "extension"
BUILT = ROOT / "notebook_accel" / "labextension"
INPUTS = ("src", "style", "schema", "package.json", "package-lock.json", "tsconfig.json")
SKIPPED = (
    "notebook_accel: node and npm are not on PATH, so this build has no JupyterLab extension "
    "(the magics and widgets work without it). Install node >= 18 and npm, then install again to get it."
)


def build(target_name: str, version: str, **_kwargs) -> None:
    if version == "editable" or is_current():
        return
    if shutil.which("node") is None or shutil.which("npm") is None:
        print(SKIPPED, file=sys.stderr, flush=True)
        return
    if not (SOURCE / "node_modules").is_dir():
        _npm("ci", "--no-audit", "--no-fund", "--loglevel=error")
    _npm("run", "build")


def _npm(*args: str) -> None:
    print(f"notebook_accel: npm {' '.join(args)} in {SOURCE}", file=sys.stderr, flush=True)
    subprocess.run(["npm", *args], cwd=SOURCE, check=True)


def is_current() -> bool:
    """The built extension exists and no source file is newer than it."""
    marker = BUILT / "package.json"
    if not marker.is_file():
        return False
    built_at = marker.stat().st_mtime
    for name in INPUTS:
        path = SOURCE / name
        files = path.rglob("*") if path.is_dir() else [path]
        if any(f.is_file() and f.stat().st_mtime > built_at for f in files):
            return False
    return True
