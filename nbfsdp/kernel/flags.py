"""The flags of ``%%fsdp`` and ``%fsdp``'s actions, declared with IPython's ``magic_arguments``.

The fsdp_config flags are made from ``FSDPConfig`` itself: one flag per setting (``--a-b`` for the field
``a_b``), its choices the field's ``Literal``, its help the field's docstring. A new setting is one field
with a docstring, and its flag, choices and help follow.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from nbfsdp.kernel.planning.workload import Workload, autocast_dtype
from nbfsdp.shared import config
from nbfsdp.shared.limits import DEFAULT_TIMEOUT_SECONDS

if TYPE_CHECKING:
    from nbfsdp.kernel.cluster.slurm import SlurmRequest

WORLD_SIZE_HELP = (
    "Number of ranks, one engine each (default: the number of GPUs, or 2 on CPU and with --device cpu; "
    "attached: every engine)."
)
KEEP_ON_RANKS_HELP = (
    "The cell's models live on the ranks from now on: never gathered after a cell, the notebook's copy freed (its "
    "repr says where the weights are); nbfsdp.gather(model) brings them on demand."
)


TIMEOUT_HELP = f"Seconds a collective may wait before it fails (default {DEFAULT_TIMEOUT_SECONDS:g})."
#: ``--hang-report``'s default: far above any one collective of a healthy step.
DEFAULT_HANG_REPORT_SECONDS = 30.0
HANG_REPORT_HELP = (
    "Seconds a rank may wait in one collective before the cell prints, by itself, where every rank is (%%fsdp "
    "where's report) and goes on waiting for --timeout; 0: never (default 30, or half of --timeout if shorter)."
)


TIMELINE_HELP = (
    "Each rank captures its second step, the first after each change of the settings, then one step every "
    "SECONDS: every unit's all-gathers, compute and reduce-scatters, in last_run().timeline and the dashboard's "
    "timeline panel (%%fsdp timeline, %%fsdp trace PATH.json). 0: none. Default 10."
)


def timeline_seconds(given: float) -> float:
    """``--timeline``'s seconds between captured steps, checked: 0 (none) or positive."""
    if not (given >= 0 and given < float("inf")):
        raise UsageError(f"--timeline must be 0 (no captures) or a positive number of seconds, got {given:g}")
    return given


def hang_report_seconds(given: float | None, timeout: float) -> float:
    """``--hang-report``'s seconds: as given (0: off), else 30 or half of ``--timeout``, whichever is shorter, so
    that the report comes before the collective's own timeout ends the cell."""
    seconds = min(DEFAULT_HANG_REPORT_SECONDS, timeout / 2) if given is None else given
    if not seconds >= 0:
        raise UsageError(f"--hang-report must be 0 (off) or a positive number of seconds, got {seconds:g}")
    return seconds


