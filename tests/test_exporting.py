"""Checkpoints read in the kernel without engines (``nbfsdp.kernel.checkpoints.exporting``), and full-weights files
read into a sharded world one shard per rank (``nbfsdp.shared.weights_files``).

Checkpoints are written the real way: a 2-rank ``%%fsdp`` cell trains, saves with ``dcp.save`` in the
checkpoint format (``models`` / ``optimizers`` / ``schedulers`` / ``rng``, per-rank values under rank
keys) and rank 0 writes the manifest; the cell also gathers the model's own full state dict, the
reference every comparison here is bitwise against.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from IPython.core.error import UsageError
from safetensors.torch import load_file, save_file

from nbfsdp.kernel.checkpoints.exporting import export, load_into
from nbfsdp.shared.weights_files import full_weights_reader
from tests.conftest import TINY_MODEL, run_ok

pytestmark = pytest.mark.timeout(240)

#: Trains ``steps`` steps, saves a checkpoint of ``model``, ``opt`` and ``sched`` into CKPT, gathers ``full``.
SAVE = """%%fsdp --world-size 2
import json, os, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
for step in range(2):
    x, y = BATCH(rank, step)
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad(); sched.step()
state = {
    "models": {"model": get_model_state_dict(model)},
    "optimizers": {"opt": get_optimizer_state_dict(model, opt)},
    "schedulers": {"sched": sched.state_dict()},
    "rng": {f"rank{rank}": {"torch": torch.get_rng_state()}},
}
dcp.save(state, checkpoint_id=CKPT)
dist.barrier()
if rank == 0:
    manifest = {
        "format": 1, "step": 2, "world_size": world_size, "created": "2026-01-01T00:00:00", "torch": torch.__version__,
        "nbfsdp": "test", "models": {"model": {"class": type(model).__qualname__, "parameters": 0, "fsdp": {}}},
        "optimizers": {"opt": "model"}, "schedulers": {"sched": "opt"}, "loaders": [], "bytes_per_rank": [0, 0],
    }
    with open(os.path.join(CKPT, "nbfsdp.json"), "w") as f:
        json.dump(manifest, f)
full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
del state
"""

#: A model whose embedding and head are one tied parameter, with an odd first dimension (11 rows on 2 ranks).
TIED = """
import torch, torch.nn as nn

class Tied(nn.Module):
    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
    def forward(self, idx):
        return self.head(self.norm(self.tokens(idx)))

def tied_batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randn(4, 5, 11, generator=g)

loss_fn = nn.MSELoss()
torch.manual_seed(0)
model = Tied()
"""


def _save(shell, checkpoint: Path, batch: str) -> dict[str, torch.Tensor]:
    run_ok(shell, SAVE.replace("CKPT", repr(str(checkpoint))).replace("BATCH", batch))
    return shell.user_ns["full"]


@pytest.fixture(scope="module")
def net_checkpoint(shell, tmp_path_factory):
    """A checkpoint of conftest's Net after 2 AdamW steps (head: 1 row on 2 ranks), its full state dict, and
    the optimizer's state as the cell brought it back to the notebook."""
    path = tmp_path_factory.mktemp("net") / "ckpt" / "manual"
    run_ok(shell, TINY_MODEL + "\ntorch.manual_seed(0)\nmodel = Net()\n")
    full = _save(shell, path, "batch_for")
    return path, full, copy.deepcopy(shell.user_ns["opt"].state_dict())


@pytest.fixture(scope="module")
def tied_checkpoint(shell, tmp_path_factory):
    run_ok(shell, TIED)
    path = tmp_path_factory.mktemp("tied") / "tied"
    return path, _save(shell, path, "tied_batch")


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_export_pt_loads_strictly_into_the_plain_model(shell, net_checkpoint, tmp_path):
    checkpoint, full, _ = net_checkpoint
    out = export(checkpoint, tmp_path / "out" / "model.pt")
    assert out == tmp_path / "out" / "model.pt" and out.is_file()
    assert [p.name for p in out.parent.iterdir()] == ["model.pt"]  # the partial file renamed, none left
    state = torch.load(out, weights_only=True)
    _equal(state, full)
    plain = shell.user_ns["Net"]()
    plain.load_state_dict(state, strict=True)
    _equal(plain.state_dict(), full)


