"""What a ``%%fsdp`` cell's source does on every rank, read from its syntax tree alone: which calls are
collectives (a forward of a sharded model, a backward, ``torch.distributed``'s collectives, a state dict
gathered), which conditions depend on the rank, and which loops accumulate gradients. ``check`` turns these
into findings; nothing here runs the cell.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from types import FunctionType
from typing import Any

import torch.distributed
from torch.optim import Optimizer

#: ``torch.distributed``'s collectives: every rank of the group must call each one, in the same order.
#: Point-to-point calls (``send``, ``recv``) differ by rank on purpose and are left out.
COLLECTIVES = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
        "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
        "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    }
)  # fmt: skip
#: Calls that gather or set sharded state: a collective on every rank (DTensor's ``full_tensor`` all-gathers;
#: ``clip_grad_norm_`` all-reduces the norm of sharded gradients; DCP's save and load agree on a plan).
STATE_COLLECTIVES = frozenset(
    {
        "full_tensor", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
        "set_optimizer_state_dict", "set_state_dict", "clip_grad_norm_",
    }
)  # fmt: skip
#: Names and attributes that differ by rank: torchrun's variables, nbfsdp's ``rank``, Accelerate's main process.
RANK_NAMES = frozenset({"rank", "local_rank", "global_rank", "RANK", "LOCAL_RANK", "GROUP_RANK"})
_RANK_CALLS = frozenset({"get_rank", "get_local_rank", "get_node_local_rank", "get_global_rank"})
_RANK_ATTRIBUTES = frozenset({"is_main_process", "is_local_main_process", "process_index", "local_process_index"})
#: The calls that stop gradients being reduced on each backward (FSDP2's, and FSDP1's and DDP's ``no_sync``).
SYNC_SETTINGS = frozenset({"set_requires_gradient_sync", "no_sync", "set_requires_all_reduce"})
_SHARDING_CALLS = frozenset({"fully_shard", "FSDP", "FullyShardedDataParallel", "DDP", "DistributedDataParallel"})
#: How deep the calls of the cell's and the notebook's functions are followed.
_DEPTH = 3


@dataclass(frozen=True, slots=True)
class Call:
    """A call every rank must make, found at ``line`` of the cell (through ``via``, a function it calls)."""

    kind: str
    """What it is, in words: "model's forward", "a backward", "torch.distributed.all_reduce"."""
    line: int
    via: str = ""


def dotted(node: ast.AST) -> str:
    """``torch.distributed.all_reduce`` for that attribute chain; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and the nodes below it that run when it runs: not the bodies of functions, classes or lambdas
    it defines."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from own_nodes(child)


def statement_text(source: str, statement: ast.stmt) -> str:
    """The statement's source, dedented (a multi-line one keeps its inner indentation)."""
    return textwrap.dedent(ast.get_source_segment(source, statement, padded=True) or ast.unparse(statement))


