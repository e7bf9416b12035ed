"""The warm forkserver started early (issue #19, part 2): in a kernel, importing notebook_accel (or
`%load_ext notebook_accel`) starts it in the background; a launch that comes while it boots waits
for that one server; NOTEBOOK_ACCEL_PREWARM=0 turns it off; it goes with its kernel. Real
processes and real kernels (jupyter_client) throughout."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from kernels import alive, kernel_children, run
from launch_targets import where_this_rank_runs

from notebook_accel.launch import notebook_launcher, prewarm
from notebook_accel.launch.channel import recv_frame
from notebook_accel.launch.warm import WarmServer

SERVER = "notebook_accel.launch.warm"
TESTS = os.path.dirname(__file__)


@pytest.fixture(autouse=True)
def prewarm_as_by_default(monkeypatch):
    # conftest.py turns prewarm off for the rest of the suite; here it is what a user gets.
    monkeypatch.delenv(prewarm.ENV, raising=False)


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.delenv(prewarm.ENV, raising=False)
    WarmServer.shutdown()
    yield
    WarmServer.shutdown()


def servers_under(pid: int) -> list:
    """Forkservers among pid's descendants (not their ranks, which share their command line)."""
    found = [p for p in psutil.Process(pid).children(recursive=True) if alive(p) and SERVER in " ".join(p.cmdline())]
    return [p for p in found if p.ppid() not in {q.pid for q in found}]


def still_booting(server: WarmServer) -> bool:
    """It has not said ready yet: nothing has arrived on its socket."""
    return not select.select([server.sock], [], [], 0)[0]


def ok(kc, code: str, **kw) -> dict:
    seen = run(kc, code, **kw)
    assert seen["reply"]["status"] == "ok", (code, seen["reply"], seen["text"])
    return seen


def said(kc, code: str, **kw):
    """The JSON a cell printed on its last line."""
    return json.loads(ok(kc, code, **kw)["text"].strip().splitlines()[-1])