def test_export_safetensors_in_fp32_and_bf16(net_checkpoint, tmp_path):
    checkpoint, full, _ = net_checkpoint
    _equal(dict(sorted(load_file(export(checkpoint, tmp_path / "m.safetensors")).items())), dict(sorted(full.items())))
    cast = load_file(export(checkpoint, tmp_path / "m16.safetensors", dtype="bf16"))
    assert {v.dtype for v in cast.values()} == {torch.bfloat16}
    _equal(dict(sorted(cast.items())), {k: v.to(torch.bfloat16) for k, v in sorted(full.items())})


def test_export_of_tied_weights_writes_each_name(shell, tied_checkpoint, tmp_path):
    checkpoint, full = tied_checkpoint
    assert {"tokens.weight", "head.weight"} <= set(full) and full["tokens.weight"].shape[0] == 11
    for suffix in (".pt", ".safetensors"):
        out = export(checkpoint, tmp_path / f"tied{suffix}", dtype="fp16")
        state = torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out)
        _equal(dict(sorted(state.items())), {k: v.to(torch.float16) for k, v in sorted(full.items())})
        plain = shell.user_ns["Tied"]().half()
        plain.load_state_dict(state, strict=True)
        assert plain.head.weight is plain.tokens.weight  # still tied, holding the saved values
        torch.testing.assert_close(plain.head.weight.detach(), full["head.weight"].half(), rtol=0, atol=0)


def test_load_into_the_notebook_model_optimizer_and_scheduler(shell, net_checkpoint):
    checkpoint, full, opt_state = net_checkpoint
    Net, batch_for, loss_fn = (shell.user_ns[name] for name in ("Net", "batch_for", "loss_fn"))
    torch.manual_seed(1)
    plain = Net()
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    load_into(checkpoint, plain, opt, sched)
    _equal(plain.state_dict(), full)
    got = opt.state_dict()
    assert got["param_groups"] == opt_state["param_groups"]
    assert list(got["state"]) == list(opt_state["state"]) == list(range(len(list(plain.parameters()))))
    for index, entry in opt_state["state"].items():
        _equal(dict(sorted(got["state"][index].items())), dict(sorted(entry.items())))  # any order of keys
    assert sched.last_epoch == 2 and sched.get_last_lr() == [0.01 * 0.5**2] == [g["lr"] for g in opt.param_groups]
    # the next step from the loaded state is the next step of the trained model the cell brought back
    trained = Net()
    trained.load_state_dict(full)
    trained_opt = torch.optim.AdamW(trained.parameters(), lr=0.01)
    trained_opt.load_state_dict(opt_state)
    for model, optimizer in ((plain, opt), (trained, trained_opt)):
        x, y = batch_for(0, 2)
        loss_fn(model(x), y).backward()
        optimizer.step()
    _equal(plain.state_dict(), trained.state_dict())


def test_load_into_refuses_another_model_naming_its_keys(shell, net_checkpoint):
    checkpoint, _, _ = net_checkpoint
    other = shell.user_ns["Net"](width=12, depth=4)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(UsageError, match=r"missing: blocks\.3\..*other shapes: embed\.weight \(checkpoint \[16, 8\]"):
        load_into(checkpoint, other)
    _equal(other.state_dict(), before)  # nothing changed
    with pytest.raises(UsageError, match=r"missing: extra\.weight, extra\.bias; unexpected: embed\.weight"):
        load_into(checkpoint, nn.ModuleDict({"extra": nn.Linear(1, 1)}))


def _two_models(tmp_path: Path) -> Path:
    """A checkpoint of two models written in this process (DCP without a process group)."""
    path = tmp_path / "two"
    models = {"a": nn.Linear(3, 2).state_dict(), "b": nn.Linear(2, 5).state_dict()}
    with warnings.catch_warnings():  # no process group, as intended
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"models": models}, checkpoint_id=str(path), no_dist=True)
    (path / "nbfsdp.json").write_text(json.dumps({"format": 1, "models": {"a": {}, "b": {}}}))
    return path


