"""A real Slurm in the tests (issue 61, point 1): a ``slurmctld`` and two ``slurmd`` in network namespaces, with
``munge`` and no accounting daemon (``benchmarks.slurm_hosts``). Skipped, saying why, where namespaces cannot be
made or the packages are missing (``make test`` installs them as root)."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import threading
import time
from pathlib import Path

import ipyparallel as ipp
import psutil
import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from benchmarks import slurm_hosts
from nbfsdp.kernel.cluster.rank_calls import RankError
from tests.conftest import child_with, one_process_losses, run_failing, run_ok, soon
from tests.test_kernel import Kernel

STEPS = 4
#: How often a test looks at the queue while it waits: each look is an ``squeue`` process and an RPC to slurmctld
#: (a half second is nothing beside Slurm's own latencies: KillWait 5 s, time limits checked every 30 s).
POLL_SECONDS = 0.5

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_hosts.why_not()
    if why:
        pytest.skip(why)
    # 4 CPUs a node: a 2 x 2 world beside the timed kernel's job of 2 ranks
    with slurm_hosts.slurm(2, tmp_path_factory.mktemp("slurm"), cpus_per_node=4) as cluster:
        yield cluster


#: The job of the kernel that runs beside the module's other tests: one node, a GPU bound to each of its two tasks,
#: a time limit of a minute (Slurm's least; slurmctld looks at limits every 30 s, so it ends 60 to 90 s after it
#: started, while the tests between run).
TIMED_ATTACH = "%fsdp attach --slurm --nodes 1 --ranks-per-node 2 --time 1 --sbatch-arg=--gpus-per-task=1 "
#: Each rank's CUDA_VISIBLE_DEVICES, then what the notebook's session heard from each engine of its host.
VISIBLE = """%%fsdp
import os, torch
visible = [None] * world_size
torch.distributed.all_gather_object(visible, os.environ.get("CUDA_VISIBLE_DEVICES"))
"""
HEARD = """import nbfsdp
print(visible, sorted(i.visible_gpus for i in nbfsdp._magics.session.attached_cluster.identities().values()))"""


#: The timed kernel's job: the other tests look at the queue without it.
TIMED_JOBS: set[str] = set()


def _jobs(slurm) -> list[str]:
    """The queue (``JOBID STATE``) but for the timed kernel's job."""
    return [line for line in slurm.jobs() if line.split()[0] not in TIMED_JOBS]


@pytest.fixture(scope="module")
def timed_kernel(slurm, tmp_path_factory):
    """A kernel of its own whose Slurm job has a time limit of one minute, on the first node (the node-lost test
    kills the second); started by the first test that asks for it, ended after the module."""
    ipython = tmp_path_factory.mktemp("timed-ipython")
    env = {**os.environ, "SLURM_CONF": str(slurm.conf), "IPYTHONDIR": str(ipython), "NBFSDP_PREWARM": "0"}
    kernel = Kernel(env=env)
    try:
        code = f"%load_ext nbfsdp\n{TIMED_ATTACH}--sbatch-arg=--nodelist={slurm.nodes[0].name}"
        reply, messages = kernel.execute(code)
        assert reply["content"]["status"] == "ok", kernel.stdout(messages)
        TIMED_JOBS.add(re.search(r"Slurm job (\d+)", kernel.stdout(messages))[1])
        yield kernel
    finally:
        with contextlib.suppress(Exception):  # the last test shuts it down itself
            kernel.shutdown()
        for line in slurm.jobs():
            slurm.command("scancel", line.split()[0])


def test_a_job_runs_across_both_nodes_with_slurms_rank_layout(slurm, tmp_path):
    """Both nodes idle once the fixture returns; a batch job of 2 nodes x 2 tasks runs one step whose tasks are
    numbered as Slurm numbers them (``SLURM_PROCID`` in blocks per node, ``SLURM_LOCALID`` within it), each on
    its node's hostname; then the queue is empty."""
    assert slurm.node_states() == {node.name: "idle" for node in slurm.nodes}
    out = tmp_path / "job.out"
    step = "srun sh -c 'echo $(hostname) $SLURM_PROCID $SLURM_LOCALID $SLURM_JOB_NUM_NODES'"
    submitted = slurm.command("sbatch", "--nodes=2", "--ntasks-per-node=2", f"--output={out}", "--wrap", step)
    assert submitted.returncode == 0 and submitted.stdout.startswith("Submitted batch job"), submitted.stderr
    assert _queue_empties(slurm, 60), _jobs(slurm)
    lines = sorted(out.read_text().splitlines(), key=lambda line: int(line.split()[1]))
    first, second = (node.name for node in slurm.nodes)
    assert lines == [f"{first} 0 0 2", f"{first} 1 1 2", f"{second} 2 0 2", f"{second} 3 1 2"], lines


