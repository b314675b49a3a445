"""The planner's trace made fast enough for ``--suggest`` (``nbfsdp.kernel.planning.peak.TraceCache``): a deep
stack of alike layers traced cut to a few and stretched, one recording replayed under every setting it does not
see, and AdamW's step extrapolated from a few layers. Each must give the bytes a whole trace gives."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn as nn

import nbfsdp
from nbfsdp.kernel.planning import peak
from nbfsdp.kernel.planning.workload import Workload
from nbfsdp.shared.config import FSDPConfig, validate
from nbfsdp.shared.devices import choose

pytestmark = pytest.mark.timeout(600)

transformers = pytest.importorskip("transformers")


def _llama(layers: int) -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


class Block(nn.Module):
    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Deeper(Block):
    """Keeps for its backward a tensor that grows with its place in the stack: no two layers alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grows = x.new_ones(x.shape[0], self.index + 1, requires_grad=True)
        return super().forward(x) + (grows * x[:, :1]).sum(-1, keepdim=True)


class Stack(nn.Module):
    def __init__(self, block: type[Block], depth: int = 30, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(block(width, index) for index in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _peaks(model: nn.Module, cache: peak.TraceCache, device: str, micro_batches: int = 1, **settings) -> list:
    devices = choose(device, 4, 0, planning=True)
    config = validate(FSDPConfig(device=device, **settings), 4, devices)
    if isinstance(model, Stack):
        batch = (torch.empty(16, 8, device="meta"),)
    else:
        ids = torch.empty(8, 32, dtype=torch.long, device="meta")
        batch = {"input_ids": ids, "labels": ids}
    workload = Workload(batch=batch, micro_batches=micro_batches)
    peaks, _ = peak.rank_peaks(model, config, devices, workload, cache)
    failure = peak.Failure(limit=peaks[0].total * 3 // 4, first_step=False)
    crossed = peak.crossing(model, config, devices, workload, failure, cache=cache)
    return [(p.as_dict(), p.at) for p in peaks] + [(crossed.as_dict(), crossed.at)]


SETTINGS = [
    {},
    {"sharding_strategy": "SHARD_GRAD_OP", "forward_prefetch": True},
    {"activation_checkpointing": True},
    {"activation_checkpointing": True, "checkpoint_scope": "attention"},
    {"mixed_precision": "PURE", "micro_batches": 2},
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_a_deep_llama_traced_cut_and_stretched_peaks_as_traced_whole(device, settings):
    model = _llama(26)
    settings = {"wrap_cls": "LlamaDecoderLayer", **settings}
    micro = settings.pop("micro_batches", 1)
    cut = peak.TraceCache()
    assert _peaks(model, cut, device, micro, **settings) == _peaks(
        model, peak.TraceCache(cut_stacks=False), device, micro, **settings
    )
    assert (cut.traced, cut.stretched) == (3, 1)  # 3, 4 and 5 layers recorded, not 26


def test_every_second_layer_checkpointed_is_a_stack_of_period_two():
    model = Stack(Block, depth=50)
    settings = {"wrap_cls": "Block", "activation_checkpointing": True, "checkpoint_every": 2}
    cut = peak.TraceCache()
    assert _peaks(model, cut, "cpu", **settings) == _peaks(model, peak.TraceCache(cut_stacks=False), "cpu", **settings)
    assert (cut.traced, cut.stretched) == (3, 1)  # 6, 8 and 10 layers


def test_layers_that_are_not_alike_are_traced_whole():
    """Their parameters match, but each keeps more than the one before: the cut recordings do not stretch into
    each other, and the whole stack is traced."""
    model = Stack(Deeper)
    cut = peak.TraceCache()
    assert _peaks(model, cut, "cpu", wrap_cls="Deeper") == _peaks(
        model, peak.TraceCache(cut_stacks=False), "cpu", wrap_cls="Deeper"
    )
    assert (cut.traced, cut.stretched) == (4, 0)  # three cuts tried, then the whole


@pytest.fixture(scope="module")
def suggested() -> tuple[nn.Module, dict, nbfsdp.Plan, str]:
    """One ``--suggest`` search (seconds of tracing) for the tests of its suggestions and of its progress line:
    the model, the settings asked, the plan, and what it wrote to stderr."""
    model = _llama(26)
    ids = torch.empty(16, 32, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    # the margin (768 MiB of CUDA context, 8% for the allocator) and 14.6 MB for the step: the asked step's
    # 20.0 MB does not fit, checkpointing, PURE, micro-batches and more ranks do
    asked = {"world_size": 4, "device": "cpu", "wrap_cls": "LlamaDecoderLayer", "batch": batch}
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        planned = nbfsdp.explain(model, **asked, device_memory="783MiB", suggest=True)
    return model, asked, planned, said.getvalue()


def test_suggestions_replayed_from_shared_recordings_peak_as_their_own_plans(suggested):
    """A suggestion's plan reuses the recordings of the plans before it (the same units, dtypes and inputs):
    its peak is what explaining its settings anew gives."""
    model, asked, planned, _ = suggested
    assert not planned.fits and len(planned.suggestions) >= 5, planned
    for option in planned.suggestions:
        settings = dict(option.change_settings)
        size = settings.pop("world_size", 4)
        micro = settings.pop("micro_batches", 1)
        if micro > 1:
            continue  # explain takes no micro-batches: the workload says them
        alone = nbfsdp.explain(model, **{**asked, "world_size": size}, **settings, device_memory="783MiB")
        assert alone.peak == option.peak, option.change


def test_explain_suggest_says_how_far_its_search_is(suggested):
    said = suggested[3]
    assert "nbfsdp: --suggest: 1 of " in said and "settings traced in" in said.splitlines()[-1], said


def test_a_search_with_a_budget_of_recordings_tries_what_they_replay_and_the_same_on_any_machine():
    """The out-of-memory report's search: at most N recordings of the step, so the fixes it offers do not depend
    on how fast the machine traces (a budget in seconds found PURE on one machine and not on another)."""
    from nbfsdp.kernel.planning import fitting
    from nbfsdp.kernel.planning.plans import StepTrace, plan

    model = _llama(26)
    ids = torch.empty(16, 32, dtype=torch.long, device="meta")
    devices = choose("cpu", 4, 0, planning=True)
    config = validate(FSDPConfig(device="cpu", wrap_cls="LlamaDecoderLayer"), 4, devices)
    workload = Workload(batch={"input_ids": ids, "labels": ids})
    memory = fitting.device_memory(None, "783MiB")

    def searched() -> tuple[list[str], int]:
        trace = StepTrace(workload=workload, memory=memory, suggest=True, cache=peak.TraceCache(most=2))
        planned = plan(model, config, 4, devices=devices, trace=trace)
        return [s.change for s in planned.suggestions], planned.untried

    changes, untried = searched()
    assert changes == ["activation checkpointing"] and untried > 0  # the asked step's recording, then checkpointing
    assert searched() == (changes, untried)
