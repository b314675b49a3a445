"""Processes, exactly: signals reach a process by pid and start time, a failed background start leaves
nothing running, and the fork server's engines end with it. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nbfsdp.kernel.cluster.forkserver import ForkServer
from nbfsdp.shared import processes
from nbfsdp.shared.processes import ProcessRef
from tests.conftest import gone, left_behind, removed

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "psutil"])
def test_a_process_ref_signals_only_the_process_that_started_at_its_time(monkeypatch, pidfd):
    if not pidfd:  # where the system has no pidfds, psutil checks the pid before the signal
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    sleeper = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ref = ProcessRef.of(sleeper.pid)
        assert ref is not None and ref.alive()
        other = ProcessRef(sleeper.pid, ref.started - 30.0)  # what a ref to a former owner of the pid holds
        assert not other.alive() and other.process() is None
        assert other.signal(signal.SIGKILL) is False
        assert sleeper.is_running() and not gone(sleeper.pid)  # untouched
        assert ref.signal(signal.SIGKILL) is True
        monkeypatch.undo()  # psutil's wait uses pidfds itself
        assert sleeper.wait(10) == -signal.SIGKILL
        assert not ref.alive() and ref.signal(signal.SIGKILL) is False  # ended: nothing to signal
    finally:
        monkeypatch.undo()
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_a_process_ref_of_no_process_is_none():
    finished = psutil.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    assert ProcessRef.of(finished.pid) is None or not ProcessRef.of(finished.pid).alive()


def _waiting_engine(server: ForkServer, directory: str) -> int:
    """An engine that waits (up to a minute) for a connection file that never comes: alive, harmless."""
    argv = ["ipengine", f"--file={directory}/never.json", "--IPEngine.wait_for_url_file=60"]
    return server.spawn(argv, dict(os.environ), cwd=directory, output=f"{directory}/engine.log")


@pytest.mark.parametrize("how", ["stop", "SIGTERM", "SIGKILL"])
def test_the_fork_servers_engines_end_with_it(tmp_path, how):
    server = ForkServer(dict(os.environ), str(tmp_path))
    try:
        engines = [_waiting_engine(server, str(tmp_path)) for _ in range(2)]
        for pid in engines:
            assert psutil.Process(pid).ppid() == server.pid
            # the start time the server read as it forked, which every later signal checks
            assert server.engine(pid) == ProcessRef.of(pid)
        assert server.engine(os.getpid()) is None  # not one of its engines
        if how == "stop":
            server.stop()  # closes its stdin: what ``%fsdp stop`` and a kernel's death do
        else:
            psutil.Process(server.pid).send_signal(getattr(signal, how))  # SIGKILL: Linux's parent-death signal
        assert left_behind([server.pid, *engines], 10) == []
    finally:
        server.stop()


def test_a_failed_background_start_stops_all_it_started_and_keeps_its_error(tmp_path):
    """The engines start, then fail for real (gloo told to use a network interface that does not exist):
    the controller, the engines, the fork server and the reaper all end, and the error stays for ``%fsdp
    status``. A kernel of its own, so that every process it started can be watched."""
    script = textwrap.dedent(
        """
        import json, threading, time
        import psutil
        from nbfsdp.shared import processes
        from nbfsdp.kernel.cluster.local import FSDPCluster

        me, seen, done = psutil.Process(), set(), threading.Event()

        def watch():  # every process the start ever had under this one, engines' helpers included
            while not done.is_set():
                for child in me.children(recursive=True):
                    seen.add(child.pid)
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()
        cluster = FSDPCluster()
        cluster.start_in_background(2, 30.0)
        running = cluster.running  # waits for the background start
        done.set()
        print(json.dumps({
            "running": running,
            "world": cluster.world is not None,
            "error": repr(cluster.background_error),
            "seen": sorted(seen),
            "left": [p.pid for p in me.children(recursive=True) if processes.alive(p.pid)],
        }))
        """
    )
    before = {p.pid for p in psutil.process_iter()}
    env = dict(os.environ, GLOO_SOCKET_IFNAME="nbfsdp-no-such-interface", NBFSDP_PREWARM="0")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=100, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["running"] and not result["world"]
    assert "nbfsdp-no-such-interface" in result["error"]  # kept, for ``%fsdp status``
    assert len(result["seen"]) >= 4  # reaper, fork server, controller, engines: it did get that far
    assert result["left"] == []  # no child of the "kernel" still running when the start had failed
    assert left_behind(set(result["seen"]) - before, 10) == []  # nor anything it ever started, later


def test_status_shows_why_the_background_start_failed(shell, capsys):
    """What ``%fsdp status`` prints once a background start has failed: the error it kept."""
    from nbfsdp.kernel.cluster.local import FSDPCluster
    from nbfsdp.kernel.magics import FSDPMagics

    cluster = FSDPCluster()  # never started: the state a failed start leaves
    cluster.background_error = RuntimeError("no engines today")
    FSDPMagics(shell, cluster).fsdp_line("status")
    assert "the background start failed: no engines today" in capsys.readouterr().out


def test_stop_kills_what_still_runs_for_the_cluster_and_reaps_the_reaper():
    from nbfsdp.kernel.cluster.local import FSDPCluster

    cluster = FSDPCluster()
    cluster.start_fork_server()
    directory, watcher, server = cluster._private_dir, cluster._reaper.pid, cluster._fork_server.pid
    # a controller-like process that an orderly stop does not know of (the kind a start killed half-way leaves)
    stray = psutil.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "ipyparallel", f"--profile-dir={directory}"]
    )
    started = time.monotonic()
    cluster.stop()
    assert time.monotonic() - started < 8
    assert stray.wait(5) == -signal.SIGKILL
    assert gone(server) and not psutil.pid_exists(watcher)  # the reaper is reaped, not left a zombie
    assert removed(directory, 1) and processes.cluster_processes(directory) == []


def test_a_local_engine_is_one_process_with_no_nanny(shell, cluster):
    """ipyparallel's nanny (a process each engine starts and waits for: 0.3 s of CPU) is left out on this
    machine: the kernel signals its fork server's engines itself."""
    shell.run_cell_magic("fsdp", "--world-size 2", "x = 1")
    engines = psutil.Process(cluster._fork_server.pid).children()
    assert len(engines) == 2
    assert [engine.children() for engine in engines] == [[], []]
