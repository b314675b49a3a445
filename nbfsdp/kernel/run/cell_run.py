"""A cell submitted to the ranks, and how its end comes back into the notebook.

Nothing in the notebook changes until every rank has succeeded: ``finish``
raises a failed run's error before it touches a model or a name.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch.nn as nn
from IPython.core.interactiveshell import InteractiveShell

from nbfsdp.kernel.cluster.rank_calls import RankError, RankOutOfMemory
from nbfsdp.kernel.cluster.world import Cluster, RunningWorld
from nbfsdp.kernel.diagnostics import out_of_memory
from nbfsdp.kernel.diagnostics.hang_report import HangReporter
from nbfsdp.kernel.planning import predicted
from nbfsdp.kernel.planning.plans import Plan, plan
from nbfsdp.kernel.planning.predicted import PeakPrediction
from nbfsdp.kernel.run import history, residence
from nbfsdp.kernel.run.held import EngineHoldings, fingerprint
from nbfsdp.kernel.run.inputs import on_meta
from nbfsdp.kernel.run.loaders import NotebookLoaders
from nbfsdp.kernel.run.runner import RankRun
from nbfsdp.kernel.run.spec import CellModel, Delivery, PreparedCell, RunFiles
from nbfsdp.shared import optimizers, transfer
from nbfsdp.shared.config import LIVE_SETTINGS, LIVE_STRATEGIES, FSDPConfig
from nbfsdp.shared.protocol import CellOutcome, CellSpec, ModelRoute
from nbfsdp.shared.units import wrap_rule, wrap_units
from nbfsdp.ui.dashboard import DashboardCalls, LiveDashboard, RankHosts

#: At a cell's end, how long its predicted peak's trace may still take before the final figure is drawn
#: without it (it still reaches ``last_run().predicted_peak`` when done).
PREDICTION_WAIT_SECONDS = 2.0


@dataclass(eq=False, kw_only=True)
class CellRun:
    """A cell submitted to the ranks, and what finishing it needs: built whole by ``submit``; only its
    ``prediction`` (traced from the first call), ``thread`` and ``outcome`` change after."""

    ranks: RankRun
    record: history.RunRecord
    files: RunFiles
    dashboard: LiveDashboard | None
    models: dict[str, CellModel]
    routes: dict[str, ModelRoute]
    """Each model's route, as the ranks were told it (``CellSpec.models``)."""
    sent: dict[str, Any]
    """The notebook's own loaders, optimizers and schedulers the cell read: they take rank 0's state after."""
    started: float
    holder: tuple[int, int]
    """The world the cell runs in: its generation and size."""
    hang_reporter: HangReporter | None
    """Says, once, where the ranks are when one waits in a collective too long (``--hang-report``)."""
    prediction: PeakPrediction | None
    thread: threading.Thread | None = None
    outcome: list[CellOutcome] | BaseException | None = None

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The cell's models themselves, by name."""
        return {name: model.module for name, model in self.models.items()}

    def watch_in_background(self) -> None:
        try:
            self.outcome = self.ranks.watch()
        except BaseException as error:  # handed to %fsdp wait, which raises it in the notebook
            self.outcome = error

    def change_live(self, given: dict[str, Any], asked: set[str]) -> str:
        """Settings changed while the cell runs: those that can change live go to the ranks, in force from
        their next step; what to say of it (the others apply from the next cell)."""
        live = {key: value for key, value in given.items() if key in LIVE_SETTINGS}
        strategies = {live.get("sharding_strategy"), self.record.config["sharding_strategy"]}
        if "sharding_strategy" in live and strategies - set(LIVE_STRATEGIES):
            live.pop("sharding_strategy")  # another mesh: only a new cell can shard that way
        later = sorted(asked - set(live))
        if live:
            self.files.control.change(live)
        words = ", ".join(f"{key}={value}" for key, value in live.items())
        message = f"requested {words} (from the next step)" if live else ""
        if later:
            message += f"{'; ' if message else ''}{', '.join(later)}: from the next cell"
        return message

    def clean_up(self) -> None:
        """The run's files for the ranks go: its control file, its interval saves' markers; its hang report, if
        one was printed, goes into its record."""
        self.files.remove()
        if self.hang_reporter is not None:
            self.hang_reporter.stop()
            self.record.hang_report, self.record.hang_report_after = self.hang_reporter.report, self.hang_reporter.after


class SessionCallbacks(Protocol):
    """What a cell's run needs of the session: its shell and cluster, and what a dashboard's controls and the
    hang report call."""

    shell: InteractiveShell

    @property
    def cluster(self) -> Cluster: ...

    def change_settings(self, settings: dict[str, Any]) -> str: ...
    def cancel(self) -> None: ...
    def where(self, seconds: float = ...) -> Any: ...


