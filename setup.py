"""Only for what pyproject.toml cannot say: ship the prebuilt JupyterLab extension when it is built.

`make labextension` writes notebook_accel/labextension/; a wheel built after it installs the
extension under share/jupyter/labextensions/, where JupyterLab finds it with no further step. A
checkout without the build (no node: Binder, `pip install git+...` on Colab) still installs, without
the extension; the widgets and magics do not need it.
"""

from collections import defaultdict
from pathlib import Path

from setuptools import setup

BUILT = Path("notebook_accel/labextension")
DEST = Path("share/jupyter/labextensions/notebook-accel-labextension")

files = defaultdict(list)
if (BUILT / "package.json").is_file():
    for path in sorted(p for p in BUILT.rglob("*") if p.is_file()):
        files[str(DEST / path.parent.relative_to(BUILT))].append(str(path))

setup(data_files=sorted(files.items()))
