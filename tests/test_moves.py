"""A model that lives on the ranks follows the world (issue 59, points 1-3): a cell at another world size, sharding
strategy, wrap rule or precision moves the trained weights, the optimizer's and the scheduler's state through
shared memory first, exactly as ``%fsdp save`` then ``%fsdp load`` at the same point would; a LoRA model's adapters
and frozen base move alike; a move that cannot happen leaves the model where it was, one that fails after the old
world wrote it leaves it in shared memory for the next cell; ``%fsdp stop`` frees what a move left. Real ranks,
real DCP, real ``/dev/shm``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.checkpoints.moves import MOVE_PREFIX
from nbfsdp.kernel.cluster import reaping
from nbfsdp.kernel.cluster.reaping import SHARED_MEMORY
from nbfsdp.kernel.run import residence
from tests.conftest import forget_after_each_test, run_failing, run_ok

pytestmark = [pytest.mark.timeout(420)]

NOTEBOOK = """
import torch, torch.nn as nn, nbfsdp
from torch.utils.data import DataLoader, TensorDataset

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))

def fresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), Block(24), Block(24), nn.Linear(24, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 5, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    return model, opt, sched, loader
"""

#: Four steps a cell, from where the loader and ``resume_step`` say; rank 0's losses and the steps logged.
TRAIN = """%%fsdp {flags}
batches = iter(loader)
for step in range(resume_step, resume_step + 4):
    x, y = next(batches)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    nbfsdp.log(step=step, loss=loss.item())
"""

#: The same four global batches at any world size, each rank its part: a loader's order depends on its epochs.
TRAIN_FIXED = """%%fsdp {flags}
g = torch.Generator().manual_seed(1000 + resume_step)
for step in range(resume_step, resume_step + 4):
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)
    loss = nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    nbfsdp.log(step=step, loss=loss.item())
