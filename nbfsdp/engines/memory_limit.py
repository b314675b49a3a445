"""A rank's memory limit (``--memory-limit``) and what a rank that runs out of memory tells the notebook. Runs
on the ranks.

CPU ranks have the whole machine's memory, so a laptop never meets the error a GPU gives. Under a limit
their cell runs inside ``FSDPMemTracker`` (PyTorch's own accounting, the oracle the planner is held to):
every tensor an operator or FSDP2 makes is counted by category, and the one that takes the rank's total past
the limit raises ``torch.OutOfMemoryError`` worded as CUDA's, from the operator or the all-gather that
asked. The tracker instruments every operator (measured in ``docs/guide/errors.md``), so it is on only
under a limit. A GPU's limit is its allocator's (``torch.cuda.set_per_process_memory_fraction``, set at the
world's set-up by ``engine.setup``) and the error is CUDA's own.

Either way the failed rank's outcome carries its bytes by category at the failure, what it was doing and the
shapes its model was last called with (the workload the kernel's planner traces to offer fixes); its peers,
woken by the torn-down world, send their bytes where they stopped.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn

from nbfsdp.engines.metrics import MemoryMeter
from nbfsdp.engines.world import World
from nbfsdp.shared.protocol import TensorShape
from nbfsdp.shared.torch_private import limited_memory_tracker, tree_map

#: Past its limit, how long a CPU rank waits for frees under way in other threads before it runs out.
PENDING_FREE_SECONDS = 0.2


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


class RankMemory:
    """Around one cell's ``exec`` on one rank: the limit enforced (CPU), the last batch's shapes noted, and,
    if the cell fails, ``report`` says this rank's memory then."""

    def __init__(
        self,
        world: World,
        models: list[nn.Module],
        meter: MemoryMeter,
        *,
        limit: int | None,
        ranks_per_gpu: int = 1,
        on_first_call: Callable[[Any], None] | None = None,
    ) -> None:
        """``on_first_call``: the shapes of the model's first call, as soon as it is made (the kernel traces the
        step's predicted peak with them: ``nbfsdp.kernel.planning.predicted``)."""
        self.rank, self.device, self.limit, self.meter = world.rank, world.device, limit, meter
        self.ranks_per_gpu = ranks_per_gpu
        self._on_first_call = on_first_call
        self.cap = limit
        """The bytes this rank may hold: the limit, or on a GPU the allocator's cap."""
        self.models = models
        self.batch: Any = None
        self.failed: dict[str, Any] | None = None  # this rank's own out-of-memory, as it happened
        self.stopped: dict[str, int] | None = None  # any failed cell: its bytes where it stopped
        self.tracker: Any = None
        self._armed = False
        self._handles: list[Any] = []

    def __enter__(self) -> RankMemory:
        self._handles = [
            model.register_forward_pre_hook(self._note_batch, with_kwargs=True) for model in self.models[:1]
        ]
        if self.device.type == "cuda":
            self._limit_gpu()
        elif self.limit is not None and self.models:
            self.tracker = limited_memory_tracker(self.models[0], self._over_limit)
            self.tracker.__enter__()  # one dispatch mode: another model's shards count once it makes a tensor
            self._armed = True
            held = sum(self.tracker.by_category().values())
            self._over_limit(held, held, "holding the model's shards, before the cell's first operator")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is not None:
            if self.failed is None and isinstance(error, torch.OutOfMemoryError):  # CUDA's own
                self.failed = {"at_failure": self.by_category(), "doing": _asked_by(error)}
            self.stopped = self.by_category()  # a peer's failure woke this rank: its bytes where it stopped
        self._armed = False
        for handle in self._handles:
            handle.remove()
        if self.tracker is not None:
            self.tracker.__exit__(kind, error, trace)
            self.tracker = None
        if self.device.type == "cuda" and isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()  # the allocator emptied: the next cell starts from the shards alone

    def _limit_gpu(self) -> None:
        """The allocator's cap: the limit, else 1/k of the GPU where k ranks share it (one rank cannot starve
        the others), else none. Set for every cell: the next may ask another."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = min(1.0, self.limit / total) if self.limit is not None else 1.0 / self.ranks_per_gpu
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self.cap = int(fraction * total)

    # -- while the cell runs
    def _note_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The shapes of the model's last call: the batch the planner traces when this rank runs out."""
        # shapes and dtypes, not meta tensors: a tensor made here would be counted (the tracker is on)
        first = self.batch is None
        self.batch = tree_map(
            lambda t: TensorShape(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None, (args, kwargs)
        )
        if first and self._on_first_call is not None:
            self._on_first_call(self.batch)

    def _over_limit(self, asked: int, total: int, doing: str = "") -> None:
        assert self.limit is not None
        if not self._armed or total <= self.limit:
            return
        total = self._once_frees_land(total, self.limit)
        if total <= self.limit:
            return
        self._armed = False  # one error; what the unwinding allocates is not another
        doing = doing or self.tracker.doing
        self.failed = {"at_failure": self.by_category(), "doing": doing, "asked": asked}
        free = max(0, self.limit - (total - asked))
        raise torch.OutOfMemoryError(
            f"CPU out of memory. Tried to allocate {_mib(asked)}. Rank {self.rank} has a --memory-limit of "
            f"{_mib(self.limit)} of which {_mib(free)} is free. Of the limit, {_mib(total - asked)} is allocated by "
            f"tensors (nbfsdp's accounting: FSDPMemTracker). Doing: {doing}."
        )

    def _once_frees_land(self, total: int, limit: int) -> int:
        """The tracked total once the frees other threads are making have landed. gloo's worker thread drops a
        finished asynchronous all-gather's buffers moments after the rank has waited on it (the tracker hears of
        a free when the storage's last reference goes, in whichever thread): counted, they would make a rank at
        its limit run out one allocation early, or not, by chance. Waits only past the limit, and at most
        ``PENDING_FREE_SECONDS``: a rank that truly ran out reports that much later."""
        deadline = time.monotonic() + PENDING_FREE_SECONDS
        while total > limit and time.monotonic() < deadline:
            time.sleep(0.001)  # the GIL let go: a free waiting in another thread runs its tracker callback
            total = self.tracker.total(self.device)
        return total

    # -- what the kernel is told
    def by_category(self) -> dict[str, int]:
        """This rank's bytes now by the planner's categories: the tracker's (CPU, under a limit), else the
        meter's last figures with the rest of the allocator's bytes as temporaries (GPU)."""
        if self.tracker is not None:
            return self.tracker.by_category()
        figures = self.meter.read()
        known = {
            "params": figures["mem_params"],
            "grads": figures["mem_grads"],
            "optim": figures["mem_optim"],
            "activations": figures["mem_activations"],
        }
        allocated = figures.get("cuda_allocated", sum(known.values()))
        return {**known, "temporaries": max(0, allocated - sum(known.values())), "comm_buffers": 0}

    def report(self) -> dict[str, Any] | None:
        """This rank's memory at a failed cell's end, for ``CellOutcome.memory``: None where it did not fail."""
        if self.failed is not None:
            return {**self.failed, "out_of_memory": True, "limit": self.cap, "batch": self.batch}
        if self.stopped is None:
            return None
        return {"at_failure": self.stopped, "out_of_memory": False, "limit": self.cap, "batch": self.batch}


def _asked_by(error: BaseException) -> str:
    """A real CUDA out-of-memory: the innermost frame that asked, as ``function (file:line)``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "allocation"
    last = frames[-1]
    return f"{last.name} ({last.filename.rsplit('site-packages/', 1)[-1]}:{last.lineno})"
