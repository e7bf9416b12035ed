"""The cells every notebook in notebooks/ starts with: open-in badges and an install cell.

    python tools/notebook_header.py notebooks/NAME.ipynb [...]   # add or refresh them, strip outputs

The install cell checks every module the notebook imports and pip-installs the missing ones, so a
notebook opened on Colab or Kaggle (no notebook_accel) or after a plain `pip install notebook_accel`
(no matplotlib) works from its second cell on; where everything is installed it does nothing.

The repository the badges open and the install cell installs from is `[project.urls] Repository` in
pyproject.toml, the one place a fork changes it (then run this tool on every notebook).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
GITHUB = "https://github.com/"


def _repository() -> str:
    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    if not url.startswith(GITHUB) or url.rstrip("/").count("/") != 4:
        raise SystemExit(f"pyproject.toml [project.urls] Repository = {url!r}: the badges need a GitHub "
                         f"repository URL, {GITHUB}OWNER/NAME")  # fmt: skip
    return url.rstrip("/")[len(GITHUB):]


REPO = _repository()  # OWNER/NAME, as Colab, Kaggle and Binder links spell it
BADGES_MARK = "<!-- open-in badges -->"
INSTALL_MARK = "# Colab, Kaggle or a fresh environment"
# What pip installs for a module a notebook imports; the standard library needs nothing.
PIP_NAMES = {
    "notebook_accel": f"notebook_accel[notebooks] @ git+{GITHUB}{REPO}",
    "torch": "torch", "numpy": "numpy", "psutil": "psutil", "safetensors": "safetensors",
    "IPython": "ipython", "yaml": "pyyaml", "matplotlib": "matplotlib", "tqdm": "tqdm",
    "ray": "ray[default]",  # what the package's `ray` extra installs
}  # fmt: skip
IMPORT = re.compile(r"\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*))")


def badges(name: str) -> str:
    path = f"notebooks/{name}"
    return "\n".join([
        BADGES_MARK,
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{REPO}/blob/main/{path})",
        f"[![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
        f"(https://kaggle.com/kernels/welcome?src=https://github.com/{REPO}/blob/main/{path})",
        f"[![Binder](https://mybinder.org/badge_logo.svg)]"
        f"(https://mybinder.org/v2/gh/{REPO}/main?labpath={path.replace('/', '%2F')})",
    ])  # fmt: skip


def needs(path: Path) -> list:
    """The modules the notebook imports in any code cell (a script it writes included) that are
    neither in the standard library nor a file the notebook writes itself; notebook_accel first."""
    sources = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    found = set()
    for line in "\n".join(sources).splitlines():
        match = IMPORT.match(line)
        if match:
            names = [match.group(1)] if match.group(1) else [n.split()[0] for n in match.group(2).split(",")]
            found.update(n.strip().split(".")[0] for n in names)
    written = {m for m in found if any(re.search(rf"\b{m}\.py\b", s) for s in sources)}
    modules = sorted(found - set(sys.stdlib_module_names) - written, key=lambda m: (m != "notebook_accel", m))
    unknown = [m for m in modules if m not in PIP_NAMES]
    if unknown:
        raise SystemExit(f"{path.name} imports {unknown}: add what pip installs for each to PIP_NAMES in "
                         "tools/notebook_header.py (and to the notebooks extra in pyproject.toml)")  # fmt: skip
    return modules


def install_cell(modules) -> str:
    return "\n".join([
        f"{INSTALL_MARK}: install what this notebook imports and is missing.",
        "import importlib.util",
        "import shlex",
        "",
        "NEEDS = {  # module: what pip installs for it",
        *(f'    "{m}": "{PIP_NAMES[m]}",' for m in modules),
        "}",
        "missing = [spec for module, spec in NEEDS.items() if importlib.util.find_spec(module) is None]",
        "if missing:",
        "    specs = shlex.join(missing)",
        "    %pip install -q {specs}",
    ])  # fmt: skip


def _cell(kind: str, source: str) -> dict:
    cell = {"cell_type": kind, "metadata": {}, "source": source.splitlines(True)}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def apply(path: Path) -> None:
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if BADGES_MARK not in "".join(c["source"])]
    cells = [c for c in cells if not "".join(c["source"]).startswith(INSTALL_MARK)]
    # Old install cells (find_spec + %pip) give way to the standard one.
    cells = [c for c in cells if not ("find_spec(" in "".join(c["source"]) and "%pip install" in "".join(c["source"]))]
    title = 1 if cells and cells[0]["cell_type"] == "markdown" else 0
    cells[title:title] = [_cell("markdown", badges(path.name)), _cell("code", install_cell(needs(path)))]
    for c in cells:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
        c.pop("id", None)
    nb["cells"] = cells
    nb["metadata"] = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                      "language_info": {"name": "python"}}  # fmt: skip
    nb["nbformat"], nb["nbformat_minor"] = 4, 4
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        apply(Path(arg))
