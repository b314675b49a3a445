"""The check before a cell's first step (issue 45, point 4): ``%fsdp check``, and by itself before each new
``%%fsdp`` cell. Each kind of finding names the cell's line and gives the fix as code that parses; a clean
cell, and every ``%%fsdp`` cell of the course but the debugging notebook's planted bug, find nothing."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nbfsdp.course import MLP, TinyGPT
from nbfsdp.kernel.diagnostics import check
from nbfsdp.shared import transfer
from nbfsdp.shared.config import ConfigError, resolve, validate
from nbfsdp.shared.devices import Devices, on_gpus
from tests.conftest import forget_after_each_test, run_ok

ROOT = Path(__file__).resolve().parent.parent

forget = forget_after_each_test("other", "opt", "stale")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)


class Tied(nn.Module):
    """GPT-2's tie: the head's weight is the embedding's."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 10, bias=False)
        self.head.weight = self.embed.weight


def settings(world_size: int = 2, devices: Devices | None = None, **given):
    devices = devices or Devices("cpu", world_size)
    return validate(resolve(None, given), world_size, devices, quiet=True), devices


def findings(code: str, namespace: dict, world_size: int = 2, devices: Devices | None = None, **given):
    config, devices = settings(world_size, devices, **given)
    return check.check(textwrap.dedent(code), namespace, config, world_size, devices)


def only(found: list[check.Finding], kind: str) -> check.Finding:
    assert [f.kind for f in found] == [kind], check.report(found)
    finding = found[0]
    if not finding.fix.startswith("%%fsdp"):
        ast.parse(finding.fix)  # the fix is code to paste
    return finding


#: Notebook 14's planted bug: only rank 0 evaluates, and the sharded forward is a collective.
EVALUATES_ON_RANK_0 = """\
for step in range(STEPS):
    x, y = batch_for(rank, step, device=device)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    nbfsdp.log(loss=loss.item())
if rank == 0:  # "only rank 0 evaluates": the bug
    with torch.no_grad():
        x_val, y_val = batch_for(0, 100, device=device)
        val_loss = loss_fn(model(x_val), y_val).item()
    print(f"validation loss {val_loss:.3f}")
"""


def test_a_forward_under_rank_0_is_found_with_its_line_and_moved_out_of_the_branch():
    model = Block(4)
    found = only(findings(EVALUATES_ON_RANK_0, {"model": model}), "rank-branch")
    assert (found.line, found.text) == (8, 'if rank == 0:  # "only rank 0 evaluates": the bug')
    assert "model's forward (line 11) runs only on the ranks where `rank == 0` holds" in found.what
    assert "the cell hangs" in found.why
    assert found.fix == textwrap.dedent("""\
        # every rank runs these:
        with torch.no_grad():
            x_val, y_val = batch_for(0, 100, device=device)
            val_loss = loss_fn(model(x_val), y_val).item()
        if rank == 0:
            print(f"validation loss {val_loss:.3f}")""")
    assert "line 8: if rank == 0:" in str(found) and "Fix:" in str(found)


@pytest.mark.parametrize(
    ("code", "call"),
    [
        ("if dist.get_rank() == 0:\n    out = model(x)\n", "model's forward (line 2)"),
        ("if int(os.environ['RANK']) != 0:\n    loss.backward()\n", "a backward (line 2)"),
        ("main = local_rank == 0\nif main:\n    dist.all_reduce(t)\n", "torch.distributed.all_reduce (line 3)"),
        (
            "net = model\nif not rank:\n    print(net.head.weight.full_tensor())\n",
            "full_tensor (a collective) (line 3)",
        ),
        ("if rank == 0:\n    state = get_model_state_dict(model)\n", "get_model_state_dict (a collective) (line 2)"),
        (
            "def evaluate(m):\n    return m(x)\nif rank == 0:\n    evaluate(model)\n",
            "model's forward in evaluate() (line 4)",
        ),
        ("if rank == 0:\n    pass\nelse:\n    out = model.forward(x)\n", "model's forward (line 4)"),
    ],
)
def test_each_rank_source_and_collective_is_seen(code, call):
    found = only(findings(code, {"model": Block(4), "dist": torch.distributed}), "rank-branch")
    assert call in found.what


