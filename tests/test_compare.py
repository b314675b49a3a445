"""%fsdp compare and nbfsdp.compare: recent runs side by side."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.comparison import loss_figure
from tests.conftest import run_ok

pytestmark = pytest.mark.timeout(120)

TRAIN = """%%fsdp --world-size 2 --wrap-cls Block --sharding-strategy {strategy}
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(4):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x), y)
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
"""


def test_recent_runs_side_by_side(shell, tiny_model, capsys):
    run_ok(shell, TRAIN.format(strategy="FULL_SHARD"))
    first = nbfsdp.last_run()
    run_ok(shell, TRAIN.format(strategy="SHARD_GRAD_OP"))
    second = nbfsdp.last_run()

    rows = nbfsdp.compare(2)
    assert [row["settings"] for row in rows] == [
        {"sharding_strategy": "FULL_SHARD"},
        {"sharding_strategy": "SHARD_GRAD_OP"},
    ]  # only what differed
    for row, run in zip(rows, (first, second), strict=True):
        assert row["final_loss"] == run.metric("loss", rank=0)[-1]
        assert row["peak_memory"] == [max(m["mem_peak"] for m in run.metrics if m["rank"] == r) for r in (0, 1)]
        assert 0 < row["median_step_time"] < 5
    assert rows[1]["run"] == rows[0]["run"] + 1 == len(nbfsdp.runs())

    capsys.readouterr()
    shell.run_line_magic("fsdp", "compare 2")
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["run", "sharding_strategy"]
    assert "FULL_SHARD" in out and "SHARD_GRAD_OP" in out and "MiB" in out
    figure = loss_figure(2)
    assert len(figure.axes[0].lines) == 2


def test_compare_refuses_a_bad_count(shell):
    with pytest.raises(UsageError, match="one optional positive number of runs"):
        shell.run_line_magic("fsdp", "compare many")
