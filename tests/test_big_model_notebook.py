"""notebooks/big_model_offload.ipynb, executed in a real kernel; the checks read what it printed."""

import ast
import re

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from notebooks import execute  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def executed():
    pairs = execute("big_model_offload.ipynb", timeout=180, label="the big-model notebook")
    return [c for _, c in pairs], "".join(text for text, _ in pairs)


def _number(pattern, text):
    match = re.search(pattern, text, re.M)
    assert match, f"no match for {pattern!r} in:\n{text}"
    return float(match.group(1))


def test_install_cell_is_silent_when_the_package_is_there(executed):
    cells, _ = executed
    assert "%pip install" in cells[0].source
    assert cells[0].outputs == []


def test_empty_model_takes_no_memory(executed):
    _, text = executed
    assert re.search(r"^one block: [\d.]+ MB; parameters on meta$", text, re.M), text
    assert _number(r"^init_empty_weights took \d+ ms and ([\d.]+) MB$", text) < 5


def test_device_map_puts_blocks_on_cpu_and_on_disk(executed):
    _, text = executed
    device_map = dict(re.findall(r"^  (\S+)\s+-> (\S+)$", text, re.M))
    assert set(device_map.values()) == {"cpu", "disk"}, text
    assert device_map["blocks.0"] == "cpu" and device_map["blocks.15"] == "disk", device_map
    # From the first block on disk, every later block is on disk too: filled in order.
    devices = [device_map[f"blocks.{i}"] for i in range(16)]
    assert devices == sorted(devices), devices


def test_disk_blocks_are_read_from_the_checkpoint_not_copied(executed):
    _, text = executed
    assert re.search(r"^loaded in [\d.]+s; offload folder: \['index.json'\], \d+ kB$", text, re.M), text


def test_output_matches_the_block_by_block_reference(executed):
    _, text = executed
    diff = _number(r"^max abs diff vs the block-by-block reference: (\S+)$", text)
    assert diff < 1e-5


def test_peak_memory_stays_well_below_the_model(executed):
    cells, text = executed
    model_mb = _number(r"^model size:\s+(\d+) MB", text)
    budget_mb = _number(r"^CPU budget:\s+(\d+)MB$", text)
    assert model_mb > 3 * budget_mb  # several times larger than its budget
    peak_mb = _number(r"^peak anonymous memory:\s+(\d+) MB above the baseline during load and forward", text)
    assert peak_mb < 0.6 * model_mb, text
    assert peak_mb < budget_mb + 2 * _number(r"^one block: ([\d.]+) MB", text)
    # Writing the checkpoint block by block never held the model either.
    assert _number(r"^peak anonymous memory while writing: (\d+) MB", text) < 0.6 * model_mb

    result = next(o for o in cells[-1].outputs if o.output_type == "execute_result")
    summary = ast.literal_eval(result.data["text/plain"])
    assert summary["blocks_on_cpu"] > 0 and summary["blocks_on_disk"] > 0
    assert summary["peak_over_model"] < 0.6
    assert summary["max_abs_diff"] < 1e-5


def test_memory_plot_is_an_inline_png(executed):
    cells, _ = executed
    images = [o for c in cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
