"""Collectives on real gloo ranks (2 and 4), and the nested-structure helpers in one process."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from mp import run_ranks

from notebook_accel.state import PartialState
from notebook_accel.utils import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_to_fp32,
    find_batch_size,
    gather,
    gather_object,
    get_data_structure,
    honor_type,
    is_tensor_information,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)
from notebook_accel.utils.operations import initialize_tensors

Pair = namedtuple("Pair", ["first", "second"])

# -- run on every rank (module level, so the forkserver children can import them) -----------------


def _gather_and_broadcast():
    state = PartialState()
    r, n = state.process_index, state.num_processes
    out = {"world": n, "type": str(state.distributed_type)}

    scalar = gather(torch.tensor(float(r)))
    out["scalar"] = (tuple(scalar.shape), scalar.tolist())

    nested = gather({"a": [torch.tensor([r, r]), torch.full((1, 2), r)], "b": (torch.tensor(r * 10),)})
    out["nested_types"] = (type(nested).__name__, type(nested["a"]).__name__, type(nested["b"]).__name__)
    out["nested"] = listify(nested)

    pair = gather(Pair(torch.tensor([r]), torch.tensor([[r, -r]])))
    out["pair"] = (type(pair).__name__, pair.first.tolist(), pair.second.tolist())

    out["objects"] = gather_object([f"r{r}", r])
    out["one_object_each"] = gather_object({"rank": r})

    from_first = broadcast(torch.full((3,), float(r)))
    last = n - 1
    nested_b = broadcast({"x": torch.full((2,), r), "y": [torch.tensor(float(r))]}, from_process=last)
    # A transposed view is not contiguous: it must still be overwritten in place.
    base = torch.arange(6).view(2, 3) * (r + 1)
    view = base.t()
    returned = broadcast(view, from_process=last)
    out["broadcast"] = (from_first.tolist(), listify(nested_b), base.tolist(), returned is view)

    objs = [f"x{r}", {"r": r}]
    same = broadcast_object_list(objs)
    out["objlist_first"] = (list(objs), same is objs)
    out["objlist_last"] = broadcast_object_list([r, f"y{r}"], from_process=last)
    return out


def _reduce_and_pad():
    state = PartialState()
    r = state.process_index
    t = torch.tensor([float(r), 2.0 * r + 1])
    out = {
        "sum": reduce(t, "sum").tolist(),
        "mean": reduce(t, "mean").tolist(),
        "max": reduce(t, "max").tolist(),
        "min": reduce(t, "min").tolist(),
        "scaled": reduce(t, "sum", scale=0.5).tolist(),
        "int_mean": (lambda x: (str(x.dtype), x.tolist()))(reduce(torch.tensor([r]), "mean")),
        "nested": listify(reduce({"a": [t], "b": (torch.tensor(r),)}, "sum")),
        "input_untouched": t.tolist(),
    }

    ragged = torch.full((2, r + 1), r + 1)  # rank r has r + 1 columns
    end = pad_across_processes(ragged, dim=1, pad_index=-1)
    front = pad_across_processes(ragged, dim=1, pad_index=-1, pad_first=True)
    negative_dim = pad_across_processes(ragged, dim=-1, pad_index=7)
    mixed = pad_across_processes({"ids": ragged, "label": torch.tensor([r])}, dim=1)
    out["pad_end"] = end.tolist()
    out["pad_front"] = front.tolist()
    out["pad_negative_dim"] = negative_dim.tolist()
    out["pad_mixed"] = (mixed["ids"].tolist(), mixed["label"].tolist())
    rows = torch.ones(r + 1, 2) * r  # ragged along dim 0, padded and then gathered
    out["pad_then_gather"] = gather(pad_across_processes(rows, pad_index=-5)).tolist()
    return out


def _debug_mismatch():
    state = PartialState()
    r = state.process_index
    out = {"debug": state.debug, "matching": gather(torch.ones(2, 3) * r).shape[0]}
    ragged = torch.zeros(2 * (r + 1), 3)
    for name, call in [
        ("gather", lambda: gather(ragged)),
        ("reduce", lambda: reduce(ragged, "sum")),
        ("broadcast", lambda: broadcast(ragged, from_process=state.num_processes - 1)),
        ("nested", lambda: broadcast({"x": ragged})),
        ("dtype", lambda: gather(torch.zeros(2, dtype=torch.float32 if r == 0 else torch.int64))),
    ]:
        try:
            call()
        except DistributedOperationException as exc:
            out[name] = str(exc)
        else:
            out[name] = None
    # The job must still be usable after the errors: nothing was left half-sent.
    out["after"] = gather(torch.tensor([r])).tolist()
    return out


# -- multi-process tests ------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_gather_object_and_broadcast(world_size):
    results = run_ranks(_gather_and_broadcast, world_size, timeout=60)
    n, last = world_size, world_size - 1
    for out in results:
        assert out["world"] == n and out["type"] == "MULTI_CPU"
        assert out["scalar"] == ((n,), [float(i) for i in range(n)])
        assert out["nested_types"] == ("dict", "list", "tuple")
        assert out["nested"] == {
            "a": [[i for i in range(n) for _ in range(2)], [[i, i] for i in range(n)]],
            "b": ([10 * i for i in range(n)],),
        }
        assert out["pair"] == ("Pair", list(range(n)), [[i, -i] for i in range(n)])
        assert out["objects"] == [x for i in range(n) for x in (f"r{i}", i)]
        assert out["one_object_each"] == [{"rank": i} for i in range(n)]
        first, nested, base, same_view = out["broadcast"]
        assert first == [0.0, 0.0, 0.0]
        assert nested == {"x": [last, last], "y": [float(last)]}
        assert base == (torch.arange(6).view(2, 3) * n).tolist() and same_view
        assert out["objlist_first"] == (["x0", {"r": 0}], True)
        assert out["objlist_last"] == [last, f"y{last}"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_and_pad_across_processes(world_size):
    results = run_ranks(_reduce_and_pad, world_size, timeout=60)
    n = world_size
    col0, col1 = list(range(n)), [2.0 * i + 1 for i in range(n)]
    for rank, out in enumerate(results):
        assert out["sum"] == [sum(col0), sum(col1)]
        assert out["mean"] == [sum(col0) / n, sum(col1) / n]
        assert out["max"] == [n - 1, 2.0 * (n - 1) + 1]
        assert out["min"] == [0.0, 1.0]
        assert out["scaled"] == [sum(col0) / 2, sum(col1) / 2]
        assert out["int_mean"] == ("torch.float32", [sum(col0) / n])
        assert out["nested"] == {"a": [[sum(col0), sum(col1)]], "b": (sum(col0),)}
        assert out["input_untouched"] == [float(rank), 2.0 * rank + 1]

        data, pad = [rank + 1] * (rank + 1), n - rank - 1
        assert out["pad_end"] == [data + [-1] * pad] * 2
        assert out["pad_front"] == [[-1] * pad + data] * 2
        assert out["pad_negative_dim"] == [data + [7] * pad] * 2
        assert out["pad_mixed"] == ([data + [0] * pad] * 2, [rank])  # 1-d label: no dim 1, untouched
        expected_rows = []
        for i in range(n):
            expected_rows += [[float(i)] * 2] * (i + 1) + [[-5.0] * 2] * (n - i - 1)
        assert out["pad_then_gather"] == expected_rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_debug_mode_names_every_ranks_shape(world_size):
    results = run_ranks(_debug_mismatch, world_size, env={"ACCELERATE_DEBUG_MODE": "1"}, timeout=60)
    shapes = [f"rank {i}: torch.Size([{2 * (i + 1)}, 3])" for i in range(world_size)]
    for out in results:
        assert out["debug"] is True
        assert out["matching"] == 2 * world_size
        for op in ("gather", "reduce", "broadcast"):
            message = out[op]
            assert message is not None, f"{op} did not raise"
            assert ", ".join(shapes) in message
            assert "pad_across_processes" in message and op in message
        assert "rank 0: {'x': torch.Size([2, 3])}, rank 1: {'x': torch.Size([4, 3])}" in out["nested"]
        assert "rank 0: torch.Size([2]) torch.float32" in out["dtype"]
        assert "rank 1: torch.Size([2]) torch.int64" in out["dtype"]
        assert out["after"] == list(range(world_size))


# -- one process --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_DEBUG_MODE"):
        monkeypatch.delenv(name, raising=False)
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def test_collectives_in_one_process_return_their_input():
    t = torch.tensor([[1.0, 2.0]])
    assert gather(t) is t
    scalar = torch.tensor(3.0)
    assert gather(scalar) is scalar
    assert gather_object([1, "a"]) == [1, "a"]
    assert gather_object({"k": 1}) == [{"k": 1}]
    assert broadcast(t, from_process=0) is t
    objs = ["a", 1]
    assert broadcast_object_list(objs) is objs and objs == ["a", 1]
    assert pad_across_processes(t, dim=1, pad_index=9) is t
    reduced = reduce(t, "sum", scale=2.0)
    assert reduced is not t and reduced.tolist() == [[2.0, 4.0]]
    assert reduce(t, "mean").tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError, match="'median' is not one of"):
        reduce(t, "median")
    with pytest.raises(ValueError, match='pass "sum"'):
        reduce(t, "none")
    with pytest.raises(TypeError, match="fills a list in place"):
        broadcast_object_list(("a",))
    with pytest.raises(TypeError, match=r"Unsupported types \(<class .str.>\)"):
        reduce({"a": "text"}, "sum")


def test_send_to_device_nested_with_skip_keys():
    class Box:  # any object with .to() is moved by calling it
        def __init__(self, tensor):
            self.tensor = tensor

        def to(self, device):  # no non_blocking: the fallback call must be used
            return Box(self.tensor.to(device))

    batch = {
        "ids": [torch.ones(2), (torch.zeros(1), Pair(torch.ones(1), "label"))],
        "keep": torch.ones(3),
        "box": Box(torch.ones(1)),
        "n": 5,
    }
    moved = send_to_device(batch, "meta", non_blocking=True, skip_keys="keep")
    assert moved["ids"][0].device.type == "meta"
    assert isinstance(moved["ids"][1], tuple) and moved["ids"][1][0].device.type == "meta"
    pair = moved["ids"][1][1]
    assert isinstance(pair, Pair) and pair.first.device.type == "meta" and pair.second == "label"
    assert moved["keep"] is batch["keep"]
    assert moved["box"].tensor.device.type == "meta"
    assert moved["n"] == 5
    assert send_to_device(torch.ones(1), torch.device("cpu"), non_blocking=True).device.type == "cpu"
    ordered = send_to_device(OrderedDict(a=torch.ones(1)), "meta", skip_keys=["b"])
    assert type(ordered) is OrderedDict and ordered["a"].is_meta
    counts = send_to_device(defaultdict(list, a=torch.ones(1)), "meta")
    assert isinstance(counts, defaultdict) and counts.default_factory is list and counts["a"].is_meta


def test_recursively_apply_and_honor_type():
    data = {"a": [torch.ones(2), 3], "b": Pair(torch.zeros(1), torch.ones(1))}
    doubled = recursively_apply(lambda t, k: t * k, data, 2)
    assert doubled["a"][0].tolist() == [2.0, 2.0] and doubled["a"][1] == 3
    assert isinstance(doubled["b"], Pair) and doubled["b"].second.tolist() == [2.0]
    with pytest.raises(TypeError, match=r"Unsupported types \(<class .int.>\)"):
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    assert honor_type(Pair(1, 2), iter([3, 4])) == Pair(3, 4)
    assert honor_type((1,), iter([5, 6])) == (5, 6)


def test_find_batch_size_concatenate_and_friends():
    assert find_batch_size(torch.ones(4, 2)) == 4
    assert find_batch_size({"meta": ["x"], "scalar": torch.tensor(1.0), "x": [torch.ones(6, 1)]}) == 6
    assert find_batch_size((torch.ones(3), torch.ones(5))) == 3
    with pytest.raises(ValueError, match="empty list"):
        find_batch_size([])
    with pytest.raises(TypeError, match="no tensor"):
        find_batch_size({"a": [1, 2]})

    parts = [{"x": torch.ones(2, 1), "y": (torch.zeros(1),)}, {"x": torch.zeros(3, 1), "y": (torch.ones(2),)}]
    joined = concatenate(parts)
    assert joined["x"].shape == (5, 1) and joined["y"][0].tolist() == [0.0, 1.0, 1.0]
    assert concatenate([torch.ones(2, 1), torch.zeros(2, 2)], dim=1).tolist() == [[1, 0, 0]] * 2
    with pytest.raises(TypeError, match="not int"):
        concatenate([1, 2])
    assert concatenate(["one batch"]) == "one batch"  # one batch comes back as it is, as in accelerate

    structure = get_data_structure({"a": torch.ones(2, 3, dtype=torch.float16)})
    assert is_tensor_information(structure["a"]) and structure["a"].shape == (2, 3)
    empty = initialize_tensors(structure)
    assert empty["a"].shape == (2, 3) and empty["a"].dtype == torch.float16

    halves = convert_to_fp32({"h": torch.ones(1, dtype=torch.bfloat16), "i": torch.ones(1, dtype=torch.int8)})
    assert halves["h"].dtype == torch.float32 and halves["i"].dtype == torch.int8
    assert listify([torch.tensor([1.5], dtype=torch.bfloat16)]) == [[1.5]]
    assert slice_tensors({"a": torch.arange(5)}, slice(1, 3))["a"].tolist() == [1, 2]
