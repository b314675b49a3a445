"""The engines come from the cluster's fork server: forked with torch imported, each with its own environment."""

from __future__ import annotations

import gc
import os
import signal

import psutil
import pytest

from nbfsdp.kernel.cluster.forkserver import ForkServer, ForkServerError
from nbfsdp.kernel.cluster.world import cpu_threads_per_rank
from tests.conftest import gone, run_ok

pytestmark = pytest.mark.timeout(120)


def test_each_engine_is_forked_by_the_fork_server_with_its_own_environment(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    server = cluster._fork_server
    engines = [psutil.Process(pid) for pid in cluster.world.pids]
    assert [engine.ppid() for engine in engines] == [server.pid, server.pid]
    assert all(os.getsid(engine.pid) == engine.pid for engine in engines)  # a session each, as ipyparallel's
    views = cluster.client[cluster.world.engine_ids]
    # the CPU world's, set in each engine after the fork (the server has the kernel's environment)
    assert views.apply_sync(os.getenv, "CUDA_VISIBLE_DEVICES") == ["", ""]
    assert views.apply_sync(os.getenv, "OMP_NUM_THREADS") == [str(cpu_threads_per_rank(2))] * 2
    # what the server imported is frozen: an engine's collections neither walk nor copy it
    assert all(count > 100_000 for count in views.apply_sync(gc.get_freeze_count))


def test_the_fork_server_reports_how_each_engine_ended(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    server, pid = cluster._fork_server, cluster.world.pids[1]
    os.kill(pid, signal.SIGKILL)
    assert server.wait(pid) == -signal.SIGKILL  # the engine is the server's child, not the kernel's
    assert server.wait(pid, timeout=0) == -signal.SIGKILL  # kept: asking again does not wait
    cluster.kill_engines()  # the next test starts a new world


def test_a_restart_forks_the_new_engines_from_the_same_fork_server(shell, cluster):
    """The server's imports are paid once: a restart (another size, a rank that died) reuses it."""
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    server, old_engines = cluster._fork_server, list(cluster.world.pids)
    cluster.kill_engines()  # what a rank's death or a broken world leads to: the next cell restarts the engines
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    assert cluster._fork_server is server and server.running
    assert not set(cluster.world.pids) & set(old_engines)
    assert [psutil.Process(pid).ppid() for pid in cluster.world.pids] == [server.pid, server.pid]


def test_a_fork_server_that_died_is_replaced_at_the_next_restart(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    dead = cluster._fork_server
    psutil.Process(dead.pid).kill()
    dead.wait(cluster.world.pids[0], timeout=10)  # returns once the server is gone
    cluster.kill_engines()
    run_ok(shell, "%%fsdp --world-size 2\nassert world_size == 2\n")
    assert cluster._fork_server is not dead and cluster._fork_server.running
    assert [psutil.Process(pid).ppid() for pid in cluster.world.pids] == [cluster._fork_server.pid] * 2


def test_a_fork_server_that_is_gone_is_a_clear_error(tmp_path):
    log = tmp_path / "forkserver.log"
    server = ForkServer(dict(os.environ), str(tmp_path))
    psutil.Process(server.pid).kill()
    with pytest.raises(ForkServerError, match=f"fork server .*{log}"):
        server.spawn(["ipengine"], dict(os.environ), cwd=str(tmp_path), output=str(tmp_path / "engine.log"))
    server.stop()
    assert gone(server.pid)
