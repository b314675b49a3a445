"""What the engines hold, as the kernel records it (``nbfsdp.kernel.run.held``): no cluster, no engine."""

from __future__ import annotations

import torch
import torch.nn as nn

from nbfsdp.kernel.run.held import EngineHoldings, fingerprint
from nbfsdp.shared import transfer
from nbfsdp.shared.config import FSDPConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _held(model: nn.Module, config: FSDPConfig | None = None) -> tuple[EngineHoldings, tuple]:
    """Holdings in which the ranks hold ``model`` as it is now, under ``config``."""
    held = EngineHoldings()
    held.forget(generation=1)
    printed = fingerprint(model, transfer.model_skeleton(model), config or FSDPConfig())
    tokens = held.tokens_for({"model": model}, ["model"])
    held.model_held("model", printed, tokens["model"])
    return held, printed


def test_a_model_is_held_until_its_weights_or_its_settings_change():
    model = _model()
    held, printed = _held(model)
    assert held.holds("model", printed)
    assert held.models() == ["model"]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not held.holds("model", fingerprint(model, transfer.model_skeleton(model), FSDPConfig()))
    other = FSDPConfig(sharding_strategy="SHARD_GRAD_OP")
    assert not held.holds("model", fingerprint(_model(), transfer.model_skeleton(_model()), other))


def test_settings_chosen_or_asked_for_alike_fingerprint_alike():
    model = _model()
    skeleton = transfer.model_skeleton(model)
    chosen = FSDPConfig(why={"mixed_precision": "chosen for the CPU"})
    assert fingerprint(model, skeleton, chosen) == fingerprint(model, skeleton, FSDPConfig())


def test_a_model_sent_again_gets_a_new_token_and_a_kept_one_its_old():
    model, other = _model(), _model()
    held, _ = _held(model)
    first = held.tokens_for({"model": model}, [])["model"]
    again = held.tokens_for({"model": model, "other": other}, ["other"])
    assert again["model"] == first
    assert again["other"] != first


def test_an_optimizer_and_its_scheduler_are_kept_together_or_sent_together():
    model = _model()
    held, printed = _held(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    held.object_held("opt", optimizer)
    held.object_held("sched", scheduler)
    others = {"opt": optimizer, "sched": scheduler, "n": 3}
    assert held.kept_objects(others, {"model": model}, {"model": printed}) == {"opt", "sched"}

    optimizer.step()
    scheduler.step()  # the notebook's scheduler moved on: both go, or the kept optimizer is a copy's
    assert held.kept_objects(others, {"model": model}, {"model": printed}) == set()


def test_an_optimizer_over_a_model_sent_anew_is_sent_too():
    model = _model()
    held, _ = _held(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held.object_held("opt", optimizer)
    with torch.no_grad():
        model[1].bias.zero_()
    changed = fingerprint(model, transfer.model_skeleton(model), FSDPConfig())
    assert held.kept_objects({"opt": optimizer}, {"model": model}, {"model": changed}) == set()
    held.models_sent(kept=set())
    held.model_held("model", changed, 7)
    assert held.kept_objects({"opt": optimizer}, {"model": model}, {"model": changed}) == set()


def test_a_name_that_is_no_longer_an_optimizer_is_no_longer_held():
    model = _model()
    held, printed = _held(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held.object_held("opt", optimizer)
    held.object_held("opt", 42)
    assert held.kept_objects({"opt": optimizer}, {"model": model}, {"model": printed}) == set()


def test_after_a_load_the_notebook_and_the_ranks_agree_again():
    model = _model()
    held, _ = _held(model)
    with torch.no_grad():  # a checkpoint read into both the notebook's model and the ranks'
        model[0].weight.mul_(2.0)
    held.now_in_sync({"model": model}, {})
    assert held.holds("model", fingerprint(model, transfer.model_skeleton(model), FSDPConfig()))


def test_a_new_world_holds_nothing():
    model = _model()
    held, printed = _held(model)
    held.forget(generation=2)
    assert held.generation == 2
    assert held.models() == []
    assert not held.holds("model", printed)
