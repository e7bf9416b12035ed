"""The layer map is checked, not hoped for: import-linter's contracts hold, and they can fail."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, env_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT), "--no-cache"],
        cwd=cwd,
        env={"PYTHONPATH": str(env_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_contracts_named_by_the_design_are_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; CI and the dev venv have it
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["type"]: c for c in config["contracts"]}
    layers = [layer.split(" : ") for layer in contracts["layers"]["layers"]]
    order = {name.strip(): i for i, group in enumerate(layers) for name in group}
    # jupyter > commands > session > launch > training modules > state > hardware/config > utils
    chain = ["jupyter", "commands", "session", "launch", "accelerator", "state", "hardware", "utils"]
    assert [order[name] for name in chain] == sorted(order[name] for name in chain)
    assert order["config"] == order["hardware"]
    assert contracts["layers"]["exhaustive"] is True
    forbidden = [c for c in config["contracts"] if c["type"] == "forbidden"]
    launch = next(c for c in forbidden if c["source_modules"] == ["notebook_accel.launch"])
    assert set(launch["forbidden_modules"]) == {
        "notebook_accel.jupyter",
        "notebook_accel.accelerator",
        "notebook_accel.session",
    }
    front = next(c for c in forbidden if "IPython" in c["forbidden_modules"])
    package = ROOT / "notebook_accel"
    everything = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    everything |= {p.parent.name for p in package.glob("*/__init__.py")}
    # every module of the package but jupyter/ is a source: a new module cannot slip past the rule
    assert {m.removeprefix("notebook_accel.") for m in front["source_modules"]} == everything - {"jupyter"}
    assert front["ignore_imports"] == ["notebook_accel.session.display -> IPython"]


def test_lint_imports_passes_on_the_package():
    result = _lint(ROOT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


def test_a_launch_module_importing_jupyter_breaks_the_contracts(tmp_path):
    shutil.copytree(
        ROOT / "notebook_accel", tmp_path / "notebook_accel", ignore=shutil.ignore_patterns("labextension")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    launcher = tmp_path / "notebook_accel" / "launch" / "launcher.py"
    launcher.write_text(launcher.read_text() + "\n\ndef _bad():\n    from ..jupyter import panel  # noqa\n")
    result = _lint(tmp_path, tmp_path)
    assert result.returncode != 0
    assert "notebook_accel.launch.launcher -> notebook_accel.jupyter.panel" in result.stdout


def test_architecture_md_names_every_module():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    package = ROOT / "notebook_accel"
    missing = [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if "labextension" not in p.parts and f"`{p.relative_to(package)}`" not in text
    ]
    assert not missing, f"ARCHITECTURE.md does not list {missing}: add one line for each"


def test_no_module_is_squeezed_under_the_size_limit():
    # A module past ~600 lines is asking to be split by job (DESIGN.md); `# fmt: skip` was used to
    # pack lines instead, so it may not come back.
    package = ROOT / "notebook_accel"
    sizes = {str(p.relative_to(package)): len(p.read_text().splitlines()) for p in package.rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > 600} == {}
    assert [k for k in sizes if "fmt: skip" in (package / k).read_text()] == []
