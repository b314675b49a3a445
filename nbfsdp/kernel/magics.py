"""``%%fsdp`` and ``%fsdp``: their arguments parsed and checked, each action handed to the session (a cell's
run, checkpoints, explain) or answered here (status and compare tables)."""

from __future__ import annotations

import ast
import dataclasses
import io

import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import Image, display

from nbfsdp.kernel import comparison
from nbfsdp.kernel.cluster.local import FSDPCluster
from nbfsdp.kernel.cluster.world import visible_gpus
from nbfsdp.kernel.planning import fitting
from nbfsdp.kernel.planning.peak import Workload, autocast_dtype
from nbfsdp.kernel.planning.plans import plan
from nbfsdp.kernel.run.session import Session
from nbfsdp.kernel.status import status
from nbfsdp.kernel.usage_errors import as_usage_errors
from nbfsdp.shared import config
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.devices import requested_device
from nbfsdp.shared.limits import MAX_WORLD_SIZE
from nbfsdp.ui.panel import SettingsPanel

DEFAULT_TIMEOUT_SECONDS = 30.0
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
    "where": "where: each rank's stack and collectives while a cell runs, and which rank left the others waiting",
    "interrupt": "interrupt: end an --async run now, as Ctrl-C ends a blocking one",
    "save": "save PATH [--overwrite] [--async]: a sharded checkpoint of what the engines hold",
    "load": "load PATH [--world-size N] [--load-ignore-keys K,...] [--model NAME]: a checkpoint (or a "
    ".pt/.safetensors file of full weights, each rank reading its shard) into the engines and the notebook's objects",
    "checkpoints": "checkpoints FOLDER: the checkpoints there",
    "export": "export CHECKPOINT OUT [--model NAME] [--dtype D]: one model's full weights into one .pt or "
    ".safetensors file, in the kernel",
    "export-script": "export-script PATH: the last %%fsdp cell as a torchrun script, its inputs saved beside it",
    "attach": "attach [--profile P] [--cluster-id ID]: run the next cells on a running ipyparallel cluster nbfsdp "
    "did not start (any launcher, several hosts)",
    "detach": "detach: let go of it, leaving it running",
}
LINE_ACTIONS = tuple(LINE_ACTION_HELP)
WORLD_SIZE_HELP = (
    "Number of ranks, one engine each (default: the number of GPUs, or 2 on CPU and with --device cpu; "
    "attached: every engine)."
)

#: What %fsdp set (and the controls) can set: the fsdp_config fields and the world size.
SETTABLE = (*(f.name for f in dataclasses.fields(config.FSDPConfig) if f.name not in ("ignored", "why")), "world_size")


def _switch(flag: str, help_text: str):
    """A flag that turns a setting on; absent means 'not given' so --config and defaults apply."""
    return argument(flag, action="store_const", const=True, default=None, help=help_text)


#: The fsdp_config flags, shared by %%fsdp and %fsdp explain.
_CONFIG_ARGUMENTS = [
    argument("--config", metavar="NAME", help="A dict in the notebook in Composer's fsdp_config form; flags win."),
    argument(
        "--device",
        choices=config.DEVICE_CHOICES,
        help="cuda: every rank on a GPU, rank r on GPU r mod G (several ranks share one where there are fewer GPUs; "
        "NCCL between them goes over sockets); cpu: gloo; auto (default, or $NBFSDP_DEVICE): a GPU a rank where "
        "there are enough, else the CPU.",
    ),
    argument(
        "--sharding-strategy",
        choices=config.SHARDING_STRATEGIES,
        help="FULL_SHARD (ZeRO-3, default), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (replicated), HYBRID_SHARD.",
    ),
    argument("--replicas", type=int, metavar="R", help="HYBRID_SHARD: R replica groups, each sharding the model."),
    argument(
        "--mixed-precision",
        choices=config.MIXED_PRECISIONS,
        help="FULL: fp32 (default on CPU); DEFAULT: low-precision parameters (the compute), fp32 gradient "
        "reduction, fp32 buffers (default on GPU; Composer's FSDP2 meaning); PURE: low precision throughout.",
    ),
    argument(
        "--precision",
        choices=config.PRECISIONS,
        help="The low precision of DEFAULT and PURE (default bf16); given, DEFAULT is the default on CPU too.",
    ),
    argument(
        "--backward-prefetch",
        choices=config.BACKWARD_PREFETCHES,
        help="Gather the next unit during backward (default: Composer's BACKWARD_POST, which runs as BACKWARD_PRE).",
    ),
    _switch("--forward-prefetch", "Gather the next unit during forward."),
    _switch("--activation-checkpointing", "Recompute activations in backward (Composer's module rules decide where)."),
    _switch("--activation-cpu-offload", "Keep saved activations on the CPU until backward."),
    _switch("--cpu-offload", "Keep sharded parameters, gradients and optimizer state on the CPU."),
    argument("--min-params", metavar="N", help="Wrap a module as its own unit from N parameters (default 1e8)."),
    argument("--wrap-cls", metavar="NAME[,NAME]", help="Class names whose instances are FSDP units (TorchAcc)."),
    _switch(
        "--sync-module-states",
        "A model built on the meta device: rank 0 initializes it whole and broadcasts the shards "
        "(without it every rank initializes its own shards under the same seeds).",
    ),
]


