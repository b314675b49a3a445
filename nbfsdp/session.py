"""One notebook's FSDP session: turns a ``%%fsdp`` cell into a run and its results.

The order matters for "nothing lost in the notebook": the cell is parsed and
every input pickled before any engine is touched, so a syntax error or an
unpicklable name fails at once; the notebook's namespace and models change
only after every rank has succeeded.
"""

from __future__ import annotations

import ast
import itertools
import pickle
import sys
import time
from typing import Any

import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbfsdp import history, transfer
from nbfsdp.cluster import FSDPCluster
from nbfsdp.runner import run_on_ranks
from nbfsdp.sharding import block_units

#: FSDP2's behaviour with no settings, in Composer's ``fsdp_config`` vocabulary.
DEFAULT_FSDP_CONFIG = {
    "sharding_strategy": "FULL_SHARD",
    "mixed_precision": "FULL",
    "backward_prefetch": "BACKWARD_PRE",
    "forward_prefetch": False,
    "activation_checkpointing": False,
    "cpu_offload": False,
}


def _unit_names(model: nn.Module) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(unit)] for unit in block_units(model)] + [""]


class Session:
    """The cluster plus what the notebook knows the engines hold."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self.cluster = FSDPCluster()
        self._cells = itertools.count(1)
        self._tokens = itertools.count(1)
        self._engine_models: dict[str, tuple[tuple, int]] = {}  # name -> (fingerprint, token)
        self._models_generation: int | None = None

    def run_cell(self, cell: str, *, world_size: int, timeout: float, gather: bool) -> None:
        started = time.perf_counter()
        number = next(self._cells)
        tree = ast.parse(cell, filename=f"<fsdp-cell-{number}>")
        reads, assigned = transfer.analyze_cell(tree)
        namespace, hidden = self.shell.user_ns, self.shell.user_ns_hidden
        inputs = {name: namespace[name] for name in reads if name in namespace and name not in hidden}
        models: dict[str, nn.Module] = {}
        for name, value in inputs.items():  # a second name for the same model travels as a reference
            if transfer.is_model(value) and all(value is not m for m in models.values()):
                models[name] = value
        for name, model in models.items():
            if any(p.is_meta for p in model.parameters()):
                raise UsageError(f"{name!r} is on the meta device: give it real weights before %%fsdp")
        try:
            values = transfer.pack_values({n: v for n, v in inputs.items() if n not in models}, models)
        except transfer.UnpicklableName as error:
            raise UsageError(str(error)) from None
        skeletons = {name: transfer.model_skeleton(model) for name, model in models.items()}
        fingerprints = {name: transfer.model_fingerprint(model, skeletons[name]) for name, model in models.items()}

        world = self.cluster.ensure_world(world_size, timeout)
        if world.generation != self._models_generation:  # a new world holds no models
            self._engine_models, self._models_generation = {}, world.generation
        to_send = [name for name in models if self._engine_models.get(name, (None,))[0] != fingerprints[name]]
        tokens = {name: next(self._tokens) if name in to_send else self._engine_models[name][1] for name in models}
        sending = {name: models[name] for name in to_send}
        per_rank = [
            ({name: skeletons[name] for name in to_send}, *transfer.pack_shards(sending, rank, world_size))
            for rank in range(world_size)
        ]
        spec = {
            "code": cell,
            "filename": f"<fsdp-cell-{number}>",
            "generation": world.generation,
            "models": list(models),
            "model_tokens": tokens,
            "assigned": assigned,
            "gather": sorted(models) if gather else [],
        }
        config = {
            "world_size": world_size,
            "backend": world.backend,
            "device": "cuda" if world.backend == "nccl" else "cpu",
            "timeout": timeout,
            "gather": gather,
            **DEFAULT_FSDP_CONFIG,
            "fsdp_units": {name: _unit_names(model) for name, model in models.items()},
        }
        run = history.RunRecord(world_size=world_size, config=config)
        history.record(run)
        try:
            outcomes = run_on_ranks(self.cluster, spec, values, per_rank)
        except BaseException as error:
            run.ok, run.error = False, str(error) or type(error).__name__
            raise
        finally:
            run.elapsed = time.perf_counter() - started
        for name in to_send:
            self._engine_models[name] = (fingerprints[name], tokens[name])
        self._apply_results(outcomes, models, skeletons, tokens)
        run.metrics = sorted((m for o in outcomes for m in o["metrics"]), key=lambda m: (m["step"], m["rank"]))
        run.elapsed = time.perf_counter() - started

    def _apply_results(
        self, outcomes: list[dict[str, Any]], models: dict[str, nn.Module], skeletons: dict[str, bytes], tokens: dict
    ) -> None:
        """Trained weights into the notebook's own model objects, then the names rank 0 sent."""
        first = outcomes[0]
        for name, state in first["states"].items():
            models[name].load_state_dict(state)  # in place: other references see it too
            fingerprint = transfer.model_fingerprint(models[name], skeletons[name])
            self._engine_models[name] = (fingerprint, tokens[name])
        for name, data in first["names"].items():
            self.shell.user_ns[name] = pickle.loads(data)
        if first["skipped"]:
            reasons = "; ".join(f"{name} ({why})" for name, why in first["skipped"].items())
            print(f"nbfsdp: kept on the engines only, not brought back: {reasons}", file=sys.stderr)

    def stop(self) -> None:
        self.cluster.stop()
        self._engine_models = {}
