"""utils/constants.py holds accelerate's interoperability constants with accelerate's values, and
the modules that name checkpoint files take those names from it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conformance import wheel  # noqa: E402

from notebook_accel import checkpointing, serialization  # noqa: E402
from notebook_accel.utils import constants, fsdp_files  # noqa: E402


def test_every_constant_of_accelerate_has_its_value_here():
    # accelerate's constants.py imports only operator and torch: run it for its values.
    theirs: dict = {}
    exec(
        compile(wheel.source("utils.constants").read_text(), "accelerate/utils/constants.py", "exec"), theirs
    )
    names = sorted(n for n in theirs if n.isupper())
    assert len(names) > 35
    differ = [n for n in names if getattr(constants, n, "<missing>") != theirs[n]]
    assert not differ, {n: (getattr(constants, n, "<missing>"), theirs[n]) for n in differ}


def test_file_names_live_once():
    for name in ("OPTIMIZER_NAME", "SCHEDULER_NAME", "SCALER_NAME", "RNG_STATE_NAME"):
        assert getattr(checkpointing, name) is getattr(constants, name)
    assert fsdp_files.FSDP_MODEL_NAME is constants.FSDP_MODEL_NAME
    # serialization names the stems: "model" for safetensors, "pytorch_model" for .bin
    assert serialization.MODEL_NAME is constants.SAFE_MODEL_NAME
    assert serialization.WEIGHTS_NAME is constants.MODEL_NAME
    assert (
        constants.SAFE_WEIGHTS_NAME == "model.safetensors" and constants.WEIGHTS_NAME == "pytorch_model.bin"
    )
