"""%%accelerate and %accelerate in a real kernel (nbclient), with the console sink so the ranks'
text lands in the cell's output. One notebook, run once; each test reads its own cells. First, with
no kernel: how each %%accelerate option becomes a notebook_launcher argument."""

from __future__ import annotations

import inspect
import os
import re
import sys
from types import SimpleNamespace

import nbformat
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShellABC
from nbclient import NotebookClient

import notebook_accel
from notebook_accel.jupyter import cell_jobs
from notebook_accel.jupyter.magics import AccelerateMagics
from notebook_accel.launch import launcher, make_plan


class _Shell(InteractiveShellABC):
    """Just what %%accelerate reads from IPython's shell. A real InteractiveShell would become
    get_ipython() for every later test in this process."""

    def __init__(self):
        self.user_ns = {"offset": 10, "__builtins__": __builtins__}
        self.execution_count = 7
        self.compile = SimpleNamespace(cache=lambda source, number: f"<accelerate-cell-{number}>")


@pytest.fixture
def magic(monkeypatch):
    """magic(line) runs `%%accelerate <line>` on a one-line cell with notebook_launcher replaced and
    returns the recorded calls, each (function, args, kwargs), checked against the real signature;
    magic.shell is the shell. The stand-in makes the launch plan, as notebook_launcher does first,
    but never starts a process."""
    shell, calls = _Shell(), []
    signature = inspect.signature(launcher.notebook_launcher)

    def fake_launcher(function, args=(), **kwargs):
        signature.bind(function, args, **kwargs)  # a keyword notebook_launcher lacks: TypeError
        calls.append((function, args, kwargs))
        if kwargs.get("use_port") != "auto" and kwargs.get("engine") != "ray":  # the plan would check the port
            kwargs = {**kwargs, "use_port": "auto"}
        make_plan(**{k: v for k, v in kwargs.items() if k != "timeout"})
        return [{name: f"{name} from rank 0" for name in function.out}, None]

    monkeypatch.setattr("notebook_accel.launch.notebook_launcher", fake_launcher)
    magics = AccelerateMagics(shell=shell)

    def run(line: str, cell: str = "y = offset + 1"):
        magics.accelerate(line, cell)
        return calls

    run.shell = shell
    return run


FORK_DEFAULTS = {"num_processes": None, "timeout": None}  # no start_method: notebook_launcher's fork


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "line, expected, travels",
    [
        ("", {}, False),  # no -n: the launcher's num_processes=None decides
        ("-n 3", {"num_processes": 3}, False),
        ("--num-processes 2", {"num_processes": 2}, False),
        ("-n 2 --num-nodes 2", {"num_processes": 2, "num_nodes": 2}, True),
        ("--num-nodes 2 --node-rank 1", {"num_nodes": 2, "node_rank": 1}, True),
        ("--node-rank 0", {"node_rank": 0}, False),
        (
            "--num-nodes 2 --rdzv-endpoint 10.1.2.3:29400",
            {"num_nodes": 2, "rdzv_endpoint": "10.1.2.3:29400"},
            True,
        ),
        ("--max-restarts 1", {"max_restarts": 1}, True),
        ("--max-restarts 0", {"max_restarts": 0}, False),
        ("--start-method fork", {"start_method": "fork"}, False),
        ("--engine ray -n 4", {"engine": "ray", "num_processes": 4}, True),
        (
            "-n 2 --engine ray --ray-address ray://head:10001 --placement strict_spread "
            "--resources-per-rank '{\"CPU\": 2}'",
            {"num_processes": 2, "engine": "ray", "ray_address": "ray://head:10001", "placement": "strict_spread",
             "resources_per_rank": {"CPU": 2}},
            True,
        ),
        ("--start-method spawn", {"start_method": "spawn"}, True),
        ("--start-method forkserver", {"start_method": "forkserver"}, True),
        ("--mixed-precision bf16", {"mixed_precision": "bf16"}, False),
        ("--mixed-precision fp16", {"mixed_precision": "fp16"}, False),
        ("--mixed-precision no", {"mixed_precision": "no"}, False),
        ("--cpu", {"cpu": True}, False),
        ("--fsdp", {"fsdp": True}, False),
        ("-n 2 --fsdp --start-method spawn", {"num_processes": 2, "fsdp": True, "start_method": "spawn"}, True),
        ("--port auto", {"use_port": "auto"}, False),
        ("--port 29512", {"use_port": "29512"}, False),
        ("--timeout 2.5", {"timeout": 2.5}, False),
        ("--timeout 30", {"timeout": 30.0}, False),
        ("--stall-after 0", {"stall_after": 0.0}, False),  # 0: the stall watch off
        ("--stall-after 2.5", {"stall_after": 2.5}, False),
        ("--out model,losses", {}, False),  # not a launcher argument: the job returns them
        ("--pdb", {"pdb": True}, False),
        (
            "-n 2 --start-method spawn --mixed-precision bf16 --cpu --port auto --timeout 9 --max-restarts 2",
            {
                "num_processes": 2,
                "start_method": "spawn",
                "mixed_precision": "bf16",
                "cpu": True,
                "use_port": "auto",
                "timeout": 9.0,
                "max_restarts": 2,
            },
            True,
        ),
    ],
)
def test_each_option_becomes_its_launcher_argument(magic, line, expected, travels):
    calls = magic(line)
    assert len(calls) == 1, calls
    job, args, kwargs = calls[0]
    assert kwargs == {**FORK_DEFAULTS, **expected}  # and nothing the cell did not set
    assert isinstance(job, cell_jobs.CellJob) and job.source == "y = offset + 1"
    assert job.filename == "<accelerate-cell-7>"
    if travels:  # pickled to the ranks: only the names the cell reads
        assert args == () and job.namespace == {"offset": 10}
    else:  # forked ranks run the cell in (their copy of) the notebook's own namespace
        assert args == (magic.shell.user_ns,) and job.namespace is None
    out = tuple(re.search(r"--out (\S+)", line).group(1).split(",")) if "--out" in line else ()
    assert job.out == out
    for name in out:  # rank 0's values land in the notebook
        assert magic.shell.user_ns[name] == f"{name} from rank 0"


