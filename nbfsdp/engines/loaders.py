"""A notebook ``DataLoader`` split across the ranks: the engines' half.

``split`` turns the loader a cell received into this rank's part of it, in
place, keeping the user's class, dataset, ``collate_fn``, workers, generator
and every other setting; ``nbfsdp.kernel.run.loaders`` planned and checked the
split in the notebook before anything ran.

Two conventions:

- default (*split batches*): the loader's ``batch_size`` stays the **global**
  batch; every batch the notebook's loader would give is cut into N equal
  contiguous parts and rank r takes part r. With FSDP averaging gradients, a
  step is the same math as the plain cell whatever N is, and ``len(loader)``
  is unchanged.
- ``--per-rank-batches``: rank r takes whole batches r, r + N, r + 2N, ...
  (``N x batch_size`` samples per step, ``len / N`` steps), as Composer's and
  Lightning's samplers do.

Every rank draws the same batches from the same pickled generator state, so
the ranks agree on one shuffle without talking to each other; with a seeded
``generator=`` it is exactly the notebook loader's shuffle. Ranks must take
as many steps as each other or FSDP's collectives hang: a short last batch
that does not split evenly is trimmed to a multiple of N (dropped when
shorter than N), and in per-rank mode an incomplete last round of N batches
is dropped; the plan says which.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from nbfsdp.shared.protocol import LoaderState
from nbfsdp.shared.torch_private import infinite_sampler, is_iterable_loader


def global_batch_size(loader: DataLoader) -> int | None:
    """The global batch size: the loader's, or its batch sampler's."""
    if loader.batch_size is not None:
        return loader.batch_size
    return getattr(loader.batch_sampler, "batch_size", None)


def _share(batch: list, rank: int, world_size: int) -> list:
    """Rank's contiguous part of a global batch, trimmed so that every rank's part is the same size."""
    each = len(batch) // world_size
    return batch[rank * each : (rank + 1) * each]


class _Epochs:
    """How many epochs this rank began (a loader iterator that drew its first batch)."""

    def __init__(self) -> None:
        self.started = 0


class SplitBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s part of every batch the notebook loader's own batch sampler gives.

    Wrapping the user's batch sampler (not replacing it) keeps its shuffle, its
    generator and the order in which the generator is drawn from.
    """

    def __init__(self, batches: Iterable[list[int]], rank: int, world_size: int, *, per_rank: bool, epochs: _Epochs):
        self.batches, self.rank, self.world_size, self.per_rank, self.epochs = (
            batches,
            rank,
            world_size,
            per_rank,
            epochs,
        )

    def __iter__(self) -> Iterator[list[int]]:
        self.epochs.started += 1
        if self.per_rank:
            round_: list[list[int]] = []
            for batch in self.batches:
                round_.append(list(batch))
                if len(round_) == self.world_size:
                    yield round_[self.rank]
                    round_ = []
            return  # an incomplete last round is dropped: every rank takes as many steps
        for batch in self.batches:
            part = _share(list(batch), self.rank, self.world_size)
            if part:
                yield part

    def __len__(self) -> int:
        batches = len(self.batches)  # type: ignore[arg-type]  # one without a length: TypeError, as len(loader)
        if self.per_rank:
            return batches // self.world_size
        size = getattr(self.batches, "batch_size", None)
        sampler = getattr(self.batches, "sampler", None)
        if size and sampler is not None and not getattr(self.batches, "drop_last", False):
            last = len(sampler) % size
            if last and last < self.world_size:
                return batches - 1
        return batches