class CellCode:
    """A cell's source and what its names are: the notebook's models and optimizers it reads, the modules it
    shards itself, the names that hold the rank, the functions it defines or calls."""

    def __init__(self, source: str, namespace: dict[str, Any], models: list[str]) -> None:
        self.source = source
        self.lines = source.splitlines()
        self.tree = ast.parse(source)
        self.namespace = namespace
        self.models = set(models)
        """Names bound to a sharded model: the notebook's models the cell reads, their aliases in the cell, and
        what the cell passes to ``fully_shard`` (or FSDP1, DDP) itself."""
        self.optimizers = {n for n in namespace if isinstance(namespace[n], Optimizer)}
        self.functions = {
            n.name: n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        self.distributed = {"torch.distributed"} | {
            name for name, value in namespace.items() if value is torch.distributed
        }
        self.checkpoint_modules = {"torch.distributed.checkpoint", "dcp"}
        self.rank_names = set(RANK_NAMES)
        self._read_bindings()

    def _read_bindings(self) -> None:
        """Follow the cell's imports and assignments (twice, for chains): aliases of models, of
        ``torch.distributed``, optimizers built here, names computed from the rank."""
        for _ in range(2):
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    self._read_import(node)
                elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]
                    if self.rank_dependent(node.value):
                        self.rank_names.update(names)
                    if isinstance(node.value, ast.Name) and node.value.id in self.models:
                        self.models.update(names)
                    if isinstance(node.value, ast.Call) and self._builds_optimizer(node.value):
                        self.optimizers.update(names)
                elif isinstance(node, ast.Call) and dotted(node.func).rpartition(".")[2] in _SHARDING_CALLS:
                    self.models.update(n.id for n in node.args[:1] if isinstance(n, ast.Name))

    def _read_import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            full = f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
            bound = alias.asname or (alias.name if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0])
            if full == "torch.distributed" and (alias.asname or isinstance(node, ast.ImportFrom)):
                self.distributed.add(bound)
            elif full == "torch.distributed.checkpoint":
                self.checkpoint_modules.add(bound)

    def _builds_optimizer(self, call: ast.Call) -> bool:
        name = dotted(call.func)
        if name.startswith(("torch.optim.", "optim.")):
            return True
        value = self.namespace.get(name)
        return isinstance(value, type) and issubclass(value, Optimizer)

    def rank_dependent(self, expression: ast.AST) -> bool:
        """The expression's value differs between ranks: it reads the rank, ``get_rank()``, ``$RANK``."""
        for node in ast.walk(expression):
            if isinstance(node, ast.Name) and node.id in self.rank_names:
                return True
            if isinstance(node, ast.Attribute) and node.attr in _RANK_ATTRIBUTES:
                return True
            if isinstance(node, ast.Call) and dotted(node.func).rpartition(".")[2] in _RANK_CALLS:
                return True
            if isinstance(node, ast.Constant) and node.value in RANK_NAMES and self._environment_read(expression):
                return True
        return False

    @staticmethod
    def _environment_read(expression: ast.AST) -> bool:
        return any(
            dotted(n).startswith(("os.environ", "os.getenv", "environ", "getenv"))
            for n in ast.walk(expression)
            if isinstance(n, ast.Attribute | ast.Name)
        )

    def collectives(self, node: ast.AST, models: set[str] | None = None, depth: int = 0) -> list[Call]:
        """The calls under ``node`` that every rank must make; into the cell's and the notebook's functions it
        calls, ``depth`` levels deep, with ``models`` the names bound to sharded models there."""
        models = self.models if models is None else models
        found: list[Call] = []
        for call in (n for n in own_nodes(node) if isinstance(n, ast.Call)):
            kind = self._kind(call, models)
            if kind:
                found.append(Call(kind, call.lineno))
            elif depth < _DEPTH and (inner := self._function_calls(call, models, depth)):
                found += inner
        return found

    def _kind(self, call: ast.Call, models: set[str]) -> str:
        func = call.func
        attr = func.attr if isinstance(func, ast.Attribute) else ""
        base = dotted(func.value) if isinstance(func, ast.Attribute) else ""
        if isinstance(func, ast.Name):
            if func.id in models:
                return f"{func.id}'s forward"
            if func.id in COLLECTIVES and self._from_distributed(func.id):
                return f"torch.distributed.{func.id}"
            if func.id in STATE_COLLECTIVES:
                return f"{func.id} (a collective)"
            return ""
        if base in models and attr in ("forward", "generate"):
            return f"{base}'s forward"
        if attr == "backward":
            return "a backward"
        if attr in COLLECTIVES and base in self.distributed:
            return f"torch.distributed.{attr}"
        if attr in STATE_COLLECTIVES:
            return f"{attr} (a collective)"
        if attr in ("save", "load", "async_save") and base in self.checkpoint_modules:
            return f"torch.distributed.checkpoint.{attr}"
        if attr == "step" and base in self.optimizers:
            return f"{base}.step()"
        return ""

    def _from_distributed(self, name: str) -> bool:
        value = self.namespace.get(name)
        imported = any(
            isinstance(n, ast.ImportFrom) and n.module == "torch.distributed" and any(a.name == name for a in n.names)
            for n in ast.walk(self.tree)
        )
        return imported or getattr(value, "__module__", "").startswith("torch.distributed")

    def _function_calls(self, call: ast.Call, models: set[str], depth: int) -> list[Call]:
        """The collectives of a function the cell defines or the notebook holds, called here; reported at
        the line of this call."""
        if not isinstance(call.func, ast.Name):
            return []
        name = call.func.id
        definition = self.functions.get(name) or _notebook_function(self.namespace.get(name))
        if definition is None:
            return []
        parameters = [a.arg for a in [*definition.args.posonlyargs, *definition.args.args]]
        given = [*zip(parameters, call.args, strict=False), *((k.arg, k.value) for k in call.keywords if k.arg)]
        bound = {p: a.id for p, a in given if isinstance(a, ast.Name) and a.id in models}  # parameter: model
        inner_models = (models - set(parameters)) | set(bound)
        inner = [c for statement in definition.body for c in self.collectives(statement, inner_models, depth + 1)]
        return [Call(_renamed(c.kind, bound), call.lineno, via=f"{name}()") for c in inner]

    def line(self, number: int) -> str:
        return self.lines[number - 1] if 0 < number <= len(self.lines) else ""

    def first_use(self, name: str) -> int:
        """The first line that reads ``name`` (1 when it reads none)."""
        lines = [n.lineno for n in ast.walk(self.tree) if isinstance(n, ast.Name) and n.id == name]
        return min(lines, default=1)


def _renamed(kind: str, bound: dict[str, str]) -> str:
    """A kind found in a function, in the caller's names: ``m's forward`` is ``model's forward``."""
    name, quote, rest = kind.partition("'")
    return f"{bound[name]}{quote}{rest}" if quote and name in bound else kind


def _notebook_function(value: Any) -> ast.FunctionDef | None:
    """The syntax tree of a function the notebook defined (IPython keeps each cell's source), or None."""
    if not isinstance(value, FunctionType):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(value)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = tree.body[0] if tree.body else None
    return found if isinstance(found, ast.FunctionDef) else None