@pytest.mark.timeout(30)
def test_no_n_keeps_the_launchers_own_default():
    assert inspect.signature(launcher.notebook_launcher).parameters["num_processes"].default is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "line, named",
    [
        ("-n 0", "must be >= 1, got '0'"),
        ("-n -2", "must be >= 1, got '-2'"),
        ("-n abc", "must be a whole number, got 'abc'"),
        ("-n 1.5", "must be a whole number, got '1.5'"),
        ("--num-nodes 0", "--num-nodes: must be >= 1, got '0'"),
        ("--node-rank first", "--node-rank: must be a whole number, got 'first'"),
        ("--max-restarts many", "--max-restarts: must be a whole number, got 'many'"),
        ("--start-method nope", "--start-method: invalid choice: 'nope'"),
        ("--mixed-precision fp12", "--mixed-precision: invalid choice: 'fp12'"),
        ("--timeout 0", "--timeout: must be a number of seconds > 0, got '0'"),
        ("--timeout soon", "--timeout: must be a number of seconds > 0, got 'soon'"),
        ("--stall-after 1m", "--stall-after: '1m' is not a number: write a number of seconds, 0 to turn"),
        ("--stall-after -1", "--stall-after: '-1' is negative: write a number of seconds"),
        ("--out 1x,y", "--out: must be comma-separated variable names, got '1x,y'"),
        ("--ranks 0", "--ranks needs a running session"),
        ("-n 2 --bogus", "unrecognized arguments: --bogus"),
        # Let through by the parser, refused by the launch plan before any process starts:
        ("--node-rank -1", "node_rank=-1 must be in 0..0"),
        ("--num-nodes 2 --node-rank 2", "node_rank=2 must be in 0..1"),
        ("--max-restarts -1", "max_restarts=-1 must be 0 or more"),
        ("--port abc", "use_port='abc' must be a port number or 'auto'"),
        ("--port 70000", "use_port=70000 is outside 1..65535"),
    ],
)
def test_bad_option_values_are_named_in_a_usage_error(magic, monkeypatch, line, named):
    # The plan must refuse these with the port as given; no launch may follow.
    def refuse(function, args=(), **kwargs):
        make_plan(**{k: v for k, v in kwargs.items() if k != "timeout"})
        raise AssertionError(f"{line!r} would have launched with {kwargs}")

    monkeypatch.setattr("notebook_accel.launch.notebook_launcher", refuse)
    with pytest.raises(UsageError) as caught:
        magic(line)
    message = str(caught.value)
    assert message.startswith("%%accelerate: ") and named in message, message


