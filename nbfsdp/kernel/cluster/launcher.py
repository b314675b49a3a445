"""ipyparallel launchers whose engines are forked by nbfsdp's fork server.

They are ipyparallel's local launchers with one change: ``start`` asks the
``ForkServer`` for the process instead of running ``python -m
ipyparallel.engine``, and the exit code comes from the server (the engine is
its child, not the kernel's, so psutil cannot wait for its status). Output
files, signals, stop and the cluster's bookkeeping stay ipyparallel's.
"""

from __future__ import annotations

import os

from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Instance

from nbfsdp.kernel.cluster import ipyparallel_private
from nbfsdp.kernel.cluster.forkserver import ForkServer, ForkServerError


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the engine set's fork server."""

    def start(self) -> None:
        env = os.environ.copy()
        env.update(self.get_env())
        argv = ["ipengine", *ipyparallel_private.engine_arguments(self)]
        fork_server = self.parent.fork_server
        pid = fork_server.spawn(argv, env, cwd=os.path.abspath(self.work_dir), output=self.output_file)
        # the engine as the server forked it: ipyparallel signals and stops it through this psutil.Process,
        # which then checks that the pid is still the engine's
        engine = fork_server.engine(pid)
        process = engine.process() if engine else None
        if process is None:
            raise ForkServerError(f"engine {pid} ended as soon as it was forked (log: {self.output_file})")
        ipyparallel_private.adopt_process(self, process)
        # the engine is the server's child, not the kernel's: only the server can wait for its exit code
        ipyparallel_private.watch_exit(self, lambda: fork_server.wait(pid))


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """A set of engines forked by ``fork_server`` (pass it to ``Cluster.start_engines``)."""

    launcher_class = ForkedEngineLauncher
    fork_server = Instance(ForkServer)