def test_a_queued_job_is_said_until_it_runs_and_detach_leaves_it(slurm_notebook, slurm, capsys):
    """While every node is taken by another job, the attach says the job is PENDING and why (Slurm's reason);
    once that job ends, RUNNING, and the engines registering. ``%fsdp detach`` leaves the job running on purpose
    and says how to cancel it."""
    blocker = slurm.command("sbatch", "--nodes=2", "--exclusive", "--output=/dev/null", "--wrap", "sleep 300")
    blocker = blocker.stdout.split()[-1]
    deadline = time.monotonic() + 30
    while f"{blocker} RUNNING" not in _jobs(slurm) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)

    def free_the_nodes() -> None:
        deadline = time.monotonic() + 60
        while not any(j.endswith("PENDING") and j.split()[0] != blocker for j in _jobs(slurm)):
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_SECONDS)
        time.sleep(1.0)  # the notebook says the state it saw
        slurm.command("scancel", blocker)

    freeing = threading.Thread(target=free_the_nodes)
    freeing.start()
    try:
        # one node is enough to wait behind a job that holds both, and one engine fewer to start
        run_ok(slurm_notebook, "%fsdp attach --slurm --nodes 1 --ranks-per-node 1")
    finally:
        freeing.join()
    said = capsys.readouterr().err
    pending = said.index("PENDING (Resources)")
    assert pending < said.index(": RUNNING; engines registered"), said
    attached = nbfsdp._magics.session.attached_cluster.job  # not the queue's first: the blocker may be COMPLETING
    job, private_dir = attached.job_id, attached.private_dir
    run_ok(slurm_notebook, "%fsdp detach")  # on purpose: the job goes on, and the line says how to end it
    assert f"Slurm job {job} goes on running: scancel {job} ends it" in capsys.readouterr().out
    assert _jobs(slurm) == [f"{job} RUNNING"], (TIMED_JOBS, slurm.jobs())
    slurm.command("scancel", job)
    for process in psutil.process_iter(["cmdline"]):  # and its controller, which detach left running too
        if f"--work-dir={private_dir}" in (process.info["cmdline"] or []):
            process.kill()


