"""The ipyparallel cluster behind ``%%fsdp``: one engine per rank, one world at a time.

Engines are ipyparallel engines forked by the cluster's fork server
(``nbfsdp.helpers.forkserver``), a fresh process that imports torch, FSDP2 and
ipykernel once; it is never the notebook's process, so CUDA used in the
notebook is harmless. ``start_fork_server`` starts it, and ``%load_ext`` calls
that before its own imports, which the server's then overlap. A restart
(another world size, a rank that died) forks the new engines from the same
server, so only ``stop`` (``%fsdp stop``) pays its imports again. Where the
ranks run is ``nbfsdp.shared.devices.choose``'s decision: on GPUs, each engine
sees exactly one (rank r GPU r mod G, ``CUDA_VISIBLE_DEVICES``) and the world
uses NCCL, ranks that share a GPU told apart for NCCL by ``NCCL_HOSTID``; on
the CPU the world uses gloo. Either way each engine gets ``cores // N`` torch
threads so N engines share the cores without oversubscription (torchrun sets
``OMP_NUM_THREADS`` for the same reason).

Everything stays on this machine and private to its user: the controller
listens on 127.0.0.1, connection files live in a fresh 0700 directory, and the
process group's rendezvous is a ``FileStore`` in that directory (torch's
``TCPStore`` would listen on every interface). Each new world gets a fresh
store file, since a reused store can hang a second ``init_process_group``.
Each rank gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``...)
for a script pasted into a cell; the address they name is a second store that
rank 0 serves on 127.0.0.1 for such a script, never the world's own.

``start_in_background`` runs what ``ensure_world`` would on a daemon thread
(``%load_ext`` uses it so the first cell finds the engines ready). The
ipyparallel client serves one thread at a time, so every other use of the
cluster first waits for that thread, in short slices that Ctrl-C can
interrupt; a background start that failed stops everything it had started, and
its error is kept for ``%fsdp status``, not printed; the next ``ensure_world``
starts again from scratch (and raises, if it fails again).
Every process the cluster launches names the private directory on its command
line, which is how the reaper (``nbfsdp.helpers.reaper``) finds them once the kernel is
gone, so a kernel killed mid-start leaves nothing behind (the fork server also
ends its engines when the kernel's end of its pipe closes). The engines are
signalled by pid and start time (``processes.ProcessRef``), never by a pid that
may have passed to another process since.

Importing this module loads neither torch nor ipyparallel.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from nbfsdp.kernel.cluster import ipyparallel_private, reaping
from nbfsdp.kernel.cluster.rank_calls import set_up_every_rank
from nbfsdp.kernel.cluster.threads import KernelThread
from nbfsdp.kernel.cluster.world import (
    ENGINE_START_TIMEOUT,
    RunningWorld,
    WorldPlan,
    cpu_threads_per_rank,
    devices_here,
    engine_layout,
    nccl_host_environment,
    run_id,
    visible_gpus,
    wait_for_death,
)
from nbfsdp.shared import processes
from nbfsdp.shared.devices import Devices, requested_device
from nbfsdp.shared.processes import ProcessRef
from nbfsdp.shared.protocol import WorldSetup

if TYPE_CHECKING:
    import ipyparallel as ipp

    from nbfsdp.kernel.cluster.forkserver import ForkServer

#: The rank an engine on a GPU was started for (its engine set's environment), so ranks find their engines.
_RANK_VARIABLE = "NBFSDP_RANK"


def _end_watcher(watcher: psutil.Popen) -> None:
    """End the reaper of a cluster that is stopped (it would see the directory gone within a second) and reap
    it, so no process of the cluster outlives ``stop``, not even as a zombie."""
    watcher.terminate()  # the kernel's own child, not yet waited for: its pid is still its own
    watcher.wait()


@dataclass
class _BackgroundStart:
    thread: KernelThread
    world_size: int
    since: float  # time.monotonic()


def _how_it_ended(code: int | None) -> str:
    """An engine's end, said from its exit code as the fork server saw it (None: unknown)."""
    if code is None:
        return "exited"
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}{' (out of memory?)' if name == 'SIGKILL' else ''}"
    return f"exited with code {code}"


