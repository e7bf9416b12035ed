"""notebooks/cell_magic.ipynb, executed once in a real kernel; the checks read what its cells printed."""

import re

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from notebook_accel.demo import cell_texts  # noqa: E402
from notebooks import execute  # noqa: E402

SHARD_NAMES = "['DataLoader', 'ShardStats', 'train_set']"  # what the spawn cell reads from the notebook

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def executed():
    return [c for _, c in execute("cell_magic.ipynb", label="the cell-magic notebook")]


def _cell(cells, marker):
    """The first code cell whose source contains `marker`, and the text it showed."""
    cell = next((c for c in cells if marker in c.source), None)
    assert cell is not None, f"no cell contains {marker!r}"
    return cell, "".join(cell_texts(cell))


def _error(cell):
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert len(errors) == 1, cell.outputs
    return errors[0]


def _floats(text):
    return [float(v) for v in re.findall(r"-?\d+\.\d+", text)]


def test_hardware_and_config_line_magics(executed):
    import torch

    _, hardware = _cell(executed, "%accelerate hardware")
    assert hardware.startswith("Hardware report\n"), hardware
    assert re.search(rf"^  torch\s+{re.escape(torch.__version__)}$", hardware, re.M), hardware
    assert re.search(r"^  Cores\s+\d+ physical, \d+ logical$", hardware, re.M), hardware
    _, config = _cell(executed, "%accelerate config")
    # conftest points NOTEBOOK_ACCEL_CONFIG_FILE at a missing file, and the kernel inherits it.
    assert "No config file at " in config and "no-such-config.yaml" in config, config


def test_training_cell_runs_on_two_ranks(executed):
    cell, text = _cell(executed, "--out losses,weights")
    assert cell.source.startswith("%%accelerate -n 2 --port auto --out losses,weights\n")
    assert "accelerator.backward(loss)" in cell.source and "accelerator.prepare(" in cell.source
    for rank in (0, 1):
        epochs = re.findall(rf"^\[rank {rank}\] epoch (\d): loss [\d.]+ over (\d+) samples$", text, re.M)
        # Each rank trains on its own half of the 1024 samples.
        assert epochs == [(str(e), "512") for e in range(5)], text
    # accelerator.print: rank 0 only.
    assert re.findall(r"^\[rank (\d)\] trained on 2 processes \(MULTI_\w+\)$", text, re.M) == ["0"], text


def test_out_brings_the_losses_and_weights_back(executed):
    _, launch = _cell(executed, "--out losses,weights")
    rank0 = [float(v) for v in re.findall(r"^\[rank 0\] epoch \d: loss ([\d.]+)", launch, re.M)]
    _, text = _cell(executed, 'print("rank 0 loss per epoch:"')
    line = re.search(r"^rank 0 loss per epoch: (\[.*\])$", text, re.M)
    assert line, text
    # The notebook's `losses` is rank 0's list from the cell that ran on the ranks.
    assert _floats(line.group(1)) == pytest.approx(rank0, abs=1e-4)
    assert rank0[-1] < rank0[0] / 4, rank0
    assert "loss went down: True" in text
    assert "returned weights: net.0.weight, net.0.bias, net.2.weight, net.2.bias\n" in text
    before = float(re.search(r"^eval mse with the starting weights: ([\d.]+)$", text, re.M).group(1))
    after = float(re.search(r"^eval mse with the returned weights: ([\d.]+)$", text, re.M).group(1))
    assert after < before / 4, text  # the returned weights are the trained ones


def test_spawn_cell_uses_a_class_from_an_earlier_cell(executed):
    definition, _ = _cell(executed, "class ShardStats")
    assert "%%accelerate" not in definition.source
    cell, text = _cell(executed, "--start-method spawn")
    counts = {}
    for rank in (0, 1):
        m = re.search(rf"^\[rank {rank}\] received (\[.*\]); ShardStats\(count=(\d+), mean=", text, re.M)
        assert m, text
        # Only the names the cell reads travel: not `losses`, `In`, or anything else of the notebook.
        assert m.group(1) == SHARD_NAMES
        counts[rank] = int(m.group(2))
    assert counts == {0: 512, 1: 512}
    _, back = _cell(executed, 'spawn_report["received"]')
    assert f"names rank 0 received: {SHARD_NAMES}\n" in back
    assert re.search(r"^rank 0 used ShardStats -> ShardStats\(count=512, mean=[-+][\d.]+\)$", back, re.M), (
        back
    )


