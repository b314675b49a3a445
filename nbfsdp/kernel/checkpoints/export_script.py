"""``%fsdp export-script PATH``: the last ``%%fsdp`` cell as a standalone script for ``torchrun``.

Graduating from the notebook: the script holds what the cell read from the notebook (the functions and
classes defined there, by their source; the modules and library objects, as imports), the process group
and the device, the exact FSDP2 code of the cell's settings (``explain --code``), the notebook's loaders
split as ``%%fsdp`` splits them, and the cell's body. It starts from the notebook's state at export time:
the values the cell reads (models with their weights, optimizers' state, loaders with their shuffle,
tensors...) are saved beside it in one file, ``PATH`` with ``.inputs.pt``, which the script loads. The
script builds each optimizer after ``fully_shard``, as a plain FSDP2 script must: ``fully_shard`` puts a new
sharded parameter (a ``DTensor``) in place of each of the model's, so an optimizer built before it holds
tensors the model no longer has. The notebook's optimizer state, keyed by parameter name
(``get_optimizer_state_dict``), is loaded into the new one with ``set_optimizer_state_dict``, which shards
it as the parameters are; an LR scheduler the cell reads is bound to the new optimizer. Run under
``torchrun --nproc-per-node N PATH`` it computes what the same cell, run again in the notebook from that
state, computes (``tests/test_export_script.py`` checks the losses). The script needs
torch and the libraries the cell's objects come from, not nbfsdp: ``nbfsdp.log`` becomes a JSON line on
each rank's standard output.

The loaders are split as ``%%fsdp`` splits them (each global batch cut into N contiguous parts, or with
``--per-rank-batches`` whole batches r, r + N, ...), not with ``DistributedSampler``, which interleaves
samples and reshuffles by a seed per epoch: the same losses need the same split. Runs in the kernel.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import datetime
import importlib
import inspect
import io
import linecache
import pickle
import pickletools
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from IPython.core.error import UsageError
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from nbfsdp.kernel.planning.plans import plan
from nbfsdp.kernel.run.history import LastCell
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.torch_private import is_iterable_loader

#: Names a cell finds on the ranks without reading them from the notebook.
_GIVEN = {"rank", "world_size", "device", "nbfsdp", "resume_step"}


@dataclass
class _Parts:
    """What the script is made of, sorted out of the notebook's namespace."""

    imports: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # a notebook definition's name -> its source
    values: dict[str, Any] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    optimizers: list[str] = field(default_factory=list)
    loaders: list[str] = field(default_factory=list)
    schedulers: dict[str, str] = field(default_factory=dict)  # a scheduler's name -> its optimizer's
    optimizer_models: dict[str, list[str]] = field(default_factory=dict)  # the models its parameters are in
    holding: dict[str, set[int]] = field(default_factory=dict)  # a value's name -> the optimizers its pickle holds


@dataclass(frozen=True)
class ExportedScript:
    """The script and its inputs, and how to run it."""

    script: Path
    inputs: Path
    command: str

    def __str__(self) -> str:
        return f"nbfsdp: wrote {self.script} and {self.inputs.name} beside it; run it with: {self.command}"


def export_script(cell: LastCell | None, namespace: dict[str, Any], path: str, shuffle_states: dict) -> ExportedScript:
    """Write ``cell`` as a torchrun script at ``path``, its inputs beside it, from ``namespace`` as it is now.
    ``shuffle_states``: the generator state each loader without one of its own shuffles from on the ranks."""
    if cell is None:
        raise UsageError("%fsdp export-script: no %%fsdp cell has run yet; it exports the last one")
    script = Path(path).expanduser().resolve()
    if script.suffix != ".py":
        raise UsageError(f"%fsdp export-script {path}: the script's name must end in .py")
    with _main_resolves(namespace):
        parts = _gather(cell, namespace)
        inputs = script.with_name(script.stem + ".inputs.pt")
        states = {name: shuffle_states.get(name) for name in parts.loaders}
        optimizers = {name: _optimizer_state(parts, name, namespace) for name in parts.optimizers}
        values = {name: _unbound(value) if name in parts.schedulers else value for name, value in parts.values.items()}
        values = {name: value for name, value in values.items() if name not in parts.optimizers}
        data = io.BytesIO()
        torch.save({"values": values, "optimizers": optimizers, "shuffle": states}, data)
    script.parent.mkdir(parents=True, exist_ok=True)
    inputs.write_bytes(data.getvalue())
    script.write_text(_render(cell, parts, inputs.name, namespace))
    command = f"torchrun --nproc-per-node {cell.world_size} {script}"
    return ExportedScript(script, inputs, command)


