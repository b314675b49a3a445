"""``%fsdp export-script PATH``: the last ``%%fsdp`` cell as a standalone script for ``torchrun``.

Graduating from the notebook: the script holds what the cell read from the notebook (the functions and
classes defined there, by their source; the modules and library objects, as imports), the process group
and the device, the exact FSDP2 code of the cell's settings (``explain --code``), the notebook's loaders
split as ``%%fsdp`` splits them, and the cell's body. It starts from the notebook's state at export time:
the values the cell reads (models with their weights, optimizers with their state, loaders with their
shuffle, tensors...) are saved beside it in one file, ``PATH`` with ``.inputs.pt``, which the script
loads. Run under ``torchrun --nproc-per-node N PATH`` it computes what the same cell, run again in the
notebook from that state, computes (``tests/test_export_script.py`` checks the losses). The script needs
torch and the libraries the cell's objects come from, not nbfsdp: ``nbfsdp.log`` becomes a JSON line on
each rank's standard output.

The loaders are split as ``%%fsdp`` splits them (each global batch cut into N contiguous parts, or with
``--per-rank-batches`` whole batches r, r + N, ...), not with ``DistributedSampler``, which interleaves
samples and reshuffles by a seed per epoch: the same losses need the same split. Runs in the kernel.
"""

from __future__ import annotations

import ast
import contextlib
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
from torch.optim import Optimizer
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
        data = io.BytesIO()
        torch.save({"values": parts.values, "shuffle": states}, data)
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
                todo += _notebook_globals(value)  # its classes (a model's modules, a loader's dataset), functions
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
    if refused:
        raise UsageError(f"%fsdp export-script: cannot export {'; '.join(refused)}")
    if not parts.models:
        raise UsageError("%fsdp export-script: the last %%fsdp cell reads no model of the notebook")
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


def _notebook_globals(value: Any) -> list[str]:
    """The notebook's classes and functions a value's pickle refers to by name (``__main__.Name``): found in
    its pickle's GLOBAL opcodes (protocol 2 writes each as one, with its module and name)."""
    found = []
    for opcode, argument, _ in pickletools.genops(pickle.dumps(value, protocol=2)):
        if opcode.name == "GLOBAL" and isinstance(argument, str) and argument.startswith("__main__ "):
            found.append(argument.split(" ", 1)[1])
    return found


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
        "import collections",
        "import gc",
        "import json",
        "import os",
        "import sys",
        "from types import SimpleNamespace",
        "",
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict",
        "from torch.distributed.tensor import distribute_tensor",
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
        *[f'{name} = inputs["values"]["{name}"]' for name in parts.values],
    ]
    if parts.optimizers:
        lines.append("parameter_names = {" + ", ".join(
            f'**{{id(p): ("{m}", n) for n, p in {m}.named_parameters()}}' for m in parts.models
        ) + "}  # before sharding: the optimizers' parameters are these")  # fmt: skip
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
        lines += ["", "MODELS = {" + ", ".join(f'"{m}": {m}' for m in parts.models) + "}", *_REPOINT.splitlines()]
        lines += [f"repoint({name})" for name in parts.optimizers]
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


_REPOINT = '''
def repoint(optimizer):
    """The optimizer built over the whole parameters, over their shards now; its state sharded as they are."""
    sharded = {name: dict(model.named_parameters()) for name, model in MODELS.items()}
    state = collections.defaultdict(dict)
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            model, name = parameter_names[id(p)]
            shard = sharded[model][name]
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape:  # a whole tensor of the parameter's shape
                    value = distribute_tensor(value.to(device), shard.device_mesh, shard.placements)
                state[shard][key] = value
            params.append(shard)
        group["params"] = params
    optimizer.state = state
'''

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
        return len(self.batches) // world_size if self.per_rank else len(self.batches)


def split(loader, per_rank, shuffle_state):
    """The loader gives this rank its part; a loader without a generator shuffles as it would have."""
    if loader.generator is None and shuffle_state is not None:
        generator = torch.Generator()
        generator.set_state(shuffle_state)
        loader.generator = loader.sampler.generator = generator
    object.__setattr__(loader, "batch_sampler", SplitBatches(loader.batch_sampler, per_rank))
'''
