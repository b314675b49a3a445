"""A plain training loop, unchanged, under ``%%fsdp``: the notebook's DataLoader split across the ranks,
the notebook's optimizer and LR scheduler sharded and brought back, the same math as one process."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.floor

#: The notebook: data whose first feature is the sample's index (so ranks can say what they saw),
#: a model, and a reference copy of everything for the plain loop.
NOTEBOOK = """
import copy, torch, torch.nn as nn, nbfsdp
from torch.utils.data import DataLoader, TensorDataset, IterableDataset
torch.manual_seed(0)
N_SAMPLES = {samples}
X = torch.cat([torch.arange(N_SAMPLES).float()[:, None], torch.randn(N_SAMPLES, 7)], dim=1)
Y = torch.randn(N_SAMPLES, 1)
dataset = TensorDataset(X, Y)

def make_loader(batch_size, **kwargs):
    return DataLoader(dataset, batch_size=batch_size, **kwargs)

model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
reference = copy.deepcopy(model)
"""

#: One epoch of a plain loop; the same text runs in the notebook and under %%fsdp.
EPOCH = """
for x, y in {loader}:
    loss = nn.functional.mse_loss({model}(x), y)
    loss.backward(); {opt}.step(); {opt}.zero_grad(); {sched}.step()
    nbfsdp.log(loss=loss.item())
    {losses}.append(loss.item())
"""


def _notebook(shell, samples: int = 48) -> None:
    run_ok(shell, NOTEBOOK.format(samples=samples))


def _epoch(loader: str, model: str = "model", opt: str = "opt", sched: str = "sched", losses: str = "losses") -> str:
    return EPOCH.format(loader=loader, model=model, opt=opt, sched=sched, losses=losses)


def _run_losses(world_size: int) -> list[float]:
    """The global loss of each step of the last run: the mean of the ranks' losses over equal parts."""
    run = nbfsdp.last_run()
    per_rank = [run.metric("loss", rank=r) for r in range(world_size)]
    return [sum(step) / world_size for step in zip(*per_rank, strict=True)]


