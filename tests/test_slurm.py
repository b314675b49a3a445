"""A real Slurm in the tests (issue 61, point 1): a ``slurmctld`` and two ``slurmd`` in network namespaces, with
``munge`` and no accounting daemon (``benchmarks.slurm_hosts``). Skipped, saying why, where namespaces cannot be
made or the packages are missing (``make test`` installs them as root)."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from benchmarks import slurm_hosts
from nbfsdp.kernel.cluster.rank_calls import RankError
from tests.conftest import one_process_losses, run_failing, run_ok
from tests.test_kernel import Kernel

STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_hosts.why_not()
    if why:
        pytest.skip(why)
    with slurm_hosts.slurm(2, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def test_a_job_runs_across_both_nodes_with_slurms_rank_layout(slurm, tmp_path):
    """Both nodes idle once the fixture returns; a batch job of 2 nodes x 2 tasks runs one step whose tasks are
    numbered as Slurm numbers them (``SLURM_PROCID`` in blocks per node, ``SLURM_LOCALID`` within it), each on
    its node's hostname; then the queue is empty."""
    assert slurm.node_states() == {node.name: "idle" for node in slurm.nodes}
    out = tmp_path / "job.out"
    step = "srun sh -c 'echo $(hostname) $SLURM_PROCID $SLURM_LOCALID $SLURM_JOB_NUM_NODES'"
    submitted = slurm.command("sbatch", "--nodes=2", "--ntasks-per-node=2", f"--output={out}", "--wrap", step)
    assert submitted.returncode == 0 and submitted.stdout.startswith("Submitted batch job"), submitted.stderr
    deadline = time.monotonic() + 60
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not slurm.jobs()
    lines = sorted(out.read_text().splitlines(), key=lambda line: int(line.split()[1]))
    first, second = (node.name for node in slurm.nodes)
    assert lines == [f"{first} 0 0 2", f"{first} 1 1 2", f"{second} 2 0 2", f"{second} 3 1 2"], lines


#: Four steps over the 2 x 2 ranks, HYBRID_SHARD (a replica per node, each node sharding among its ranks), then each
#: rank's view of itself beside Slurm's, and its shard and replicate groups.
TRAIN = """%%fsdp --mixed-precision FULL --wrap-cls Block --sharding-strategy HYBRID_SHARD
import os, socket
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(STEPS):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
mine = (rank, os.environ["LOCAL_RANK"], os.environ["SLURM_PROCID"], os.environ["SLURM_LOCALID"], socket.gethostname())
seen = [None] * world_size
torch.distributed.all_gather_object(seen, mine)
mesh = next(model.parameters()).device_mesh
groups = [None] * world_size
own = tuple(tuple(torch.distributed.get_process_group_ranks(mesh.get_group(d))) for d in ("shard", "replicate"))
torch.distributed.all_gather_object(groups, own)
"""


