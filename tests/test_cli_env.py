"""The installed console script runs and prints the hardware report."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(sys.executable), "notebook-accel")


@pytest.mark.timeout(60)
def test_env_prints_report_as_text_and_json():
    text = subprocess.run([SCRIPT, "env"], capture_output=True, text=True, timeout=50)
    assert text.returncode == 0, text.stderr
    cores = f"{os.cpu_count()} logical"
    assert text.stdout.startswith("Hardware report") and cores in text.stdout
    data = json.loads(subprocess.run([SCRIPT, "env", "--json"], capture_output=True, text=True, timeout=50).stdout)
    assert data["logical_cores"] == os.cpu_count()
    assert data["versions"]["torch"]


@pytest.mark.timeout(60)
def test_no_command_prints_usage_and_fails():
    done = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=50)
    assert done.returncode == 2 and "usage: notebook-accel" in done.stderr


@pytest.mark.timeout(60)
def test_library_imports_no_jupyter_packages_in_a_plain_script():
    code = (
        "import sys, notebook_accel\n"
        "from notebook_accel import notebook_launcher, PartialState, debug_launcher\n"
        "from notebook_accel.utils import gather, set_seed\n"
        "from notebook_accel import hardware; hardware.report()\n"
        "print(sorted(m for m in ('IPython', 'ipywidgets', 'ipykernel') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