# -- in this process (not a kernel): prewarm.start() called directly ---------------------------------
@pytest.mark.timeout(180)
def test_launches_during_boot_wait_for_that_server(no_server):
    server = prewarm.start()
    assert server is not None and still_booting(server)
    results = {}

    def launch(name):
        results[name] = notebook_launcher(where_this_rank_runs, ("HOME",), num_processes=2, start_method="forkserver")

    threads = [threading.Thread(target=launch, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert sorted(results) == ["a", "b"], results
    parents = {r["ppid"] for rs in results.values() for r in rs}
    assert parents == {server.proc.pid}, (parents, server.proc.pid)
    assert [p.pid for p in servers_under(os.getpid())] == [server.proc.pid]
    assert WarmServer.get() is server


@pytest.mark.timeout(180)
def test_a_session_started_during_boot_uses_that_server(no_server):
    from notebook_accel.session import Session

    server = prewarm.start()
    assert still_booting(server)
    session = Session(2, start_method="forkserver", cpu=True, on_output=lambda *_: None)
    session.start(timeout=150)
    try:
        session.run_cell("import os\nparent = os.getppid()", timeout=60, check=True)
        assert [session.pull("parent", rank=r) for r in (0, 1)] == [server.proc.pid] * 2
        assert [p.pid for p in servers_under(os.getpid())] == [server.proc.pid]
    finally:
        session.stop()


@pytest.mark.timeout(120)
def test_forkserver_ranks_see_the_launcher_as_it_is_now_and_at_its_priority(no_server, monkeypatch, tmp_path):
    """The server started before these changes (as at import, with prewarm): its ranks still see the
    launcher's variables, sys.path and folder as they are at the launch, and its priority."""
    server = prewarm.start()
    WarmServer.get()  # ready
    monkeypatch.setenv("NOTEBOOK_ACCEL_TEST_VARIABLE", "set after the server started")
    monkeypatch.syspath_prepend(str(tmp_path / "added"))
    monkeypatch.chdir(tmp_path)
    seen = notebook_launcher(
        where_this_rank_runs, ("NOTEBOOK_ACCEL_TEST_VARIABLE",), num_processes=2, start_method="forkserver"
    )
    for rank in seen:
        assert rank["ppid"] == server.proc.pid
        assert rank["variable"] == "set after the server started"
        assert rank["path"][0] == str(tmp_path / "added")
        assert rank["cwd"] == str(tmp_path)
        assert rank["priority"] == os.getpriority(os.PRIO_PROCESS, 0)
    assert psutil.Process(server.proc.pid).nice() == psutil.Process().nice()


@pytest.mark.timeout(60)
def test_a_server_still_booting_leaves_with_its_parent(no_server):
    """Its lifeline (stdin) closes while it imports torch: it exits then, never saying ready."""
    server = prewarm.start()
    assert still_booting(server)
    server.proc.stdin.close()
    assert server.proc.wait(timeout=50) == 0
    frames = []
    try:
        while True:
            frames.append(recv_frame(server.sock))
    except (EOFError, OSError):
        pass
    assert frames == [], frames
    WarmServer.shutdown()


@pytest.mark.timeout(120)
def test_a_process_forked_from_the_launcher_does_not_keep_its_server_alive(no_server):
    """A fork rank (or any fork of the kernel) gives up the server: it closes the inherited lifeline,
    so the server still goes when the launcher does, while that process lives on."""
    server = WarmServer.get()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.write(write_end, b"1" if WarmServer._instance is None and server.proc.stdin.closed else b"0")
        time.sleep(60)
        os._exit(0)
    try:
        os.close(write_end)
        assert os.read(read_end, 1) == b"1"
        server.proc.stdin.close()  # what the launcher's exit does
        assert server.proc.wait(timeout=50) == 0
        assert alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
    WarmServer.shutdown()


@pytest.mark.timeout(30)
def test_prewarm_values(no_server, monkeypatch):
    monkeypatch.setenv(prewarm.ENV, "sometimes")
    with pytest.warns(UserWarning, match=r"NOTEBOOK_ACCEL_PREWARM='sometimes' is not understood.*=0"):
        assert prewarm.start() is None
    for off in ("0", "off", " False "):
        monkeypatch.setenv(prewarm.ENV, off)
        assert prewarm.start() is None
    assert WarmServer._instance is None and servers_under(os.getpid()) == []
    # a rank (the launcher's variable set) never starts one, whatever the setting
    monkeypatch.setenv(prewarm.ENV, "1")
    monkeypatch.setenv("NOTEBOOK_ACCEL_LAUNCHER", "1")
    assert prewarm.start() is None and servers_under(os.getpid()) == []
    monkeypatch.delenv("NOTEBOOK_ACCEL_LAUNCHER")
    assert prewarm.start() is not None and len(servers_under(os.getpid())) == 1


@pytest.mark.timeout(60)
def test_outside_a_kernel_importing_starts_nothing():
    """A script, and IPython in a terminal (a shell, but no kernel): no server."""
    code = (
        "import ipykernel, psutil\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "InteractiveShell.instance()\n"
        "import notebook_accel\n"
        "notebook_accel.load_ipython_extension(InteractiveShell.instance())\n"
        "print(len(psutil.Process().children()))"
    )
    env = {k: v for k, v in os.environ.items() if k != prewarm.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0", out.stdout


# -- in a real kernel ----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_in_a_kernel_the_import_starts_one_server_and_the_first_launch_uses_it(kernel):
    km, kc = kernel
    first = said(
        kc,
        f"import json, os, select, sys\nsys.path.insert(0, {TESTS!r})\n"
        "threads_before = len(os.listdir('/proc/self/task'))\n"
        "import notebook_accel\n"
        "threads_after = len(os.listdir('/proc/self/task'))\n"
        "from notebook_accel.launch.warm import WarmServer\n"
        "from launch_targets import where_this_rank_runs, servers_a_rank_starts, parallel_math\n"
        "server = WarmServer._instance\n"
        "booting = not select.select([server.sock], [], [], 0)[0]\n"
        "ranks = notebook_accel.notebook_launcher(where_this_rank_runs, ('HOME',), num_processes=2,\n"
        "                                         start_method='forkserver')\n"
        "print(json.dumps({'threads': [threads_before, threads_after], 'booting': booting,\n"
        "                  'server': server.proc.pid, 'parents': [r['ppid'] for r in ranks]}))",
        timeout=240,
    )
    assert first["threads"][0] == first["threads"][1], first  # no thread in the kernel
    assert first["booting"], first
    assert first["parents"] == [first["server"]] * 2, first
    assert [p.pid for p in servers_under(km.provisioner.pid)] == [first["server"]]

    # ranks import notebook_accel and ask for an early server: none starts one
    for method in ("fork", "spawn", "forkserver"):
        started = said(
            kc,
            f"print(json.dumps(notebook_accel.notebook_launcher(servers_a_rank_starts, num_processes=2, "
            f"start_method={method!r})))",
            timeout=120,
        )
        assert started == [[], []], (method, started)
    # the kernel may still fork: a default (fork) launch whose ranks run multi-threaded ops
    math = said(kc, "print(json.dumps(notebook_accel.notebook_launcher(parallel_math, num_processes=2)))")
    assert [m[:2] for m in math] == [[256.0, 1_000_000.0]] * 2, math
    assert [p.pid for p in servers_under(km.provisioner.pid)] == [first["server"]]

    # %load_ext starts one too (here after the first was shut down)
    ok(kc, "WarmServer.shutdown()")
    assert servers_under(km.provisioner.pid) == []
    ok(kc, "%load_ext notebook_accel")
    assert len(servers_under(km.provisioner.pid)) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kernel, warned", [({prewarm.ENV: "0"}, False), ({prewarm.ENV: "sometimes"}, True)], indirect=["kernel"]
)
def test_in_a_kernel_prewarm_off(kernel, warned):
    km, kc = kernel
    seen = ok(kc, "import notebook_accel\n%load_ext notebook_accel")
    assert ("NOTEBOOK_ACCEL_PREWARM='sometimes' is not understood" in seen["text"]) == warned, seen["text"]
    assert kernel_children(km, helpers=True) == []
    # the first forkserver launch starts it then
    ok(kc, "notebook_accel.notebook_launcher(print, ('ranked',), num_processes=2, start_method='forkserver')", timeout=180)
    assert len(servers_under(km.provisioner.pid)) == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("end", ["kill while booting", "kill", "shutdown"])
def test_the_early_server_goes_with_its_kernel(kernel, end):
    km, kc = kernel
    ok(kc, "import notebook_accel")
    servers = servers_under(km.provisioner.pid)
    assert len(servers) == 1, servers
    if end != "kill while booting":
        ok(kc, "from notebook_accel.launch.warm import WarmServer\nWarmServer.get()", timeout=120)  # ready
    km.shutdown_kernel(now=(end != "shutdown"))
    deadline = time.monotonic() + 30
    while alive(servers[0]):
        assert time.monotonic() < deadline, f"the forkserver outlived its kernel ({end})"
        time.sleep(0.1)


# -- the launch path imported while the kernel is idle (jupyter/ready.py) ----------------------------
IMPORTED = (
    "import json, os, sys\n"
    "from notebook_accel.jupyter import ready\n"
    "from notebook_accel.launch import rank_imports\n"
    "print(json.dumps({'imported': ready.imported, 'on': ready.imported_on,\n"
    "                  'loaded': [m for m in ready.LAUNCH_PATH + ready.PANEL if m in sys.modules],\n"
    "                  'rank_modules': [m for m in rank_imports.names() if m in sys.modules],\n"
    "                  'rank_modules_on': ready.rank_modules_on}))"
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernel", ["0", "1"], indirect=True)  # NOTEBOOK_ACCEL_WIDGETS
def test_in_a_kernel_the_launch_path_is_imported_once_the_import_cell_has_ended(kernel):
    from notebook_accel.jupyter import ready

    km, kc = kernel
    first = said(
        kc,
        "import json, os, sys, time\n"
        "import notebook_accel\n"
        "time.sleep(2 * 0.5)  # longer than ready.DELAY_S: nothing is imported inside this cell\n"
        "print(json.dumps({'widgets': os.environ['NOTEBOOK_ACCEL_WIDGETS'],\n"
        "                  'loaded': [m for m in ('notebook_accel.hardware', 'notebook_accel.launch.starters.local')\n"
        "                             if m in sys.modules]}))",
    )
    assert first["loaded"] == [], first
    time.sleep(ready.DELAY_S + 1.5)  # the kernel idle
    after = said(kc, IMPORTED)
    expected = list(ready.LAUNCH_PATH + (ready.PANEL if first["widgets"] == "1" else ()))
    assert after["imported"] == expected, after
    assert set(ready.LAUNCH_PATH) <= set(after["loaded"]), after
    assert after["on"] == "MainThread", after  # the kernel's own thread, between cells
    # and what ranks import (launch/rank_imports.py), likewise, so forked ranks inherit it
    assert "torch._dynamo" in after["rank_modules"] and "notebook_accel.accelerator" in after["rank_modules"], after
    assert after["rank_modules_on"] == "MainThread", after
    ranks = said(
        kc,
        f"sys.path.insert(0, {TESTS!r})\nfrom launch_targets import where_this_rank_runs\n"
        "print(json.dumps(notebook_accel.notebook_launcher(where_this_rank_runs, ('HOME',), num_processes=2)))",
        timeout=120,
    )
    assert len(ranks) == 2, ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernel", [{prewarm.ENV: "0"}], indirect=True)
def test_in_a_kernel_prewarm_off_imports_nothing_early(kernel):
    from notebook_accel.jupyter import ready

    km, kc = kernel
    ok(kc, "import notebook_accel")
    time.sleep(ready.DELAY_S + 1.5)
    after = said(kc, IMPORTED)
    assert after["imported"] == [] and "notebook_accel.launch.starters.local" not in after["loaded"], after
    assert "torch._dynamo" not in after["rank_modules"] and after["rank_modules_on"] is None, after
