"""Packages the tests need beside the dev venv, installed with `pip install --no-deps --target` into
build/real-accelerate/ (one folder per requirement list, cached; never into the dev venv). Only the
processes that need them put the folder on their path."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / "build" / "real-accelerate"
# transformers and the dependencies the dev venv lacks, found by trying.
TRANSFORMERS = (
    "transformers==5.25.0", "huggingface_hub==2.4.0", "tokenizers==0.23.3", "regex==2026.12.2",
    "httpx2==2.17.0", "httpcore2==2.17.0", "truststore==0.10.5",
)  # fmt: skip
# What accelerate's unit tests import beyond torch and transformers.
UNIT_TEST_DEPS = ("parameterized==0.9.0",)
_OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
            "Max retries exceeded", "ConnectTimeout", "ReadTimeout")  # fmt: skip


class InstallFailed(RuntimeError):
    def __init__(self, message: str, offline: bool):
        super().__init__(message)
        self.offline = offline


def install(name: str, requirements) -> Path:
    """`pip install --no-deps --target` into a folder of CACHE once (named by `name` and the
    requirements, so a changed list installs afresh); later runs reuse it."""
    key = hashlib.sha256("\n".join(map(str, requirements)).encode()).hexdigest()[:10]
    folder = CACHE / f"{name}-{key}"
    if (folder / ".installed").exists():
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))  # renamed into place when complete
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:", "--target",
         str(scratch), *map(str, requirements)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if result.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise InstallFailed(
            f"pip install {' '.join(map(str, requirements))} failed:\n{result.stderr[-2000:]}",
            offline=any(word in result.stderr for word in _OFFLINE),
        )
    (scratch / ".installed").touch()
    try:
        scratch.rename(folder)
    except OSError:  # another run installed it first
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def transformers() -> Path:
    return install(TRANSFORMERS[0].replace("==", "-"), TRANSFORMERS)
