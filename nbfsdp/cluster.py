"""The ipyparallel cluster behind ``%%fsdp``: one engine per rank, one world at a time.

Engines are separate processes started by ipyparallel (no fork, so CUDA used
in the notebook is harmless). With at least N GPUs visible, each of N engine
sets sees exactly one GPU and the world uses NCCL; otherwise the world is CPU
and gloo, and each engine gets ``cores // N`` torch threads so N engines share
the cores without oversubscription (torchrun sets ``OMP_NUM_THREADS`` for the
same reason).

Everything stays on this machine and private to its user: the controller
listens on 127.0.0.1, connection files live in a fresh 0700 directory, and the
process group's rendezvous is a ``FileStore`` in that directory (torch's
``TCPStore`` would listen on every interface). Each new world gets a fresh
store file, since a reused store can hang a second ``init_process_group``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ipyparallel as ipp
import psutil

from nbfsdp import engine, reaper

ENGINE_START_TIMEOUT = 120.0


@dataclass
class World:
    """A running world: which engine is which rank, and on what."""

    world_size: int
    backend: str
    timeout: float
    generation: int
    engine_ids: list[int]  # by rank
    engines: list[dict[str, Any]] = field(default_factory=list)  # engine.describe() by rank
    broken: bool = False

    @property
    def pids(self) -> list[int]:
        return [e["pid"] for e in self.engines]


def visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_threads_per_rank(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)


class FSDPCluster:
    """Starts, reuses, resizes and stops the engines and their process group."""

    def __init__(self) -> None:
        self._private_dir: str | None = None
        self._cluster: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._engine_layout: tuple[int, bool] | None = None  # (engines, one GPU each)
        self._generation = 0
        self.world: World | None = None
        self.processes_started = 0

    # ------------------------------------------------------------------ public
    def ensure_world(self, world_size: int, timeout: float) -> World:
        """A healthy world of ``world_size`` ranks, reusing what already runs."""
        world = self.world
        if world and not world.broken and world.world_size == world_size and world.timeout == timeout:
            return world
        gpus = visible_gpus()
        use_gpus = gpus >= world_size
        if 0 < gpus < world_size:
            print(
                f"nbfsdp: {world_size} ranks but only {gpus} GPU(s) visible: running on CPU with gloo", file=sys.stderr
            )
        if self._engine_layout != (world_size, use_gpus) or (world and self.dead_ranks()):
            self._start_engines(world_size, use_gpus)
        return self._setup_world(world_size, "nccl" if use_gpus else "gloo", timeout)

    @property
    def client(self) -> ipp.Client:
        assert self._client is not None, "no cluster running"
        return self._client

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has ended, with how it ended."""
        dead: dict[int, str] = {}
        for rank, pid in enumerate(self.world.pids if self.world else []):
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                dead[rank] = self._how_it_ended(pid)
        return dead

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.world.pids[rank], signum)

    def kill_engines(self) -> None:
        """End every engine now (even one stuck in a collective); the next world restarts them."""
        if self.world:
            self.signal_ranks(list(range(self.world.world_size)), signal.SIGKILL)
        self._engine_layout = None
        self.world = None

    def stop(self) -> None:
        """Stop engines and controller and remove the private directory."""
        if self._client is not None:
            self._client.close()
        if self._cluster is not None:
            if self.world:
                self.signal_ranks(list(range(self.world.world_size)), signal.SIGKILL)
            self._cluster.stop_cluster_sync()
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        self._cluster = self._client = self._private_dir = None
        self._engine_layout = None
        self.world = None

    @property
    def private_dir(self) -> str:
        """The cluster's 0700 directory: connection files, the rendezvous store, run control files."""
        assert self._private_dir is not None, "no cluster running"
        return self._private_dir

    @property
    def running(self) -> bool:
        return self._cluster is not None

    # ----------------------------------------------------------------- helpers
    def _exit_code(self, pid: int) -> int | None:
        for engine_set in self._cluster.engines.values() if self._cluster else []:
            for launcher in getattr(engine_set, "launchers", {}).values():
                if launcher.pid == pid:
                    # the launcher's psutil.Process caches its exit code; waiting on that same
                    # object cannot steal it from the launcher's own waiting thread
                    try:
                        return launcher.process.wait(timeout=0)
                    except psutil.TimeoutExpired:
                        return None
        return None

    def _how_it_ended(self, pid: int) -> str:
        deadline = time.monotonic() + 1.0
        while (code := self._exit_code(pid)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if code is None:
            return "exited"
        if code < 0:
            name = signal.Signals(-code).name
            return f"killed by {name}{' (out of memory?)' if name == 'SIGKILL' else ''}"
        return f"exited with code {code}"

    def _start_engines(self, world_size: int, use_gpus: bool) -> None:
        self.stop()
        reaper.clean_stale()
        self._private_dir = tempfile.mkdtemp(prefix=reaper.PRIVATE_DIR_PREFIX)  # mode 0700
        reaper.record(self._private_dir, os.getpid(), [])
        reaper.start(os.getpid(), self._private_dir)
        self._cluster = ipp.Cluster(
            profile_dir=self._private_dir,
            controller_ip="127.0.0.1",
            # engines that end are nbfsdp's to report (a RankError says how a rank died); at WARNING,
            # ipyparallel would print engine logs into the cell each time nbfsdp ends engines on purpose
            log_level=logging.ERROR,
            delay=0.1,
        )
        self._cluster.start_controller_sync()
        threads = str(cpu_threads_per_rank(world_size))
        if use_gpus:  # one engine set per GPU, so each engine sees exactly one
            for gpu in range(world_size):
                env = {"CUDA_VISIBLE_DEVICES": str(gpu), "OMP_NUM_THREADS": threads}
                self._cluster.start_engines_sync(1, environment=env)
        else:
            env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads}
            self._cluster.start_engines_sync(world_size, environment=env)
        self.processes_started += world_size
        self._client = self._cluster.connect_client_sync()
        self._client.wait_for_engines(world_size, timeout=ENGINE_START_TIMEOUT, interactive=False)
        self._engine_layout = (world_size, use_gpus)
        reaper.record(self._private_dir, os.getpid(), self.cluster_pids())

    def cluster_pids(self) -> list[int]:
        """The controller's and every engine's process id."""
        launchers = [self._cluster.controller] + [
            launcher for engine_set in self._cluster.engines.values() for launcher in engine_set.launchers.values()
        ]
        return [launcher.pid for launcher in launchers]

    def _rank_order(self, use_gpus: bool) -> list[int]:
        ids = sorted(self.client.ids)
        if not use_gpus:
            return ids
        visible = self.client[ids].apply_sync(lambda: __import__("os").environ["CUDA_VISIBLE_DEVICES"])
        return [engine_id for _, engine_id in sorted(zip((int(v) for v in visible), ids, strict=True))]

    def _setup_world(self, world_size: int, backend: str, timeout: float) -> World:
        self._generation += 1
        store_path = os.path.join(self._private_dir, f"store-{self._generation}")
        engine_ids = self._rank_order(backend == "nccl")
        threads = cpu_threads_per_rank(world_size)
        results = [
            self.client[engine_id].apply_async(
                engine.setup,
                rank=rank,
                world_size=world_size,
                backend=backend,
                store_path=store_path,
                timeout=timeout,
                threads=threads,
                generation=self._generation,
            )
            for rank, engine_id in enumerate(engine_ids)
        ]
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        with ThreadPoolExecutor(len(results)) as pool:
            engines = list(pool.map(lambda r: r.get(timeout=max(1.0, deadline - time.monotonic())), results))
        self.world = World(world_size, backend, timeout, self._generation, engine_ids, engines)
        return self.world
