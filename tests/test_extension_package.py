"""The wheel carries the prebuilt JupyterLab extension where JupyterLab looks for it, so that
`pip install notebook_accel` is the whole install (no node, no `jupyter labextension install`)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILT = ROOT / "notebook_accel" / "labextension"
SHARE = "notebook_accel-0.1.0.data/data/share/jupyter/labextensions/notebook-accel-labextension"


@pytest.mark.timeout(300)
def test_wheel_ships_the_built_extension(tmp_path):
    assert (BUILT / "package.json").exists(), "the extension is not built: run `make labextension`"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("notebook_accel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"{SHARE}/package.json" in names
    assert any(n.startswith(f"{SHARE}/static/remoteEntry.") for n in names), names
    assert f"{SHARE}/schemas/notebook-accel-labextension/plugin.json" in names
    meta = json.loads(zipfile.ZipFile(wheel).read(f"{SHARE}/package.json"))
    assert meta["name"] == "notebook-accel-labextension" and meta["jupyterlab"]["_build"]["load"].startswith("static/")


def test_jupyter_finds_the_extension_in_the_dev_venv():
    listed = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True)
    line = [ln for ln in (listed.stdout + listed.stderr).splitlines() if "notebook-accel-labextension" in ln]
    assert line and "enabled" in line[0] and "OK" in line[0], (listed.stdout, listed.stderr)
