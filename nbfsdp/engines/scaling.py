"""fp16 loss scaling on the ranks: what ``torch.amp.GradScaler`` does, for a cell's own loop, without code.

fp16's range ends at 65504 and its smallest normal number is 6e-5: gradients computed in fp16 underflow to
zero unless the loss is scaled up before backward and the gradients scaled down before the step, and a step
whose gradients overflowed is skipped (GradScaler's dynamic scale and its defaults: 2**16 at first, halved
at an overflow, doubled after 2,000 steps without one). A cell whose models compute in fp16 (``--precision
fp16``; the default on a GPU without bf16) gets this around its plain ``loss.backward(); opt.step()``:

- ``loss.backward()`` after a forward of a cell model (with gradients on) runs as ``(loss * scale).backward()``,
  and the gradients it leaves on the cell models' parameters are unscaled at once, each checked for inf/NaN.
  Code between backward and step (``clip_grad_norm_``, a logged gradient norm) sees true gradients, and
  gradients accumulated over micro-batches add true to true (those of earlier backwards are set aside
  while one runs). A GradScaler unscales only at the step, which a loop that never calls ``unscale_``
  would clip in scaled units;
- an optimizer holding a cell model's parameter steps only where no rank found inf/NaN since the last step.
  Each rank checks only its own shards, so the ranks agree by one all-reduce (MAX) of the flag before the
  first such step, and all skip or all step together: the "sharded" part, what FSDP1's ShardedGradScaler
  does (``GradScaler`` on FSDP2's DTensor gradients gets the same from DTensor's rule for its kernel);
- the scale is updated once the step is over, before the next scaled backward (or at the cell's end), so
  every optimizer of a step sees the same scale. It is kept for the world's next cells, as a GradScaler
  kept in the notebook would be.

Gradients of tensors outside the cell's models that a scaled backward reaches stay scaled: keep trainable
tensors in the model. ``torch.autograd.backward`` and ``torch.autograd.grad`` are not scaled. A loop that
brings its own GradScaler would scale twice: its ``scale()`` raises ``TWICE``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from nbfsdp.engines.metrics import Recorder
from nbfsdp.engines.sharding import ShardedModel
from nbfsdp.shared import torch_private
from nbfsdp.shared.torch_private import local_tensor, unscale_and_check_, update_scale_

if TYPE_CHECKING:
    from nbfsdp.engines.world import World

#: The error a loop's own GradScaler meets when nbfsdp scales its losses already: one line, the fix in it.
TWICE = (
    "nbfsdp already scales this cell's fp16 losses (its models compute in fp16: --precision fp16, or the default "
    "on a GPU without bf16): remove the GradScaler (plain loss.backward() and opt.step()), or run the cell with "
    "--precision bf16 or --mixed-precision FULL"
)
#: The key of every record of a cell whose losses are scaled: the scale this step's backward used.
METRIC = "grad_scale"


def computes_fp16(sharded: ShardedModel) -> bool:
    """The model's forward and backward run in fp16: fp16 parameters by its settings, or, where they keep each
    parameter as stored, a trainable parameter stored in fp16."""
    param_dtype = sharded.config.dtypes()[0]
    if param_dtype is None:
        return any(p.dtype == torch.float16 for p in sharded.module.parameters() if p.requires_grad)
    return param_dtype == torch.float16


class LossScaler:
    """The dynamic loss scale of one world's fp16 cells, and the inf/NaN found since the last step."""

    def __init__(self, device: torch.device) -> None:
        defaults = torch.amp.GradScaler(device.type)  # its defaults, read through its public getters
        self.scale = torch.full((1,), defaults.get_scale(), dtype=torch.float32, device=device)
        self._factors = (defaults.get_growth_factor(), defaults.get_backoff_factor(), defaults.get_growth_interval())
        self._growth_tracker = torch.zeros((1,), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
        """1 where a gradient this rank unscaled since the last step held inf or NaN (every rank's once agreed)."""
        self.agreed = False
        """``found_inf`` is every rank's (all-reduced) since the last scaled backward."""
        self.stepped = False
        """An optimizer of the cell's models stepped (or skipped) since the last update."""

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide these gradients by the scale in place, noting inf/NaN in ``found_inf``."""
        inverse = self.scale.double().reciprocal().float()  # as GradScaler: the reciprocal in fp64
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for grad in grads:
            local = local_tensor(grad) if isinstance(grad, DTensor) else grad
            groups[(local.device, local.dtype)].append(local)
        for (device, _), tensors in groups.items():
            found = self.found_inf if device == self.found_inf.device else self.found_inf.new_zeros(1).to(device)
            unscale_and_check_(tensors, found, inverse.to(device))
            if found is not self.found_inf:  # offloaded gradients, on the CPU beside a GPU's scale
                torch.maximum(self.found_inf, found.to(self.found_inf.device), out=self.found_inf)

    def agree(self) -> bool:
        """Whether any rank found inf/NaN since the last step: one all-reduce (MAX), once a step, on every rank."""
        if not self.agreed:
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX)
            self.agreed = True
        return bool(self.found_inf.item())

    def update(self) -> None:
        """After a step: back off where it overflowed, grow after enough clean steps; the next step starts clean."""
        if not self.stepped:
            return
        update_scale_(self.scale, self._growth_tracker, self.found_inf, *self._factors)
        self.found_inf.zero_()
        self.agreed = self.stepped = False


class ScaledLosses:
    """The hooks of one cell (a context manager around its ``exec``): its models' forwards, ``Tensor.backward``,
    every optimizer's step, and ``GradScaler.scale``, each restored at the cell's end."""

    def __init__(self, scaler: LossScaler, models: list[ShardedModel], recorder: Recorder | None) -> None:
        self._scaler = scaler
        self._models = models
        self._recorder = recorder
        self._params = [p for sharded in models for p in sharded.module.parameters()]
        self._param_ids = {id(p) for p in self._params}
        # optimizer -> (its groups, holds a cell model's parameter): weak, an optimizer's id may be another's later
        self._holds: weakref.WeakKeyDictionary[Optimizer, tuple[int, bool]] = weakref.WeakKeyDictionary()
        self._fp16: tuple[tuple[int, ...], bool] = ((), False)  # (the models' settings objects, computes fp16)
        self._forward_seen = False
        self._handles: list[Any] = []
        self._patches = contextlib.ExitStack()
        self._backward = torch.Tensor.backward
        self._their_scale = torch.amp.GradScaler.scale

    def computes_fp16(self) -> bool:
        """Any of the cell's models computes in fp16 now (settings change live: read again after a change)."""
        settings = tuple(id(sharded.config) for sharded in self._models)
        if settings != self._fp16[0]:
            self._fp16 = (settings, any(computes_fp16(sharded) for sharded in self._models))
        return self._fp16[1]

    def __enter__(self) -> ScaledLosses:
        self._handles = [sharded.module.register_forward_hook(self._after_forward) for sharded in self._models]
        self._handles += [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        scaled = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            return scaled._scaled_backward(tensor, *args, **kwargs)

        def scale(grad_scaler: torch.amp.GradScaler, outputs: Any) -> Any:
            if grad_scaler.is_enabled() and scaled.computes_fp16():
                raise RuntimeError(TWICE)
            return scaled._their_scale(grad_scaler, outputs)

        self._patches.enter_context(torch_private.replaced(torch.Tensor, "backward", backward))
        self._patches.enter_context(torch_private.replaced(torch.amp.GradScaler, "scale", scale))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._patches.close()  # Tensor.backward and GradScaler.scale restored
        for handle in self._handles:
            handle.remove()
        if kind is None:
            self._scaler.update()  # the last step's; a failed cell's world is torn down anyway

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if not self.computes_fp16():
            if self._recorder is not None:
                self._recorder.fields.pop(METRIC, None)  # switched off live: the records stop saying a scale
        elif torch.is_grad_enabled():
            self._forward_seen = True

    def _scaled_backward(
        self,
        tensor: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,  # noqa: FBT001 (Tensor.backward's signature, which callers use positionally)
        create_graph: bool = False,  # noqa: FBT001, FBT002 (Tensor.backward's signature)
        inputs: Any = None,
    ) -> None:
        """``tensor.backward(...)``: scaled where a forward of an fp16 cell model came since the last backward."""
        if not self._forward_seen:
            return self._backward(tensor, gradient, retain_graph, create_graph, inputs)
        self._forward_seen = False
        scaler = self._scaler
        scaler.update()
        scaler.agreed = False
        if self._recorder is not None:
            self._recorder.fields[METRIC] = scaler.scale  # read at each log call: this step's scale
        held = {p: p.grad for p in self._params if p.grad is not None}  # earlier micro-batches', unscaled
        for param in held:
            param.grad = None
        scale = scaler.scale.to(tensor.device)
        try:
            if gradient is None:
                self._backward(tensor * scale, None, retain_graph, create_graph, inputs)
            else:
                self._backward(tensor, gradient * scale, retain_graph, create_graph, inputs)
            scaler.unscale([p.grad for p in self._params if p.grad is not None])
        finally:
            self._forward_seen = False  # a forward recomputed in backward (checkpointing) is no new step
            for param, earlier in held.items():
                if param.grad is not None:
                    _local(earlier).add_(_local(param.grad))
                param.grad = earlier
        return None

    def _holds_cell_params(self, optimizer: Optimizer) -> bool:
        groups, holds = self._holds.get(optimizer, (-1, False))
        if groups != len(optimizer.param_groups):  # new, or a group added since
            ids = self._param_ids
            holds = any(id(p) in ids for group in optimizer.param_groups for p in group["params"])
            self._holds[optimizer] = (len(optimizer.param_groups), holds)
        return holds

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Skip the step on every rank where any found inf/NaN: no gradient, no update (nor weight decay)."""
        if not (self.computes_fp16() and self._holds_cell_params(optimizer)):
            return
        if self._scaler.agree():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self.computes_fp16() and self._holds_cell_params(optimizer):
            self._scaler.stepped = True


def scaled_losses(world: World, models: list[ShardedModel], recorder: Recorder | None) -> AbstractContextManager:
    """Around a cell's ``exec``: its losses scaled while its models compute in fp16 (nothing without models)."""
    if not models:
        return contextlib.nullcontext()
    if world.loss_scaler is None:
        world.loss_scaler = LossScaler(world.device)
    return ScaledLosses(world.loss_scaler, models, recorder)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
