"""Helpers for the tests that execute a notebook of notebooks/ once per module and read its cells."""

import shutil
from pathlib import Path

from notebook_accel.demo import cell_texts, run_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(name_or_path, leftovers_glob=None, timeout=150, label="the notebook"):
    """Run the notebook (a name in notebooks/, or a path) in a real kernel; returns (text, cell) for
    each code cell, text being what a person reads under it. Folders matching `leftovers_glob` next
    to the notebook that the run created are removed, even when it fails (a failing cell skips the
    notebook's own clean-up), and then count as a failure. `label` names the notebook in the message."""
    notebook = NOTEBOOKS / name_or_path  # an absolute path stays as it is
    leftovers_before = set(notebook.parent.glob(leftovers_glob)) if leftovers_glob else set()
    leftovers = set()
    try:
        nb, error = run_notebook(str(notebook), timeout=timeout)
    finally:
        if leftovers_glob:
            leftovers = set(notebook.parent.glob(leftovers_glob)) - leftovers_before
            for folder in leftovers:
                shutil.rmtree(folder, ignore_errors=True)
    assert error is None, f"{label} failed:\n{error}"
    assert not leftovers, f"the notebook left {leftovers} behind"
    return [("".join(cell_texts(c)), c) for c in nb.cells if c.cell_type == "code"]


def cell(executed, marker):
    """(text, cell) of the first code cell whose source contains `marker`."""
    found = next(((text, c) for text, c in executed if marker in c.source), None)
    assert found is not None, f"no cell contains {marker!r}"
    return found