#: The last dashboard's plan, and what it was made of (the first model's skeleton and settings, the world):
#: warm cells over the same model reuse it (20 ms a cell for a 246M-parameter Llama, measured).
_last_plan: tuple[tuple, Plan] | None = None


def live_dashboard(
    cluster: Cluster, world: RunningWorld, prepared: PreparedCell, session: SessionCallbacks
) -> LiveDashboard:
    """The cell's live dashboard: the plan's predicted memory, the controls wired to the session."""
    global _last_plan
    config, hosts = prepared.config, cluster.rank_hosts()
    planned = None
    if prepared.models:
        first = next(iter(prepared.models.values()))
        (_, _, skeleton), settings_key = first.fingerprint
        made_of = (
            id(first.module),
            skeleton,
            settings_key,
            world.world_size,
            tuple(hosts),
            str(world.devices),
        )
        if _last_plan is None or _last_plan[0] != made_of:
            _last_plan = made_of, plan(first.module, config, world.world_size, hosts, world.devices)
        planned = _last_plan[1]
    settings = {**dataclasses.asdict(config), "world_size": world.world_size}
    return LiveDashboard(
        world.devices,
        settings=settings,
        calls=DashboardCalls(
            on_change=session.change_settings, on_stop=session.cancel, on_where=lambda: str(session.where())
        ),
        predicted=planned.memory if planned else None,
        with_output=prepared.options.background,
        hosts=RankHosts(each=hosts, across=planned.hosts_lines() if planned else []),
    )


def submit(
    prepared: PreparedCell,
    delivery: Delivery,
    *,
    spec: CellSpec,
    files: RunFiles,
    started: float,
    session: SessionCallbacks,
) -> CellRun:
    """The cell sent to every rank of the session's running world, with its run record, its dashboard and its
    predicted peak beside it. The ranks start first: a warm cell's dashboard (17 widgets, each a message to the
    frontend: 8 ms) is built while they run, and is displayed before their output, which ``watch`` streams only
    after."""
    cluster, options = session.cluster, prepared.options
    world = cluster.world
    assert world is not None  # the session ensured the cell's world before it delivered the models
    record = new_record(prepared, world, delivery.sent_bytes)
    try:
        ranks = RankRun(cluster, spec, prepared.values, delivery.sending)
    except RankError as error:  # an engine ended before the cell reached it: nothing ran
        record.ok, record.error = False, str(error)
        files.remove()
        raise
    dashboard = prediction = None
    try:
        if not prepared.internal and getattr(session.shell, "kernel", None) is not None:  # a frontend can show one
            dashboard = live_dashboard(cluster, world, prepared, session)
        if not prepared.internal:
            prediction = predict_peak(prepared, world=world, record=record, dashboard=dashboard)
    except BaseException:  # a Ctrl-C while the dashboard is built: the ranks started already
        ranks.stop()
        raise
    reporting = options.hang_report > 0 and not prepared.internal and not cluster.unsteerable()
    # a cell whose collectives wait for a rank at a prompt: --timeout is kept here, by the hang reporter
    timeout = (options.timeout, ranks.time_out) if spec.breakpoints else None
    run = CellRun(
        ranks=ranks,
        record=record,
        files=files,
        dashboard=dashboard,
        models=prepared.models,
        routes=delivery.routes,
        sent=prepared.sent,
        started=started,
        holder=(world.generation, world.world_size),
        hang_reporter=HangReporter(
            session.where, options.hang_report if reporting else 0.0, dashboard, ranks.prompts, timeout
        ).start()
        if reporting or timeout
        else None,
        prediction=prediction,
    )
    ranks.show_on(
        view=dashboard,
        sink=dashboard if options.background else None,
        on_records=functools.partial(stream_into, record, dashboard),
        on_capture=functools.partial(capture_into, record, dashboard),
        # not ``prepared``: its pickled inputs (a loader's dataset) must not outlive the cell with the run
        on_first_call=None
        if prepared.internal
        else functools.partial(_predict_from_call, run, prepared.config, prepared.code, world),
    )
    if dashboard is not None:
        for name, model in prepared.models.items():
            if model.on_ranks:
                dashboard.note(f"{name}: weights live on the ranks only (not gathered after the cell)")
        for name, module in prepared.modules.items():
            if note := _frozen_note(name, module):
                dashboard.note(note)
    return run


def _frozen_note(name: str, model: nn.Module) -> str:
    """What trains of a model with frozen parameters (a LoRA model's base): those have no gradient and no
    optimizer state on the ranks, and the dashboard's predicted memory counts them so."""
    params = list({id(p): p for p in model.parameters()}.values())
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    if not frozen:
        return ""
    trained = sum(p.numel() for p in params) - frozen
    return f"{name}: {trained:,} parameters train; {frozen:,} frozen have no gradient or optimizer state"


