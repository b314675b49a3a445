"""One notebook's FSDP session: turns a ``%%fsdp`` cell into a run and its results.

The order matters for "nothing lost in the notebook": the cell is parsed and
every input pickled before any engine is touched, so a syntax error or an
unpicklable name fails at once; the notebook's namespace and models change
only after every rank has succeeded.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import pickle
import sys
import time
from typing import Any

import torch
import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbfsdp import history, transfer
from nbfsdp.cluster import FSDPCluster, World, visible_gpus
from nbfsdp.config import FSDPConfig, validate
from nbfsdp.dashboard import LiveDashboard
from nbfsdp.explain import plan
from nbfsdp.runner import run_on_ranks
from nbfsdp.sharding import check_initializable, wrap_units


def _unit_names(model: nn.Module, config: FSDPConfig) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(unit)] for unit in wrap_units(model, config)] + [""]


def _check_no_shared_modules(name: str, model: nn.Module) -> None:
    """Composer's duplicate-module check: FSDP shards each module once, by one path."""
    seen: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen and any(True for _ in module.parameters()):
            raise UsageError(
                f"{name}.{seen[id(module)]} and {name}.{path} are the same module; FSDP can shard a module "
                "only once: give each place its own module (tie single parameters instead)"
            )
        seen.setdefault(id(module), path)


#: A cell's pickled inputs above this size get a warning naming the big ones.
HUGE_INPUT_BYTES = 64 * 2**20


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