#: How long the controller's queues have to listen on their ports once it has written its connection files
#: (0.1-0.2 s measured on 2 idle cores; a process stuck as it started never does).
QUEUE_START_TIMEOUT = 30.0


def _queue_failure(cluster: ipp.Cluster) -> str | None:
    """Why one of the controller's queues will never serve (a port it chose taken before its process bound
    it, or a process stuck as it started: ``ipyparallel_private.unbound_ports``); None once each queue
    listens. Waits up to ``QUEUE_START_TIMEOUT`` for them, while the engines start."""
    deadline = time.monotonic() + QUEUE_START_TIMEOUT
    while unbound := ipyparallel_private.unbound_ports(cluster):
        logged = ipyparallel_private.controller_failure(cluster)
        if logged is not None:
            return f"{logged}: a port it chose was taken before it could bind it"
        if time.monotonic() >= deadline:
            ports = ", ".join(f"{name} {port}" for name, port in unbound)
            return f"nothing listened on its {ports} {QUEUE_START_TIMEOUT:.0f} s after it started"
        time.sleep(0.05)
    return None


def _wait_for_registration(
    cluster: ipp.Cluster, client: ipp.Client, fork_server: ForkServer, forked_before: int, world_size: int
) -> None:
    """Until ``world_size`` engines have registered; an engine that ends first (of those the fork server forked
    after its first ``forked_before``) fails the start at once, with how it ended and the end of its output.
    ipyparallel's ``wait_for_engines`` would wait out its timeout: an engine's stop notice never reaches it here
    (see ``ipyparallel_private.launched_pids``). Nor are the engine set's launchers where to look: the set drops
    an engine that ended whenever its stop notice runs, always under a kernel's running loop (ipyparallel's
    ``_sync`` calls then run on a thread of their own), in a shell while the start is still running."""
    from IPython.core.error import UsageError

    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        try:
            client.wait_for_engines(world_size, timeout=max(0.0, min(left, 0.5)), interactive=False)
            return
        except TimeoutError:  # ipyparallel's, for this half second: look for an engine that ended, then again
            ipyparallel_private.catch_up_registrations(cluster, client)
        for pid, output in fork_server.forked_since(forked_before).items():
            code = fork_server.wait(pid, timeout=0)
            if code is not None:
                raise UsageError(
                    f"nbfsdp: an engine {_how_it_ended(code)} before it registered with the controller; the end "
                    f"of its output ({output}):\n{fork_server.last_output(pid)}\nthe next cell starts the engines again"
                )
        if left <= 0:
            raise UsageError(
                f"nbfsdp: {len(client.ids)} of {world_size} engines registered with the controller within "
                f"{ENGINE_START_TIMEOUT:.0f} s (a machine too busy to start them; their output is in "
                f"{cluster.profile_dir}); the next cell starts them again"
            )


def _joining(
    devices: Devices, timeout: float, private_dir: str, generation: int, script_store: tuple[str, int]
) -> dict[int, tuple[WorldSetup]]:
    """What each rank of a new world on this machine joins it with: a ``FileStore`` in the private directory,
    the one GPU its engine sees, torchrun's variables naming ``script_store``."""
    from nbfsdp.kernel.cluster.hosts import one_host

    world_size = devices.world_size
    store_path = os.path.join(private_dir, f"store-{generation}")
    threads = cpu_threads_per_rank(world_size)
    torchrun = [
        p.environment(world_size, 1, script_store, run_id(private_dir, generation)) for p in one_host(world_size)
    ]
    return {
        rank: (
            WorldSetup(
                rank=rank,
                world_size=world_size,
                backend=devices.backend,
                store_path=store_path,
                timeout=timeout,
                threads=threads,
                generation=generation,
                gpu=0 if devices.type == "cuda" else None,  # the one GPU the engine sees
                environment={**torchrun[rank], **nccl_host_environment(devices, rank, private_dir)},
                where_dir=private_dir,
            ),
        )
        for rank in range(world_size)
    }


