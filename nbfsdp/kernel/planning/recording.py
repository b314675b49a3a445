"""The planner's traced step as a list of events: what the model's forward and backward do on the meta device,
recorded once and replayed by ``ledger`` under as many FSDP settings as need it. Runs in the notebook's kernel.

The step runs for real on a meta copy of the model, under ``live_bytes``'s dispatch counter, with hooks on the
FSDP units; the recording keeps, in order, each change of the live bytes (activations, temporaries, unsharded
gradients) and each unit's hook (its pre-forward, post-forward, pre-backward, and the moment its gradients are
all accumulated), the live bytes at that hook beside it. What FSDP2 allocates around the units (shards,
gathers, reductions) depends on the sharding, the strategy, prefetch and the reduce dtype, none of which the
live bytes see: changing only those is a replay, not another trace (``--suggest`` tries several such changes).

A unit is named by a ``Ref``: ``(layer, rest)`` for a unit in the model's stack of identical layers (layer ``j``,
the rest of its name: ``""`` for the layer itself, ``".mlp"`` for a unit inside it), ``(-1, name)`` for any other,
so that ``stretch`` can repeat a layer's events under the next layer's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nbfsdp.kernel.planning.attention import device_attention
from nbfsdp.kernel.planning.live_bytes import LiveBytes, paused
from nbfsdp.kernel.planning.meta_autocast import meta_autocast
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.torch_private import tree_flatten, tree_map
from nbfsdp.shared.units import activation_modules, forward_order, wrap_units

#: Live bytes: activations, temporaries, unsharded gradients.
Split = tuple[int, int, int]
#: A unit: ``(layer, rest of its name)`` in the stack of identical layers, ``(-1, its name)`` elsewhere.
Ref = tuple[int, str]
#: One event: its kind first (``live``, ``where``, ``phase``, ``pre_forward``, ``post_forward``, ``pre_backward``,
#: ``reduce``, ``backward_done``), then what it carries (a ``Ref``, the live bytes at it).
Event = tuple

#: Where the optimizer's step is said to be.
ALL_UNITS: Ref = (-1, "(all units)")


def optimizer_events(peak: Split, base: Split) -> list[Event]:
    """The optimizer's step in a recording: its temporaries at their largest (``optimizer_peak``) on top of what
    backward left alive."""
    live = base[0] + peak[0], base[1] + peak[1], base[2] + peak[2]
    return [("phase", "optimizer step"), ("where", ALL_UNITS), ("live", *live)]


def ref_by_name(stack: str | None) -> Callable[[str], Ref]:
    """The ``Ref`` of a unit by its name: layer ``j`` of ``stack`` (its path, e.g. ``model.layers``) and the rest
    of the name, or ``(-1, name)``."""
    prefix = f"{stack}." if stack else None

    def ref(name: str) -> Ref:
        if prefix is not None and name.startswith(prefix):
            index, _, rest = name[len(prefix) :].partition(".")
            if index.isdigit():
                return int(index), f".{rest}" if rest else ""
        return -1, name

    return ref


@dataclass(frozen=True, slots=True)
class Recording:
    """A traced forward and backward: its events, and the live bytes once backward is done."""

    events: list[Event]
    end: Split


class Recorder:
    """Runs one rank's forward and backward of ``model`` (a meta copy it may change: hooks, dtypes, checkpoints)
    and records what happens."""

    def __init__(
        self,
        model: nn.Module,
        config: FSDPConfig,
        devices: Devices,
        autocast: torch.dtype | None,
        ref: Callable[[str], Ref],
    ) -> None:
        self.model, self.devices, self.autocast = model, devices, autocast
        self.param_dtype = config.dtypes()[0]
        units = wrap_units(model, config)
        ordered = forward_order(model, units)
        names = {id(m): n for n, m in model.named_modules()}
        owner: dict[int, nn.Module] = {}
        for unit in reversed(ordered):  # the deepest unit takes a parameter first
            for param in unit.parameters():
                owner.setdefault(id(param), unit)
        unique = list({id(p): p for p in model.parameters()}.values())
        self.units = [
            (module, ref(names[id(module)]), [p for p in unique if owner[id(p)] is module and p.requires_grad])
            for module in ordered
        ]
        for module in activation_modules(model, units, config):
            checkpoint(module, autocast, devices.type)
        with torch.no_grad():  # the model computes in param_dtype: FSDP2 casts what it gathers (None: as stored)
            for param in unique:
                if param.is_floating_point() and self.param_dtype is not None:
                    param.data = param.data.to(self.param_dtype)
        self.events: list[Event] = []
        self.phase = "forward"
        self._last: Split = (0, 0, 0)
        self.live = LiveBytes(self._changed)
        self.live.hold([*unique, *model.buffers()])

    def split(self) -> Split:
        live = self.live.split()
        return live["activations"], live["temporaries"], live["grads"]

    def _changed(self) -> None:
        """After each operator: its live bytes, where they changed (where they did not, nothing can peak)."""
        split = self.split()
        if split != self._last:
            self._last = split
            self.events.append(("live", *split))

    def _at_hook(self, kind: str, ref: Ref) -> None:
        split = self._last = self.split()
        self.events.append((kind, ref, split))

    def _hooks(self) -> Iterator[Any]:
        for module, ref, params in self.units:

            def pre_forward(module, args, kwargs, ref=ref):
                if self.phase == "backward":  # a checkpointed unit recomputing (gathered for its backward)
                    self.events.append(("where", ref))
                    self.live.kind = "activations"  # what it makes now is what its backward reads
                    return None
                self._at_hook("pre_forward", ref)
                if module is self.model and self.param_dtype is not None:  # FSDP2's root casts floating inputs
                    cast = lambda t: t.to(self.param_dtype) if torch.is_floating_point(t) else t  # noqa: E731
                    return tree_map(lambda v: cast(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
                return None

            def post_forward(module, args, kwargs, output, ref=ref):
                if self.phase == "backward":
                    self.live.kind = "temporaries"
                    return None
                self.events.append(("post_forward", ref))
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads, ref=ref: pre_backward(ref), mode="any"
                    )
                return None

            def pre_backward(ref: Ref) -> None:
                self.phase = "backward"
                self._at_hook("pre_backward", ref)

            reduced = [0]

            def accumulated(param: torch.Tensor, ref=ref, params=params, reduced=reduced) -> None:
                assert param.grad is not None  # autograd has just accumulated it
                self.live.reclassify(param.grad, "grads")
                reduced[0] += 1
                if reduced[0] == len(params):  # the unit's gradients are all here: FSDP2 reduce-scatters them
                    reduced[0] = 0
                    self.live.kind = "temporaries"  # a recompute that stopped early leaves it set
                    before = self.split()
                    for each in params:
                        each.grad = None  # copied into the reduce-scatter's input, then freed
                    self._last = self.split()
                    self.events.append(("reduce", ref, before, self._last))

            yield module.register_forward_pre_hook(pre_forward, with_kwargs=True)
            yield module.register_forward_hook(post_forward, with_kwargs=True)
            for param in params:
                yield param.register_post_accumulate_grad_hook(accumulated)

    def run(self, args: tuple, kwargs: dict, loss_of: Callable[[Any], torch.Tensor]) -> Recording:
        """Forward and backward of one micro-batch; the recording of what they did."""
        handles = list(self._hooks())
        try:
            with self.live, device_attention(on_gpu=self.devices.type == "cuda", autocast=self.autocast):
                for tensor in tree_flatten((args, kwargs))[0]:
                    if isinstance(tensor, torch.Tensor):
                        self.live.count(tensor, "activations")
                with meta_autocast(self.autocast, self.devices.type):
                    output = self.model(*args, **kwargs)
                    loss = loss_of(output)
                del output
                self.live.kind = "temporaries"
                loss.backward()
                del loss
                self.events.append(("backward_done",))
        finally:
            for handle in handles:
                handle.remove()
        return Recording(self.events, self.split())


def optimizer_peak(shapes: list[tuple[int, ...]], *, foreach: bool) -> Split:
    """AdamW's step on fp32 shards of ``shapes`` (foreach on a GPU, as PyTorch picks there): the live bytes of its
    temporaries at their largest. Its state, made by a first step, and the shards are the ledger's."""
    largest: list[Split] = [(0, 0, 0)]

    def changed() -> None:
        split = _split(live)
        if sum(split) > sum(largest[0]):
            largest[0] = split

    live = LiveBytes(changed, kind="temporaries")
    with live:
        with paused(live):  # the shards, their gradients and the state are the ledger's already
            shards = []
            for shape in shapes:
                shard = torch.empty(shape, device="meta", dtype=torch.float32, requires_grad=True)
                shard.grad = torch.empty_like(shard)
                shards.append(shard)
            optimizer = torch.optim.AdamW(shards, lr=1e-3, foreach=foreach)
            optimizer.step()  # the first step makes the state
        state = [t for per_param in optimizer.state.values() for t in per_param.values() if isinstance(t, torch.Tensor)]
        live.hold([*shards, *(s.grad for s in shards if s.grad is not None), *state])  # every grad is set
        optimizer.step()
    return largest[0]


def _split(live: LiveBytes) -> Split:
    split = live.split()
    return split["activations"], split["temporaries"], split["grads"]


def checkpoint(module: nn.Module, autocast: torch.dtype | None, device: str) -> None:
    """Activation checkpointing as the ranks apply it; under autocast its recomputation casts as the forward
    did (``torch.utils.checkpoint`` restores autocast's state for it), in autograd's thread."""
    from nbfsdp.shared.torch_private import checkpoint as checkpoint_module

    if autocast is None:
        checkpoint_module(module)
    else:
        checkpoint_module(module, context_fn=lambda: (contextlib.nullcontext(), meta_autocast(autocast, device)))
