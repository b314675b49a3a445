"""A model built on the meta device made real, one module at a time, in any process: on the ranks
(``nbfsdp.engines.sharding``, each rank keeping its shard of each tensor), and in the kernel (the buffers a
checkpoint lacks, such as rotary ``inv_freq``, of a model whose weights live on the ranks).

What initializes a module is ``units.init_function``: the root's ``param_init_fn``, a Hugging Face model's
``_init_weights``, or the module's own ``reset_parameters``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nbfsdp.shared.torch_private import childless_copy, is_persistent_buffer, own_buffers, own_parameters, put_buffer
from nbfsdp.shared.transfer import shard_slice
from nbfsdp.shared.units import init_function


def initialized_copy(root: nn.Module, name: str, device: torch.device, seed: int) -> nn.Module:
    """``root``'s module ``name`` alone (no children), its own tensors full-size and initialized under ``seed``."""
    module = root.get_submodule(name)
    empty = lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)  # noqa: E731
    parameters: dict[str, nn.Parameter | None] = {  # None stays: reset_parameters reads it (a Linear without bias)
        key: None if p is None else nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for key, p in own_parameters(module).items()
    }
    buffers = {key: None if b is None else empty(b) for key, b in own_buffers(module).items()}
    copy = childless_copy(module, parameters, buffers)
    torch.manual_seed(seed)
    init_fn = init_function(root, name)
    assert init_fn is not None  # the kernel checked (units.check_initializable)
    init_fn(copy)
    return copy


def materialize(
    model: nn.Module,
    device: torch.device,
    shard: tuple[int, int],
    seed: int,
    *,
    full: bool,
    loaded: frozenset[str] = frozenset(),
) -> dict:
    """Fill a sharded model that was built on the meta device, one module at a time.

    Every rank initializes each module's own tensors full-size under the same
    seed (so all ranks agree), keeps its shard ``shard = (index, count)`` and
    frees the rest: the peak is one module's tensors, never the model's. With
    ``full`` the full tensors are also returned (rank 0, for sync_module_states).
    The tensors named in ``loaded`` (those a checkpoint holds, read next, or that the model has already) are
    left as they are, and a module whose tensors all are is not initialized at all.
    """
    index, count = shard
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for position, (name, module) in enumerate(model.named_modules()):
            if not own_parameters(module) and not own_buffers(module):
                continue
            prefix = f"{name}." if name else ""
            own = [key for key, t in [*own_parameters(module).items(), *own_buffers(module).items()] if t is not None]
            if all(prefix + key in loaded for key in own):
                continue
            copy = initialized_copy(model, name, device, seed + position)
            for key, param in own_parameters(module).items():
                if param is None or prefix + key in loaded:
                    continue
                whole = own_parameters(copy)[key]
                assert whole is not None  # the copy has each parameter the module has
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(shard_slice(whole, index, count))
                if full:
                    state[prefix + key] = whole.detach().cpu()
            for key, buffer in own_buffers(copy).items():
                if prefix + key in loaded:
                    continue
                put_buffer(module, key, buffer)
                if full and buffer is not None and is_persistent_buffer(module, key):
                    state[prefix + key] = buffer.cpu()
    return state
