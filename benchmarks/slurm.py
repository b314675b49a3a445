"""2 nodes x 2 ranks through a real Slurm (``benchmarks.slurm_hosts``: a slurmctld and a slurmd per node in
network namespaces): ``%fsdp attach --slurm`` against ``sbatch`` + ``srun torchrun`` on the same nodes.

- Ready: from ``%fsdp attach --slurm --nodes 2 --ranks-per-node 2`` to the end of the first ``%%fsdp`` cell (its
  world formed: every rank's process group up). A: a batch job of ``srun torchrun --nnodes 2 --nproc-per-node 2``
  (its store on the first node), from ``sbatch`` to rank 0 leaving its first collective (a barrier after
  ``init_process_group``; its wall clock, this machine's). No target: the two do different things before their
  ranks meet (ipyparallel's controller and engines, torchrun's agents and rendezvous); both say what Slurm's
  scheduling and ``srun`` cost on these nodes.
- Step time: the ``step_time`` loop and rows (``loops.CPU_FULL``) at world size 4 over the two nodes. A: the batch
  job above, its ranks running the loop (``benchmarks.torchrun_loop``), gloo on each node's ``eth0``. B: the
  ``%%fsdp`` cell on the attached job's ranks. Rounds in ``in_turn``'s order; during torchrun's turn every process
  of the attached session is stopped (``SIGSTOP``: its engines and nannies on the nodes, controller, kernel), as in
  ``benchmarks.hosts``. Figure: the median over rounds of each side's per-round median, B/A (target at most 1.05).

Each node has 4 CPUs in Slurm's eyes (``CR_CPU``), so the torchrun job (a task of 2 CPUs a node) runs beside the
attached one (2 tasks of one CPU a node); both share this machine's 2 cores, one side stopped while the other runs.
Skipped where Slurm cannot be made (``benchmarks.slurm_hosts.why_not()``). ``--quick``: the ready rows, one launch of
each, and no step-time rounds (the row says so). Run alone: ``python -m benchmarks --only slurm``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import psutil

from benchmarks import hosts, launch, loops, notebook_loop, slurm_hosts, step_time
from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, median

NAME = "slurm"
NODES = 2
RANKS_PER_NODE = 2
WORLD_SIZE = NODES * RANKS_PER_NODE
TARGET_RATIO = 1.05
ATTACH = f"%fsdp attach --slurm --nodes {NODES} --ranks-per-node {RANKS_PER_NODE}"
#: The torchrun job: a task a node, torchrun there starting that node's ranks, its node rank Slurm's node id and the
#: store on the first node (static rendezvous: c10d's looks the node's hostname up, which these nodes cannot).
BATCH = """#!/bin/sh
#SBATCH --nodes={nodes} --ntasks-per-node=1 --cpus-per-task={ranks} --output={output}
srun sh -c 'exec python -m torch.distributed.run --nnodes={nodes} --nproc-per-node={ranks} --node-rank=$SLURM_NODEID \\
    --master-addr={address} --master-port={port} -m benchmarks.torchrun_loop {config} {out}'
