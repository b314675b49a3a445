"""See FSDP happen: each rank captures chosen steps (``--timeline``), every unit's all-gathers, compute and
reduce-scatters; ``last_run().timeline``, ``%fsdp timeline``, ``%fsdp trace``; prefetch that overlaps on CPU ranks.
Real ranks, real gloo collectives, FSDP2 as it runs."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.shared.timeline import LANES, hidden_percent
from tests.conftest import gpu, run_failing, run_ok

pytestmark = [pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent

#: A root with parameters of its own (``embed``, ``head``) and three block units (``blocks.0``...): the course's
#: shape.
TRAIN = """%%fsdp --world-size {ws} --wrap-cls Block --mixed-precision FULL {flags}
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({steps}):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x), y)
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
"""
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


def _steps(run) -> dict[int, list[dict]]:
    by_forward: dict[int, list[dict]] = {}
    for capture in run.timeline:
        by_forward.setdefault(capture["forward"], []).append(capture)
    return by_forward


def _collectives(capture: dict) -> Counter:
    return Counter((e["name"], e["unit"]) for e in capture["events"] if e["lane"] in ("all_gather", "reduce_scatter"))


@pytest.mark.parametrize(
    ("ws", "flags", "gathers_per_block", "reductions"),
    # by world size, 4 then 2 (the tests below run at 2): another size restarts the controller and engines
    [
        (4, "", 2, ("reduce_scatter",)),  # FULL_SHARD: each block gathered in forward and again in backward
        (4, "--sharding-strategy HYBRID_SHARD --replicas 2", 2, ("reduce_scatter", "all_reduce")),
        (4, "--reshard-after-forward 2", 2, ("reduce_scatter",)),  # backward's gather inside a pair of ranks
        (2, "", 2, ("reduce_scatter",)),
        (2, "--sharding-strategy SHARD_GRAD_OP", 1, ("reduce_scatter",)),  # kept gathered into backward
    ],
    ids=["full-ws4", "hybrid-ws4", "reshard-to-2-ws4", "full-ws2", "shard-grad-op-ws2"],
)
def test_each_captured_step_holds_every_collective_fsdp2_issues(
    shell, tiny_model, ws, flags, gathers_per_block, reductions
):
    run_ok(shell, TRAIN.format(ws=ws, flags=flags + " --timeline 1000", steps=4))
    run = nbfsdp.last_run()
    steps = _steps(run)
    assert list(steps) == [1], list(steps)  # the cell's second step: 1000 s leave no other due
    captures = steps[1]
    assert sorted(c["rank"] for c in captures) == list(range(ws))
    for capture in captures:
        counts = _collectives(capture)
        # the root is gathered once (FSDP2 keeps it from forward into backward); each block as the strategy says
        assert counts[("all_gather", "")] == 1, counts
        for block in BLOCKS:
            assert counts[("all_gather", block)] == gathers_per_block, (block, counts)
            for name in reductions:
                assert counts[(name, block)] == 1, (block, name, counts)
        assert all(counts[(name, "")] == 1 for name in reductions), counts  # the root's own gradients
        assert capture["step"] == 1 and capture["step_ms"] > 0 and 0 <= capture["exposed_comm_ms"] <= capture["comm_ms"]
        assert {e["lane"] for e in capture["events"]} <= set(LANES)
        phases = {(e["name"], e["unit"]) for e in capture["events"] if e["lane"] == "compute"}
        assert {("forward", b) for b in BLOCKS} <= phases and {("backward", b) for b in BLOCKS} <= phases, phases
        assert any(e["lane"] == "optimizer" for e in capture["events"])
        assert any(e["lane"] == "nbfsdp" and e["name"] == "log" for e in capture["events"])
        gathers = [e for e in capture["events"] if e["name"] == "all_gather" and e["unit"] == "blocks.0"]
        block = tiny_model.blocks[0]
        shards = ws // (2 if "HYBRID" in flags else 1)
        padded = sum(-(-p.shape[0] // shards) * shards * p[0].numel() * 4 for p in block.parameters())
        assert all(e["bytes"] == padded for e in gathers), (gathers, padded)
        assert capture["settings"]["sharding_strategy"] == (flags.split()[1] if "strategy" in flags else "FULL_SHARD")
        assert capture["post_forward_group"] == (2 if "reshard" in flags else None)
        assert capture["clock_offset_ms"] == 0  # one host: one clock
    # the ranks' clocks are one: a step's captures start within a fraction of the step of each other
    starts = [c["clock_ns"] for c in captures]
    assert (max(starts) - min(starts)) / 1e6 < max(c["step_ms"] for c in captures)


def test_steps_are_captured_second_after_each_change_and_every_n_seconds(shell, tiny_model):
    """The second step; then the first step after a live change (a new capture with the new setting); then one
    every --timeline seconds."""
    session = nbfsdp._magics.session

    def change_soon() -> None:
        deadline = time.monotonic() + 120
        while (session.active is None or not session.active.record.metrics) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        session.change_settings({"forward_prefetch": True})

    thread = threading.Thread(target=change_soon)
    thread.start()
    run_ok(
        shell,
        TRAIN.format(ws=2, flags="--timeline 1000", steps=40)
        .replace("nbfsdp.log(", "time.sleep(0.05); nbfsdp.log(")
        .replace("opt = ", "import time\nopt = "),
    )
    thread.join()
    run = nbfsdp.last_run()
    change = next(m["step"] for m in run.metrics if "changed" in m and m["rank"] == 0)
    steps = _steps(run)
    assert sorted(steps) == [1, change], (sorted(steps), change)
    assert all(not c["settings"]["forward_prefetch"] for c in steps[1])
    assert all(c["settings"]["forward_prefetch"] for c in steps[change])
    run_ok(
        shell,
        TRAIN.format(ws=2, flags="--timeline 0.2", steps=12)
        .replace("nbfsdp.log(", "time.sleep(0.1); nbfsdp.log(")
        .replace("opt = ", "import time\nopt = "),
    )
    assert len(_steps(nbfsdp.last_run())) >= 4  # one every 0.2 s of a 1.2 s loop, after the second
    run_ok(shell, TRAIN.format(ws=2, flags="--timeline 0", steps=4))
    assert nbfsdp.last_run().timeline == []


def test_a_cell_that_profiles_itself_captures_nothing_and_runs(shell, tiny_model):
    cell = TRAIN.format(ws=2, flags="", steps=3).replace(
        "loss.backward();", "from torch.profiler import profile\n    with profile():\n        loss.backward()\n   "
    )
    run_ok(shell, cell)
    run = nbfsdp.last_run()
    assert run.ok and run.timeline == []


def test_timeline_and_trace_show_and_write_the_last_cells_steps(shell, tiny_model, tmp_path, capsys):
    run_ok(shell, TRAIN.format(ws=2, flags="--timeline 1000", steps=3))
    capsys.readouterr()
    run_ok(shell, "%fsdp timeline")
    said = capsys.readouterr().out
    assert "step 1 on rank 0:" in said and "exposed" in said and "all_gather" in said and "blocks.1" in said
    run_ok(shell, "%fsdp timeline --step 1 --rank 1")
    assert "step 1 on rank 1:" in capsys.readouterr().out
    error, _ = run_failing(shell, "%fsdp timeline --step 7")
    assert isinstance(error, UsageError) and "captured: 1" in str(error)
    path = tmp_path / "trace.json"
    run_ok(shell, f"%fsdp trace {path}")
    assert "open it in https://ui.perfetto.dev" in capsys.readouterr().out
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1}  # a process per rank
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == set(LANES)
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float | int) for e in complete)
    assert any(e["name"] == "all_gather blocks.1" and e["args"]["bytes"] > 0 for e in complete)
    error, _ = run_failing(shell, f"%fsdp trace {tmp_path / 'trace.txt'}")
    assert isinstance(error, UsageError) and ".json" in str(error)


PREFETCH = {
    "off": "--backward-prefetch NONE",
    "forward and backward": "--forward-prefetch --backward-prefetch BACKWARD_PRE",
}
WIDE = """
import torch
import torch.nn as nn
class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(512, 2048), nn.Linear(2048, 512)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
torch.manual_seed(0)
wide = nn.Sequential(*[Wide() for _ in range(4)])
"""


def test_prefetch_hides_communication_on_cpu_ranks_with_the_same_losses(shell):
    """On gloo FSDP2 issues each all-gather synchronously: a prefetch only moved the wait (0% hidden, measured).
    Issued asynchronously (``set_unshard_async_op``), a prefetched gather runs in gloo's thread while the rank
    computes: more of the communication is hidden with forward and backward prefetch than without, and the
    training is the same to the bit."""
    run_ok(shell, WIDE)
    hidden, losses = {}, {}
    for name, flags in PREFETCH.items():
        run_ok(
            shell,
            "initial = {k: v.clone() for k, v in wide.state_dict().items()}"
            if name == "off"
            else "wide.load_state_dict(initial)",
        )
        run_ok(
            shell,
            f"""%%fsdp --world-size 2 --wrap-cls Wide --mixed-precision FULL --timeline 0.001 {flags}
