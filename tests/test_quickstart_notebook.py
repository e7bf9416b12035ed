"""The quickstart notebook, executed in a real kernel through the same code path as `make demo`."""

import ast
import re
import sys

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from notebook_accel.demo import main  # noqa: E402
from notebooks import cell as _cell  # noqa: E402
from notebooks import execute  # noqa: E402

EVAL_SET_SIZE = 250  # the notebook's eval set: not a multiple of 2 ranks x batch 32, so it is padded


def _summary(cell):
    result = next(o for o in cell.outputs if o.output_type == "execute_result")
    return ast.literal_eval(result.data["text/plain"])


@pytest.fixture(scope="module")
def executed():
    return execute("quickstart.ipynb", label="the quickstart")


@pytest.mark.timeout(180)
def test_kernel_runs_this_interpreter(executed):
    first, _ = _cell(executed, "kernel python")
    assert f"kernel python: {sys.executable}\n" in first
    assert "notebook process:" in first


@pytest.mark.timeout(180)
def test_plain_loop_runs_in_the_notebook_process(executed):
    text, cell = _cell(executed, "for epoch in range(2):")
    assert "Accelerator" not in cell.source
    assert re.findall(r"^epoch (\d+) loss [\d.]+$", text, re.M) == ["0", "1"], text


@pytest.mark.timeout(180)
def test_every_rank_reports_each_epoch(executed):
    launch, _ = _cell(executed, "notebook_launcher(train, args=(5,)")
    for rank in (0, 1):
        epochs = [int(m) for m in re.findall(rf"^\[rank {rank}\] epoch (\d+) loss [\d.]+$", launch, re.M)]
        assert epochs == [0, 1, 2, 3, 4], launch
    # accelerator.print: the main process only, and the metric covers exactly the eval set.
    evals = re.findall(r"^\[rank (\d)\] epoch (\d+) eval mse [\d.]+ over (\d+) samples$", launch, re.M)
    assert evals == [("0", str(epoch), str(EVAL_SET_SIZE)) for epoch in range(5)], launch


@pytest.mark.timeout(180)
def test_training_result(executed):
    text, cell = _cell(executed, "check(results)")
    summary = _summary(cell)
    assert summary["ranks"] == 2
    assert summary["mixed_precision"] == "no"
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["loss_decreased"] is True
    assert summary["weights_identical"] is True
    assert summary["eval_set_size"] == EVAL_SET_SIZE
    assert summary["eval_samples"] == EVAL_SET_SIZE
    assert len(re.findall(r"^rank \d loss per epoch: ", text, re.M)) == 2, text
    assert "weights identical across ranks: True" in text
    assert f"over [{EVAL_SET_SIZE}] samples (eval set: {EVAL_SET_SIZE})" in text


@pytest.mark.timeout(180)
def test_bf16_launch_trains(executed):
    text, cell = _cell(executed, '"bf16"')
    for rank in (0, 1):
        assert len(re.findall(rf"^\[rank {rank}\] epoch \d+ loss [\d.]+$", text, re.M)) == 5, text
    summary = _summary(cell)
    assert summary["ranks"] == 2
    assert summary["mixed_precision"] == "bf16"
    assert summary["loss_decreased"] is True
    assert summary["weights_identical"] is True
    assert summary["eval_samples"] == EVAL_SET_SIZE


@pytest.mark.timeout(180)
def test_demo_exits_nonzero_on_a_failing_cell(tmp_path, capsys):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    path = tmp_path / "broken.ipynb"
    cells = [
        new_code_cell("print('before')"),
        new_code_cell("raise ValueError('on purpose')"),
        new_code_cell("1"),
    ]
    nbformat.write(new_notebook(cells=cells), str(path))
    assert main([str(path), "--timeout", "60"]) == 1
    out, err = capsys.readouterr()
    assert "before" in out
    assert "FAILED in code cell 2" in err and "ValueError" in err and "on purpose" in err


@pytest.mark.timeout(180)
def test_loss_plot_is_drawn(executed):
    text, cell = _cell(executed, "plt.subplots")
    assert "plotted 20 points" in text
    assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.outputs
