"""How long each notebook in notebooks/ takes to run top to bottom on this machine's CPU.

    python benchmarks/notebooks.py [--repeat 1] [--json PATH]

Each notebook runs in a fresh kernel of this interpreter, from a copy in a temp folder (they may
write files next to themselves), through nbclient as tests and `make demo` run them. The issue's
target is "a couple of minutes" each on a laptop CPU; the table gives the wall time from kernel
start to the last cell's end, and the slowest cell.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(path: Path) -> dict:
    from notebook_accel.demo import run_notebook

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        shutil.copy(path, copy)
        start = time.monotonic()
        nb, error = run_notebook(str(copy), timeout=600)
        seconds = time.monotonic() - start
    if error is not None:
        raise SystemExit(f"{path.name} failed:\n{error}")
    cells = []
    for cell in nb.cells:
        timing = cell.get("metadata", {}).get("execution", {})
        began, ended = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if began and ended:
            from datetime import datetime

            cells.append((datetime.fromisoformat(ended.rstrip("Z")) - datetime.fromisoformat(began.rstrip("Z"))).total_seconds())
    return {"seconds": seconds, "slowest_cell": max(cells) if cells else None, "cells": len(nb.cells)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--only", nargs="*", default=None, help="notebook names (stems) to run, default all")
    args = parser.parse_args()
    results = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if args.only and path.stem not in args.only:
            continue
        runs = [run_once(path) for _ in range(args.repeat)]
        results[path.stem] = {
            "median_s": statistics.median(r["seconds"] for r in runs),
            "slowest_cell_s": max(r["slowest_cell"] or 0 for r in runs),
            "cells": runs[0]["cells"],
        }
        row = results[path.stem]
        print(f"{path.stem:<36} {row['median_s']:6.1f} s   slowest cell {row['slowest_cell_s']:5.1f} s", flush=True)
    print(f"total {sum(r['median_s'] for r in results.values()):.1f} s  (python {sys.version.split()[0]})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
