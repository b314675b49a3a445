"""The exported script's sampler (``export_script``'s ``SplitBatches`` and ``split``, as the script holds them)
and the ranks' ``engines.loaders.split``: the same indices on each rank, epoch after epoch, for the same loader.

An exported script must train on what the cell trained on; the two are written apart (the script imports no
nbfsdp), so this holds them together. Pure CPU, no world: each rank's side is built in this process.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from nbfsdp.engines import loaders
from nbfsdp.kernel.checkpoints import export_script


def _loader(size: int, batch_size: int, drop_last: bool) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    return DataLoader(list(range(size)), batch_size=batch_size, shuffle=True, generator=generator, drop_last=drop_last)


def _script_split(loader: DataLoader, rank: int, world_size: int, per_rank: bool) -> DataLoader:
    """``loader`` split by the script's own source, run as the script runs it (its globals: rank, world_size)."""
    namespace = {"torch": torch, "Sampler": Sampler, "rank": rank, "world_size": world_size}
    exec(compile(export_script._SPLIT, "<exported script>", "exec"), namespace)
    namespace["split"](loader, per_rank, None)
    return loader


def _epochs(loader: DataLoader, epochs: int = 3) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for _ in range(epochs)]


@pytest.mark.parametrize("per_rank", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("size", "batch_size", "drop_last"), [(16, 4, False), (23, 6, False), (23, 6, True), (9, 8, False)]
)
def test_the_exported_scripts_sampler_gives_each_rank_what_the_ranks_gave_it(
    size, batch_size, drop_last, world_size, per_rank
):
    for rank in range(world_size):
        ranks = loaders.split(
            _loader(size, batch_size, drop_last), rank, world_size, per_rank=per_rank, seed_state=None
        ).loader
        script = _script_split(_loader(size, batch_size, drop_last), rank, world_size, per_rank)
        assert _epochs(script) == _epochs(ranks), (rank, world_size)


def test_the_check_sees_a_sampler_that_splits_otherwise():
    """The comparison itself: a script whose sampler gave every rank the whole batch would fail it."""
    ranks = loaders.split(_loader(16, 4, False), 1, 2, per_rank=False, seed_state=None).loader
    whole = _loader(16, 4, False)
    assert _epochs(whole) != _epochs(ranks)


def test_the_exported_scripts_sampler_has_the_ranks_length():
    ranks = loaders.split(_loader(9, 8, False), 0, 2, per_rank=False, seed_state=None).loader
    script = _script_split(_loader(9, 8, False), 0, 2, False)
    assert len(script) == len(ranks) == len(_epochs(ranks, 1)[0])