#: %%fsdp flags that are fsdp_config keys (flag --a-b is key a_b), read off the arguments so that a new flag
#: is one line above.
CONFIG_FLAGS = tuple(
    a.args[0].removeprefix("--").replace("-", "_") for a in _CONFIG_ARGUMENTS if a.args[0] != "--config"
)


#: %%fsdp's checkpoint flags, Composer's names (flag --a-b is the --config key a_b): run settings, not fsdp_config.
_CHECKPOINT_ARGUMENTS = [
    argument("--save-folder", metavar="DIR", help="Where --save-interval saves (DIR/step-N) and --autoresume looks."),
    argument(
        "--save-interval",
        metavar="N",
        help="Save a checkpoint at nbfsdp.log(step=s) when (s + 1) %% N == 0, on every rank (needs --save-folder).",
    ),
    argument(
        "--save-num-checkpoints-to-keep",
        metavar="K",
        help="Keep the K newest complete checkpoints in the save folder (default -1: all).",
    ),
    _switch(
        "--autoresume",
        "Before the cell, load the newest complete checkpoint in --save-folder, if any; resume_step is its step.",
    ),
    argument("--load-path", metavar="PATH", help="Before the cell, load this checkpoint; resume_step is its step."),
    argument(
        "--load-ignore-keys",
        metavar="K[,K]",
        help="With --load-path or --autoresume: globs on the checkpoint's keys to skip, e.g. 'optimizers.*'.",
    ),
]


def checkpoint_arguments(func):
    """Add the checkpoint flags to %%fsdp's arguments."""
    for add in reversed(_CHECKPOINT_ARGUMENTS):
        func = add(func)
    return func


