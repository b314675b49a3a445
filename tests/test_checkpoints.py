"""``%fsdp save``, ``%fsdp load``, ``%fsdp checkpoints`` on real ranks and a real file system (issue 28).

Exact resume between cells (AdamW, an LR scheduler, dropout, a shuffled split DataLoader, a parameter
whose first dimension the ranks do not divide), resharding from 4 ranks to 1, 2 and 3, atomic writes
(a rank killed mid-save leaves nothing complete) and the bad inputs a load refuses before anything
changes.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.run.session import current_session
from nbfsdp.shared import checkpoints
from nbfsdp.shared.checkpoints import MANIFEST, CheckpointError, Manifest, list_checkpoints
from tests.conftest import run_failing, run_ok

NOTEBOOK = """
import torch, torch.nn as nn, nbfsdp
from torch.utils.data import DataLoader, TensorDataset

class Net(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Dropout(0.2), nn.Linear(width, width))
        self.head = nn.Linear(width, 5)  # 5 rows: no world size here divides them
    def forward(self, x):
        return self.head(self.body(x))

def fresh(seed=0, width=32):
    torch.manual_seed(seed)
    model = Net(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 5, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    return model, opt, sched, loader
"""

SEED = "%%fsdp --world-size {n}\ntorch.manual_seed(100 + rank)\n"

TRAIN = """%%fsdp --world-size {n}
losses = []
for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    losses.append(loss.item())
    nbfsdp.log(step=start + len(losses) - 1, loss=loss.item())
"""


def _state(shell) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def _assert_optimizers_equal(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for index in a["state"]:
        _assert_states_equal(a["state"][index], b["state"][index])
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


#: On a rank: the source of every cell it was sent that tracebacks can still show (an expression: a test
#: module's function would travel by reference, and the engines cannot import the tests).
CELL_SOURCES = (
    "''.join(''.join(entry[2]) for name, entry in __import__('linecache').cache.items() if name.startswith('<fsdp-'))"
)


@pytest.mark.slow
@pytest.mark.floor
def test_exact_resume_between_cells_after_the_world_is_stopped(shell, tmp_path):
    """k steps, save, stop, fresh notebook objects, load, m steps == k + m steps in one world, bitwise."""
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nstart = 0")
    run_ok(shell, SEED.format(n=2))
    run_ok(shell, TRAIN.format(n=2))
    first = list(shell.user_ns["losses"])
    run_ok(shell, "start = 8")
    run_ok(shell, TRAIN.format(n=2))
    second, final = list(shell.user_ns["losses"]), _state(shell)
    final_optimizer = shell.user_ns["opt"].state_dict()

    run_ok(shell, "%fsdp stop")
    run_ok(shell, "model, opt, sched, loader = fresh()\nstart = 0")
    run_ok(shell, SEED.format(n=2))
    run_ok(shell, TRAIN.format(n=2))
    assert shell.user_ns["losses"] == first
    sent_with_model = nbfsdp.last_run().sent_bytes[0]  # a new world: the model went to the ranks
    path = tmp_path / "manual"
    saved, saved_optimizer = _state(shell), shell.user_ns["opt"].state_dict()
    run_ok(shell, f"%fsdp save {path}")
    assert (path / MANIFEST).is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    run_ok(shell, "%fsdp stop")
    # as after a kernel restart: every object new, other weights, an optimizer without state, a new loader
    run_ok(shell, "model, opt, sched, loader = fresh(seed=1)\nstart = 8")
    run_ok(shell, f"%fsdp load {path}")
    assert nbfsdp.last_run().metric("loss")[-1] == first[-1]  # the load is no run of its own
    # it reached the ranks as a typed request (shared.protocol.LoadCheckpoint), never as source to run
    client = current_session().cluster.client
    sources = client[:].apply_sync(eval, CELL_SOURCES)
    assert sources and not any("load_into" in text or "checkpointing" in text for text in sources)
    # the notebook's own objects hold what was saved (the kernel read them while the ranks loaded theirs)
    _assert_states_equal(_state(shell), saved)
    _assert_optimizers_equal(shell.user_ns["opt"].state_dict(), saved_optimizer)
    assert shell.user_ns["sched"].last_epoch == 8
    run_ok(shell, TRAIN.format(n=2))
    assert shell.user_ns["losses"] == second
    # notebook and ranks agreed after the load: the model and optimizer were not sent again
    state_bytes = sum(t.numel() * t.element_size() for t in final.values())
    assert nbfsdp.last_run().sent_bytes[0] + state_bytes <= sent_with_model
    _assert_states_equal(_state(shell), final)
    _assert_optimizers_equal(shell.user_ns["opt"].state_dict(), final_optimizer)
    assert shell.user_ns["sched"].last_epoch == 16


@pytest.mark.slow
@pytest.mark.floor
def test_reshard_from_four_ranks_to_one_two_and_three(shell, tmp_path, capsys):
    """Saved at 4 ranks, each writing about a quarter; loaded at 1, 3 and 2: the same full state dicts."""
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh(width=512)\nstart = 0")
    run_ok(shell, TRAIN.format(n=4).replace("for x, y in loader:", "for x, y in list(loader)[:2]:"))
    saved_model, saved_optimizer = _state(shell), shell.user_ns["opt"].state_dict()
    path = tmp_path / "four"
    manifest = nbfsdp.save(path)
    assert manifest.world_size == 4 and manifest.step == 2
    assert manifest.optimizers == {"opt": "model"} and manifest.schedulers == {"sched": "opt"}
    total = sum(manifest.bytes_per_rank)
    for written in manifest.bytes_per_rank:  # each rank its own shards: about a quarter of the bytes
        assert abs(written - total / 4) < 0.1 * total / 4, manifest.bytes_per_rank
    for world_size in (1, 3, 2):  # 2 last: the world it leaves is the one the next tests run in, not restarted
        run_ok(shell, "model, opt, sched, loader = fresh(seed=5, width=512)")
        capsys.readouterr()
        run_ok(shell, f"%fsdp load {path} --world-size {world_size}")
        out = capsys.readouterr().out
        assert "RNG states and data positions do not carry over" in out
        assert nbfsdp._magics.session.cluster.world.world_size == world_size
        _assert_states_equal(_state(shell), saved_model)
        _assert_optimizers_equal(shell.user_ns["opt"].state_dict(), saved_optimizer)
        assert shell.user_ns["sched"].last_epoch == 2
    run_ok(shell, "model, opt, sched, loader = fresh(seed=5, width=512)")
    untouched = _state(shell)
    run_ok(shell, f"%fsdp load {path} --load-ignore-keys optimizers.*")
    _assert_states_equal(_state(shell), saved_model)
    assert not shell.user_ns["opt"].state and shell.user_ns["sched"].last_epoch == 0  # skipped, with its scheduler
    assert not torch.equal(untouched["head.weight"], saved_model["head.weight"])


@pytest.mark.slow
def test_incomplete_checkpoints_are_listed_as_such_and_refused(shell, tmp_path, capsys):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nstart = 0")
    run_ok(shell, SEED.format(n=2))
    run_ok(shell, TRAIN.format(n=2))
    run_ok(shell, f"%fsdp save {tmp_path / 'done'}")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "__0_0.distcp").write_bytes(b"\0" * 10)
    (tmp_path / ".writing.partial-0a1b").mkdir()
    found = {info.name: info for info in nbfsdp.checkpoints(tmp_path)}
    assert set(found) == {"done", "broken", "writing"}
    assert found["done"].complete and found["done"].step == 8 and found["done"].world_size == 2
    assert not found["broken"].complete and not found["writing"].complete
    capsys.readouterr()
    run_ok(shell, f"%fsdp checkpoints {tmp_path}")
    table = capsys.readouterr().out
    assert "broken" in table and "no (incomplete)" in table and "done" in table
    error, _ = run_failing(shell, f"%fsdp load {tmp_path / 'broken'}")
    assert isinstance(error, UsageError) and "incomplete" in str(error)
    error, _ = run_failing(shell, f"%fsdp save {tmp_path / 'done'}")
    assert isinstance(error, UsageError) and "--overwrite" in str(error)
    before = (tmp_path / "done" / MANIFEST).read_text()
    run_ok(shell, "start = 8")
    run_ok(shell, TRAIN.format(n=2))
    run_ok(shell, f"%fsdp save {tmp_path / 'done'} --overwrite")
    assert (tmp_path / "done" / MANIFEST).read_text() != before
    assert [info.name for info in list_checkpoints(tmp_path) if info.complete] == ["done"]


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_nothing_complete(shell, tmp_path):
    run_ok(shell, "import torch.nn as nn\nbig = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)])")
    run_ok(shell, "%%fsdp --world-size 2\nbig")
    session = nbfsdp._magics.session
    world = session.cluster.world
    path = tmp_path / "big"
    errors: list[BaseException] = []

    def save() -> None:
        try:
            nbfsdp.save(path)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.monotonic() + 120  # a hang guard: rank 0 starts writing within seconds
    while not any(p.glob("__0_*.distcp") for p in tmp_path.glob(".big.partial-*")):
        assert time.monotonic() < deadline and thread.is_alive(), "the save never started writing"
        time.sleep(0.005)
    os.kill(world.pids[1], 9)
    thread.join(120)
    assert errors and "rank 1: engine died while saving" in str(errors[0]), errors
    assert not path.exists()
    assert [(info.name, info.complete) for info in list_checkpoints(tmp_path)] == [("big", False)]
    run_ok(shell, "%%fsdp --world-size 2\nx = rank")  # the next cell starts a new world


@pytest.mark.slow
def test_bad_input_is_refused_and_nothing_changes(shell, tmp_path):
    run_ok(shell, "%fsdp stop")
    error, _ = run_failing(shell, f"%fsdp save {tmp_path / 'none'}")
    assert isinstance(error, UsageError) and "no world" in str(error)
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nstart = 0")
    run_ok(shell, TRAIN.format(n=2))
    path = tmp_path / "net"
    run_ok(shell, f"%fsdp save {path}")
    error, _ = run_failing(shell, f"%fsdp load {tmp_path / 'missing'}")
    assert isinstance(error, UsageError) and "no such checkpoint" in str(error)

    session = nbfsdp._magics.session
    generation, last = session.cluster.world.generation, nbfsdp.last_run()
    other = "model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 6))"
    run_ok(shell, other + "\nopt = torch.optim.AdamW(model.parameters())")
    before = _state(shell)
    error, _ = run_failing(shell, f"%fsdp load {path}")
    assert isinstance(error, UsageError)
    assert "models.model.body.0.weight" in str(error) and "models.model.0.weight" in str(error)
    _assert_states_equal(_state(shell), before)
    run_ok(shell, "model = Net(width=16)\nopt = torch.optim.AdamW(model.parameters())")
    error, _ = run_failing(shell, f"%fsdp load {path}")
    assert "shapes differ" in str(error) and "models.model.body.0.weight [32, 8] vs [16, 8]" in str(error)
    run_ok(shell, "del model")
    error, _ = run_failing(shell, f"%fsdp load {path}")
    assert isinstance(error, UsageError) and "model" in str(error) and "not nn.Modules in the notebook" in str(error)
    assert session.cluster.world.generation == generation and nbfsdp.last_run() is last  # no engine touched


def _fake(folder, name: str, step: int) -> None:
    (folder / name).mkdir()
    (folder / name / "__0_0.distcp").write_bytes(b"\0" * 4)
    manifest = Manifest(step=step, world_size=1, created=f"2026-01-0{step}T00:00:00+00:00", torch="", nbfsdp="")
    (folder / name / MANIFEST).write_text(manifest.to_json())


def test_keeping_the_latest_k_removes_the_oldest_complete_ones_and_never_a_partial(tmp_path):
    for step in (3, 1, 2):
        _fake(tmp_path, f"step-{step}", step)
    (tmp_path / ".step-4.partial-00ff").mkdir()
    removed = checkpoints.keep_latest(tmp_path, 2)
    assert removed == [str(tmp_path / "step-1")]
    assert [(i.name, i.complete) for i in list_checkpoints(tmp_path)] == [
        ("step-2", True), ("step-3", True), ("step-4", False),
    ]  # fmt: skip


def test_a_directory_of_other_files_is_never_replaced_even_with_overwrite(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="other files"):
        checkpoints.check_target(tmp_path / "data", overwrite=True)
    _fake(tmp_path, "old", 1)
    checkpoints.check_target(tmp_path / "old", overwrite=True)
    with pytest.raises(CheckpointError, match="--overwrite"):
        checkpoints.check_target(tmp_path / "old", overwrite=False)


def test_ignore_globs_match_an_entry_or_what_is_under_it():
    assert checkpoints.ignored("optimizers.opt", ["optimizers.*"])
    assert checkpoints.ignored("optimizers.opt", ["optimizers.opt.*"])
    assert checkpoints.ignored("rng.rank0", ["rng*"])
    assert checkpoints.ignored("models.model.head.weight", ["models.model.head.*"])
    assert not checkpoints.ignored("models.model.body.0.weight", ["models.model.head.*"])
    assert not checkpoints.ignored("optimizers.opt2", ["optimizers.opt.*"])


@pytest.mark.slow
def test_a_saved_checkpoint_exports_to_one_file_that_a_plain_model_loads(shell, tmp_path, capsys):
    """``%fsdp save`` then ``%fsdp export``: the notebook's trained weights, in one file, without engines."""
    from safetensors.torch import load_file

    run_ok(shell, NOTEBOOK + "model, opt, sched, loader = fresh()\nstart = 0\n")
    run_ok(shell, TRAIN.format(n=2))
    trained = _state(shell)
    run_ok(shell, f"%fsdp save {tmp_path / 'ck'}")
    run_ok(shell, "%fsdp stop")  # export reads the files alone
    run_ok(shell, f"%fsdp export {tmp_path / 'ck'} {tmp_path / 'net.pt'}")
    run_ok(shell, f"%fsdp export {tmp_path / 'ck'} {tmp_path / 'net.safetensors'} --dtype bf16")
    assert "nbfsdp: wrote" in capsys.readouterr().out
    plain = shell.user_ns["Net"]()
    plain.load_state_dict(torch.load(tmp_path / "net.pt"), strict=True)
    _assert_states_equal(_state_of(plain), trained)
    _assert_states_equal(load_file(tmp_path / "net.safetensors"), {k: v.bfloat16() for k, v in trained.items()})
    assert nbfsdp.export is not None and "export" in nbfsdp.__all__
    with pytest.raises(UsageError, match="invalid choice: .int8."):
        shell.run_line_magic("fsdp", f"export {tmp_path / 'ck'} {tmp_path / 'x.pt'} --dtype int8")


def _state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


#: Steps ``first`` .. ``stop - 1`` through the loader's epochs (8 steps an epoch).
EPOCHS = """%%fsdp --world-size 2 {flags}
step = first
while step < stop:
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        nbfsdp.log(step=step)
        step += 1
        if step == stop:
            break
"""


def _loader_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("nbfsdp: loader:"))


