"""One notebook's FSDP session: turns a ``%%fsdp`` cell into a run and its results.

The order matters for "nothing lost in the notebook": the cell is parsed and
every input pickled before any engine is touched, so a syntax error or an
unpicklable name fails at once; the notebook's namespace and models change
only after every rank has succeeded (``cell_run.finish``).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbfsdp.kernel.cluster.local import FSDPCluster
from nbfsdp.kernel.cluster.threads import KernelThread
from nbfsdp.kernel.cluster.world import Cluster, RunningWorld, WorldPlan, plan_with
from nbfsdp.kernel.diagnostics import check
from nbfsdp.kernel.diagnostics.where import ANSWER_SECONDS, Where, where_of
from nbfsdp.kernel.run import cell_run, residence
from nbfsdp.kernel.run.cell_run import CellRun
from nbfsdp.kernel.run.delivery import send_models
from nbfsdp.kernel.run.held import EngineHoldings
from nbfsdp.kernel.run.history import LastCell
from nbfsdp.kernel.run.loaders import NotebookLoaders
from nbfsdp.kernel.run.spec import PreparedCell, ResumePoint, RunOptions, cell_spec, prepare, run_files
from nbfsdp.shared.checkpoints import ignored
from nbfsdp.shared.config import CheckpointSettings, FSDPConfig, resolve, validate
from nbfsdp.shared.protocol import InternalRequest, LoadCheckpoint
from nbfsdp.ui.widget_events import pending_events

if TYPE_CHECKING:
    from nbfsdp.kernel.cluster.attached import AttachedCluster
    from nbfsdp.kernel.cluster.slurm import SlurmJob

#: How long an interrupted ``%fsdp wait`` asks the ranks where they are before it ends them (they answer in ms).
INTERRUPT_WHERE_SECONDS = 1.0


class BackgroundSave(Protocol):
    """A ``%fsdp save --async`` the ranks still write (``nbfsdp.kernel.checkpoints.sharded.PendingSave``)."""

    path: str | os.PathLike

    def wait(self) -> object:
        """Until every rank has written its part and the checkpoint is complete; its error raised."""


class Session:
    """The cluster plus what the notebook knows the engines hold."""

    def __init__(self, shell: InteractiveShell, cluster: FSDPCluster | None = None) -> None:
        self.shell = shell
        self.cluster = cluster or FSDPCluster()
        self.panel: dict[str, Any] = {}
        """fsdp_config defaults set with ``%fsdp panel`` or a dashboard's controls (flags and --config win)."""
        self.panel_world_size: int | None = None
        self.active: CellRun | None = None
        """The cell running now, in the foreground or the background."""
        self.held = EngineHoldings()
        self.loaders = NotebookLoaders()
        self._cells = itertools.count(1)
        self.last_cell: LastCell | None = None
        """The last user cell, for ``%fsdp export-script``."""
        self.resume_at = ResumePoint()
        """Where the next user cell resumes: a checkpoint's, loaded since the last one (``resume_after_load``)."""
        self._own_cluster: Cluster | None = None
        """nbfsdp's own cluster, set aside while ``self.cluster`` is an attached one."""
        self._pending_save: BackgroundSave | None = None

    def run_cell(self, cell: str | InternalRequest, config: FSDPConfig, options: RunOptions) -> None:
        """Run ``cell`` on every rank as ``options`` say, and bring its results back. ``cell`` a typed request
        (``shared.protocol``): nbfsdp's own cell, with no dashboard and no run record, so ``last_run()`` stays the
        user's last cell. Loads a cell asks for happen before it (``sharded.load_before_cell``)."""
        self._refuse_while_running()
        started = time.perf_counter()
        prepared, plan = self._prepare(cell, config, options)
        world = self._world_for(plan, prepared.config, options.checkpointing)
        if world.generation != self.held.generation:
            self.held.forget(world.generation)
            prepared = prepared.sent_to(world)  # it was to run in the running world (a rank died since)
        run = _submitted(self, prepared, world, started)
        self.active = run
        if options.background:
            run.thread = KernelThread(target=run.watch_in_background, name="nbfsdp-async")
            run.thread.start()
            print(f"nbfsdp: running in the background on {options.world_size} ranks; `%fsdp wait` for the results")
            return
        try:
            with pending_events() as poll:
                run.outcome = run.ranks.watch(on_poll=poll)
        except BaseException as error:
            run.outcome = error
        self._finish(run)

    def resume_for(self, *, internal: bool) -> ResumePoint:
        """Where a checkpoint loaded since the last cell left the steps and the loaders: for the one user
        cell after it."""
        if internal:
            return ResumePoint()
        resume, self.resume_at = self.resume_at, ResumePoint()
        return resume

    def resume_after_load(self, resume: ResumePoint) -> None:
        """A checkpoint was loaded: the next user cell resumes where it left the steps and the loaders."""
        self.resume_at = resume

    @property
    def pending_save(self) -> BackgroundSave | None:
        """A ``%fsdp save --async`` the ranks still write: waited for by ``%fsdp wait``, ``stop``, the next save
        or load, and before its world is replaced."""
        return self._pending_save

    def hold_save(self, save: BackgroundSave) -> None:
        """``save`` is written in the background from now on: the session waits for it before what would end it."""
        self._pending_save = save

    def forget_save(self, save: BackgroundSave) -> None:
        """``save`` is being waited for: the session holds it no longer."""
        if self._pending_save is save:
            self._pending_save = None

    def wait_for_save(self) -> None:
        """The background save, if any, waited for (its error raised)."""
        if self._pending_save is not None:
            self._pending_save.wait()

    def _refuse_while_running(self) -> None:
        if self.active is not None:
            alive = self.active.thread is not None and self.active.thread.is_alive()
            state = "still going" if alive else "done"
            raise UsageError(f"an --async run is {state}: `%fsdp wait` brings its results (`%fsdp cancel` ends it)")

    @property
    def cluster(self) -> Cluster:
        """The cluster the cells run on; it also decides where planned ranks would run (``planned_devices``)."""
        return self._cluster

    @cluster.setter
    def cluster(self, cluster: Cluster) -> None:
        self._cluster = cluster
        plan_with(cluster)

    def _prepare(
        self, cell: str | InternalRequest, config: FSDPConfig, options: RunOptions
    ) -> tuple[PreparedCell, WorldPlan]:
        """The cell parsed, its inputs read and pickled (``spec.prepare``), and its world planned, the cluster
        asked once: every refusal happens here."""
        world_size = options.world_size
        plan = self.cluster.plan_world(world_size, options.timeout, config.device)
        config = validate(config, world_size, plan.devices)
        check.before_cell(cell, self.shell.user_ns, config, world_size, plan.devices)  # said, never refused
        world = self.cluster.world
        in_running_world = plan.reuses and world is not None and world.generation == self.held.generation
        prepared = prepare(
            self, cell, number=next(self._cells), config=config, options=options, in_running_world=in_running_world
        )
        running = world.generation if world is not None and not world.broken else None
        named = {name: self.shell.user_ns.get(name) for name in [*self.held.models(), *prepared.models]}
        reshaped = {
            name
            for name, model in prepared.models.items()
            if in_running_world and not self.held.holds(name, model.fingerprint)
        }
        residence.refuse_losing_weights(
            named,
            set(prepared.models),
            reshaped,
            running=running,
            reusing=in_running_world,
            world_size=world_size,
            replacing=_loaded_whole(cell, self.shell.user_ns),
        )
        if isinstance(cell, str):
            self.last_cell = LastCell(cell, world_size, config, plan.devices, options.per_rank_batches, prepared.reads)
        return prepared, plan

    def _world_for(self, plan: WorldPlan, config: FSDPConfig, checkpointing: CheckpointSettings | None) -> RunningWorld:
        """The world the cell runs in: the running one, or a new one (which holds nothing of the notebook's)."""
        if not plan.reuses:
            self.wait_for_save()  # replacing the world would end its write
            if "device" in config.why:  # auto chose the CPU where there is a GPU: said once a world
                print(f"nbfsdp: {config.why['device']}", file=sys.stderr)
            if "precision" in config.why:  # fp16 where the GPUs have no bf16: said once a world
                print(f"nbfsdp: precision fp16: {config.why['precision']}", file=sys.stderr)
        world = self.cluster.ensure_world(plan)
        unsteerable = self.cluster.unsteerable()
        if unsteerable and checkpointing is not None and checkpointing.save_interval is not None:
            raise UsageError(f"--save-interval: {unsteerable}")  # the ranks agree on each save through files there
        return world

    def wait(self) -> None:
        """Block until the background run ends, then finish it as a blocking cell would have."""
        run = self.active
        if run is None or run.thread is None:
            print("nbfsdp: no background run")
            return
        try:
            run.thread.join()
        except KeyboardInterrupt:
            self._end_interrupted(run)
            return
        self._finish(run)

    def where(self, seconds: float = ANSWER_SECONDS) -> Where:
        """Where each rank of the running world is: its stack and collectives (``nbfsdp.kernel.diagnostics.where``)."""
        return where_of(self.cluster, seconds)

    def interrupt(self) -> None:
        """End the background run now, as Ctrl-C ends a blocking cell: SIGINT to every rank, then a kill for a
        rank that does not stop (one blocked in a collective); the next cell starts a fresh world if one died."""
        run = self.active
        if run is None or run.thread is None:
            print("nbfsdp: no background run")
            return
        self._end_interrupted(run)

    def _end_interrupted(self, run: CellRun) -> None:
        """End the background run on every rank (SIGINT, then a kill for a rank blocked in a collective), and say
        where the ranks were: the next cell starts on fresh engines if one had to go."""
        try:
            where = self.where(INTERRUPT_WHERE_SECONDS).interrupted_at()
        except Exception:  # the world went meanwhile: the ends below say the rest
            where = ""
        run.ranks.interrupt()
        assert run.thread is not None  # a background run's
        run.thread.join()
        try:
            self._finish(run)
        except KeyboardInterrupt:
            said = f"; {where}" if where else ""
            print(f"nbfsdp: interrupted{said}. The run ended on every rank; its results are not brought back")

    def cancel(self) -> None:
        """End the running cell cleanly at the start of an agreed forward, the same one on every rank."""
        if self.active is None:
            print("nbfsdp: nothing is running")
            return
        self.active.files.control.cancel()
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
        return self.active.change_live(given, set(settings)) if self.active is not None else ""

    def _finish(self, run: CellRun) -> None:
        """The run has ended: its results into the notebook, or its error raised (``cell_run.finish``)."""
        self.active = None
        cell_run.finish(run, self.shell, self.held, self.loaders)

    def engine_models(self) -> list[str]:
        """The notebook's models the running world holds (sharded by an earlier cell)."""
        world = self.cluster.world
        if world is None or world.broken or world.generation != self.held.generation:
            return []
        return self.held.models()

    def attach(
        self, profile: str | None, cluster_id: str | None, shared_dir: str | None = None, job: SlurmJob | None = None
    ) -> list[str]:
        """Run the next cells on a running ipyparallel cluster nbfsdp did not start
        (``nbfsdp.kernel.cluster.attached``), instead of its own, which stops; return what to say of it. ``job``:
        the cluster is the Slurm job nbfsdp just started (``nbfsdp.kernel.cluster.slurm``), which ``stop``
        cancels."""
        from nbfsdp.kernel.cluster.attached import AttachedCluster

        if self.active is not None:
            raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then attach")
        attached = AttachedCluster(profile, cluster_id, shared_dir)
        attached.job = job
        self.end_job()
        self.detach()
        self.stop()
        self._own_cluster, self.cluster = self.cluster, attached
        return attached.summary()

    def end_job(self) -> bool:
        """Cancel the Slurm job nbfsdp started the attached cluster as, if any (the kernel's own cluster comes
        back); whether there was one."""
        job = self.attached_cluster.job if self.attached_cluster is not None else None
        if job is not None:
            self.detach()
            job.stop()
        return job is not None

    def attached_to(self, profile: str, cluster_id: str | None) -> bool:
        """The cells run on the cluster of ``profile`` (and ``cluster_id``, where given) already."""
        cluster = self.attached_cluster
        return cluster is not None and cluster.profile == profile and cluster_id in (None, cluster.cluster_id)

    @property
    def attached(self) -> bool:
        """The cells run on a cluster nbfsdp did not start."""
        return self._own_cluster is not None

    @property
    def attached_cluster(self) -> AttachedCluster | None:
        """The cluster the cells run on while ``attached``, else None: what only an attached cluster has
        (its engines, their hosts, its profile) is asked of it."""
        if self._own_cluster is None:
            return None
        from nbfsdp.kernel.cluster.attached import AttachedCluster

        cluster = self.cluster
        assert isinstance(cluster, AttachedCluster)  # attach() set it; detach() puts nbfsdp's own back
        return cluster

    def detach(self) -> bool:
        """Let go of an attached cluster (it goes on running); the next cell starts nbfsdp's own again.
        Whether one was attached."""
        own, attached = self._own_cluster, self.attached_cluster
        if own is None or attached is None:
            return False
        self.wait_for_save()
        attached.detach()
        self.cluster, self._own_cluster = own, None
        self.held.forget()
        return True

    def stop(self) -> None:
        """End the cluster; a background run still going ends with it. A background save is waited for
        first; its error, if any, is raised once the cluster has stopped."""
        failed: BaseException | None = None
        try:
            self.wait_for_save()
        except Exception as error:  # the cluster still stops
            failed = error
        if self.active is not None and self.active.thread is not None:
            self.active.ranks.interrupt()
            self.active.thread.join()
            self.active.clean_up()
            self.active = None
        if not self.end_job():  # a Slurm job nbfsdp started ends here; another attached cluster refuses
            self.cluster.stop()
        self.held.forget()
        for directory in residence.free_left():
            print(f"nbfsdp: freed {directory}, where a failed move had left weights", file=sys.stderr)
        if failed is not None:
            raise failed


def _submitted(session: Session, prepared: PreparedCell, world: RunningWorld, started: float) -> CellRun:
    """The cell's models delivered to ``world``, what every rank is to run made, and the cell sent to them with
    its record and dashboard."""
    cluster = session.cluster
    delivery = send_models(cluster, world, prepared, session.held)
    files = run_files(cluster.private_dir, prepared, unsteerable=cluster.unsteerable())
    resume = session.resume_for(internal=prepared.internal)
    spec = cell_spec(prepared, delivery, world=world, files=files, loaders=session.loaders, resume=resume)
    return cell_run.submit(prepared, delivery, spec=spec, files=files, started=started, session=session)


def _loaded_whole(cell: str | InternalRequest, namespace: dict[str, Any]) -> list[str]:
    """The models a ``%fsdp load`` cell reads whole from a checkpoint: what the ranks held of them is replaced."""
    if not isinstance(cell, LoadCheckpoint):
        return []
    return [
        name
        for name in cell.models
        if not any(ignored(f"models.{name}.{key}", cell.ignore) for key in namespace[name].state_dict())
    ]


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
    (``nbfsdp.kernel.diagnostics.where``)."""
    return current_session().where()
