"""ipyparallel launchers whose engines are forked by nbfsdp's fork server.

They are ipyparallel's local launchers with one change: ``start`` asks the
``ForkServer`` for the process instead of running ``python -m
ipyparallel.engine``, and the exit code comes from the server (the engine is
its child, not the kernel's, so psutil cannot wait for its status). Output
files, signals, stop and the cluster's bookkeeping stay ipyparallel's. ``forked_cluster`` is a cluster whose
engines are forked so.
"""

from __future__ import annotations

import logging
import os

import ipyparallel as ipp
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Instance

from nbfsdp.kernel.cluster import ipyparallel_private
from nbfsdp.kernel.cluster.forkserver import ForkServer, ForkServerError
from nbfsdp.kernel.cluster.world import ENGINE_START_TIMEOUT

#: The controller's heartbeat. It registers an engine at the second beat after the engine connects, so at
#: ipyparallel's 3 s a cold start idles up to 6 s; an engine silent for 30 s is still dropped, as before.
HEARTBEAT_MS = 500
HEARTBEAT_MISSES = 30_000 // HEARTBEAT_MS


#: No nanny: ipyparallel's nanny is a second process an engine starts and waits for (Python, zmq and ipyparallel
#: imported anew, 0.3 s of CPU an engine, measured) to relay signals to engines on other hosts and to tell the
#: controller at once when its engine dies. The kernel signals these engines itself (they are its fork server's
#: children on this machine) and hears their deaths from the fork server.
#:
#: The registration timeout: at ipyparallel's 5 s an engine whose controller (on this machine, its connection
#: files written) was too busy to answer that soon gave up and exited, and the cell waited out its whole start
#: time for an engine that was gone (seen in CI on a loaded machine, reproduced by stopping the controller for
#: 6 s). A controller here is late, not absent: the engine waits as long as the kernel waits for it.
ENGINE_REGISTRATION_FLAG = f"--IPEngine.timeout={ENGINE_START_TIMEOUT:.0f}"
ENGINE_FLAGS = ("--IPEngine.enable_nanny=False", ENGINE_REGISTRATION_FLAG)

#: The controller's side of the same: once it has answered an engine's registration it waits ipyparallel's 30 s
#: for that engine's first heartbeat (which starts after the engine has built its IPython shell), then forgets
#: the engine without telling it; the engine beats on, unheard, and never counts as registered (reproduced by
#: stopping the engines for 35 s once the first registration was accepted: the cell waited out its start time).
#: An engine late to beat on a loaded machine is late, not gone.
CONTROLLER_REGISTRATION_FLAG = f"--IPController.registration_timeout={ENGINE_START_TIMEOUT:.0f}"

#: The kernel's client waits as long for the controller's first reply (ipyparallel's 10 s), for the same reason.
CLIENT_TIMEOUT = ENGINE_START_TIMEOUT

#: How long a started controller has to finish writing the connection files it has opened (milliseconds on an idle
#: machine).
CONNECTION_FILES_TIMEOUT = 30.0


def wait_for_connection_files(cluster: ipp.Cluster, then: str) -> None:
    """Until the started controller has written its connection files whole, before ``start_engines`` reads them:
    ipyparallel reads a partial file only twice, 0.5 s apart, which a controller descheduled between its open and
    its write outlasted (json's ``Expecting value`` as the cell's error, in a quiet fresh-clone run). ``then``: what
    the user's next step does, said in the error when the files stay partial."""
    from IPython.core.error import UsageError

    try:
        ipyparallel_private.wait_for_connection_files(cluster, CONNECTION_FILES_TIMEOUT)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"nbfsdp: the controller did not finish writing its connection files within "
            f"{CONNECTION_FILES_TIMEOUT:.0f} s ({error}); {then}"
        ) from None


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the engine set's fork server."""

    def start(self) -> None:
        env = os.environ.copy()
        env.update(self.get_env())
        argv = ["ipengine", *ipyparallel_private.engine_arguments(self), *ENGINE_FLAGS]
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
    """A set of engines forked by ``fork_server`` (pass it to ``ipyparallel.Cluster.start_engines``)."""

    launcher_class = ForkedEngineLauncher
    fork_server = Instance(ForkServer)


def forked_cluster(private_dir: str) -> ipp.Cluster:
    """A cluster, not yet started, whose controller listens on loopback with ``private_dir`` as its profile, and
    whose engines a fork server forks (``start_engines_sync(..., fork_server=...)``)."""
    return ipp.Cluster(
        profile_dir=private_dir,
        controller_ip="127.0.0.1",
        engine_launcher_class=ForkedEngineSetLauncher,
        # engines that end are nbfsdp's to report (a RankError says how a rank died); at WARNING,
        # ipyparallel would print engine logs into the cell each time nbfsdp ends engines on purpose
        log_level=logging.ERROR,
        controller_args=[
            # ipyparallel passes the profile in the environment; on the command line it names the cluster
            # for the reaper, in the controller and in the schedulers it forks
            f"--profile-dir={private_dir}",
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
            CONTROLLER_REGISTRATION_FLAG,
            # no task database: ipyparallel's default keeps every request's and result's buffers (each
            # cell's shards and gathered state, up to 1 GiB) in the controller, and nbfsdp never reads it
            "--nodb",
        ],
    )