def test_an_optimizer_step_on_rank_0_alone_is_found_as_a_half_update():
    model = Block(4)
    namespace = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    found = only(
        findings("loss = model(x).sum()\nloss.backward()\nif rank == 0:\n    opt.step()\n", namespace), "rank-branch"
    )
    assert "opt.step() (line 4)" in found.what and "half updated" in found.why
    assert found.fix == "# every rank runs these:\nopt.step()"


@pytest.mark.parametrize(
    "code",
    [
        "if rank == 0:\n    print(model)\n    torch.save(model.state_dict(), 'out.pt')\n",
        "if rank == 0:\n    out = model(x)\nelse:\n    out = model(y)\n",
        "if step % 10 == 0:\n    out = model(x)\n",
        "if device.type == 'cuda':\n    out = model(x)\n",
        "if rank == 0:\n    dist.send(t, 1)\nelse:\n    dist.recv(t, 0)\n",
    ],
)
def test_no_false_alarm_on_what_rank_0_may_do_alone(code):
    assert findings(code, {"model": Block(4), "dist": torch.distributed}) == []


def test_a_clean_cell_finds_nothing():
    model = TinyGPT()
    namespace = {"model": model, "opt": torch.optim.AdamW(model.parameters())}
    code = "for step in range(3):\n    loss = model(x).sum()\n    loss.backward(); opt.step(); opt.zero_grad()\n"
    assert findings(code, namespace, wrap_cls="Block") == []


def test_tied_weights_a_rule_splits_are_found_with_the_wrap_cls_that_keeps_them():
    found = only(findings("loss = model(x).sum()\n", {"model": Tied()}, wrap_cls="Embedding,Block"), "tied-weights")
    assert (found.line, found.text) == (0, "--wrap-cls Embedding,Block")
    assert "embed.weight and head.weight are one tied parameter" in found.what
    assert found.fix == "%%fsdp --wrap-cls Block"
    # the default rules keep the tie whole by themselves: nothing to say
    assert findings("loss = model(x).sum()\n", {"model": Tied()}) == []


def test_a_unit_of_two_dtypes_is_found_with_its_split_and_the_cast_that_avoids_it():
    model = Tied()
    model.blocks[1].to(torch.bfloat16)
    found = only(findings("x = 1\nloss = model(x).sum()\n", {"model": model}), "mixed-dtypes")
    assert (found.line, found.text) == (2, "loss = model(x).sum()")
    assert "blocks.1 (bfloat16) is a unit of its own" in found.what
    assert found.fix.splitlines()[-1] == "model.blocks[1].to(torch.float32)"


def test_a_module_of_two_trainable_dtypes_is_found_before_the_cell_is_refused():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.ones(4))
            self.b = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    model = nn.Sequential(nn.Linear(4, 4), Odd())
    found = only(findings("loss = model(x).sum()\n", {"model": model}), "mixed-dtypes")
    assert "model[1] (Odd) holds trainable parameters stored in bfloat16 and float32" in found.what
    assert found.fix.startswith("model[1].to(torch.float32)")


def test_bf16_on_gpus_without_it_is_found_in_the_flags_and_the_code():
    t4 = on_gpus(2, 2, capability=(7, 5))
    code = "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x).sum()\n"
    found = findings(code, {"model": Block(4)}, devices=t4, precision="bf16")
    assert [(f.kind, f.line) for f in found] == [("bf16", 0), ("bf16", 1)]
    assert found[0].fix.startswith("%%fsdp --precision fp16")
    assert found[1].fix.startswith("with torch.autocast('cuda', dtype=torch.float16):")
    assert "7.5" in found[0].why
    # nbfsdp's own choice there is fp16, and an A100 has bf16: nothing to say
    assert findings("loss = model(x).sum()\n", {"model": Block(4)}, devices=t4) == []
    a100 = on_gpus(2, 2, capability=(8, 0))
    assert findings(code, {"model": Block(4)}, devices=a100, precision="bf16") == []


