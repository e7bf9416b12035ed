"""notebooks/checkpoint_and_resume.ipynb, executed once in a real kernel: what its cells print and draw."""

import re

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from notebooks import cell as _cell  # noqa: E402
from notebooks import execute  # noqa: E402

STEPS = 5 * 16  # 5 epochs of 16 batches per rank
FILES = [
    "custom_checkpoint_0.pkl", "dl_state_dict.bin", "dl_state_dict_rank1.bin", "model.safetensors",
    "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
]  # fmt: skip


def _folders(text, label):
    listed = re.search(rf"^{re.escape(label)}: \[(.*)\]$", text, re.M)
    assert listed, text
    return [name.strip("' ") for name in listed[1].split(",")]


def _checkpoints(n):
    return [f"checkpoint_{i}" for i in range(n)]


@pytest.fixture(scope="module")
def executed():
    return execute("checkpoint_and_resume.ipynb", leftovers_glob="checkpoint-demo-*")


@pytest.mark.timeout(240)
def test_reference_run_saves_a_checkpoint_per_epoch(executed):
    text, _ = _cell(executed, "reference = notebook_launcher")
    assert [
        int(e)
        for e in re.findall(r"^\[rank 0\] epoch (\d): last loss [\d.]+, saved checkpoint_\1$", text, re.M)
    ] == list(range(5)), text
    assert f"{STEPS} steps, final loss" in text
    assert _folders(text, "uninterrupted/checkpoints") == _checkpoints(5)


@pytest.mark.timeout(240)
def test_a_checkpoint_holds_every_piece(executed):
    text, _ = _cell(executed, "file.stat().st_size")
    assert re.findall(r"^  (\S+)\s+\d+ bytes$", text, re.M) == FILES, text


@pytest.mark.timeout(240)
def test_the_crash_is_caught_and_shown_with_its_traceback(executed):
    text, cell = _cell(executed, '(2, "end")')
    assert not any(o.output_type == "error" for o in cell.outputs)
    assert "LaunchFailedError: rank 1 raised RuntimeError: simulated crash after epoch 2" in text, text
    assert (
        "Traceback from rank 1:" in text
        and 'raise RuntimeError(f"simulated crash after epoch {epoch}")' in text
    )
    assert "saved checkpoint_3" not in text
    assert _folders(text, "interrupted/checkpoints after the crash") == _checkpoints(3)


@pytest.mark.timeout(240)
def test_resumed_run_matches_the_uninterrupted_one(executed):
    text, _ = _cell(executed, "def compare(")
    assert "[rank 0] resumed: 48 steps done, continuing at epoch 3 batch 1" in text, text
    assert re.findall(r"^\[rank 0\] epoch (\d): last loss [\d.]+, saved checkpoint_\1$", text, re.M) == [
        "3",
        "4",
    ], text
    assert _folders(text, "interrupted/checkpoints after resuming") == _checkpoints(5)
    _assert_identical(text, split=48)


@pytest.mark.timeout(240)
def test_mid_epoch_resume_matches_the_uninterrupted_one(executed):
    text, _ = _cell(executed, "mid_epoch = workdir")
    assert "[rank 0] epoch 3 batch 6: saved checkpoint_3 (mid-epoch)" in text, text
    assert "LaunchFailedError: rank 1 raised RuntimeError: simulated crash in epoch 3 after batch 9" in text
    assert _folders(text, "mid_epoch/checkpoints after the crash") == _checkpoints(4)
    # load_state brought the loader back to epoch 3; skip_first_batches skipped the 6 done batches
    assert "continuing at epoch 3 batch 7 (the loader is back in epoch 3)" in text, text
    assert _folders(text, "mid_epoch/checkpoints after resuming") == _checkpoints(6)
    _assert_identical(text, split=54)


def _assert_identical(text, split):
    assert f"steps: {STEPS} resumed vs {STEPS} uninterrupted; resumed after step {split}" in text, text
    differences = re.findall(r"^max abs difference, (.+): ([\d.e+-]+)$", text, re.M)
    assert [what for what, _ in differences] == [
        f"steps 1-{split} (restored from the checkpoint)",
        f"steps {split + 1}-{STEPS} (trained after resuming)",
        "final weights",
    ], text
    assert all(float(value) <= 1e-6 for _, value in differences), text


@pytest.mark.timeout(240)
def test_both_curves_are_plotted(executed):
    text, cell = _cell(executed, "plt.subplots")
    assert f"plotted {3 * STEPS} points" in text
    assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.outputs


@pytest.mark.timeout(240)
def test_the_working_folder_is_removed(executed):
    text, _ = _cell(executed, "shutil.rmtree(workdir)")
    assert re.fullmatch(r"removed checkpoint-demo-\S+: True\n", text), text
