"""``%fsdp attach --slurm``: the ranks started as one Slurm job from the notebook, then attached as any running
cluster is (``nbfsdp.kernel.cluster.attached``). Runs in the kernel.

The engines are ipyparallel's own ``SlurmEngineSetLauncher`` job (``sbatch``, one ``srun`` step of nodes x
ranks-per-node engines), its batch script written here from the flags. The controller runs on this machine and
listens on its address toward the partition's nodes (the address its route to the first node leaves from), never
every interface, with CurveZMQ on. Everything is checked before anything is submitted (``sinfo``, the partition's
accounts, ``sbatch --test-only``).

nbfsdp owns this job: ``%fsdp stop``, ``%unload_ext`` and the kernel's end cancel it, the last through the reaper
(``nbfsdp.helpers.reaper``), which finds the controller by its working directory (the job's private directory,
``--work-dir``) and cancels the job it names (``JOB_FILE``), however the kernel ended. ``%fsdp detach`` leaves the
job running and says how to cancel it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ipyparallel as ipp
from IPython.core.error import UsageError

from nbfsdp.kernel.cluster import ipyparallel_private, reaping
from nbfsdp.kernel.cluster.launcher import (
    CLIENT_TIMEOUT,
    CONTROLLER_REGISTRATION_FLAG,
    ENGINE_REGISTRATION_FLAG,
    wait_for_connection_files,
)
from nbfsdp.shared.network import source_address
from nbfsdp.shared.processes import SLURM_JOB_FILE, end_cluster

#: How often the job's state and the engines registered are looked at while it starts.
POLL_SECONDS = 0.5
#: Words of the reasons a pending job never leaves by itself (``squeue``'s ``%r``): held (a launch that failed is
#: requeued held), or refused by what its partition allows.
NEVER_STARTS = ("held", "not known", "InvalidAccount", "InvalidQOS", "PartitionConfig", "BadConstraints", "NotAllowed")


@dataclass(frozen=True)
class SlurmRequest:
    """``%fsdp attach --slurm``'s flags."""

    nodes: int
    ranks_per_node: int
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    account: str | None = None
    sbatch_args: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def options(self) -> list[str]:
        """The job's ``sbatch`` options from the flags (as the batch script and ``sbatch --test-only`` give them)."""
        options = [f"--nodes={self.nodes}", f"--ntasks-per-node={self.ranks_per_node}"]
        options += [f"--partition={self.partition}"] if self.partition else []
        options += [f"--time={self.time}"] if self.time else []
        options += [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else []
        options += [f"--account={self.account}"] if self.account else []
        return options + self.sbatch_args

    def batch_script(self, output: str) -> str:
        """The job's script, as ``SlurmEngineSetLauncher`` fills it (``{cluster_id}``, ``{program_and_args}``); the
        engines' output to ``output`` (``%j``: the job id)."""
        lines = ["#!/bin/sh", "#SBATCH --job-name=nbfsdp-{cluster_id}", "#SBATCH --export=ALL"]
        options = [*self.options, f"--output={output}"]
        return "\n".join([*lines, *(f"#SBATCH {option}" for option in options), "srun {program_and_args}", ""])


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: list[str]
    default: bool
    cpus: str
    """CPUs a node (``sinfo``'s ``%c``: ``4``, or ``4+`` where nodes differ)."""
    gres: str
    """Generic resources a node, GPUs among them (``gpu:2``; ``(null)`` where none)."""

    def __str__(self) -> str:
        gres = f", {self.gres}" if self.gres not in ("", "(null)") else ""
        return f"{self.name}{' (default)' if self.default else ''}: {len(self.nodes)} nodes of {self.cpus} CPUs{gres}"


def partitions() -> list[Partition]:
    """The partitions ``sinfo`` lists, each with its nodes; a UsageError where there is no Slurm here."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        raise UsageError("--slurm: no Slurm on the PATH here (sbatch, sinfo): run the notebook on a login node")
    listed = subprocess.run(["sinfo", "-h", "-N", "-o", "%P %N %c %G"], capture_output=True, text=True)
    if listed.returncode != 0:
        raise UsageError(f"--slurm: sinfo failed: {listed.stderr.strip()}")
    found: dict[str, Partition] = {}
    for line in listed.stdout.splitlines():
        name, node, cpus, gres = line.split()
        key = name.rstrip("*")
        found.setdefault(key, Partition(key, [], name.endswith("*"), cpus, gres)).nodes.append(node)
    return sorted(found.values(), key=lambda p: (not p.default, p.name))  # sinfo -N lists them in no set order


def check(request: SlurmRequest) -> Partition:
    """The partition the job goes to, checked against what Slurm offers before anything is submitted: the
    partition, its nodes, the accounts it allows, then the whole request by ``sbatch --test-only`` (CPUs and GPUs
    a node, the time limit, every ``--sbatch-arg``), each refusal naming what ``sinfo`` lists."""
    if request.nodes < 1 or request.ranks_per_node < 1:
        raise UsageError("--nodes and --ranks-per-node must be at least 1")
    offered = partitions()
    described = "; ".join(str(p) for p in offered)
    if request.partition is None:
        partition = next((p for p in offered if p.default), None)
        if partition is None:
            raise UsageError(f"--slurm: Slurm has no default partition: pass --partition (sinfo: {described})")
    else:
        partition = next((p for p in offered if p.name == request.partition), None)
        if partition is None:
            raise UsageError(f"--partition {request.partition}: no such partition (sinfo: {described})")
    if request.nodes > len(partition.nodes):
        raise UsageError(f"--nodes {request.nodes}: partition {partition.name} has {len(partition.nodes)} nodes")
    _check_account(request.account, partition.name)
    tried = subprocess.run(
        ["sbatch", "--test-only", *request.options, "--output=/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
    )
    if tried.returncode != 0:
        said = [line.split(": ", 1)[-1].removeprefix("error: ") for line in tried.stderr.splitlines() if line.strip()]
        raise UsageError(f"--slurm: Slurm refuses this job: {'; '.join(said)} (sinfo: {partition})")
    return partition


def _check_account(account: str | None, partition: str) -> None:
    """The accounts the partition allows or denies (``scontrol show partition``), and where Slurm keeps accounts
    (``sacctmgr``, with its database daemon) this user's. ``sbatch --test-only`` passes an account it would hold
    for ever with "Job's account not known", so this is checked here."""
    fields = _scontrol_show("partition", partition)
    allowed = fields.get("AllowAccounts", "ALL")
    if allowed != "ALL" and account not in allowed.split(","):
        given = f"--account {account}" if account else "no --account"
        raise UsageError(f"{given}: partition {partition} allows accounts {allowed.replace(',', ', ')}")
    if account and account in fields.get("DenyAccounts", "").split(","):
        raise UsageError(f"--account {account}: partition {partition} denies it")
    if not account or shutil.which("sacctmgr") is None:
        return
    user = getpass.getuser()
    listed = subprocess.run(
        ["sacctmgr", "-nP", "show", "associations", "where", f"user={user}", "format=account"],
        capture_output=True,
        text=True,
    )
    mine = sorted({line.strip() for line in listed.stdout.splitlines() if line.strip()})
    if listed.returncode == 0 and mine and account not in mine:
        raise UsageError(f"--account {account}: {user}'s accounts are {', '.join(mine)} (sacctmgr)")


def _scontrol_show(kind: str, name: str) -> dict[str, str]:
    """``scontrol show KIND NAME``'s fields (one line, ``Key=Value``; empty where Slurm knows no such one)."""
    shown = subprocess.run(["scontrol", "show", kind, "-o", name], capture_output=True, text=True)
    return dict(part.split("=", 1) for part in shown.stdout.split() if "=" in part)


def controller_address(partition: Partition) -> str:
    """This machine's address toward the partition's nodes: where the controller listens."""
    fields = _scontrol_show("node", partition.nodes[0])
    return source_address(fields.get("NodeAddr", partition.nodes[0]))


class SlurmJob:
    """The running job and its controller: its id, state and nodes; ``stop`` cancels it."""

    def __init__(self, cluster: ipp.Cluster, job_id: str, private_dir: str) -> None:
        self.cluster, self.job_id, self.private_dir = cluster, job_id, private_dir

    def state(self) -> tuple[str, str]:
        """The job's state and Slurm's reason (``squeue``); ('', '') once it has left the queue."""
        shown = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"], capture_output=True, text=True)
        state, _, reason = shown.stdout.strip().partition("|")
        return state, reason

    def ended(self) -> str:
        """'' while the job is queued or runs; else how it ended, as Slurm says it (``CANCELLED``, ``TIMEOUT``,
        ``NODE_FAIL``..., with its reason), read with ``scontrol`` (which keeps an ended job for ``MinJobAge``)."""
        fields = _scontrol_show("job", self.job_id)
        state, reason = fields.get("JobState", ""), fields.get("Reason", "None")
        if state in ("PENDING", "CONFIGURING", "RUNNING"):
            return ""
        return f"{state}{f', {reason}' if reason != 'None' else ''}" if state else "no longer known to Slurm"

    def nodes(self) -> str:
        shown = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%N"], capture_output=True, text=True)
        return shown.stdout.strip()

    def leave_running(self) -> None:
        """``%fsdp detach``: the job and its controller go on after the kernel; the reaper is told to let them be."""
        shutil.rmtree(self.private_dir, ignore_errors=True)

    def stop(self) -> None:
        """Cancel the job (ipyparallel's ``scancel``) and end the controller; the reaper is told it is over."""
        with contextlib.suppress(Exception):
            self.cluster.stop_cluster_sync()
        subprocess.run(["scancel", self.job_id], capture_output=True)
        end_cluster(self.private_dir)  # what a stop that failed (its engines gone) left: the controller, its schedulers


def start(request: SlurmRequest, profile: str) -> tuple[str, SlurmJob]:
    """Submit the job and start its controller; wait, saying the job's state as it changes, until every engine
    has registered. The cluster id, and the job."""
    partition = check(request)
    address = controller_address(partition)
    private_dir = tempfile.mkdtemp(prefix=f"{reaping.PRIVATE_DIR_PREFIX}slurm-")
    reaping.note_kernel(private_dir, os.getpid())
    reaping.start(os.getpid(), private_dir)
    cluster_id = f"slurm-{secrets.token_hex(4)}"
    cluster = ipp.Cluster(
        profile=profile,
        cluster_id=cluster_id,
        controller_ip=address,
        # the work directory: how the reaper finds it
        controller_args=[f"--work-dir={private_dir}", CONTROLLER_REGISTRATION_FLAG],
        engine_launcher_class="slurm",
        n=request.ranks,
        log_level=logging.WARNING,
        shutdown_atexit=False,  # the reaper ends it with the kernel, unless `%fsdp detach` left it running
    )
    log_dir = Path(cluster.profile_dir, "log")  # the profile's: where the nodes can write (a shared home)
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster.config.SlurmEngineSetLauncher.batch_template = request.batch_script(str(log_dir / "nbfsdp-%j.out"))
    # the script itself in the job's private directory, not in the notebook's (ipyparallel writes it in the cwd)
    cluster.config.SlurmEngineSetLauncher.batch_file_name = str(Path(private_dir, "engines.sbatch"))
    # a controller slow to answer (a busy login node) is waited for, as on one machine: at ipyparallel's 5 s the
    # engines gave up and exited, ending the job ("Slurm job N ended before its engines registered")
    cluster.config.SlurmEngineSetLauncher.engine_args = [ENGINE_REGISTRATION_FLAG]
    try:
        _note_job(private_dir, f"nbfsdp-{cluster_id}")  # before sbatch: the reaper cancels it by its name
        with _curve():
            cluster.start_controller_sync()
            wait_for_connection_files(cluster, then="the job was not submitted; attach again")
            cluster.start_engines_sync()
        launcher = next(iter(cluster.engines.values()))
        job = SlurmJob(cluster, str(launcher.job_id), private_dir)
        print(f"nbfsdp: Slurm job {job.job_id} submitted: {request.nodes} nodes x {request.ranks_per_node} ranks")
        _wait_for_engines(cluster, job, request.ranks, log_dir / f"nbfsdp-{job.job_id}.out")
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.stop_cluster_sync()
        shutil.rmtree(private_dir, ignore_errors=True)
        raise
    return cluster_id, job


def _wait_for_engines(cluster: ipp.Cluster, job: SlurmJob, ranks: int, output: Path) -> None:
    """Until every engine registered; the job's state and the engines said as they change. A job that leaves
    the queue first is a UsageError with its output's end."""
    client = cluster.connect_client_sync(timeout=CLIENT_TIMEOUT)
    said = ("", "", -1)
    try:
        while len(client.ids) < ranks:
            state, reason = job.state()
            now = (state, reason, len(client.ids))
            if now != said:
                print(
                    f"nbfsdp: Slurm job {job.job_id}: {state or 'ended'}"
                    + (f" ({reason})" if reason and reason != "None" else "")
                    + f"; engines registered: {len(client.ids)}/{ranks}",
                    file=sys.stderr,
                    flush=True,
                )
                said = now
            if not state:
                tail = output.read_text()[-2000:] if output.exists() else ""
                raise UsageError(f"Slurm job {job.job_id} ended before its engines registered:\n{tail}")
            if state == "PENDING" and any(word.lower() in reason.lower() for word in NEVER_STARTS):
                raise UsageError(f"Slurm job {job.job_id} would wait for ever ({reason}): cancelled")
            time.sleep(POLL_SECONDS)
            # a registration notice the client missed would leave this loop waiting with the job running
            ipyparallel_private.catch_up_registrations(cluster, client)
    finally:
        client.close()


@contextlib.contextmanager
def _curve() -> Iterator[None]:
    """CurveZMQ for the controller and the engines it is given to (``sbatch --export=ALL``), this start only."""
    before = os.environ.get("IPP_ENABLE_CURVE")
    os.environ["IPP_ENABLE_CURVE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("IPP_ENABLE_CURVE", None)
        else:
            os.environ["IPP_ENABLE_CURVE"] = before


def _note_job(private_dir: str, name: str) -> None:
    """What the reaper cancels (the job's name, known before it is submitted), with the Slurm configuration."""
    path = Path(private_dir, SLURM_JOB_FILE)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"name": name, "slurm_conf": os.environ.get("SLURM_CONF")}))
    partial.replace(path)
