"""The debug checks collectives can wear (verify_operation, chained_operation), shape and tensor
hand-offs from one rank (gather_tensor_shape, copy_tensor_to_devices), and the local helpers
find_device, pad_input_tensors and the dtype codes: on 2 real gloo ranks, and in one process."""

from __future__ import annotations

import warnings

import pytest
import torch
from mp import run_ranks

from notebook_accel.state import PartialState
from notebook_accel.utils import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    find_device,
    gather,
    gather_object,
    pad_across_processes,
    pad_input_tensors,
)
from notebook_accel.utils.dataclasses import TensorInformation
from notebook_accel.utils.operations import (
    TENSOR_INT_TO_DTYPE,
    TENSOR_TYPE_TO_INT,
    chained_operation,
    copy_tensor_to_devices,
    gather_tensor_shape,
    get_shape,
    verify_operation,
)

# -- run on every rank (module level, so the forkserver children can import them) -----------------

CALLS = []


@verify_operation
def shapes_collective(tensor, note=""):
    """Gathers every rank's shapes; checked first in debug mode."""
    CALLS.append(note)
    return gather_object([get_shape(tensor)])


@chained_operation
def two_step_collective(tensor):
    return shapes_collective(tensor * 2, note="inner")


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # the test compares the type and the message on every rank
        cause = exc.__cause__
        return (type(exc).__name__, str(exc), type(cause).__name__ if cause is not None else None)


def _checked_calls():
    state = PartialState()
    r = state.process_index
    out = {"debug": state.debug, "name": shapes_collective.__name__}
    CALLS.clear()
    out["same"] = _outcome(lambda: shapes_collective(torch.zeros(2, 3), note="same"))
    out["by_keyword"] = _outcome(lambda: shapes_collective(tensor=torch.zeros(2, 3), note="keyword"))
    out["ragged"] = _outcome(lambda: shapes_collective(torch.zeros(r + 1, 3), note="ragged"))
    out["nested"] = _outcome(lambda: shapes_collective({"x": torch.zeros(2, r + 1)}, note="nested"))
    where = "meta" if r == 1 else "cpu"
    out["device"] = _outcome(lambda: shapes_collective(torch.zeros(2, device=where), note="device"))
    if state.debug:  # without the check, a gather of a meta tensor would fail on one rank and hang the other
        out["gather_device"] = _outcome(lambda: gather(torch.zeros(2, device=where)))
    out["chained"] = _outcome(lambda: two_step_collective(torch.zeros(r + 2)))
    out["calls"] = list(CALLS)
    out["after"] = gather(torch.tensor([r])).tolist()  # the job still works after the errors
    return out


def _hand_offs():
    state = PartialState()
    r = state.process_index
    out = {}
    held = torch.arange(6, dtype=torch.int32).reshape(2, 3) + 10 if r == 1 else None
    shape, code = gather_tensor_shape(held)
    out["shape"] = (shape.tolist(), str(shape.dtype), shape.device.type, code)
    empty_rows = torch.zeros(0, 5, dtype=torch.bool) if r == 0 else None
    shape, code = gather_tensor_shape(empty_rows)
    out["empty_rows"] = (shape.tolist(), code)
    copied = copy_tensor_to_devices(held)
    out["copied"] = (copied.tolist(), str(copied.dtype))
    out["complex"] = _outcome(lambda: gather_tensor_shape(torch.ones(2, dtype=torch.complex64) if r else None))
    out["both"] = _outcome(lambda: gather_tensor_shape(torch.ones(1)))
    out["nobody"] = _outcome(lambda: copy_tensor_to_devices(None))
    out["not_a_tensor"] = _outcome(lambda: copy_tensor_to_devices([1, 2] if r == 0 else None))

    # A batch of 3 rows padded for the 2 processes, split between them, and gathered back.
    batch = torch.arange(3.0)[:, None] + 1
    padded = pad_input_tensors(batch, batch_size=3, num_processes=state.num_processes)
    rows = padded.shape[0] // state.num_processes
    mine = padded[r * rows : (r + 1) * rows]
    out["split"] = (tuple(padded.shape), mine.tolist(), gather(mine * 10).tolist())
    return out


