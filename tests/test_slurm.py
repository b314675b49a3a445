"""A real Slurm in the tests (issue 61, point 1): a ``slurmctld`` and two ``slurmd`` in network namespaces, with
``munge`` and no accounting daemon (``benchmarks.slurm_hosts``). Skipped, saying why, where namespaces cannot be
made or the packages are missing (``make test`` installs them as root)."""

from __future__ import annotations

import time

import pytest

from benchmarks import slurm_hosts

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