"""


def torchrun_job(
    cluster: slurm_hosts.SlurmHosts, sizes: loops.LoopSizes, ready_only: bool = False, timeout: float = 300
) -> dict:
    """One run of the torchrun job; rank 0's result, with ``ready_s``: from ``sbatch`` to rank 0 leaving its
    first collective (``ready_only``: then the job ends, no loop)."""
    first = cluster.nodes[0]
    port = hosts._free_port(cluster.machines, first)
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-slurm-torchrun-") as scratch:
        config, out, output = Path(scratch, "config.json"), Path(scratch, "out.json"), Path(scratch, "job.out")
        mark = "only" if ready_only else True
        config.write_text(json.dumps({**sizes.as_dict(), "device": "cpu", "mark_ready": mark}))
        script = Path(scratch, "torchrun.sbatch")
        script.write_text(
            BATCH.format(
                nodes=NODES, ranks=RANKS_PER_NODE, output=output, address=first.address, port=port,
                config=config, out=out,
            )
        )  # fmt: skip
        # the job's environment is this one's (sbatch exports it): torchrun's own thread default, this repository
        # on the path, gloo on the nodes' network
        env = {**launch.torchrun_env(cpu_only=True), "SLURM_CONF": str(cluster.conf), "TMPDIR": scratch}
        env["GLOO_SOCKET_IFNAME"] = hosts.INTERFACE
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `python` in the script: this one
        submitted = time.time()
        job = subprocess.run(
            ["sbatch", "--parsable", str(script)], env=env, cwd=launch.REPO, capture_output=True, text=True
        )
        # its end watched here, not with `sbatch --wait`, whose polls grow to several seconds apart
        deadline = time.monotonic() + timeout
        while job.returncode == 0 and cluster.command("squeue", "-h", "-j", job.stdout.strip()).stdout.strip():
            if ready_only and out.exists():  # its ranks met: what is measured; the job ends on its own
                break
            if time.monotonic() > deadline:
                cluster.command("scancel", job.stdout.strip())
                raise RuntimeError(f"the torchrun job took over {timeout:.0f} s")
            time.sleep(0.2)
        if job.returncode != 0 or not out.exists():
            tail = output.read_text(errors="replace")[-3000:] if output.exists() else ""
            raise RuntimeError(f"the torchrun job failed: {job.stderr}\n{tail}")
        result = json.loads(out.read_text())
    result["wall_s"] = time.time() - submitted  # sbatch to the job's end
    result["ready_s"] = result.pop("ready_at") - submitted
    return result


def _session(cluster: slurm_hosts.SlurmHosts, kernel: Kernel) -> dict[str, list[psutil.Process]]:
    """The attached session's processes, by part: its engines and nannies on the nodes (ipyparallel's, under
    slurmstepd, which goes on), and the kernel with everything below it (the controller, its schedulers)."""
    engines = []
    for pid in hosts._namespace_pids(cluster.machines):
        with suppress(psutil.Error):
            process = psutil.Process(pid)
            if any("ipyparallel" in part for part in process.cmdline()):
                engines.append(process)
    kernel_process = psutil.Process(kernel.pid)
    below = kernel_process.children(recursive=True)
    return {"kernel": [kernel_process, *below], "controller": [], "ssh": [], "waiters": [], "engines": engines}


def compare(kernel: Kernel, cluster: slurm_hosts.SlurmHosts, sizes: loops.LoopSizes, rounds: int) -> dict:
    """Alternate the torchrun job (A, the attached session stopped) and the ``%%fsdp`` cell (B)."""

    def torchrun_alone() -> dict:
        with hosts._paused(lambda: _session(cluster, kernel)):
            return torchrun_job(cluster, sizes)

    sides = {"torchrun": torchrun_alone, "%%fsdp": lambda: notebook_loop.run(kernel, WORLD_SIZE, sizes)}
    compared = step_time.alternate(sides, sizes, rounds)
    a_runs = compared.pop("torchrun_runs")
    del compared["fsdp_runs"]
    return {
        "world_size": WORLD_SIZE,
        "nodes": NODES,
        "sizes": sizes.as_dict(),
        **compared,
        "threads_torchrun": a_runs[0]["torch_threads"],
        "torchrun_ready_s": [run["ready_s"] for run in a_runs],
    }


def run(ctx: Context) -> dict:
    why = slurm_hosts.why_not()
    if why:
        return {"skipped": why}
    sizes = loops.CPU_QUICK if ctx.quick else loops.CPU_FULL
    rounds = ctx.rounds(full=8, quick=0)
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-slurm-") as scratch:
        directory = Path(scratch)
        with slurm_hosts.slurm(NODES, directory / "slurm", cpus_per_node=2 * RANKS_PER_NODE) as cluster:
            env = {**NO_PREWARM, **CPU_ONLY, "IPYTHONDIR": str(directory / "ipython"), "SLURM_CONF": str(cluster.conf)}
            kernel = Kernel(env=env)
            try:
                kernel.execute("%load_ext nbfsdp\nimport json, torch, torch.nn as nn, nbfsdp")
                attach = kernel.execute(ATTACH)
                first_cell = kernel.execute(f"%%fsdp {loops.cell_flags(WORLD_SIZE, sizes)}\npass")
                attach_ready = [attach.elapsed + first_cell.elapsed]
                torchrun_ready = [torchrun_job(cluster, sizes, ready_only=True)["ready_s"]]
                result = compare(kernel, cluster, sizes, rounds) if rounds else None
                if result is not None:
                    torchrun_ready += result["torchrun_ready_s"]
            finally:
                with suppress(Exception):
                    kernel.execute("%fsdp stop", timeout=60, check=False)
                ctx.shutdown(kernel)
    return {
        "measurements": [_ready_row(attach_ready, torchrun_ready), *_step_rows(result)],
        "rounds": rounds,
        "step_time": result,
        "attach_ready_s": attach_ready,
        "torchrun_ready_s": torchrun_ready,
    }


def _ready_row(attach_ready: list[float], torchrun_ready: list[float]) -> Measurement:
    return Measurement(
        what=f"slurm {NODES}x{RANKS_PER_NODE}: `{ATTACH}` to the first cell's ranks ready / sbatch + srun torchrun "
        "to rank 0's first collective",
        value=median(attach_ready) / median(torchrun_ready),
        unit="x",
        a_label="sbatch + srun torchrun",
        a=median(torchrun_ready),
        b_label="attach + first cell",
        b=median(attach_ready),
        ab_unit="s",
        note=f"no target (different start-ups on the same nodes); {len(attach_ready)} attach, "
        f"{len(torchrun_ready)} torchrun jobs",
    )


def _step_rows(result: dict | None) -> list[Measurement]:
    """``step_time``'s rows for the comparison against this benchmark's target; under ``--quick``, that row alone,
    not measured."""
    label = f"slurm {NODES}x{RANKS_PER_NODE} (ws{WORLD_SIZE}, gloo over {hosts.INTERFACE})"
    what = f"{label}: step time, %%fsdp / srun torchrun --nnodes {NODES} (median of round medians)"
    if result is None:
        note = "not measured under --quick: a round is two jobs of ~15 s; run `python -m benchmarks --only slurm`"
        return [Measurement(what=what, value=None, unit="x", target=TARGET_RATIO, op="<=", note=note)]
    rows = step_time.measurements(result, label)
    rows[0].what, rows[0].target = what, TARGET_RATIO
    return rows
