"""nbfsdp.log's per-rank memory figures against PyTorch's FSDPMemTracker on the same step."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import nbfsdp
from nbfsdp.engines import metrics
from nbfsdp.shared import torch_private
from tests.conftest import gpu, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(180)]

#: Categories nbfsdp does not follow on CPU (no allocator statistics there).
UNTRACKED_ON_CPU = ("Temp", "All Gather", "Reduce Scatter", "Unsharded Param", "Unsharded Grad", "Buffer", "Inputs")

MEASURE = """%%fsdp --world-size 2 --mixed-precision FULL --timeline 0
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

def categories(snapshot):  # this rank's device only: on CUDA the tracker also reports the CPU's few bytes
    return {str(getattr(k, "value", k)): v for k, v in snapshot[device].items()}

opt = torch.optim.AdamW(wide.parameters(), lr=1e-3)
x, y = batch_for(rank, 0, per_rank=256)
x = x.to(device); y = y.to(device)
loss_fn(wide(x), y).backward(); opt.step(); opt.zero_grad()   # step 0 creates optimizer state
nbfsdp.log(step=0)
tracker = FSDPMemTracker(wide, opt)
with tracker:
    loss_fn(wide(x), y).backward()
    at_step = categories(tracker.get_tracker_snapshot("current"))
    allocated_at_step = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    opt.step(); opt.zero_grad()
    after_step = categories(tracker.get_tracker_snapshot("current"))
