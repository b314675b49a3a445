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

from nbfsdp.kernel.forkserver import ForkServer, ForkServerError


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the engine set's fork server."""

    def start(self) -> None:
        env = os.environ.copy()
        env.update(self.get_env())
        argv = ["ipengine", *self.args[len(self.engine_cmd) :]]
        self.pid = self.parent.fork_server.spawn(argv, env, cwd=os.path.abspath(self.work_dir), output=self.output_file)
        # the engine as the server forked it: ipyparallel signals and stops it through this psutil.Process,
        # which then checks that the pid is still the engine's
        engine = self.parent.fork_server.engine(self.pid)
        self.process = engine.process() if engine else None
        if self.process is None:
            raise ForkServerError(f"engine {self.pid} ended as soon as it was forked (log: {self.output_file})")
        self.notify_start(self.pid)
        self._start_waiting()

    def _wait(self) -> None:
        exit_code = self.parent.fork_server.wait(self.pid)
        stop_data = {"exit_code": exit_code, "pid": self.pid, "identifier": self.identifier}
        self.loop.add_callback(lambda: self.notify_stop(stop_data))


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """A set of engines forked by ``fork_server`` (pass it to ``Cluster.start_engines``)."""

    launcher_class = ForkedEngineLauncher
    fork_server = Instance(ForkServer)