@pytest.fixture
def slurm_notebook(shell, slurm, tmp_path, monkeypatch):
    """A notebook whose Slurm commands reach the test's Slurm, with a fresh IPython directory (the profile's
    directory, which the "nodes" share as they share the file system)."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    yield shell
    shell.run_line_magic("fsdp", "stop")


def test_attach_slurm_starts_the_ranks_as_one_job_trains_as_one_process_and_stop_cancels_it(
    slurm_notebook, tiny_model, slurm, capsys
):
    """Issue 61, points 2 and 3 (in part): ``%fsdp attach --slurm --nodes 2 --ranks-per-node 2`` submits one job
    through ipyparallel's Slurm launcher, says its id and state, and attaches; the ranks are Slurm's tasks
    (``RANK`` = ``SLURM_PROCID``, ``LOCAL_RANK`` = ``SLURM_LOCALID``); HYBRID_SHARD with a replica per node
    trains as one process;
    the controller listens on the address toward the nodes only, with CurveZMQ; ``%fsdp status`` names the job
    and its nodes; ``%fsdp stop`` cancels it."""
    shell = slurm_notebook
    reference = copy.deepcopy(tiny_model)
    run_ok(shell, "%fsdp attach --slurm --nodes 2 --ranks-per-node 2")
    said = capsys.readouterr()
    job = said.out.split("Slurm job ")[1].split()[0]
    assert f"Slurm job {job} submitted: 2 nodes x 2 ranks" in said.out, said.out
    assert f"Slurm job {job}: RUNNING; engines registered" in said.err or "RUNNING" in said.out, said
    names = [node.name for node in slurm.nodes]
    assert f"attached to 4 engines on 2 hosts ({names[0]} 2, {names[1]} 2)" in said.out, said.out
    assert "IPP_ENABLE_CURVE" not in said.err  # CurveZMQ on: no warning
    assert slurm.jobs() == [f"{job} RUNNING"]

    shell.user_ns["STEPS"] = STEPS
    run_ok(shell, TRAIN)
    seen = shell.user_ns["seen"]
    assert [(r, int(local), int(procid), int(localid)) for r, local, procid, localid, _ in seen] == [
        (r, r % 2, r, r % 2) for r in range(4)
    ], seen
    assert [host for *_, host in seen] == [names[0], names[0], names[1], names[1]], seen
    # shard groups inside each node, replicate groups across them
    assert shell.user_ns["groups"] == [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), ((2, 3), (1, 3))]
    run = nbfsdp.last_run()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = one_process_losses(shell, reference, opt, 4, STEPS)
    sharded = [sum(run.metric("loss", rank=r)[step] for r in range(4)) / 4 for step in range(STEPS)]
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(expected))

    # the controller and its schedulers listen on the address toward the nodes (or loopback), never every interface
    private_dir = nbfsdp._magics.session.attached_cluster.job.private_dir  # on the controller's command line
    controllers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "ipyparallel.controller" in (line := p.info["cmdline"] or []) and f"--work-dir={private_dir}" in line
    ]
    family = [p for c in controllers for p in (c, *c.children(recursive=True))]
    listening = {c.laddr.ip for p in family for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert controllers and listening <= {slurm.machines.bridge_address, "127.0.0.1"}, listening

    run_ok(shell, "%fsdp status")
    status = capsys.readouterr().out
    nodes = slurm.command("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()  # Slurm's hostlist of both
    assert f"Slurm job {job}: RUNNING, nodes {nodes} (scancel {job} ends it)" in status, status
    run_ok(shell, "%fsdp stop")
    assert _queue_empties(slurm, 30), slurm.jobs()
    # the batch script and the engines' output went to the job's directories, not the notebook's
    assert not [p.name for p in Path.cwd().iterdir() if p.name.startswith("slurm") or p.suffix == ".sbatch"]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            "--nodes 2 --ranks-per-node 2 --partition gpu",
            "--partition gpu: no such partition (sinfo: debug (default): 2 nodes)",
        ),
        ("--nodes 3 --ranks-per-node 1", "--nodes 3: partition debug has 2 nodes"),
        ("--nodes 2", "--slurm needs --nodes N and --ranks-per-node K"),
    ],
)
def test_bad_slurm_requests_fail_before_anything_is_submitted(slurm_notebook, slurm, flags, said):
    error, _ = run_failing(slurm_notebook, f"%fsdp attach --slurm {flags}")
    assert isinstance(error, UsageError) and said in str(error), error
    assert not slurm.jobs()


def test_no_slurm_on_the_path_is_said_before_anything_runs(shell, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    error, _ = run_failing(shell, "%fsdp attach --slurm --nodes 1 --ranks-per-node 1")
    assert isinstance(error, UsageError) and "no Slurm on the PATH here (sbatch, sinfo)" in str(error), error


def test_unload_and_a_killed_kernel_cancel_the_slurm_job(slurm, tmp_path):
    """Issue 61, point 3: ``%unload_ext`` cancels the job nbfsdp started; a kernel killed with SIGKILL leaves
    nothing in the queue within 60 s (its reaper cancels the job by name, whatever the engines do). In a kernel of
    their own: the suite's notebook keeps its extension loaded."""
    env = {**os.environ, "SLURM_CONF": str(slurm.conf), "IPYTHONDIR": str(tmp_path / "ipython"), "NBFSDP_PREWARM": "0"}
    kernel = Kernel(env=env)
    try:
        reply, messages = kernel.execute("%load_ext nbfsdp\n%fsdp attach --slurm --nodes 1 --ranks-per-node 1")
        assert reply["content"]["status"] == "ok" and len(slurm.jobs()) == 1, kernel.stdout(messages)
        reply, _ = kernel.execute("%unload_ext nbfsdp")
        assert reply["content"]["status"] == "ok" and _queue_empties(slurm, 30), slurm.jobs()
        code = "%load_ext nbfsdp\n%fsdp attach --slurm --nodes 2 --ranks-per-node 1\nimport os\nprint(os.getpid())"
        reply, messages = kernel.execute(code)
        assert reply["content"]["status"] == "ok" and len(slurm.jobs()) == 1, kernel.stdout(messages)
        os.killpg(int(kernel.stdout(messages).split()[-1]), signal.SIGKILL)  # as Jupyter kills a kernel
        started = time.monotonic()
        assert _queue_empties(slurm, 60), slurm.jobs()
        print(f"queue empty {time.monotonic() - started:.1f} s after the kernel's SIGKILL")
    finally:
        kernel.shutdown()
        for line in slurm.jobs():
            slurm.command("scancel", line.split()[0])


