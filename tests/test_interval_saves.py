"""Checkpoints inside a ``%%fsdp`` cell (issue 28): ``--save-folder``, ``--save-interval``,
``--save-num-checkpoints-to-keep``, ``--autoresume``, ``--load-path``, ``resume_step``, on real ranks and
a real file system.

Exact resume from an interval save after the world is stopped (AdamW, an LR scheduler, dropout, a
shuffled split DataLoader with its generator, saved at an epoch's end and part-way through one),
keep-K, a log on rank 0 only failing at once instead of hanging, autoresume ignoring partial saves,
Composer's keys through ``--config``, ``--load-path`` at another world size, ``--async``, and the
settings a cell refuses before any engine is touched.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from test_checkpoints import NOTEBOOK, SEED, _assert_optimizers_equal, _assert_states_equal, _state

import nbfsdp
from nbfsdp.shared.checkpoints import MANIFEST, Manifest, list_checkpoints
from tests.conftest import run_failing, run_ok

#: 8 steps an epoch (64 samples, batches of 8); ``stop`` ends it at a step, ``resume_step`` starts it.
TRAIN = """%%fsdp --world-size 2 {flags}
losses, first_step = [], resume_step
step = resume_step
while step < stop:
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        nbfsdp.log(step=step, loss=loss.item())
        step += 1
        if step == stop:
            break