# -- multi-process tests ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_verify_operation_in_debug_mode_raises_on_every_rank_and_names_each_ranks_input():
    results = run_ranks(_checked_calls, 2, env={"ACCELERATE_DEBUG_MODE": "1"}, timeout=90)
    for out in results:
        assert out["debug"] is True and out["name"] == "shapes_collective"
        assert out["same"] == ("ok", [[2, 3], [2, 3]])
        assert out["by_keyword"] == ("ok", [[2, 3], [2, 3]])
        kind, message, _ = out["ragged"]
        assert kind == "DistributedOperationException"
        assert "shapes_collective" in message
        assert "rank 0: torch.Size([1, 3]), rank 1: torch.Size([2, 3])" in message
        kind, message, _ = out["nested"]
        assert kind == "DistributedOperationException"
        assert "rank 0: {'x': torch.Size([2, 1])}, rank 1: {'x': torch.Size([2, 2])}" in message
        for case in ("device", "gather_device"):
            kind, message, _ = out[case]
            assert kind == "DistributedOperationException", case
            assert "device type (cpu)" in message and "rank 1: meta" in message and "rank 0" not in message
        kind, message, cause = out["chained"]
        assert kind == "DistributedOperationException" and cause == "DistributedOperationException"
        assert "two_step_collective" in message and "torch.Size([2]), rank 1: torch.Size([3])" in message
        # The wrapped function ran only where every rank agreed.
        assert out["calls"] == ["same", "keyword"]
        assert out["after"] == [0, 1]


@pytest.mark.timeout(120)
def test_verify_operation_outside_debug_mode_only_calls_the_function():
    results = run_ranks(_checked_calls, 2, timeout=90)
    for out in results:
        assert out["debug"] is False
        assert out["ragged"] == ("ok", [[1, 3], [2, 3]])
        assert out["nested"] == ("ok", [{"x": [2, 1]}, {"x": [2, 2]}])
        assert out["chained"] == ("ok", [[2], [3]])
        assert out["calls"] == ["same", "keyword", "ragged", "nested", "device", "inner"]


@pytest.mark.timeout(120)
def test_gather_tensor_shape_copy_tensor_to_devices_and_pad_input_tensors_on_two_ranks():
    results = run_ranks(_hand_offs, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out["shape"] == ([2, 3], "torch.int64", "cpu", TENSOR_TYPE_TO_INT[torch.int32])
        assert out["empty_rows"] == ([0, 5], TENSOR_TYPE_TO_INT[torch.bool])
        assert out["copied"] == ([[10, 11, 12], [13, 14, 15]], "torch.int32")
        kind, message, _ = out["complex"]
        assert kind == "TypeError" and "torch.complex64" in message
        kind, message, _ = out["both"]
        assert kind == "ValueError" and "ranks [0, 1] passed one" in message
        kind, message, _ = out["nobody"]
        assert kind == "ValueError" and "ranks none passed one" in message
        kind, message, _ = out["not_a_tensor"]
        assert kind == "TypeError" and "rank 0: list" in message
        shape, mine, gathered = out["split"]
        assert shape == (4, 1)
        assert mine == ([[1.0], [2.0]] if rank == 0 else [[3.0], [0.0]])
        assert gathered == [[10.0], [20.0], [30.0], [0.0]]


# -- one process --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_DEBUG_MODE"):
        monkeypatch.delenv(name, raising=False)
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def test_find_device_returns_the_first_tensors_device_or_none():
    meta = torch.zeros(1, device="meta")
    assert find_device(meta) == torch.device("meta")
    assert find_device({"ids": [1, "a"], "x": (meta, torch.zeros(1))}) == torch.device("meta")
    assert find_device([{"a": None}, [torch.zeros(1), meta]]) == torch.device("cpu")
    assert find_device([1, "text", {"k": None}]) is None
    assert find_device([]) is None


def test_pad_input_tensors_pads_to_a_multiple_of_the_processes_with_zeros():
    for rows, processes, padded_rows in [(3, 4, 4), (5, 4, 8), (9, 4, 12), (1, 2, 2), (7, 3, 9), (1, 1, 1)]:
        batch = torch.arange(1.0, rows + 1)[:, None].repeat(1, 2)
        padded = pad_input_tensors(batch, rows, processes)
        assert padded.shape == (padded_rows, 2), (rows, processes)
        assert padded[:rows].equal(batch) and not padded[rows:].any()
    already = torch.ones(8, 2)
    assert pad_input_tensors(already, 8, 4) is already  # 8 rows split evenly on 4: untouched
    nested = pad_input_tensors({"x": torch.ones(3, 2), "y": [torch.tensor(5)]}, 3, 2)
    assert nested["x"].shape == (4, 2) and nested["y"][0].item() == 5  # 0-d: no dim 0 to pad
    with pytest.raises(TypeError, match=r"Unsupported types \(<class .str.>\)"):
        pad_input_tensors({"x": torch.ones(3, 2), "s": "text"}, 3, 2)
    columns = pad_input_tensors(torch.ones(2, 3), 3, 2, dim=1)
    assert columns.tolist() == [[1.0, 1.0, 1.0, 0.0]] * 2
    assert pad_input_tensors(torch.ones(2, 3), 3, 2, dim=-1).shape == (2, 4)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.ones(3, 2), 3, 0), ValueError, "num_processes must be an integer of at least 1, got 0"),
        ((torch.ones(3, 2), -1, 2), ValueError, "batch_size must be an integer of at least 0, got -1"),
        ((torch.ones(3, 2), 3.0, 2), ValueError, "batch_size must be an integer of at least 0, got 3.0"),
        ((torch.ones(3, 2), 3, 2, "0"), TypeError, "dim must be an integer, got '0'"),
        ((torch.ones(5, 2), 3, 2), ValueError, r"shape \(5, 2\): every tensor must have 3 entries along dim 0"),
    ],
)
def test_pad_input_tensors_names_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        pad_input_tensors(*args)