CELLS = {
    "setup": "%load_ext notebook_accel\nimport os, threading\noffset = 10\n"
    "class Scale:\n    def __init__(self, k):\n        self.k = k\n\n    def apply(self, x):\n        return self.k * x",
    "hello": '%%accelerate -n 2 --port auto\nr = int(os.environ["RANK"])\nprint("hello", r, offset)\nprint("a", 1)',
    "out": "%%accelerate -n 2 --port auto --out losses,world\nimport torch.distributed as dist\n"
    "losses = [1.0, 0.5 * (dist.get_rank() + 1)]\nworld = dist.get_world_size()",
    "use_out": 'print("LOSSES", losses, world)',
    "fail": '%%accelerate -n 2 --port auto\nimport time\nif int(os.environ["RANK"]) == 1:\n'
    '    raise ValueError("bad on rank 1")\ntime.sleep(20)\nopen(f"late-{os.environ[\'RANK\']}", "w").close()',
    "after_fail": 'print("still alive")',
    "spawn": "%%accelerate -n 2 --start-method spawn --port auto --out result\n"
    'result = Scale(3).apply(int(os.environ["RANK"]) + 1)',
    "use_spawn": 'print("RESULT", result)',
    "fsdp": "%%accelerate -n 2 --port auto --fsdp\nimport torch\nfrom notebook_accel import Accelerator\n"
    "acc = Accelerator()\nm = acc.prepare(torch.nn.Linear(4, 4))\n"
    "print('FSDP', acc.process_index, acc.distributed_type, type(m).__name__, tuple(m.weight.to_local().shape))",
    "no_fsdp": "%%accelerate -n 2 --port auto\nfrom notebook_accel import Accelerator\n"
    "print('PLAIN', Accelerator().distributed_type)",
    "define": "def twice(x):\n    return 2 * x",
    # --max-restarts runs the elastic engine: the names the cell reads travel pickled, although the
    # start method is fork (`threading`, imported in "setup" but not read here, stays behind).
    "elastic": "%%accelerate -n 2 --port auto --max-restarts 1 --out elastic_result\nr = int(os.environ['RANK'])\n"
    "print('ELASTIC', r, Scale(5).apply(r + 1), twice(offset), os.environ.get('TORCHELASTIC_MAX_RESTARTS'),"
    " 'threading' in globals())\nelastic_result = twice(r + 100)",
    "use_elastic": 'print("ELASTIC_OUT", elastic_result)',
    "lock": "lock = threading.Lock()",
    "unpicklable": "%%accelerate -n 2 --start-method spawn --port auto\nprint(lock)",
    "bad_n": "%%accelerate -n zero\npass",
    "missing_out": "%%accelerate -n 2 --port auto --out nowhere\nx = 1",
    "timeout": "%%accelerate -n 2 --port auto --timeout 2\nimport time\ntime.sleep(30)",
    "config": "%accelerate config",
    "env": "%accelerate env",
    "hardware": "%accelerate hardware",
    "bad_line": "%accelerate fly",
    # The elastic cell started multiprocessing's forkserver and resource tracker, and importing
    # notebook_accel our own forkserver: all stay up for later launches by design (as in
    # test_launcher_elastic.py). Any other child is a rank left behind.
    "alive": "import psutil\nfrom multiprocessing import forkserver, resource_tracker\n"
    "from notebook_accel.launch.warm import WarmServer\n"
    "helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid,\n"
    "           WarmServer._instance and WarmServer._instance.proc.pid}\n"
    "left = [p for p in psutil.Process().children(recursive=True) if p.pid not in helpers]\n"
    'print("ALIVE", len(left), "HELPERS", len(helpers - {None}), [p.cmdline() for p in left])',
    "unload": "%unload_ext notebook_accel",
    "after_unload": "%accelerate config",
}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    folder = tmp_path_factory.mktemp("magics")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS.values()])
    env = {**os.environ, "NOTEBOOK_ACCEL_WIDGETS": "0", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,
        allow_errors=True,
        resources={"metadata": {"path": str(folder)}},
    )
    client.kernel_manager_class = __import__("notebook_accel.demo", fromlist=["x"])._kernel_manager_class()
    client.execute(env=env)
    out = dict(zip(CELLS, nb.cells))
    out["_folder"] = folder
    return out


def _text(cell, stream=None) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and stream in (None, o.name))


def _error(cell):
    errors = [o for o in cell.outputs if o.output_type == "error"]
    return errors[0] if errors else None


@pytest.mark.timeout(400)
def test_fsdp_option_shards_that_cells_models_only(cells):
    assert _error(cells["fsdp"]) is None, cells["fsdp"].outputs
    text = _text(cells["fsdp"])
    # torch's FSDP2 class for a fully_shard-ed Linear; each rank holds half of the 4 x 4 weight.
    assert "[rank 0] FSDP 0 FSDP FSDPLinear (2, 4)" in text and "[rank 1] FSDP 1 FSDP FSDPLinear (2, 4)" in text, text
    plain = _text(cells["no_fsdp"])
    assert "[rank 0] PLAIN MULTI_CPU" in plain and "[rank 1] PLAIN MULTI_CPU" in plain, plain