def _assert_same_model(shell) -> None:
    ns = shell.user_ns
    for (name, trained), (_, expected) in zip(
        ns["model"].named_parameters(), ns["reference"].named_parameters(), strict=True
    ):
        torch.testing.assert_close(trained, expected, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(  # by world size, 2 last as the tests below: another size restarts controller and engines
    ("shuffle", "world_size"), [(shuffle, world_size) for world_size in (1, 4, 2) for shuffle in ("seeded", "none")]
)
def test_a_notebook_loader_trains_as_the_plain_loop(shell, world_size, shuffle):
    """Losses every step and the final parameters equal one process's, over two epochs."""
    _notebook(shell)
    options = "shuffle=True, generator=torch.Generator().manual_seed(7)" if shuffle == "seeded" else ""
    run_ok(
        shell,
        f"""
loader, ref_loader = make_loader(16, {options}), make_loader(16, {options})
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
expected = []
for epoch in range(2):
{_epoch("ref_loader", "reference", "ref_opt", "ref_sched", "expected").replace(chr(10), chr(10) + "    ")}
""",
    )
    run_ok(
        shell,
        f"""%%fsdp --world-size {world_size} --mixed-precision FULL
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
losses = []
for epoch in range(2):
{_epoch("loader").replace(chr(10), chr(10) + "    ")}
""",
    )
    got = _run_losses(world_size)
    assert len(got) == 2 * 3  # 48 samples in batches of 16: len(loader) is unchanged by the split
    torch.testing.assert_close(torch.tensor(got), torch.tensor(shell.user_ns["expected"]))
    _assert_same_model(shell)
    config = nbfsdp.last_run().config["loaders"]["loader"]
    assert config == {
        "mode": "split",
        "batch_size": 16,
        "per_rank": 16 // world_size,
        "steps_per_epoch": 3,
        "last_batch": "",
        "epoch": 1,
    }


WHAT_EACH_RANK_SAW = """%%fsdp --world-size 2 {flags}
seen, sizes = [], []
for epoch in range({epochs}):
    for x, y in {loader}:
        seen.append(x[:, 0].long().tolist())
        sizes.append(len(x))
every_rank = [None] * world_size
torch.distributed.all_gather_object(every_rank, (seen, sizes))
try:
    steps = len({loader})
except TypeError:  # an IterableDataset without a length
    steps = None
"""


def _what_each_rank_saw(shell, loader: str = "loader", epochs: int = 1, flags: str = "") -> list[tuple[list, list]]:
    """(sample indices of each step, batch sizes) of rank 0 and rank 1, reading ``loader`` in a 2-rank cell."""
    run_ok(shell, WHAT_EACH_RANK_SAW.format(flags=flags, epochs=epochs, loader=loader))
    return shell.user_ns["every_rank"]


@pytest.mark.timeout(120)
def test_each_rank_gets_its_own_part_of_every_batch_and_together_they_cover_the_epoch(shell, capsys):
    _notebook(shell, samples=40)
    run_ok(shell, "loader = make_loader(8, shuffle=True, generator=torch.Generator().manual_seed(3))")
    expected_batches = [batch[0][:, 0].long().tolist() for batch in shell.user_ns["make_loader"](
        8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )]  # fmt: skip
    (seen0, sizes0), (seen1, sizes1) = _what_each_rank_saw(shell)
    assert sizes0 == sizes1 == [4] * 5
    assert shell.user_ns["steps"] == 5
    for step, batch in enumerate(expected_batches):  # the notebook loader's own batches, halved
        assert seen0[step] == batch[:4] and seen1[step] == batch[4:]
    assert sorted(i for b in seen0 + seen1 for i in b) == list(range(40))
    assert "nbfsdp: loader: batches of 8 split 4 per rank, 5 steps per epoch (epoch 1)" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_epochs_continue_across_cells_with_a_new_shuffle_each_and_the_notebook_continues_it(shell, capsys):
    """Also without a generator of the loader's own: one order on every rank, another each epoch."""
    _notebook(shell, samples=24)
    run_ok(shell, "loader = make_loader(6, shuffle=True)")
    (seen0, _), (seen1, _) = _what_each_rank_saw(shell, epochs=2)
    epochs = [sorted(i for b in seen0[e * 4 : e * 4 + 4] + seen1[e * 4 : e * 4 + 4] for i in b) for e in range(2)]
    assert epochs[0] == epochs[1] == list(range(24))  # each epoch covers the data once, over both ranks
    first_order = [seen0[s] + seen1[s] for s in range(8)]
    assert first_order[:4] != first_order[4:]  # a new shuffle in the second epoch
    (seen0, _), (seen1, _) = _what_each_rank_saw(shell)
    third = [seen0[s] + seen1[s] for s in range(4)]
    assert third not in (first_order[:4], first_order[4:])  # the next cell goes on to epoch 3
    assert "(epoch 3)" in capsys.readouterr().out
    assert nbfsdp.last_run().config["loaders"]["loader"]["epoch"] == 3


@pytest.mark.timeout(120)
def test_with_a_seeded_generator_the_notebook_loader_goes_on_where_the_ranks_left_it(shell):
    _notebook(shell, samples=24)
    seeded = "make_loader(6, shuffle=True, generator=torch.Generator().manual_seed(11))"
    run_ok(shell, f"loader, twin = {seeded}, {seeded}\nfirst_epoch = [b[0][:, 0].long().tolist() for b in twin]")
    (seen0, _), (seen1, _) = _what_each_rank_saw(shell)
    assert [seen0[s] + seen1[s] for s in range(4)] == shell.user_ns["first_epoch"]
    run_ok(
        shell,
        "assert [b[0][:, 0].long().tolist() for b in loader] == [b[0][:, 0].long().tolist() for b in twin]",
    )


@pytest.mark.timeout(120)
def test_per_rank_batches_gives_each_rank_whole_batches(shell, capsys):
    _notebook(shell, samples=40)
    run_ok(shell, "loader = make_loader(4)")
    (seen0, sizes0), (seen1, sizes1) = _what_each_rank_saw(shell, flags="--per-rank-batches")
    assert sizes0 == sizes1 == [4] * 5 and shell.user_ns["steps"] == 5  # 10 batches, 5 steps of 2 x 4 samples
    assert seen0 == [list(range(b * 4, b * 4 + 4)) for b in range(0, 10, 2)]
    assert seen1 == [list(range(b * 4, b * 4 + 4)) for b in range(1, 10, 2)]
    assert "whole batches of 4 per rank" in capsys.readouterr().out
    assert nbfsdp.last_run().config["loaders"]["loader"]["mode"] == "per_rank"


@pytest.mark.timeout(60)
def test_a_batch_the_ranks_do_not_divide_is_refused_before_anything_runs_naming_both_fixes(shell):
    _notebook(shell)
    run_ok(shell, "loader = make_loader(10)")
    runs_before = len(nbfsdp.runs())
    error, elapsed = run_failing(shell, "%%fsdp --world-size 4\nfor x, y in loader:\n    pass\n")
    assert isinstance(error, UsageError)
    assert "batch_size 10 does not split across 4 ranks" in str(error)
    assert "8 or 12" in str(error) and "--per-rank-batches" in str(error)
    assert len(nbfsdp.runs()) == runs_before  # nothing was submitted


@pytest.mark.timeout(120)
def test_a_short_last_batch_is_evened_out_and_said(shell, capsys):
    """44 samples in batches of 16: the last batch of 12 splits 6 and 6; of 13 it would hang, so 12 are kept."""
    _notebook(shell, samples=45)
    run_ok(shell, "loader = make_loader(16)")
    (seen0, sizes0), (seen1, sizes1) = _what_each_rank_saw(shell)
    assert sizes0 == sizes1 == [8, 8, 6]
    assert seen0[2] + seen1[2] == list(range(32, 44))  # sample 44 is left out of this epoch
    assert "the last batch of 13 trimmed to 12 (6 per rank)" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_an_iterable_dataset_is_split_into_disjoint_parts(shell):
    _notebook(shell)
    run_ok(
        shell,
        """
class Stream(IterableDataset):
    def __iter__(self):
        for i in range(30):
            yield torch.tensor([float(i), *([0.0] * 7)]), torch.zeros(1)
stream = DataLoader(Stream(), batch_size=4)
""",
    )
    (seen0, sizes0), (seen1, sizes1) = _what_each_rank_saw(shell, "stream")
    assert sizes0 == sizes1 == [2] * 7 + [1]  # 7 batches of 4, then the last 2 samples, one each
    assert [a + b for a, b in zip(seen0, seen1, strict=True)] == [
        list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)
    ]


