"""``%%fsdp`` and ``%fsdp``: their arguments parsed and checked, each action handed to the session (a cell's
run, checkpoints, explain) or answered here (status and compare tables)."""

from __future__ import annotations

import ast
import dataclasses

import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from nbfsdp.kernel import comparison, flags
from nbfsdp.kernel.checkpoints.export_script import export_script
from nbfsdp.kernel.cluster.local import FSDPCluster
from nbfsdp.kernel.planning import check, fitting
from nbfsdp.kernel.planning.plans import plan
from nbfsdp.kernel.run.session import Session
from nbfsdp.kernel.status import status
from nbfsdp.kernel.usage_errors import as_usage_errors
from nbfsdp.shared import config
from nbfsdp.shared.limits import MAX_WORLD_SIZE
from nbfsdp.ui.panel import SettingsPanel

DEFAULT_TIMEOUT_SECONDS = flags.DEFAULT_TIMEOUT_SECONDS
#: ``%fsdp``'s actions: each one's usage and what it does (the help is made from these), in the order shown.
#: Each is run by the ``FSDPMagics`` method ``_action_<name>`` (dashes as underscores) with the rest of the line.
LINE_ACTION_HELP = {
    "status": "status: engines, ranks, devices, pids",
    "stop": "stop: end the cluster",
    "explain": "explain [--code] [settings] [--world-size N] MODEL: the FSDP plan, or with --code the plain FSDP2 "
    "code it amounts to, nothing run (see %%fsdp? for settings)",
    "compare": "compare [N]: the last N runs (default 5) side by side",
    "panel": "panel [MODEL]: the settings as controls, defaults of the next cells, with MODEL's plan",
    "set": "set KEY=VALUE ...: what the controls do, as text (the running cell at its next step, later cells' "
    "defaults)",
    "wait": "wait: the results of an --async run, and an --async save's end",
    "cancel": "cancel: end the running cell at its next step",
    "check": "check: the last %%fsdp cell checked again (each is checked by itself before its first step): "
    "branches on the rank around collectives, split ties, mixed dtypes, bf16, optimizers, gradient accumulation",
    "where": "where: each rank's stack and collectives while a cell runs, and which rank left the others waiting",
    "interrupt": "interrupt: end an --async run now, as Ctrl-C ends a blocking one",
    "save": "save PATH [--overwrite] [--async]: a sharded checkpoint of what the engines hold; with --hf "
    "[--max-shard-size SIZE] [--model NAME]: one model as save_pretrained writes it, for from_pretrained",
    "load": "load PATH [--world-size N] [--load-ignore-keys K,...] [--model NAME]: a checkpoint (or a "
    ".pt/.safetensors file of full weights, each rank reading its shard) into the engines and the notebook's objects",
    "checkpoints": "checkpoints FOLDER: the checkpoints there",
    "export": "export CHECKPOINT OUT [--model NAME] [--dtype D]: one model's full weights into one .pt or "
    ".safetensors file, in the kernel; with --hf [--max-shard-size SIZE]: into the directory OUT as "
    "save_pretrained writes it, one file at a time",
    "export-script": "export-script PATH: the last %%fsdp cell as a torchrun script, its inputs saved beside it",
    "attach": "attach [--profile P] [--cluster-id ID]: run the next cells on a running ipyparallel cluster nbfsdp "
    "did not start (any launcher, several hosts)",
    "detach": "detach: let go of it, leaving it running",
}
LINE_ACTIONS = tuple(LINE_ACTION_HELP)