def test_an_optimizer_over_a_model_the_cell_does_not_read_is_found():
    model, other = Block(8), Block(8)
    namespace = {"model": model, "other": other, "opt": torch.optim.AdamW(other.parameters(), lr=1e-3)}
    found = only(findings("loss = model(x).sum()\nloss.backward()\nopt.step()\n", namespace), "optimizer")
    assert (found.line, found.text) == (3, "opt.step()")
    assert "they are other's parameters, and the cell does not read other" in found.what
    assert found.fix == "opt = torch.optim.AdamW(model.parameters(), lr=0.001)  # at the cell's top"


def test_an_optimizer_over_an_earlier_model_is_found():
    stale = Block(8)
    opt = torch.optim.SGD(stale.parameters(), lr=0.1)
    found = only(findings("model(x).sum().backward()\nopt.step()\n", {"model": Block(8), "opt": opt}), "optimizer")
    assert "no notebook model's" in found.what


def test_an_optimizer_over_a_module_the_cell_builds_and_does_not_shard_is_found():
    code = "head = nn.Linear(4, 4).to(device)\nopt = torch.optim.SGD(head.parameters(), lr=0.1)\n"
    found = only(findings(code, {}), "optimizer")
    assert (found.line, found.fix.splitlines()[-1].split("  #")[0]) == (2, "fully_shard(head)")
    sharded = "head = nn.Linear(4, 4).to(device)\nfully_shard(head)\nopt = torch.optim.SGD(head.parameters(), lr=0.1)\n"
    assert findings(sharded, {}) == []


ACCUMULATES = """\
for i in range(8):
    loss = loss_fn(model(x[i]), y[i]) / K
    loss.backward()
    if (i + 1) % K == 0:
        opt.step()
        opt.zero_grad()
"""


def test_gradient_accumulation_without_no_sync_is_found_with_the_planners_bytes():
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # 4.0 MiB of fp32 gradients
    namespace = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "K": 4}
    found = only(findings(ACCUMULATES, namespace), "accumulation")
    assert (found.line, found.text) == (3, "    loss.backward()")
    assert "K (4) backwards per opt.step() (line 5)" in found.what and "4.0 MiB a rank" in found.what
    assert "2.0 MiB more a rank" in found.why
    assert found.fix == (
        "model.set_requires_gradient_sync((i + 1) % K == 0)  # reduce-scatter only before opt.step()\nloss.backward()"
    )
    synced = ACCUMULATES.replace("    loss.backward()", "    model.set_requires_gradient_sync((i + 1) % K == 0)\n"
                                 "    loss.backward()")  # fmt: skip
    assert findings(synced, namespace) == []
    assert findings(ACCUMULATES, namespace, world_size=1) == []  # one rank reduces nothing
    small = nn.Linear(8, 8)  # under ACCUMULATION_BYTES: the extra reduce-scatters cost their latency only
    assert findings(ACCUMULATES, {**namespace, "model": small, "opt": torch.optim.SGD(small.parameters())}) == []
    assert findings(ACCUMULATES, {**namespace, "K": 1}) == []  # % 1: a step every backward


ONE_MICRO_BATCH = """for step in range(3):
    for part in x.chunk(MICRO):
        loss = loss_fn(model(part), part)
        loss.backward()
    opt.step()
"""


def test_a_micro_batch_loop_of_one_is_no_accumulation():
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))
    namespace = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "MICRO": 1}
    assert findings(ONE_MICRO_BATCH, namespace) == []
    assert findings(ONE_MICRO_BATCH.replace("MICRO", "1"), namespace) == []
    found = only(findings(ONE_MICRO_BATCH, {**namespace, "MICRO": 4}), "accumulation")
    assert found.line == 4 and "MICRO (4) backwards per opt.step()" in found.what


