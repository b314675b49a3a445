"""Each private ipyparallel API nbfsdp relies on (``nbfsdp.kernel.cluster.ipyparallel_private``), called directly.

An ipyparallel release that moves one fails here, by name: on a real launcher watching a short real
process, and on a real ``ipp.Cluster`` (controller and one engine). tests/test_forkserver.py shows what
they are for (engines forked by the fork server, stopped and reported by ipyparallel).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import ipyparallel as ipp
import psutil
import pytest
from ipyparallel.cluster.launcher import LocalEngineLauncher

from nbfsdp.kernel.cluster import ipyparallel_private
from tests.conftest import left_behind

pytestmark = pytest.mark.timeout(60)


def test_engine_arguments_are_the_command_line_after_the_program(tmp_path):
    launcher = LocalEngineLauncher(profile_dir=str(tmp_path), cluster_id="c1", engine_args=["--log-level=20"])
    arguments = ipyparallel_private.engine_arguments(launcher)
    assert launcher.args == [*launcher.engine_cmd, *arguments]  # what ipyparallel would run
    assert launcher.engine_cmd[-2:] == ["-m", "ipyparallel.engine"] and "ipyparallel.engine" not in arguments
    assert arguments == [*launcher.cluster_args, "--log-level=20"]


def test_an_adopted_process_is_signalled_stopped_and_reported_with_our_exit_code(tmp_path):
    """What ipyparallel does with an engine the fork server forked: signal it through the adopted process,
    wait on our function, and report its exit code to the on_stop callbacks."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours_returned = threading.Event()

    def wait_for_exit() -> int:
        child.wait()
        ours_returned.set()
        return 42  # not the child's status (-SIGTERM), which ipyparallel's own wait would report

    async def drive() -> tuple[list[dict], bool, str]:
        # a stop that cannot signal fails in seconds, not at ipyparallel's minute
        launcher = LocalEngineLauncher(
            profile_dir=str(tmp_path), identifier="0", stop_seconds_until_kill=1, stop_timeout=1
        )
        stopped: list[dict] = []
        launcher.on_stop(stopped.append)
        ipyparallel_private.adopt_process(launcher, psutil.Process(child.pid))
        assert (launcher.state, launcher.pid) == ("running", child.pid)
        ipyparallel_private.watch_exit(launcher, wait_for_exit)
        await launcher.stop()  # SIGTERM through the adopted process, then join: our wait has returned
        joined = ours_returned.is_set()
        deadline = time.monotonic() + 5
        while not stopped and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # notify_stop runs on the launcher's loop, this one
        return stopped, joined, launcher.state

    try:
        stopped, joined, state = asyncio.run(drive())
    finally:
        child.kill()
        child.wait()
    assert stopped == [{"exit_code": 42, "pid": child.pid, "identifier": "0"}]
    assert state == "after"
    assert joined
    assert child.returncode == -signal.SIGTERM


def _end_groups(groups: set[int]) -> None:
    """The schedulers a controller forks outlive a controller that ipyparallel's stop had to kill (seen in loaded
    full runs: orphaned for the rest of the run, and once after it), and may be forked after their pids could be
    read: not what these tests check, so each launched process's group is ended, where they are."""
    for group in groups - {os.getpgid(0)}:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def test_a_running_cluster_is_found_by_its_files_in_the_profile(tmp_path):
    """What ``%fsdp attach`` reads of a cluster it did not start: its id, and its engines' connection file."""
    security = tmp_path / "security"
    cluster = ipp.Cluster(
        profile_dir=str(tmp_path), cluster_id="c1", controller_ip="127.0.0.1", log_level=logging.ERROR
    )
    groups: set[int] = set()
    try:
        cluster.start_controller_sync()
        groups = {os.getpgid(pid) for pid in ipyparallel_private.launched_pids(cluster)}
        assert ipyparallel_private.running_cluster_ids(security) == ["c1"]
        # written once the controller listens, in place: read at once, it can be missing or empty (CI, once)
        connection = ipyparallel_private.read_engine_connection(security, "c1", wait_s=30)
        assert "127.0.0.1" in connection["interface"]
    finally:
        cluster.stop_cluster_sync()
        _end_groups(groups)
    assert ipyparallel_private.running_cluster_ids(security) == []  # its file goes with it
    assert ipyparallel_private.engine_connection_file(security, "").name == "ipcontroller-engine.json"


def test_an_engine_connection_file_being_written_is_read_once_whole(tmp_path):
    """The controller writes it in place: a reader that comes early sees it empty, then half, then whole."""
    path = ipyparallel_private.engine_connection_file(tmp_path, "c1")
    path.write_text("")
    whole = '{"interface": "tcp://127.0.0.1", "key": "k"}'

    def write_slowly() -> None:
        time.sleep(0.3)
        path.write_text(whole[:10])
        time.sleep(0.3)
        path.write_text(whole)

    writer = threading.Thread(target=write_slowly)
    writer.start()
    try:
        assert ipyparallel_private.read_engine_connection(tmp_path, "c1", wait_s=10) == {
            "interface": "tcp://127.0.0.1",
            "key": "k",
        }
    finally:
        writer.join()
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):  # no such cluster: says so once the wait is over
        ipyparallel_private.read_engine_connection(tmp_path, "c2", wait_s=0.2)
    assert time.monotonic() - started < 5


