"""Ranks as Ray actors on a cluster (engine="ray"): one placement group per launch, one bundle and
one actor per rank. Ray places, schedules and notices dead nodes; we rendezvous the ranks at rank
0's node, run the function in each actor (launch/ray_rank.py) and turn what comes back over Ray's
own calls into the events every launch reports. Nothing of ours stays on the cluster after a launch:
every actor is killed and the placement group removed, however the launch ends."""

from __future__ import annotations

import os
import time

from .. import events as ev
from ..errors import LaunchConfigError, LaunchFailedError, LaunchStoppedError, LaunchTimeoutError
from ..lines import LineSplitter
from ..ray_plan import INSTALL
from .local import finished

POLL_S = 0.1  # how often the driver asks the ranks for their output and checks for a stop
NOTICE_AFTER_S = 2.0  # a placement group not ready by then: say that the launch waits for the cluster
TAKE_WAIT_S = 10.0  # a rank's output call that takes longer is left for the next poll
PROBE_WAIT_S = 5.0  # the stall watch's question to a rank's actor (which asks its server for 2 s at most)
PROBE_S = 5.0  # a cluster address that does not answer a TCP connect by then is not a cluster
REMOVE_WAIT_S = 10.0  # at most this long for Ray to free a launch's bundles


def ray_module():
    try:
        import ray
    except ImportError:
        raise LaunchConfigError(f"engine='ray' needs Ray, which is not installed here: {INSTALL}") from None
    return ray


_opened: dict = {}  # the connection this module opened: {"job": its job id, "address", "runtime_env"}


def _job(ray) -> str:
    return ray.get_runtime_context().get_job_id()


def connect(ray, address, runtime_env, sink) -> bool:
    """Use the cluster this process is connected to, else connect to `address`, $RAY_ADDRESS or
    "auto"; we never start a cluster. A connection opened here stays open for later launches and
    carries `runtime_env` as the job's: Ray uploads a local folder (working_dir, py_modules) only for
    a job, so a launch with another runtime_env reconnects, to the same address. True when the ranks'
    actors must carry `runtime_env` themselves (a connection the user opened, never closed by us)."""
    if ray.is_initialized():
        if not _opened or _opened["job"] != _job(ray):  # the user's (perhaps opened after ours ended)
            _opened.clear()
            return runtime_env is not None
        if _opened["runtime_env"] == runtime_env:
            return False
        address = address or _opened["address"]
        sink.handle(
            ev.LaunchNotice(f"connecting to Ray again at {address!r} for runtime_env={runtime_env!r}")
        )
        ray.shutdown()  # ours, opened for another runtime_env
    _opened.clear()
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address == "local":
        raise LaunchConfigError(
            "ray_address='local' would start a Ray instance here; a launch only connects to a running "
            "cluster: start one (`ray start --head`, or ray.init() yourself) and pass its address."
        )
    try:
        _probe(address)  # Ray retries an address where nothing listens for minutes
        ray.init(address=address, runtime_env=runtime_env)
    except (OSError, RuntimeError, ValueError) as exc:
        raise LaunchConfigError(
            f"no Ray cluster answers at ray_address={address!r} ({_cause(exc)}). Start one with `ray start "
            "--head` on a machine of the cluster and pass its address (or 'auto' on that machine), or call "
            "ray.init(...) yourself before launching."
        ) from None
    _opened.update(job=_job(ray), address=address, runtime_env=runtime_env)
    return False