def new_record(prepared: PreparedCell, world: RunningWorld, sent_bytes: list[int]) -> history.RunRecord:
    """The cell's run record, kept for ``last_run()`` (a user's cell), and its loaders' plans said."""
    record = history.RunRecord(
        world_size=world.world_size,
        config=effective_settings(
            world, prepared.config, prepared.modules, timeout=prepared.options.timeout, gather=prepared.options.gather
        ),
        sent_bytes=sent_bytes,
    )
    if prepared.plans:
        record.config["loaders"] = {name: loader_plan.as_dict() for name, loader_plan in prepared.plans.items()}
    if not prepared.internal:
        history.record(record)
    for name, loader_plan in prepared.plans.items():
        print(loader_plan.line(name))
    return record


def effective_settings(
    world: RunningWorld, config: FSDPConfig, models: dict[str, nn.Module], *, timeout: float, gather: bool
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
        "fsdp_units": {name: unit_names(model, config) for name, model in models.items()},
        "fsdp_wrap": {name: wrap_rule(model, config).as_dict() for name, model in models.items()},
    }


def unit_names(model: nn.Module, config: FSDPConfig) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(unit)] for unit in wrap_units(model, config)] + [""]


def _predict_from_call(run: CellRun, config: FSDPConfig, code: str, world: RunningWorld, call: Any) -> None:
    """Rank 0's model was first called with ``call`` (its shapes): where the kernel could not know the cell's
    batch before it ran, its predicted peak is traced with this one, the batch the ranks use."""
    if run.prediction is not None or not run.models:
        return
    workload = predicted.workload_of_call(call, autocast=predicted.cell_autocast(code, world.devices))
    if workload is None:
        return
    run.prediction = _prediction(next(iter(run.modules.values())), config, world, workload, run.record, run.dashboard)


def _prediction(
    model: nn.Module,
    config: FSDPConfig,
    world: RunningWorld,
    workload: Any,
    record: history.RunRecord,
    dashboard: LiveDashboard | None,
) -> PeakPrediction:
    """The peak of a step of ``model`` on ``workload``, traced in a thread; into ``last_run().predicted_peak`` and
    the dashboard (each rank's traced bytes by category) when done."""
    prediction: PeakPrediction | None = None

    def done(peaks: list[int], described: str) -> None:
        record.predicted_peak = peaks
        if dashboard is not None:
            dashboard.predict_peaks(peaks, described, prediction.parts if prediction is not None else None)

    prediction = PeakPrediction(model, config, world.devices, workload, done)
    return prediction


def predict_peak(
    prepared: PreparedCell, *, world: RunningWorld, record: history.RunRecord, dashboard: LiveDashboard | None
) -> PeakPrediction | None:
    """The cell's first model's peak, traced beside the cell where its batch is known (``predicted``)."""
    if not prepared.models:
        return None
    model = next(iter(prepared.modules.values()))
    autocast = predicted.cell_autocast(prepared.code, world.devices)
    loaders = [prepared.sent[name] for name in prepared.plans]
    per_rank_batches = prepared.options.per_rank_batches
    try:
        workload = predicted.cell_workload(model, loaders, per_rank_batches=per_rank_batches, autocast=autocast)
    except Exception:  # a loader that cannot give a batch fails on the ranks too, where the cell reports it
        return None
    if workload is None:
        return None
    return _prediction(model, prepared.config, world, workload, record, dashboard)


def stream_into(record: history.RunRecord, dashboard: LiveDashboard | None, records: list[dict[str, Any]]) -> None:
    """Records as the ranks send them: into ``last_run().metrics`` while the cell runs, and onto the dashboard.

    When the cell ends, ``metrics`` becomes every rank's complete list, in step order.
    """
    record.metrics.extend(records)
    if dashboard is not None:
        dashboard.add(records)


def capture_into(record: history.RunRecord, dashboard: LiveDashboard | None, capture: dict[str, Any]) -> None:
    """A step a rank captured (``--timeline``), as it sends it: into ``last_run().timeline`` and onto the
    dashboard's timeline panel. When the cell ends, ``timeline`` becomes every rank's complete list."""
    record.timeline.append(capture)
    if dashboard is not None:
        dashboard.add_capture(capture)