opt = torch.optim.SGD(wide.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for step in range(6):
    loss = wide(torch.randn(64, 512, generator=g)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
""",
        )
        run = nbfsdp.last_run()
        captures = [c for c in run.timeline if c["forward"] >= 2]  # past the first steps' warm-up
        hidden[name] = sorted(hidden_percent(c) for c in captures)[len(captures) // 2]
        losses[name] = [run.metric("loss", r) for r in range(2)]
    assert losses["off"] == losses["forward and backward"]  # the same to the bit
    assert hidden["off"] < 10, hidden  # nothing to overlap with: a gather waited on where it is issued
    assert hidden["forward and backward"] > hidden["off"] + 10, hidden


def test_the_quick_starts_measured_peak_and_explains_traced_with_the_ranks_batch_agree(shell):
    """Issue 56 (point 6): explain's bar is traced with the batch the ranks used (rank 0's model's first call, sent
    back as the cell starts), and a captured step's measured peak counts every CPU tensor it allocated (the
    profiler's, on top of the shards and the optimizer's state): the two agree within 5% on the quick start, as
    ``explain --batch`` agrees with FSDPMemTracker. Before, the measured bar stacked each category at its own peak
    and explain's had no activations (4.0 MiB against 1.2 MiB).

    Every step is captured and the least peak of the steps after the first is compared. On gloo a gathered
    unit's buffer is freed by whichever thread lets go of it last, the rank's or gloo's, and the profiler sees no
    free in gloo's thread, so a step can read a gathered unit or two above its schedule (+8.6% once: the first
    step, then the only one captured, on a machine kept busy), never below it; the first step also makes the
    optimizer's state and FSDP's lazy state, and read 4.0 to 5.0 MB by what the shell ran before. The steps after
    it read 4,561,852 B here, and explain's trace 4,764,864: within 5%, never below what the ranks held.
    """
    import nbformat

    quickstart = nbformat.read(REPO / "notebooks" / "00-quickstart.ipynb", as_version=4)
    run_ok(shell, quickstart.cells[3].source)  # the model, batch_for, loss_fn
    cell = next(c.source for c in quickstart.cells if c.source.startswith("%%fsdp"))
    every_step = "--wrap-cls Block --timeline 0.001"
    run_ok(shell, cell.replace("range(300)", "range(6)").replace("--wrap-cls Block", every_step))
    run = nbfsdp.last_run()
    deadline = time.monotonic() + 60  # a hang guard: the trace runs beside the cell, in a thread
    while run.predicted_peak is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.predicted_peak is not None, "no prediction traced with the ranks' first batch"
    for rank in range(2):
        captured = [m["mem_peak"] for m in run.metrics if m["rank"] == rank and "mem_captured_peak" in m]
        assert len(captured) >= 4, "each captured step's record carries its true peak"
        captured = captured[1:]  # the first step: the optimizer's state and FSDP's lazy state made
        measured = min(captured)
        assert 0 <= run.predicted_peak[rank] / measured - 1 < 0.05, (rank, captured, run.predicted_peak)


@gpu
def test_on_gpu_ranks_the_timeline_holds_the_cuda_kernels_times(shell, tiny_model):
    """On a GPU a captured step's transfers are NCCL's kernels and its compute the kernels the units launched,
    timed by the profiler's CUDA activity: two ranks sharing one GPU (``--device cuda``), every collective FSDP2
    issues, each unit's forward and backward kernels."""
    run_ok(shell, TRAIN.format(ws=2, flags="--device cuda --timeline 1000", steps=4).replace("batch_for(rank, step)",
           "(t.to(device) for t in batch_for(rank, step))"))  # fmt: skip
    captures = _steps(nbfsdp.last_run())[1]
    assert sorted(c["rank"] for c in captures) == [0, 1]
    for capture in captures:
        assert capture["device"] == "cuda"
        counts = _collectives(capture)
        assert all(counts[("all_gather", block)] == 2 and counts[("reduce_scatter", block)] == 1 for block in BLOCKS)
        transfers = [e for e in capture["events"] if e["name"] in ("all_gather", "reduce_scatter")]
        assert all(e["ms"] > 0 and e["bytes"] > 0 for e in transfers), transfers
        kernels = {(e["name"], e["unit"]) for e in capture["events"] if e["lane"] == "compute"}
        assert {("forward", b) for b in BLOCKS} <= kernels and {("backward", b) for b in BLOCKS} <= kernels, kernels


def test_a_span_fsdp2_does_not_open_is_refused_with_the_ones_the_timeline_reads():
    from nbfsdp.course import fsdp_span
    from nbfsdp.course.timelines import SPANS

    with pytest.raises(ValueError, match="not one of FSDP2's spans the timeline reads: pre_forward, all_gather"):
        fsdp_span("forward", "blocks.0")
    assert all(fsdp_span(what, "blocks.0").name == f"FSDP::{what} (blocks.0)" for what in SPANS)
