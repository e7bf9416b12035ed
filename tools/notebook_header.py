"""The cells every notebook in notebooks/ starts with: open-in badges and an install cell.

    python tools/notebook_header.py notebooks/NAME.ipynb [...]   # add or refresh them, strip outputs

Colab and Kaggle start without notebook_accel; the install cell adds it there and does nothing
where it is installed (this repo's venv, Binder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = "notebook-accel/notebook_accel"  # the GitHub repository the badges open
BADGES_MARK = "<!-- open-in badges -->"
INSTALL_MARK = "# Colab, Kaggle or a fresh environment"


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


def install_cell(extra: str = "matplotlib") -> str:
    return "\n".join([
        f"{INSTALL_MARK}: install notebook_accel (nothing to do where it is installed).",
        "import importlib.util",
        "",
        'if importlib.util.find_spec("notebook_accel") is None:',
        f'    %pip install -q "notebook_accel @ git+https://github.com/{REPO}" {extra}'.rstrip(),
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
    cells[title:title] = [_cell("markdown", badges(path.name)), _cell("code", install_cell())]
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