class Session:
    """The cluster plus what the notebook knows the engines hold."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self.cluster = FSDPCluster()
        self._cells = itertools.count(1)
        self._tokens = itertools.count(1)
        self._engine_models: dict[str, tuple[tuple, int]] = {}  # name -> (fingerprint, token)
        self._models_generation: int | None = None

    def run_cell(self, cell: str, *, world_size: int, timeout: float, gather: bool, config: FSDPConfig) -> None:
        started = time.perf_counter()
        validate(config, world_size, "cuda" if visible_gpus() >= world_size else "cpu")
        filename = f"<fsdp-cell-{next(self._cells)}>"
        reads, assigned = transfer.analyze_cell(ast.parse(cell, filename=filename))
        models, values = self._read_inputs(reads)
        skeletons = {name: transfer.model_skeleton(model) for name, model in models.items()}
        settings = repr(sorted(dataclasses.asdict(config).items()))  # other settings: shard again
        fingerprints = {
            name: (transfer.model_fingerprint(model, skeletons[name]), settings) for name, model in models.items()
        }

        world = self.cluster.ensure_world(world_size, timeout)
        if world.generation != self._models_generation:  # a new world holds no models
            self._engine_models, self._models_generation = {}, world.generation
        to_send = [name for name in models if self._engine_models.get(name, (None,))[0] != fingerprints[name]]
        tokens = {name: next(self._tokens) if name in to_send else self._engine_models[name][1] for name in models}
        sending = {name: models[name] for name in to_send}
        _, shard_degree = config.mesh_shape(world_size)  # rank r holds shard r % shard_degree
        per_rank = [
            (
                {name: skeletons[name] for name in to_send},
                *transfer.pack_shards(sending, rank % shard_degree, shard_degree),
            )
            for rank in range(world_size)
        ]
        spec = {
            "code": cell,
            "filename": filename,
            "generation": world.generation,
            "models": list(models),
            "model_tokens": tokens,
            "assigned": assigned,
            "gather": sorted(models) if gather else [],
            "fsdp": dataclasses.asdict(config),
            "materialize": [name for name in to_send if _on_meta(models[name])],
            "seed": torch.initial_seed() % 2**63,
        }
        run = history.RunRecord(
            world_size=world_size, config=self._effective_settings(world, timeout, gather, config, models)
        )
        history.record(run)
        dashboard = self._dashboard(world, models, config)
        try:
            outcomes = run_on_ranks(self.cluster, spec, values, per_rank, view=dashboard)
        except BaseException as error:
            run.ok, run.error = False, str(error) or type(error).__name__
            if dashboard:
                dashboard.finish(None, "failed")
            raise
        finally:
            run.elapsed = time.perf_counter() - started
        for name in to_send:
            self._engine_models[name] = (fingerprints[name], tokens[name])
        self._apply_results(outcomes, models, skeletons, tokens, settings)
        run.metrics = sorted((m for o in outcomes for m in o["metrics"]), key=lambda m: (m["step"], m["rank"]))
        if dashboard:
            dashboard.finish(run.metrics, "done")
        run.elapsed = time.perf_counter() - started

    def _dashboard(self, world: World, models: dict[str, nn.Module], config: FSDPConfig) -> LiveDashboard | None:
        """A live dashboard where a frontend can show one: in a kernel, not a terminal IPython."""
        if getattr(self.shell, "kernel", None) is None:
            return None
        predicted = plan(next(iter(models.values())), config, world.world_size).memory if models else None
        device = "cuda" if world.backend == "nccl" else "cpu"
        return LiveDashboard(world.world_size, device, predicted)

    def _read_inputs(self, reads: list[str]) -> tuple[dict[str, nn.Module], bytes]:
        """The notebook's models the cell reads, and every other name it reads, pickled.

        Everything that can be refused is refused here, before an engine is touched.
        """
        namespace, hidden = self.shell.user_ns, self.shell.user_ns_hidden
        inputs = {name: namespace[name] for name in reads if name in namespace and name not in hidden}
        models: dict[str, nn.Module] = {}
        for name, value in inputs.items():  # a second name for the same model travels as a reference
            if transfer.is_model(value) and all(value is not m for m in models.values()):
                models[name] = value
        for name, model in models.items():
            if _on_meta(model) and (why := check_initializable(model)):
                raise UsageError(f"{name!r} is built on the meta device, but {why}")
            _check_no_shared_modules(name, model)
        others = {n: v for n, v in inputs.items() if n not in models}
        try:
            values = transfer.pack_values(others, models)
        except transfer.UnpicklableName as error:
            raise UsageError(str(error)) from None
        if len(values) > HUGE_INPUT_BYTES:
            self._warn_huge(others, models)
        return models, values

    def _warn_huge(self, values: dict[str, Any], models: dict[str, nn.Module]) -> None:
        """Name the inputs that make a cell's payload big: each rank gets a copy of each."""
        sizes = {name: len(transfer.pack_values({name: v}, models)) for name, v in values.items()}
        big = ", ".join(f"{n} ({s / 2**20:.0f} MiB)" for n, s in sizes.items() if s > HUGE_INPUT_BYTES // 4)
        world = self.cluster.world
        ranks = f"each of {world.world_size} ranks" if world else "each rank"
        print(f"nbfsdp: sending {big} to {ranks}; data this big is better loaded on the ranks", file=sys.stderr)

    @staticmethod
    def _effective_settings(
        world: World, timeout: float, gather: bool, config: FSDPConfig, models: dict[str, nn.Module]
    ) -> dict[str, Any]:
        """What ``last_run().config`` shows: the world, then the FSDP settings in Composer's names."""
        return {
            "world_size": world.world_size,
            "backend": world.backend,
            "device": "cuda" if world.backend == "nccl" else "cpu",
            "timeout": timeout,
            "gather": gather,
            **config.as_dict(),
            "fsdp_units": {name: _unit_names(model, config) for name, model in models.items()},
        }

    def _apply_results(
        self,
        outcomes: list[dict[str, Any]],
        models: dict[str, nn.Module],
        skeletons: dict[str, bytes],
        tokens: dict[str, int],
        settings: str,
    ) -> None:
        """Trained weights into the notebook's own model objects, then the names rank 0 sent."""
        first = outcomes[0]
        for name, state in first["states"].items():
            # in place, so other references see it too; a meta-built model takes the tensors as they are
            models[name].load_state_dict(state, assign=_on_meta(models[name]))
            fingerprint = (transfer.model_fingerprint(models[name], skeletons[name]), settings)
            self._engine_models[name] = (fingerprint, tokens[name])
        for name, data in first["names"].items():
            self.shell.user_ns[name] = pickle.loads(data)
        if first["skipped"]:
            reasons = "; ".join(f"{name} ({why})" for name, why in first["skipped"].items())
            print(f"nbfsdp: kept on the engines only, not brought back: {reasons}", file=sys.stderr)

    def stop(self) -> None:
        self.cluster.stop()
        self._engine_models = {}