class FSDPCluster:
    """Starts, reuses, resizes and stops the engines and their process group."""

    def __init__(self) -> None:
        self._private_dir: str | None = None
        self._cluster: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._fork_server: ForkServer | None = None
        self._engine_layout: tuple[str, int, tuple[int, ...]] | None = None  # the devices' ``_layout``
        self._generation = 0
        self._background: _BackgroundStart | None = None
        self._reaper: psutil.Popen | None = None
        self.background_error: BaseException | None = None
        """Why the last background start failed (the next ``ensure_world`` starts again)."""
        self.world: RunningWorld | None = None
        self.processes_started = 0

    # ------------------------------------------------------------------ public
    def start_in_background(self, world_size: int, timeout: float, since: float | None = None) -> None:
        """Start the world ``plan_world(world_size, timeout)`` plans, on a daemon thread; return at once.

        ``since`` (``time.monotonic()``, default now) is when the start was asked for, for ``starting``.
        """
        self._wait_for_background()
        self.background_error = None
        thread = KernelThread(target=self._start_quietly, args=(world_size, timeout), name="nbfsdp-prewarm")
        self._background = _BackgroundStart(thread, world_size, time.monotonic() if since is None else since)
        thread.start()

    @property
    def starting(self) -> tuple[int, float] | None:
        """While a background start runs: its world size and the seconds since it began. Never waits."""
        background = self._background
        if background is None or not background.thread.is_alive():
            return None
        return background.world_size, time.monotonic() - background.since

    def plan_world(self, world_size: int, timeout: float, device: str | None = None) -> WorldPlan:
        """Where a world of ``world_size`` ranks on ``device`` runs, and whether the running world serves it."""
        devices = self.devices(world_size, device)
        return WorldPlan(
            world_size, timeout, devices, bool(self.world and self.world.serves(world_size, timeout, devices))
        )

    def ensure_world(self, plan: WorldPlan) -> RunningWorld:
        """A healthy world as ``plan`` says, reusing what already runs."""
        self._wait_for_background()
        self.background_error = None  # this start replaces a failed one
        world = self.world
        if world is not None and world.serves(plan.world_size, plan.timeout, plan.devices):
            return world
        if self._cluster is None and self._fork_server is None:
            self.start_fork_server()
        if self._engine_layout != engine_layout(plan.devices) or (world and self.dead_ranks()):
            self._start_engines(plan.devices)
        return self._setup_world(plan.devices, plan.timeout)

    @property
    def client(self) -> ipp.Client:
        self._wait_for_background()
        assert self._client is not None, "no cluster running"
        return self._client

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has ended, with how it ended."""
        self._wait_for_background()
        dead: dict[int, str] = {}
        for rank, process in enumerate(self.world.processes if self.world else []):
            if not process.alive():
                assert self._fork_server is not None  # it started the world's engines, and stops only with them
                dead[rank] = _how_it_ended(self._fork_server.wait(process.pid, timeout=1.0))
        return dead

    def how_rank_died(self, rank: int, within: float = 2.0) -> str | None:
        """How the rank's engine ended, waiting up to ``within`` seconds to see it end."""
        return wait_for_death(self.dead_ranks, rank, within)

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        """Signal the ranks' engines that still run (an engine that ended is skipped, and so is its pid)."""
        self._wait_for_background()
        assert self.world is not None, "no world running"
        for rank in ranks:
            self.world.processes[rank].signal(signum)

    def unsteerable(self) -> str | None:
        """Why a cell could not be steered mid-run: never, every rank is on this machine."""
        return None

    def devices(self, world_size: int, device: str | None = None, *, planning: bool = False) -> Devices:
        return devices_here(world_size, device, planning=planning)

    def default_world_size(self, device: str | None = None) -> int:
        return 2 if requested_device(device) == "cpu" else (visible_gpus() or 2)

    def rank_hosts(self) -> list[str]:
        """The running world's host per rank: this machine's, for all."""
        return [info.host for info in self.world.engines] if self.world else []

    def kill_engines(self) -> None:
        """End every engine now (even one stuck in a collective); the next world restarts them."""
        self._wait_for_background()
        if self.world:
            self.signal_ranks(list(range(self.world.world_size)), signal.SIGKILL)
        self._engine_layout = None
        self.world = None

    def stop(self) -> None:
        """Stop engines, controller and fork server, and remove the private directory (after a background
        start ends).

        Every step runs even when one before it fails, and whatever still runs for the directory then is
        killed: a start that failed half-way (a controller without engines) leaves nothing behind."""
        self._wait_for_background()
        private_dir, fork_server, watcher = self._private_dir, self._fork_server, self._reaper
        self._private_dir = self._fork_server = self._reaper = None
        with contextlib.ExitStack() as then:  # run last first
            if watcher is not None:
                then.callback(_end_watcher, watcher)
            if private_dir:
                then.callback(processes.end_cluster, private_dir)  # what the steps below missed; the directory
            if fork_server is not None:
                then.callback(fork_server.stop)
            self._stop_engines_and_controller()

    @property
    def private_dir(self) -> str:
        """The cluster's 0700 directory: connection files, the rendezvous store, run control files."""
        self._wait_for_background()
        assert self._private_dir is not None, "no cluster running"
        return self._private_dir

    @property
    def running(self) -> bool:
        self._wait_for_background()
        return self._cluster is not None

    # ----------------------------------------------------------------- helpers
    def _start_quietly(self, world_size: int, timeout: float) -> None:
        """The background thread: its error is kept for the next ``ensure_world``, never printed into a cell."""
        try:
            self.ensure_world(self.plan_world(world_size, timeout))
        except BaseException as error:
            self.background_error = error
            with contextlib.suppress(Exception):
                self.stop()  # a clean slate: the next ensure_world starts from scratch

    def _wait_for_background(self) -> None:
        """Let a background start finish before anything else touches the cluster."""
        background = self._background
        if background is None or background.thread is threading.current_thread():
            return
        background.thread.join()
        self._background = None

    def start_fork_server(self) -> None:
        """Stop what runs, and start the engines' fork server (``nbfsdp.helpers.forkserver``) in a fresh private
        directory; return at once. It imports what the engines need while the caller goes on, and the next
        world that starts engines forks them from it."""
        self.stop()
        reaping.clean_stale()
        self._private_dir = tempfile.mkdtemp(prefix=reaping.PRIVATE_DIR_PREFIX)  # mode 0700
        reaping.note_kernel(self._private_dir, os.getpid())
        self._reaper = reaping.start(os.getpid(), self._private_dir)
        from nbfsdp.kernel.cluster.forkserver import ForkServer

        # the engines' own variables (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS) are set in each engine after
        # the fork: torch reads them only when it first uses CUDA or its thread pool, never at import
        self._fork_server = ForkServer(dict(os.environ), self._private_dir)

    def _stop_engines_and_controller(self) -> None:
        client, cluster, world = self._client, self._cluster, self.world
        self._cluster = self._client = None
        self._engine_layout = None
        self.world = None
        with contextlib.ExitStack() as then:  # run last first, each even when one before it fails
            if cluster is not None:
                then.callback(cluster.stop_cluster_sync)
                for process in world.processes if world else []:
                    then.callback(process.signal, signal.SIGKILL)
            if client is not None:
                client.close()

    def _start_engines(self, devices: Devices, *, again_if_broken: bool = True) -> None:
        if self._cluster is not None:
            # a restart (another size, a rank died) keeps the fork server: it has imported everything once
            self._stop_engines_and_controller()
        if self._fork_server is None or not self._fork_server.running:
            self.start_fork_server()
        world_size = devices.world_size
        threads = str(cpu_threads_per_rank(world_size))
        if devices.type == "cuda":  # one engine set per rank, so each engine sees exactly its GPU
            engine_sets = [
                (1, {"CUDA_VISIBLE_DEVICES": str(gpu), _RANK_VARIABLE: str(rank), "OMP_NUM_THREADS": threads})
                for rank, gpu in enumerate(devices.rank_gpus)
            ]
        else:
            engine_sets = [(world_size, {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads})]
        from nbfsdp.kernel.cluster.launcher import CLIENT_TIMEOUT, forked_cluster, wait_for_connection_files

        assert self._private_dir is not None and self._fork_server is not None  # start_fork_server made them
        self._cluster = forked_cluster(self._private_dir)
        self._cluster.start_controller_sync()
        wait_for_connection_files(self._cluster, then="the next cell starts it again")
        forked_before = self._fork_server.forked_count
        for count, env in engine_sets:
            # delay: ipyparallel's pause between the engines of a set (0.1 s each)
            self._cluster.start_engines_sync(count, environment=env, delay=0, fork_server=self._fork_server)
        self.processes_started += world_size
        failure = _queue_failure(self._cluster)
        if failure is not None:  # requests through that queue would never return
            if again_if_broken:
                self._start_engines(devices, again_if_broken=False)
                return
            from IPython.core.error import UsageError

            raise UsageError(
                f"nbfsdp: the controller lost one of its queues as it started, twice ({failure}); the next cell "
                "starts it again"
            )
        self._client = self._cluster.connect_client_sync(timeout=CLIENT_TIMEOUT)
        import nbfsdp.engines.engine  # noqa: F401  (what _setup_world sends, imported while the cores wait for heartbeats)

        _wait_for_registration(self._cluster, self._client, self._fork_server, forked_before, world_size)
        self._engine_layout = engine_layout(devices)

    def cluster_pids(self) -> list[int]:
        """The fork server's, the controller's and every engine's process id."""
        self._wait_for_background()
        assert self._fork_server is not None, "no cluster running"
        return [self._fork_server.pid, *ipyparallel_private.launched_pids(self._cluster)]

    def _rank_order(self, devices: Devices) -> list[int]:
        """Engine ids by rank: on GPUs each engine was started for its rank (and that rank's GPU)."""
        ids = sorted(self.client.ids)
        if devices.type == "cpu":
            return ids
        ranks = self.client[ids].apply_sync(lambda name: int(__import__("os").environ[name]), _RANK_VARIABLE)
        return [engine_id for _, engine_id in sorted(zip(ranks, ids, strict=True))]

    def _setup_world(self, devices: Devices, timeout: float) -> RunningWorld:
        # torch: imported by the first world, not by importing this module
        from nbfsdp.engines import engine, hosts

        assert self._private_dir is not None  # _start_engines made it, or an earlier world's start
        self._generation += 1
        world_size = devices.world_size
        engine_ids = self._rank_order(devices)
        # the address torchrun's variables name (MASTER_ADDR, MASTER_PORT): a store rank 0 serves on loopback
        script_store = tuple(self.client[engine_ids[0]].apply_sync(hosts.open_rendezvous, "127.0.0.1"))
        joining = _joining(devices, timeout, self._private_dir, self._generation, script_store)
        engines = list(set_up_every_rank(self.client, dict(enumerate(engine_ids)), engine.setup, joining).values())
        processes = [self._engine_process(engine.pid) for engine in engines]
        self.world = RunningWorld(
            world_size, devices.backend, timeout, self._generation, engine_ids, devices, engines, processes=processes
        )
        return self.world

    def _engine_process(self, pid: int) -> ProcessRef:
        """Engine ``pid`` as the fork server started it; one it did not start (an engine of an older kind) is
        taken as it runs now, and one already gone is never signalled (its start time is unknown)."""
        return (self._fork_server and self._fork_server.engine(pid)) or ProcessRef.of(pid) or ProcessRef(pid, math.nan)