def test_check_alone_needs_a_cell_that_ran():
    with pytest.raises(ConfigError, match="none has run yet"):
        check.last_cell(None, {})


def test_before_a_cell_the_findings_are_printed_once_and_check_says_them_again(shell, tiny_model, capsys):
    shell.user_ns["other"] = nn.Linear(8, 8)
    run_ok(shell, "opt = torch.optim.SGD(other.parameters(), lr=0.1)")
    cell = "%%fsdp --world-size 2\nx, y = batch_for(rank, 0)\nloss_fn(model(x), y).backward()\nopt.step()\n"
    capsys.readouterr()
    run_ok(shell, cell)
    said = capsys.readouterr().err
    assert "nbfsdp check: line 3: opt.step()" in said and "they are other's parameters" in said
    assert "opt = torch.optim.SGD(model.parameters(), lr=0.1)" in said
    run_ok(shell, cell)  # the same cell again: said once
    assert "nbfsdp check" not in capsys.readouterr().err
    run_ok(shell, "%fsdp check")
    assert "nbfsdp check: line 3: opt.step()" in capsys.readouterr().out
    run_ok(shell, "%%fsdp --world-size 2\nx, y = batch_for(rank, 1)\nloss_fn(model(x), y).backward()\n")
    assert "nbfsdp check" not in capsys.readouterr().err  # a clean cell: nothing
    run_ok(shell, "%fsdp check")
    assert "nbfsdp check: nothing found" in capsys.readouterr().out


# ------------------------------------------------------------------ the course
#: What the course's definition cells call to make a model: the check's models in the course test.
MODEL_MAKERS = {"TinyGPT", "MLP", "GPT", "CharGPT", "EveryOtherBlock", "from_pretrained", "from_config",
                "get_peft_model", "deepcopy"}  # fmt: skip
#: The one finding the course plants on purpose (notebook 14: "only rank 0 evaluates").
PLANTED = [("14-debugging", "rank-branch", 8)]


def _course_namespace(cells: list[str]) -> dict:
    """The notebook's models and optimizers as far as its plain cells' assignments say: the course's own
    models built as written where they take no arguments, a small stand-in for the others."""
    namespace: dict = {}
    for source in cells:
        try:
            tree = ast.parse(
                "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
            )
        except SyntaxError:
            continue
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            called = ast.unparse(node.value.func).rpartition(".")[2]
            if called in MODEL_MAKERS:
                made = {"TinyGPT": TinyGPT, "MLP": MLP}.get(called) if not node.value.args else None
                namespace.update(dict.fromkeys(names, made() if made and not node.value.keywords else nn.Linear(4, 4)))
            elif ast.unparse(node.value.func).startswith("torch.optim."):
                over = [n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id in namespace]
                if over and isinstance(namespace[over[0]], nn.Module):
                    namespace.update(dict.fromkeys(names, torch.optim.SGD(namespace[over[0]].parameters(), lr=0.1)))
    return namespace


def test_the_course_cells_find_nothing_but_the_planted_bug():
    found, checked = [], 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        plain: list[str] = []
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            if cell["cell_type"] != "code":
                continue
            if not source.startswith("%%fsdp"):
                plain.append(source)
                continue
            line, _, code = source.partition("\n")
            words = line.split()
            world_size = int(words[words.index("--world-size") + 1]) if "--world-size" in words else 2
            wrap_cls = words[words.index("--wrap-cls") + 1] if "--wrap-cls" in words else None
            namespace = _course_namespace(plain)
            assert transfer.analyze_cell(ast.parse(code))  # the cell parses
            config, devices = settings(world_size, wrap_cls=wrap_cls)
            found += [(path.stem, f.kind, f.line) for f in check.check(code, namespace, config, world_size, devices)]
            checked += 1
    assert checked >= 70  # every %%fsdp cell of the course
    assert found == PLANTED
