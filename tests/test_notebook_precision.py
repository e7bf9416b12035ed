"""notebooks/mixed_precision_and_accumulation.ipynb, executed once in a real kernel: what its cells print."""

import re

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from notebooks import cell, execute  # noqa: E402

EVAL_SET_SIZE = 203  # not a multiple of 2 ranks x batch 32
K = 4  # gradient accumulation steps
MAX_NORM = 1.0
CHANCE = 0.25  # 4 classes
LAYER_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ROW = re.compile(
    r"^(fp32|bf16|fp16)\s+\| (\w+)\s+\|\s+([\d.]+) \|\s+([\d.]+) \|\s+(\d+) \|\s+(\d+) \|\s+[\d.]+$", re.M
)


def _text(executed, marker):
    return cell(executed, marker)[0]


@pytest.fixture(scope="module")
def executed():
    return execute("mixed_precision_and_accumulation.ipynb")


@pytest.fixture(scope="module")
def table(executed):
    """{precision: (layer dtype, final loss, accuracy, eval samples, steps per epoch)} of the runs that ran."""
    text = _text(executed, "{'precision':<9}")
    rows = {m[0]: (m[1], float(m[2]), float(m[3]), int(m[4]), int(m[5])) for m in ROW.findall(text)}
    refused = dict(re.findall(r"^(fp32|bf16|fp16)\s+\| refused: (.+)$", text, re.M))
    return rows, refused, text


@pytest.mark.timeout(240)
def test_each_precision_trained_or_was_refused_with_a_reason(table):
    rows, refused, text = table
    # fp32 and bf16 autocast run on any CPU torch supports; fp16 on CPU depends on the torch build.
    assert {"fp32", "bf16"} <= set(rows), text
    assert set(rows) | set(refused) == {"fp32", "bf16", "fp16"}, text
    for precision, reason in refused.items():
        assert f"mixed_precision='{precision}'" in reason, reason


@pytest.mark.timeout(240)
def test_autocast_really_ran_in_each_precision(table):
    rows, _, text = table
    for precision, (dtype, *_rest) in rows.items():
        assert dtype == LAYER_DTYPE[precision], text


@pytest.mark.timeout(240)
def test_accuracy_well_above_chance_over_the_exact_eval_set(table):
    rows, _, text = table
    for precision, (_, final_loss, accuracy, eval_samples, _steps) in rows.items():
        assert accuracy > CHANCE + 0.5, (precision, text)
        assert final_loss < 0.5, (precision, text)
        assert eval_samples == EVAL_SET_SIZE, (precision, text)


@pytest.mark.timeout(240)
def test_every_epoch_printed_by_rank_0_only(executed, table):
    rows, _, _ = table
    text = _text(executed, "for precision in (")
    epochs = re.findall(
        r"^\[rank (\d)\] epoch (\d): loss [\d.]+ \| 32 batches per rank, (\d+) optimizer steps$", text, re.M
    )
    assert epochs == [("0", str(e), str(32 // K)) for _ in rows for e in range(3)], text


@pytest.mark.timeout(240)
def test_optimizer_steps_once_every_k_batches(executed, table):
    rows, _, _ = table
    text = _text(executed, "expected = list(range(K")
    counts = re.findall(
        r"^(\w+): (\d+) batches per rank per epoch -> optimizer steps per epoch: \[([\d, ]+)\] \(k=(\d+)\)$",
        text,
        re.M,
    )
    assert [c[0] for c in counts] == list(rows), text
    for _, batches, steps, k in counts:
        assert int(k) == K
        assert [int(s) for s in steps.split(", ")] == [int(batches) // K] * 3, text
    stepped = re.findall(r"epoch 0 stepped after batches \[([\d, ]+)\]; both ranks alike: (\w+)$", text, re.M)
    assert len(stepped) == len(rows), text
    for batches, alike in stepped:
        assert [int(b) for b in batches.split(", ")] == list(range(K, 32 + 1, K)), text
        assert alike == "True"


@pytest.mark.timeout(240)
def test_accumulation_equals_a_k_times_larger_batch(executed):
    text = _text(executed, "large_batch = notebook_launcher")
    assert "k=4 x batch 16: [8, 8, 8] steps per epoch | k=1 x batch 64: [8, 8, 8] steps per epoch" in text, (
        text
    )
    difference = float(re.search(r"largest difference between the final weights: ([\d.e+-]+)", text)[1])
    assert difference < 1e-5, text


@pytest.mark.timeout(240)
def test_clipping_bounds_the_gradient_norm(executed, table):
    rows, _, _ = table
    text = _text(executed, "clipped = sum(")
    summaries = re.findall(
        r"^(\w+): (\d+) optimizer steps, (\d+) clipped; first steps: (.+)$\n"
        r"^\s+largest norm before clipping ([\d.]+), after clipping ([\d.]+) \(max_norm ([\d.]+)\)$\n"
        r"^\s+every step within max_norm: (\w+)$",
        text,
        re.M,
    )
    assert [s[0] for s in summaries] == list(rows), text
    for _, steps, clipped, first, before, after, max_norm, within in summaries:
        assert int(steps) == 3 * (32 // K)
        assert float(max_norm) == MAX_NORM
        assert int(clipped) >= 1 and float(before) > MAX_NORM, text  # clipping did something
        assert float(after) <= MAX_NORM + 1e-6 and within == "True", text
        pairs = [tuple(map(float, p.split(" -> "))) for p in first.split(", ")]
        assert all(a <= min(b, MAX_NORM) + 1e-3 for b, a in pairs), first


@pytest.mark.timeout(240)
def test_gather_for_metrics_counts_each_eval_sample_once(executed, table):
    rows, _, _ = table
    text = _text(executed, "per_step = 2 * 32")
    assert f"eval set: {EVAL_SET_SIZE} samples = 4 steps of 64, the last with 11 real samples" in text, text
    found = re.findall(
        r"^(\w+): accelerator.gather returned (\d+) predictions, gather_for_metrics (\d+): accuracy (\d+)/(\d+) = ([\d.]+)$",
        text,
        re.M,
    )
    assert [f[0] for f in found] == list(rows), text
    for precision, plain, exact, correct, total, accuracy in found:
        assert int(plain) == 4 * 64 > EVAL_SET_SIZE  # the padding repeats samples
        assert int(exact) == int(total) == EVAL_SET_SIZE
        assert abs(int(correct) / EVAL_SET_SIZE - float(accuracy)) < 1e-3
        assert float(accuracy) == rows[precision][2]


@pytest.mark.timeout(240)
def test_an_unsupported_precision_is_refused_with_the_reason(executed):
    text = _text(executed, 'args=("fp8",)')
    assert re.search(
        r"^LaunchFailedError: rank \d raised ValueError: mixed_precision='fp8' needs", text, re.M
    ), text
    assert "epoch 0" not in text  # refused before training