def _queue_empties(slurm, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not slurm.jobs()


def test_a_queued_job_is_said_until_it_runs_and_detach_leaves_it(slurm_notebook, slurm, capsys):
    """While every node is taken by another job, the attach says the job is PENDING and why (Slurm's reason);
    once that job ends, RUNNING, and the engines registering. ``%fsdp detach`` leaves the job running on purpose
    and says how to cancel it."""
    blocker = slurm.command("sbatch", "--nodes=2", "--exclusive", "--output=/dev/null", "--wrap", "sleep 300")
    blocker = blocker.stdout.split()[-1]

    def free_the_nodes() -> None:
        deadline = time.monotonic() + 60
        while not any("PENDING" in job for job in slurm.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the notebook says the state it saw
        slurm.command("scancel", blocker)

    freeing = threading.Thread(target=free_the_nodes)
    freeing.start()
    try:
        run_ok(slurm_notebook, "%fsdp attach --slurm --nodes 2 --ranks-per-node 1")
    finally:
        freeing.join()
    said = capsys.readouterr().err
    pending = said.index("PENDING (Resources)")
    assert pending < said.index(": RUNNING; engines registered"), said
    job = slurm.jobs()[0].split()[0]
    private_dir = nbfsdp._magics.session.attached_cluster.job.private_dir
    run_ok(slurm_notebook, "%fsdp detach")  # on purpose: the job goes on, and the line says how to end it
    assert f"Slurm job {job} goes on running: scancel {job} ends it" in capsys.readouterr().out
    assert slurm.jobs() == [f"{job} RUNNING"]
    slurm.command("scancel", job)
    for process in psutil.process_iter(["cmdline"]):  # and its controller, which detach left running too
        if f"--work-dir={private_dir}" in (process.info["cmdline"] or []):
            process.kill()


def test_a_node_lost_mid_cell_is_named_and_a_cancelled_job_is_said_in_the_next_cell(slurm_notebook, slurm):
    """Issue 61, point 4 (in part): every process of the second node killed mid-cell (its slurmd, the job's step,
    its engines) ends the cell within 10 s naming a rank of that node, the first node's ranks released; once the
    job is cancelled from outside (``scancel``), the next cell says so instead of running."""
    shell = slurm_notebook
    run_ok(shell, "%fsdp attach --slurm --nodes 2 --ranks-per-node 1")
    job = slurm.jobs()[0].split()[0]
    run_ok(shell, "%%fsdp\nimport torch\nfirst = rank")
    lost = slurm.nodes[1]
    killer = threading.Timer(3.0, slurm.machines.kill, args=(lost,))
    killer.start()
    error, elapsed = run_failing(
        shell,
        "%%fsdp\nimport time\nfor _ in range(600):\n    torch.distributed.all_reduce(torch.ones(1))\n"
        "    time.sleep(0.05)",
    )
    killer.join()
    assert isinstance(error, RankError) and error.rank == 1 and lost.name in str(error), error
    assert elapsed < 3.0 + 10.0, elapsed
    slurm.command("scancel", job)
    error, _ = run_failing(shell, "%%fsdp --world-size 2\nsecond = rank")
    # Slurm's word for it: CANCELLED, or COMPLETING while it waits for the lost node to report
    said = str(error)
    assert isinstance(error, UsageError) and f"Slurm job {job} is over (" in said, error
    assert any(f"is over ({state}" in said for state in ("CANCELLED", "COMPLETING")), said
