"""Where a split DataLoader is in its epoch, counted batch by batch, so that an interval save can say it and a
resumed cell can start there. Runs on the ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from nbfsdp.engines.loaders import SplitBatchSampler, set_after_init, shuffle_generators
from nbfsdp.shared.protocol import LoaderState


class PositionedBatches(SplitBatchSampler):
    """A split loader's batches, counted, so that an interval save knows where in its epoch it is.

    At an epoch's last batch: a sampler may draw from its generator after its last batch
    (``RandomSampler`` draws one more permutation as it stops); the log call of that step comes before
    the draw, a cell's end after it. ``finish_epoch`` runs the sampler to its end at the save instead,
    as the loop would next, so the saved states are those the next epoch starts from.
    Part-way through an epoch: the save keeps the states the epoch drew its shuffle from and the batches
    taken (``LoaderState.taken``); the cell resumed from it gives ``resume`` here, and its first epoch
    shuffles from those states again and skips those batches (their indices only: no data is loaded).
    A ``resume`` with nothing taken and no generator states carries only the epochs begun before this
    cell (the kernel's count), so that a save here counts them too.
    """

    def __init__(self, split: SplitBatchSampler, generators: list[torch.Generator], resume: LoaderState | None) -> None:
        super().__init__(split.batches, split.rank, split.world_size, per_rank=split.per_rank, epochs=split.epochs)
        self.taken = 0
        #: Epochs begun before this cell: a part-way epoch resumed is begun again here.
        self.before = max(resume.epochs - (1 if resume.taken else 0), 0) if resume is not None else 0
        self.began: list[torch.Tensor] = []
        self._generators, self._resume = generators, resume
        self._epoch: Any = None

    def __iter__(self) -> Any:
        resume, self._resume = self._resume, None
        if resume is not None:
            for generator, state in zip(self._generators, resume.generators, strict=False):
                generator.set_state(state)
        self.began = [g.get_state() for g in self._generators]  # before this epoch's shuffle is drawn
        self.taken = 0
        self._epoch = super().__iter__()
        for _ in range(resume.taken if resume is not None else 0):
            next(self._epoch, None)  # taken by the run that saved
            self.taken += 1
        for batch in self._epoch:
            self.taken += 1
            yield batch

    def part_way(self) -> bool:
        """An epoch begun and not all taken."""
        return self._epoch is not None and 0 < self.taken < len(self)

    def finish_epoch(self) -> None:
        """At a save: end an epoch whose batches were all taken (the sampler's draws as it stops)."""
        if self._epoch is not None and self.taken >= len(self):
            for _ in self._epoch:  # it has no batch left to give
                pass
            self._epoch = None


def track_positions(loader: DataLoader, resume: LoaderState | None) -> None:
    """With ``--save-interval`` or a part-way position to resume: count a split loader's batches."""
    if isinstance(loader.batch_sampler, SplitBatchSampler):
        batches = PositionedBatches(loader.batch_sampler, shuffle_generators(loader), resume)
        set_after_init(loader, "batch_sampler", batches)