def test_each_rank_keeps_the_gpus_slurm_bound_to_its_task(timed_kernel):
    """Issue 61, point 2 (GPUs from Slurm's binding, on GPUs Slurm believes the nodes have: ``gres.conf`` device
    files stand for them, as in Slurm's own tests): with ``--gpus-per-task 1`` each task sees its own GPU
    (``CUDA_VISIBLE_DEVICES`` 0 and 1), the ranks keep what Slurm set, and the session knows each engine's list,
    so that on GPUs each rank takes the one it sees (``tests/test_hosts.py`` for that choice: no GPU here)."""
    reply, messages = timed_kernel.execute(f"{VISIBLE}\n")
    assert reply["content"]["status"] == "ok", (reply["content"], timed_kernel.stdout(messages))
    reply, messages = timed_kernel.execute(HEARD)
    assert timed_kernel.stdout(messages).strip() == "['0', '1'] ['0', '1']", (reply["content"], messages)


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
visible = [None] * world_size
torch.distributed.all_gather_object(visible, os.environ.get("CUDA_VISIBLE_DEVICES"))
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
    run_ok(shell, "%fsdp attach --slurm --nodes 2 --ranks-per-node 2 --gpus-per-node 2")
    said = capsys.readouterr()
    job = said.out.split("Slurm job ")[1].split()[0]
    assert f"Slurm job {job} submitted: 2 nodes x 2 ranks" in said.out, said.out
    assert f"Slurm job {job}: RUNNING; engines registered" in said.err or "RUNNING" in said.out, said
    names = [node.name for node in slurm.nodes]
    assert f"attached to 4 engines on 2 hosts ({names[0]} 2, {names[1]} 2)" in said.out, said.out
    assert "IPP_ENABLE_CURVE" not in said.err  # CurveZMQ on: no warning
    assert _jobs(slurm) == [f"{job} RUNNING"], (TIMED_JOBS, slurm.jobs())

    shell.user_ns["STEPS"] = STEPS
    run_ok(shell, TRAIN)
    seen = shell.user_ns["seen"]
    assert [(r, int(local), int(procid), int(localid)) for r, local, procid, localid, _ in seen] == [
        (r, r % 2, r, r % 2) for r in range(4)
    ], seen
    assert [host for *_, host in seen] == [names[0], names[0], names[1], names[1]], seen
    # each node's two GPUs (Slurm's --gpus-per-node) seen by both its ranks, who take LOCAL_RANK's of them
    visible = shell.user_ns["visible"]
    assert visible[0] == visible[1] and visible[2] == visible[3] and all(len(v.split(",")) == 2 for v in visible)
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
    # nor on the nodes: the ranks' sockets (gloo's, the world's store on rank 0) listen on the node's address
    for node in slurm.nodes:
        listed = slurm.machines.run(node, "ss", "-H", "-ltnp").stdout.splitlines()
        ours = [line for line in listed if '"python' in line]
        anywhere = [line for line in ours if line.split()[3].rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]")]
        assert ours and not anywhere, listed

    run_ok(shell, "%fsdp status")
    status = capsys.readouterr().out
    nodes = slurm.command("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()  # Slurm's hostlist of both
    assert f"Slurm job {job}: RUNNING, nodes {nodes} (scancel {job} ends it)" in status, status
    run_ok(shell, "%fsdp stop")
    assert _queue_empties(slurm, 30), _jobs(slurm)
    # the batch script and the engines' output went to the job's directories, not the notebook's
    assert not [p.name for p in Path.cwd().iterdir() if p.name.startswith("slurm") or p.suffix == ".sbatch"]


def test_an_attach_whose_controller_is_slow_to_answer_waits_for_it(slurm_notebook, slurm, tmp_path):
    """A busy login node: the job's controller stopped (SIGSTOP) from once its connection files are written until
    8 s after both engines asked to register. At ipyparallel's 5 s the engines gave up and exited, ending the
    job ("Slurm job 2 ended before its engines registered"), and the notebook's client gave up at 10 s; both now
    wait as long as the kernel does for engines on its own machine. The attach completes, and the ranks run a cell."""
    held: dict[str, object] = {}

    def hold_the_controller() -> None:
        controller = None
        try:
            security = tmp_path / "ipython" / "profile_nbfsdp-slurm" / "security"
            held["waiting for"] = "the connection files"
            soon(lambda: len(list(security.glob("ipcontroller-slurm-*.json"))) == 2, every=0.001)
            held["waiting for"] = "the controller"
            controller = soon(lambda: child_with(psutil.Process(), "ipyparallel.controller", "nbfsdp-slurm-"))
            controller.suspend()
            output = tmp_path / "ipython" / "profile_nbfsdp-slurm" / "log"
            held["waiting for"] = "both engines to ask to register"
            soon(lambda: sum(p.read_text().count("Registering with controller") for p in output.glob("*.out")) == 2)
            del held["waiting for"]
            time.sleep(8.0)
            held["for"] = 8.0
        except BaseException as error:
            held["error"] = error
        finally:
            if controller is not None:
                controller.resume()

    thread = threading.Thread(target=hold_the_controller, daemon=True)
    thread.start()
    run_ok(slurm_notebook, "%fsdp attach --slurm --nodes 1 --ranks-per-node 2")
    thread.join()
    assert held == {"for": 8.0}, held
    run_ok(slurm_notebook, "%%fsdp\nout = world_size\n")
    assert slurm_notebook.user_ns.pop("out") == 2
    run_ok(slurm_notebook, "%fsdp stop")
    assert _queue_empties(slurm, 30), _jobs(slurm)  # the next tests find the queue empty


def test_an_attach_whose_client_missed_every_registration_notice_still_completes(slurm_notebook, slurm, monkeypatch):
    """A client learns of each engine from a notice the controller publishes, and one whose subscription was still
    being set up misses it (seen with the local start's client on a loaded machine). Here every client is deaf to
    those notices: the attach's wait learns of the engines from the controller's own record, and completes; the
    attached cluster's client learns of them as it connects. Without the catch-up the wait polls a running job for
    ever: the job is cancelled after 90 s, and the attach fails."""
    monkeypatch.setattr(ipp.Client, "_register_engine", lambda client, message: None)

    def cancel_the_job() -> None:
        for line in _jobs(slurm):
            slurm.command("scancel", line.split()[0])

    still_waiting = threading.Timer(90.0, cancel_the_job)
    still_waiting.start()
    try:
        run_ok(slurm_notebook, "%fsdp attach --slurm --nodes 1 --ranks-per-node 2")
    finally:
        still_waiting.cancel()
    run_ok(slurm_notebook, "%%fsdp\nout = world_size\n")
    assert slurm_notebook.user_ns.pop("out") == 2
    run_ok(slurm_notebook, "%fsdp stop")
    assert _queue_empties(slurm, 30), _jobs(slurm)


NODE = "2 nodes of 4 CPUs, gpu:4"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            "--nodes 2 --ranks-per-node 2 --partition a100",
            f"--partition a100: no such partition (sinfo: debug (default): {NODE}; gpu: {NODE}; teach: {NODE})",
        ),
        ("--nodes 3 --ranks-per-node 1", "--nodes 3: partition debug has 2 nodes"),
        ("--nodes 2", "--slurm needs --nodes N and --ranks-per-node K"),
        ("--nodes 1 --ranks-per-node 1 --partition teach --account nope", "partition teach allows accounts course, re"),
        ("--nodes 1 --ranks-per-node 1 --partition teach", "no --account: partition teach allows accounts course"),
        # what only sbatch knows, asked of it with --test-only: CPUs and GPUs a node, the time, any option
        (
            "--nodes 1 --ranks-per-node 5",
            f"Slurm refuses this job: Requested node configuration is not available (sinfo: debug (default): {NODE})",
        ),
        ("--nodes 1 --ranks-per-node 1 --gpus-per-node 5", "Requested node configuration is not available"),
        ("--nodes 1 --ranks-per-node 1 --time soon", "Slurm refuses this job: Invalid --time specification"),
        (
            "--nodes 1 --ranks-per-node 1 --sbatch-arg=--colour",
            "Slurm refuses this job: unrecognized option '--colour'",
        ),
    ],
)
def test_bad_slurm_requests_fail_before_anything_is_submitted(slurm_notebook, slurm, flags, said):
    error, _ = run_failing(slurm_notebook, f"%fsdp attach --slurm {flags}")
    assert isinstance(error, UsageError) and said in str(error), error
    assert not _jobs(slurm)