def _gather(cell: LastCell, namespace: dict[str, Any]) -> _Parts:
    """The names the cell needs, and the names those need in turn, each as an import, a source or a value."""
    parts, seen, todo = _Parts(), set(), [n for n in cell.reads if n not in _GIVEN]
    refused = []
    while todo:
        name = todo.pop(0)
        if name in seen or name not in namespace:
            continue  # a builtin, or a name the cell binds itself
        seen.add(name)
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            parts.imports.append(_import_module(name, value))
        elif _defined_here(value):
            source = _source_of(value, namespace)
            if source is None:
                refused.append(f"{name} (its source cannot be read)")
                continue
            parts.sources[name] = source
            todo += _globals_of(value) + _definition_names(source)
        elif (line := _import_object(name, value)) is not None:
            parts.imports.append(line)
        else:
            if isinstance(value, DataLoader) and is_iterable_loader(value):
                refused.append(f"{name} (a DataLoader over an IterableDataset: export-script splits map-style ones)")
                continue
            try:  # one pickle: whether it can be saved, and which of the notebook's definitions it needs
                found, parts.holding[name] = _notebook_globals(value)
                todo += found  # its classes (a model's modules, a loader's dataset), functions
            except Exception as error:  # an open file, a generator mid-iteration...
                refused.append(f"{name} ({type(value).__name__}: {str(error)[:120]})")
                continue
            parts.values[name] = value
            if isinstance(value, nn.Module):
                if any(p.is_meta for p in value.parameters()):
                    refused.append(f"{name} (a model on the meta device: its weights exist only on the ranks)")
                parts.models.append(name)
            elif isinstance(value, Optimizer):
                parts.optimizers.append(name)
            elif isinstance(value, DataLoader):
                parts.loaders.append(name)
    if not parts.models and not refused:
        raise UsageError("%fsdp export-script: the last %%fsdp cell reads no model of the notebook")
    refused += _bind_to_optimizers(parts, namespace)
    if refused:
        raise UsageError(f"%fsdp export-script: cannot export {'; '.join(refused)}")
    parts.sources = _in_definition_order(parts.sources)
    return parts


def _in_definition_order(sources: dict[str, str]) -> dict[str, str]:
    """The definitions, each after those its definition runs (a base, a decorator, a default, a class
    attribute, a dataclass's ``default_factory``): what a method only calls may come later, as in a file."""
    ordered: dict[str, str] = {}

    def place(name: str, visiting: frozenset[str]) -> None:
        if name in ordered or name in visiting:
            return  # placed already, or a cycle (which Python would not run either): kept as gathered
        for needed in _definition_names(sources[name]):
            if needed in sources and needed != name:
                place(needed, visiting | {name})
        ordered[name] = sources[name]

    for name in sources:
        place(name, frozenset())
    return ordered


@contextlib.contextmanager
def _main_resolves(namespace: dict[str, Any]) -> Iterator[None]:
    """Pickle finds the notebook's classes and functions as ``__main__.Name``, where the script defines them.

    Pickle saves them by reference after checking that ``sys.modules["__main__"]`` has them, which is the
    notebook's own module in a Jupyter kernel but not in every shell: the missing ones are put there for
    the save's length."""
    main = sys.modules["__main__"]
    added = [
        name
        for name, value in namespace.items()
        if _defined_here(value) and getattr(value, "__qualname__", None) == name and not hasattr(main, name)
    ]
    for name in added:
        setattr(main, name, namespace[name])
    try:
        yield
    finally:
        for name in added:
            delattr(main, name)


def _defined_here(value: Any) -> bool:
    """A function or class the notebook defined (its module is the notebook's ``__main__``)."""
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__"


def _source_of(value: Any, namespace: dict[str, Any]) -> str | None:
    """The source of a notebook function or class. ``inspect.getsource`` finds a function's through its
    code, but a class's only through its module's file, which a notebook's ``__main__`` has not. A class is
    found in a cell that defines a class of its name at the top: first the cells its methods were compiled
    from, then the notebook's input history, newest first. Generated methods (a dataclass's, a
    ``NamedTuple``'s) name no cell, and neither does a method that made a round trip through cloudpickle, so
    the history decides for them."""
    try:
        return textwrap.dedent(inspect.getsource(value))
    except (OSError, TypeError):
        if not isinstance(value, type):
            return None
    for text in _cells_for(value, namespace):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == value.__name__]
        if found:
            node = found[-1]
            lines = text.splitlines(keepends=True)
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            return textwrap.dedent("".join(lines[start : node.end_lineno]))
    return None