def _probe(address: str, seconds: float = PROBE_S) -> None:
    """Raise ConnectionError when nothing listens at a "host:port" address (or "ray://host:port")."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto": Ray's own look-up, which fails fast
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except OSError as exc:
        raise ConnectionError(f"nothing listens at {host}:{port}: {exc.strerror or exc}") from None


def check_fits(ray, resources: dict, ranks: int, strategy: str) -> None:
    """Fail at once when the cluster's nodes could never hold the ranks as `strategy` places them:
    in total, one rank on any node, how many ranks each node holds. Nodes an autoscaler has yet to
    add do not count."""
    total = ray.cluster_resources()
    short = [
        f"{name}: {amount * ranks:g} wanted, {total.get(name, 0):g} in the cluster"
        for name, amount in resources.items()
        if amount and amount * ranks > total.get(name, 0) + 1e-9
    ]
    holds = [_holds(n.get("Resources", {}), resources) for n in ray.nodes() if n.get("Alive")]
    if not short:
        if not any(holds):
            short = [f"no node has {resources} for one rank"]
        elif strategy == "STRICT_PACK" and max(holds) < ranks:
            short = [
                f"placement='strict_pack' needs one node for all {ranks}, and a node holds at most {max(holds)}"
            ]
        elif strategy == "STRICT_SPREAD" and sum(1 for h in holds if h) < ranks:
            short = [
                f"placement='strict_spread' needs {ranks} nodes, and {sum(1 for h in holds if h)} hold a rank"
            ]
        elif sum(holds) < ranks:
            short = [f"its nodes hold {sum(holds)} such ranks in all ({', '.join(map(str, holds))} a node)"]
    if short:
        raise LaunchConfigError(
            f"the Ray cluster cannot hold {ranks} rank(s) of resources_per_rank={resources}: "
            f"{'; '.join(short)}. Use fewer ranks, smaller resources_per_rank, another placement, or add nodes."
        )


def _holds(node: dict, resources: dict) -> int:
    """How many bundles of `resources` fit in `node`'s total resources."""
    fits = [int(node.get(name, 0) / amount + 1e-9) for name, amount in resources.items() if amount]
    return min(fits) if fits else 0