def config_arguments(func):
    """Add the fsdp_config flags to a magic's arguments."""
    for add in reversed(_CONFIG_ARGUMENTS):
        func = add(func)
    return func


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
        help=WORLD_SIZE_HELP,
    )
    @argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"Seconds a collective may wait before it fails (default {DEFAULT_TIMEOUT_SECONDS:g}).",
    )
    @argument(
        "--no-gather",
        action="store_true",
        help="Leave the trained weights on the engines; the notebook's models keep their old weights.",
    )
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
    @checkpoint_arguments
    @config_arguments
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
        if requested is None and (attached := self.session.attached_cluster) is not None:
            requested = attached.engines  # every engine of the attached cluster
        if not args.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        settings = self._settings(args)
        world_size = _world_size(requested, settings.device)
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
        )

    def _checkpointing(self, args) -> config.CheckpointSettings:
        """Explicit flags > the --config dict's Composer checkpoint keys."""
        flags = {key: getattr(args, key) for key in config.CHECKPOINT_KEYS}
        return config.checkpoint_settings(self._composer_dict(args.config), flags)

    def _settings(self, args) -> config.FSDPConfig:
        """Explicit flags > the --config dict > the panel's settings > defaults."""
        flags = {k: getattr(args, k) for k in CONFIG_FLAGS}
        return config.resolve(self._composer_dict(args.config), flags, self.session.panel)

    def _composer_dict(self, name: str | None) -> dict | None:
        if name is None:
            return None
        if name not in self.shell.user_ns:
            raise UsageError(f"--config {name}: no such name in the notebook")
        value = self.shell.user_ns[name]
        if not isinstance(value, dict):
            raise UsageError(f"--config {name}: is a {type(value).__name__}, not a dict like Composer's fsdp_config")
        return value

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
        print(self.session.export_script(rest))

    def _action_attach(self, rest: str) -> None:
        args = parse_argstring(self._attach_arguments, rest)
        self._attach(args.profile, args.cluster_id, args.shared_dir)

    def _action_detach(self, rest: str) -> None:
        _no_arguments("detach", rest)
        attached = self.session.detach()
        print("nbfsdp: detached; the cluster goes on running" if attached else "nbfsdp: no cluster attached")

    @magic_arguments()
    @argument("model", help="The name of an nn.Module in the notebook.")
    @argument("--world-size", "-n", type=int, default=None, help=WORLD_SIZE_HELP)
    @argument("--code", action="store_true", help="Print the plain FSDP2 code these settings amount to.")
    @argument(
        "--batch",
        metavar="EXPR",
        help="One step's global batch, a notebook expression (a tensor, a tuple, a dict of tensors, a DataLoader, "
        "meta tensors): each rank's peak in a training step, traced on the meta device.",
    )
    @argument("--loss", metavar="NAME", help="With --batch: loss_fn(output, *target), where the output has no loss.")
    @argument(
        "--per-rank-batches", action="store_true", help="With --batch: the batch is each rank's, not the global one."
    )
    @argument(
        "--autocast",
        choices=("bf16", "fp16"),
        help="With --batch: forward and loss run under torch.autocast to this dtype, as the training loop does.",
    )
    @argument("--gpu", metavar="NAME", help="With --batch: does it fit this GPU (H100, A100 40GB, L4, ...)?")
    @argument("--device-memory", metavar="SIZE", help="With --batch: does it fit this much memory (80GiB)?")
    @argument("--suggest", action="store_true", help="With --gpu or --device-memory: the cheapest settings that fit.")
    @config_arguments
    def _explain_arguments(self, line: str) -> None:
        """%fsdp explain [--code] [settings] [--world-size N] [--batch EXPR [--gpu NAME] [--suggest]] MODEL"""

    def _action_explain(self, line: str) -> None:
        args = parse_argstring(self._explain_arguments, line)
        model = self.shell.user_ns.get(args.model)
        if not isinstance(model, nn.Module):
            found = "no such name" if model is None else f"a {type(model).__name__}"
            raise UsageError(f"%fsdp explain {args.model}: {found}, not an nn.Module in the notebook")
        attached = self.session.attached_cluster
        requested = args.world_size
        if requested is None and attached is not None:
            requested = attached.engines  # as %%fsdp: every engine of the attached cluster
        settings = self._settings(args)
        world_size = _world_size(requested, settings.device)
        hosts = None
        if attached is not None:  # the ranks' hosts, to say which collectives cross between them
            hosts = [p.host for p in attached.placements_for(world_size)]
            settings = self._replica_per_host(settings, world_size)
        devices = self.session.cluster.devices(world_size, settings.device, planning=True)
        settings = config.validate(settings, world_size, devices)
        workload = self._workload(args)
        memory = fitting.device_memory(args.gpu, args.device_memory)
        if (memory is not None or args.suggest) and workload is None:
            raise UsageError("--gpu, --device-memory and --suggest need --batch EXPR: the step whose peak they judge")
        if args.suggest and memory is None:
            raise UsageError("--suggest needs --gpu NAME or --device-memory SIZE: what the settings must fit")
        planned = plan(
            model, settings, world_size, hosts, devices, workload=workload, memory=memory, suggest=args.suggest
        )
        print(planned.code if args.code else planned, end="" if args.code else "\n")

    def _workload(self, args) -> Workload | None:
        """``--batch EXPR`` evaluated in the notebook, with ``--loss NAME`` and ``--per-rank-batches``."""
        if args.batch is None:
            if args.loss is not None or args.per_rank_batches or args.autocast is not None:
                raise UsageError("--loss, --per-rank-batches and --autocast go with --batch EXPR")
            return None
        try:
            batch = eval(args.batch, self.shell.user_ns)  # noqa: S307 (the user's own expression, in their notebook)
        except Exception as error:
            raise UsageError(f"--batch {args.batch}: {type(error).__name__}: {error}") from None
        loss = None
        if args.loss is not None:
            loss = self.shell.user_ns.get(args.loss)
            if not callable(loss):
                raise UsageError(f"--loss {args.loss}: not a function in the notebook (loss_fn(output, target))")
        return Workload(batch, loss, args.per_rank_batches, autocast=autocast_dtype(args.autocast))

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

    @magic_arguments()
    @argument(
        "--profile", default=None, help="The ipyparallel profile the cluster was started with (default: default)."
    )
    @argument("--cluster-id", default=None, help="Its cluster id, where the profile has several running.")
    @argument(
        "--shared-dir",
        default=None,
        help="A directory the notebook and every host see (a shared file system), for live changes, cancel and "
        "--save-interval (default: a directory in the cluster's profile, shared where the hosts share a home).",
    )
    def _attach_arguments(self, line: str) -> None:
        """%fsdp attach [--profile P] [--cluster-id ID] [--shared-dir PATH]"""

    @magic_arguments()
    @argument("path", help="The checkpoint's directory.")
    @argument("--overwrite", action="store_true", help="Replace a complete checkpoint already at PATH.")
    @argument(
        "--async",
        dest="background",
        action="store_true",
        help="Return once every rank has its snapshot; the ranks write it while the next cells run "
        "(`%%fsdp wait`, `%%fsdp stop` and the next save wait for it and raise its error).",
    )
    def _save_arguments(self, line: str) -> None:
        """%fsdp save PATH [--overwrite] [--async]"""

    @magic_arguments()
    @argument("path", help="The checkpoint's directory, or a .pt or .safetensors file of full weights.")
    @argument(
        "--world-size",
        "-n",
        type=int,
        default=None,
        help="Ranks to load into (default: the running world's, or with none running the checkpoint's).",
    )
    @argument(
        "--load-ignore-keys",
        metavar="K[,K]",
        default="",
        help="Globs on the checkpoint's keys to skip, e.g. 'optimizers.*' (an optimizer skipped skips its scheduler).",
    )
    @argument(
        "--model",
        default=None,
        help="With a .pt or .safetensors file: the notebook's model to load it into (default: the only one it fits).",
    )
    def _load_arguments(self, line: str) -> None:
        """%fsdp load PATH [--world-size N] [--load-ignore-keys K,...] [--model NAME]"""

    @magic_arguments()
    @argument("folder", help="A folder holding checkpoints.")
    def _checkpoints_arguments(self, line: str) -> None:
        """%fsdp checkpoints FOLDER"""

    @magic_arguments()
    @argument("checkpoint", help="A complete checkpoint's directory.")
    @argument("out", help="The file to write: .pt (a plain state dict) or .safetensors.")
    @argument("--model", default=None, help="Which model, when the checkpoint holds several.")
    @argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="Cast the floating tensors.")
    def _export_arguments(self, line: str) -> None:
        """%fsdp export CHECKPOINT OUT [--model NAME] [--dtype {fp32,bf16,fp16}]"""

    def _checkpoint(self, action: str, line: str) -> None:
        from nbfsdp.kernel.checkpoints import sharded as checkpoints

        if action == "export":  # in the kernel: no engines needed
            from nbfsdp.kernel.checkpoints import exporting

            args = parse_argstring(self._export_arguments, line)
            written = exporting.export(args.checkpoint, args.out, model=args.model, dtype=args.dtype)
            print(f"nbfsdp: wrote {written} ({size_text(written.stat().st_size)})")
            return

        if action == "save":
            args = parse_argstring(self._save_arguments, line)
            checkpoints.save_with(self.session, args.path, args.overwrite, background=args.background)
        elif action == "load":
            args = parse_argstring(self._load_arguments, line)
            checkpoints.load_with(self.session, args.path, args.world_size, args.load_ignore_keys, model=args.model)
        else:
            args = parse_argstring(self._checkpoints_arguments, line)
            found = checkpoints.checkpoints(args.folder)
            print(checkpoints.table(found) if found else f"nbfsdp: no checkpoints in {args.folder}")

    def _action_compare(self, rest: str) -> None:
        words = rest.split()
        if len(words) > 1 or (words and not (words[0].isdigit() and int(words[0]) > 0)):
            raise UsageError(f"%fsdp compare takes one optional positive number of runs; got {' '.join(words)!r}")
        last = int(words[0]) if words else 5
        rows = comparison.compare(last)
        if not rows:
            print("nbfsdp: no runs yet")
            return
        print(comparison.table(rows))
        figure = comparison.loss_figure(last)
        if figure is not None and getattr(self.shell, "kernel", None) is not None:
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png")
            display(Image(data=buffer.getvalue()))

    def _action_set(self, rest: str) -> None:
        words = rest.split()
        settings: dict[str, bool | str | int] = {}
        for word in words:
            key, equals, value = word.partition("=")
            if not equals or not value:
                raise UsageError(f"%fsdp set takes KEY=VALUE pairs (fsdp_config keys or world_size); got {word!r}")
            if key not in SETTABLE:
                raise UsageError(f"%fsdp set {key}: not a setting; valid: {', '.join(SETTABLE)}")
            settings[key] = {"true": True, "false": False}.get(value.lower(), value)
        if "world_size" in settings:
            if not str(settings["world_size"]).isdigit():
                raise UsageError(f"world_size must be a whole number; got {settings['world_size']!r}")
            settings["world_size"] = _world_size(int(settings["world_size"]))
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
        world_size = _world_size(self.session.panel_world_size, self.session.panel.get("device"))
        display(settings_panel(self.session, model, world_size).box)

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


def _no_arguments(action: str, rest: str) -> None:
    if rest:
        raise UsageError(f"%fsdp {action} takes no arguments; got {rest!r}")


def _world_size(requested: int | None, device: str | None = None) -> int:
    """The world size asked, or by default a rank per GPU (2 on the CPU)."""
    if requested is None:
        requested = 2 if requested_device(device) == "cpu" else (visible_gpus() or 2)
    world_size = requested
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
    return world_size