def finish(run: CellRun, shell: InteractiveShell, held: EngineHoldings, loaders: NotebookLoaders) -> None:
    """The run has ended: bring results into the notebook, or raise its error; either way it is recorded."""
    run.clean_up()
    record, outcome = run.record, run.outcome
    record.elapsed = time.perf_counter() - run.started
    if isinstance(outcome, RankOutOfMemory):  # each rank's bytes beside the planner's, and what fits
        world = run.ranks.world
        record.out_of_memory = out_of_memory.explain(
            outcome, run.modules, run.ranks.config, world.world_size, world.devices
        )
        if run.dashboard:
            run.dashboard.note(record.out_of_memory["text"].splitlines()[0].removeprefix("nbfsdp: "))
    if isinstance(outcome, BaseException):
        record.ok, record.error = False, str(outcome) or type(outcome).__name__
        if run.dashboard:
            run.dashboard.finish(None, "failed")
        raise outcome
    assert outcome is not None
    if run.prediction is not None:
        run.prediction.copied()  # the trace copied the model before its weights change
    record.gathered_bytes = {
        name: sum({id(t): t.nbytes for t in state.values()}.values()) for name, state in outcome[0].states.items()
    }
    _apply_results(outcome, run, shell, held, loaders)
    if sum(record.gathered_bytes.values()) >= FREE_GATHERED_BYTES:
        _free_gathered(outcome)
    record.metrics = sorted((m for o in outcome for m in o.metrics), key=lambda m: (m["step"], m["rank"]))
    record.timeline = sorted((c for o in outcome for c in o.timeline), key=lambda c: (c["forward"], c["rank"]))
    record.changes = [(m["step"], m["changed"]) for m in record.metrics if m["rank"] == 0 and "changed" in m]
    record.cancelled = outcome[0].cancelled
    if run.prediction is not None:  # a cell shorter than its trace: its final figure still shows the peak
        run.prediction.wait(PREDICTION_WAIT_SECONDS)
    if run.dashboard:
        run.dashboard.finish(record.metrics, "stopped" if record.cancelled else "done")
    record.elapsed = time.perf_counter() - run.started


#: Gathered weights of at least this size are freed from the kernel at once (``_free_gathered``); below it the
#: collection would cost more than it frees (measured: 333 ms of ``gc.collect`` after a LoRA cell's 100 KB).
FREE_GATHERED_BYTES = 64 * 2**20


def _free_gathered(outcomes: list[CellOutcome]) -> None:
    """The gathered weights are in the notebook's models now: free rank 0's copies at once, so the kernel holds
    one model, not three. ipyparallel's finished futures hold the outcomes in reference cycles (only the
    cyclic collector frees them), and glibc keeps freed blocks of this size in its heap (its mmap threshold rises
    as big blocks are freed) until ``malloc_trim`` gives the pages back: measured, a 192 MiB model left
    364 MiB behind after each gathering cell."""
    for outcome in outcomes:
        outcome.states.clear()
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent elsewhere (musl, macOS)
    if trim is not None:
        trim(0)


def _apply_results(
    outcomes: list[CellOutcome], run: CellRun, shell: InteractiveShell, held: EngineHoldings, loaders: NotebookLoaders
) -> None:
    """Trained weights into the notebook's own model objects, then the names rank 0 sent."""
    first = outcomes[0]
    reformed = set()  # models that live on the ranks and changed form here (freed, or filled): their skeletons anew
    for name, model in run.models.items():
        state = first.states.get(name)
        if model.on_ranks:
            world, written = run.holder, name in first.written
            if residence.settle(model.module, world=world, written=written, state=state):
                reformed.add(name)
        elif state is not None:
            # in place, so other references see it too; a meta-built model takes the tensors as they are; only what
            # some rank wrote came back (a LoRA cell's adapters, not its frozen base)
            partial = len(state) < len(model.module.state_dict(keep_vars=True))
            tied = transfer.tied_as(model.module, state)
            model.module.load_state_dict(tied, strict=not partial, assign=on_meta(model.module))
    for name, model in run.models.items():
        # what the engines hold now: these weights, under the settings in force at the end (live changes too)
        settings = first.settings[name]
        skeleton = transfer.model_skeleton(model.module) if name in reformed else model.skeleton
        held.model_held(name, fingerprint(model.module, skeleton, settings), run.routes[name].token, settings)
    for name, state in first.in_place.items():
        run.sent[name].load_state_dict(state)  # in place: a scheduler bound to it, its parameters, stay
        held.object_held(name, run.sent[name])
    for name, value in run.sent.items():
        if isinstance(value, optimizers.STATEFUL) and name not in first.in_place and name not in first.names:
            # its state stayed on the ranks with its model's weights (a model living there, --no-gather): the
            # ranks' copy goes on from where it is, the notebook's is sent again only once changed here
            held.object_held(name, value)
    for name, position in first.loaders.items():
        loaders.continue_after(run.sent[name], position)
    objects = dict(run.sent)
    for name, data in first.names.items():  # optimizers first: a scheduler the cell made refers to one
        objects[name] = shell.user_ns[name] = transfer.load_result(data, run.modules, objects, shell.user_ns)
        optimizers.track_steps(objects[name])
        held.object_held(name, objects[name])
    if first.skipped:
        reasons = "; ".join(f"{name} ({why})" for name, why in first.skipped.items())
        print(f"nbfsdp: kept on the engines only, not brought back: {reasons}", file=sys.stderr)
