"""accelerate 1.15.0's wheel, fetched from the package index at test time into a cache, never vendored.

The conformance run and the public-surface test read their material from it: the test scripts under
`accelerate/test_utils/scripts/` and the package's own source (to list its public names).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

VERSION = "1.15.0"
_REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """Where the wheel and what is unpacked from it live (`build/` is ignored by git)."""
    path = Path(os.environ.get("NOTEBOOK_ACCEL_CONFORMANCE_CACHE", _REPO / "build" / "conformance"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _alone():
    """One process at a time fetches or unpacks (test processes run side by side under xdist)."""
    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def wheel_path() -> Path:
    """The wheel, downloaded once (`pip download accelerate==1.15.0 --no-deps`)."""
    with _alone():
        return _wheel_path()


def _wheel_path() -> Path:
    folder = cache_dir()
    found = sorted(folder.glob(f"accelerate-{VERSION}-*.whl"))
    if found:
        return found[0]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         f"accelerate=={VERSION}", "-d", str(folder)],
        capture_output=True, text=True, timeout=300,
    )
    found = sorted(folder.glob(f"accelerate-{VERSION}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download accelerate=={VERSION} from the package index into {folder}:\n"
            f"{result.stderr[-2000:]}\nThe conformance run needs the index (or the wheel placed in {folder})."
        )
    return found[0]


def unpacked() -> Path:
    """The wheel's files, unpacked once; returns the folder holding the `accelerate` package."""
    target = cache_dir() / f"accelerate-{VERSION}"
    done = target / ".unpacked"
    if not done.exists():
        wheel = wheel_path()
        with _alone():
            if not done.exists():
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(target)
                done.touch()
    return target


def script(name: str) -> Path:
    """One of accelerate's distributed test scripts, e.g. "test_ops"."""
    path = unpacked() / "accelerate" / "test_utils" / "scripts" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"accelerate {VERSION}'s wheel has no {path.name}")
    return path


def source(module: str) -> Path:
    """The source file of one of accelerate's modules, e.g. "utils.operations" or "" for the package."""
    parts = ["accelerate", *[p for p in module.split(".") if p]]
    base = unpacked().joinpath(*parts)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def sdist_tests() -> Path:
    """The root of accelerate 1.15.0's source distribution with its `tests/` folder (the unit tests ship
    only there), downloaded once (`pip download --no-binary :all:`) and unpacked once."""
    target = cache_dir() / f"accelerate-{VERSION}-sdist"
    if not (target / ".unpacked").exists():
        with _alone():
            _fetch_sdist(target)
    return target / f"accelerate-{VERSION}"


def _fetch_sdist(target: Path) -> None:
    folder = cache_dir()
    done = target / ".unpacked"
    if done.exists():
        return
    archive = folder / f"accelerate-{VERSION}.tar.gz"
    if not archive.exists():
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
             f"accelerate=={VERSION}", "-d", str(folder)],
            capture_output=True, text=True, timeout=300,
        )
        if result.returncode != 0 or not archive.exists():
            raise RuntimeError(
                f"could not download accelerate=={VERSION}'s sdist from the package index into {folder}:\n"
                f"{result.stderr[-2000:]}\nThe unit conformance run needs the index (or {archive.name} placed there)."
            )
    prefix = f"accelerate-{VERSION}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(target, members=members, filter="data")
    done.touch()
