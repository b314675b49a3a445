"""Every private or internal ipyparallel API nbfsdp relies on, in one place (kernel side): its launchers'
internals, and the names of the files a running cluster leaves in its profile.

nbfsdp's engines are forked by its fork server (``nbfsdp.kernel.cluster.launcher``), not started by
ipyparallel, and ipyparallel has no public hook for a launcher whose process it did not start, nor a
public list of the processes a ``Cluster`` runs. Each function says what it relies on;
``tests/test_ipyparallel_private.py`` calls each one on real ipyparallel objects, so a release that
moves one fails there, by name. Read in the source of ipyparallel 7.1.0, 8.0.0, 8.6.1, 9.0.0, 9.0.1,
9.1.0 and 9.2.0: each is the same in all of them.

What a launcher is built with (``parent``, ``work_dir``, ``output_file``, ``identifier``,
``get_env()``) and ``notify_start`` / ``notify_stop`` / ``on_stop`` are the launcher's documented
interface and are used directly. Importing this module loads no ipyparallel.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ipyparallel as ipp
    import psutil
    from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalProcessLauncher

__all__ = [
    "adopt_process",
    "catch_up_registrations",
    "controller_failure",
    "engine_arguments",
    "engine_connection_file",
    "launched_pids",
    "read_engine_connection",
    "read_whole_json",
    "running_cluster_ids",
    "unbound_ports",
    "wait_for_connection_files",
    "watch_exit",
]


def engine_arguments(launcher: LocalEngineLauncher) -> list[str]:
    """The engine's command line after its program (``python -m ipyparallel.engine``), for another way to run it.

    Relies on ``LocalEngineLauncher.find_args()`` being ``engine_cmd + cluster_args + engine_args``; a
    release that put anything before ``engine_cmd`` would hand the engine a wrong command line.
    """
    return list(launcher.args[len(launcher.engine_cmd) :])


def adopt_process(launcher: LocalProcessLauncher, process: psutil.Process) -> None:
    """Make ``process`` the launcher's, as ``LocalProcessLauncher.start`` does after its ``Popen``; then it
    is running.

    Relies on ``pid`` (saved in the cluster file) and ``process``, the ``psutil.Process`` that
    ``signal()`` (and so ``stop()`` and ``ipyparallel.Cluster.signal_engines``) sends to: without it, they fail.
    """
    launcher.pid = process.pid
    launcher.process = process
    launcher.notify_start(process.pid)


def watch_exit(launcher: LocalProcessLauncher, wait_for_exit: Callable[[], int | None]) -> None:
    """Watch the launcher's process on ipyparallel's wait thread, with ``wait_for_exit`` (blocks, returns the
    exit code) in place of psutil's wait, which only the process's parent can use.

    Relies on ``_start_waiting()`` starting a thread on ``self._wait``, which ``join()`` (so ``stop()``
    and ``ipyparallel.Cluster.stop_engines``) waits for; the thread ends by calling ``notify_stop`` on the
    launcher's ``loop`` with ``exit_code``, ``pid`` and ``identifier``, which fires the ``on_stop``
    callbacks (the engine set's count of running engines). If ``_wait`` were no longer the thread's
    target, the exit code would be psutil's (None for a process that is not ours).
    """

    def wait() -> None:
        exit_code = wait_for_exit()
        stop_data = {"exit_code": exit_code, "pid": launcher.pid, "identifier": launcher.identifier}
        launcher.loop.add_callback(lambda: launcher.notify_stop(stop_data))

    launcher._wait = wait
    launcher._start_waiting()


def launched_pids(cluster: ipp.Cluster) -> list[int]:
    """The process ids of the cluster's controller, then of each engine it started (by engine set).

    Relies on ``ipyparallel.Cluster.controller`` and ``ipyparallel.Cluster.engines`` (engine set id ->
    launcher; ipyparallel calls both "private state"), on an engine set's ``launchers`` (identifier -> engine
    launcher) and on each launcher's ``pid``. An engine that ended may still be listed: the set drops it only
    when its stop notice runs on the loop it was started on, which a ``_sync`` call outside a running loop
    closes.
    """
    return [launcher.pid for launcher in [cluster.controller, *_engine_launchers(cluster)]]


def _engine_launchers(cluster: ipp.Cluster) -> list[LocalEngineLauncher]:
    return [launcher for engine_set in cluster.engines.values() for launcher in engine_set.launchers.values()]


def controller_failure(cluster: ipp.Cluster) -> str | None:
    """The error that ended one of the controller's queues as it started, or None when none did.

    The controller forks a process for each queue (``zmq.devices.ProcessMonitoredQueue``), which binds the port
    the controller chose for it moments before, by binding port 0 and closing it (``select_random_ports``). On a
    busy machine another program may take the port in between; the queue's process then ends with ``ZMQError:
    Address already in use`` while the controller and its engines go on, and every request through that queue
    waits forever (seen once in a fresh-clone suite, three clusters starting at once on 2 cores: the first
    ``apply_sync`` never returned). Relies on the controller launcher's ``output_file``, where ipyparallel sends
    the controller's output and with it the queue process's traceback; read while ``unbound_ports`` still
    names the queue's port.
    """
    try:
        with open(cluster.controller.output_file, errors="replace") as log:
            lines = log.read().splitlines()
    except OSError:
        return None
    if not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    errors = [line for line in lines if line and not line[0].isspace() and "Error" in line.partition(":")[0]]
    return errors[-1] if errors else "a traceback in its log"


def unbound_ports(cluster: ipp.Cluster) -> list[tuple[str, int]]:
    """The ports the controller's connection files name that none of its processes listens on yet, by name
    (``engine mux``...); [] once each queue's process has bound its own.

    A queue's process that never binds is a controller whose requests through it wait forever. Besides a port
    taken first (``controller_failure``), seen once in a fresh-clone suite: the controller forks its queues'
    processes while its own zmq threads run, and the mux queue's process was stuck for good in libc's
    ``random()``, whose lock one of those threads held at the fork. Relies on the controller launcher's
    ``connection_files`` (kind -> path, the files ``get_connection_info`` reads; read in 9.0.0 and 9.2.0) and
    ``pid``; psutil's ``net_connections`` lists which process listens where (all for root, this user's else).
    """
    import psutil

    try:
        controller = psutil.Process(cluster.controller.pid)
        tree = {controller.pid, *(child.pid for child in controller.children(recursive=True))}
    except psutil.NoSuchProcess:
        return [("controller", 0)]
    named: list[tuple[str, int]] = []
    for kind, path in cluster.controller.connection_files.items():
        for name, value in json.loads(Path(path).read_text()).items():
            ports = value if isinstance(value, list) else [value]
            named += [(f"{kind} {name}", port) for port in ports if isinstance(port, int)]
    listening = {
        each.laddr.port
        for each in psutil.net_connections(kind="tcp")
        if each.status == psutil.CONN_LISTEN and each.pid in tree
    }
    return [(name, port) for name, port in named if port not in listening]


def engine_connection_file(security_dir: str | Path, cluster_id: str) -> Path:
    """The file a running controller wrote for its engines: where it listens, and its CurveZMQ key if any.

    Relies on ``IPController.engine_json_file``: ``ipcontroller-<cluster id>-engine.json`` in the profile's
    security directory, ``ipcontroller-engine.json`` for the empty cluster id. Read instead of
    ``ipyparallel.Cluster.from_file``, which would restore the cluster's launchers here (an SSH launcher then watches
    every engine over ssh from this kernel, once a minute).
    """
    name = f"ipcontroller-{cluster_id}" if cluster_id else "ipcontroller"
    return Path(security_dir, f"{name}-engine.json")


def read_engine_connection(security_dir: str | Path, cluster_id: str, wait_s: float = 10.0) -> dict:
    """The engine connection file's contents, once the controller has finished writing it (``read_whole_json``)."""
    return read_whole_json(engine_connection_file(security_dir, cluster_id), wait_s)


