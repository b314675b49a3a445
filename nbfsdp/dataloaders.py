"""A notebook ``DataLoader`` split across the ranks, as Accelerate's ``prepare`` and Lightning do.

Two halves, one per process. In the notebook's kernel, ``plan_split`` checks a
loader the cell reads against the world size before anything runs (a batch N
does not divide is a ``UsageError`` naming both fixes) and says in one line
what the ranks will get. On the engines, ``split`` turns the loader the cell
received into this rank's part of it, in place, keeping the user's class,
dataset, ``collate_fn``, workers, generator and every other setting.

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

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from IPython.core.error import UsageError
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from nbfsdp.torch_private import infinite_sampler, is_iterable_loader


@dataclass(kw_only=True, slots=True)
class LoaderPlan:
    """What one loader becomes on the ranks; recorded in ``last_run().config["loaders"]``."""

    mode: str
    """"split" (each batch cut across the ranks) or "per_rank" (each rank whole batches)."""
    batch_size: int
    """The notebook loader's batch size."""
    per_rank: int
    """Samples a rank takes per step."""
    steps_per_epoch: int | None
    """Steps every rank takes per epoch (None: the dataset has no length)."""
    last_batch: str
    """What happens to a last batch that does not split evenly."""
    epoch: int
    """The epoch the cell starts in (1 for a loader never iterated on the ranks)."""

    def line(self, name: str) -> str:
        steps = f", {self.steps_per_epoch} steps per epoch" if self.steps_per_epoch is not None else ""
        if self.mode == "split":
            what = f"batches of {self.batch_size} split {self.per_rank} per rank"
        else:
            what = f"whole batches of {self.batch_size} per rank ({self.per_rank} samples per rank per step)"
        last = f"; {self.last_batch}" if self.last_batch else ""
        return f"nbfsdp: {name}: {what}{steps} (epoch {self.epoch}){last}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _global_batch_size(loader: DataLoader) -> int | None:
    if loader.batch_size is not None:
        return loader.batch_size
    return getattr(loader.batch_sampler, "batch_size", None)


def _dataset_length(loader: DataLoader) -> int | None:
    try:
        return len(loader.dataset) if is_iterable_loader(loader) else len(loader.sampler)
    except TypeError:
        return None


def plan_split(name: str, loader: DataLoader, world_size: int, per_rank_batches: bool, epoch: int) -> LoaderPlan:
    """Check ``loader`` against the world size (``UsageError`` when it cannot be split) and plan its split.

    Runs in the notebook, before any engine is touched.
    """
    batch_size = _global_batch_size(loader)
    if batch_size is None:
        raise UsageError(
            f"{name}: a DataLoader with batch_size=None yields single samples, which cannot be split across "
            f"{world_size} ranks; give it a batch_size (or a batch_sampler with a batch_size attribute)"
        )
    length = _dataset_length(loader)
    drop_last = bool(loader.drop_last or getattr(loader.batch_sampler, "drop_last", False))
    full, last = divmod(length, batch_size) if length is not None else (None, 0)
    last = 0 if drop_last else last
    if per_rank_batches:
        batches = None if full is None else full + (1 if last else 0)
        steps = None if batches is None else batches // world_size
        dropped = 0 if batches is None else batches - steps * world_size
        note = f"the last {dropped} batch(es) dropped: every rank takes as many steps" if dropped else ""
        return LoaderPlan(
            mode="per_rank", batch_size=batch_size, per_rank=batch_size, steps_per_epoch=steps,
            last_batch=note, epoch=epoch,
        )  # fmt: skip
    if batch_size % world_size:
        lower = batch_size - batch_size % world_size
        raise UsageError(
            f"{name}: batch_size {batch_size} does not split across {world_size} ranks; use a batch size "
            f"{world_size} divides (e.g. {lower or world_size} or {lower + world_size}), or --per-rank-batches "
            "so that each rank takes whole batches"
        )
    steps = None if full is None else full
    note = ""
    if last:
        kept = last - last % world_size
        if kept:
            steps += 1
        if kept == 0:
            note = f"the last batch of {last} dropped (fewer samples than ranks)"
        elif kept != last:
            note = f"the last batch of {last} trimmed to {kept} ({kept // world_size} per rank)"
    return LoaderPlan(
        mode="split", batch_size=batch_size, per_rank=batch_size // world_size, steps_per_epoch=steps,
        last_batch=note, epoch=epoch,
    )  # fmt: skip