@pytest.mark.slow
def test_after_a_load_the_loader_line_names_the_epoch_the_loader_resumes_in(shell, tmp_path, capsys):
    """Epoch 1 in one cell, then epochs 2 and 3 with saves every 4 steps; after each load (fresh objects; the
    first into a fresh world, as after a kernel restart, the others into the running one) the next cell's line
    names the epoch that cell continues or begins."""
    run_ok(shell, "%fsdp stop")
    run_ok(shell, NOTEBOOK)
    run_ok(shell, "model, opt, sched, loader = fresh()\nfirst, stop = 0, 8")
    run_ok(shell, EPOCHS.format(flags=""))
    folder = tmp_path / "ckpt"
    run_ok(shell, "first, stop = 8, 20")  # the second cell's saves count the first cell's epoch too
    capsys.readouterr()
    run_ok(shell, EPOCHS.format(flags=f"--save-folder {folder} --save-interval 4"))
    assert _loader_line(capsys.readouterr().out).endswith("(epoch 2)")
    # step-12: 4 batches into epoch 2; step-16: epoch 2 done; step-20: 4 batches into epoch 3. The line is the
    # kernel's, from the new loader's loaded position, world stopped or not: one stop (a cluster's start costs
    # seconds of CPU) gives the first load its fresh world
    run_ok(shell, "%fsdp stop")
    for name, epoch in (("step-16", 3), ("step-12", 2), ("step-20", 3)):
        run_ok(shell, "model, opt, sched, loader = fresh(seed=1)")
        run_ok(shell, f"%fsdp load {folder / name} --world-size 2")
        run_ok(shell, f"first = {int(name[5:])}\nstop = first + 1")
        capsys.readouterr()
        run_ok(shell, EPOCHS.format(flags=""))
        assert _loader_line(capsys.readouterr().out).endswith(f"(epoch {epoch})"), name
