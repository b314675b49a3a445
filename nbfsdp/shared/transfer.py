"""Names between the notebook and the engines, and shard-only model transfer.

The notebook sends every rank one pickle of the names a cell reads. In it each
model (an ``nn.Module`` with parameters) is only a reference; the model itself
travels as a *skeleton* (the module pickled with its tensors replaced by their
shape and dtype) plus that rank's dim-0 chunk of every parameter, which is the
exact slice FSDP2's ``fully_shard`` keeps on that rank. No rank ever receives a
whole copy of a model's parameters; the chunks travel as bytes in bounded
pieces (``nbfsdp.kernel.run.delivery``).

Pickling is cloudpickle's (classes and functions defined in the notebook go by
value, importable modules by reference, so engines import them again); the
references are pickle's own ``persistent_id`` / ``persistent_load`` protocol.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import io
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import torch
import torch.nn as nn

from nbfsdp.shared import torch_private
from nbfsdp.shared.cloudpickle_private import OwnDefinitions

#: Names every cell gets on the engines; never sent, never brought back.
INJECTED_NAMES = frozenset({"rank", "world_size", "device", "nbfsdp"})


# --------------------------------------------------------------------- analysis
class _TopLevelStores(ast.NodeVisitor):
    """Names a statement binds in the module scope (not inside defs or lambdas)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.names.append(node.id)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.names.append(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.names.append(node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass

    def visit_alias(self, node: ast.alias) -> None:
        if node.name != "*":
            self.names.append(node.asname or node.name.split(".")[0])

    def _skip_scope(self, node: ast.AST) -> None:
        pass

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _skip_scope


def analyze_cell(tree: ast.Module) -> tuple[list[str], list[str]]:
    """(names the cell reads before binding them, names it binds at top level).

    A name the cell assigns before it ever reads it does not need the
    notebook's value, so it is not sent.
    """
    reads: list[str] = []
    stores: list[str] = []
    bound: set[str] = set()
    for statement in tree.body:
        for node in ast.walk(statement):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Load, ast.Del))):
                continue  # not a read
            if node.id not in bound and node.id not in reads:
                reads.append(node.id)
        visitor = _TopLevelStores()
        visitor.visit(statement)
        for name in visitor.names:
            bound.add(name)
            if name not in stores:
                stores.append(name)
    return (
        [n for n in reads if n not in INJECTED_NAMES],
        [n for n in stores if n not in INJECTED_NAMES],
    )


