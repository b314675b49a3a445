"""``%fsdp export-script``: the last cell as a torchrun script that computes what the cell computes, run
under a real ``torchrun`` (gloo, 2 ranks); and a torchrun script pasted into a cell, its own
``init_process_group``/``destroy_process_group`` taken as the world's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.checkpoints.export_script import export_script
from nbfsdp.kernel.run.history import LastCell
from nbfsdp.shared.config import FSDPConfig, for_device
from nbfsdp.shared.devices import Devices
from tests.conftest import logged_losses, run_failing, run_ok, torchrun

pytestmark = pytest.mark.timeout(300)

NOTEBOOK = """
import torch, torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WIDTH = 16

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.blocks(x))

def loss_fn(out, y):
    return F.mse_loss(out.float(), y)

torch.manual_seed(0)
net = Net()
class Pairs(Dataset):  # its base named only in the class's header: the script must import it
    def __init__(self, n):
        self.x, self.y = torch.randn(n, WIDTH), torch.randn(n, 1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

loader = DataLoader(Pairs(64), batch_size=16, shuffle=True)
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
"""
CELL = """%%fsdp --world-size 2 --wrap-cls Block
for x, y in loader:
    loss = loss_fn(net(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(loss=loss.item())
"""


def _torchrun(script, ranks: int) -> list[list[float]]:
    """Each rank's logged losses from the script run under torchrun."""
    return logged_losses(torchrun(script, ranks), ranks)


def test_the_exported_script_computes_what_the_cell_computes(shell, tmp_path, capsys):
    run_ok(shell, NOTEBOOK)
    run_ok(shell, CELL)  # a first epoch: the optimizer has state, the loader's shuffle has moved on
    capsys.readouterr()
    run_ok(shell, f"%fsdp export-script {tmp_path / 'train.py'}")
    said = capsys.readouterr().out
    assert f"run it with: torchrun --nproc-per-node 2 {tmp_path / 'train.py'}" in said
    script = (tmp_path / "train.py").read_text()
    assert "class Block(nn.Module):" in script and "def loss_fn(out, y):" in script  # the notebook's sources
    assert "class Pairs(Dataset):" in script and "from torch.utils.data.dataset import Dataset" in script
    assert "fully_shard(" in script and "import nbfsdp" not in script  # FSDP2 itself; no nbfsdp needed
    _optimizer_built_after_sharding(script, "opt", "net")
    assert "opt = torch.optim.AdamW(net.parameters(), lr=0.01)\n" in script  # as the notebook built it
    (Path(os.environ.get("NBFSDP_KEEP_SCRIPT", tmp_path)) / "kept.py").write_text(script)
    run_ok(shell, CELL)  # the same cell again, from the state the script starts from
    in_notebook = [nbfsdp.last_run().metric("loss", rank) for rank in range(2)]
    trained = {name: value.clone() for name, value in shell.user_ns["net"].state_dict().items()}

    assert _torchrun(tmp_path / "train.py", 2) == in_notebook and len(in_notebook[0]) == 4
    from_script = torch.load(tmp_path / "train.trained.pt")["net"]
    assert from_script.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(from_script[name], value, rtol=0, atol=0, msg=name)


def _optimizer_built_after_sharding(script: str, optimizer: str, model: str) -> None:
    """The script builds ``optimizer`` after ``fully_shard`` has replaced ``model``'s parameters (an optimizer
    built before holds the old, whole tensors), over them, and loads its state with ``set_optimizer_state_dict``;
    no optimizer travels in the inputs, and none is re-pointed."""
    lines = script.splitlines()
    sharded = lines.index(f"{model} = shard_{model}({model}.to(device))")
    assert max(i for i, line in enumerate(lines) if "fully_shard(" in line) < sharded
    built = [i for i, line in enumerate(lines) if line.startswith(f"{optimizer} = torch.optim.")]
    assert len(built) == 1 and built[0] > sharded, (built, sharded)
    loaded = [i for i, line in enumerate(lines) if line.startswith(f"set_optimizer_state_dict({model}, {optimizer}, ")]
    assert len(loaded) == 1 and loaded[0] > built[0]
    assert f'inputs["values"]["{optimizer}"]' not in script and "repoint" not in script


GROUPS = """
import torch, torch.nn as nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
decay, plain = [p for p in net.parameters() if p.dim() > 1], [p for p in net.parameters() if p.dim() == 1]
opt = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)
def falling(step):
    return 1 / (1 + step)
sched = torch.optim.lr_scheduler.LambdaLR(opt, falling)
"""
GROUPS_CELL = """%%fsdp --world-size 2 --mixed-precision FULL
for step in range(3):
    g = torch.Generator().manual_seed(10 * step + rank)
    x, y = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 1, generator=g).to(device)
    loss = nn.functional.mse_loss(net(x), y)
    loss.backward(); opt.step(); sched.step(); opt.zero_grad()
    nbfsdp.log(loss=loss.item(), lr=opt.param_groups[1]["lr"])
"""


def test_parameter_groups_and_a_scheduler_follow_the_optimizer_built_after_sharding(shell, tmp_path):
    """Two parameter groups with their own settings, built again over the sharded parameters by name, and
    a scheduler bound to the new optimizer: the losses and the learning rates the cell logs, bit for bit."""
    run_ok(shell, GROUPS)
    run_ok(shell, GROUPS_CELL)
    run_ok(shell, f"%fsdp export-script {tmp_path / 'groups.py'}")
    script = (tmp_path / "groups.py").read_text()
    lines = script.splitlines()
    built = lines.index('opt = torch.optim.AdamW(by_name(net, inputs["optimizers"]["opt"]["param_groups"]), lr=0.01)')
    assert (
        lines.index("net = shard_net(net.to(device))")
        < built
        < lines.index("sched.optimizer = opt  # the notebook's scheduler, on it")
    )
    run_ok(shell, GROUPS_CELL)
    run = nbfsdp.last_run()
    output = torchrun(tmp_path / "groups.py", 2)
    assert logged_losses(output, 2) == [run.metric("loss", rank) for rank in range(2)]
    lrs = [json.loads(line)["lr"] for line in output.splitlines() if line.startswith('{"rank": 0')]
    assert lrs == run.metric("lr", 0) and lrs[0] < 3e-3 / 3  # the schedule went on from where the notebook left it


def test_a_value_holding_an_optimizer_other_than_a_scheduler_is_named(shell, tmp_path):
    run_ok(
        shell, "import torch, torch.nn as nn\nnet = nn.Linear(4, 1)\nopt = torch.optim.SGD(net.parameters(), lr=0.1)"
    )
    run_ok(shell, "holder = {'opt': opt}")
    run_ok(shell, "%%fsdp --world-size 2\nnet(torch.ones(2, 4)).sum().backward(); opt.step(); n = len(holder)")
    error, _ = run_failing(shell, f"%fsdp export-script {tmp_path / 'train.py'}")
    assert isinstance(error, UsageError) and "cannot export holder (it holds opt, which the script builds anew" in str(
        error
    )


def test_a_value_that_cannot_be_saved_is_named(shell, tmp_path):
    run_ok(shell, "import torch, torch.nn as nn\nnet = nn.Linear(4, 1)\nnotes = open('/dev/null')")
    run_ok(shell, "%%fsdp --world-size 2\nout = net(torch.ones(2, 4))\nseen = notes.name")
    error, _ = run_failing(shell, f"%fsdp export-script {tmp_path / 'train.py'}")
    assert isinstance(error, UsageError) and "cannot export notes (TextIOWrapper" in str(error)
    assert not (tmp_path / "train.py").exists()


def test_export_script_says_what_it_needs(shell, tmp_path):
    with pytest.raises(UsageError, match="no %%fsdp cell has run yet"):
        export_script(None, {}, str(tmp_path / "train.py"), {})
    run_ok(shell, "import torch, torch.nn as nn\nnet = nn.Linear(4, 1)")
    run_ok(shell, "%%fsdp --world-size 2\nout = net(torch.ones(2, 4))")
    error, _ = run_failing(shell, f"%fsdp export-script {tmp_path / 'train.txt'}")
    assert isinstance(error, UsageError) and "must end in .py" in str(error)
    run_ok(shell, "%%fsdp --world-size 2\nout = rank * 2")
    error, _ = run_failing(shell, f"%fsdp export-script {tmp_path / 'train.py'}")
    assert isinstance(error, UsageError) and "reads no model of the notebook" in str(error)


PASTED = """%%fsdp --world-size 2
import torch.distributed as dist
dist.init_process_group({arguments})
t = torch.full((2,), float(dist.get_rank() + 1))
dist.all_reduce(t)
total = t.tolist()
dist.destroy_process_group()
"""


def test_a_pasted_torchrun_script_runs_in_the_world_and_keeps_it(shell, capsys):
    run_ok(shell, "import torch")
    capsys.readouterr()
    run_ok(shell, PASTED.format(arguments='backend="gloo"'))
    said = capsys.readouterr().out
    assert "init_process_group: the cell runs in the world already started (gloo, 2 ranks)" in said
    assert "destroy_process_group: the world is kept for the next cell" in said
    assert said.count("nbfsdp: init_process_group") == 1  # rank 0 says it, once
    run_ok(shell, "%%fsdp --world-size 2\nimport torch.distributed as dist\nafter = dist.get_world_size()")
    assert shell.user_ns["after"] == 2  # the world survived the cell's destroy_process_group


@pytest.mark.parametrize("arguments", ['backend="nccl"', 'backend="gloo", world_size=4'])
def test_a_pasted_init_for_another_world_is_named(shell, arguments):
    run_ok(shell, "import torch")
    error, _ = run_failing(shell, PASTED.format(arguments=arguments))
    said = str(error)
    assert "in a cell, but the running world is gloo with 2 ranks" in said, said
    assert "init_process_group(backend=" in said
    run_ok(shell, "%%fsdp --world-size 2\nok = rank")  # the world is still there


def test_a_script_for_ranks_sharing_a_gpu_sets_the_device_and_tells_them_apart(tmp_path):
    """Written from a CPU kernel for the GPU layout the cell had (nothing run): 2 ranks on one GPU."""
    devices = Devices("cuda", 2, gpus=1, rank_gpus=(0, 0), nccl_hosts=("h0", "h1"))
    cell = LastCell("out = net(torch.ones(2, 4, device=device))", 2, for_device(FSDPConfig(), devices), devices,
                    False, ["net", "torch", "device"])  # fmt: skip
    export_script(cell, {"net": torch.nn.Linear(4, 1), "torch": torch}, str(tmp_path / "gpu.py"), {})
    script = (tmp_path / "gpu.py").read_text()
    hostid = script.index('os.environ["NCCL_HOSTID"] = f"export-{NCCL_HOSTS[')
    assert hostid < script.index('dist.init_process_group("nccl")') < script.index("torch.cuda.set_device(device)")
    assert "NCCL_HOSTS = ('h0', 'h1')" in script
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in script  # DEFAULT


CONFIGURED = """
import cloudpickle, pickle
import torch, torch.nn as nn
import torch.nn.functional as F
from dataclasses import dataclass, field
from typing import NamedTuple

class Base(nn.Module):
    def count(self):
        return sum(p.numel() for p in self.parameters())

class Attention(Base):
    def __init__(self, args):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(args.dim, 3 * args.dim), nn.Linear(args.dim, args.dim), args.heads

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))

class FeedForward(Base):
    def __init__(self, args):
        super().__init__()
        self.up, self.down = nn.Linear(args.dim, args.hidden), nn.Linear(args.hidden, args.dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))

class Block(Base):
    attention_cls = Attention  # class attributes: these classes must be defined before Block
    feed_forward_cls = FeedForward

    def __init__(self, args):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention, self.feed_forward = self.attention_cls(args), self.feed_forward_cls(args)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))

class Transformer(Base):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.head = nn.Linear(args.dim, args.vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

class Shape(NamedTuple):
    batch: int = 4
    seq: int = 8

@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab: int = 32
    dim: int = 16
    heads: int = 2
    hidden: int = 32
    layers: int = 2
    shape: Shape = field(default_factory=Shape)

args = ModelArgs()
torch.manual_seed(0)
model = Transformer(args)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
# what cloudpickle's own load does to a notebook class it has sent: its methods' code now names no cell
pickle.loads(cloudpickle.dumps(model))
"""
CONFIGURED_CELL = """%%fsdp --world-size 2 --wrap-cls Block
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, args.vocab, (args.shape.batch, args.shape.seq + 1), generator=g).to(device)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(loss=loss.item())
"""


BESIDE = """
import torch.nn as nn

class Scale(nn.Module):
    def forward(self, x):
        return 0.5 * x
"""


def test_dataclass_configs_named_tuples_and_a_class_hierarchy_export_by_their_cells(shell, tmp_path):
    """Every class a cell defined, by its cell's source (found through the input history, whatever its methods'
    code objects say: a dataclass's and a ``NamedTuple``'s are generated, and these were rewritten by a round
    trip), each after what its definition needs; a class from a file beside the notebook imported; under
    torchrun the same losses, bit for bit."""
    (tmp_path / "beside.py").write_text(BESIDE)
    before, path = os.getcwd(), list(sys.path)
    shell.run_line_magic("cd", str(tmp_path))  # the notebook beside its module: the ranks import it there too
    sys.path.insert(0, "")  # as a Jupyter kernel's path starts (this test shell's does not)
    try:
        run_ok(shell, "from beside import Scale")
        run_ok(shell, CONFIGURED.replace("x = block(x)", "x = Scale()(block(x))"))
        run_ok(shell, CONFIGURED_CELL)
    finally:
        shell.run_line_magic("cd", before)
        sys.path[:] = path
    assert shell.user_ns["Block"].forward.__code__.co_filename == "<dynamic-code>"  # the upstream rewrite, above
    run_ok(shell, f"%fsdp export-script {tmp_path / 'configured.py'}")
    script = (tmp_path / "configured.py").read_text()
    for header in ("class ModelArgs:", "class Shape(NamedTuple):", "class Base(nn.Module):", "class Block(Base):"):
        assert header in script, header
    assert "@dataclass(frozen=True, slots=True)" in script and "shape: Shape = field(default_factory=Shape)" in script
    assert "from beside import Scale" in script and "class Scale" not in script  # imported, as the notebook did
    order = [script.index(f"class {name}") for name in ("Base", "Attention", "FeedForward", "Block", "Transformer")]
    assert order[:3] == sorted(order[:3]) and max(order[:3]) < order[3]  # bases and class attributes first
    assert script.index("class Shape") < script.index("class ModelArgs")  # its default_factory
    run_ok(shell, CONFIGURED_CELL)  # the cell again, from the state the script starts from
    in_notebook = [nbfsdp.last_run().metric("loss", rank) for rank in range(2)]
    assert _torchrun(tmp_path / "configured.py", 2) == in_notebook and len(in_notebook[0]) == 3