@pytest.mark.timeout(240)
def test_a_notebook_optimizer_with_state_and_its_scheduler_train_on_and_come_back(shell):
    """A step in a plain cell, two %%fsdp cells, a plain cell again: the same as never leaving one process."""
    _notebook(shell)
    run_ok(
        shell,
        """
gen = lambda: torch.Generator().manual_seed(5)
loader, ref_loader = make_loader(16, shuffle=True, generator=gen()), make_loader(16, shuffle=True, generator=gen())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
expected, losses = [], []
for _ in range(4):
"""
        + _epoch("ref_loader", "reference", "ref_opt", "ref_sched", "expected").replace("\n", "\n    ")
        + "\n"
        + _epoch("loader").replace("nbfsdp.log(loss=loss.item())", "pass"),  # one plain epoch first: state
    )
    sharded = []
    for _ in range(2):
        run_ok(
            shell,
            "%%fsdp --world-size 2 --mixed-precision FULL\ncell_losses = []" + _epoch("loader", losses="cell_losses"),
        )
        sharded += _run_losses(2)
    run_ok(shell, _epoch("loader"))  # and a plain cell goes on from where the ranks stopped
    ns = shell.user_ns
    got = ns["losses"][:3] + sharded + ns["losses"][3:]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ns["expected"]))
    _assert_same_model(shell)
    assert ns["sched"].get_last_lr() == ns["ref_sched"].get_last_lr()
    for trained, expected in zip(ns["model"].parameters(), ns["reference"].parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(ns["opt"].state[trained][key], ns["ref_opt"].state[expected][key])


@pytest.mark.timeout(120)
def test_an_optimizer_and_scheduler_made_in_the_cell_come_back_bound_to_the_notebook_model(shell):
    _notebook(shell)
    run_ok(shell, "loader = make_loader(16)")
    run_ok(
        shell,
        "%%fsdp --world-size 2 --mixed-precision FULL\n"
        "made = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "made_sched = torch.optim.lr_scheduler.LambdaLR(made, lambda step: 0.5 ** step)\n"
        "cell_losses = []" + _epoch("loader", opt="made", sched="made_sched", losses="cell_losses"),
    )
    ns = shell.user_ns
    made, model = ns["made"], ns["model"]
    assert isinstance(made, torch.optim.SGD) and ns["made_sched"].optimizer is made
    assert all(p is q for p, q in zip(made.param_groups[0]["params"], model.parameters(), strict=True))
    assert all(made.state[p]["momentum_buffer"].shape == p.shape for p in model.parameters())
    assert made.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


@pytest.mark.timeout(240)
def test_an_optimizer_the_ranks_hold_is_not_sent_again_until_the_notebook_changes_it(shell):
    """After a cell brings its state back, the ranks' optimizer and scheduler are the notebook's: the next
    cell sends neither (its payload shrinks by the optimizer's state) and trains on theirs. A change in
    the notebook (a learning rate, the model's weights) sends them again, and the change takes effect."""
    _notebook(shell, samples=64)
    run_ok(
        shell,
        "loader = make_loader(16)\nopt = torch.optim.AdamW(model.parameters(), lr=1e-2)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)",
    )
    cell = "%%fsdp --world-size 2 --mixed-precision FULL\ncell_losses = []" + _epoch("loader", losses="cell_losses")
    ns = shell.user_ns
    state_bytes = lambda: sum(  # noqa: E731
        t.numel() * t.element_size() for s in ns["opt"].state.values() for t in s.values() if torch.is_tensor(t)
    )
    weights = lambda: [p.detach().clone() for p in ns["model"].parameters()]  # noqa: E731
    run_ok(shell, cell)  # the optimizer goes to the ranks (no state yet) and comes back with state
    run_ok(shell, cell)
    kept = nbfsdp.last_run().sent_bytes[0]
    run_ok(shell, "for group in opt.param_groups:\n    group['lr'] = 0.0")  # a change in the notebook
    before = weights()
    run_ok(shell, cell)
    resent = nbfsdp.last_run().sent_bytes[0]
    assert resent - kept >= state_bytes() > 0, (resent, kept, state_bytes())
    for p, q in zip(weights(), before, strict=True):  # it took effect: learning rate 0, nothing moved
        torch.testing.assert_close(p, q, rtol=0, atol=0)

    run_ok(shell, "for group in opt.param_groups:\n    group['lr'] = 1e-2")
    run_ok(shell, cell)  # sent again (the learning rate), and held since
    run_ok(shell, "with torch.no_grad():\n    model[0].weight.add_(1.0)")  # the model goes to the ranks again
    changed = weights()
    run_ok(shell, cell)
    assert nbfsdp.last_run().sent_bytes[0] - kept >= state_bytes()  # so does its optimizer, pointing at it
    assert all(not torch.equal(p, q) for p, q in zip(weights(), changed, strict=True))  # and it trains it
