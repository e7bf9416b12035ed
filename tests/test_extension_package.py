"""The wheel carries the prebuilt JupyterLab extension where JupyterLab looks for it, so that
`pip install notebook_accel` is the whole install (no node, no `jupyter labextension install`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILT = ROOT / "notebook_accel" / "labextension"
NAME = "notebook-accel-labextension"
SHARE = "notebook_accel-0.1.0.data/data/share/jupyter/labextensions/notebook-accel-labextension"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from this checkout, once for the module's tests."""
    assert (BUILT / "package.json").exists(), "the extension is not built: run `make labextension`"
    folder = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), str(ROOT)],
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (built,) = folder.glob("notebook_accel-*.whl")
    return built


@pytest.mark.timeout(300)
def test_wheel_ships_the_built_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert f"{SHARE}/package.json" in names
    assert any(n.startswith(f"{SHARE}/static/remoteEntry.") for n in names), names
    assert f"{SHARE}/schemas/notebook-accel-labextension/plugin.json" in names
    meta = json.loads(zipfile.ZipFile(wheel).read(f"{SHARE}/package.json"))
    assert meta["name"] == "notebook-accel-labextension" and meta["jupyterlab"]["_build"]["load"].startswith("static/")


def _labextension_sections(text: str) -> dict:
    """`jupyter labextension list`'s output as {folder: [extension lines]} (colour codes removed)."""
    sections: dict = {}
    folder = None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
        if line.strip() and not line[:1].isspace():
            folder = line.strip()
            sections[folder] = []
        elif line.strip() and folder is not None:
            sections[folder].append(line.strip())
    return sections


@pytest.mark.timeout(300)
def test_the_installed_wheel_is_an_enabled_labextension(wheel, tmp_path):
    """`pip install` of the wheel is the whole install: JupyterLab finds the extension, enabled and OK,
    where pip put it (a --prefix here, so the dev venv's link to extension/'s build cannot answer)."""
    prefix = tmp_path / "prefix"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
         "--ignore-installed", "--prefix", str(prefix), str(wheel)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    share = prefix / "share" / "jupyter"
    installed = share / "labextensions" / NAME
    assert (installed / "package.json").is_file(), sorted(str(p) for p in prefix.rglob("*"))[:40]
    schema = json.loads((installed / "schemas" / NAME / "plugin.json").read_text())
    assert schema["properties"]["numProcesses"]["default"] == 0  # the config's num_processes, else 2

    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(JUPYTER_PATH=str(share), JUPYTER_DATA_DIR=str(share))
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")  # no page_config.json that disables it
    listed = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"],
                            capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    output = listed.stdout + listed.stderr
    assert listed.returncode == 0, output
    sections = _labextension_sections(output)
    lines = [ln for ln in sections.get(str(share / "labextensions"), []) if ln.startswith(NAME + " ")]
    assert lines, output
    assert re.search(r"\benabled\b", lines[0]) and re.search(r"\bOK\b", lines[0]), output
    assert "disabled" not in lines[0], output


def test_jupyter_finds_the_extension_in_the_dev_venv():
    listed = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True)
    line = [ln for ln in (listed.stdout + listed.stderr).splitlines() if "notebook-accel-labextension" in ln]
    assert line and "enabled" in line[0] and "OK" in line[0], (listed.stdout, listed.stderr)
