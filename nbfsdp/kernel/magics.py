"""``%%fsdp`` and ``%fsdp``: their arguments parsed and checked, each action handed to the session (a cell's
run, checkpoints, explain) or answered here (status and compare tables)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from nbfsdp.kernel import comparison, flags, timeline
from nbfsdp.kernel.checkpoints.export_script import export_script
from nbfsdp.kernel.cluster.local import FSDPCluster
from nbfsdp.kernel.diagnostics import check
from nbfsdp.kernel.planning import fitting
from nbfsdp.kernel.planning.plans import StepTrace, plan
from nbfsdp.kernel.planning.progress import ProgressLine
from nbfsdp.kernel.run import debugging, residence
from nbfsdp.kernel.run.session import Session
from nbfsdp.kernel.run.spec import RunOptions
from nbfsdp.kernel.status import status
from nbfsdp.kernel.usage_errors import as_usage_errors
from nbfsdp.shared import config
from nbfsdp.shared.limits import DEFAULT_TIMEOUT_SECONDS, world_size_error
from nbfsdp.shared.timeline import DEFAULT_EVERY_SECONDS
from nbfsdp.ui.panel import SettingsPanel


@dataclass(frozen=True)
class Action:
    """One of ``%fsdp``'s actions: its usage (the help is made of these) and what runs it, given the magics and
    the rest of the line."""

    usage: str
    handler: Callable[[FSDPMagics, str], None]


def _parsed(name: str, parser_function: Any, handler: Callable[[FSDPMagics, str], None]) -> Action:
    """An action that parses its flags: its usage made from its parser (``flags.synopsis``) and its docstring."""
    usage = f"{name} {flags.synopsis(parser_function)}: {flags.description(parser_function)}"
    return Action(" ".join(usage.split()).replace("%", "%%"), handler)  # argparse formats help with %


def _no_arguments(action: str, rest: str) -> None:
    if rest:
        raise UsageError(f"%fsdp {action} takes no arguments; got {rest!r}")


def _status(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("status", rest)
    status(magics.session)


def _stop(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("stop", rest)
    magics.session.stop()
    print("nbfsdp: cluster stopped")


def _wait(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("wait", rest)
    session = magics.session
    waited = session.active is not None
    if waited:
        session.wait()
    if session.pending_save is not None:
        session.wait_for_save()
        waited = True
    if not waited:
        print("nbfsdp: nothing to wait for: no background run or save")


def _cancel(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("cancel", rest)
    magics.session.cancel()


def _check(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("check", rest)
    print(check.last_cell(magics.session.last_cell, magics.shell.user_ns))


def _where(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("where", rest)
    print(magics.session.where())


def _interrupt(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("interrupt", rest)
    magics.session.interrupt()


def _save(magics: FSDPMagics, rest: str) -> None:
    from nbfsdp.kernel.checkpoints import sharded

    args = parse_argstring(flags.save_arguments, rest)
    sharded.save_with(magics.session, args.path, overwrite=args.overwrite, **flags.save_options(args))


def _load(magics: FSDPMagics, rest: str) -> None:
    from nbfsdp.kernel.checkpoints import sharded

    args = parse_argstring(flags.load_arguments, rest)
    sharded.load_with(magics.session, args.path, args.world_size, args.load_ignore_keys, model=args.model)


def _checkpoints(magics: FSDPMagics, rest: str) -> None:
    from nbfsdp.kernel.checkpoints import sharded

    args = parse_argstring(flags.checkpoints_arguments, rest)
    found = sharded.checkpoints(args.folder)
    print(sharded.table(found) if found else f"nbfsdp: no checkpoints in {args.folder}")


def _export(magics: FSDPMagics, rest: str) -> None:
    """In the kernel: no engines needed."""
    from nbfsdp.kernel.checkpoints import exporting

    args = parse_argstring(flags.export_arguments, rest)
    print(exporting.wrote(exporting.export(args.checkpoint, args.out, **flags.export_options(args))))


def _export_script(magics: FSDPMagics, rest: str) -> None:
    if len(rest.split()) != 1:
        raise UsageError("%fsdp export-script PATH: the script to write, e.g. train.py")
    session = magics.session
    reads = session.last_cell.reads if session.last_cell is not None else []
    shuffle = session.loaders.shuffle_states(magics.shell.user_ns, reads)
    print(export_script(session.last_cell, magics.shell.user_ns, rest, shuffle))


def _timeline(magics: FSDPMagics, rest: str) -> None:
    args = parse_argstring(flags.timeline_arguments, rest)
    timeline.show(args.step, args.rank)


def _trace(magics: FSDPMagics, rest: str) -> None:
    args = parse_argstring(flags.trace_arguments, rest)
    print(timeline.write_trace(args.path))


def _debug(magics: FSDPMagics, rest: str) -> None:
    args = parse_argstring(flags.debug_arguments, rest)
    session = magics.session
    if args.release:
        print(debugging.release(session))
    elif args.rank is not None:
        debugging.post_mortem(session, rank=args.rank)
    else:
        print(debugging.which_failed(session))


def _attach(magics: FSDPMagics, rest: str) -> None:
    args = parse_argstring(flags.attach_arguments, rest)
    request = flags.slurm_request(args)
    if request is None:
        magics.attach(args.profile, args.cluster_id, args.shared_dir)
        return
    from nbfsdp.kernel.cluster import slurm

    if magics.session.active is not None:
        raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then attach")
    profile = args.profile or "nbfsdp-slurm"
    cluster_id, job = slurm.start(request, profile)
    try:
        said = magics.session.attach(profile, cluster_id, args.shared_dir, job)
    except BaseException:  # a job nothing attached to is cancelled at once
        job.stop()
        raise
    for line in [*said, f"Slurm job {job.job_id} on {job.nodes()}"]:
        print(f"nbfsdp: {line}")


def _detach(magics: FSDPMagics, rest: str) -> None:
    _no_arguments("detach", rest)
    attached = magics.session.attached_cluster
    job = attached.job if attached is not None else None
    if not magics.session.detach():
        print("nbfsdp: no cluster attached")
    elif job is not None:
        job.leave_running()
        print(f"nbfsdp: detached; Slurm job {job.job_id} goes on running: scancel {job.job_id} ends it")
    else:
        print("nbfsdp: detached; the cluster goes on running")


def _explain(magics: FSDPMagics, rest: str) -> None:
    args = parse_argstring(flags.explain_arguments, rest)
    model = magics.shell.user_ns.get(args.model)
    if not isinstance(model, nn.Module):
        found = "no such name" if model is None else f"a {type(model).__name__}"
        raise UsageError(f"%fsdp explain {args.model}: {found}, not an nn.Module in the notebook")
    settings, world_size = magics.cell_settings(args, args.world_size)
    attached = magics.session.attached_cluster
    # the ranks' hosts, to say which collectives cross between them
    hosts = [p.host for p in attached.placements_for(world_size)] if attached is not None else None
    devices = magics.session.cluster.devices(world_size, settings.device, planning=True)
    settings = config.validate(settings, world_size, devices)
    workload = flags.explain_workload(args, magics.shell.user_ns)
    memory = fitting.device_memory(args.gpu, args.device_memory, settings.memory_limit)
    if (args.gpu or args.device_memory or args.suggest) and workload is None:
        raise UsageError("--gpu, --device-memory and --suggest need --batch EXPR: the step whose peak they judge")
    if args.suggest and memory is None:
        raise UsageError(
            "--suggest needs --gpu NAME, --device-memory SIZE or --memory-limit SIZE: what the settings must fit"
        )
    progress = ProgressLine("nbfsdp: --suggest") if args.suggest else None
    trace = (
        None
        if workload is None
        else StepTrace(workload=workload, memory=memory, suggest=args.suggest, progress=progress)
    )
    planned = plan(model, settings, world_size, hosts, devices, trace=trace)
    print(planned.code if args.code else planned, end="" if args.code else "\n")


def _compare(magics: FSDPMagics, rest: str) -> None:
    words = rest.split()
    if len(words) > 1 or (words and not (words[0].isdigit() and int(words[0]) > 0)):
        raise UsageError(f"%fsdp compare takes one optional positive number of runs; got {' '.join(words)!r}")
    comparison.show(int(words[0]) if words else 5, with_figure=getattr(magics.shell, "kernel", None) is not None)


def _set(magics: FSDPMagics, rest: str) -> None:
    words = rest.split()
    settings: dict[str, bool | str | int] = {}
    for word in words:
        key, equals, value = word.partition("=")
        if not equals or not value:
            raise UsageError(f"%fsdp set takes KEY=VALUE pairs (fsdp_config keys or world_size); got {word!r}")
        if key not in flags.SETTABLE:
            raise UsageError(f"%fsdp set {key}: not a setting; valid: {', '.join(flags.SETTABLE)}")
        settings[key] = {"true": True, "false": False}.get(value.lower(), value)
    if "world_size" in settings:
        if not str(settings["world_size"]).isdigit():
            raise UsageError(f"world_size must be a whole number; got {settings['world_size']!r}")
        settings["world_size"] = magics.world_size_for(int(settings["world_size"]))
    if not settings:
        raise UsageError("%fsdp set takes KEY=VALUE pairs, e.g. %fsdp set activation_checkpointing=true")
    print(f"nbfsdp: {magics.session.change_settings(settings) or 'defaults of the next cells set'}")


def _panel(magics: FSDPMagics, rest: str) -> None:
    words = rest.split()
    if len(words) > 1:
        raise UsageError(f"%fsdp panel takes at most one model name; got {' '.join(words)!r}")
    model = None
    if words:
        model = magics.shell.user_ns.get(words[0])
        if not isinstance(model, nn.Module):
            raise UsageError(f"%fsdp panel {words[0]}: not an nn.Module in the notebook")
    session = magics.session
    world_size = magics.world_size_for(session.panel_world_size, session.panel.get("device"))
    display(settings_panel(session, model, world_size).box)


#: ``%fsdp``'s actions, in the order the help shows them.
ACTIONS = {
    "status": Action("status: engines, ranks, devices, pids", _status),
    "stop": Action("stop: end the cluster", _stop),
    "explain": _parsed("explain", flags.explain_arguments, _explain),
    "compare": Action("compare [N]: the last N runs (default 5) side by side", _compare),
    "panel": Action("panel [MODEL]: the settings as controls, defaults of the next cells, with MODEL's plan", _panel),
    "set": Action(
        "set KEY=VALUE ...: what the controls do, as text (the running cell at its next step, later cells' defaults)",
        _set,
    ),
    "wait": Action("wait: the results of an --async run, and an --async save's end", _wait),
    "cancel": Action("cancel: end the running cell at its next step", _cancel),
    "check": Action(
        "check: the last %%fsdp cell checked again (each is checked by itself before its first step): "
        "branches on the rank around collectives, split ties, mixed dtypes, bf16, optimizers, gradient accumulation",
        _check,
    ),
    "where": Action(
        "where: each rank's stack and collectives while a cell runs, and which rank left the others waiting", _where
    ),
    "interrupt": Action("interrupt: end an --async run now, as Ctrl-C ends a blocking one", _interrupt),
    "timeline": _parsed("timeline", flags.timeline_arguments, _timeline),
    "trace": _parsed("trace", flags.trace_arguments, _trace),
    "save": _parsed("save", flags.save_arguments, _save),
    "load": _parsed("load", flags.load_arguments, _load),
    "checkpoints": _parsed("checkpoints", flags.checkpoints_arguments, _checkpoints),
    "export": _parsed("export", flags.export_arguments, _export),
    "export-script": Action(
        "export-script PATH: the last %%fsdp cell as a torchrun script, its inputs saved beside it", _export_script
    ),
    "debug": _parsed("debug", flags.debug_arguments, _debug),
    "attach": _parsed("attach", flags.attach_arguments, _attach),
    "detach": Action("detach: let go of it, leaving it running", _detach),
}


@magics_class
class FSDPMagics(Magics):
    """Train the notebook's models sharded with FSDP2 across an ipyparallel cluster."""

    shell: InteractiveShell  # always given (Magics allows None)

    def __init__(self, shell: InteractiveShell, cluster: FSDPCluster | None = None) -> None:
        super().__init__(shell)
        self.session = Session(shell, cluster)
        self._debug_magic = debugging.DebugMagic(shell, self.session)  # %debug after a failed cell: the rank's frames

    @magic_arguments()
    @argument(
        "--world-size",
        "-n",
        type=int,
        default=None,
        help=flags.WORLD_SIZE_HELP,
    )
    @argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help=flags.TIMEOUT_HELP)
    @argument("--hang-report", type=float, default=None, help=flags.HANG_REPORT_HELP)
    @argument("--debug-rank", default=None, metavar="R", help=flags.DEBUG_RANK_HELP)
    @argument("--timeline", type=float, default=DEFAULT_EVERY_SECONDS, help=flags.TIMELINE_HELP)
    @argument(
        "--no-gather",
        action="store_true",
        help="Leave the trained weights on the engines; the notebook's models keep their old weights.",
    )
    @argument("--keep-on-ranks", action="store_true", help=flags.KEEP_ON_RANKS_HELP)
    @argument(
        "--per-rank-batches",
        action="store_true",
        help="Each rank takes whole batches of the notebook's DataLoaders (N x batch_size per step, len / N "
        "steps), as DistributedSampler does; by default each batch is split across the ranks (the same math "
        "as the plain cell).",
    )
    @argument(
        "--async",
        dest="background",
        action="store_true",
        help="Return at once while the ranks train; `%%fsdp wait` brings the results, `%%fsdp cancel` stops.",
    )
    @argument(
        "--profile",
        default=None,
        help="Run on the running ipyparallel cluster of this profile (as `%%fsdp attach --profile P` does first, "
        "once); the cells after run there too, until `%%fsdp detach`.",
    )
    @argument("--cluster-id", default=None, help="With --profile: its cluster id, where the profile has several.")
    @flags.checkpoint_arguments
    @flags.config_arguments
    @cell_magic
    @as_usage_errors
    def fsdp(self, line: str, cell: str) -> None:
        """Run this cell on every rank, with the notebook's models sharded by FSDP2.

        Inside the cell ``rank``, ``world_size``, ``device`` and ``resume_step``
        (0, or the step of the checkpoint loaded just before) are defined and
        ``nbfsdp`` is imported; every name the cell reads comes from the
        notebook. Afterwards the notebook's models hold the trained weights and
        the names the cell assigned hold rank 0's values.
        """
        args = parse_argstring(self.fsdp, line)
        if args.cluster_id is not None and args.profile is None:
            raise UsageError("--cluster-id goes with --profile P: the profile the cluster was started with")
        if args.profile is not None and not self.session.attached_to(args.profile, args.cluster_id):
            self.attach(args.profile, args.cluster_id, None)
        requested = args.world_size if args.world_size is not None else self.session.panel_world_size
        if not args.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        settings, world_size = self.cell_settings(args, requested)
        saving = self._checkpointing(args)
        if saving.loads:
            from nbfsdp.kernel.checkpoints import sharded as checkpoints

            ast.parse(cell)  # a cell that cannot run fails before the load, not after
            devices = self.session.cluster.devices(world_size, settings.device)
            config.validate(settings, world_size, devices, quiet=True)
            checkpoints.load_before_cell(self.session, saving, world_size, args.timeout, settings)
        options = RunOptions(
            world_size=world_size,
            timeout=args.timeout,
            gather=not args.no_gather,
            background=args.background,
            per_rank_batches=args.per_rank_batches,
            checkpointing=saving,
            keep_on_ranks=args.keep_on_ranks,
            hang_report=flags.hang_report_seconds(args.hang_report, args.timeout),
            timeline=flags.timeline_seconds(args.timeline),
            debug_ranks=debugging.debug_ranks(args.debug_rank, world_size),
        )
        try:
            self.session.run_cell(cell, settings, options)
        except residence.MustMove as needed:  # a model living on the ranks goes to the cell's world first
            from nbfsdp.kernel.checkpoints import moves

            moves.move(self.session, needed, world_size=world_size, config=settings, timeout=args.timeout)
            self.session.run_cell(cell, settings, options)

    def _checkpointing(self, args) -> config.CheckpointSettings:
        """Explicit flags > the --config dict's Composer checkpoint keys."""
        given = {key: getattr(args, key) for key in config.CHECKPOINT_KEYS}
        return config.checkpoint_settings(_composer_dict(self.shell, args.config), given)

    def cell_settings(self, args: argparse.Namespace, requested: int | None) -> tuple[config.FSDPConfig, int]:
        """The settings of ``%%fsdp`` and ``%fsdp explain``, and their world size: explicit flags > the --config
        dict > the panel's settings > defaults; on an attached cluster, HYBRID_SHARD without --replicas has a
        replica per host (each host shards the model among its ranks)."""
        given = {k: getattr(args, k) for k in flags.CONFIG_FLAGS}
        settings = config.resolve(_composer_dict(self.shell, args.config), given, self.session.panel)
        world_size = self.world_size_for(requested, settings.device)
        attached = self.session.attached_cluster
        if attached is None or settings.sharding_strategy != "HYBRID_SHARD" or settings.replicas is not None:
            return settings, world_size
        replicas = attached.host_replicas(world_size)
        why = {**settings.why, "replicas": f"not given: one replica per host ({replicas} hosts)"}
        return dataclasses.replace(settings, replicas=replicas, why=why), world_size

    @magic_arguments()
    @argument("action", choices=tuple(ACTIONS), help="; ".join(action.usage for action in ACTIONS.values()) + ".")
    @line_magic("fsdp")  # type: ignore[arg-type]  # IPython types line_magic(name) as a function or a decorator
    @as_usage_errors
    def fsdp_line(self, line: str) -> None:
        """Inspect or stop the cluster behind ``%%fsdp``, or explain what it would do with a model."""
        name, _, rest = line.strip().partition(" ")
        if name not in ACTIONS:
            parse_argstring(self.fsdp_line, line)  # argparse's error, naming the valid actions
        ACTIONS[name].handler(self, rest.strip())

    def attach(self, profile: str | None, cluster_id: str | None, shared_dir: str | None) -> None:
        """The next cells run on the running cluster of ``profile`` (``Session.attach``), said here."""
        for line in self.session.attach(profile, cluster_id, shared_dir):
            print(f"nbfsdp: {line}")

    def world_size_for(self, requested: int | None, device: str | None = None) -> int:
        """The world size asked, or by default the cluster's (a rank per GPU, 2 on the CPU; attached: every
        engine)."""
        world_size = requested if requested is not None else self.session.cluster.default_world_size(device)
        if refused := world_size_error(world_size):
            raise UsageError(refused)
        return world_size

    def stop(self) -> None:
        """The extension unloads (or the kernel ends): an attached cluster is let go of, nbfsdp's own stopped."""
        self._debug_magic.remove()
        self.session.end_job()  # a Slurm job nbfsdp started ends with the extension
        self.session.detach()
        self.session.stop()


def settings_panel(session: Session, model: nn.Module | None, world_size: int) -> SettingsPanel:
    """``%fsdp panel``'s controls, bound to ``session``'s defaults, with ``model``'s plan beside them (the panel
    reaches the session only through these callables)."""
    return SettingsPanel(
        session.panel,
        session.change_settings,
        lambda size, device: session.cluster.devices(size, device, planning=True),
        (lambda config, size, devices: str(plan(model, config, size, devices=devices))) if model else None,
        world_size,
    )


def _composer_dict(shell: InteractiveShell, name: str | None) -> dict | None:
    """``--config NAME``: the notebook's dict of that name (Composer's ``fsdp_config``)."""
    if name is None:
        return None
    if name not in shell.user_ns:
        raise UsageError(f"--config {name}: no such name in the notebook")
    value = shell.user_ns[name]
    if not isinstance(value, dict):
        raise UsageError(f"--config {name}: is a {type(value).__name__}, not a dict like Composer's fsdp_config")
    return value