def test_several_models_need_model(tmp_path):
    path = _two_models(tmp_path)
    with pytest.raises(UsageError, match=r"several models: pass model= one of \['a', 'b'\]"):
        export(path, tmp_path / "x.pt")
    with pytest.raises(UsageError, match=r"no model 'c': its models are \['a', 'b'\]"):
        export(path, tmp_path / "x.pt", model="c")
    state = torch.load(export(path, tmp_path / "b.pt", model="b"), weights_only=True)
    assert state["weight"].shape == (5, 2)


def test_bad_input_is_a_usage_error_naming_the_choices(tmp_path, monkeypatch):
    good = _two_models(tmp_path)
    with pytest.raises(UsageError, match=r"unknown weights file suffix '\.bin'; use one of \.pt, \.safetensors"):
        export(good, tmp_path / "x.bin", model="a")
    with pytest.raises(UsageError, match="unknown dtype 'int8': use one of fp32, bf16, fp16"):
        export(good, tmp_path / "x.pt", model="a", dtype="int8")
    with pytest.raises(UsageError, match="no checkpoint at .*nowhere"):
        export(tmp_path / "nowhere", tmp_path / "x.pt")
    (good / "nbfsdp.json").rename(tmp_path / "aside.json")  # as a save that died before its manifest
    with pytest.raises(UsageError, match="not a complete checkpoint"):
        export(good, tmp_path / "x.pt", model="a")
    partial = tmp_path / ".two.partial-0a1b"
    good.rename(partial)
    (tmp_path / "aside.json").rename(partial / "nbfsdp.json")
    with pytest.raises(UsageError, match="not a complete checkpoint"):
        export(partial, tmp_path / "x.pt", model="a")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if the optional extra were not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UsageError, match=r"needs the safetensors package: pip install 'nbfsdp\[examples\]'"):
        export(partial, tmp_path / "x.safetensors", model="a")
    assert not list(tmp_path.glob("x.*")) and not list(tmp_path.glob(".x.*"))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_full_weights_load_into_a_sharded_world_a_shard_per_rank(shell, tiny_model, tmp_path, suffix):
    torch.manual_seed(7)
    weights = {k: v.clone() for k, v in shell.user_ns["Net"]().state_dict().items()}  # not the model's
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(weights, path)
    else:
        save_file(weights, str(path))
    run_ok(
        shell,
        f"""%%fsdp --world-size 2
from nbfsdp.shared.weights_files import full_weights_reader
from torch.distributed.tensor import DTensor
with full_weights_reader({str(path)!r}) as reader:
    reader.load_into(model)
read_bytes = reader.bytes_read
loaded = {{k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}}
""",
    )
    _equal(shell.user_ns["loaded"], weights)
    _equal(tiny_model.state_dict(), weights)  # gathered back into the notebook's model after the cell
    # rank 0 read only its rows: the first ceil(n/2) rows of each parameter, every buffer whole (none here)
    rank0 = sum(-(-v.shape[0] // 2) * v[0].numel() * v.element_size() for v in weights.values())
    total = sum(v.numel() * v.element_size() for v in weights.values())
    assert shell.user_ns["read_bytes"] == rank0 < 0.6 * total


def test_a_tied_model_loads_from_a_file_that_keeps_one_name_of_the_tie(shell, tmp_path):
    """Hugging Face's safetensors files drop a tie's duplicate name: the reader reads it once, under the other."""
    run_ok(shell, TIED)  # a fresh Tied as the notebook's model: 11 rows, 6 on rank 0 and 5 on rank 1
    torch.manual_seed(3)
    weights = {k: v.clone() for k, v in shell.user_ns["Tied"]().state_dict().items() if k != "head.weight"}
    save_file(weights, str(tmp_path / "hf.safetensors"))
    run_ok(
        shell,
        f"""%%fsdp --world-size 2
from nbfsdp.shared.weights_files import full_weights_reader
with full_weights_reader({str(tmp_path / "hf.safetensors")!r}) as reader:
    reader.load_into(model)
tokens, head = model.tokens.weight.full_tensor(), model.head.weight.full_tensor()
""",
    )
    torch.testing.assert_close(shell.user_ns["tokens"], weights["tokens.weight"], rtol=0, atol=0)
    torch.testing.assert_close(shell.user_ns["head"], weights["tokens.weight"], rtol=0, atol=0)


def test_a_reader_refuses_a_file_of_another_model(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"weight": torch.zeros(2, 3), "other": torch.zeros(1)}, path)
    with full_weights_reader(path) as reader, pytest.raises(ValueError, match="missing bias; unexpected other"):
        reader.load_into(nn.Linear(3, 2))
    with full_weights_reader(path) as reader, pytest.raises(ValueError, match=r"shape \[2, 3\], the model \[3, 3\]"):
        reader.read("weight", torch.zeros(3, 3))
    with pytest.raises(ValueError, match="unknown weights file suffix"):
        full_weights_reader(tmp_path / "w.ckpt")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_fsdp_load_of_a_full_weights_file_reads_a_shard_per_rank(shell, net_checkpoint, tmp_path, suffix):
    """``%fsdp load FILE``: the file exported by ``%fsdp export`` (or ``torch.save`` of a state dict) goes
    into the notebook's model on 2 ranks, each reading only its rows, and back into the notebook's model."""
    checkpoint, full, _ = net_checkpoint
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        run_ok(shell, f"%fsdp export {checkpoint} {path}")
    else:
        torch.save(full, path)
    run_ok(shell, "%fsdp stop")  # a fresh world: the load starts it
    run_ok(shell, "torch.manual_seed(5)\nmodel = Net()\nsmall = Net(width=12)")  # other weights; one that fits not
    import nbfsdp

    read = nbfsdp.load(path, world_size=2)
    _equal(shell.user_ns["model"].state_dict(), full)  # the notebook's model, in place
    total = sum(v.numel() * v.element_size() for v in full.values())
    assert sum(read) == total and max(read) < 0.6 * total, read  # each row read once, by the rank holding it
    run_ok(
        shell,
        "%%fsdp --world-size 2\nfrom torch.distributed.tensor import DTensor\n"
        "on_ranks = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}",
    )
    _equal(shell.user_ns["on_ranks"], full)  # the ranks' shards hold the file's weights


def test_fsdp_load_of_a_weights_file_that_fits_no_model_changes_nothing(shell, net_checkpoint, tmp_path):
    _, full, _ = net_checkpoint
    path = tmp_path / "weights.pt"
    torch.save(full, path)
    run_ok(shell, "torch.manual_seed(5)\nsmall = Net(width=12)\nother = Net(width=12)")
    for name in ("model", "same", "twin"):  # the shared shell may hold them from an earlier test, in another order
        shell.user_ns.pop(name, None)
    before = {k: v.clone() for k, v in shell.user_ns["small"].state_dict().items()}
    result = shell.run_cell(f"%fsdp load {path} --model small")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert "does not fit small" in message and "embed.weight [16, 8] vs [12, 8]" in message, message
    _equal(shell.user_ns["small"].state_dict(), before)
    result = shell.run_cell(f"%fsdp load {path}")
    message = str(result.error_in_exec)
    assert "fits no model in the notebook" in message and "small" in message and "other" in message, message
    run_ok(shell, "model = Net()\nsame = model\ntwin = Net()")  # two names of one model count once
    result = shell.run_cell(f"%fsdp load {path}")
    assert "fits several models in the notebook (model, twin): pass --model NAME" in str(result.error_in_exec)
    _equal(shell.user_ns["small"].state_dict(), before)


def test_nbfsdp_load_into_a_plain_model_touches_no_engine(shell, net_checkpoint):
    import nbfsdp

    checkpoint, full, opt_state = net_checkpoint
    run_ok(shell, "%fsdp stop")
    cluster = nbfsdp._magics.session.cluster
    torch.manual_seed(1)
    plain = shell.user_ns["Net"]()
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert nbfsdp.load(checkpoint, into=plain, optimizer=opt, scheduler=sched) is None
    _equal(plain.state_dict(), full)
    assert opt.state_dict()["param_groups"] == opt_state["param_groups"] and sched.last_epoch == 2
    assert cluster.world is None  # no engine started
    with pytest.raises(UsageError, match="world_size and load_ignore_keys do not apply"):
        nbfsdp.load(checkpoint, world_size=2, into=plain)