def test_a_job_slurm_would_hold_for_ever_is_cancelled_with_its_reason(slurm_notebook, slurm):
    """An account the partition lists but Slurm does not know (no accounting daemon here knows any): Slurm holds
    the job ("Job's account not known"), for ever; the attach says Slurm's reason and cancels it at once, where it
    waited until interrupted."""
    error, elapsed = run_failing(slurm_notebook, "%fsdp attach --slurm --nodes 1 --ranks-per-node 1 --partition "
                                 "teach --account course")  # fmt: skip
    said = str(error)
    assert isinstance(error, UsageError) and "would wait for ever (Job's account not known" in said, error
    assert elapsed < 20 and _queue_empties(slurm, 10), (elapsed, _jobs(slurm))


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
        assert reply["content"]["status"] == "ok" and len(_jobs(slurm)) == 1, kernel.stdout(messages)
        reply, _ = kernel.execute("%unload_ext nbfsdp")
        assert reply["content"]["status"] == "ok" and _queue_empties(slurm, 30), _jobs(slurm)
        # one engine: the reaper cancels the job by its name, whatever its nodes
        code = "%load_ext nbfsdp\n%fsdp attach --slurm --nodes 1 --ranks-per-node 1\nimport os\nprint(os.getpid())"
        reply, messages = kernel.execute(code)
        assert reply["content"]["status"] == "ok" and len(_jobs(slurm)) == 1, kernel.stdout(messages)
        os.killpg(int(kernel.stdout(messages).split()[-1]), signal.SIGKILL)  # as Jupyter kills a kernel
        started = time.monotonic()
        assert _queue_empties(slurm, 60), _jobs(slurm)
        print(f"queue empty {time.monotonic() - started:.1f} s after the kernel's SIGKILL")
    finally:
        kernel.shutdown()
        for line in _jobs(slurm):
            slurm.command("scancel", line.split()[0])


