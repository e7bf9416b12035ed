"""Trackers (JSONL, TensorBoard, custom) and get_logger, in this process and on real gloo ranks."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest
import torch
from mp import run_ranks

from notebook_accel.logging import get_logger
from notebook_accel.state import PartialState
from notebook_accel.tracking import (
    GeneralTracker,
    JSONLTracker,
    TensorBoardTracker,
    _tensorboard_available,
    filter_trackers,
    make_trackers,
)

TIMEOUT = 60
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_tracker_writes_one_line_per_log_and_the_config(tmp_path):
    tracker = JSONLTracker("run1", tmp_path)
    tracker.store_init_configuration({"lr": 0.1, "layers": [2, 3], "path": tmp_path})
    tracker.log({"loss": torch.tensor(0.5), "acc": np.float32(0.25), "n": np.int64(3), "note": "warmup"}, step=1)
    tracker.log({"loss": 0.25, "vec": torch.tensor([1.0, 2.0]), "nested": {"a": 1}}, step=2)
    tracker.log({"loss": 0.125})
    tracker.finish()
    lines = _lines(tmp_path / "run1" / "metrics.jsonl")
    assert [line.pop("step") for line in lines] == [1, 2, None]
    assert all(isinstance(line.pop("timestamp"), float) for line in lines)
    assert lines == [
        {"loss": 0.5, "acc": 0.25, "n": 3, "note": "warmup"},
        {"loss": 0.25, "vec": [1.0, 2.0], "nested": {"a": 1}},
        {"loss": 0.125},
    ]
    config = json.loads((tmp_path / "run1" / "config.json").read_text())
    assert config == {"lr": 0.1, "layers": [2, 3], "path": str(tmp_path)}
    with pytest.raises(RuntimeError, match="finished"):
        tracker.log({"loss": 1.0})

    again = JSONLTracker("run1", tmp_path)  # a resumed run appends
    again.log({"loss": 0.0625}, step=4)
    again.finish()
    assert [line["step"] for line in _lines(tmp_path / "run1" / "metrics.jsonl")] == [1, 2, None, 4]


def test_jsonl_tracker_refuses_what_it_cannot_write(tmp_path):
    tracker = JSONLTracker("r", tmp_path)
    with pytest.raises(ValueError, match=r"\['step'\]"):
        tracker.log({"step": 3})
    with pytest.raises(TypeError, match="Cannot log model="):
        tracker.log({"model": object()})
    with pytest.raises(ValueError, match="logging_dir"):
        JSONLTracker("r", None)
    tracker.finish()
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == ""


class ListTracker(GeneralTracker):
    name = "list"

    def __init__(self):
        self.records = []

    def log(self, values, step=None, **kwargs):
        self.records.append((step, values))


def test_filter_trackers_resolves_names_and_explains_bad_ones(tmp_path):
    custom = ListTracker()
    assert filter_trackers(None) == []
    assert filter_trackers("jsonl", tmp_path) == [JSONLTracker]
    assert filter_trackers(["all", "jsonl", custom], tmp_path) == (
        [JSONLTracker] + ([TensorBoardTracker] if _tensorboard_available() else []) + [custom]
    )
    assert filter_trackers([custom]) == [custom]  # an instance needs no folder from us
    with pytest.raises(ValueError, match="Unknown tracker 'jsnol'"):
        filter_trackers("jsnol", tmp_path)
    with pytest.raises(ValueError, match="'wandb' is not built into notebook_accel.*GeneralTracker"):
        filter_trackers("wandb", tmp_path)
    with pytest.raises(ValueError, match="'jsonl' tracker writes files but no logging folder.*logging_dir"):
        filter_trackers("jsonl", None)
    with pytest.raises(ValueError, match="no logging folder"):
        filter_trackers("all", None)
    if not _tensorboard_available():
        with pytest.raises(ValueError, match="pip install tensorboard"):
            filter_trackers("tensorboard", tmp_path)

    built = make_trackers("exp", filter_trackers(["jsonl", custom], tmp_path), tmp_path, config={"seed": 1})
    assert built[1] is custom and isinstance(built[0], JSONLTracker)
    assert json.loads((tmp_path / "exp" / "config.json").read_text()) == {"seed": 1}


@pytest.mark.skipif(not _tensorboard_available(), reason="tensorboard is not installed")
def test_tensorboard_tracker_writes_event_files(tmp_path):
    tracker = TensorBoardTracker("tb", tmp_path)
    tracker.store_init_configuration({"lr": 0.1, "opt": "adam"})
    tracker.log({"loss": torch.tensor(0.5), "note": "x", "pair": {"a": 1.0, "b": 2.0}}, step=1)
    tracker.finish()
    events = [n for _, _, files in os.walk(tmp_path / "tb") for n in files if n.startswith("events.out.tfevents")]
    assert events


def _trackers_on_rank(folder):
    rank = PartialState().process_index
    custom = ListTracker()
    jsonl = JSONLTracker("run", folder)
    for step in range(3):
        custom.log({"rank": rank}, step=step)
        jsonl.log({"rank": rank}, step=step)
    jsonl.store_init_configuration({"rank": rank})
    jsonl.finish()
    return custom.records


def test_only_the_main_process_logs(tmp_path):
    records = run_ranks(_trackers_on_rank, 2, str(tmp_path), timeout=TIMEOUT)
    assert records == [[(0, {"rank": 0}), (1, {"rank": 0}), (2, {"rank": 0})], []]
    assert [line["rank"] for line in _lines(tmp_path / "run" / "metrics.jsonl")] == [0, 0, 0]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"rank": 0}


# -- get_logger -----------------------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self, path=None, delay=0.0):
        super().__init__()
        self.messages, self.path, self.delay = [], path, delay

    def emit(self, record):
        self.messages.append(self.format(record))
        if self.path:
            time.sleep(self.delay)  # a slow rank 0: without in_order, rank 1 would write first
            with open(self.path, "a") as f:
                f.write(f"{record.process_index}:{record.getMessage()}\n")


def _log_on_rank(shared_file):
    state = PartialState()
    logger = get_logger("notebook_accel.test_ranks", log_level="INFO")
    handler = _Collect(shared_file, delay=0.3 if state.process_index == 0 else 0.0)
    logger.logger.addHandler(handler)
    logger.info("main only")
    logger.info("everyone %d", state.process_index, main_process_only=False)
    logger.debug("below the level", main_process_only=False)
    for i in range(2):
        logger.warning("ordered %d from %d", i, state.process_index, in_order=True)
    logger.logger.removeHandler(handler)
    return handler.messages


def test_get_logger_main_only_everyone_and_in_order_on_two_ranks(tmp_path):
    shared = tmp_path / "log.txt"
    messages = run_ranks(_log_on_rank, 2, str(shared), timeout=TIMEOUT)
    assert messages[0] == ["main only", "everyone 0", "ordered 0 from 0", "ordered 1 from 0"]
    assert messages[1] == ["everyone 1", "ordered 0 from 1", "ordered 1 from 1"]
    ordered = [line for line in shared.read_text().splitlines() if "ordered" in line]
    assert ordered == ["0:ordered 0 from 0", "1:ordered 0 from 1", "0:ordered 1 from 0", "1:ordered 1 from 1"]


def test_get_logger_needs_a_state_and_a_real_level():
    logger = get_logger("notebook_accel.test_single", log_level="info")
    assert logger.logger.level == logging.INFO
    with pytest.raises(RuntimeError, match="create an Accelerator"):
        logger.info("too early")
    with pytest.raises(ValueError, match="Unknown log level 'loud'"):
        get_logger("x", log_level="loud")
    PartialState(cpu=True)
    handler = _Collect()
    handler.setFormatter(logging.Formatter("%(funcName)s %(process_index)s %(message)s"))
    logger.logger.addHandler(handler)
    try:
        logger.info("hello")
        logger.warning_once("once")
        logger.warning_once("once")
        logger.info("ordered", in_order=True)
    finally:
        logger.logger.removeHandler(handler)
    name = "test_get_logger_needs_a_state_and_a_real_level"
    assert handler.messages == [f"{name} 0 hello", f"{name} 0 once", f"{name} 0 ordered"]
