"""Two hosts of two ranks: the ``step_time`` loop in ``%%fsdp`` on an attached cluster vs ``torchrun --nnodes 2``,
and the bytes each host receives while a model is sent to its ranks.

The hosts are Linux network namespaces on a bridge, each with its own hostname and sshd
(``benchmarks/namespaces.py``); ipyparallel's own SSH launcher starts two engines in each, its controller on the
bridge (``benchmarks.namespaces.ssh_cluster``). A kernel (``NBFSDP_PREWARM=0``) attaches to that cluster
(``%fsdp attach --profile P``): ranks 0 and 1 on the first host, 2 and 3 on the second, the world's
TCPStore on rank 0's host address, gloo over each host's ``eth0``.

- Step time: the ``step_time`` loop and its rows (``loops.CPU_FULL``, the same text, weights, batches and
  FSDP units) at world size 4 over the two hosts. A: ``torchrun --nnodes 2 --nproc-per-node 2
  --node-rank I --master-addr <host 0> --master-port <free port>`` started inside each namespace (``ip
  netns exec``), gloo on ``eth0``. B: the ``%%fsdp`` cell in the attached kernel (``nbfsdp.log`` each
  step, the dashboard on). Rounds in ``in_turn``'s order, each side with nothing of the other running:
  during torchrun's turn every process of the attached session is stopped (``SIGSTOP``, then ``SIGCONT``):
  engines, nannies, controller, kernel, and ipyparallel's SSH launcher's waits (one per engine, as
  ``ipcluster`` has: a Python on the engine's host waiting on its pid, started again over ssh every
  minute; new ones are stopped as they appear; the kernel starts none, ``%fsdp attach`` reading the
  connection files rather than ``Cluster.from_file``, and the idle row counts them to show it). The
  cluster stays up, as an attached one does, but takes no CPU. Figure: the median over rounds of each side's per-round
  median, B/A (target at most 1.05), with rank 0's CPU per step and loss parity as in ``step_time``;
  beside it, the cores other processes of the shared machine took during each turn, and the ratio over
  the rounds they left alone.
- Idle session: the cores each part of the attached session takes while no cell runs (no target).
- Transfer across hosts: the notebook builds a fresh ``nn.Sequential`` of ``Linear(W, W)`` (fp32) and one
  ``%%fsdp --no-gather`` cell (its body only logs each rank's local shard bytes) sends it to the ranks.
  Around that cell each namespace's ``/sys/class/net/eth0/statistics/rx_bytes`` is read (``ip netns
  exec``): the bytes that host received on the wire, everything included (Ethernet/IP/TCP headers,
  ipyparallel's messages, gloo). Divided by the sum of that host's ranks' local shard bytes as the ranks
  counted them (``p.to_local()``): target 1.00-1.05 (at most 1.05; below 1.00 the shards did not all
  cross the wire). One row per host, median over rounds (each round a fresh model).

Skipped where namespaces cannot be made (``benchmarks.namespaces.why_not()``: not root, no sshd). ``--quick``: the
hosts, the cluster, the attach, 3 s of the idle session and one transfer round of a 16.8 MB model; no
step-time rounds (their row says so), which would take the quick run past a minute on 2 cores. Run alone:
``python -m benchmarks --only hosts``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

from benchmarks import launch, loops, notebook_loop, step_time
from benchmarks import namespaces as namespace_hosts
from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, median

NAME = "hosts"
HOSTS = 2
RANKS_PER_HOST = 2
WORLD_SIZE = HOSTS * RANKS_PER_HOST
TARGET_RATIO = 1.05
TRANSFER_TARGET = 1.05
PROFILE = "nbfsdp-bench-hosts"
INTERFACE = "eth0"
RX_BYTES = f"/sys/class/net/{INTERFACE}/statistics/rx_bytes"
MiB = 2**20

TRANSFER_MODEL = (
    "torch.manual_seed({seed})\nbig = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({depth})])\n"
)
TRANSFER_CELL = f"""%%fsdp --world-size {WORLD_SIZE} --no-gather
nbfsdp.log(step=0, shard_bytes=sum(p.to_local().numel() * p.element_size() for p in big.parameters()))
"""
TRANSFER_READ = """_run = nbfsdp.last_run()
print(json.dumps({
    "model_bytes": sum(p.numel() * p.element_size() for p in big.parameters()),
    "shard_bytes": {m["rank"]: m["shard_bytes"] for m in _run.metrics},
    "hosts": [p.host for p in nbfsdp._magics.session.cluster.placements],
    "sent_bytes": _run.sent_bytes,
}))
"""


@contextmanager
def _ipython_dir(path: Path) -> Iterator[None]:
    """``IPYTHONDIR`` for this process while the cluster runs (its profile is found there by name)."""
    before = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = before


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _session_processes(machines: namespace_hosts.Hosts, cluster, kernel: Kernel) -> dict[str, list[psutil.Process]]:
    """What the attached session runs, by part. ``engines``: the processes inside the hosts that the SSH
    launcher left (engines, nannies: no longer below this process). ``waiters``: the remote halves of
    ipyparallel's SSH launchers' waits, one per engine for each ``Cluster`` that knows it (the one that
    started the cluster, as ``ipcluster`` would be; a kernel that restored the cluster with
    ``Cluster.from_file`` would add its own): a Python on each host, through sshd, waiting on its engine's
    pid (idle: a pidfd) and started again every minute; ``ssh``: their local halves, the ssh clients.
    ``controller``: the controller and its schedulers; ``kernel``: the kernel and everything below it
    (its drawing worker, its launchers' ssh clients). Not sshd itself, nor torchrun's nodes and ranks
    (below this process, and no sshd between)."""
    me = psutil.Process()
    parts: dict[str, list[psutil.Process]] = {"engines": [], "waiters": [], "ssh": [], "controller": [], "kernel": []}
    for pid in _namespace_pids(machines):
        process = _process(pid)
        with suppress(psutil.Error):
            if process is None or process.name().startswith("sshd"):
                continue
            ancestors = process.parents()
            if any(a.name().startswith("sshd") for a in ancestors):
                parts["waiters"].append(process)
            elif me.pid not in {a.pid for a in ancestors}:
                parts["engines"].append(process)
    kernel_process = _process(kernel.pid)
    below_kernel = kernel_process.children(recursive=True) if kernel_process else []
    for child in [*me.children(), *below_kernel]:
        with suppress(psutil.Error):
            if child.name() == "ssh":
                parts["ssh"].append(child)
    controller = cluster.controller.process
    parts["controller"] = [*controller.children(recursive=True), controller]
    parts["kernel"] = [p for p in below_kernel if p not in parts["ssh"]] + ([kernel_process] if kernel_process else [])
    return parts


@contextmanager
def _paused(list_processes: Callable[[], dict[str, list[psutil.Process]]]) -> Iterator[None]:
    """Every process ``list_processes`` names stopped (``SIGSTOP``: the kernel first, the engines last), and
    those it names later (the launchers start a new wait each minute) as they appear; then all continued,
    the engines first, so that neither side's heartbeat check sees the other silent for long."""
    stopped: list[psutil.Process] = []
    done = threading.Event()

    def stop_new() -> None:
        parts = list_processes()
        for name in ("kernel", "controller", "ssh", "waiters", "engines"):
            for process in parts[name]:
                if process not in stopped:
                    with suppress(psutil.Error):
                        process.send_signal(signal.SIGSTOP)
                        stopped.append(process)

    def watch() -> None:
        while not done.wait(1.0):
            with suppress(Exception):  # a process ending meanwhile; the next look sees the rest
                stop_new()

    watcher = threading.Thread(target=watch, name="pause-session", daemon=True)
    try:
        stop_new()
        watcher.start()
        yield
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join()
        for process in reversed(stopped):
            with suppress(psutil.Error):
                process.send_signal(signal.SIGCONT)


def _idle_cost(list_processes: Callable[[], dict[str, list[psutil.Process]]], seconds: float) -> dict[str, float]:
    """The cores each part of the attached session takes while no cell runs, over ``seconds``: processes
    alive at its end, those started within it counted whole (the launchers' restarts of their waits)."""

    def cpu() -> dict[str, dict[int, float]]:
        taken: dict[str, dict[int, float]] = {}
        for name, processes in list_processes().items():
            for process in processes:
                with suppress(psutil.Error):
                    t = process.cpu_times()
                    taken.setdefault(name, {})[process.pid] = t.user + t.system
        return taken

    before = cpu()
    started = time.perf_counter()
    time.sleep(seconds)
    after = cpu()
    elapsed = time.perf_counter() - started
    return {
        name: sum(t - before.get(name, {}).get(pid, 0.0) for pid, t in pids.items()) / elapsed
        for name, pids in after.items()
    }


def _free_port(machines: namespace_hosts.Hosts, host: namespace_hosts.Host) -> int:
    """A port free on ``host``'s address, asked inside its namespace."""
    probe = f"import socket; s = socket.socket(); s.bind(({host.address!r}, 0)); print(s.getsockname()[1])"
    done = machines.run(host, sys.executable, "-c", probe)
    if done.returncode != 0:
        raise RuntimeError(f"no free port on {host.name}: {done.stderr}")
    return int(done.stdout)


def _torchrun_once(machines: namespace_hosts.Hosts, sizes: loops.LoopSizes, timeout: float = 300) -> dict:
    """One run of the loop under ``torchrun --nnodes 2``, a node in each namespace; rank 0's result."""
    first = machines.hosts[0]
    port = _free_port(machines, first)
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-hosts-torchrun-") as scratch:
        config, out = Path(scratch, "config.json"), Path(scratch, "out.json")
        config.write_text(json.dumps({**sizes.as_dict(), "device": "cpu"}))
        # as launch.torchrun: torchrun's own thread default, this repository on the path, its log directories in
        # the scratch directory; gloo on the hosts' network, as the attached engines use it
        env = {**launch.torchrun_env(cpu_only=True), "TMPDIR": scratch, "GLOO_SOCKET_IFNAME": INTERFACE}
        logs = [Path(scratch, f"node{i}.log") for i in range(HOSTS)]
        nodes: list[subprocess.Popen] = []
        started = time.perf_counter()
        try:
            for index, host in enumerate(machines.hosts):
                command = [
                    "ip", "netns", "exec", host.name, sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={HOSTS}", f"--nproc-per-node={RANKS_PER_HOST}", f"--node-rank={index}",
                    f"--master-addr={first.address}", f"--master-port={port}",
                    "-m", "benchmarks.torchrun_loop", str(config), str(out),
                ]  # fmt: skip
                with open(logs[index], "wb") as log:
                    nodes.append(
                        subprocess.Popen(command, cwd=launch.REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
                    )
            deadline = time.monotonic() + timeout
            codes = [node.wait(timeout=max(1.0, deadline - time.monotonic())) for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                    node.wait()
        wall = time.perf_counter() - started
        if any(codes):
            tails = "\n".join(
                f"--- node {i} ---\n{log.read_text(errors='replace')[-2000:]}" for i, log in enumerate(logs)
            )
            raise RuntimeError(f"torchrun --nnodes {HOSTS} failed ({codes}):\n{tails}")
        result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def torchrun_on_hosts(machines: namespace_hosts.Hosts, sizes: loops.LoopSizes) -> dict:
    """``_torchrun_once``, run once more after the ranks' rare joint abort (see ``launch.ABORT``)."""
    try:
        return _torchrun_once(machines, sizes)
    except RuntimeError as error:
        if launch.ABORT not in str(error):
            raise
        print(f"[bench] torchrun's ranks aborted ({launch.ABORT}); running that launch again", file=sys.stderr)
        return _torchrun_once(machines, sizes)


def _namespace_pids(machines: namespace_hosts.Hosts) -> list[int]:
    """Every process inside the hosts' namespaces (ipyparallel's SSH launcher detaches the engines from
    their ssh session, so they are no longer below this process)."""
    pids = []
    for host in machines.hosts:
        found = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
        pids += [int(pid) for pid in found]
    return pids


def _cpu_seconds(machines: namespace_hosts.Hosts) -> tuple[float, float]:
    """The machine's busy CPU seconds so far (user, nice, system, interrupts; all cores) and this benchmark's: this
    process, every process below it (kernel, controller, torchrun) and every process in the hosts'
    namespaces (engines, sshds, torchrun's nodes), with the children each has reaped."""
    machine = psutil.cpu_times()
    me = psutil.Process()
    processes = {p.pid: p for p in (me, *me.children(recursive=True))}
    for pid in _namespace_pids(machines):
        with suppress(psutil.Error):
            processes.setdefault(pid, psutil.Process(pid))
    ours = 0.0
    for process in processes.values():
        with suppress(psutil.Error):
            t = process.cpu_times()
            ours += t.user + t.system + t.children_user + t.children_system
    return machine.user + machine.nice + machine.system + machine.irq + machine.softirq, ours


def _with_other_load(machines: namespace_hosts.Hosts, side: Callable[[], dict]) -> dict:
    """Run one side; add ``other_cores``, the cores processes outside this benchmark took meanwhile (the
    machine is shared: other engineers' tests run on it too). The kernel's own network work and the
    processes that began and ended inside the turn outside this benchmark's tree make it approximate."""
    busy, ours = _cpu_seconds(machines)
    started = time.perf_counter()
    result = side()
    busy_after, ours_after = _cpu_seconds(machines)
    result["other_cores"] = max(0.0, (busy_after - busy) - (ours_after - ours)) / (time.perf_counter() - started)
    return result


def compare(kernel: Kernel, machines: namespace_hosts.Hosts, cluster, sizes: loops.LoopSizes, rounds: int) -> dict:
    """Alternate torchrun over the two hosts (A, the attached session stopped) and the ``%%fsdp`` cell (B);
    the keys ``step_time.measurements`` reads, and each round's order."""
    kernel.execute(f"%%fsdp {loops.cell_flags(WORLD_SIZE, sizes)}\npass")  # the world up, untimed

    def session() -> dict[str, list[psutil.Process]]:
        return _session_processes(machines, cluster, kernel)

    def torchrun_alone() -> dict:
        with _paused(session):
            return torchrun_on_hosts(machines, sizes)

    sides = {
        "torchrun": lambda: _with_other_load(machines, torchrun_alone),
        "%%fsdp": lambda: _with_other_load(machines, lambda: notebook_loop.run(kernel, WORLD_SIZE, sizes)),
    }
    compared = step_time.alternate(sides, sizes, rounds)
    a_runs, b_runs = compared.pop("torchrun_runs"), compared.pop("fsdp_runs")
    return {
        "world_size": WORLD_SIZE,
        "hosts": HOSTS,
        "sizes": sizes.as_dict(),
        "session_processes_stopped_for_torchrun": {name: len(found) for name, found in session().items()},
        **compared,
        "torchrun_other_cores": [run["other_cores"] for run in a_runs],
        "fsdp_other_cores": [run["other_cores"] for run in b_runs],
        "threads_torchrun": a_runs[0]["torch_threads"],
    }


def _rx_bytes(machines: namespace_hosts.Hosts) -> dict[str, int]:
    """Bytes each host's ``eth0`` has received so far."""
    counts = {}
    for host in machines.hosts:
        done = machines.run(host, "cat", RX_BYTES)
        if done.returncode != 0:
            raise RuntimeError(f"cannot read {RX_BYTES} in {host.name}: {done.stderr}")
        counts[host.name] = int(done.stdout)
    return counts


def transfer_round(kernel: Kernel, machines: namespace_hosts.Hosts, seed: int, width: int, depth: int) -> dict:
    """A fresh model sent to the four ranks: what each host's wire carried in, against its ranks' shards."""
    kernel.execute(TRANSFER_MODEL.format(seed=seed, width=width, depth=depth))
    time.sleep(0.5)  # the traffic of the cell before has settled
    before = _rx_bytes(machines)
    reply = kernel.execute(TRANSFER_CELL)
    time.sleep(0.5)  # the last segments and acknowledgements
    after = _rx_bytes(machines)
    read = kernel.execute(TRANSFER_READ).json()
    shards = {int(rank): size for rank, size in read["shard_bytes"].items()}
    host_shards = {host.name: 0 for host in machines.hosts}
    for rank, host in enumerate(read["hosts"]):
        host_shards[host] += shards[rank]
    received = {name: after[name] - before[name] for name in before}
    return {
        "model_bytes": read["model_bytes"],
        "shard_bytes": shards,
        "rank_hosts": read["hosts"],
        "host_shard_bytes": host_shards,
        "host_rx_bytes": received,
        "host_rx_over_shards": {name: received[name] / host_shards[name] for name in received},
        "host_other_bytes": {name: received[name] - host_shards[name] for name in received},
        "sent_bytes": read["sent_bytes"],
        "cell_s": reply.elapsed,
    }


def _transfer_rows(rounds: list[dict], width: int, depth: int) -> list[Measurement]:
    model_mib = rounds[0]["model_bytes"] / MiB
    rows = []
    for index, name in enumerate(rounds[0]["host_rx_bytes"]):
        ratios = [r["host_rx_over_shards"][name] for r in rounds]
        other = [r["host_other_bytes"][name] / MiB for r in rounds]
        rows.append(
            Measurement(
                what=f"hosts: {depth} x Linear({width}, {width}) ({model_mib:.0f} MiB) to 2 hosts x 2 ranks: bytes "
                f"host {index} received on {INTERFACE} / its ranks' shard bytes",
                value=median(ratios), unit="x", target=TRANSFER_TARGET, op="<=",
                a_label="its ranks' shards", a=median([r["host_shard_bytes"][name] for r in rounds]) / MiB,
                b_label="received", b=median([r["host_rx_bytes"][name] for r in rounds]) / MiB, ab_unit="MiB",
                samples_value=ratios,
                note=f"target 1.00-1.05: rx_bytes around the cell, everything on the wire; beyond the shards "
                f"{median(other):.2f} MiB (median of {len(rounds)} rounds)",
            )
        )  # fmt: skip
    return rows


def run(ctx: Context) -> dict:
    why = namespace_hosts.why_not()
    if why:
        return {"skipped": why}
    sizes = loops.CPU_QUICK if ctx.quick else loops.CPU_FULL
    # the rounds spread widely on the shared 2-core VM (other engineers' tests run beside them): as many as
    # step_time's. --quick leaves them out: the hosts, the cluster and its stop take ~45 s already
    rounds = ctx.rounds(full=16, quick=0)
    width, depth = (1024, 4) if ctx.quick else (1024, 12)
    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        phases[name] = time.perf_counter() - clock
        clock = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-hosts-") as scratch:
        directory = Path(scratch)
        machines = None
        try:
            with (
                _ipython_dir(directory / "ipython"),
                namespace_hosts.hosts(HOSTS, directory / "hosts") as machines,
                namespace_hosts.ssh_cluster(machines, RANKS_PER_HOST, sys.executable, profile=PROFILE) as cluster,
            ):
                phase("hosts_and_cluster_up")
                kernel = Kernel(env={**NO_PREWARM, **CPU_ONLY, "IPYTHONDIR": str(directory / "ipython")})
                try:
                    kernel.execute("%load_ext nbfsdp\nimport json, torch, torch.nn as nn, nbfsdp")
                    kernel.execute(f"%fsdp attach --profile {PROFILE}")
                    phase("kernel_attached")
                    result = compare(kernel, machines, cluster, sizes, rounds) if rounds else None
                    phase("step_time_rounds")
                    idle = _idle_session(machines, cluster, kernel, IDLE_SECONDS_QUICK if ctx.quick else IDLE_SECONDS)
                    phase("idle_session")
                    kernel.execute(f"%%fsdp --world-size {WORLD_SIZE} --no-gather\npass")  # the world up, untimed
                    transfer = [
                        transfer_round(kernel, machines, seed, width, depth)
                        for seed in range(ctx.rounds(full=3, quick=1))
                    ]
                    phase("transfer_rounds")
                finally:
                    with suppress(Exception):  # let go of the cluster (and its private directory) even after an error
                        kernel.execute("%fsdp detach", timeout=60, check=False)
                    ctx.shutdown(kernel)
        finally:
            for sshd in machines.sshd.values() if machines else ():
                with suppress(subprocess.TimeoutExpired):
                    sshd.wait(timeout=10)  # killed with its namespace: reap it
    phase("kernel_cluster_and_hosts_down")
    rows = [*_step_rows(result), _idle_row(idle), *_transfer_rows(transfer, width, depth)]
    return {
        "measurements": rows,
        "rounds": rounds,
        "step_time": result,
        "transfer_model": f"{depth} x Linear({width}, {width})",
        "transfer_rounds": transfer,
        "idle_session": idle,
        "phase_s": phases,
    }


#: How long the idle session's CPU is counted (the launchers restart their waits every minute).
IDLE_SECONDS = 60.0
IDLE_SECONDS_QUICK = 3.0


def _idle_session(machines: namespace_hosts.Hosts, cluster, kernel: Kernel, seconds: float) -> dict:
    """The attached session's CPU while no cell runs, by part, and whose the SSH launchers' waits are."""
    parts = _session_processes(machines, cluster, kernel)
    kernel_tree = {p.pid for p in parts["kernel"]}
    kernel_waits = 0
    for client in parts["ssh"]:
        with suppress(psutil.Error):
            kernel_waits += client.ppid() in kernel_tree
    cores = _idle_cost(lambda: _session_processes(machines, cluster, kernel), seconds)
    return {
        "seconds": seconds,
        "cores": cores,
        "processes": {name: len(found) for name, found in parts.items()},
        "ssh_waits_of_the_kernel": kernel_waits,
        "ssh_waits_of_the_cluster": len(parts["ssh"]) - kernel_waits,
    }


def _idle_row(idle: dict) -> Measurement:
    cores = idle["cores"]
    parts = ", ".join(
        f"{name} {cores.get(name, 0.0):.4f}" for name in ("engines", "waiters", "ssh", "controller", "kernel")
    )
    return Measurement(
        what="hosts 2x2: CPU of the idle attached session (4 engines, controller, kernel, ipyparallel's SSH waits), "
        "cores",
        value=sum(cores.values()),
        unit="cores",
        note=f"no target; over {idle['seconds']:.0f} s: {parts}. The SSH waits: "
        f"{idle['ssh_waits_of_the_kernel']} of the kernel's (`%fsdp attach` reads connection files), "
        f"{idle['ssh_waits_of_the_cluster']} of the cluster's own launcher, each a Python on the engine's host "
        "waiting on its pid, started again over ssh every minute (a new connection and a Python start-up, "
        "~0.3 s of CPU each: a window of a minute or more sees one restart of each)",
    )


def _step_rows(result: dict | None) -> list[Measurement]:
    """``step_time``'s rows for the comparison, its step-time row against this benchmark's target; under
    ``--quick``, that row alone, not measured."""
    label = f"hosts 2x2 (ws{WORLD_SIZE}, gloo over {INTERFACE})"
    what = f"{label}: step time, %%fsdp / torchrun --nnodes {HOSTS} (median of round medians)"
    if result is None:
        note = "not measured under --quick: a torchrun --nnodes 2 launch takes ~11 s, a round ~15 s, on top of "
        note += "the ~45 s the hosts and the cluster take; run `python -m benchmarks --only hosts`"
        return [Measurement(what=what, value=None, unit="x", target=TARGET_RATIO, op="<=", note=note)]
    rows = step_time.measurements(result, label)
    rows[0].what, rows[0].target = what, TARGET_RATIO
    rows[0].note += "; " + _load_note(result)
    return rows


#: A round whose two turns had less than this many cores taken by processes outside the benchmark.
QUIET_CORES = 0.1


def _load_note(result: dict) -> str:
    """What other processes took during each side's turns, and the ratio of the rounds they left alone."""
    a_other, b_other = result["torchrun_other_cores"], result["fsdp_other_cores"]
    quiet = [i for i, (a, b) in enumerate(zip(a_other, b_other, strict=True)) if max(a, b) < QUIET_CORES]
    text = (
        f"other processes on the machine took {median(a_other):.2f} cores (median) during torchrun's turns, "
        f"{median(b_other):.2f} during the cells'"
    )
    if quiet:
        a = [result["torchrun_round_medians_s"][i] for i in quiet]
        b = [result["fsdp_round_medians_s"][i] for i in quiet]
        ratio = statistics.median(b) / statistics.median(a)
        text += f"; the {len(quiet)} rounds with under {QUIET_CORES} in both turns: {ratio:.3f}x"
    return text