def read_whole_json(path: str | Path, wait_s: float) -> dict:
    """A connection file's contents, once the controller has finished writing it.

    Relies on ``IPControllerApp.save_connection_dict`` writing the file in place (open, write, chmod), not by a
    rename: a controller that has just started shows an empty or partial file for a moment (read as ``''`` in a
    CI run). ipyparallel's own read (``ControllerLauncher.get_connection_info``, as engines start) tries again once,
    after 0.5 s, which a loaded machine's controller outlasted between its open and its write. Waits up to
    ``wait_s`` for whole JSON, then raises what the last read raised (``OSError`` or ``ValueError``).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def wait_for_connection_files(cluster: ipp.Cluster, wait_s: float) -> None:
    """Until a started controller's connection files hold whole JSON (``read_whole_json``), for
    ``ipyparallel.Cluster.start_engines``, which reads them once. Relies on ``ControllerLauncher.connection_files``
    naming them (``{"client": path, "engine": path}``); raises what a read that ran out of ``wait_s`` raised."""
    for path in cluster.controller.connection_files.values():
        read_whole_json(path, wait_s)


def running_cluster_ids(security_dir: str | Path) -> list[str]:
    """The ids of the clusters running in a profile, sorted.

    Relies on ``ipyparallel.Cluster.cluster_file``'s default, ``cluster-<cluster id>.json`` in the profile's security
    directory, written while the cluster runs and removed when it stops.
    """
    return sorted(p.name[len("cluster-") : -len(".json")] for p in Path(security_dir).glob("cluster-*.json"))


def catch_up_registrations(cluster: ipp.Cluster, client: ipp.Client) -> None:
    """Tell ``client`` of the engines the controller has registered that it has not heard of.

    A client learns of each registration from a notification the controller publishes (PUB/SUB), and a client
    whose subscription was still being set up when the notification went out never hears of that engine: its
    ``ids`` stay short and ``wait_for_engines`` waits for ever (seen in fresh-clone suite runs on a loaded machine,
    the client connected 0.13 s before both engines finished registering: "0 of 2 engines registered within
    120 s" while the controller's log said both were connected). Relies on the controller's engine state file
    (``engines{cluster_id}.json`` in its profile's log directory: ``{"engines": {id: uuid}}``, rewritten at each
    registration by ``Hub._save_engine_state``) and on ``Client._update_engines``, which a registration
    notification calls, run here on the client's own loop as a notification's would be.
    """
    path = Path(cluster.profile_dir, "log", f"engines{cluster.cluster_id}.json")
    try:
        registered = json.loads(path.read_text())["engines"]
    except (OSError, ValueError, KeyError):  # not written yet, or being rewritten
        return
    missed = {eid: uuid for eid, uuid in registered.items() if int(eid) not in client.ids}
    if missed:
        client._io_loop.add_callback(client._update_engines, missed)