# --------------------------------------------------------------- notebook side
def is_model(value: Any) -> bool:
    """A notebook value that is sharded rather than pickled."""
    return isinstance(value, nn.Module) and any(True for _ in value.parameters())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _ReferencingPickler(cloudpickle.Pickler):
    """cloudpickle that writes chosen objects as references (by ``id``)."""

    def __init__(self, file: Any, references: dict[int, tuple]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._references = references

    def persistent_id(self, obj: Any) -> tuple | None:
        return self._references.get(id(obj))


def _dumps(obj: Any, references: dict[int, tuple]) -> bytes:
    buffer = io.BytesIO()
    _ReferencingPickler(buffer, references).dump(obj)
    return buffer.getvalue()


class _ByteCounter:
    """A file that keeps only how many bytes were written to it."""

    def __init__(self) -> None:
        self.count = 0

    def write(self, data: bytes | pickle.PickleBuffer) -> int:
        size = memoryview(data).nbytes  # a large tensor's bytes arrive as one PickleBuffer, which has no len()
        self.count += size
        return size


def pickled_size(value: Any, models: dict[str, nn.Module]) -> int:
    """Bytes ``value`` adds to a cell's payload, measured without keeping a second copy of it."""
    counter = _ByteCounter()
    _ReferencingPickler(counter, model_references(models)).dump(value)
    return counter.count


def model_skeleton(model: nn.Module) -> bytes:
    """The model pickled without tensor data: each tensor becomes shape + dtype; but a model built on the meta
    device keeps the buffers its constructor made real (``sharding.shard_model`` keeps them on the ranks)."""
    references: dict[int, tuple] = {}
    for fqn, param in model.named_parameters():
        references[id(param)] = ("meta_param", fqn, tuple(param.shape), _dtype_name(param.dtype), param.requires_grad)
    on_meta = any(p.is_meta for p in model.parameters())
    for fqn, buffer in model.named_buffers():
        if on_meta and not buffer.is_meta:
            continue  # made by a meta-built model's constructor (rotary inv_freq): small, and its ranks need it
        references[id(buffer)] = ("meta_buffer", fqn, tuple(buffer.shape), _dtype_name(buffer.dtype))
    # an extra_repr of the object's own is the notebook's note on where its weights live
    # (nbfsdp.kernel.run.residence), not part of the model: the ranks get the class's
    note = model.__dict__.pop("extra_repr", None)
    try:
        return _dumps(model, references)
    finally:
        if note is not None:
            model.__dict__["extra_repr"] = note


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of their shapes (ties kept), for the
    kernel to trace. Made by ``copy.deepcopy``, not through the skeleton's pickle: unpickling cloudpickle's
    copy of a notebook class in the process that defined it updates that class in place, and its methods
    would lose their source (``inspect``, tracebacks)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def piece_bytes(shard_bytes: int) -> int:
    """Bytes of shard data per message: about 1/32 of a rank's shard, between 1 and 16 MiB.

    A rank holds its shards plus the last few pieces it received (measured: about
    four, as the allocator keeps freed receive buffers), so small pieces keep its
    peak near its shard; bigger ones for big shards save round trips.
    """
    return min(16 * 2**20, max(2**20, shard_bytes // 32))


#: What a rank allocates for one model before its pieces arrive: (fqn, shape, dtype) per tensor.
TensorLayout = list[tuple[str, tuple[int, ...], str]]
#: Where a piece goes: (model name, fqn, first byte in that tensor).
PieceKey = tuple[str, str, int]


def shard_slice(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """FSDP2's dim-0 chunk ``index`` of ``count`` (empty when dim 0 < count)."""
    chunks = torch.chunk(tensor, count, dim=0)
    return chunks[index] if index < len(chunks) else tensor.new_empty((0, *tensor.shape[1:]))


def rank_tensors(model: nn.Module, index: int, count: int) -> dict[str, torch.Tensor]:
    """What rank ``index`` of ``count`` receives of a model: each parameter's dim-0 chunk (a view, no
    copy), each buffer whole. ``count`` is the mesh's shard degree: the world size, or fewer ranks per
    replica with NO_SHARD (1) and HYBRID_SHARD."""
    tensors = {fqn: shard_slice(p.detach(), index, count) for fqn, p in model.named_parameters()}
    tensors.update((fqn, b.detach()) for fqn, b in model.named_buffers())
    return tensors


def layout(tensors: dict[str, torch.Tensor]) -> TensorLayout:
    return [(fqn, tuple(t.shape), _dtype_name(t.dtype)) for fqn, t in tensors.items()]


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as flat uint8: a view of a contiguous CPU tensor, else one copy of it.

    A numpy array travels as its own zero-copy zmq frame under ipyparallel, where a
    pickled tensor would first be copied into bytes (numpy has no bfloat16: bytes do).
    """
    flat = tensor.detach().cpu().contiguous().view(-1)
    return flat.view(torch.uint8).numpy()


def pieces(tensors: dict[str, dict[str, torch.Tensor]], limit: int) -> Iterator[list]:
    """Messages of ``limit`` bytes of tensor data (the last one less), as lists of ``(PieceKey, bytes)``.

    A tensor may span several messages. Lazy, so a tensor that must be copied
    (not contiguous, or on a GPU) is copied only while its own pieces travel.
    """
    batch: list[tuple[PieceKey, np.ndarray]] = []
    size = 0
    for name, by_fqn in tensors.items():
        for fqn, tensor in by_fqn.items():
            if tensor.numel() == 0:
                continue
            data = _as_bytes(tensor)
            start = 0
            while start < data.nbytes:
                part = data[start : start + limit - size]
                batch.append(((name, fqn, start), part))
                size += part.nbytes
                start += part.nbytes
                if size == limit:
                    yield batch
                    batch, size = [], 0
    if batch:
        yield batch


def model_fingerprint(model: nn.Module, skeleton: bytes) -> tuple:
    """Changes whenever the notebook's model changes: structure, tensors, or values.

    ``Tensor._version`` counts in-place writes, so training in the notebook or
    loading weights is noticed without reading any tensor data.
    """
    tensors = [*model.parameters(), *model.buffers()]
    return (
        id(model),
        tuple((id(t), torch_private.version(t)) for t in tensors),
        hashlib.blake2b(skeleton, digest_size=16).hexdigest(),
    )


def tied_as(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each of ``model``'s tied parameters as one Parameter under all its names.

    The gathered state holds a copy per name, and ``load_state_dict(assign=True)``
    (a meta-built model) would set each name its own: GPT-2's ``lm_head`` would
    come back untied from ``transformer.wte``. One shared Parameter keeps them tied.
    """
    names_of: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(fqn)
    tied = dict(state)
    for fqns in names_of.values():
        if len(fqns) > 1 and fqns[0] in state:
            tied.update(dict.fromkeys(fqns, nn.Parameter(state[fqns[0]])))
    return tied


class UnpicklableName(Exception):
    """A name the cell reads cannot be sent to the engines."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"cannot send {name!r} to the engines: {reason}")
        self.name = name


def pack_values(values: dict[str, Any], models: dict[str, nn.Module]) -> bytes:
    """Pickle the cell's inputs with each model, submodule and model tensor as a reference."""
    references = model_references(models)
    try:
        return _dumps(values, references)
    except Exception:
        for name, value in values.items():  # find which name broke, to say so
            try:
                _dumps(value, references)
            except Exception as error:
                raise UnpicklableName(name, f"{type(error).__name__}: {error}") from None
        raise


# ----------------------------------------------------------------- engine side
class _SkeletonUnpickler(pickle.Unpickler):
    """Rebuilds a skeleton with every tensor on the meta device (no memory)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors: dict[str, torch.Tensor] = {}  # tied weights stay tied

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        kind, fqn, shape, dtype, *rest = pid
        if fqn not in self._tensors:
            empty = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            self._tensors[fqn] = nn.Parameter(empty, requires_grad=rest[0]) if kind == "meta_param" else empty
        return self._tensors[fqn]


def allocate(tensors: TensorLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """Storage for a rank's shards, filled by ``write_piece`` and then adopted by FSDP2 as it is."""
    return {fqn: torch.empty(shape, dtype=getattr(torch, dtype), device=device) for fqn, shape, dtype in tensors}


def write_piece(target: torch.Tensor, start: int, data: np.ndarray) -> None:
    """Copy received bytes into ``target`` from byte ``start`` (the frame itself is read-only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only numpy; it is only read
        source = torch.from_numpy(data)
    target.view(-1).view(torch.uint8)[start : start + source.numel()].copy_(source)


def load_skeleton(data: bytes) -> nn.Module:
    return _SkeletonUnpickler(data).load()


def _model_part(models: dict[str, nn.Module], kind: str, name: str, path: str) -> Any:
    """What a ``model_references`` reference stands for, in ``models``."""
    model = models[name]
    if kind == "module":
        return model.get_submodule(path)
    if kind == "parameter":
        return model.get_parameter(path)
    return model.get_buffer(path)


class _ValuesUnpickler(pickle.Unpickler):
    """Resolves model references to the engine's sharded models."""

    def __init__(self, data: bytes, models: dict[str, nn.Module]) -> None:
        super().__init__(io.BytesIO(data))
        self._models = models

    def persistent_load(self, pid: tuple) -> Any:
        return _model_part(self._models, *pid)


def unpack_values(data: bytes, models: dict[str, nn.Module]) -> dict[str, Any]:
    return _ValuesUnpickler(data, models).load()


class HoldsDTensor(Exception):
    """Raised while pickling an object that holds a sharded tensor."""


class _ResultPickler(_ReferencingPickler):
    """The referencing pickler, refusing any sharded tensor it does not write as a reference.

    References stand for what the notebook has its own copy of: the cell's sharded
    models' parameters, buffers and modules, the notebook's own optimizers and
    schedulers, a gathered tensor for a sharded optimizer state.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.distributed.tensor.DTensor):
            raise HoldsDTensor
        return super().reducer_override(obj)


def pickle_result(value: Any, references: dict[int, tuple] | None = None) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # a loss the cell assigned carries FSDP's backward hooks; torch says it drops them, which is the point
        warnings.filterwarnings("ignore", message="backward hook .* will not be serialized", category=UserWarning)
        _ResultPickler(buffer, references or {}).dump(value)
    return buffer.getvalue()


def model_references(models: dict[str, nn.Module]) -> dict[int, tuple]:
    """Each model's modules, parameters and buffers as references (by ``id``), resolved by name and path
    on the other side: the notebook's models there are the ranks' sharded ones, and the other way round."""
    references: dict[int, tuple] = {}
    for name, model in models.items():
        for qualname, module in model.named_modules():
            references[id(module)] = ("module", name, qualname)
        for fqn, param in model.named_parameters():
            references[id(param)] = ("parameter", name, fqn)
        for fqn, buffer in model.named_buffers():
            references[id(buffer)] = ("buffer", name, fqn)
    return references


class _ResultUnpickler(pickle.Unpickler):
    """In the notebook: references resolve to the notebook's own models and objects, and the notebook's
    classes and functions stay its own (``cloudpickle_private.OwnDefinitions``): a value from the ranks
    never rewrites what the notebook defined."""

    def __init__(
        self, data: bytes, models: dict[str, nn.Module], objects: dict[str, Any], namespace: dict[str, Any]
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._models, self._objects = models, objects
        self._own = OwnDefinitions(namespace)

    def find_class(self, module: str, name: str) -> Any:
        return self._own.reconstructor(super().find_class(module, name))

    def persistent_load(self, pid: tuple) -> Any:
        kind, *rest = pid
        if kind == "whole":
            return rest[0]
        if kind == "object":
            return self._objects[rest[0]]
        return _model_part(self._models, kind, *rest)


def load_result(data: bytes, models: dict[str, nn.Module], objects: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """A value rank 0 sent back, bound to the notebook's own models, to ``objects`` (by name), and to the
    classes and functions the notebook (``namespace``) defined."""
    return _ResultUnpickler(data, models, objects, namespace).load()