class NotebookLoaders:
    """In the notebook: what the session keeps about its loaders between cells, without holding them alive.

    Epochs begun on the ranks, so a cell's line says which epoch it starts in; and for a loader that
    shuffles from the global RNG, the generator its shuffle continues from on the ranks.
    """

    def __init__(self) -> None:
        self._epochs: weakref.WeakKeyDictionary[DataLoader, int] = weakref.WeakKeyDictionary()
        self._generators: weakref.WeakKeyDictionary[DataLoader, torch.Generator] = weakref.WeakKeyDictionary()

    def plan(self, read: dict[str, Any], world_size: int, per_rank_batches: bool) -> dict[str, LoaderPlan]:
        """A plan for each DataLoader among the names a cell reads (``UsageError`` when one cannot be split).

        A loader under two names is planned once: on the ranks too they are one object.
        """
        plans: dict[str, LoaderPlan] = {}
        seen: list[DataLoader] = []
        for name, loader in read.items():
            if isinstance(loader, DataLoader) and all(loader is not other for other in seen):
                seen.append(loader)
                plans[name] = plan_split(name, loader, world_size, per_rank_batches, self._epochs.get(loader, 0) + 1)
        return plans

    def shuffle_state(self, loader: DataLoader) -> torch.Tensor | None:
        """The state of the generator a loader without one of its own shuffles from on the ranks.

        Seeded from the notebook's global RNG when first seen, as the plain loader's shuffle would be.
        """
        if not draws_without_generator(loader):
            return None
        if loader not in self._generators:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self._generators[loader] = torch.Generator().manual_seed(seed)
        return self._generators[loader].get_state()

    def continue_after(self, loader: DataLoader, state: dict[str, Any]) -> None:
        """The loader shuffles on from where rank 0's did: the next epoch, here or in the next cell."""
        self._epochs[loader] = self._epochs.get(loader, 0) + state["epochs"]
        generators = [self._generators[loader]] if loader in self._generators else _shuffle_generators(loader)
        for generator, saved in zip(generators, state["generators"], strict=False):
            generator.set_state(saved)


def draws_without_generator(loader: DataLoader) -> bool:
    """The loader shuffles from the global RNG (a ``RandomSampler`` with no generator): the notebook gives
    it one of its own for the ranks, or each rank would shuffle from its own global RNG."""
    return (
        not is_iterable_loader(loader) and loader.generator is None and getattr(loader.sampler, "generator", 0) is None
    )


# ----------------------------------------------------------------- engine side
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

    def __init__(self, batches: Iterable[list[int]], rank: int, world_size: int, per_rank: bool, epochs: _Epochs):
        self.batches, self.rank, self.world_size, self.per_rank, self.epochs = (
            batches, rank, world_size, per_rank, epochs,
        )  # fmt: skip

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
        batches = len(self.batches)
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

    def __init__(self, dataset: IterableDataset, batch_size: int, rank: int, world_size: int, per_rank: bool):
        self.dataset, self.batch_size, self.rank, self.world_size, self.per_rank = (
            dataset, batch_size, rank, world_size, per_rank,
        )  # fmt: skip

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
        full, last = divmod(len(self.dataset), self.batch_size * (self.world_size if self.per_rank else 1))
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

    def state(self) -> dict[str, Any]:
        return {"epochs": self.epochs.started, "generators": [g.get_state() for g in self.generators]}


def _set(loader: DataLoader, attribute: str, value: Any) -> None:
    # DataLoader forbids setting these after __init__; rebuilding it instead would lose a subclass's own
    # behaviour and every setting __init__ does not take back (Lightning re-runs a saved __init__ for that)
    object.__setattr__(loader, attribute, value)


def split(
    loader: DataLoader, rank: int, world_size: int, per_rank: bool, seed_state: torch.Tensor | None
) -> SplitLoader:
    """Make ``loader`` (this rank's unpickled copy of the notebook's) give this rank's part, in place.

    ``seed_state`` is the state of a generator the notebook keeps for a loader
    that has none of its own, so that its shuffle is still one order on every
    rank, new each epoch, continuing across cells.
    """
    epochs = _Epochs()
    if is_iterable_loader(loader):  # an IterableDataset: no sampler to wrap
        batch_size = _global_batch_size(loader)
        wrapped = SplitIterable(loader.dataset, batch_size, rank, world_size, per_rank)
        size = batch_size if per_rank else batch_size // world_size
        _set(loader, "dataset", wrapped)
        _set(loader, "batch_sampler", BatchSampler(infinite_sampler(), size, drop_last=False))
        _set(loader, "batch_size", size)
        _set(loader, "drop_last", False)
        return SplitLoader(loader, epochs, [])
    if loader.generator is None and seed_state is not None:
        generator = torch.Generator()
        generator.set_state(seed_state)
        loader.generator = loader.sampler.generator = generator
    _set(loader, "batch_sampler", SplitBatchSampler(loader.batch_sampler, rank, world_size, per_rank, epochs))
    return SplitLoader(loader, epochs, _shuffle_generators(loader))


def _shuffle_generators(loader: DataLoader) -> list[torch.Generator]:
    """The generators a loader's shuffle draws from: its own, and its sampler's where that is another."""
    generators = [loader.generator] if loader.generator is not None else []
    own = getattr(loader.sampler, "generator", None)
    if isinstance(own, torch.Generator) and all(own is not g for g in generators):
        generators.append(own)
    return generators
