"""The kernel's record of what the engines hold, so that a cell sends only what changed.

A model the ranks hold is known by its fingerprint (its weights and skeleton, and the settings it is
sharded under) and a token the ranks know its shards by; an optimizer or scheduler by
``optimizers.fingerprint`` as a cell last brought its state back. Everything here is plain bookkeeping:
no cluster, no engine, testable with a model and an optimizer alone.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from nbfsdp.shared import optimizers, transfer
from nbfsdp.shared.config import FSDPConfig

#: A model's fingerprint: its weights and skeleton (``transfer.model_fingerprint``), then ``settings_key``.
Fingerprint = tuple[Any, str]


def settings_key(config: FSDPConfig) -> str:
    """An ``FSDPConfig``'s fields as part of a model's fingerprint: other settings, shard again.

    ``why`` only explains them: FULL chosen by default and FULL asked for shard alike; a memory limit is the
    rank's, not the model's."""
    return repr(sorted((k, v) for k, v in dataclasses.asdict(config).items() if k not in ("why", "memory_limit")))


def fingerprint(model: nn.Module, skeleton: bytes, config: FSDPConfig) -> Fingerprint:
    """What the ranks must hold for ``model`` to need no sending: these weights, sharded under ``config``."""
    return transfer.model_fingerprint(model, skeleton), settings_key(config)


class EngineHoldings:
    """What the running world holds of the notebook's models, optimizers and schedulers, by name."""

    def __init__(self) -> None:
        self.generation: int | None = None
        """The world these holdings are in: another world holds nothing of them."""
        self._models: dict[str, tuple[Fingerprint, int]] = {}  # name -> (fingerprint, token)
        self._objects: dict[str, tuple] = {}  # name -> optimizers.fingerprint
        self._settings: dict[str, FSDPConfig] = {}  # name -> the settings its model is sharded under
        self._tokens = itertools.count(1)

    def forget(self, generation: int | None = None) -> None:
        """Nothing is held any more (a new world, a stopped cluster, another cluster)."""
        self._models, self._objects, self.generation = {}, {}, generation

    def forget_model(self, name: str) -> None:
        """The ranks' copy of model ``name`` no longer counts (its weights are to be read anew): the next cell
        sends it."""
        self._models.pop(name, None)

    def models(self) -> list[str]:
        return list(self._models)

    def holds(self, name: str, model_fingerprint: Fingerprint) -> bool:
        """The ranks hold model ``name`` as it is now: it need not be sent."""
        return self._models.get(name, (None,))[0] == model_fingerprint

    def tokens_for(self, models: Iterable[str], sending: list[str]) -> dict[str, int]:
        """Each model's token on the ranks: a new one for each model sent, its old one for the others."""
        return {name: next(self._tokens) if name in sending else self._models[name][1] for name in models}

    def kept_objects(
        self, others: dict[str, Any], models: dict[str, nn.Module], fingerprints: dict[str, Fingerprint]
    ) -> set[str]:
        """The optimizers and schedulers of ``others`` that need not be sent: the ranks hold them as the
        notebook does, and the models they point at stay on the ranks as they are. An optimizer goes with
        its schedulers: one sent while the other stays would be bound to a copy."""
        held = {
            id(p) for name, model in models.items() if self.holds(name, fingerprints[name]) for p in model.parameters()
        }
        stateful = {n: v for n, v in others.items() if isinstance(v, optimizers.STATEFUL)}
        kept = {
            name
            for name, value in stateful.items()
            if self._objects.get(name) == optimizers.fingerprint(value)
            and (not isinstance(value, Optimizer) or {id(p) for g in value.param_groups for p in g["params"]} <= held)
        }
        for _ in range(2):  # a scheduler stays only with its optimizer, and an optimizer only with its schedulers
            names = {id(stateful[name]): name for name in kept}
            for name, value in stateful.items():
                bound = getattr(value, "optimizer", None)
                if isinstance(value, Optimizer) or bound is None:
                    continue
                if id(bound) not in names or name not in kept:
                    kept.discard(name)
                    kept.discard(names.get(id(bound), ""))
        return kept

    def models_sent(self, kept: set[str]) -> None:
        """Models are being sent anew: an optimizer or scheduler the ranks hold may point at their old
        shards, so only those the cell keeps stay held."""
        self._objects = {name: self._objects[name] for name in kept}

    def model_held(
        self, name: str, model_fingerprint: Fingerprint, token: int, config: FSDPConfig | None = None
    ) -> None:
        self._models[name] = (model_fingerprint, token)
        if config is not None:
            self._settings[name] = config

    def settings_of(self, name: str) -> FSDPConfig | None:
        """The settings the ranks hold model ``name`` under (nbfsdp's own cells over it keep them)."""
        return self._settings.get(name) if name in self._models else None

    def object_held(self, name: str, value: Any) -> None:
        """The ranks hold ``value`` under ``name`` as the notebook does now (a scheduler or optimizer), or
        hold nothing the notebook tracks under that name."""
        if isinstance(value, optimizers.STATEFUL):
            self._objects[name] = optimizers.fingerprint(value)
        else:
            self._objects.pop(name, None)

    def now_in_sync(self, models: dict[str, nn.Module], objects: dict[str, Any]) -> None:
        """The notebook's models, optimizers and schedulers now hold what the ranks hold (both read one
        checkpoint): the next cell sends none of them."""
        for name, model in models.items():
            (_, settings), token = self._models[name]
            self._models[name] = ((transfer.model_fingerprint(model, transfer.model_skeleton(model)), settings), token)
        for name, value in objects.items():
            self.object_held(name, value)
