"""Which modules become units: a model's ``_no_split_modules`` when no rule is given, and tied parameters.

Plain ``nn.Module``s declaring Hugging Face's attribute, so the rule is tested
where transformers is absent (tests/test_huggingface.py runs it on GPT-2).
"""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.timeout(240)

DECLARED = """
class Inner(nn.Module):
    _no_split_modules = {"Block"}  # on a model inside the root, as GPT2LMHeadModel holds GPT2Model
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(16) for _ in range(3)])

class Declared(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(500, 16)
        self.inner = Inner()
        self.head = nn.Linear(16, 1)

declared = Declared()
"""

TIED = """
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.block = Block(16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight
    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))
"""


def test_no_split_modules_are_the_units_when_no_rule_is_given(shell, tiny_model, capsys):
    run_ok(shell, DECLARED)
    declared = shell.user_ns["declared"]
    plan = nbfsdp.explain(declared, world_size=2)
    assert [u.name for u in plan.units] == ["", "inner.blocks.0", "inner.blocks.1", "inner.blocks.2"]
    assert plan.wrap_rule["wrap_cls"] == ["Block"] and plan.wrap_rule["source"] == "_no_split_modules"
    shell.run_line_magic("fsdp", "explain declared")
    assert "units: Block x 3, from the model's _no_split_modules (Accelerate's convention)" in capsys.readouterr().out
    # min_params still applies: a module this big is a unit whatever the rule
    big = nbfsdp.explain(declared, world_size=2, min_params=5000)
    assert [u.name for u in big.units] == ["", "embed", "inner.blocks.0", "inner.blocks.1", "inner.blocks.2"]
    # a model without the attribute keeps Composer's default: the root alone; on the root it counts too
    assert [u.name for u in nbfsdp.explain(tiny_model, world_size=2).units] == [""]
    assert nbfsdp.explain(tiny_model, world_size=2).wrap_rule["source"] == "min_params"
    tiny_model._no_split_modules = ["Block"]
    assert [u.name for u in nbfsdp.explain(tiny_model, world_size=2).units] == ["", "blocks.0", "blocks.1", "blocks.2"]


def test_an_explicit_rule_wins_over_no_split_modules(shell, tiny_model):
    run_ok(shell, DECLARED)
    declared = shell.user_ns["declared"]
    by_cls = nbfsdp.explain(declared, world_size=2, wrap_cls="Linear")
    assert by_cls.wrap_rule == {"wrap_cls": ["Linear"], "source": "wrap_cls", "rule": "from wrap_cls"}
    assert "inner.blocks.0" not in [u.name for u in by_cls.units]
    declared.inner.blocks[1]._fsdp_wrap = True
    by_attribute = nbfsdp.explain(declared, world_size=2)
    assert [u.name for u in by_attribute.units] == ["", "inner.blocks.1"]
    assert by_attribute.wrap_rule["source"] == "_fsdp_wrap"
    del declared.inner.blocks[1]._fsdp_wrap
    run_ok(shell, "Declared.fsdp_wrap_fn = lambda self, m: m is self.embed")
    try:
        by_fn = nbfsdp.explain(declared, world_size=2)
        assert [u.name for u in by_fn.units] == ["", "embed"] and by_fn.wrap_rule["source"] == "fsdp_wrap_fn"
    finally:
        run_ok(shell, "del Declared.fsdp_wrap_fn")


def test_a_rule_that_splits_a_tied_parameter_is_refused_before_anything_runs(shell, tiny_model):
    run_ok(shell, TIED + "tied = Tied()\n")
    runs = len(nbfsdp.runs())
    error, _ = run_failing(
        shell, "%%fsdp --world-size 2 --wrap-cls Linear\ntied(torch.zeros(2, 3, dtype=torch.long))\n"
    )
    assert isinstance(error, UsageError)
    assert "embed.weight and head.weight are one tied parameter" in str(error)
    assert "head is a unit of its own (from wrap_cls)" in str(error) and "leave out Linear" in str(error)
    assert len(nbfsdp.runs()) == runs  # refused in the notebook: nothing ran
    with pytest.raises(UsageError, match="one tied parameter"):
        nbfsdp.explain(shell.user_ns["tied"], world_size=2, wrap_cls="Embedding")
    # both in one unit is fine: the tie's common parent
    assert [u.name for u in nbfsdp.explain(shell.user_ns["tied"], world_size=2, wrap_cls="Block").units] == [
        "",
        "block",
    ]


def test_a_tied_model_built_on_meta_comes_back_tied(shell, tiny_model):
    run_ok(shell, TIED + "with torch.device('meta'):\n    tied = Tied()\n")
    run_ok(
        shell,
        """%%fsdp --world-size 2 --wrap-cls Block --mixed-precision FULL
tied_on_ranks = tied.head.weight is tied.embed.weight
opt = torch.optim.SGD(tied.parameters(), lr=0.1)
tied(torch.arange(8).view(2, 4) + 8 * rank).sum().backward()
opt.step()
""",
    )
    tied = shell.user_ns["tied"]
    assert shell.user_ns["tied_on_ranks"] is True
    assert not tied.head.weight.is_meta
    assert tied.head.weight is tied.embed.weight
    assert tied(torch.arange(4).view(1, 4)).shape == (1, 4, 64)
