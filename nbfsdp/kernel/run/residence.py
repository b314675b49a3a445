"""Where a notebook model's weights live: in the notebook's kernel, or on the ranks only.

A model lives on the ranks when the notebook holds only its skeleton (its tensors on the meta device) and the
ranks its weights: one whose weights the ranks read from a Hugging Face checkpoint themselves
(``nbfsdp.from_pretrained``, ``%fsdp load DIR`` into a meta model), or one a cell ran with ``--keep-on-ranks``.
Such a model is never gathered after a cell; ``nbfsdp.gather`` brings its weights on demand.

The record (``OnRanks``) sits on the model object itself, as its ``extra_repr``: printing the model says
where its weights are, and a copy or a new model of the same name carries its own. Runs in the kernel.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from IPython.core.error import UsageError

from nbfsdp.kernel.cluster.threads import KernelThread
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.errors import ConfigError
from nbfsdp.shared.units import check_initializable
from nbfsdp.shared.weights_files import NameMatch, full_weights_reader, match_names

_REPR = "extra_repr"  # the per-instance attribute the record takes (nn.Module.__repr__ calls it)


@dataclass(eq=False)
class OnRanks:
    """A model whose weights live on the ranks, and what would be lost with their world."""

    own_repr: str
    """What the model's class prints between its parentheses (its ``extra_repr``), kept."""
    nbytes: int
    """Its weights' size, each tie once, in the dtype the notebook's skeleton has."""
    source: str | None = None
    """The Hugging Face checkpoint directory the ranks read the weights from (again after a world that ended,
    if no cell changed them)."""
    world: tuple[int, int] | None = None
    """The world (generation, world size) that holds them; None before the first cell reads them."""
    written: bool = False
    """A cell changed them on the ranks: a world that ends loses them."""
    here: int = 0
    """Bytes of its tensors the notebook has too: a LoRA model's adapters, which come back after each cell that
    trains them (its base stays on the ranks)."""
    left_in: str | None = None
    """A move to another world that failed after the old world wrote them (``moves``): the complete checkpoint
    in shared memory the next cell over the model reads them from."""

    def __call__(self) -> str:
        """The line ``repr(model)`` shows first: where the weights are."""
        size = size_text(self.nbytes)
        if self.left_in is not None and os.path.isdir(self.left_in):
            line = (
                f"nbfsdp: weights ({size}) in {self.left_in}, where a failed move left them: the next cell reads them"
            )
        elif self.world is None:
            where = f"read by the ranks from {self.source} at the next %%fsdp cell" if self.source else "not loaded"
            line = f"nbfsdp: weights ({size}) {where}"
        else:
            ranks = f"{self.world[1]} rank{'s' if self.world[1] != 1 else ''}"
            line = f"nbfsdp: weights ({size}) on the {ranks} only, {self.history()}"
            if self.here:
                line += f"; its trained parameters ({size_text(self.here)}) here too"
            line += "; nbfsdp.gather(model) brings them here"
        return f"{line}\n{self.own_repr}" if self.own_repr else line

    def history(self) -> str:
        """How the ranks' weights came to be what they are."""
        if self.written:
            return "changed there by a cell"
        return f"as read from {self.source}" if self.source is not None else "as the notebook sent them"

    @property
    def replaceable(self) -> bool:
        """A world that ends loses nothing: the ranks can read the weights again from ``source``."""
        return self.source is not None and not self.written

    def read_from(self, source: str) -> None:
        """The ranks are to read the weights from the checkpoint ``source`` at the next cell, whatever they held."""
        self.source, self.world, self.written = source, None, False

    def held_by(self, world: tuple[int, int], *, written: bool) -> None:
        """A cell ran over the model in ``world`` (generation, size): its weights live there, changed by a cell
        once one changed them."""
        self.world = world
        self.written = self.written or written
        self.left_in = None

    def read_again(self, name: str) -> None:
        """The ranks read the weights from ``source`` again at the next cell (the world that held them ended, or
        shards them anew), and that is said."""
        print(f"nbfsdp: {name}: the ranks read its weights from {self.source} again", file=sys.stderr)
        self.world = None

    def left(self, checkpoint: str) -> None:
        """A move failed after the old world wrote the weights to ``checkpoint``: the next cell reads them there."""
        self.left_in = checkpoint

    def trained_here(self, model: nn.Module) -> None:
        """Some of the weights came back (a LoRA model's trained adapters): the notebook holds those too."""
        self.here = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


#: The directories failed moves left models' weights in (``OnRanks.left_in``), freed with the cluster.
_left_dirs: set[str] = set()


def leave_in(model: nn.Module, checkpoint: str, directory: str) -> None:
    """A move failed after the old world wrote ``model``'s state to ``checkpoint`` (in ``directory``, which this
    kernel frees at ``%fsdp stop`` or its exit): the next cell over it reads it from there."""
    mark(model).left(checkpoint)
    _left_dirs.add(directory)