peak = categories(tracker.get_tracker_snapshot("peak"))
nbfsdp.log(step=1)
oracles = [None] * world_size
oracle = {"at_step": at_step, "after_step": after_step, "peak": peak, "allocated_at_step": allocated_at_step}
dist.all_gather_object(oracles, oracle)
"""


def _within(measured: float, oracle: float, tolerance: float = 0.10) -> bool:
    return abs(measured - oracle) <= tolerance * oracle


def test_memory_figures_match_fsdp_mem_tracker(shell, tiny_model):
    run_ok(shell, "torch.manual_seed(0)\nwide = Net(width=128, depth=3)\n")
    run_ok(shell, MEASURE)
    for rank, oracle in enumerate(shell.user_ns["oracles"]):
        record = next(m for m in nbfsdp.last_run().metrics if m["rank"] == rank and m["step"] == 1)
        peak = oracle["peak"]
        expected = {
            "mem_params": peak["Sharded Param"],
            "mem_grads": oracle["at_step"]["Sharded Grad"],
            "mem_optim": oracle["after_step"]["OptState"],
            "mem_activations": peak["Activation"],
            "mem_peak": peak["Total"] - sum(peak.get(c, 0) for c in UNTRACKED_ON_CPU),
        }
        for name, value in expected.items():
            assert value > 0, (rank, name)
            assert _within(record[name], value), f"rank {rank} {name}: measured {record[name]}, tracker {value}"


def test_a_captured_steps_peak_counts_every_tensor_as_fsdp_mem_tracker_does(shell, tiny_model):
    """A step the timeline captures (the cell's second, by default) has its CPU peak measured whole: the tensors
    it allocated, as the profiler saw them, on top of the shards and the optimizer's state. That is FSDPMemTracker's
    whole total, gathered parameters and temporaries included, which the meter's categories leave out: the tracker
    here on the step after the captured one, the same step again (under the tracker's own dispatch mode the
    profiler sees fewer allocations)."""
    run_ok(shell, "torch.manual_seed(0)\nwide = Net(width=128, depth=3)\n")
    captured_then_tracked = (
        MEASURE.replace(" --timeline 0", "")
        .replace(
            "nbfsdp.log(step=0)\n",
            "nbfsdp.log(step=0)\nloss_fn(wide(x), y).backward(); opt.step(); opt.zero_grad()\nnbfsdp.log(step=1)\n",
        )
        .replace("nbfsdp.log(step=1)\noracles", "nbfsdp.log(step=2)\noracles")
    )
    run_ok(shell, captured_then_tracked)
    for rank, oracle in enumerate(shell.user_ns["oracles"]):
        record = next(m for m in nbfsdp.last_run().metrics if m["rank"] == rank and m["step"] == 1)
        assert record["mem_peak"] == record["mem_captured_peak"] > record["mem_params"] + record["mem_optim"]
        assert _within(record["mem_peak"], oracle["peak"]["Total"], 0.01), (record["mem_peak"], oracle["peak"])


@gpu
def test_cuda_figures_match_fsdp_mem_tracker_total(shell, tiny_model):
    """On GPU mem_peak is the allocator's peak: the tracker's whole total plus what the allocator holds
    outside tensors (cuBLAS workspaces among them), measured at one instant against the tracker."""
    run_ok(shell, "torch.manual_seed(0)\nwide = Net(width=128, depth=3)\n")
    run_ok(shell, MEASURE.replace("--world-size 2", "--world-size 1"))
    oracle = shell.user_ns["oracles"][0]
    record = next(m for m in nbfsdp.last_run().metrics if m["rank"] == 0 and m["step"] == 1)
    assert {"cuda_allocated", "cuda_reserved", "cuda_max_allocated"} <= record.keys()
    outside_tensors = oracle["allocated_at_step"] - oracle["at_step"]["Total"]
    assert outside_tensors >= 0
    assert _within(record["mem_peak"], oracle["peak"]["Total"] + outside_tensors)


def _hooks_in_force() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _train(model: nn.Module, steps: int, recorder: metrics.Recorder, pause: float = 0.0) -> list[bool]:
    """``steps`` steps, each logged; whether saved-tensor hooks were in force during each."""
    counted = []
    for step in range(steps):
        counted.append(_hooks_in_force() is not None)
        model(torch.randn(4, 8)).sum().backward()
        time.sleep(pause)
        recorder.record({"step": step})
    return counted


#: The hook stack can only be read (by nbfsdp and by these tests) from torch 2.8; before, every step is counted.
needs_hook_stack = pytest.mark.skipif(
    torch_private.top_saved_tensors_hooks() is False, reason="torch < 2.8 counts every step"
)


@needs_hook_stack
def test_activations_are_counted_on_the_first_steps_then_about_once_a_second(monkeypatch):
    """Saved-tensor hooks cost ~20 us a tensor on every step they are in force (1-3% of a small CPU step):
    they count a cell's first steps, then one step per ACTIVATIONS_EVERY_SECONDS; records between repeat
    the last figure counted."""
    monkeypatch.setattr(metrics, "ACTIVATIONS_EVERY_SECONDS", 0.1)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    with metrics.MemoryMeter(torch.device("cpu"), model.parameters()) as meter:
        recorder = metrics.Recorder(0, meter)
        started = time.perf_counter()
        counted = _train(model, 40, recorder, pause=0.01)
        seconds = time.perf_counter() - started
        meter.count_next_step()  # what a settings change asks for
        counted += _train(model, 1, recorder)
    assert _hooks_in_force() is None  # the cell's end leaves none behind
    assert counted[: metrics.COUNTED_FIRST_STEPS] == [True] * metrics.COUNTED_FIRST_STEPS
    every = seconds / metrics.ACTIVATIONS_EVERY_SECONDS  # about 4 on an idle machine; 37 if every step counted
    assert every / 2 - 1 <= sum(counted[metrics.COUNTED_FIRST_STEPS : 40]) <= every + 1
    assert counted[-1]
    figures = [record["mem_activations"] for record in recorder.records]
    assert figures[0] > 0 and len(set(figures)) == 1  # the same model and batch every step: one figure


def _train_with_optimizer(
    model: nn.Module, steps: int, recorder: metrics.Recorder | None, log_before_step: bool = False
) -> list[bool]:
    """``steps`` optimizer steps, each logged (before or after ``opt.step()``) unless ``recorder`` is None;
    whether saved-tensor hooks were in force during each."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counted = []
    for step in range(steps):
        counted.append(_hooks_in_force() is not None)
        model(torch.randn(4, 8)).sum().backward()
        if recorder is not None and log_before_step:
            recorder.record({"step": step})
        opt.step()
        opt.zero_grad()
        if recorder is not None and not log_before_step:
            recorder.record({"step": step})
    return counted


@needs_hook_stack
def test_a_cell_that_does_not_log_is_counted_on_its_first_steps_only():
    """While saved-tensor hooks are in force, every gloo collective takes the GIL in gloo's threads: a cell
    that never logs (no record to end a counted step) stops counting at the optimizer's step, and its
    first record later still carries the figure those steps counted."""
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    with metrics.MemoryMeter(torch.device("cpu"), model.parameters()) as meter:
        counted = _train_with_optimizer(model, 8, None)
        late = metrics.Recorder(0, meter)
        late.record({"step": 8})
    first = metrics.COUNTED_FIRST_STEPS
    assert counted == [True] * first + [False] * (8 - first)
    with metrics.MemoryMeter(torch.device("cpu"), model.parameters()) as meter:
        logged = metrics.Recorder(0, meter)
        _train_with_optimizer(model, 1, logged)  # a counted and logged step: the reference figure
    assert logged.records[0]["mem_activations"] > 0
    assert late.records[0]["mem_activations"] == logged.records[0]["mem_activations"]


@needs_hook_stack
@pytest.mark.parametrize("log_before_step", [False, True])
def test_a_counted_step_ends_at_the_optimizer_or_the_record_whichever_comes_first(monkeypatch, log_before_step: bool):
    """Logging before or after ``opt.step()``: the same steps are counted and every record carries the
    same figure (a count ended by the optimizer is not taken again, empty, by the record after it)."""
    monkeypatch.setattr(metrics, "ACTIVATIONS_EVERY_SECONDS", 3600.0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    with metrics.MemoryMeter(torch.device("cpu"), model.parameters()) as meter:
        recorder = metrics.Recorder(0, meter)
        counted = _train_with_optimizer(model, 6, recorder, log_before_step)
        meter.count_next_step()  # what a settings change asks for
        counted += _train_with_optimizer(model, 2, recorder, log_before_step)
    first = metrics.COUNTED_FIRST_STEPS
    assert counted == [True] * first + [False] * (6 - first) + [True, False]
    figures = [record["mem_activations"] for record in recorder.records]
    assert figures[0] > 0 and len(set(figures)) == 1


@needs_hook_stack
def test_a_cells_own_saved_tensor_hooks_keep_their_place_when_it_logs_inside_them():
    """Hooks are a stack: a log call inside the cell's ``with saved_tensors_hooks`` must neither push the
    meter's above the cell's (the cell would pop them) nor pop the cell's."""
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    packed = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.shape)
        return tensor

    with metrics.MemoryMeter(torch.device("cpu"), model.parameters()) as meter:
        recorder = metrics.Recorder(0, meter)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        with hooks:
            _train(model, 6, recorder)
            assert _hooks_in_force() == (pack, hooks.unpack_hook)
        _train(model, 2, recorder)
    assert len(packed) >= 6 and _hooks_in_force() is None


def test_optimizer_state_is_counted_again_whenever_its_layout_changes():
    """mem_optim is counted once per layout of the optimizer's state (it is updated in place between steps):
    a new parameter group's first step and ``load_state_dict`` must each give a new figure."""
    first, second = nn.Linear(8, 64), nn.Linear(64, 1)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-3)

    def state_bytes() -> int:
        return metrics.storage_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))

    figures, expected = [], []
    with metrics.MemoryMeter(torch.device("cpu"), [*first.parameters(), *second.parameters()]) as meter:
        recorder = metrics.Recorder(0, meter)
        for step in range(6):
            if step == 2:
                opt.add_param_group({"params": list(second.parameters())})
            if step == 4:  # the same groups, no state yet
                fresh = torch.optim.AdamW(first.parameters(), lr=1e-3)
                fresh.add_param_group({"params": list(second.parameters())})
                opt.load_state_dict(fresh.state_dict())
            second(first(torch.randn(4, 8))).sum().backward()
            if step != 4:
                opt.step()
            opt.zero_grad()
            recorder.record({"step": step})
            figures.append(recorder.records[-1]["mem_optim"])
            expected.append(state_bytes())
    assert figures == expected
    assert expected[0] == expected[1] < expected[2] and expected[4] == 0 < expected[5]
