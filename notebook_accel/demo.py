"""Execute a notebook in a real kernel and print what each code cell showed.

    python -m notebook_accel.demo notebooks/quickstart.ipynb

`make demo` runs this on the quickstart. The kernel is always this interpreter (`sys.executable`),
so the notebook sees the same venv as the command that ran it. Exits 1 when a cell fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

CELL_TIMEOUT_S = 120


def _kernel_manager_class(python: Optional[str] = None):
    """A kernel manager whose "python3" kernel runs `python` (default: this interpreter)."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager

    class ThisPythonSpecs(KernelSpecManager):
        # A "python3" kernelspec in ~/.local or /usr/share may point at another interpreter.
        def get_kernel_spec(self, kernel_name):
            if kernel_name == "python3":
                from ipykernel.kernelspec import RESOURCES, get_kernel_dict

                spec = get_kernel_dict()
                if python:
                    spec["argv"] = [python, *spec["argv"][1:]]
                return KernelSpec(resource_dir=RESOURCES, **spec)
            return super().get_kernel_spec(kernel_name)

    class ThisPythonKernelManager(KernelManager):
        def _kernel_spec_manager_default(self):
            return ThisPythonSpecs(data_dir=self.data_dir)

    return ThisPythonKernelManager


def run_notebook(
    path: str, timeout: int = CELL_TIMEOUT_S, widgets: bool = False, python: Optional[str] = None
):
    """Execute the notebook at `path` (cwd: its folder). Returns (notebook, error or None);
    on a failing cell the notebook holds the outputs up to and including that cell.

    `widgets=False` makes launches print rank-prefixed text (what a terminal can show) as they
    go instead of drawing the live panel, whose output keeps that text only as one transcript
    when the launch ends. `python` runs the kernel on another interpreter (a venv's), which
    needs ipykernel."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(python),
        # ipykernel 7 warns on every start that local TCP is unencrypted: noise for a local demo.
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
    )
    env = {**os.environ, "NOTEBOOK_ACCEL_WIDGETS": "1" if widgets else "0"}
    try:
        client.execute(env=env)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        return nb, exc
    return nb, None


def cell_texts(cell) -> list:
    """The text a person would read under a code cell: streams, text/plain results, errors."""
    texts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            texts.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            plain = out.get("data", {}).get("text/plain")
            if plain:
                texts.append(plain if plain.endswith("\n") else plain + "\n")
        elif kind == "error":
            texts.append(f"{out.get('ename')}: {out.get('evalue')}\n")
    return texts


def _heading(markdown: str) -> Optional[str]:
    for line in markdown.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return None


def _failed_cell(nb) -> Optional[int]:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return index
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m notebook_accel.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("notebook", nargs="?", default="notebooks/quickstart.ipynb")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
    options = parser.parse_args(argv)
    if not os.path.isfile(options.notebook):
        print(f"demo: no notebook at {options.notebook!r}", file=sys.stderr)
        return 2

    print(f"Running {options.notebook} in a kernel on {sys.executable}\n")
    started = time.monotonic()
    nb, error = run_notebook(options.notebook, options.timeout)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    title, number = None, 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            title = _heading(cell.source) or title
            continue
        if cell.cell_type != "code":
            continue
        number += 1
        if cell.get("execution_count") is None and not cell.get("outputs"):
            continue  # not reached
        print(f"--- cell {number}" + (f": {title}" if title else ""))
        sys.stdout.write("".join(cell_texts(cell)))
        title = None
    elapsed = time.monotonic() - started
    if error is not None:
        index = _failed_cell(nb)
        where = (
            f"code cell {sum(c.cell_type == 'code' for c in nb.cells[: index + 1])}"
            if index is not None
            else "a cell"
        )
        print(f"\nFAILED in {where} after {elapsed:.1f}s:\n{error}", file=sys.stderr)
        return 1
    print(f"\nOK: {len(code_cells)} code cells ran in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