def free_left(directory: str | None = None) -> list[str]:
    """Free ``directory``, or every directory, failed moves left weights in (a later move read them; ``%fsdp
    stop``, the kernel's exit); the ones freed. Every move's directory still being freed is freed first."""
    wait_for_freeing()
    freed = sorted(_left_dirs if directory is None else {directory})
    for each in freed:
        shutil.rmtree(each, ignore_errors=True)
        _left_dirs.discard(each)
    return freed


#: Moves' directories being freed behind the next cell.
_freeing: list[KernelThread] = []


def free_in_background(directory: Path) -> None:
    """Free a move's directory once the new world holds the model, while the cell runs: the pages of a 1B model's
    6.4 GiB in ``/dev/shm`` take about a second to give back. Its ``state`` goes first, its kernel note last, so
    a kernel killed meanwhile leaves a directory ``reaping.clean_stale`` still recognizes."""

    def free() -> None:
        shutil.rmtree(directory / "state", ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)

    thread = KernelThread(target=free, name="nbfsdp-free-move")
    thread.start()
    _freeing[:] = [t for t in _freeing if t.is_alive()] + [thread]


def wait_for_freeing() -> None:
    """Until every move's directory being freed is gone."""
    for thread in _freeing:
        thread.join()
    _freeing.clear()


atexit.register(free_left)


def of(model: nn.Module) -> OnRanks | None:
    """``model``'s record, when its weights live on the ranks."""
    record = model.__dict__.get(_REPR)
    return record if isinstance(record, OnRanks) else None


def wrapped_record(model: nn.Module) -> tuple[str, OnRanks] | None:
    """Of a model without a record that wraps one with (peft's ``get_peft_model`` on ``nbfsdp.from_pretrained``'s
    model), that module's name and record."""
    if of(model) is not None:
        return None
    return next(((name, record) for name, inner in model.named_modules() if (record := of(inner)) is not None), None)


def take_over(name: str, model: nn.Module, inner: str, record: OnRanks) -> None:
    """``model`` wraps ``inner``, whose weights the ranks read from its checkpoint: the wrapper now lives on the
    ranks in its place, read from the same checkpoint (a peft model's base layers under their own names, its
    adapters made there as peft makes them), and ``inner``'s record goes, so one model says where they are.
    Refused where the ranks changed ``inner``'s weights: the wrapper, a new model, would be read afresh."""
    if record.source is None or not record.replaceable:
        raise UsageError(
            f"{name} wraps {inner}, whose weights live on the ranks, changed there by a cell: the ranks would read "
            f"{name} afresh without those changes. Bring them here first (nbfsdp.gather on the model you wrapped, "
            f"before wrapping it), or wrap the model as read from its checkpoint"
        )
    del model.get_submodule(inner).__dict__[_REPR]
    mark(model, source=record.source)


def check_reads(model: nn.Module, shapes: dict[str, tuple[int, ...]], path: str | os.PathLike) -> NameMatch:
    """Refuse weights of these names and shapes that do not fit ``model``, a meta model the ranks are to read them
    into: a name only in the weights, a shape that differs, or a tensor they lack that the model cannot make
    itself; nothing is read, nothing changes."""
    match = match_names(model, shapes)
    if match.unexpected or match.differ:
        kept = NameMatch(unexpected=match.unexpected, differ=match.differ)
        raise UsageError(f"{path} does not fit {type(model).__name__}: {kept.problems()}")
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, buffer in model.named_buffers() if buffer.is_meta}  # the others its constructor made
    why = check_initializable(model, names - match.covered)
    if why:
        raise UsageError(f"{path} lacks what the model cannot make itself: {why}")
    return match


def take_over_checkpoint(name: str, model: nn.Module, inner: str, record: OnRanks) -> None:
    """``model`` wraps ``inner``, a model whose weights the ranks read from a checkpoint (peft's
    ``get_peft_model(nbfsdp.from_pretrained(...), ...)``): checked against the checkpoint under its own names (its
    adapters made as peft makes them), it lives on the ranks in ``inner``'s place (``take_over``)."""
    if record.source is not None and record.replaceable:
        try:
            with full_weights_reader(record.source) as reader:
                shapes = reader.shapes()
        except ConfigError as error:
            raise UsageError(str(error)) from None
        check_reads(model, shapes, record.source)
    take_over(name, model, inner, record)


def weights_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers, a tie once (meta tensors count by shape and dtype)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def mark(model: nn.Module, source: str | None = None) -> OnRanks:
    """Say that ``model``'s weights live on the ranks (read from ``source`` at the next cell, where given)."""
    record = of(model)
    if record is None:
        record = OnRanks(own_repr=type(model).extra_repr(model), nbytes=weights_bytes(model))
        model.__dict__[_REPR] = record
    if source is not None:
        record.read_from(source)
    return record


def release(model: nn.Module) -> None:
    """``model``, whose weights the notebook holds again (gathered), lives in the notebook from now on: no
    record, so cells gather it back as any model's."""
    del model.__dict__[_REPR]


def to_meta(model: nn.Module) -> None:
    """Free the notebook's copy of ``model``'s weights: each parameter and buffer becomes a meta tensor of its
    shape, the same Python object (``torch.utils.swap_tensors``), so the notebook's optimizers over them and
    its ties stay as they are."""
    with torch.no_grad():
        for tensor in _each_once(model):
            if tensor.is_meta:
                continue
            empty = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                tensor.grad = None
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, empty)


