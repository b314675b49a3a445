"""A real Slurm on one machine, for the tests of clusters started through it: Debian's ``slurm-wlm`` (22.05) and
``munge``, a ``slurmctld`` and ``slurmd`` per node, each in a host of its own (``benchmarks.namespaces``: a
network namespace with its address on a bridge and its hostname).

No accounting daemon (``AccountingStorageType`` none), ``select/cons_tres`` over each node's CPUs, processes
tracked by process group (no cgroup is needed for that, but slurmd 22.05 starts its cgroup plugin anyway: each
slurmd mounts the v1 hierarchies it wants on a tmpfs of its own mount namespace, as ``CgroupAutomount`` lets it).
One ``munged`` serves every daemon through a socket in the run's directory, which the "nodes" share with the
machine, as they share the file system (the ipyparallel profile a job's engines read is there too). Making them
needs root: without it, or without the packages (``make test`` installs them), the tests that use them skip.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import namespaces

SLURMCTLD, SLURMD, MUNGED = "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"
PARTITION = "debug"
#: The same nodes under the name the walk-through in ``docs/guide/hosts.md`` uses.
GPU_PARTITION = "gpu"
#: A second partition on the same nodes, open to these accounts only (``AllowAccounts``; with no accounting daemon
#: Slurm knows no account, so a job there waits for ever: what nbfsdp checks before submitting is the list).
ACCOUNTS_PARTITION, ACCOUNTS = "teach", ("course", "research")
GPUS_PER_NODE = 4
FAKE_GPU_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random")
#: How long the daemons may take to show every node idle (a second, measured on 2 cores).
READY_SECONDS = 60
#: How long a daemon may take to end once told to, before it is killed (their state is thrown away with the run).
STOP_SECONDS = 2


@dataclass
class SlurmHosts:
    """The controller's host, the nodes, and the environment Slurm's commands need (``SLURM_CONF``)."""

    machines: namespaces.Hosts
    controller: namespaces.Host
    nodes: list[namespaces.Host]
    conf: Path
    cpus_per_node: int
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *command: str) -> subprocess.CompletedProcess:
        """A Slurm command (``sbatch``, ``squeue``, ``scontrol``...) from this machine, as a login node runs it."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True)

    def node_states(self) -> dict[str, str]:
        listed = self.command("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        return dict(zip(listed[::2], listed[1::2], strict=True))

    def jobs(self) -> list[str]:
        """The jobs in the queue, as ``JOBID STATE``."""
        return self.command("squeue", "-h", "-o", "%i %T").stdout.splitlines()


def why_not() -> str | None:
    """Why a Slurm cannot be made here, or None."""
    missing = [path for path in (SLURMCTLD, SLURMD, MUNGED) if not os.path.exists(path)]
    if missing:
        return f"{', '.join(missing)} missing (Debian's slurm-wlm and munge; `make test` installs them)"
    return namespaces.why_not()


@contextmanager
def slurm(nodes: int, directory: Path, cpus_per_node: int = 2) -> Iterator[SlurmHosts]:
    """A Slurm cluster of ``nodes`` nodes of ``cpus_per_node`` CPUs in partition ``debug``, every node idle; its
    daemons and hosts ended after."""
    directory.mkdir(parents=True, exist_ok=True)
    # the daemons' Unix sockets (munge's, each slurmstepd's in its spool) under a short path: a socket's path has
    # at most 108 bytes, and a test's or a benchmark's temporary directory can be deep
    sockets = Path(tempfile.mkdtemp(prefix="nbfsdp-slurm-", dir="/tmp"))
    with namespaces.hosts(nodes + 1, directory / "hosts") as machines:
        controller, *node_hosts = machines.hosts
        cluster = SlurmHosts(machines, controller, node_hosts, directory / "slurm.conf", cpus_per_node)
        try:
            socket = _start_munged(directory, sockets / "munge.socket")
            _write_config(cluster, directory, socket, sockets)
            cluster.daemons["slurmctld"] = _in_host(
                controller, f"exec {SLURMCTLD} -D -i -f {cluster.conf}", directory / "slurmctld.out", cluster.env
            )
            for node in node_hosts:
                (sockets / f"spool-{node.name}").mkdir()
                # slurmd 22.05 starts its cgroup plugin whatever tracks the processes: v1 hierarchies mounted here
                mount = "mount -t tmpfs tmpfs /sys/fs/cgroup"
                start = f"{mount} && exec {SLURMD} -D -N {node.name} -f {cluster.conf}"
                cluster.daemons[node.name] = _in_host(node, start, directory / f"slurmd-{node.name}.out", cluster.env)
            _wait_idle(cluster, directory)
            yield cluster
        finally:
            for process in cluster.daemons.values():
                process.terminate()
            for process in cluster.daemons.values():
                try:
                    process.wait(STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            with suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.kill(int((directory / "munged.pid").read_text()), 15)
            shutil.rmtree(sockets, ignore_errors=True)


def _start_munged(directory: Path, socket: Path) -> Path:
    """munge's daemon for this run alone: its own key in ``directory``, its socket ``socket``."""
    key = directory / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    subprocess.run(
        [
            MUNGED,
            "--force",  # as root, which munged otherwise refuses
            f"--socket={socket}",
            f"--key-file={key}",
            f"--pid-file={directory / 'munged.pid'}",
            f"--log-file={directory / 'munged.log'}",
            f"--seed-file={directory / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
    )
    return socket


def _write_config(cluster: SlurmHosts, directory: Path, socket: Path, spools: Path) -> None:
    (directory / "state").mkdir()
    (directory / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
    # GPUs a node says it has, so that Slurm binds them to tasks (CUDA_VISIBLE_DEVICES) as it does real ones: device
    # files that exist on every machine stand for them (the way Slurm's own test suite fakes GPUs)
    fake = ",".join(FAKE_GPU_FILES[:GPUS_PER_NODE])
    (directory / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={fake}\n")
    names = ",".join(node.name for node in cluster.nodes)
    lines = [
        "ClusterName=nbfsdp",
        f"SlurmctldHost={cluster.controller.name}({cluster.controller.address})",
        "AuthType=auth/munge",
        f"AuthInfo=socket={socket}",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={spools}/spool-%n",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory}/slurmd-%n.pid",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory}/slurmd-%n.log",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",  # the nodes are as configured, whatever this machine has
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        "GresTypes=gpu",
        *(
            f"NodeName={node.name} NodeAddr={node.address} CPUs={cluster.cpus_per_node} RealMemory=1000 "
            f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            for node in cluster.nodes
        ),
        f"PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP",
        f"PartitionName={GPU_PARTITION} Nodes={names} MaxTime=INFINITE State=UP",
        f"PartitionName={ACCOUNTS_PARTITION} Nodes={names} State=UP AllowAccounts={','.join(ACCOUNTS)}",
    ]
    cluster.conf.write_text("\n".join(lines) + "\n")


def _in_host(host: namespaces.Host, command: str, output: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in ``host``: its network, its hostname, a mount namespace of its own."""
    shell = f"hostname {host.name} && {command}"
    return subprocess.Popen(
        ["ip", "netns", "exec", host.name, "unshare", "--uts", "--mount", "sh", "-c", shell],
        env=env,
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
    )


def _wait_idle(cluster: SlurmHosts, directory: Path) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while set(cluster.node_states().values()) != {"idle"} or len(cluster.node_states()) != len(cluster.nodes):
        ended = [name for name, process in cluster.daemons.items() if process.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "".join(path.read_text()[-800:] for path in sorted(directory.glob("*.out")))
            raise RuntimeError(f"Slurm did not come up ({', '.join(ended) or 'nodes not idle'}):\n{logs}")
        time.sleep(0.2)
