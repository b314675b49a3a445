"""``--save-interval`` on one rank: checkpoints taken inside a running cell at its ``nbfsdp.log`` calls. Runs on the
ranks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch.utils.data import DataLoader

from nbfsdp.engines.checkpointing import save
from nbfsdp.engines.control import SaveAgreement
from nbfsdp.engines.loader_positions import PositionedBatches
from nbfsdp.engines.world import World
from nbfsdp.shared import checkpoints
from nbfsdp.shared.protocol import IntervalSaves, SaveTarget


class IntervalSaver:
    """``--save-interval`` on one rank: at each due ``nbfsdp.log`` the ranks agree through files
    (``SaveAgreement``: no collective, so a rank that skipped the log cannot hang the others), then save
    together with ``save``, as ``%fsdp save`` does, into ``<folder>/step-<s+1>``; rank 0 then prunes to the
    newest ``keep``.

    The log call is where every rank has finished step ``s``: optimizer and scheduler stepped, RNG and data
    consumed through it, so a run resumed from ``step-<s+1>`` at ``resume_step = s + 1`` continues exactly.
    """

    def __init__(self, saves: IntervalSaves, world: World) -> None:
        self._saves, self._world = saves, world
        self.agreement = SaveAgreement(saves.markers, world.rank, world.world_size)
        # the partial directory's name must be the same on every rank: derived from the cell's markers directory
        self._tag = hashlib.sha1(saves.markers.encode()).hexdigest()[:8]

    def at_log(self, step: int) -> None:
        due = (step + 1) % self._saves.interval == 0
        self.agreement.at_log(step, due=due)
        if not due:
            return
        loaders = {
            name: value
            for name, value in sorted(self._world.namespace.items())
            if isinstance(value, DataLoader) and isinstance(value.batch_sampler, PositionedBatches)
        }
        for loader in loaders.values():
            assert isinstance(loader.batch_sampler, PositionedBatches)  # as chosen just above
            loader.batch_sampler.finish_epoch()
        folder = Path(self._saves.folder)
        name = f"step-{step + 1}"
        partial = folder / f".{name}.partial-{self._tag}"
        # a later run into the same folder replaces its own step's checkpoint: never a half-written one
        earlier = "the earlier checkpoints in it stay complete; this cell stops here"
        target = SaveTarget(
            partial=str(partial), final=str(folder / name), step=step + 1, overwrite=True, disk_full_then=earlier
        )
        result = save(self._world.generation, target)
        if result is not None:
            removed = checkpoints.keep_latest(folder, self._saves.keep) if self._saves.keep > 0 else []
            gone = f"; removed {', '.join(Path(p).name for p in removed)}" if removed else ""
            print(f"nbfsdp: saved {folder / name}{gone}", flush=True)

    def end(self, *, failed: bool) -> None:
        self.agreement.end(failed=failed)