@pytest.mark.timeout(400)  # the whole notebook runs in its set-up
def test_cell_runs_on_two_ranks_with_the_notebook_globals(cells):
    assert _error(cells["setup"]) is None and _error(cells["hello"]) is None, cells["hello"].outputs
    text = _text(cells["hello"])
    assert "[rank 0] hello 0 10" in text and "[rank 1] hello 1 10" in text
    assert "[rank 0] a 1" in text  # print's separator survives


def test_out_brings_rank_zero_values_into_the_notebook(cells):
    assert _error(cells["out"]) is None, cells["out"].outputs
    assert "LOSSES [1.0, 0.5] 2" in _text(cells["use_out"])


def test_failing_rank_fails_the_cell_with_its_cell_line_and_the_kernel_goes_on(cells):
    error = _error(cells["fail"])
    assert error is not None and error.ename == "CellFailedError"
    assert "rank 1 raised ValueError: bad on rank 1" in error.evalue
    assert "Cell In[" in error.evalue and 'raise ValueError("bad on rank 1")' in error.evalue
    assert "cell_jobs.py" not in error.evalue and "child.py" not in error.evalue  # no launcher frames
    assert "still alive" in _text(cells["after_fail"])
    assert not list(cells["_folder"].glob("late-*"))  # rank 0 was stopped, not left to finish


def test_spawn_cell_uses_a_class_from_an_earlier_cell(cells):
    assert _error(cells["spawn"]) is None, cells["spawn"].outputs
    assert "RESULT 3" in _text(cells["use_spawn"])


@pytest.mark.timeout(400)  # the whole notebook runs here when this test runs alone
def test_elastic_cell_uses_a_class_and_a_function_from_earlier_cells(cells):
    assert _error(cells["define"]) is None and _error(cells["elastic"]) is None, cells["elastic"].outputs
    text = _text(cells["elastic"])
    # rank, Scale(5).apply(rank + 1), twice(offset), the engine's restart budget, notebook globals seen
    for rank in (0, 1):
        assert f"[rank {rank}] ELASTIC {rank} {5 * (rank + 1)} 20 1 False" in text, text
    assert "ELASTIC_OUT 200" in _text(cells["use_elastic"])


def test_unpicklable_global_is_named_before_anything_starts(cells):
    error = _error(cells["unpicklable"])
    assert error is not None and error.ename == "CellUnpicklableError"
    assert "'lock'" in error.evalue and "--start-method fork" in error.evalue
    assert "[rank" not in _text(cells["unpicklable"])


def test_bad_arguments_and_commands_get_usage_errors(cells):
    assert "must be a whole number, got 'zero'" in _text(cells["bad_n"], "stderr")
    assert "expected one of hardware, env, config, start, stop, restart, status, push, pull, auto, debug, got 'fly'" in _text(cells["bad_line"], "stderr")
    error = _error(cells["missing_out"])
    assert error is not None and "--out names 'nowhere'" in error.evalue


def test_timeout_stops_the_ranks_and_fails_the_cell(cells):
    error = _error(cells["timeout"])
    assert error is not None and error.ename == "CellTimeoutError"
    assert "timed out after 2 s" in error.evalue


def test_line_magic_shows_config_and_hardware(cells):
    assert "No config file at" in _text(cells["config"])
    text = _text(cells["hardware"])
    assert "Hardware report" in text and "Environment" in text and sys.version.split()[0] in text


@pytest.mark.timeout(400)  # the whole notebook runs here when this test runs alone
def test_line_magic_env_shows_the_torch_and_notebook_accel_versions(cells):
    import torch

    assert _error(cells["env"]) is None, cells["env"].outputs
    text = _text(cells["env"])
    assert re.search(rf"^\s*torch\s+{re.escape(torch.__version__)}$", text, re.M), text
    assert re.search(rf"^\s*notebook_accel\s+{re.escape(notebook_accel.__version__)}$", text, re.M), text
    assert "Config: none" in text  # the tests point the config at a missing file


def test_no_rank_outlives_its_cell(cells):
    assert "ALIVE 0 HELPERS" in _text(cells["alive"]), _text(cells["alive"])


def test_unload_removes_the_magics(cells):
    assert _error(cells["unload"]) is None
    assert "No config file" not in _text(cells["after_unload"])
    assert "Line magic function `%accelerate` not found" in _text(cells["after_unload"], "stderr")