def fill(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``model``'s tensors (meta or real) become ``state``'s, by name, in place: the same Python objects
    (``to_meta``'s way back)."""
    with torch.no_grad():
        names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        for tensor in _each_once(model):
            name = names.get(id(tensor))
            if name is None or name not in state:
                continue  # a non-persistent buffer: the ranks hold it, the state has none
            value = state[name]
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, value)


def settle(model: nn.Module, *, world: tuple[int, int], written: bool, state: dict[str, torch.Tensor] | None) -> bool:
    """After a cell over ``model``, whose weights live on the ranks of ``world``: the record says so, and the
    notebook's copy is freed; or the notebook's skeleton takes ``state``, what came back (``nbfsdp.gather``'s
    whole model, or a LoRA model's trained adapters: the rest stays on the ranks). ``written``: the cell changed
    them. Whether the notebook's model changed form (its skeleton is then new)."""
    record = mark(model)
    record.held_by(world, written=written)
    if state is not None:
        fill(model, state)
        if any(p.is_meta for p in model.parameters()):  # some came back, the rest stays on the ranks
            record.trained_here(model)
        return True
    if not any(p.is_meta for p in model.parameters()):
        to_meta(model)
        return True
    return False


def _each_once(model: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


class MustMove(UsageError):
    """The cell needs another world, or other settings, than the one holding a model whose weights live there
    only: they must move first (``nbfsdp.kernel.checkpoints.moves``), which a user's ``%%fsdp`` cell does. The
    message is the refusal, for where they cannot."""

    def __init__(self, message: str, names: list[str], left_in: str | None = None) -> None:
        super().__init__(message)
        self.names = names
        self.left_in = left_in
        """The checkpoint a failed move left them in, to read them from (their world has ended)."""


def refuse_losing_weights(  # noqa: PLR0913 (each is one fact about the cell and the world)
    named: dict[str, Any],
    cell_models: set[str],
    reshaped: set[str],
    *,
    running: int | None,
    reusing: bool,
    world_size: int,
    replacing: Collection[str] = (),
) -> None:
    """Before a cell runs: a model whose weights live on the ranks only goes with its world. A cell that would
    replace the world holding one a cell changed (``reusing`` False: it needs another), or shard one anew
    (``reshaped``: its skeleton changed in the notebook, an attribute or a module, or the cell's settings
    differ), raises ``MustMove``: the weights move first. A cell that needs one whose world has ended is
    refused, unless a failed move left it in shared memory. One whose checkpoint the ranks can read again
    (unchanged since) is read again, and that is said. ``named``: the notebook's models the running world
    holds and the cell's (``cell_models``), by name; ``running``: the running world's generation, None when
    it is broken or absent; ``replacing``: the models the cell loads whole from a checkpoint (``%fsdp load``),
    which lose nothing."""
    moving: dict[str, str] = {}  # the models that move with this cell's world, each with its refusal
    for name, model in named.items():
        record = of(model) if isinstance(model, nn.Module) else None
        if record is None or record.world is None or name in replacing:
            continue
        holder, size = record.world
        if reusing and holder == running and name not in reshaped:
            continue  # the cell runs in the world that holds them, as they are
        if reusing and holder == running:
            if not any(p.is_meta for p in model.parameters()):
                continue  # gathered: the notebook's copy goes to the ranks with its new skeleton
            if record.replaceable:
                record.read_again(name)
                continue
            moving[name] = (
                f"{name} lives on the ranks, changed there by a cell, and since then its skeleton in the notebook (an "
                f"attribute or a module of {name}) or the cell's FSDP settings changed: the ranks would shard it "
                f"anew, without their weights. Undo the change (or run the cell with the settings before), or "
                f"bring the weights here first (nbfsdp.gather({name})), then run the cell"
            )
            continue
        if record.replaceable:
            if name in cell_models:
                record.read_again(name)
            continue
        if holder == running:
            moving[name] = (
                f"this cell needs a new world ({world_size} ranks, or other settings), which would end the "
                f"running one of {size} ranks: the only holder of {name}'s weights, changed there by a cell. "
                f"Bring them here first (nbfsdp.gather({name})) or save them (%fsdp save DIR, then %fsdp load "
                f"DIR -n {world_size}), or run the cell at --world-size {size} with the same device"
            )
            continue
        if name in cell_models and record.left_in is not None and os.path.isdir(record.left_in):
            raise MustMove(
                f"{name}'s weights lived on the ranks only, and the world of {size} ranks that held them has ended; "
                f"a move left them in {record.left_in} (%fsdp load {record.left_in} reads them)",
                [name],
                left_in=record.left_in,
            )
        if name in cell_models:
            raise UsageError(
                f"{name}'s weights lived on the ranks only, and the world of {size} ranks that held them has "
                "ended: they are lost. Read them again (nbfsdp.from_pretrained, %fsdp load DIR) or load a "
                "checkpoint, then run the cell"
            )
    if moving:
        raise MustMove(next(iter(moving.values())), list(moving))