def _cells_for(value: type, namespace: dict[str, Any]) -> Iterator[str]:
    """The cells that may define ``value``: those its methods were compiled from (IPython keeps each cell in
    ``linecache`` with no modification time, which no file on disk has), then the input history (``_ih``,
    IPython's inputs as Python), newest first, then every cell ``linecache`` holds, newest first."""
    cells = [name for name, entry in linecache.cache.items() if len(entry) == 4 and entry[1] is None]
    methods = [code.co_filename for code in _codes(value)]
    for filename in dict.fromkeys(methods):
        if filename in cells:
            yield "".join(linecache.getlines(filename))
    yield from reversed([cell for cell in namespace.get("_ih", []) if isinstance(cell, str)])
    for filename in reversed(cells):
        yield "".join(linecache.getlines(filename))


def _codes(value: Any) -> list[types.CodeType]:
    """The code objects of a function, or of a class's methods and properties."""
    if isinstance(value, types.FunctionType):
        return [value.__code__]
    codes = []
    for member in vars(value).values():
        function = getattr(member, "__func__", member)
        for candidate in (function, getattr(member, "fget", None)):
            if isinstance(candidate, types.FunctionType):
                codes.append(candidate.__code__)
    return codes


def _globals_of(value: Any) -> list[str]:
    """The global names a notebook function or class uses: its code's, its methods', its bases'. Methods a
    library made (a ``NamedTuple``'s ``_make``) are left out: their names are the library's."""
    installed = (sys.prefix, sys.base_prefix)
    codes = [code for code in _codes(value) if not code.co_filename.startswith(installed)]
    names = [base.__name__ for base in getattr(value, "__bases__", ()) if _defined_here(base)]
    while codes:
        code = codes.pop()
        names += code.co_names
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _definition_names(source: str) -> list[str]:
    """The names a definition runs when it is defined, which its code objects do not hold: a class's bases,
    keywords and decorators and its body outside its methods (class attributes, annotations, a dataclass's
    ``field(default_factory=...)``), and a function's decorators, defaults and annotations, its methods'
    too."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ClassDef):
            parts: list[ast.AST] = [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
            for statement in node.body:
                visit(statement)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            parts = [*node.decorator_list, *arguments.defaults, *(d for d in arguments.kw_defaults if d)]
            parts += [a.annotation for a in every if a.annotation is not None]
            parts += [node.returns] if node.returns is not None else []
        else:
            parts = [node]
        names.extend(n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name) and _read(n))

    visit(ast.parse(source).body[0])
    return names


def _read(name: ast.Name) -> bool:
    return isinstance(name.ctx, ast.Load)


def _notebook_globals(value: Any) -> tuple[list[str], set[int]]:
    """The notebook's classes and functions a value's pickle refers to by name (``__main__.Name``): found in
    its pickle's GLOBAL opcodes (protocol 2 writes each as one, with its module and name); and the ``id`` of
    every other optimizer the pickle holds (a scheduler's), which the script builds anew."""
    held: set[int] = set()

    class Finder(pickle.Pickler):
        def persistent_id(self, obj: Any) -> None:
            if isinstance(obj, Optimizer) and obj is not value:
                held.add(id(obj))
            return None  # pickled as usual: this only looks

    data = io.BytesIO()
    Finder(data, protocol=2).dump(value)
    found = []
    for opcode, argument, _ in pickletools.genops(data.getvalue()):
        if opcode.name == "GLOBAL" and isinstance(argument, str) and argument.startswith("__main__ "):
            found.append(argument.split(" ", 1)[1])
    return found, held


def _bind_to_optimizers(parts: _Parts, namespace: dict[str, Any]) -> list[str]:
    """Which models each optimizer's parameters are in (``parts.optimizer_models``), and which scheduler is
    bound to which optimizer (``parts.schedulers``); what cannot follow an optimizer built anew, refused."""
    refused = []
    where = {id(p): m for m in parts.models for p in namespace[m].parameters()}
    exported = {id(namespace[name]): name for name in parts.optimizers}
    for name in parts.optimizers:
        params = [p for group in namespace[name].param_groups for p in group["params"]]
        if any(id(p) not in where for p in params):
            refused.append(f"{name} (an optimizer over parameters of no model the cell reads)")
        parts.optimizer_models[name] = list(dict.fromkeys(where[id(p)] for p in params if id(p) in where))
    for name, held in parts.holding.items():
        ours = held & exported.keys()
        if not ours or name in exported:
            continue
        value = namespace[name]
        if isinstance(value, (LRScheduler, ReduceLROnPlateau)) and ours == {id(value.optimizer)}:
            parts.schedulers[name] = exported[id(value.optimizer)]
        else:
            held_names = ", ".join(exported[i] for i in ours)
            refused.append(
                f"{name} (it holds {held_names}, which the script builds anew after fully_shard: "
                "only an LR scheduler is bound to the new one)"
            )
    return refused


def _unbound(scheduler: Any) -> Any:
    """A copy of the scheduler without its optimizer: the script binds it to the one it builds."""
    unbound = copy.copy(scheduler)
    unbound.optimizer = None
    return unbound


def _optimizer_state(parts: _Parts, name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state and settings keyed by parameter name (``get_optimizer_state_dict``'s convention),
    whole: the script's ``set_optimizer_state_dict`` shards it. One with no state yet is not touched
    (``get_optimizer_state_dict`` would make it some): its groups alone, named by hand."""
    optimizer, model = namespace[name], _state_model(parts, name, namespace)
    if optimizer.state:
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**group, "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    return {"state": {}, "param_groups": groups}


def _state_model(parts: _Parts, name: str, namespace: dict[str, Any]) -> nn.Module:
    """The module whose parameter names key the optimizer's state: its model, or its models together."""
    models = parts.optimizer_models[name]
    if len(models) == 1:
        return namespace[models[0]]
    return nn.ModuleDict({m: namespace[m] for m in models})


def _optimizer_lines(parts: _Parts, name: str, namespace: dict[str, Any]) -> list[str]:
    """The optimizer built over the sharded parameters, as the notebook built it, and its state loaded."""
    optimizer, models = namespace[name], parts.optimizer_models[name]
    lines = []
    target = models[0]
    if len(models) > 1:
        target = f"{name}_models"
        lines.append(f"{target} = torch.nn.ModuleDict({{{', '.join(f'{m!r}: {m}' for m in models)}}})")
    groups = optimizer.param_groups
    whole = [id(p) for p in namespace[models[0]].parameters()]
    if len(groups) == 1 and len(models) == 1 and [id(p) for p in groups[0]["params"]] == whole:
        params = f"{target}.parameters()"
    else:
        params = f'by_name({target}, inputs["optimizers"]["{name}"]["param_groups"])'
    lines.append(f"{name} = {_class_of(optimizer, parts)}({', '.join([params, *_settings(optimizer, name)])})")
    extra = sorted({key for group in groups for key in group} - set(optimizer.defaults) - {"params"})
    if extra and "by_name(" not in params:  # by_name copies every key of the saved groups
        lines += [
            f'for group, saved in zip({name}.param_groups, inputs["optimizers"]["{name}"]["param_groups"]):',
            f"    group.update((key, saved[key]) for key in {extra!r})  # set_optimizer_state_dict loads only a "
            "group's own keys (a scheduler's initial_lr is not one)",
        ]
    if optimizer.state:
        lines.append(
            f'set_optimizer_state_dict({target}, {name}, inputs["optimizers"]["{name}"], '
            "options=StateDictOptions(full_state_dict=True))  # sharded as the parameters are"
        )
    else:
        lines.append(f'{name}.load_state_dict(inputs["optimizers"]["{name}"])  # no state yet: its settings')
    bound = [scheduler for scheduler, on in parts.schedulers.items() if on == name]
    lines += [f"{scheduler}.optimizer = {name}  # the notebook's scheduler, on it" for scheduler in bound]
    return lines


def _class_of(optimizer: Optimizer, parts: _Parts) -> str:
    """How the script names the optimizer's class (an import it needs is added to ``parts.imports``)."""
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    if cls.__name__ in parts.sources:
        return cls.__name__
    line = _import_object(cls.__name__, cls)
    if line is not None:
        parts.imports.append(line)
        return cls.__name__
    parts.imports.append(f"import {cls.__module__}")
    return f"{cls.__module__}.{cls.__qualname__}"


def _settings(optimizer: Optimizer, name: str) -> list[str]:
    """The constructor's keyword arguments that differ from its defaults, as the optimizer's ``defaults``
    hold them; by reference to the inputs file where one is no literal (a tensor learning rate)."""
    try:
        signature = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return []
    given = {
        key: value
        for key, value in optimizer.defaults.items()
        if key in signature and key not in ("self", "params") and not _same(value, signature[key].default)
    }
    try:
        if all(ast.literal_eval(repr(value)) == value for value in given.values()):
            return [f"{key}={value!r}" for key, value in given.items()]
    except (ValueError, SyntaxError, TypeError):
        pass
    group = f'inputs["optimizers"]["{name}"]["param_groups"][0]'
    return [f"{key}={group}[{key!r}]" for key in given]


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default) and type(value) is type(default)
    except (RuntimeError, TypeError):  # a tensor against a number
        return False


def _import_module(name: str, module: types.ModuleType) -> str:
    return f"import {module.__name__}" if module.__name__ == name else f"import {module.__name__} as {name}"


def _import_object(name: str, value: Any) -> str | None:
    """``from module import object`` for a library function or class, where that gives the same object."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)) or not module or not qualname:
        return None
    if "." in qualname or module == "__main__":
        return None
    try:
        found = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        return None
    if found is not value:
        return None
    return f"from {module} import {qualname}" + ("" if qualname == name else f" as {name}")


def _render(cell: LastCell, parts: _Parts, inputs: str, namespace: dict[str, Any]) -> str:
    """The script's text."""
    device_type = cell.devices.type
    backend = "nccl" if device_type == "cuda" else "gloo"
    optimizers = [line for name in parts.optimizers for line in _optimizer_lines(parts, name, namespace)]
    lines = [
        '"""The last %%fsdp cell of a notebook, as a script: exported by nbfsdp '
        f"({datetime.datetime.now().isoformat(timespec='seconds')}).",
        "",
        f"It starts from the notebook's state at export time, saved beside it in {inputs}. Run it with",
        "",
        f"    torchrun --nproc-per-node {cell.world_size} <this file>",
        "",
        f"{cell.world_size} ranks on {'GPUs (NCCL)' if device_type == 'cuda' else 'the CPU (gloo)'}; settings: "
        f"{cell.config.sharding_strategy}, mixed precision {cell.config.mixed_precision}.",
        *(
            [
                "",
                "The cell computed in fp16, its losses scaled by nbfsdp; this script does not scale them: give its",
                "loop a torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()).",
            ]
            if cell.config.dtypes()[0] == torch.float16
            else []
        ),
        '"""',
        "",
        "import gc",
        "import json",
        "import os",
        "import sys",
        "from types import SimpleNamespace",
        "",
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.checkpoint.state_dict import (",
        "    StateDictOptions,",
        "    get_model_state_dict,",
        *(["    set_optimizer_state_dict,"] if parts.optimizers else []),
        ")",
        "from torch.utils.data import Sampler",
        *sorted(set(parts.imports) - {"import torch"}),
        "",
    ]
    if parts.sources:
        lines += [
            "",
            "# -- the notebook's definitions the cell uses",
            "",
            *[s.rstrip() + "\n\n" for s in parts.sources.values()],
        ]
    lines += [
        "",
        "# -- the process group, from torchrun's variables, and this rank's device",
        *_shared_gpu_lines(cell.devices),
        f'dist.init_process_group("{backend}")',
        "rank, world_size = dist.get_rank(), dist.get_world_size()",
    ]
    if device_type == "cuda":
        lines += [
            'local_rank = int(os.environ.get("LOCAL_RANK", rank))',
            "device = torch.device('cuda', local_rank % torch.cuda.device_count())",
            "torch.cuda.set_device(device)",
        ]
    else:
        lines.append('device = torch.device("cpu")')
    lines += [
        "",
        "# -- the notebook's values at export time",
        "here = os.path.dirname(os.path.abspath(__file__))",
        f'inputs = torch.load(os.path.join(here, "{inputs}"), weights_only=False)',
        *[f'{name} = inputs["values"]["{name}"]' for name in parts.values if name not in parts.optimizers],
    ]
    for name in parts.models:
        code = plan(namespace[name], cell.config, cell.world_size, None, cell.devices).code
        body = [line for line in code.splitlines() if line.strip()]
        lines += [
            "",
            f"# -- FSDP2 for {name}, as the cell's settings give it (%fsdp explain --code)",
            f"def shard_{name}(model):",
            *[f"    {line}" for line in body],
            "    return model",
            "",
            f"{name} = shard_{name}({name}.to(device))",
        ]
    if parts.optimizers:
        lines += _OPTIMIZERS.splitlines()
        if any("by_name(" in line for line in optimizers):
            lines += [*_BY_NAME.splitlines(), ""]
        lines += optimizers
    if parts.loaders:
        lines += ["", *_SPLIT.splitlines()]
        lines += [f'split({name}, {cell.per_rank_batches}, inputs["shuffle"]["{name}"])' for name in parts.loaders]
    lines += [
        "",
        "",
        "# -- nbfsdp.log: one JSON line per call on each rank's standard output",
        "def _log(**values):",
        '    sys.stdout.write(json.dumps({"rank": rank, **values}, default=float) + "\\n")  # one write: lines whole',
        "    sys.stdout.flush()",
        "",
        "",
        "nbfsdp = SimpleNamespace(log=_log)",
        "resume_step = 0",
        "",
        "# -- the cell",
        cell.code.rstrip(),
        "",
        "# -- the trained weights, whole, beside the script (rank 0)",
        "full = StateDictOptions(full_state_dict=True, cpu_offload=True)",
        "trained = {" + ", ".join(f'"{m}": get_model_state_dict({m}, options=full)' for m in parts.models) + "}",
        "if rank == 0:",
        '    torch.save(trained, os.path.join(here, os.path.splitext(os.path.basename(__file__))[0] + ".trained.pt"))',
        f"del {', '.join([*parts.optimizers, *parts.models])}",
        "gc.collect()  # the sharded models' last collectives freed while their group lives: gloo aborts otherwise",
        "dist.barrier()",
        "dist.destroy_process_group()",
        "",
    ]
    text = "\n".join(lines)
    ast.parse(text)  # a script that does not parse is nbfsdp's error: found here, not under torchrun
    return text


def _shared_gpu_lines(devices: Devices) -> list[str]:
    """Where ranks share a GPU: each rank's ``NCCL_HOSTID`` before the process group, as the cell's ranks
    had it (NCCL refuses two ranks of one communicator on one device unless they seem on two hosts)."""
    if not devices.shared:
        return []
    return [
        f"NCCL_HOSTS = {devices.nccl_hosts!r}  # ranks of one GPU told apart for NCCL, as in the notebook",
        'os.environ["NCCL_HOSTID"] = f"export-{NCCL_HOSTS[int(os.environ[\'RANK\'])]}"',
    ]


_OPTIMIZERS = """
# -- the optimizers, built after fully_shard, over the sharded parameters (DTensors) it put in place of the
# model's own: an optimizer built before it would hold the old, whole tensors, which the model no longer has
# (they get no gradients; its step would change nothing the model computes). The notebook's optimizer state,
# keyed by parameter name, is loaded into each, sharded as its parameters are."""

_BY_NAME = '''def by_name(model, groups):
    """The notebook optimizer's parameter groups, each parameter the model's (sharded) one of that name."""
    params = dict(model.named_parameters())
    return [{**group, "params": [params[name] for name in group["params"]]} for group in groups]'''

_SPLIT = '''
class SplitBatches(Sampler):
    """This rank's part of every batch the loader's own batch sampler gives, as %%fsdp splits them: each
    batch cut into world_size contiguous parts (trimmed to equal parts), or with per_rank whole batches
    rank, rank + world_size, ... (an incomplete last round dropped)."""

    def __init__(self, batches, per_rank):
        self.batches, self.per_rank = batches, per_rank

    def __iter__(self):
        if self.per_rank:
            round_ = []
            for batch in self.batches:
                round_.append(list(batch))
                if len(round_) == world_size:
                    yield round_[rank]
                    round_ = []
            return
        for batch in self.batches:
            each = len(batch) // world_size
            part = list(batch)[rank * each:(rank + 1) * each]
            if part:
                yield part

    def __len__(self):
        if self.per_rank:
            return len(self.batches) // world_size
        size, sampler = getattr(self.batches, "batch_size", None), getattr(self.batches, "sampler", None)
        last = len(sampler) % size if size and sampler is not None and not self.batches.drop_last else 0
        return len(self.batches) - (0 < last < world_size)  # a last batch too small to split gives none


def split(loader, per_rank, shuffle_state):
    """The loader gives this rank its part; a loader without a generator shuffles as it would have."""
    if loader.generator is None and shuffle_state is not None:
        generator = torch.Generator()
        generator.set_state(shuffle_state)
        loader.generator = loader.sampler.generator = generator
    object.__setattr__(loader, "batch_sampler", SplitBatches(loader.batch_sampler, per_rank))
'''
