"""notebooks/multi_node_on_one_machine.ipynb, executed once in a real kernel: two nodes on localhost."""

import re
import time

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
psutil = pytest.importorskip("psutil")

# Alone: beside a parallel test process, node 0 (the notebook) finished so far ahead that node 1's torch
# elastic agent logged a traceback from its exit barrier (the store had gone), which test_both_nodes_exit_zero
# rightly refuses to see.
pytestmark = pytest.mark.alone

from notebooks import cell, execute  # noqa: E402

RANK_LINE = re.compile(
    r"^\[rank (\d)\] global rank (\d) of (\d) on node (\d) \(local rank (\d)\): all_reduce of rank\+1 = (\d+)$",
    re.M,
)


def _text(executed, marker):
    return cell(executed, marker)[0]


def _demo_processes():
    """Processes that carry the notebook's node-1 marker (its launcher, forkserver, ranks)."""
    found = []
    for p in psutil.process_iter():
        try:
            if "MULTI_NODE_DEMO" in p.environ():
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def executed():
    return execute("multi_node_on_one_machine.ipynb", leftovers_glob="multi-node-demo-*")


def _rank_lines(text):
    return {int(m[1]): m for m in RANK_LINE.findall(text)}


@pytest.mark.timeout(240)
def test_each_node_runs_its_own_global_ranks(executed):
    node0 = _rank_lines(_text(executed, "node_rank=0"))
    node1 = _rank_lines(_text(executed, "node1_log.read_text()"))
    assert sorted(node0) == [0, 1] and sorted(node1) == [2, 3], (node0, node1)
    for rank, (prefix, _, world, node, local, _sum) in {**node0, **node1}.items():
        assert int(prefix) == rank  # output lines carry the global rank
        assert (int(world), int(node), int(local)) == (4, rank // 2, rank % 2)


@pytest.mark.timeout(240)
def test_all_reduce_sums_over_four_ranks(executed):
    lines = {
        **_rank_lines(_text(executed, "node_rank=0")),
        **_rank_lines(_text(executed, "node1_log.read_text()")),
    }
    assert sorted(lines) == [0, 1, 2, 3]
    assert {int(m[5]) for m in lines.values()} == {1 + 2 + 3 + 4}
    text = _text(executed, "expected_sum =")
    assert "global ranks: [0, 1, 2, 3]" in text, text
    assert "all_reduce sum on every rank == 10: True" in text
    assert "weights identical on all ranks: True" in text
    assert (
        len(
            re.findall(
                r"^rank (\d) on node \d: world 4, all_reduce sum 10, 128 samples per epoch$", text, re.M
            )
        )
        == 4
    )


@pytest.mark.timeout(240)
def test_both_nodes_exit_zero(executed):
    text = _text(executed, "node_rank=0")
    assert "node 0 (this notebook) returned results for ranks [0, 1]" in text, text
    assert "node 1 exited with code 0" in text
    node1 = _text(executed, "node1_log.read_text()")
    assert [int(r) for r in re.findall(r'^RESULT \{"rank": (\d)', node1, re.M)] == [2, 3], node1
    assert "Traceback" not in node1


@pytest.mark.timeout(240)
def test_no_process_left_behind(executed):
    text = _text(executed, "def node1_processes")
    assert "node 1 processes still running: 0" in text, text
    assert re.search(r"rank processes still running under them: 0$", text, re.M), text
    # And seen from outside, after the kernel has shut down: nothing carries node 1's marker.
    deadline = time.monotonic() + 10
    while _demo_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _demo_processes() == []


@pytest.mark.timeout(240)
def test_the_working_folder_is_removed(executed):
    text = _text(executed, "shutil.rmtree(workdir)")
    assert re.fullmatch(r"removed multi-node-demo-\S+: True\n", text), text
