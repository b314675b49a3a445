"""A notebook ``DataLoader`` split across the ranks, as Accelerate's ``prepare`` and Lightning do: the kernel's half.

``plan_split`` checks a loader the cell reads against the world size before
anything runs (a batch N does not divide is a ``UsageError`` naming both
fixes) and says in one line what the ranks will get. On the engines,
``nbfsdp.engines.loaders.split`` turns the loader the cell received into this
rank's part of it, in place, keeping the user's class, dataset,
``collate_fn``, workers, generator and every other setting.

The two conventions (split batches, ``--per-rank-batches``) and what keeps the ranks in step are
said in ``nbfsdp.engines.loaders``, which carries them out.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch
from IPython.core.error import UsageError
from torch.utils.data import DataLoader

from nbfsdp.engines.loaders import global_batch_size, shuffle_generators
from nbfsdp.shared.protocol import LoaderState
from nbfsdp.shared.torch_private import is_iterable_loader


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


def _dataset_length(loader: DataLoader) -> int | None:
    try:
        # a dataset or sampler without a length raises TypeError (torch types them as maybe unsized)
        return len(loader.dataset) if is_iterable_loader(loader) else len(loader.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None


def plan_split(name: str, loader: DataLoader, world_size: int, *, per_rank_batches: bool, epoch: int) -> LoaderPlan:
    """Check ``loader`` against the world size (``UsageError`` when it cannot be split) and plan its split.

    Runs in the notebook, before any engine is touched.
    """
    batch_size = global_batch_size(loader)
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
        dropped = 0 if batches is None else batches % world_size
        note = f"the last {dropped} batch(es) dropped: every rank takes as many steps" if dropped else ""
        return LoaderPlan(
            mode="per_rank",
            batch_size=batch_size,
            per_rank=batch_size,
            steps_per_epoch=steps,
            last_batch=note,
            epoch=epoch,
        )
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
            assert steps is not None  # a last batch: the length is known
            steps += 1
        if kept == 0:
            note = f"the last batch of {last} dropped (fewer samples than ranks)"
        elif kept != last:
            note = f"the last batch of {last} trimmed to {kept} ({kept // world_size} per rank)"
    return LoaderPlan(
        mode="split",
        batch_size=batch_size,
        per_rank=batch_size // world_size,
        steps_per_epoch=steps,
        last_batch=note,
        epoch=epoch,
    )


class NotebookLoaders:
    """In the notebook: what the session keeps about its loaders between cells, without holding them alive.

    Epochs begun on the ranks, so a cell's line says which epoch it starts in; and for a loader that
    shuffles from the global RNG, the generator its shuffle continues from on the ranks.
    """

    def __init__(self) -> None:
        self._epochs: weakref.WeakKeyDictionary[DataLoader, int] = weakref.WeakKeyDictionary()
        self._generators: weakref.WeakKeyDictionary[DataLoader, torch.Generator] = weakref.WeakKeyDictionary()

    def plan(self, read: dict[str, Any], world_size: int, *, per_rank_batches: bool) -> dict[str, LoaderPlan]:
        """A plan for each DataLoader among the names a cell reads (``UsageError`` when one cannot be split).

        A loader under two names is planned once: on the ranks too they are one object.
        """
        plans: dict[str, LoaderPlan] = {}
        seen: list[DataLoader] = []
        for name, loader in read.items():
            if isinstance(loader, DataLoader) and all(loader is not other for other in seen):
                seen.append(loader)
                epoch = self._epochs.get(loader, 0) + 1
                plans[name] = plan_split(name, loader, world_size, per_rank_batches=per_rank_batches, epoch=epoch)
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

    def shuffle_states(self, namespace: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor | None]:
        """``shuffle_state`` of each of ``names`` that is a DataLoader in ``namespace``."""
        loaders = {name: namespace[name] for name in names if isinstance(namespace.get(name), DataLoader)}
        return {name: self.shuffle_state(loader) for name, loader in loaders.items()}

    def continue_after(self, loader: DataLoader, state: LoaderState) -> None:
        """The loader shuffles on from where rank 0's did: the next epoch, here or in the next cell."""
        self._epochs[loader] = self._epochs.get(loader, 0) + state.epochs
        generators = [self._generators[loader]] if loader in self._generators else shuffle_generators(loader)
        for generator, saved in zip(generators, state.generators, strict=False):
            generator.set_state(saved)

    def restore(self, loader: DataLoader, state: LoaderState) -> None:
        """The loader goes on from a checkpoint's position: its shuffle from the saved generator states, and
        its epoch count from the saved one, so the next cell's line names the epoch it really starts in
        (``state.epochs`` begun; one taken part-way is the one the next cell continues)."""
        self.continue_after(loader, LoaderState(epochs=0, generators=state.generators))
        self._epochs[loader] = max(state.epochs - (1 if state.taken else 0), 0)

    def epochs(self, loader: DataLoader) -> int:
        """Epochs the loader began on the ranks, in every cell of this kernel (or since a checkpoint)."""
        return self._epochs.get(loader, 0)


def draws_without_generator(loader: DataLoader) -> bool:
    """The loader shuffles from the global RNG (a ``RandomSampler`` with no generator): the notebook gives
    it one of its own for the ranks, or each rank would shuffle from its own global RNG."""
    return (
        not is_iterable_loader(loader) and loader.generator is None and getattr(loader.sampler, "generator", 0) is None
    )
