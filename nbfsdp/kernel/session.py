"""One notebook's FSDP session: turns a ``%%fsdp`` cell into a run and its results.

The order matters for "nothing lost in the notebook": the cell is parsed and
every input pickled before any engine is touched, so a syntax error or an
unpicklable name fails at once; the notebook's namespace and models change
only after every rank has succeeded.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from nbfsdp.kernel import history, loaders, predicted
from nbfsdp.kernel.cluster import Cluster, FSDPCluster, World
from nbfsdp.kernel.control import RunControl
from nbfsdp.kernel.delivery import deliver
from nbfsdp.kernel.export_script import ExportedScript, LastCell, export_script
from nbfsdp.kernel.planning import plan
from nbfsdp.kernel.predicted import PeakPrediction
from nbfsdp.kernel.runner import RankRun
from nbfsdp.kernel.where import Where, ask_where
from nbfsdp.shared import optimizers, transfer
from nbfsdp.shared.config import LIVE_SETTINGS, LIVE_STRATEGIES, CheckpointSettings, FSDPConfig, resolve, validate
from nbfsdp.shared.protocol import CellOutcome, CellSpec, IntervalSaves, LoaderSplit, LoaderState
from nbfsdp.shared.units import check_initializable, wrap_rule, wrap_units
from nbfsdp.ui.dashboard import LiveDashboard
from nbfsdp.ui.widget_events import pending_events


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
#: At a cell's end, how long its predicted peak's trace may still take before the final figure is drawn
#: without it (it still reaches ``last_run().predicted_peak`` when done).
PREDICTION_WAIT_SECONDS = 2.0


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


@dataclass(eq=False)
class CellRun:
    """A cell submitted to the ranks, and what finishing it needs."""

    ranks: RankRun
    record: history.RunRecord
    control: RunControl
    dashboard: LiveDashboard | None
    models: dict[str, nn.Module]
    sent: dict[str, Any]
    """The notebook's own loaders, optimizers and schedulers the cell read: they take rank 0's state after."""
    skeletons: dict[str, bytes]
    tokens: dict[str, int]
    started: float
    prediction: PeakPrediction | None = None
    thread: threading.Thread | None = None
    outcome: list[CellOutcome] | BaseException | None = None
    markers: str | None = None
    """``--save-interval``: the directory the ranks agree on each save in, removed when the run ends."""

    def watch_in_background(self) -> None:
        try:
            self.outcome = self.ranks.watch()
        except BaseException as error:  # handed to %fsdp wait, which raises it in the notebook
            self.outcome = error


class Session:
    """The cluster plus what the notebook knows the engines hold."""

    def __init__(self, shell: InteractiveShell, cluster: FSDPCluster | None = None) -> None:
        self.shell = shell
        self.cluster: Cluster = cluster or FSDPCluster()
        self.panel: dict[str, Any] = {}
        """fsdp_config defaults set with ``%fsdp panel`` or a dashboard's controls (flags and --config win)."""
        self.panel_world_size: int | None = None
        self.active: CellRun | None = None
        """The cell running now, in the foreground or the background."""
        self._cells = itertools.count(1)
        self._tokens = itertools.count(1)
        self._engine_models: dict[str, tuple[tuple, int]] = {}  # name -> (fingerprint, token)
        self._engine_objects: dict[str, tuple] = {}
        """Optimizers and schedulers the ranks hold as the notebook does, by name -> ``optimizers.fingerprint``."""
        self._models_generation: int | None = None
        self._loaders = loaders.NotebookLoaders()
        self.last_cell: LastCell | None = None
        """The last user cell, for ``%fsdp export-script``."""
        self.resume_step = 0
        """``resume_step`` of the next user cell: the step of the checkpoint loaded since the last one, else 0."""
        self.loader_resume: dict[str, LoaderState] = {}
        """Loaders that checkpoint saved part-way through an epoch: the next user cell's ranks resume them there."""
        self._own_cluster: FSDPCluster | None = None
        """nbfsdp's own cluster, set aside while ``self.cluster`` is an attached one."""
        self.pending_save: Any = None
        """A ``%fsdp save --async`` the ranks still write (``nbfsdp.kernel.checkpoints.PendingSave``): waited for
        by ``%fsdp wait``, ``stop``, the next save or load, and before the world it runs in is replaced."""

    def run_cell(
        self,
        cell: str,
        *,
        world_size: int,
        timeout: float,
        gather: bool,
        config: FSDPConfig,
        background: bool = False,
        per_rank_batches: bool = False,
        internal: bool = False,
        checkpointing: CheckpointSettings | None = None,
    ) -> None:
        """Run ``cell`` on every rank and bring its results back. ``internal``: nbfsdp's own cell (a checkpoint
        load): no dashboard and no run record, so ``last_run()`` stays the user's last cell.
        ``checkpointing``: with a save interval, the ranks save inside the cell (loads happen before it,
        in ``nbfsdp.kernel.checkpoints.load_before_cell``)."""
        if self.active is not None:
            state = "still going" if self.active.thread.is_alive() else "done"
            raise UsageError(f"an --async run is {state}: `%fsdp wait` brings its results (`%fsdp cancel` ends it)")
        started = time.perf_counter()
        devices = self.cluster.devices(world_size, config.device)
        config = validate(config, world_size, devices)
        cell_number = next(self._cells)
        filename = f"<fsdp-cell-{cell_number}>"
        reads, assigned = transfer.analyze_cell(ast.parse(cell, filename=filename))
        models, others = self._read_inputs(reads)
        if not internal:
            self.last_cell = LastCell(cell, world_size, config, devices, per_rank_batches, reads)
        skeletons = {name: transfer.model_skeleton(model) for name, model in models.items()}
        for model in models.values():  # a rule FSDP2 would refuse (a split tie) fails here, before any engine
            wrap_units(model, config)
        fingerprints = {
            name: (transfer.model_fingerprint(model, skeletons[name]), _settings_key(config))
            for name, model in models.items()
        }
        kept = self._kept_objects(others, models, fingerprints, world_size, timeout, config.device)
        values, sent = self._pack_inputs(others, models, kept)
        plans = self._loaders.plan(sent, world_size, per_rank_batches)

        replaced = not self.cluster.reuses_world(world_size, timeout, config.device)
        if self.pending_save is not None and replaced:
            self.pending_save.wait()  # replacing the world would end its write
        if replaced and "device" in config.why:  # auto chose the CPU where there is a GPU: said once a world
            print(f"nbfsdp: {config.why['device']}", file=sys.stderr)
        world = self.cluster.ensure_world(world_size, timeout, config.device)
        unsteerable = self.cluster.unsteerable()
        if unsteerable and checkpointing is not None and checkpointing.save_interval is not None:
            raise UsageError(f"--save-interval: {unsteerable}")  # the ranks agree on each save through files there
        if world.generation != self._models_generation:  # a new world holds no models, nor anything else
            self._engine_models, self._models_generation, self._engine_objects = {}, world.generation, {}
            if kept:  # it was to be the running one (a rank died since): send everything after all
                kept = set()
                values, sent = self._pack_inputs(others, models, kept)
        to_send = [name for name in models if self._engine_models.get(name, (None,))[0] != fingerprints[name]]
        if to_send:  # an optimizer or scheduler the ranks hold may point at a model's old shards
            self._engine_objects = {name: self._engine_objects[name] for name in kept}
        tokens = {name: next(self._tokens) if name in to_send else self._engine_models[name][1] for name in models}
        materialize = [name for name in to_send if _on_meta(models[name])]
        delivering = {name: models[name] for name in to_send if name not in materialize}
        _, shard_degree = config.mesh_shape(world_size)
        received = deliver(self.cluster, world, delivering, tokens, shard_degree, config.cpu_offload)
        sending = {name: skeletons[name] for name in to_send}
        sent_bytes = [n + len(values) + sum(map(len, sending.values())) for n in received]
        control = RunControl(self.cluster.private_dir, cell_number, unsteerable)
        saves = None
        if checkpointing is not None and checkpointing.save_interval is not None:
            folder = Path(checkpointing.save_folder).expanduser().resolve()  # the engines may run elsewhere
            folder.mkdir(parents=True, exist_ok=True)
            markers = Path(self.cluster.private_dir, f"saves-{cell_number}")
            markers.mkdir()
            saves = IntervalSaves(
                folder=str(folder),
                interval=checkpointing.save_interval,
                keep=checkpointing.save_num_checkpoints_to_keep,
                markers=str(markers),
            )
        resume_step = 0
        loader_resume: dict[str, LoaderState] = {}
        if not internal:  # a load's step and positions are for the one cell after it
            resume_step, self.resume_step = self.resume_step, 0
            loader_resume, self.loader_resume = self.loader_resume, {}
        spec = CellSpec(
            code=cell,
            filename=filename,
            generation=world.generation,
            models=list(models),
            model_tokens=tokens,
            assigned=assigned,
            gather=sorted(models) if gather else [],
            fsdp=config,
            materialize=materialize,
            seed=torch.initial_seed() % 2**63,
            control=control.for_ranks,
            loaders={
                name: LoaderSplit(per_rank=per_rank_batches, seed_state=self._loaders.shuffle_state(sent[name]))
                for name in plans
            },
            resume_step=resume_step,
            saves=saves,
            kept=sorted(kept),
            loader_resume={
                # with saves on, every loader also carries the epochs it began before, for the saves' count
                **(
                    {name: LoaderState(epochs=self._loaders.epochs(sent[name]), generators=[]) for name in plans}
                    if saves is not None
                    else {}
                ),
                **{name: state for name, state in loader_resume.items() if name in plans},
            },
        )
        record = history.RunRecord(
            world_size=world_size,
            config=self._effective_settings(world, timeout, gather, config, models),
            sent_bytes=sent_bytes,
        )
        if plans:
            record.config["loaders"] = {name: plan.as_dict() for name, plan in plans.items()}
        if not internal:
            history.record(record)
        for name, loader_plan in plans.items():
            print(loader_plan.line(name))
        dashboard = None if internal else self._dashboard(world, models, config, background)
        prediction = None
        if not internal:
            read = [sent[name] for name in plans]
            prediction = _predict_peak(models, read, per_rank_batches, cell, config, world, record, dashboard)
        ranks = RankRun(
            self.cluster,
            spec,
            values,
            sending,
            view=dashboard,
            sink=dashboard if background else None,
            on_records=functools.partial(_stream_into, record, dashboard),
        )
        run = CellRun(ranks, record, control, dashboard, models, sent, skeletons, tokens, started, prediction)
        run.markers = saves.markers if saves else None
        self.active = run
        if background:
            run.thread = threading.Thread(target=run.watch_in_background, name="nbfsdp-async", daemon=True)
            run.thread.start()
            print(f"nbfsdp: running in the background on {world_size} ranks; `%fsdp wait` for the results")
            return
        try:
            with pending_events() as poll:
                run.outcome = run.ranks.watch(on_poll=poll)
        except BaseException as error:
            run.outcome = error
        self._finish(run)

    def wait(self) -> None:
        """Block until the background run ends, then finish it as a blocking cell would have."""
        run = self.active
        if run is None or run.thread is None:
            print("nbfsdp: no background run")
            return
        try:
            while run.thread.is_alive():
                run.thread.join(0.1)
        except KeyboardInterrupt:
            run.ranks.interrupt()
            run.thread.join()
        self._finish(run)

    def export_script(self, path: str) -> ExportedScript:
        """The last cell as a torchrun script at ``path``, from the notebook's state now (``export_script``)."""
        namespace = self.shell.user_ns
        shuffle = {
            name: self._loaders.shuffle_state(value)
            for name, value in namespace.items()
            if self.last_cell is not None and name in self.last_cell.reads and isinstance(value, DataLoader)
        }
        return export_script(self.last_cell, namespace, path, shuffle)

    def where(self) -> Where:
        """Where each rank of the running world is: its stack and collectives (``nbfsdp.kernel.where``)."""
        world = self.cluster.world
        if world is None:
            raise UsageError("%fsdp where: no world is running (a cell starts one)")
        if why := self.cluster.unsteerable():
            raise UsageError(f"%fsdp where: {why}")
        return ask_where(self.cluster.private_dir, world.world_size, self.cluster.rank_hosts())

    def interrupt(self) -> None:
        """End the background run now, as Ctrl-C ends a blocking cell: SIGINT to every rank, then a kill for a
        rank that does not stop (one blocked in a collective); the next cell starts a fresh world if one died."""
        run = self.active
        if run is None or run.thread is None:
            print("nbfsdp: no background run")
            return
        run.ranks.interrupt()
        run.thread.join()
        try:
            self._finish(run)
        except KeyboardInterrupt:
            print("nbfsdp: the background run was interrupted on every rank; its results are not brought back")

    def cancel(self) -> None:
        """End the running cell cleanly at the start of an agreed forward, the same one on every rank."""
        if self.active is None:
            print("nbfsdp: nothing is running")
            return
        self.active.control.cancel()
        if self.active.dashboard is not None:
            self.active.dashboard.note("stop requested: the ranks end before their next forward")

    def change_settings(self, settings: dict[str, Any]) -> str:
        """A control was changed: the new defaults for later cells, and live in the running cell."""
        given = {key: value for key, value in settings.items() if key != "world_size"}
        checked = resolve({}, given)
        given = {key: getattr(checked, key) for key in given}
        self.panel.update(given)
        if "world_size" in settings:
            self.panel_world_size = int(settings["world_size"])
        run = self.active
        live = {key: value for key, value in given.items() if key in LIVE_SETTINGS}
        strategies = {live.get("sharding_strategy"), run.record.config["sharding_strategy"]} if run else set()
        if "sharding_strategy" in live and strategies - set(LIVE_STRATEGIES):
            live.pop("sharding_strategy")  # another mesh: only a new cell can shard that way
        later = sorted(set(settings) - set(live)) if run else []
        if run is not None and live:
            run.control.change(live)
        words = ", ".join(f"{key}={value}" for key, value in live.items())
        message = f"requested {words} (from the next step)" if run is not None and live else ""
        if later:
            message += f"{'; ' if message else ''}{', '.join(later)}: from the next cell"
        return message

    def _finish(self, run: CellRun) -> None:
        """The run has ended: bring results into the notebook, or raise its error; either way it is recorded."""
        self.active = None
        run.control.remove()
        if run.markers is not None:
            shutil.rmtree(run.markers, ignore_errors=True)
        record, outcome = run.record, run.outcome
        record.elapsed = time.perf_counter() - run.started
        if isinstance(outcome, BaseException):
            record.ok, record.error = False, str(outcome) or type(outcome).__name__
            if run.dashboard:
                run.dashboard.finish(None, "failed")
            raise outcome
        if run.prediction is not None:
            run.prediction.copied()  # the trace copied the model before its weights change
        self._apply_results(outcome, run)
        record.metrics = sorted((m for o in outcome for m in o.metrics), key=lambda m: (m["step"], m["rank"]))
        record.changes = [(m["step"], m["changed"]) for m in record.metrics if m["rank"] == 0 and "changed" in m]
        record.cancelled = outcome[0].cancelled
        if run.prediction is not None:  # a cell shorter than its trace: its final figure still shows the peak
            run.prediction.wait(PREDICTION_WAIT_SECONDS)
        if run.dashboard:
            run.dashboard.finish(record.metrics, "stopped" if record.cancelled else "done")
        record.elapsed = time.perf_counter() - run.started

    def _dashboard(
        self, world: World, models: dict[str, nn.Module], config: FSDPConfig, background: bool
    ) -> LiveDashboard | None:
        """A live dashboard where a frontend can show one: in a kernel, not a terminal IPython."""
        if getattr(self.shell, "kernel", None) is None:
            return None
        hosts = self.cluster.rank_hosts()
        planned = plan(next(iter(models.values())), config, world.world_size, hosts) if models else None
        settings = {**dataclasses.asdict(config), "world_size": world.world_size}
        return LiveDashboard(
            world.world_size,
            world.devices,
            planned.memory if planned else None,
            settings,
            self.change_settings,
            self.cancel,
            with_output=background,
            on_where=lambda: str(self.where()),
            hosts=hosts,
            across_hosts=planned.hosts_lines() if planned else None,
        )

    def _read_inputs(self, reads: list[str]) -> tuple[dict[str, nn.Module], dict[str, Any]]:
        """The notebook's models the cell reads, and every other name it reads.

        Everything that can be refused is refused here or in ``_pack_inputs``, before an engine is touched.
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
        return models, {n: v for n, v in inputs.items() if n not in models}

    def _pack_inputs(
        self, others: dict[str, Any], models: dict[str, nn.Module], kept: set[str]
    ) -> tuple[bytes, dict[str, Any]]:
        """The cell's other names pickled, less those ``kept`` (the ranks hold them already); and the
        loaders, optimizers and schedulers among them all, which take the ranks' state after the cell."""
        sending = {n: v for n, v in others.items() if n not in kept}
        try:
            values = transfer.pack_values(sending, models)
        except transfer.UnpicklableName as error:
            raise UsageError(str(error)) from None
        if len(values) > HUGE_INPUT_BYTES:
            self._warn_huge(sending, models)
        return values, {n: v for n, v in others.items() if isinstance(v, (DataLoader, *optimizers.STATEFUL))}

    def _kept_objects(
        self,
        others: dict[str, Any],
        models: dict[str, nn.Module],
        fingerprints: dict[str, tuple],
        world_size: int,
        timeout: float,
        device: str,
    ) -> set[str]:
        """The optimizers and schedulers the cell reads that need not be sent: the running world holds
        them as the notebook does (their fingerprint is the one taken when a cell brought their state
        back), and the models they point at stay on the ranks as they are. An optimizer goes with its
        schedulers: one sent while the other stays would be bound to a copy."""
        world = self.cluster.world
        if not self.cluster.reuses_world(world_size, timeout, device) or world.generation != self._models_generation:
            return set()
        held = {
            id(p)
            for name, model in models.items()
            if self._engine_models.get(name, (None,))[0] == fingerprints[name]
            for p in model.parameters()
        }
        stateful = {n: v for n, v in others.items() if isinstance(v, optimizers.STATEFUL)}
        kept = {
            name
            for name, value in stateful.items()
            if self._engine_objects.get(name) == optimizers.fingerprint(value)
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

    def _warn_huge(self, values: dict[str, Any], models: dict[str, nn.Module]) -> None:
        """Name the inputs that make a cell's payload big: each rank gets a copy of each."""
        sizes = {name: transfer.pickled_size(v, models) for name, v in values.items()}
        big = ", ".join(f"{n} ({s / 2**20:.0f} MiB)" for n, s in sizes.items() if s > HUGE_INPUT_BYTES // 4)
        world = self.cluster.world
        ranks = f"each of {world.world_size} ranks" if world else "each rank"
        print(f"nbfsdp: sending {big} to {ranks}; data this big is better loaded on the ranks", file=sys.stderr)

    @staticmethod
    def _effective_settings(
        world: World, timeout: float, gather: bool, config: FSDPConfig, models: dict[str, nn.Module]
    ) -> dict[str, Any]:
        """What ``last_run().config`` shows: the world, then the FSDP settings in Composer's names (``why``: those
        nbfsdp chose for the device or runs otherwise than asked)."""
        return {
            "world_size": world.world_size,
            "backend": world.backend,
            "device": world.devices.type,
            "devices": str(world.devices),
            "timeout": timeout,
            "gather": gather,
            **config.as_dict(),
            "fsdp_units": {name: _unit_names(model, config) for name, model in models.items()},
            "fsdp_wrap": {name: wrap_rule(model, config).as_dict() for name, model in models.items()},
        }

    def _apply_results(self, outcomes: list[CellOutcome], run: CellRun) -> None:
        """Trained weights into the notebook's own model objects, then the names rank 0 sent."""
        first = outcomes[0]
        for name, state in first.states.items():
            model = run.models[name]
            # in place, so other references see it too; a meta-built model takes the tensors as they are
            model.load_state_dict(transfer.tied_as(model, state), assign=_on_meta(model))
        for name, model in run.models.items():
            # what the engines hold now: these weights, under the settings in force at the end (live changes too)
            settings = _settings_key(first.settings[name])
            self._engine_models[name] = (
                (transfer.model_fingerprint(model, run.skeletons[name]), settings),
                run.tokens[name],
            )
        for name, state in first.in_place.items():
            run.sent[name].load_state_dict(state)  # in place: a scheduler bound to it, its parameters, stay
            self._engine_objects[name] = optimizers.fingerprint(run.sent[name])
        for name, state in first.loaders.items():
            self._loaders.continue_after(run.sent[name], state)
        objects = dict(run.sent)
        for name, data in first.names.items():  # optimizers first: a scheduler the cell made refers to one
            objects[name] = self.shell.user_ns[name] = transfer.load_result(data, run.models, objects)
            optimizers.track_steps(objects[name])
            if isinstance(objects[name], optimizers.STATEFUL):
                self._engine_objects[name] = optimizers.fingerprint(objects[name])
            else:
                self._engine_objects.pop(name, None)
        if first.skipped:
            reasons = "; ".join(f"{name} ({why})" for name, why in first.skipped.items())
            print(f"nbfsdp: kept on the engines only, not brought back: {reasons}", file=sys.stderr)

    def now_in_sync(self, models: dict[str, nn.Module], objects: dict[str, Any]) -> None:
        """The notebook's models, optimizers and schedulers now hold what the ranks hold (both read one
        checkpoint): the next cell sends none of them."""
        for name, model in models.items():
            (_, settings), token = self._engine_models[name]
            self._engine_models[name] = (
                (transfer.model_fingerprint(model, transfer.model_skeleton(model)), settings),
                token,
            )
        for name, value in objects.items():
            self._engine_objects[name] = optimizers.fingerprint(value)

    def engine_models(self) -> list[str]:
        """The notebook's models the running world holds (sharded by an earlier cell)."""
        world = self.cluster.world
        if world is None or world.broken or world.generation != self._models_generation:
            return []
        return list(self._engine_models)

    def restore_loader(self, loader: DataLoader, state: LoaderState) -> None:
        """A loader shuffles on from a checkpoint's position, as after the cell that left it there (its
        generators' states, and the epoch count the next cell's plan line shows)."""
        self._loaders.restore(loader, state)

    def loader_epochs(self, loader: DataLoader) -> int:
        """Epochs the notebook's loader began on the ranks: what a checkpoint saves as its epoch count."""
        return self._loaders.epochs(loader)

    def attach(self, profile: str | None, cluster_id: str | None, shared_dir: str | None = None) -> list[str]:
        """Run the next cells on a running ipyparallel cluster nbfsdp did not start (``nbfsdp.kernel.attached``),
        instead of its own, which stops; return what to say of it."""
        from nbfsdp.kernel.attached import AttachedCluster

        if self.active is not None:
            raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then attach")
        attached = AttachedCluster(profile, cluster_id, shared_dir)
        self.detach()
        self.stop()
        self._own_cluster, self.cluster = self.cluster, attached
        return attached.summary()

    def attached_to(self, profile: str, cluster_id: str | None) -> bool:
        """The cells run on the cluster of ``profile`` (and ``cluster_id``, where given) already."""
        cluster = self.cluster
        return self.attached and cluster.profile == profile and cluster_id in (None, cluster.cluster_id)

    @property
    def attached(self) -> bool:
        """The cells run on a cluster nbfsdp did not start."""
        return self._own_cluster is not None

    def detach(self) -> bool:
        """Let go of an attached cluster (it goes on running); the next cell starts nbfsdp's own again.
        Whether one was attached."""
        if self._own_cluster is None:
            return False
        if self.pending_save is not None:
            self.pending_save.wait()
        self.cluster.detach()
        self.cluster, self._own_cluster = self._own_cluster, None
        self._engine_models, self._engine_objects = {}, {}
        return True

    def stop(self) -> None:
        """End the cluster; a background run still going ends with it. A background save is waited for
        first; its error, if any, is raised once the cluster has stopped."""
        failed: BaseException | None = None
        if self.pending_save is not None:
            try:
                self.pending_save.wait()
            except Exception as error:  # the cluster still stops
                failed = error
        if self.active is not None and self.active.thread is not None:
            self.active.ranks.interrupt()
            self.active.thread.join()
            self.active.control.remove()
            if self.active.markers is not None:
                shutil.rmtree(self.active.markers, ignore_errors=True)
            self.active = None
        self.cluster.stop()
        self._engine_models, self._engine_objects = {}, {}
        if failed is not None:
            raise failed


def _predict_peak(
    models: dict[str, nn.Module],
    loaders: list[Any],
    per_rank_batches: bool,
    cell: str,
    config: FSDPConfig,
    world: World,
    record: history.RunRecord,
    dashboard: LiveDashboard | None,
) -> PeakPrediction | None:
    """The cell's first model's peak, traced beside the cell where its batch is known (``predicted``)."""
    if not models:
        return None
    model = next(iter(models.values()))
    autocast = predicted.cell_autocast(cell, world.devices)
    try:
        workload = predicted.cell_workload(model, loaders, per_rank_batches, autocast)
    except Exception:  # a loader that cannot give a batch fails on the ranks too, where the cell reports it
        return None
    if workload is None:
        return None

    def done(peaks: list[int], described: str) -> None:
        record.predicted_peak = peaks
        if dashboard is not None:
            dashboard.predict_peaks(peaks, described)

    return PeakPrediction(model, config, world.world_size, world.devices, workload, done)


def _stream_into(record: history.RunRecord, dashboard: LiveDashboard | None, records: list[dict[str, Any]]) -> None:
    """Records as the ranks send them: into ``last_run().metrics`` while the cell runs, and onto the dashboard.

    When the cell ends, ``metrics`` becomes every rank's complete list, in step order.
    """
    record.metrics.extend(records)
    if dashboard is not None:
        dashboard.add(records)


def _settings_key(config: FSDPConfig) -> str:
    """An ``FSDPConfig``'s fields as part of a model's fingerprint: other settings, shard again.

    ``why`` only explains them: FULL chosen by default and FULL asked for shard alike."""
    return repr(sorted((key, value) for key, value in dataclasses.asdict(config).items() if key != "why"))


def current_session() -> Session:
    """The notebook's session, for nbfsdp's functions (``nbfsdp.save``, ``nbfsdp.where``); the magics hold theirs."""
    from IPython import get_ipython

    shell = get_ipython()
    magics = shell.magics_manager.registry.get("FSDPMagics") if shell is not None else None
    if magics is None:
        raise UsageError("nbfsdp is not loaded (or still loading in the background): run %load_ext nbfsdp first")
    return magics.session


def where() -> Where:
    """``%fsdp where`` in Python: where each rank of the running world is, and what that says
    (``nbfsdp.kernel.where``)."""
    return current_session().where()
