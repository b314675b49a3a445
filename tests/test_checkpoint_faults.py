"""A full disk mid-save (issue 28, point 7), on a real small file system: a 2 MB tmpfs.

``ENOSPC`` while the ranks write leaves nothing complete and nothing half-written behind, the magic or
the cell says so in plain words, and after ``%fsdp save`` the world goes on: the next save elsewhere
holds exactly what the engines hold. Mounting needs root (CAP_SYS_ADMIN): without it the tests skip.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.shared.checkpoints import MANIFEST, list_checkpoints
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _small_disk(path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs at ``path`` for the test's length (skips the test where mounting is not permitted)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _full_state(shell) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in shell.user_ns["engine_state"].items()}


def test_a_full_disk_during_fsdp_save_saves_nothing_and_the_world_goes_on(shell, tmp_path):
    # 786k fp32 parameters (3 MB) and AdamW's two moments: far more than the 2 MB disk holds
    run_ok(shell, "import torch, torch.nn as nn\ntorch.manual_seed(0)\nwide = nn.Linear(1024, 768)")
    run_ok(shell, "wide_opt = torch.optim.AdamW(wide.parameters(), lr=1e-2)")
    step = "%%fsdp --world-size 2\nwide(torch.ones(4, 1024)).square().mean().backward()\nwide_opt.step()\n"
    run_ok(shell, step + "wide_opt.zero_grad()")
    world = nbfsdp._magics.session.cluster.world
    with _small_disk(tmp_path / "small") as small:
        error, _ = run_failing(shell, f"%fsdp save {small / 'full'}")
        assert isinstance(error, UsageError), error
        message = str(error)
        assert "no space left on device" in message and "nothing was saved" in message, message
        assert "the engines still hold the trained state" in message, message
        assert list_checkpoints(small) == [] and list(small.iterdir()) == []  # the partial's space is freed
    assert nbfsdp._magics.session.cluster.world is world and not world.broken  # the world goes on
    run_ok(shell, step + "wide_opt.zero_grad()")  # and trains on: its collectives are intact
    run_ok(
        shell,
        "%%fsdp --world-size 2\nfrom torch.distributed.tensor import DTensor\n"
        "engine_state = {k: v.full_tensor() for k, v in wide.state_dict().items()}",
    )
    held = _full_state(shell)
    roomy = tmp_path / "roomy"
    run_ok(shell, f"%fsdp save {roomy}")
    assert (roomy / MANIFEST).is_file()
    exported = nbfsdp.export(roomy, tmp_path / "wide.pt", model="wide")
    saved = torch.load(exported, weights_only=True)
    assert saved.keys() == held.keys()
    for key in held:
        torch.testing.assert_close(saved[key], held[key], rtol=0, atol=0, msg=key)


def test_a_full_disk_at_an_interval_save_fails_the_cell_and_keeps_the_earlier_checkpoint(shell, tmp_path):
    # 98k parameters with AdamW: about 1.2 MB a checkpoint, so the first fits the 2 MB disk and the second not
    run_ok(shell, "%fsdp stop")  # a fresh world: an interval save holds every model the engines hold
    run_ok(shell, "import torch, torch.nn as nn\ntorch.manual_seed(0)\nmid = nn.Linear(256, 384)")
    run_ok(shell, "mid_opt = torch.optim.AdamW(mid.parameters(), lr=1e-2)")
    with _small_disk(tmp_path / "small") as small:
        error, _ = run_failing(
            shell,
            f"%%fsdp --world-size 2 --save-folder {small} --save-interval 1\n"
            "for step in range(3):\n"
            "    loss = mid(torch.ones(4, 256)).square().mean()\n"
            "    loss.backward()\n"
            "    mid_opt.step()\n"
            "    mid_opt.zero_grad()\n"
            "    nbfsdp.log(step=step, loss=loss.item())\n",
        )
        message = str(error)
        assert "no space left on device" in message and "nothing was saved" in message, message
        assert "earlier checkpoints in it stay complete" in message, message
        assert [(info.name, info.complete) for info in list_checkpoints(small)] == [("step-1", True)]
        assert [p.name for p in small.iterdir()] == ["step-1"]  # the failed step-2's partial is gone
        assert nbfsdp.checkpoints(small)[0].step == 1


def test_a_full_disk_under_an_async_save_is_raised_at_the_next_wait_save_or_stop(shell, tmp_path):
    """The background write fails; the save itself returned. The error comes at the next ``%fsdp wait``,
    the next save (which then does not save) or ``%fsdp stop`` (after the cluster stops); nothing
    complete is left and the world trains on."""
    run_ok(shell, "%fsdp stop")
    run_ok(shell, "import torch, torch.nn as nn\ntorch.manual_seed(0)\nwide = nn.Linear(1024, 768)")
    run_ok(shell, "wide_opt = torch.optim.AdamW(wide.parameters(), lr=1e-2)")
    step = "%%fsdp --world-size 2\nwide(torch.ones(4, 1024)).square().mean().backward()\nwide_opt.step()\n"
    run_ok(shell, step + "wide_opt.zero_grad()")
    session = nbfsdp._magics.session
    world = session.cluster.world
    with _small_disk(tmp_path / "small") as small:
        run_ok(shell, f"%fsdp save {small / 'a'} --async")
        error, _ = run_failing(shell, "%fsdp wait")
        assert isinstance(error, UsageError) and "no space left on device" in str(error), error
        assert session.pending_save is None and list(small.iterdir()) == []
        assert session.cluster.world is world and not world.broken
        run_ok(shell, step + "wide_opt.zero_grad()")  # the world trains on

        run_ok(shell, f"%fsdp save {small / 'b'} --async")
        error, _ = run_failing(shell, f"%fsdp save {tmp_path / 'roomy'}")
        assert "no space left on device" in str(error) and not (tmp_path / "roomy").exists()
        run_ok(shell, f"%fsdp save {tmp_path / 'roomy'}")  # asked again, it saves
        assert (tmp_path / "roomy" / MANIFEST).is_file()

        run_ok(shell, f"%fsdp save {small / 'c'} --async")
        error, _ = run_failing(shell, "%fsdp stop")
        assert "no space left on device" in str(error) and session.cluster.world is None
        assert list_checkpoints(small) == []