def test_pad_across_processes_warns_and_leaves_a_nested_tensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's prototype notice for nested tensors
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.warns(CannotPadNestedTensorWarning, match="nested tensor"):
        out = pad_across_processes({"n": nested, "t": torch.ones(2)})
    assert out["n"] is nested
    with warnings.catch_warnings():
        warnings.simplefilter("error", CannotPadNestedTensorWarning)
        pad_across_processes(torch.ones(2))  # a plain tensor does not warn


def test_dtype_codes_are_accelerates_and_invert():
    assert TENSOR_TYPE_TO_INT[torch.float32] == 1 and TENSOR_TYPE_TO_INT[torch.bool] == 10
    assert TENSOR_TYPE_TO_INT[torch.bfloat16] == 4 and TENSOR_TYPE_TO_INT[torch.int64] == 9
    assert len(TENSOR_TYPE_TO_INT) == 10
    assert all(TENSOR_INT_TO_DTYPE[code] is dtype for dtype, code in TENSOR_TYPE_TO_INT.items())


def test_gather_tensor_shape_in_one_process():
    shape, code = gather_tensor_shape(torch.zeros(4, 0, 2, dtype=torch.float16))
    assert shape.tolist() == [4, 0, 2] and code == 3
    with pytest.raises(ValueError, match="needs a tensor, got None"):
        gather_tensor_shape(None)
    with pytest.raises(TypeError, match="no code for torch.complex128"):
        gather_tensor_shape(torch.zeros(1, dtype=torch.complex128))


def test_the_decorators_in_one_process_call_through_and_keep_the_name():
    CALLS.clear()
    assert shapes_collective(torch.zeros(3), note="alone") == [[3]]
    assert CALLS == ["alone"] and shapes_collective.__doc__.startswith("Gathers")
    assert two_step_collective(torch.zeros(2)) == [[2]]

    @chained_operation
    def fails(kind):
        raise kind("inner problem")

    with pytest.raises(DistributedOperationException, match="Error while calling .*fails: inner problem") as info:
        fails(DistributedOperationException)
    assert isinstance(info.value.__cause__, DistributedOperationException)
    with pytest.raises(KeyError):  # other errors pass through unchanged
        fails(KeyError)


def test_tensor_information_lives_at_accelerates_path():
    from notebook_accel.utils.operations import get_data_structure

    info = get_data_structure(torch.zeros(2, 3))
    assert isinstance(info, TensorInformation) and info == TensorInformation(torch.Size([2, 3]), torch.float32)