"""

#: World size 4 -> 2 -> 4, then at 4: another strategy (the same world, RNG and loader positions carry over),
#: other units, bf16 parameters throughout.
PHASES = (
    "--world-size 4",
    "--world-size 2",
    "--world-size 4",
    "--world-size 4 --sharding-strategy SHARD_GRAD_OP",
    "--world-size 4 --wrap-cls Block",
    "--world-size 4 --mixed-precision PURE --precision bf16",
)

_forget = forget_after_each_test(
    "model", "opt", "sched", "loader", "fresh", "Block", "batches", "x", "y", "loss", "step", "base", "peft",
    "tokens", "transformers", "plain", "plain_opt", "plain_sched", "steps_taken",
)  # fmt: skip


def _our_shared_memory() -> set[str]:
    """This process's move directories in shared memory, by the kernel each names (``reaping.note_kernel``): the
    other worker's tests and notebooks move their models through it at the same time (seen once: a move of theirs
    counted as this test's second)."""
    ours = set()
    for path in SHARED_MEMORY.glob(f"{MOVE_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads((path / reaping.KERNEL_FILE).read_text())["kernel"] == os.getpid():
                ours.add(path.name)
    return ours


def _rank0_losses() -> list[float]:
    return [m["loss"] for m in nbfsdp.last_run().metrics if m["rank"] == 0 and "loss" in m]


def _sequence(shell, tmp_path: Path, *, through_save_and_load: bool, capsys) -> tuple[list[list[float]], dict]:
    """The phases in order, from fresh objects; between phases either nothing (the cell moves the model) or an
    explicit ``%fsdp save`` and a ``--load-path`` of it on the next cell. Each phase's rank-0 losses, and the
    final state as a plain model, optimizer and scheduler in the kernel read back."""
    run_ok(shell, "model, opt, sched, loader = fresh()")
    losses, lines = [], []
    for index, flags in enumerate(PHASES):
        if index == 0:
            flags += " --keep-on-ranks"
        elif through_save_and_load:
            run_ok(shell, f"%fsdp save {tmp_path / f'phase-{index}'}")
            flags += f" --load-path {tmp_path / f'phase-{index}'}"
        capsys.readouterr()
        run_ok(shell, TRAIN.format(flags=flags))
        lines.append(capsys.readouterr().out)
        losses.append(_rank0_losses())
        assert all(p.is_meta for p in shell.user_ns["model"].parameters())  # never here
        world = PHASES[index].split()[1]
        assert f"on the {world} ranks only" in repr(shell.user_ns["model"])
    final = tmp_path / ("final-saved" if through_save_and_load else "final-moved")
    run_ok(shell, f"%fsdp save {final}")
    run_ok(shell, f"plain, plain_opt, plain_sched, _ = fresh()\nnbfsdp.load({str(final)!r}, into=plain, "
           "optimizer=plain_opt, scheduler=plain_sched)")  # fmt: skip
    state = {
        "model": {k: v.clone() for k, v in shell.user_ns["plain"].state_dict().items()},
        "optimizer": shell.user_ns["plain_opt"].state_dict(),
        "scheduler": shell.user_ns["plain_sched"].state_dict(),
        "lines": lines,
    }
    return losses, state


def test_a_model_on_the_ranks_moves_between_worlds_and_settings_as_through_save_and_load(shell, tmp_path, capsys):
    # one fresh cluster for both sequences: the reference's first phase runs in the world of 4 the moved sequence
    # ended in, as a fresh one would (its objects are new, all sent; the ranks draw no random numbers)
    run_ok(shell, "%fsdp stop")
    run_ok(shell, NOTEBOOK)
    before = _our_shared_memory()
    moved, moved_state = _sequence(shell, tmp_path, through_save_and_load=False, capsys=capsys)
    said = moved_state["lines"]
    assert "nbfsdp: moved model from 4 ranks to 2 ranks, FULL_SHARD in " in said[1]
    assert "RNG states and data positions do not carry over to another world size" in said[1]
    assert "nbfsdp: moved model from 4 ranks to 4 ranks, SHARD_GRAD_OP in " in said[3]
    assert "do not carry over" not in said[3]  # the same world size: RNG states and positions carry over
    assert "4 ranks, FULL_SHARD, PURE" in said[5]
    assert all("ranks wrote" in line and f"to {SHARED_MEMORY} in" in line for line in said[1:])
    residence.wait_for_freeing()  # each freed behind the cell after its move
    assert _our_shared_memory() == before
    saved, saved_state = _sequence(shell, tmp_path, through_save_and_load=True, capsys=capsys)
    assert all("moved" not in line for line in saved_state["lines"])  # the reference loaded, nothing moved

    assert moved == saved  # every phase's losses, bit for bit
    assert all(len(phase) == 4 for phase in moved)
    for key, tensor in saved_state["model"].items():
        assert torch.equal(moved_state["model"][key], tensor), key
    for (key, state), (_, expected) in zip(
        moved_state["optimizer"]["state"].items(), saved_state["optimizer"]["state"].items(), strict=True
    ):
        for field, value in expected.items():
            assert torch.equal(torch.as_tensor(state[field]), torch.as_tensor(value)), (key, field)
    assert moved_state["scheduler"] == saved_state["scheduler"]
    assert moved_state["scheduler"]["last_epoch"] == 4 * len(PHASES)  # the ranks' scheduler went on throughout
    assert all(int(state["step"]) == 4 * len(PHASES) for state in moved_state["optimizer"]["state"].values())


LLAMA = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
LORA = "peft.LoraConfig(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'])"
LORA_TRAIN = """%%fsdp --world-size {n}
if "opt" not in globals():
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
for step in range(3):
    loss = model(input_ids=tokens[step][rank::world_size], labels=tokens[step][rank::world_size]).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
steps_taken = max(int(state["step"]) for state in opt.state.values())
"""


def test_a_lora_model_on_a_frozen_base_read_by_the_ranks_moves_alike(shell, tmp_path):
    directory = tmp_path / "llama"
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(directory)
    shell.user_ns["tokens"] = torch.randint(0, 96, (3, 4, 12), generator=torch.Generator().manual_seed(11))
    run_ok(shell, "import torch, transformers, peft, nbfsdp")
    results = {}
    # fresh ranks, without another test's ``opt``; the saved way's first cell, at 2 ranks, is a new world again
    run_ok(shell, "%fsdp stop")
    for way in ("moved", "saved"):
        shell.user_ns.pop("opt", None)
        run_ok(shell, f"torch.manual_seed(0)\nbase = nbfsdp.from_pretrained({str(directory)!r})\n"
               f"model = peft.get_peft_model(base, {LORA})")  # fmt: skip
        run_ok(shell, LORA_TRAIN.format(n=2))
        first = _rank0_losses()
        if way == "saved":
            run_ok(shell, f"%fsdp save {tmp_path / 'lora'}")
            run_ok(shell, LORA_TRAIN.format(n=f"4 --load-path {tmp_path / 'lora'}"))
        else:
            run_ok(shell, LORA_TRAIN.format(n=4))
        model = shell.user_ns["model"]
        assert "on the 4 ranks only" in repr(model)
        assert all(p.is_meta for n, p in model.named_parameters() if "lora_" not in n)  # the base stayed there
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        assert shell.user_ns["steps_taken"] == 6  # the optimizer the first cell made moved with its state
        results[way] = first, _rank0_losses(), adapters
    (first, after, adapters), (first_saved, after_saved, adapters_saved) = results["moved"], results["saved"]
    assert first == first_saved and after == after_saved
    assert after[0] < first[0]  # the trained adapters moved, not fresh ones
    for name, tensor in adapters_saved.items():
        assert torch.equal(adapters[name], tensor), name


@pytest.fixture
def small_shared_memory(tmp_path, monkeypatch):
    """A 64 KiB tmpfs as the host's shared memory: room enough by the move's estimate for a tiny model's weights
    (three times their 4.2 KiB), not for what DCP writes of it (its optimizer, RNG and metadata: ~150 KiB)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target = tmp_path / "shm"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(target)], check=True)
    monkeypatch.setattr(reaping, "SHARED_MEMORY", target)
    yield target
    subprocess.run(["umount", "--lazy", str(target)], check=False)


def test_shared_memory_that_fills_during_a_move_leaves_the_model_on_its_world(shell, small_shared_memory):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()")
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 2 --keep-on-ranks"))
    error, _ = run_failing(shell, TRAIN_FIXED.format(flags="--world-size 4"))
    assert isinstance(error, UsageError)
    assert "moving them failed while the ranks wrote them" in str(error) and "no space left" in str(error).lower()
    assert "they stay on the running world" in str(error)
    assert list(small_shared_memory.iterdir()) == []  # what was written is freed
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 2"))  # the old world still holds it, and trains on
    assert "on the 2 ranks only, changed there by a cell" in repr(shell.user_ns["model"])
    assert nbfsdp.last_run().metrics[0]["step"] == 0  # no checkpoint was loaded: resume_step stayed 0


def test_a_model_whose_skeleton_no_longer_fits_stays_on_its_world(shell):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()")
    run_ok(shell, TRAIN.format(flags="--world-size 2 --keep-on-ranks"))
    before = _our_shared_memory()
    run_ok(shell, "model.append(nn.Linear(5, 5))")
    error, _ = run_failing(shell, TRAIN.format(flags="--world-size 4"))
    assert isinstance(error, UsageError)
    assert "they cannot move: model does not match the checkpoint's model: not in the checkpoint: " in str(error)
    assert _our_shared_memory() == before  # what the move wrote is freed
    run_ok(shell, "del model[-1]")
    run_ok(shell, TRAIN.format(flags="--world-size 2"))  # the old world still holds it, trained
    assert "on the 2 ranks only, changed there by a cell" in repr(shell.user_ns["model"])


def _move_with_rank_1_killed(shell, capsys) -> tuple[Path, str]:
    """A cell at 4 ranks over a model trained on 2: once the old world wrote it and the new one is up, before it
    has read it, rank 1 of the new world dies. Where the model was left, and what was said."""
    before = _our_shared_memory()
    session = nbfsdp._magics.session
    old_world = session.cluster.world
    killed = threading.Event()

    def kill_rank_1_of_the_new_world() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            world = session.cluster.world
            if world is not None and world is not old_world and len(world.processes) == 4:
                world.processes[1].signal(signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=kill_rank_1_of_the_new_world, daemon=True)
    watcher.start()
    capsys.readouterr()
    run_failing(shell, TRAIN_FIXED.format(flags="--world-size 4"))
    watcher.join()
    assert killed.is_set()
    said = capsys.readouterr().err
    left = _our_shared_memory() - before
    assert len(left) == 1, said
    return SHARED_MEMORY / left.pop() / "state", said


def test_a_rank_killed_during_a_move_leaves_the_model_in_shared_memory_for_the_next_cell(shell, tmp_path, capsys):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()")
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 2 --keep-on-ranks"))
    run_ok(shell, f"%fsdp save {tmp_path / 'reference'}")
    checkpoint, said = _move_with_rank_1_killed(shell, capsys)
    assert f"they are whole in {checkpoint}, which the next cell over them reads" in said
    assert (checkpoint / ".metadata").exists()  # complete: DCP's metadata is written last
    assert f"in {checkpoint}, where a failed move left them" in repr(shell.user_ns["model"])

    # the next cell reads it from there and goes on as from the save taken at the same point
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 4"))
    assert f"read from {checkpoint}, where a failed move left them" in capsys.readouterr().out
    moved = _rank0_losses()
    assert not checkpoint.parent.exists()  # freed once a world holds the model
    run_ok(shell, "model, opt, sched, loader = fresh()")  # new objects, all sent to the same world of 4
    run_ok(shell, TRAIN_FIXED.format(flags=f"--world-size 4 --load-path {tmp_path / 'reference'}"))
    assert moved == _rank0_losses()


def test_fsdp_stop_frees_what_a_failed_move_left(shell, capsys):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()")
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 2 --keep-on-ranks"))
    before = _our_shared_memory()
    checkpoint, _ = _move_with_rank_1_killed(shell, capsys)
    run_ok(shell, "%fsdp stop")
    assert f"nbfsdp: freed {checkpoint.parent}, where a failed move had left weights" in capsys.readouterr().err
    assert _our_shared_memory() == before - {checkpoint.parent.name}
    error, _ = run_failing(shell, TRAIN_FIXED.format(flags="--world-size 2"))
    assert "they are lost" in str(error)


def test_release_undoes_keep_on_ranks_and_the_next_cell_brings_everything_back(shell):
    """``nbfsdp.release``: the weights come back and the model lives in the notebook again; the next cell gathers
    it and its optimizer's and scheduler's state as any cell does, and all of it is one process's training."""
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()")
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 2 --keep-on-ranks"))
    model, opt, sched = (shell.user_ns[name] for name in ("model", "opt", "sched"))
    assert all(p.is_meta for p in model.parameters())
    nbfsdp.release(model)
    assert not any(p.is_meta for p in model.parameters()) and "nbfsdp:" not in repr(model)
    run_ok(shell, TRAIN_FIXED.format(flags="--world-size 2"))
    assert not any(p.is_meta for p in model.parameters())  # gathered back after the cell, as any model's
    assert sched.last_epoch == 8 and all(int(state["step"]) == 8 for state in opt.state.values())

    run_ok(shell, "plain, plain_opt, plain_sched, _ = fresh()")  # one process, the same 2 x 4 global batches
    plain, plain_opt, plain_sched = (shell.user_ns[name] for name in ("plain", "plain_opt", "plain_sched"))
    for _ in range(2):
        g = torch.Generator().manual_seed(1000)
        for _ in range(4):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)
            torch.nn.functional.mse_loss(plain(x), y).backward()
            plain_opt.step()
            plain_opt.zero_grad()
            plain_sched.step()
    for (name, tensor), expected in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(tensor, expected, msg=name)