"""

#: No loader: ``steps`` steps on one fixed batch.
STEPS = """%%fsdp --world-size 2 {flags}
x, y = torch.ones(4, 8), torch.zeros(4, 5)
for step in range(resume_step, steps):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    {log}
"""


def _complete(folder) -> list[str]:
    return sorted(info.name for info in list_checkpoints(folder) if info.complete)


@pytest.mark.slow
@pytest.mark.floor
def test_interval_saves_and_autoresume_continue_bitwise_exactly(shell, tmp_path, capsys):
    """20 steps in one run == 12 steps with a save every 4 (at an epoch's end and part-way through one),
    the world stopped, fresh notebook objects, --autoresume from step-12, 8 more across an epoch's end:
    every loss and the final parameters and optimizer state bitwise."""
    run_ok(shell, "%fsdp stop")
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nstop = 20")
    run_ok(shell, SEED.format(n=2))
    run_ok(shell, TRAIN.format(flags=""))
    reference, final = list(shell.user_ns["losses"]), _state(shell)
    final_optimizer = shell.user_ns["opt"].state_dict()
    assert len(reference) == 20

    folder = tmp_path / "ckpt"
    flags = f"--save-folder {folder} --save-interval 4"
    # the same world: fresh objects and the seed cell repeat the reference's start (a stop here cost a cluster start)
    run_ok(shell, "model, opt, sched, loader = fresh()\nstop = 12")
    run_ok(shell, SEED.format(n=2))
    run_ok(shell, TRAIN.format(flags=flags))
    assert shell.user_ns["losses"] == reference[:12] and shell.user_ns["first_step"] == 0
    assert _complete(folder) == ["step-12", "step-4", "step-8"]
    assert Manifest.from_json((folder / "step-12" / MANIFEST).read_text()).step == 12
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]

    run_ok(shell, "%fsdp stop")
    # as after a kernel restart: every object new, other weights, an optimizer without state, a new loader
    run_ok(shell, "model, opt, sched, loader = fresh(seed=1)\nstop = 20")
    capsys.readouterr()
    run_ok(shell, TRAIN.format(flags=f"{flags} --autoresume"))
    out = capsys.readouterr().out
    assert "autoresume: the newest complete checkpoint" in out and "step-12" in out
    assert shell.user_ns["first_step"] == 12
    assert shell.user_ns["losses"] == reference[12:]
    _assert_states_equal(_state(shell), final)
    _assert_optimizers_equal(shell.user_ns["opt"].state_dict(), final_optimizer)
    assert shell.user_ns["sched"].last_epoch == 20
    assert _complete(folder) == ["step-12", "step-16", "step-20", "step-4", "step-8"]
    run_ok(shell, "%%fsdp --world-size 2\nafter = resume_step")  # a load's step is for the cell right after it
    assert shell.user_ns["after"] == 0


@pytest.mark.slow
def test_keep_k_and_composer_keys_through_config(shell, tmp_path):
    """Five interval saves keeping 2 leave the 2 newest; the same settings as a Composer dict, then
    --load-path and autoresume through it."""
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nsteps = 10")
    folder = tmp_path / "keep"
    flags = f"--save-folder {folder} --save-interval 2 --save-num-checkpoints-to-keep 2"
    run_ok(shell, STEPS.format(flags=flags, log="nbfsdp.log(step=step, loss=loss.item())"))
    assert _complete(folder) == ["step-10", "step-8"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]

    composer = tmp_path / "composer"
    run_ok(
        shell,
        f"cfg = dict(save_folder={str(composer)!r}, save_interval='3ba', save_num_checkpoints_to_keep=1,"
        " sharding_strategy='SHARD_GRAD_OP')\nsteps = 7",
    )
    run_ok(shell, STEPS.format(flags="--config cfg", log="nbfsdp.log(step=step)"))
    assert _complete(composer) == ["step-6"]
    assert nbfsdp.last_run().config["sharding_strategy"] == "SHARD_GRAD_OP"
    run_ok(shell, f"cfg = dict(save_folder={str(composer)!r}, autoresume=True)")
    run_ok(shell, "%%fsdp --world-size 2 --config cfg\nr = resume_step")
    assert shell.user_ns["r"] == 6
    run_ok(shell, f"cfg = dict(load_path={str(folder / 'step-8')!r}, load_ignore_keys=['schedulers.*'])")
    run_ok(shell, "%%fsdp --world-size 2 --config cfg\nr = resume_step")
    assert shell.user_ns["r"] == 8
    run_ok(shell, f"%%fsdp --world-size 1 --load-path {folder / 'step-10'}\nr = resume_step")  # resharded
    assert shell.user_ns["r"] == 10

    background = tmp_path / "async"
    run_ok(shell, "steps = 4")
    flags = f"--save-folder {background} --save-interval 2 --async"
    run_ok(shell, STEPS.format(flags=flags, log="nbfsdp.log(step=step)"))
    run_ok(shell, "%fsdp wait")
    assert _complete(background) == ["step-2", "step-4"]
    assert not list(Path(nbfsdp._magics.session.cluster.private_dir).glob("saves-*"))  # the agreement's files


@pytest.mark.slow
def test_a_log_on_rank_0_only_fails_at_once_on_every_rank_and_the_next_cell_works(shell, tmp_path):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nsteps = 6")
    folder = tmp_path / "skipped"
    flags = f"--save-folder {folder} --save-interval 2 --timeout 120"
    error, elapsed = run_failing(shell, STEPS.format(flags=flags, log="if rank == 0: nbfsdp.log(step=step)"))
    assert "--save-interval needs nbfsdp.log(step=...) on every rank" in str(error), error
    assert elapsed < 60  # not the collective timeout: the ranks agree through files first
    assert _complete(folder) == []
    run_ok(shell, "%%fsdp --world-size 2\nx = rank")  # a fresh world
    # a rank that ends the cell without the due log: its peer does not wait for it either
    error, _ = run_failing(shell, STEPS.format(flags=flags, log="if rank == 0 and step == 1: nbfsdp.log(step=step)"))
    assert "--save-interval needs nbfsdp.log(step=...) on every rank" in str(error), error
    run_ok(shell, "%%fsdp --world-size 2\nx = rank")


@pytest.mark.slow
def test_autoresume_starts_at_0_in_an_empty_folder_and_ignores_partial_saves(shell, tmp_path, capsys):
    folder = tmp_path / "empty"
    run_ok(shell, "%%fsdp --world-size 2\nr = resume_step")
    assert shell.user_ns["r"] == 0
    capsys.readouterr()
    run_ok(shell, f"%%fsdp --world-size 2 --save-folder {folder} --autoresume\nr = resume_step")
    assert shell.user_ns["r"] == 0 and "no complete checkpoint" in capsys.readouterr().out
    folder.mkdir(exist_ok=True)
    partial = folder / ".step-4.partial-0a1b"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 10)
    run_ok(shell, f"%%fsdp --world-size 2 --save-folder {folder} --autoresume\nr = resume_step")
    assert shell.user_ns["r"] == 0 and "no complete checkpoint" in capsys.readouterr().out
    assert partial.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--save-folder {f} --save-interval 0", "save_interval must be a positive whole number"),
        ("--save-folder {f} --save-interval 1ep", "save_interval must be a positive whole number"),
        ("--save-interval 5", "save_interval needs save_folder"),
        ("--autoresume", "autoresume needs save_folder"),
        ("--save-folder {f}", "save_folder needs save_interval"),
        ("--save-folder {f} --save-interval 2 --save-num-checkpoints-to-keep 0", "-1 (keep all) or a positive"),
        ("--load-ignore-keys 'optimizers.*'", "load_ignore_keys needs load_path or autoresume"),
        ("--load-path {f}/nothing", "no such checkpoint"),
        ("--config bad", "save_interval must be a positive whole number"),
    ],
)
def test_bad_checkpoint_settings_are_refused_before_any_engine(shell, tmp_path, flags, message):
    shell.user_ns["bad"] = {"save_folder": str(tmp_path), "save_interval": -3}
    world = nbfsdp._magics.session.cluster.world
    generation = world.generation if world else None
    started = time.monotonic()
    error, _ = run_failing(shell, f"%%fsdp --world-size 2 {flags.format(f=tmp_path)}\nx = 1")
    assert isinstance(error, UsageError) and message in str(error), error
    world = nbfsdp._magics.session.cluster.world
    assert (world.generation if world else None) == generation and time.monotonic() - started < 10