def test_bf16_cell_computes_in_bf16_and_trains(executed):
    cell, text = _cell(executed, "--mixed-precision bf16")
    assert "--out bf16_losses,bf16_dtypes" in cell.source.splitlines()[0]
    assert re.findall(r"^\[rank (\d)\] epoch (\d): loss [\d.]+$", text, re.M) == [
        ("0", str(e)) for e in range(5)
    ]
    _, back = _cell(executed, "bf16_dtypes.items()")
    assert "mixed_precision: bf16\n" in back
    assert "first layer computed in: ['torch.bfloat16']\n" in back
    assert "model output: torch.float32\n" in back  # autocast hands fp32 outputs back
    assert "weights: torch.float32\n" in back
    assert "bf16 loss went down: True" in back
    losses = _floats(re.search(r"^bf16 loss per epoch: (\[.*\])$", back, re.M).group(1))
    assert len(losses) == 5 and losses[-1] < losses[0] / 4, losses


def test_timeout_stops_the_cell_after_five_seconds(executed):
    cell, text = _cell(executed, "--timeout 5")
    assert "raises-exception" in cell.metadata.get("tags", [])
    error = _error(cell)
    assert error.ename == "CellTimeoutError"
    assert "timed out after 5 s" in error.evalue and "every rank was stopped" in error.evalue
    steps = [int(s) for s in re.findall(r"^\[rank 0\] step (\d+) at [\d.]+ s$", text, re.M)]
    assert steps and steps == list(range(len(steps))), text
    assert steps[-1] < 10, f"the cell ran on past its timeout (it has 60 steps): {steps}"
    _, after = _cell(executed, "gave the kernel back after")
    seconds = float(re.search(r"gave the kernel back after ([\d.]+) s", after).group(1))
    assert 5 <= seconds < 20, after


def test_failing_rank_shows_the_rank_its_message_and_the_cell_line(executed):
    cell, _ = _cell(executed, 'shard[3, 0] = float("nan")')
    assert "raises-exception" in cell.metadata.get("tags", [])
    error = _error(cell)
    assert error.ename == "CellFailedError"
    assert error.evalue.startswith("rank 1 raised ValueError: rank 1: samples [3] of my shard contain NaN\n")
    assert "Traceback from rank 1:" in error.evalue
    # The rank's frame is labelled like IPython's own, with the cell's source line under it.
    assert re.search(r"^  Cell In\[\d+\], line 10, in <module>$", error.evalue, re.M), error.evalue
    assert (
        'raise ValueError(f"rank {state.process_index}: samples {bad} of my shard contain NaN")'
        in error.evalue
    )
    assert "rank 0 raised" not in error.evalue  # rank 0 did not fail, it was only stopped


def test_failing_cell_label_is_the_cells_own_prompt_number(executed):
    cell, _ = _cell(executed, 'shard[3, 0] = float("nan")')
    assert f"Cell In[{cell.execution_count}], line 10" in _error(cell).evalue


def test_kernel_goes_on_after_the_timeout_and_the_failure(executed):
    failing, _ = _cell(executed, 'shard[3, 0] = float("nan")')
    check, text = _cell(executed, "processes left by the launches")
    _, back = _cell(executed, 'print("rank 0 loss per epoch:"')
    kept = re.search(r"^losses from the first run are still here: (\[.*\])$", text, re.M)
    assert kept and _floats(kept.group(1)) == _floats(re.search(r"per epoch: (\[.*\])", back).group(1))
    assert "processes left by the launches: []\n" in text
    last, ready = _cell(executed, 'print(f"rank {state.process_index} of {state.num_processes}: ready")')
    assert failing.execution_count < check.execution_count < last.execution_count
    assert sorted(re.findall(r"^\[rank (\d)\] rank \1 of 2: ready$", ready, re.M)) == ["0", "1"], ready


def test_only_the_tagged_cells_raised_and_every_cell_ran(executed):
    for cell in executed:
        assert cell.execution_count is not None, cell.source
        raised = any(o.output_type == "error" for o in cell.outputs)
        assert raised == ("raises-exception" in cell.metadata.get("tags", [])), cell.source