def _command_line(pid: int, seconds: float = 10.0) -> list[str]:
    """A process's command line once it has one: ``start_engines_sync`` returns once the engine is launched, and
    a process that has just started can show none for a moment (psutil read ``[]``, the engine's status
    'running', in a quiet fresh-clone run)."""
    deadline = time.monotonic() + seconds
    while not (line := psutil.Process(pid).cmdline()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return line


def test_launched_pids_are_the_controller_then_each_engine(tmp_path):
    cluster = ipp.Cluster(profile_dir=str(tmp_path), controller_ip="127.0.0.1", log_level=logging.ERROR)
    pids: list[int] = []
    groups: set[int] = set()
    try:
        cluster.start_controller_sync()
        cluster.start_engines_sync(1)
        pids = ipyparallel_private.launched_pids(cluster)
        groups = {os.getpgid(pid) for pid in pids}
        # pids only: another test's child may be a zombie here, whose command line cannot be read
        children = {child.pid for child in psutil.Process().children()}
        assert len(pids) == 2 and set(pids) <= children  # the processes this cluster started
        controller, engine = pids
        assert "ipyparallel.controller" in _command_line(controller)
        assert "ipyparallel.engine" in _command_line(engine)
    finally:
        cluster.stop_cluster_sync()
        _end_groups(groups)
    assert left_behind(pids, 10) == []


def _free_ports(count: int) -> list[int]:
    """Ports free on loopback a moment ago (the controller binds them after: what ipyparallel itself does)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for each in sockets:
            each.bind(("127.0.0.1", 0))
        return [each.getsockname()[1] for each in sockets]


def test_a_queue_that_could_not_bind_its_port_is_named_from_the_controllers_log_and_its_port_unbound(tmp_path):
    """A port the controller chose, taken before its queue's process binds it: the controller and its engines
    run on, the queue is gone, and ``controller_failure`` names the error. Here the port is the engines' mux
    queue's (the third of ipyparallel's pool: registration, control, mux), held by this test."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = _free_ports(40)
    ports[2] = taken.getsockname()[1]
    broken = ipp.Cluster(
        profile_dir=str(tmp_path / "broken"),
        controller_ip="127.0.0.1",
        log_level=logging.ERROR,
        controller_args=[f"--ports={','.join(map(str, ports))}"],
    )
    healthy = ipp.Cluster(profile_dir=str(tmp_path / "healthy"), controller_ip="127.0.0.1", log_level=logging.ERROR)
    groups: set[int] = set()
    try:
        broken.start_controller_sync()
        groups |= {os.getpgid(pid) for pid in ipyparallel_private.launched_pids(broken)}
        deadline = time.monotonic() + 30
        while (failure := ipyparallel_private.controller_failure(broken)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert failure is not None and "Address already in use" in failure, failure
        assert str(ports[2]) in failure
        assert ports[2] in [port for _, port in ipyparallel_private.unbound_ports(broken)]  # this test listens there
        # a whole controller, asked once its engine has registered (when nbfsdp asks): nothing to name
        healthy.start_controller_sync()
        healthy.start_engines_sync(1)
        groups |= {os.getpgid(pid) for pid in ipyparallel_private.launched_pids(healthy)}
        with healthy.connect_client_sync() as client:
            client.wait_for_engines(1, timeout=60, interactive=False)
            assert client[:].apply_sync(os.getpid)  # the mux queue answers
        assert ipyparallel_private.controller_failure(healthy) is None
        assert ipyparallel_private.unbound_ports(healthy) == []  # every queue listens
    finally:
        taken.close()
        for cluster in (broken, healthy):
            with contextlib.suppress(Exception):
                cluster.stop_cluster_sync()
        _end_groups(groups)


def test_a_client_that_missed_a_registration_is_told_of_it_from_the_controllers_record(tmp_path):
    """The controller's engine state file names each registered engine by id and uuid, as the client knows it;
    a client that dropped the notification learns of the engine from it."""
    cluster = ipp.Cluster(profile_dir=str(tmp_path), controller_ip="127.0.0.1", log_level=logging.ERROR)
    pids: list[int] = []
    try:
        cluster.start_controller_sync()
        heard = cluster.connect_client_sync()
        deaf = cluster.connect_client_sync()
        deaf._notification_handlers["registration_notification"] = lambda message: None
        cluster.start_engines_sync(1)
        pids = ipyparallel_private.launched_pids(cluster)
        heard.wait_for_engines(1, timeout=30, interactive=False)
        time.sleep(0.5)  # the deaf client's notification, dropped by now
        assert deaf.ids == []
        ipyparallel_private.catch_up_registrations(cluster, deaf)
        deaf.wait_for_engines(1, timeout=5, interactive=False)
        assert deaf.ids == heard.ids == [0] and deaf._engines == heard._engines
        assert deaf[0].apply_sync(os.getpid) == pids[1]  # reached through the engine's uuid
        heard.close()
        deaf.close()
    finally:
        cluster.stop_cluster_sync()
    assert left_behind(pids, 10) == []