@magics_class
class FSDPMagics(Magics):
    """Train the notebook's models sharded with FSDP2 across an ipyparallel cluster."""

    shell: InteractiveShell  # always given (Magics allows None)

    def __init__(self, shell: InteractiveShell, cluster: FSDPCluster | None = None) -> None:
        super().__init__(shell)
        self.session = Session(shell, cluster)

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
            self._attach(args.profile, args.cluster_id, None)
        requested = args.world_size if args.world_size is not None else self.session.panel_world_size
        if not args.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        settings = self._settings(args)
        world_size = self.world_size_for(requested, settings.device)
        settings = self._replica_per_host(settings, world_size)
        saving = self._checkpointing(args)
        if saving.loads:
            from nbfsdp.kernel.checkpoints import sharded as checkpoints

            ast.parse(cell)  # a cell that cannot run fails before the load, not after
            devices = self.session.cluster.devices(world_size, settings.device)
            config.validate(settings, world_size, devices, quiet=True)
            checkpoints.load_before_cell(self.session, saving, world_size, args.timeout, settings)
        self.session.run_cell(
            cell,
            world_size=world_size,
            timeout=args.timeout,
            gather=not args.no_gather,
            config=settings,
            background=args.background,
            per_rank_batches=args.per_rank_batches,
            checkpointing=saving,
            keep_on_ranks=args.keep_on_ranks,
            hang_report=flags.hang_report_seconds(args.hang_report, args.timeout),
        )

    def _checkpointing(self, args) -> config.CheckpointSettings:
        """Explicit flags > the --config dict's Composer checkpoint keys."""
        given = {key: getattr(args, key) for key in config.CHECKPOINT_KEYS}
        return config.checkpoint_settings(_composer_dict(self.shell, args.config), given)

    def _settings(self, args) -> config.FSDPConfig:
        """Explicit flags > the --config dict > the panel's settings > defaults."""
        given = {k: getattr(args, k) for k in flags.CONFIG_FLAGS}
        return config.resolve(_composer_dict(self.shell, args.config), given, self.session.panel)

    @magic_arguments()
    @argument(
        "action",
        choices=LINE_ACTIONS,
        help="; ".join(LINE_ACTION_HELP.values()) + ".",
    )
    @line_magic("fsdp")  # type: ignore[arg-type]  # IPython types line_magic(name) as a function or a decorator
    @as_usage_errors
    def fsdp_line(self, line: str) -> None:
        """Inspect or stop the cluster behind ``%%fsdp``, or explain what it would do with a model."""
        name, _, rest = line.strip().partition(" ")
        if name not in LINE_ACTION_HELP:
            parse_argstring(self.fsdp_line, line)  # argparse's error, naming the valid actions
        getattr(self, f"_action_{name.replace('-', '_')}")(rest.strip())

    # -- one method per action, given the rest of the line
    def _action_status(self, rest: str) -> None:
        _no_arguments("status", rest)
        status(self.session)

    def _action_stop(self, rest: str) -> None:
        _no_arguments("stop", rest)
        self.session.stop()
        print("nbfsdp: cluster stopped")

    def _action_wait(self, rest: str) -> None:
        _no_arguments("wait", rest)
        waited = self.session.active is not None
        if waited:
            self.session.wait()
        if self.session.pending_save is not None:
            self.session.pending_save.wait()
            waited = True
        if not waited:
            print("nbfsdp: nothing to wait for: no background run or save")

    def _action_cancel(self, rest: str) -> None:
        _no_arguments("cancel", rest)
        self.session.cancel()

    def _action_check(self, rest: str) -> None:
        _no_arguments("check", rest)
        print(check.last_cell(self.session.last_cell, self.shell.user_ns))

    def _action_where(self, rest: str) -> None:
        _no_arguments("where", rest)
        print(self.session.where())

    def _action_interrupt(self, rest: str) -> None:
        _no_arguments("interrupt", rest)
        self.session.interrupt()

    def _action_save(self, rest: str) -> None:
        self._checkpoint("save", rest)

    def _action_load(self, rest: str) -> None:
        self._checkpoint("load", rest)

    def _action_checkpoints(self, rest: str) -> None:
        self._checkpoint("checkpoints", rest)

    def _action_export(self, rest: str) -> None:
        self._checkpoint("export", rest)

    def _action_export_script(self, rest: str) -> None:
        if len(rest.split()) != 1:
            raise UsageError("%fsdp export-script PATH: the script to write, e.g. train.py")
        session = self.session
        reads = session.last_cell.reads if session.last_cell is not None else []
        shuffle = session.loaders.shuffle_states(self.shell.user_ns, reads)
        print(export_script(session.last_cell, self.shell.user_ns, rest, shuffle))

    def _action_attach(self, rest: str) -> None:
        args = parse_argstring(flags.attach_arguments, rest)
        self._attach(args.profile, args.cluster_id, args.shared_dir)

    def _action_detach(self, rest: str) -> None:
        _no_arguments("detach", rest)
        attached = self.session.detach()
        print("nbfsdp: detached; the cluster goes on running" if attached else "nbfsdp: no cluster attached")

    def _action_explain(self, line: str) -> None:
        args = parse_argstring(flags.explain_arguments, line)
        model = self.shell.user_ns.get(args.model)
        if not isinstance(model, nn.Module):
            found = "no such name" if model is None else f"a {type(model).__name__}"
            raise UsageError(f"%fsdp explain {args.model}: {found}, not an nn.Module in the notebook")
        attached = self.session.attached_cluster
        requested = args.world_size
        settings = self._settings(args)
        world_size = self.world_size_for(requested, settings.device)
        hosts = None
        if attached is not None:  # the ranks' hosts, to say which collectives cross between them
            hosts = [p.host for p in attached.placements_for(world_size)]
            settings = self._replica_per_host(settings, world_size)
        devices = self.session.cluster.devices(world_size, settings.device, planning=True)
        settings = config.validate(settings, world_size, devices)
        workload = flags.explain_workload(args, self.shell.user_ns)
        memory = fitting.device_memory(args.gpu, args.device_memory, settings.memory_limit)
        if (args.gpu or args.device_memory or args.suggest) and workload is None:
            raise UsageError("--gpu, --device-memory and --suggest need --batch EXPR: the step whose peak they judge")
        if args.suggest and memory is None:
            raise UsageError(
                "--suggest needs --gpu NAME, --device-memory SIZE or --memory-limit SIZE: what the settings must fit"
            )
        planned = plan(
            model, settings, world_size, hosts, devices, workload=workload, memory=memory, suggest=args.suggest
        )
        print(planned.code if args.code else planned, end="" if args.code else "\n")

    def _replica_per_host(self, settings: config.FSDPConfig, world_size: int) -> config.FSDPConfig:
        """HYBRID_SHARD without --replicas on an attached cluster: shard inside each host, replicate across."""
        attached = self.session.attached_cluster
        if not (attached is not None and settings.sharding_strategy == "HYBRID_SHARD" and settings.replicas is None):
            return settings
        replicas = attached.host_replicas(world_size)
        why = {**settings.why, "replicas": f"not given: one replica per host ({replicas} hosts)"}
        return dataclasses.replace(settings, replicas=replicas, why=why)

    def _attach(self, profile: str | None, cluster_id: str | None, shared_dir: str | None) -> None:
        for line in self.session.attach(profile, cluster_id, shared_dir):
            print(f"nbfsdp: {line}")

    def _checkpoint(self, action: str, line: str) -> None:
        from nbfsdp.kernel.checkpoints import sharded as checkpoints

        if action == "export":  # in the kernel: no engines needed
            from nbfsdp.kernel.checkpoints import exporting

            args = parse_argstring(flags.export_arguments, line)
            print(exporting.wrote(exporting.export(args.checkpoint, args.out, **flags.export_options(args))))
            return

        if action == "save":
            args = parse_argstring(flags.save_arguments, line)
            checkpoints.save_with(self.session, args.path, args.overwrite, **flags.save_options(args))
        elif action == "load":
            args = parse_argstring(flags.load_arguments, line)
            checkpoints.load_with(self.session, args.path, args.world_size, args.load_ignore_keys, model=args.model)
        else:
            args = parse_argstring(flags.checkpoints_arguments, line)
            found = checkpoints.checkpoints(args.folder)
            print(checkpoints.table(found) if found else f"nbfsdp: no checkpoints in {args.folder}")

    def _action_compare(self, rest: str) -> None:
        words = rest.split()
        if len(words) > 1 or (words and not (words[0].isdigit() and int(words[0]) > 0)):
            raise UsageError(f"%fsdp compare takes one optional positive number of runs; got {' '.join(words)!r}")
        comparison.show(int(words[0]) if words else 5, with_figure=getattr(self.shell, "kernel", None) is not None)

    def _action_set(self, rest: str) -> None:
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
            settings["world_size"] = self.world_size_for(int(settings["world_size"]))
        if not settings:
            raise UsageError("%fsdp set takes KEY=VALUE pairs, e.g. %fsdp set activation_checkpointing=true")
        print(f"nbfsdp: {self.session.change_settings(settings) or 'defaults of the next cells set'}")

    def _action_panel(self, rest: str) -> None:
        words = rest.split()
        if len(words) > 1:
            raise UsageError(f"%fsdp panel takes at most one model name; got {' '.join(words)!r}")
        model = None
        if words:
            model = self.shell.user_ns.get(words[0])
            if not isinstance(model, nn.Module):
                raise UsageError(f"%fsdp panel {words[0]}: not an nn.Module in the notebook")
        world_size = self.world_size_for(self.session.panel_world_size, self.session.panel.get("device"))
        display(settings_panel(self.session, model, world_size).box)

    def world_size_for(self, requested: int | None, device: str | None = None) -> int:
        """The world size asked, or by default the cluster's (a rank per GPU, 2 on the CPU; attached: every
        engine)."""
        world_size = requested if requested is not None else self.session.cluster.default_world_size(device)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise UsageError(f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
        return world_size

    def stop(self) -> None:
        """The extension unloads (or the kernel ends): an attached cluster is let go of, nbfsdp's own stopped."""
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


def _no_arguments(action: str, rest: str) -> None:
    if rest:
        raise UsageError(f"%fsdp {action} takes no arguments; got {rest!r}")