class SplitIterable(IterableDataset):
    """An ``IterableDataset`` read in full by every rank, each keeping its disjoint part.

    Items are grouped as the notebook's loader would batch them (``batch_size``
    at a time, per worker); rank r keeps part r of each group (split mode), or
    every N-th whole group (per-rank mode), so no item reaches two ranks.
    """

    def __init__(self, dataset: IterableDataset, batch_size: int, rank: int, world_size: int, *, per_rank: bool):
        self.dataset, self.batch_size, self.rank, self.world_size, self.per_rank = (
            dataset,
            batch_size,
            rank,
            world_size,
            per_rank,
        )

    def __iter__(self) -> Iterator[Any]:
        group_size = self.batch_size * (self.world_size if self.per_rank else 1)
        group: list[Any] = []
        for item in self.dataset:
            group.append(item)
            if len(group) == group_size:
                yield from self._mine(group)
                group = []
        if group and not self.per_rank:  # per-rank: an incomplete last round is dropped
            yield from _share(group, self.rank, self.world_size)

    def _mine(self, group: list[Any]) -> list[Any]:
        if self.per_rank:
            return group[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return _share(group, self.rank, self.world_size)

    def __len__(self) -> int:
        # a dataset without a length: TypeError, as len(loader) raises
        group = self.batch_size * (self.world_size if self.per_rank else 1)
        full, last = divmod(len(self.dataset), group)  # type: ignore[arg-type]
        if self.per_rank:
            return full * self.batch_size
        return full * (self.batch_size // self.world_size) + last // self.world_size


@dataclass(eq=False)
class SplitLoader:
    """A loader split on this rank, and what the notebook gets back of it after the cell."""

    loader: DataLoader
    epochs: _Epochs
    generators: list[torch.Generator]
    """The generators its shuffle draws from (the loader's, and its sampler's if another)."""

    def state(self) -> LoaderState:
        return LoaderState(epochs=self.epochs.started, generators=[g.get_state() for g in self.generators])


def set_after_init(loader: DataLoader, attribute: str, value: Any) -> None:
    # DataLoader forbids setting these after __init__; rebuilding it instead would lose a subclass's own
    # behaviour and every setting __init__ does not take back (Lightning re-runs a saved __init__ for that)
    object.__setattr__(loader, attribute, value)


def split(
    loader: DataLoader, rank: int, world_size: int, *, per_rank: bool, seed_state: torch.Tensor | None
) -> SplitLoader:
    """Make ``loader`` (this rank's unpickled copy of the notebook's) give this rank's part, in place.

    ``seed_state`` is the state of a generator the notebook keeps for a loader
    that has none of its own, so that its shuffle is still one order on every
    rank, new each epoch, continuing across cells.
    """
    epochs = _Epochs()
    if is_iterable_loader(loader):  # an IterableDataset: no sampler to wrap
        batch_size = global_batch_size(loader)
        assert isinstance(loader.dataset, IterableDataset)  # what is_iterable_loader says
        assert batch_size is not None  # the kernel's plan_split refused a loader without one
        wrapped = SplitIterable(loader.dataset, batch_size, rank, world_size, per_rank=per_rank)
        size = batch_size if per_rank else batch_size // world_size
        set_after_init(loader, "dataset", wrapped)
        set_after_init(loader, "batch_sampler", BatchSampler(infinite_sampler(), size, drop_last=False))
        set_after_init(loader, "batch_size", size)
        set_after_init(loader, "drop_last", value=False)
        return SplitLoader(loader, epochs, [])
    if loader.generator is None and seed_state is not None:
        generator = torch.Generator()
        generator.set_state(seed_state)
        # the sampler a loader makes for shuffle=True (RandomSampler) draws from its generator
        loader.generator = loader.sampler.generator = generator  # type: ignore[attr-defined]
    batches = loader.batch_sampler
    assert batches is not None  # the kernel's plan_split refused a loader without a batch size
    set_after_init(
        loader, "batch_sampler", SplitBatchSampler(batches, rank, world_size, per_rank=per_rank, epochs=epochs)
    )
    return SplitLoader(loader, epochs, shuffle_generators(loader))


def shuffle_generators(loader: DataLoader) -> list[torch.Generator]:
    """The generators a loader's shuffle draws from: its own, and its sampler's where that is another."""
    generators = [loader.generator] if loader.generator is not None else []
    own = getattr(loader.sampler, "generator", None)
    if isinstance(own, torch.Generator) and all(own is not g for g in generators):
        generators.append(own)
    return generators