#: ``--dtype`` of exports and ``--hf`` saves.
HF_DTYPES = ("fp32", "bf16", "fp16")
MAX_SHARD_SIZE_HELP = (
    "With --hf: the largest safetensors file, e.g. 200MB or 5GB (decimal units, as save_pretrained's; default "
    "5GB); a tensor larger than that gets a file of its own."
)
#: FSDPConfig fields that are no flag: the Composer keys without effect, nbfsdp's reasons.
_NOT_FLAGS = ("ignored", "why")
#: Flags whose value is read as text and checked by ``config.resolve`` (a number may be written 1e8).
_METAVARS = {
    "replicas": "R",
    "min_params": "N",
    "wrap_cls": "NAME[,NAME]",
    "memory_limit": "SIZE",
    "save_folder": "FOLDER",
    "save_interval": "INTERVAL",
    "save_num_checkpoints_to_keep": "KEEP",
    "load_path": "PATH",
    "load_ignore_keys": "KEYS",
}


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string under each field), read from its source: Python keeps
    no attribute docstrings at run time."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(definition, ast.ClassDef)
    body = definition.body
    docs = {}
    for field_node, doc in zip(body, body[1:], strict=False):
        if (
            isinstance(field_node, ast.AnnAssign)
            and isinstance(field_node.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field_node.target.id] = " ".join(inspect.cleandoc(doc.value.value).split())
    return docs


def _choices(cls: type, name: str) -> tuple[str, ...] | None:
    """The strings a field's ``Literal`` allows (``None`` and other members of a union aside), if it has one."""
    hint = typing.get_type_hints(cls)[name]
    literals = [a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal] or [hint]
    found = [
        value for literal in literals if typing.get_origin(literal) is typing.Literal for value in literal.__args__
    ]
    return tuple(found) or None


def field_argument(cls: type, docs: dict[str, str], name: str) -> Callable:
    """The flag of dataclass field ``name`` of ``cls`` (``FSDPConfig`` or ``CheckpointSettings``), its help
    the field's docstring: a switch for a bool, a choice for a ``Literal``, else text."""
    doc = docs[name].replace("%", "%%")  # argparse formats help with %
    flag = "--" + name.replace("_", "-")
    default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(default, bool):  # absent means 'not given' so --config and defaults apply
        return argument(flag, action="store_const", const=True, default=None, help=doc)
    choices = _choices(cls, name)
    if choices is not None:
        return argument(flag, choices=choices, help=doc)
    return argument(flag, metavar=_METAVARS.get(name, name.upper()), help=doc)


FIELD_DOCS = field_docs(config.FSDPConfig)
#: %%fsdp flags that are fsdp_config keys (flag --a-b is key a_b), in FSDPConfig's order.
CONFIG_FLAGS = tuple(f.name for f in dataclasses.fields(config.FSDPConfig) if f.name not in _NOT_FLAGS)
#: What %fsdp set (and the controls) can set: the fsdp_config fields and the world size.
SETTABLE = (*CONFIG_FLAGS, "world_size")
_CONFIG_ARGUMENTS: list[Callable[[Callable], Callable]] = [
    argument("--config", metavar="NAME", help="A dict in the notebook in Composer's fsdp_config form; flags win."),
    *(field_argument(config.FSDPConfig, FIELD_DOCS, name) for name in CONFIG_FLAGS),
]
CHECKPOINT_DOCS = field_docs(config.CheckpointSettings)


#: %%fsdp's checkpoint flags, Composer's names (flag --a-b is the --config key a_b): run settings, not fsdp_config.
_CHECKPOINT_ARGUMENTS: list[Callable[[Callable], Callable]] = [
    field_argument(config.CheckpointSettings, CHECKPOINT_DOCS, name) for name in config.CHECKPOINT_KEYS
]


def config_arguments(func: Callable) -> Callable:
    """Add the fsdp_config flags to a magic's arguments."""
    for add in reversed(_CONFIG_ARGUMENTS):
        func = add(func)
    return func


def checkpoint_arguments(func: Callable) -> Callable:
    """Add the checkpoint flags to %%fsdp's arguments."""
    for add in reversed(_CHECKPOINT_ARGUMENTS):
        func = add(func)
    return func


def synopsis(parser_function: Any) -> str:
    """An action's arguments as its parser declares them, in the source's order, the settings flags written
    once as ``[settings]``: the usage is made from the parser, so it cannot miss a flag the parser takes.
    Reads ``magic_arguments``' own record of the decorators (``decorators``, each ``argument`` with its
    ``args`` and ``kwds``), not argparse's private action list."""
    words: list[str] = []
    for decorator in reversed(parser_function.decorators):
        if decorator in _CONFIG_ARGUMENTS:
            words += [] if "[settings]" in words else ["[settings]"]
        elif isinstance(decorator, argument):
            words.append(_usage_word(decorator.args, decorator.kwds))
    return " ".join([w for w in words if not w.startswith("[")] + [w for w in words if w.startswith("[")])


def _usage_word(names: tuple[str, ...], options: dict[str, Any]) -> str:
    if not names[0].startswith("-"):
        return options.get("metavar") or names[0].upper()
    flag = next(n for n in names if n.startswith("--"))
    if options.get("action") in ("store_true", "store_const"):
        return f"[{flag}]"
    choices = options.get("choices")
    value = options.get("metavar") or ("{" + ",".join(choices) + "}" if choices else flag[2:].upper())
    return f"[{flag} {value}]"


def description(parser_function: Any) -> str:
    """What an action does: its parser's description (the parser function's docstring)."""
    return parser_function.parser.description


# -- the parsers of %fsdp's actions that take flags (parse_argstring(parser, rest)); each docstring says what the
# action does, and ``synopsis`` writes its arguments
@magic_arguments()
@argument("model", help="The name of an nn.Module in the notebook.")
@argument("--world-size", "-n", type=int, metavar="N", default=None, help=WORLD_SIZE_HELP)
@argument("--code", action="store_true", help="Print the plain FSDP2 code these settings amount to.")
@argument(
    "--batch",
    metavar="EXPR",
    help="One step's global batch, a notebook expression (a tensor, a tuple, a dict of tensors, a DataLoader, "
    "meta tensors): each rank's peak in a training step, traced on the meta device.",
)
@argument("--loss", metavar="NAME", help="With --batch: loss_fn(output, *target), where the output has no loss.")
@argument("--per-rank-batches", action="store_true", help="With --batch: the batch is each rank's, not the global one.")
@argument(
    "--autocast",
    choices=("bf16", "fp16"),
    help="With --batch: forward and loss run under torch.autocast to this dtype, as the training loop does.",
)
@argument("--gpu", metavar="NAME", help="With --batch: does it fit this GPU (H100, A100 40GB, L4, ...)?")
@argument("--device-memory", metavar="SIZE", help="With --batch: does it fit this much memory (80GiB)?")
@argument("--suggest", action="store_true", help="With --gpu or --device-memory: the cheapest settings that fit.")
@config_arguments
def explain_arguments(line: str) -> None:
    """the FSDP plan, or with --code the plain FSDP2 code it amounts to, nothing run (see %fsdp? for settings);
    with --batch, each rank's peak in a training step, and with --gpu or --device-memory whether it fits"""


@magic_arguments()
@argument(
    "--profile",
    metavar="P",
    default=None,
    help="The ipyparallel profile the cluster was started with (default: default).",
)
@argument("--cluster-id", metavar="ID", default=None, help="Its cluster id, where the profile has several running.")
@argument(
    "--shared-dir",
    metavar="PATH",
    default=None,
    help="A directory the notebook and every host see (a shared file system), for live changes, cancel and "
    "--save-interval (default: a directory in the cluster's profile, shared where the hosts share a home).",
)
@argument("--slurm", action="store_true", help="Start the ranks as a Slurm job first (sbatch), then attach to them.")
@argument("--nodes", type=int, metavar="N", default=None, help="With --slurm: the job's nodes.")
@argument("--ranks-per-node", type=int, metavar="K", default=None, help="With --slurm: ranks (engines) a node.")
@argument("--partition", metavar="P", default=None, help="With --slurm: the partition (default: Slurm's default).")
@argument("--time", metavar="T", default=None, help="With --slurm: the job's time limit, as sbatch --time takes it.")
@argument("--gpus-per-node", type=int, metavar="G", default=None, help="With --slurm: GPUs a node (sbatch's).")
@argument("--account", metavar="A", default=None, help="With --slurm: the account to charge.")
@argument(
    "--sbatch-arg", action="append", default=[], metavar="ARG", help="With --slurm: one more sbatch option, as typed."
)
def attach_arguments(line: str) -> None:
    """run the next cells on a running ipyparallel cluster nbfsdp did not start (any launcher, several hosts), or
    with --slurm on the ranks of a Slurm job it starts (--sbatch-arg=--exclusive passes an option that starts
    with a dash)"""


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
@argument(
    "--hf",
    action="store_true",
    help="Write PATH as save_pretrained does (safetensors files, their index, config.json) for from_pretrained, "
    "each rank writing its shards; the kernel never holds the model.",
)
@argument("--model", metavar="NAME", default=None, help="With --hf: which model, when the engines hold several.")
@argument("--max-shard-size", metavar="SIZE", default=None, help=MAX_SHARD_SIZE_HELP)
@argument("--dtype", choices=HF_DTYPES, default=None, help="With --hf: cast the floating tensors (default: as held).")
def save_arguments(line: str) -> None:
    """a sharded checkpoint of what the engines hold; with --hf, one model as save_pretrained writes it, for
    from_pretrained"""


@magic_arguments()
@argument("path", help="The checkpoint's directory, or a .pt or .safetensors file of full weights.")
@argument(
    "--world-size",
    "-n",
    type=int,
    metavar="N",
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
    metavar="NAME",
    default=None,
    help="With a .pt or .safetensors file: the notebook's model to load it into (default: the only one it fits).",
)
def load_arguments(line: str) -> None:
    """a checkpoint (or a .pt/.safetensors file of full weights, each rank reading its shard) into the engines
    and the notebook's objects"""


@magic_arguments()
@argument("folder", help="A folder holding checkpoints.")
def checkpoints_arguments(line: str) -> None:
    """the checkpoints there"""


@magic_arguments()
@argument("--rank", type=int, metavar="R", default=None, help="Walk this failed rank's frames (%%debug's, here).")
@argument("--release", action="store_true", help="Let every rank go of its failed frames now, and say what they held.")
def debug_arguments(line: str) -> None:
    """the ranks that keep a failed cell's frames for %debug; --rank R walks one"""


def slurm_request(args: argparse.Namespace) -> SlurmRequest | None:
    """``%fsdp attach``'s Slurm flags as the job to start, checked; None without ``--slurm`` (where they are
    refused)."""
    from nbfsdp.kernel.cluster.slurm import SlurmRequest

    only = {"--nodes": args.nodes, "--ranks-per-node": args.ranks_per_node, "--partition": args.partition,
            "--time": args.time, "--gpus-per-node": args.gpus_per_node, "--account": args.account,
            "--sbatch-arg": args.sbatch_arg or None}  # fmt: skip
    if not args.slurm:
        if given := [flag for flag, value in only.items() if value is not None]:
            raise UsageError(f"{', '.join(given)} go with --slurm: the Slurm job nbfsdp starts")
        return None
    if args.cluster_id is not None:
        raise UsageError("--cluster-id names a running cluster; --slurm starts one")
    if args.nodes is None or args.ranks_per_node is None:
        raise UsageError("--slurm needs --nodes N and --ranks-per-node K (the job's nodes, and engines a node)")
    return SlurmRequest(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        partition=args.partition,
        time=args.time,
        gpus_per_node=args.gpus_per_node,
        account=args.account,
        sbatch_args=args.sbatch_arg,
    )


DEBUG_RANK_HELP = (
    "The ranks a breakpoint() or pdb.set_trace() in the cell stops, such as 1 or 0,2 (default: every rank, one "
    "prompt at a time, the lowest rank first); the others pass it over."
)


@magic_arguments()
@argument(
    "--step", type=int, metavar="N", default=None, help="The captured step to draw (default: the last one captured)."
)
@argument("--rank", type=int, metavar="R", default=None, help="Draw this rank alone (default: every rank, aligned).")
def timeline_arguments(line: str) -> None:
    """a step the last cell captured (--timeline), each rank's all_gather, compute and reduce_scatter phases,
    and its collectives' sizes and bus bandwidth"""


@magic_arguments()
@argument(
    "path",
    metavar="PATH.json",
    help="The Chrome trace file to write, e.g. trace.json (Perfetto and chrome://tracing open it).",
)
def trace_arguments(line: str) -> None:
    """the last cell's captured steps as one Chrome trace (Perfetto)"""


@magic_arguments()
@argument("checkpoint", help="A complete checkpoint's directory.")
@argument("out", help="The file to write: .pt (a plain state dict) or .safetensors; with --hf a directory.")
@argument("--model", metavar="NAME", default=None, help="Which model, when the checkpoint holds several.")
@argument("--dtype", choices=HF_DTYPES, default=None, help="Cast the floating tensors.")
@argument(
    "--hf",
    action="store_true",
    help="Write the directory OUT as save_pretrained does (safetensors files, their index, config.json from the "
    "notebook's model of that name), one file's tensors in the kernel at a time.",
)
@argument("--max-shard-size", metavar="SIZE", default=None, help=MAX_SHARD_SIZE_HELP)
@argument("--overwrite", action="store_true", help="With --hf: replace a model directory already at OUT.")
def export_arguments(line: str) -> None:
    """one model's full weights into one .pt or .safetensors file, in the kernel; with --hf, into the directory
    OUT as save_pretrained writes it, one file at a time"""


def save_options(args: argparse.Namespace) -> dict[str, Any]:
    """``%fsdp save``'s flags as ``save_with``'s keywords."""
    return {
        "background": args.background,
        "hf": args.hf,
        "max_shard_size": args.max_shard_size,
        "model": args.model,
        "dtype": args.dtype,
    }


def export_options(args: argparse.Namespace) -> dict[str, Any]:
    """``%fsdp export``'s flags as ``exporting.export``'s keywords."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "hf": args.hf,
        "max_shard_size": args.max_shard_size,
        "overwrite": args.overwrite,
    }


def explain_workload(args: argparse.Namespace, namespace: dict[str, Any]) -> Workload | None:
    """``--batch EXPR`` evaluated in the notebook, with ``--loss NAME`` and ``--per-rank-batches``."""
    if args.batch is None:
        if args.loss is not None or args.per_rank_batches or args.autocast is not None:
            raise UsageError("--loss, --per-rank-batches and --autocast go with --batch EXPR")
        return None
    try:
        batch = eval(args.batch, namespace)  # noqa: S307 (the user's own expression, in their notebook)
    except Exception as error:
        raise UsageError(f"--batch {args.batch}: {type(error).__name__}: {error}") from None
    loss = None
    if args.loss is not None:
        loss = namespace.get(args.loss)
        if not callable(loss):
            raise UsageError(f"--loss {args.loss}: not a function in the notebook (loss_fn(output, target))")
    return Workload(batch, loss, args.per_rank_batches, autocast=autocast_dtype(args.autocast))