def _queue_empties(slurm, seconds: float) -> bool:
    """Whether the queue empties (but for the timed kernel's job) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while _jobs(slurm) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    return not _jobs(slurm)


def walkthrough_cells() -> list[str]:
    """The cells of ``docs/guide/hosts.md``'s Slurm walk-through, as written."""
    page = (Path(__file__).parents[1] / "docs" / "guide" / "hosts.md").read_text()
    section = page.split("## Slurm from the notebook")[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def _shown(line: str) -> str:
    """A line of output the page shows, as a pattern: its job id, node names and counts of engines stand for any."""
    pattern = re.escape(line)
    for example in (r"node\[17\-18\]", "node17,node18", "node17", "node18"):
        pattern = pattern.replace(example, r"\S+")
    return pattern.replace("4242", r"\d+").replace("0/4", r"\d/4")


def test_a_job_over_its_time_limit_says_so_the_walkthrough_runs_as_written_and_shutting_down_cancels_its_job(
    timed_kernel, slurm
):
    """Issue 61, points 3, 4 and 6: the timed kernel's job, a minute old at least, ends by its limit; the next
    cell says so in Slurm's word (``TIMEOUT``) rather than running. Then the walk-through of ``docs/guide/hosts.md``
    runs cell by cell as written, each saying what the page shows; and the kernel, shut down as Jupyter shuts one
    down (a shutdown request, not a kill), cancels its job."""
    deadline = time.monotonic() + 120
    while any(line.split()[0] in TIMED_JOBS for line in slurm.jobs()) and time.monotonic() < deadline:
        time.sleep(2 * POLL_SECONDS)  # slurmctld ends it at its next 30 s look
    reply, messages = timed_kernel.execute("%%fsdp\nx = 1")
    said = reply["content"].get("evalue", "")
    assert reply["content"]["status"] == "error" and "is over (TIMEOUT" in said, (said, timed_kernel.stdout(messages))
    said = ""
    for cell in walkthrough_cells():
        reply, messages = timed_kernel.execute(cell)
        said += timed_kernel.stdout(messages)
        assert reply["content"]["status"] == "ok", (cell, reply["content"], timed_kernel.stdout(messages))
        lines = cell.rstrip().splitlines()
        shown = lines[len(lines) - next(i for i, line in enumerate(reversed(lines)) if not line.startswith("# ")) :]
        for line in shown:  # what the page shows the cell saying, said (but PENDING, said only while it waits)
            assert "PENDING" in line or re.search(_shown(line[2:]), said), (line, said)
    job = re.search(r"Slurm job (\d+) submitted", said)[1]
    assert f"{job} RUNNING" in slurm.jobs(), slurm.jobs()
    timed_kernel.client.stop_channels()
    timed_kernel.manager.shutdown_kernel(now=False)  # Jupyter's "Shut Down Kernel": the kernel ends itself
    deadline = time.monotonic() + 30
    while any(line.split()[0] == job for line in slurm.jobs()) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    assert not [line for line in slurm.jobs() if line.split()[0] == job], slurm.jobs()


def test_a_node_lost_mid_cell_is_named_and_a_cancelled_job_is_said_in_the_next_cell(slurm_notebook, slurm):
    """Issue 61, point 4 (in part): every process of the second node killed mid-cell (its slurmd, the job's step,
    its engines) ends the cell within 10 s naming a rank of that node, the first node's ranks released; once the
    job is cancelled from outside (``scancel``), the next cell says so instead of running."""
    shell = slurm_notebook
    run_ok(shell, "%fsdp attach --slurm --nodes 2 --ranks-per-node 1")
    job = _jobs(slurm)[0].split()[0]
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
