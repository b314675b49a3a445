"""``nbfsdp.gather``: the weights of a model that lives on the ranks (``residence``), brought into the notebook's
object on demand; ``nbfsdp.release``: the same, and the model lives in the notebook again. Runs in the kernel."""

from __future__ import annotations

import psutil
import torch
import torch.nn as nn
from IPython.core.error import UsageError

from nbfsdp.kernel.run import residence
from nbfsdp.kernel.run.session import current_session
from nbfsdp.kernel.run.spec import RunOptions
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.initializing import materialize
from nbfsdp.shared.protocol import GatherModel

#: The kernel holds a gathered model about twice while it arrives: the bytes received, and the tensors made of them.
_COPIES_WHILE_ARRIVING = 2


def gather(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Bring the weights of ``model``, which live on the ranks, into the notebook's object, in place (its
    parameters stay the same Python objects), in ``dtype`` where given; the ranks keep theirs, and ``model``
    still lives there: the next cell that uses it frees the notebook's copy again. Returns ``model``.

    Refused at once, nothing moved, when the weights would not fit the kernel's free memory."""
    session = current_session()
    name = next((key for key, value in session.shell.user_ns.items() if value is model), None)
    record = residence.of(model)
    if name is None or record is None:
        raise UsageError(
            "nbfsdp.gather: this model's weights are in the notebook already (a model lives on the ranks after "
            "nbfsdp.from_pretrained, %fsdp load into a meta model, or a cell run with --keep-on-ranks)"
        )
    if record.world is None:
        raise UsageError(f"nbfsdp.gather: {name}'s weights are not on the ranks yet: run a %%fsdp cell that uses it")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(f"dtype must be a floating-point torch dtype (torch.bfloat16 ...), got {dtype!r}")
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    needed = sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors) * _COPIES_WHILE_ARRIVING
    free = free_memory()
    if needed > free:
        raise UsageError(
            f"nbfsdp.gather: {name}'s weights need about {size_text(needed)} of the kernel's memory as they arrive, "
            f"and {size_text(free)} is free: gather them in a smaller dtype (dtype=torch.bfloat16), or save them "
            "from the ranks instead (%fsdp save DIR)"
        )
    generation, world_size = record.world
    world = session.cluster.world
    config = session.held.settings_of(name)
    if world is None or world.generation != generation or config is None:
        raise UsageError(f"nbfsdp.gather: the world of {world_size} ranks that held {name}'s weights has ended")
    request = GatherModel(model=name, dtype=str(dtype).removeprefix("torch.") if dtype is not None else None)
    session.run_cell(request, config, RunOptions(world_size=world_size, timeout=world.timeout, gather=True))
    _make_buffers(model)
    return model


def release(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Undo ``--keep-on-ranks`` (and ``nbfsdp.from_pretrained``'s residence): bring ``model``'s weights into the
    notebook's object as ``gather`` does, and let it live in the notebook again: each later cell that changes it
    brings its weights back, with the state of the optimizers over it that the cell reads. Returns ``model``."""
    gather(model, dtype)
    residence.release(model)
    return model


def free_memory() -> int:
    """The bytes the kernel's machine has free now (what a gather may take)."""
    return psutil.virtual_memory().available


def _make_buffers(model: nn.Module) -> None:
    """The buffers no state dict holds (rotary ``inv_freq``), made in the notebook as the model makes them."""
    missing = {name for name, buffer in model.named_buffers() if buffer.is_meta}
    if not missing:
        return
    everything = {name for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    with torch.random.fork_rng(devices=[]):  # materialize seeds torch: the notebook's own random state stays
        materialize(
            model, torch.device("cpu"), (0, 1), torch.initial_seed(), full=False, loaded=frozenset(everything - missing)
        )