class RayLaunch:
    """One launch's placement group and actors, and the loop that watches them."""

    def __init__(self, ray, plan, sink, control, actor_env: bool = False):
        self.ray, self.plan, self.sink, self.control = ray, plan, sink, control
        self.actor_env = actor_env  # the actors carry plan.ray.runtime_env (see connect)
        self.group = None
        self.actors: list = []  # by bundle index
        self.ranks: list = []  # rank -> bundle index
        self.where: list = []  # rank -> the actor's `where` answer
        self.nodes: list = []  # node ids in node-rank order
        self.splitters: dict = {}
        self.takes: dict = {}  # rank -> its `take` call in flight
        self.peak_rss: dict = {}  # rank -> the highest RSS its node reported
        self.calling: set = set()  # ranks whose function has begun
        self.going: frozenset = frozenset()  # ranks running now (swapped whole: read from other threads)
        self.started = 0.0
        self.stall_watch = None  # the stall watch, from the ranks' start (watch.py)
        self.probe = None  # its questions to the ranks (_Probe)

    # -- placing -------------------------------------------------------------------------------
    def place(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..ray_rank import RankActor

        settings, n = self.plan.ray, self.plan.num_processes
        self.group = placement_group([dict(settings.resources)] * n, strategy=settings.placement)
        self._wait_for_group()
        resources = dict(settings.resources)
        options = {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0)}
        if "memory" in resources:  # Ray takes memory as its own option, not among custom resources
            options["memory"] = resources.pop("memory")
        if resources:
            options["resources"] = resources
        if self.actor_env:
            options["runtime_env"] = settings.runtime_env
        actor = self.ray.remote(RankActor)
        for index in range(n):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
            try:
                self.actors.append(
                    actor.options(max_concurrency=RankActor.CALLS, scheduling_strategy=strategy, **options).remote()
                )
            except ValueError as exc:
                if "runtime_env" in options and "job level" in str(exc):  # a local folder, on an actor
                    raise LaunchConfigError(
                        f"runtime_env={settings.runtime_env!r}: {_cause(exc)} This process was connected to Ray "
                        "before the launch: pass the runtime_env to your ray.init(runtime_env=...), or launch "
                        "before connecting and notebook_launcher connects with it."
                    ) from None
                raise LaunchConfigError(
                    f"Ray refused a rank's actor for resources_per_rank={settings.resources} and "
                    f"runtime_env={settings.runtime_env!r}: {_cause(exc)}"
                ) from None
        where = self._get([a.where.remote() for a in self.actors], "the ranks' actors to start")
        self._check_versions(where)
        self.ranks, self.nodes = order(where)
        self.where = [where[i] for i in self.ranks]

    def _wait_for_group(self) -> None:
        ready, told, since = self.group.ready(), False, time.monotonic()
        while not self.ray.wait([ready], timeout=POLL_S)[0]:
            self._check_stop(f"waiting for the cluster to place the ranks ({self._missing()})")
            if not told and time.monotonic() - since > NOTICE_AFTER_S:
                told = True
                self.sink.handle(
                    ev.LaunchNotice(f"waiting for the Ray cluster to place the ranks: {self._missing()}")
                )

    def _missing(self) -> str:
        free = self.ray.available_resources()
        want = {k: v * self.plan.num_processes for k, v in self.plan.ray.resources.items() if v}
        return ", ".join(f"{k} {v:g} wanted, {free.get(k, 0):g} free now" for k, v in want.items())

    def _check_versions(self, where: list) -> None:
        from ..ray_rank import versions

        here = versions()
        for w in where:
            if w["versions"] != here:
                theirs = ", ".join(f"{k} {v}" for k, v in w["versions"].items())
                ours = ", ".join(f"{k} {v}" for k, v in here.items())
                raise LaunchConfigError(
                    f"Ray node {w['ip']} ({w['node_id'][:12]}) runs {theirs}, this process runs {ours}: "
                    "install the same versions on every node (or pass runtime_env={'pip': [...]})."
                )

    # -- running -------------------------------------------------------------------------------
    def rank_envs(self, port: int) -> list:
        n, master = self.plan.num_processes, self.where[0]["ip"]
        envs = []
        for rank, w in enumerate(self.where):
            same = [r for r, other in enumerate(self.where) if other["node_id"] == w["node_id"]]
            env = {
                **self.plan.env,
                "RANK": str(rank),
                "LOCAL_RANK": str(same.index(rank)),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(len(same)),
                "GROUP_RANK": str(self.nodes.index(w["node_id"])),
                "NODE_RANK": str(self.nodes.index(w["node_id"])),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
            }
            env["CUDA_VISIBLE_DEVICES"] = _devices([self.where[r]["gpus"] for r in same])
            envs.append(env)
        return envs

    def watch(self, body: bytes) -> list:
        from ..payload import loads_result

        port = self._get([self.actors[self.ranks[0]].free_port.remote()], "rank 0 to pick a port")[0]
        envs = self.rank_envs(port)
        started = time.monotonic()
        from .. import frontend
        from ..watch import Watch

        self.probe = _Probe(self)
        self.stall_watch = Watch(self.plan.stall_after, started, frontend.label_traceback, probe=self.probe)
        self.started = started
        self.control.where_now = self.where_now
        running = {}
        for rank, index in enumerate(self.ranks):
            self.sink.handle(ev.RankStarted(rank, self.where[rank]["pid"], _node(self.where[rank])))
            running[self.actors[index].run.remote(envs[rank], self.plan.threads_per_process, body)] = rank
        results: list = [None] * len(self.ranks)
        while running:
            self.going = frozenset(running.values())
            ready, _ = self.ray.wait(list(running), num_returns=len(running), timeout=POLL_S)
            self._pump(sorted(running.values()))
            failed = []
            for ref in sorted(ready, key=running.get):
                rank = running.pop(ref)
                outcome = self._outcome(ref)
                self._drain(rank)  # the rank's last lines, before what it returned
                self._moved()
                if outcome[0] == "result":
                    # Ray hands back bytes: a tensor must not be built on read-only memory.
                    results[rank] = loads_result(outcome[1], [bytearray(b) for b in outcome[2]])
                    self.sink.handle(
                        ev.RankFinished(rank, time.monotonic() - started, self.peak_rss.get(rank))
                    )
                else:
                    failed.append(self._failure(rank, outcome))
            if failed:  # every rank that failed in this poll: the cause may be any of them
                for other in sorted(running.values()):
                    self.sink.handle(ev.RankStopped(other, f"rank {failed[0].rank} failed"))
                raise LaunchFailedError(failed)
            self._check_stop("", sorted(running.values()))
            self._tick(running)
        return results

    def where_now(self, label=None):
        """Where every rank is now, asked through the actors (the panel's Stacks button; any thread)."""
        from ..watch import snapshot

        probe = _Probe(self)  # its own: the launch's loop may be asking with the watch's meanwhile
        ranks = self._asked(probe, self.going)
        return snapshot(time.monotonic() - self.started, ranks, label, asked=True, probe=probe)

    def _asked(self, probe, going) -> list:
        """(rank, key, state) of every rank for the watch, the running ones asked through `probe`: a
        rank is its own key; one no longer running returned (a failure ends the launch at once)."""
        ranks = [
            (rank, rank, (False if rank in self.calling else "starting") if rank in going else True)
            for rank in range(len(self.ranks))
        ]
        probe.gather([rank for rank, _, state in ranks if state is False])
        return ranks

    def _tick(self, running: dict) -> None:
        """The stall watch's turn: the ranks that run are asked through their actors, all at once
        (`_Probe.gather`); a rank no longer running returned (a failure ends the launch at once)."""
        now = time.monotonic()
        if not self.stall_watch.due(now):
            return
        ranks = self._asked(self.probe, set(running.values()))
        for event in self.stall_watch.tick(now, ranks):
            self.sink.handle(event)

    def _moved(self) -> None:
        if self.stall_watch is not None:
            for event in self.stall_watch.progress(time.monotonic()):
                self.sink.handle(event)

    def _outcome(self, ref) -> tuple:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            return ("died", _cause(exc))

    def _failure(self, rank: int, outcome: tuple):
        """`rank`'s RankFailed, sent to the sink."""
        where = self.where[rank]
        if outcome[0] == "died":
            message = f"its Ray actor died ({outcome[1]})"
            report = ev.RankFailed(
                rank, where["pid"], None, message=message, node=_node(where), peak_rss=self.peak_rss.get(rank)
            )
        else:
            error = outcome[1]
            report = ev.RankFailed(
                rank,
                where["pid"],
                1,
                error["exc_type"],
                error["message"],
                error["traceback"],
                peak_rss=self.peak_rss.get(rank),
                node=_node(where),
            )
        self.sink.handle(report)
        return report

    def _pump(self, ranks: list, wait: float = 0.0) -> None:
        """Collect what the ranks printed: one `take` call in flight a rank (its answer holds the
        lines the actor handed over, so it is never dropped: a slow one is collected later)."""
        for rank in ranks:
            if rank not in self.takes:
                self.takes[rank] = self.actors[self.ranks[rank]].take.remote()
        refs = {self.takes[rank]: rank for rank in ranks}
        if not refs:
            return
        ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=wait)
        for ref in ready:
            rank = refs[ref]
            del self.takes[rank]
            try:
                chunks, usage, calling = self.ray.get(ref)
            except self.ray.exceptions.RayError:
                continue  # the actor is gone: its run call says how
            if chunks or (calling and rank not in self.calling):
                self._moved()  # output, or its function began
            if calling:
                self.calling.add(rank)
            for stream, data in chunks:
                self._lines(rank, stream, LineSplitter.feed, data)
            if usage is not None:
                self.peak_rss[rank] = max(self.peak_rss.get(rank, 0), usage.rss)
                self.sink.handle(usage)

    def _drain(self, rank: int) -> None:
        """A finished rank's last output: the call in flight, then one asked after the rank's end."""
        self._pump([rank], TAKE_WAIT_S)
        self._pump([rank], TAKE_WAIT_S)
        for stream in ("stdout", "stderr"):
            self._lines(rank, stream, lambda splitter, _: splitter.finish(), None)

    def _lines(self, rank: int, stream: str, take, data) -> None:
        splitter = self.splitters.setdefault((rank, stream), LineSplitter())
        for text, transient in take(splitter, data):
            self.sink.handle(ev.RankOutput(rank, stream, text, transient))

    def _check_stop(self, doing: str, running: list = ()) -> None:
        reason = self.control.check(time.monotonic())
        if not reason:
            return
        if doing:
            reason = f"{reason} while {doing}"
        for rank in running:
            self.sink.handle(ev.RankStopped(rank, reason))
        kind = LaunchTimeoutError if self.control.timed_out else LaunchStoppedError
        raise kind(reason, stall=self.stall_watch.last_report if self.stall_watch is not None else None)

    def _get(self, refs: list, what: str) -> list:
        """ray.get, watching for a stop or the timeout; an actor that cannot start names its node."""
        pending = list(refs)
        while self.ray.wait(pending, num_returns=len(pending), timeout=POLL_S)[1]:
            self._check_stop(f"waiting for {what}")
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayError as exc:
            raise LaunchConfigError(
                f"a rank's Ray actor could not start: {_cause(exc)}. Every node needs notebook_accel and "
                f"torch installed (the same versions as here), or a runtime_env that installs them."
            ) from None

    # -- ending --------------------------------------------------------------------------------
    def clean(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self.group is None:
            return
        try:
            remove_placement_group(self.group)
        except Exception:
            return
        # Ray frees bundles and actors in the background: wait until the cluster's view has neither,
        # so the resources are back when the launch returns.
        deadline = time.monotonic() + REMOVE_WAIT_S
        while time.monotonic() < deadline:
            if self._gone(deadline):
                return
            time.sleep(0.05)
        self.sink.handle(
            ev.LaunchNotice(
                f"Ray had not freed the launch's actors and placement group {REMOVE_WAIT_S:g} s after it "
                "removed them; it goes on in the background"
            )
        )

    def _gone(self, deadline: float) -> bool:
        """Ray shows none of the group's bundles and none of the actors answers (asked together)."""
        try:
            mark = self.group.id.hex()
            if any(mark in name for name in self.ray.available_resources()):
                return False
            pings = [actor.take.remote() for actor in self.actors]
            left = max(0.1, deadline - time.monotonic())
            ready, waiting = self.ray.wait(pings, num_returns=len(pings), timeout=left)
            if waiting:
                return False
            for ping in ready:
                try:
                    self.ray.get(ping)
                    return False  # still answers
                except self.ray.exceptions.RayActorError:
                    continue
            return True
        except Exception:  # the connection itself went: nothing more to wait for here
            return True


class _Probe:
    """The stall watch's questions to Ray ranks (a rank is its own key), asked through their actors:
    the driver cannot reach a pid on another node. `gather` asks every running rank at once, under
    one deadline; the watch then reads the answers. A rank that did not answer in time is unknown."""

    def __init__(self, launch: RayLaunch):
        self.launch = launch
        self.answers: dict = {}  # rank -> (collectives, stacks text), from the last gather

    def gather(self, ranks: list) -> None:
        ray = self.launch.ray
        refs = {self.launch.actors[self.launch.ranks[rank]].probe.remote(True): rank for rank in ranks}
        self.answers = {}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_WAIT_S)
        for ref in ready:
            try:
                self.answers[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # its actor died: its run call says how

    def collectives(self, rank: int):
        return self.answers.get(rank, (None, None))[0]

    def stacks(self, rank: int):
        return self.answers.get(rank, (None, None))[1]


def order(where: list) -> tuple:
    """(the bundle index of each rank, the node ids in node-rank order) from each bundle's actor's
    `where`: ranks node by node, in the order the bundles first name each node, bundle order within,
    so a node's ranks have consecutive global ranks and local ranks 0, 1, ..."""
    nodes = list(dict.fromkeys(w["node_id"] for w in where))
    return sorted(range(len(where)), key=lambda i: (nodes.index(where[i]["node_id"]), i)), nodes


def _node(where: dict) -> str:
    """A node as a person finds it: its address, and its id's start (nodes may share an address)."""
    return f"{where['ip']} ({where['node_id'][:8]})"


def _cause(exc) -> str:
    """An exception's message in one line: Ray's put the cause after a generic first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines) if lines else type(exc).__name__
    return text if len(text) <= 600 else text[:600] + " ..."


def _devices(per_rank: list) -> str:
    """A node's CUDA_VISIBLE_DEVICES from its ranks' GPU ids (local-rank order): each rank's first
    GPU first, so cuda:LOCAL_RANK is the rank's own, then the ranks' other GPUs. "" for ranks
    without a GPU: they see none, whatever the node has."""
    firsts = [ids[0] for ids in per_rank if ids]
    rest = [g for ids in per_rank for g in ids[1:] if g not in firsts]
    return ",".join(dict.fromkeys(firsts + rest))


def run(plan, payload, sink, control) -> list:
    ray = ray_module()
    body = payload.pickled()  # an unpicklable function is named before the cluster is touched
    actor_env = connect(ray, plan.ray.address, plan.ray.runtime_env, sink)
    check_fits(ray, plan.ray.resources, plan.num_processes, plan.ray.placement)
    started = time.monotonic()
    sink.handle(ev.LaunchStarted(plan.num_processes, "ray", plan.num_processes, fsdp=plan.fsdp))
    launch = RayLaunch(ray, plan, sink, control, actor_env)
    try:
        control.start()
        launch.place()
        results = launch.watch(body)
    except BaseException as exc:
        launch.clean()  # before LaunchFinished, as on success: a notice of its own comes before the end
        finished(sink, started, exc)
        raise
    launch.clean()
    finished(sink, started)
    return results
