"""The stall report without processes (launch/stall.py, launch/watch_probe.py): stacks as torch's
worker server dumps them, collectives as its flight recorder lists them, and the one sentence."""

from __future__ import annotations

import os

from notebook_accel.launch import stall, watch_probe

PKG = os.path.dirname(stall.__file__)
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
USER = "/home/me/train.py"

DUMP = f"""Current thread 0x00007f91324266c0 (most recent call first):
  <no Python frame>

Thread 0x00007f915545cb80 (most recent call first):
  File "{TORCH}", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{USER}", line 15 in step
  File "{USER}", line 30 in train
  File "{PKG}/child.py", line 106 in run_function
  File "{PKG}/child.py", line 99 in run
  File "{USER}", line 40 in <module>
"""


def collective(op, seq, shapes=((4,),), dtypes=("Float",), group="default"):
    return watch_probe.Collective(op, group, seq, shapes, dtypes)


def test_stacks_keep_python_threads_and_stop_at_the_launcher():
    threads = stall.frames_of(DUMP)
    assert len(threads) == 1  # the server's own thread has no Python frame
    frames = threads[0].frames
    # The launcher's frames and, below them, the parent's stack a forked rank inherited, are cut.
    assert [f.func for f in frames] == ["all_reduce", "wrapper", "step", "train"], frames
    assert [f.mine for f in frames] == [False, False, True, True]


def test_a_rank_s_stack_text_shows_its_own_frames_and_counts_the_library_s():
    where = stall.RankWhere(0, "waiting", (collective("all_reduce", 12),), threads=stall.frames_of(DUMP))
    text = where.stack_text()
    assert "... 2 library frames" in text and f"{USER}, line 15, in step" in text, text
    assert "c10d_logger" not in text and "run_function" not in text, text
    assert where.doing() == f"waits in all_reduce #12 (float32[4]) at {USER}, line 15, in step"


def test_notebook_files_are_named_as_the_cell_s_error_names_them():
    where = stall.RankWhere(1, "waiting", (collective("barrier", 12, (), ()),), threads=stall.frames_of(DUMP))

    def label(text):
        return text.replace(f'File "{USER}"', "Cell In[5]")

    assert where.doing(label) == "waits in barrier #12 at Cell In[5], line 15, in step"


def test_the_sentence_names_the_disagreement():
    threads = stall.frames_of(DUMP)
    ranks = [
        stall.RankWhere(1, "waiting", (collective("barrier", 12, (), ()),), threads=threads),
        stall.RankWhere(0, "waiting", (collective("all_reduce", 12),), threads=threads),
    ]
    report = stall.build(61.2, ranks)
    assert report.stalled
    assert report.sentence == (
        f"stalled for 61 s: rank 0 waits in all_reduce #12 (float32[4]) at {USER}, line 15, in step; "
        f"rank 1 waits in barrier #12 at {USER}, line 15, in step"
    ), report.sentence
    assert [r.rank for r in report.ranks] == [0, 1]


def test_a_peer_that_returned_is_said_so():
    ranks = [
        stall.RankWhere(0, "waiting", (collective("all_reduce", 13),), threads=stall.frames_of(DUMP)),
        stall.RankWhere(1, "returned"),
    ]
    sentence = stall.build(5, ranks).sentence
    assert sentence.startswith("stalled for 5 s: rank 0 waits in all_reduce #13 (float32[4])"), sentence
    assert sentence.endswith("; rank 1 returned from the function"), sentence


def test_ranks_in_the_same_place_are_named_together():
    same = (collective("all_reduce", 3),)
    ranks = [stall.RankWhere(r, "waiting", same) for r in (0, 2)] + [stall.RankWhere(1, "running")]
    sentence = stall.build(7, ranks).sentence
    assert sentence == "stalled for 7 s: ranks 0, 2 wait in all_reduce #3 (float32[4]); rank 1 is in no collective"


def test_no_rank_in_a_collective_is_no_progress_not_a_stall():
    ranks = [stall.RankWhere(0, "running", threads=stall.frames_of(DUMP)), stall.RankWhere(1, "unknown")]
    report = stall.build(60, ranks)
    assert not report.stalled
    assert report.sentence.startswith("no progress for 60 s: no rank is in a collective; rank 0 is in no collective"), (
        report.sentence
    )
    assert "rank 1 did not answer" in report.sentence


def test_ranks_still_starting_are_said_to_be_starting():
    """Before its function begins a rank has no worker server: "starting", never "did not answer"."""
    both = stall.build(61, [stall.RankWhere(0, "starting"), stall.RankWhere(1, "starting")])
    assert not both.stalled
    assert both.sentence == (
        "no progress for 61 s: ranks 0, 1 are still starting (not yet in the function: importing, or unpickling it)"
    ), both.sentence
    one = stall.build(61, [stall.RankWhere(0, "running", threads=stall.frames_of(DUMP)), stall.RankWhere(1, "starting")])
    assert one.sentence.startswith("no progress for 61 s: no rank is in a collective; rank 0 is in no collective")
    assert "rank 1 is still starting" in one.sentence, one.sentence


def test_the_flight_recorder_s_json_gives_the_waiting_collective_per_group():
    trace = {
        "pg_status": {"0": {"last_completed_collective": "4", "last_enqueued_collective": "5"},
                      "1": {"last_completed_collective": "2", "last_enqueued_collective": "2"}},
        "entries": [
            {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 4,
             "profiling_name": "gloo:all_reduce", "input_sizes": [[20]], "input_dtypes": ["Float"]},
            {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 5,
             "profiling_name": "gloo:broadcast", "input_sizes": [[2, 3]], "input_dtypes": ["BFloat16"]},
            {"pg_id": 1, "process_group": ["1", "undefined"], "collective_seq_id": 2,
             "profiling_name": "gloo:all_gather", "input_sizes": [[1]], "input_dtypes": ["Long"]},
        ],
    }  # fmt: skip
    found = watch_probe.parse_trace(trace)
    assert [c.describe() for c in found.waiting] == ["broadcast #5 (bfloat16[2, 3])"], found
    assert [c.describe() for c in found.last] == ["broadcast #5 (bfloat16[2, 3])", "all_gather #2 of group #1 (int64[1])"]
    assert found.issued == {"default": 5, "#1": 2}
