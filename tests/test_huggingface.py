"""A Hugging Face GPT-2 under ``%%fsdp``: its ``_no_split_modules`` as units, its tied weights kept, generate after.

Built from a tiny config (no download). transformers is an optional extra of nbfsdp, never a runtime
requirement, but `make test` installs it (the ``examples`` extra), so these tests always run there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.timeout(240)

STEPS = 3

GPT2 = """
import torch, nbfsdp
from transformers import GPT2Config, GPT2LMHeadModel

config = GPT2Config(
    n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
torch.manual_seed(0)
gpt = GPT2LMHeadModel(config)
tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
"""

# eps=1e-6: the key bias (c_attn.bias[32:64]) has no gradient in exact math (softmax ignores what is added to
# every score of a query), only rounding noise, which sums otherwise across two ranks; AdamW's default eps=1e-8
# scales that noise up to lr-sized steps (measured: 3e-5 apart after 3 steps, on those elements alone)
TRAIN = """%%fsdp --world-size 2 --mixed-precision FULL
tied_on_ranks = gpt.lm_head.weight is gpt.transformer.wte.weight
opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2, eps=1e-6)
ids = tokens[2 * rank : 2 * rank + 2]
for step in range({steps}):
    loss = gpt(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
same_storage = gpt.lm_head.weight.to_local().data_ptr() == gpt.transformer.wte.weight.to_local().data_ptr()
"""


@pytest.fixture
def gpt(shell):
    run_ok(shell, GPT2)
    return shell.user_ns["gpt"]


def test_gpt2_trains_as_one_process_does_with_its_blocks_as_units_and_stays_tied(shell, gpt):
    reference = copy.deepcopy(gpt)
    run_ok(shell, TRAIN.format(steps=STEPS))

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    tokens = shell.user_ns["tokens"]
    expected_losses = []
    for _ in range(STEPS):
        loss = reference(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected_losses.append(loss.item())

    run = nbfsdp.last_run()
    assert run.config["fsdp_units"]["gpt"] == ["transformer.h.0", "transformer.h.1", ""]
    assert run.config["fsdp_wrap"]["gpt"]["wrap_cls"] == ["GPT2Block"]
    assert run.config["fsdp_wrap"]["gpt"]["source"] == "_no_split_modules"
    # each rank's loss is the mean over its half (as many tokens each); the global mean is their mean
    sharded_losses = [(run.metric("loss", rank=0)[s] + run.metric("loss", rank=1)[s]) / 2 for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(sharded_losses), torch.tensor(expected_losses))
    for (name, trained), (_, expected) in zip(gpt.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, expected, msg=lambda m, name=name: f"{name}: {m}")

    assert shell.user_ns["tied_on_ranks"] is True and shell.user_ns["same_storage"] is True
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # the notebook's model, after the cell
    prompt = torch.tensor([[1, 2, 3]])
    generated = gpt.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 8)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=5, do_sample=False))


def test_explain_names_no_split_modules_and_an_explicit_wrap_cls_wins(shell, gpt, capsys):
    shell.run_line_magic("fsdp", "explain gpt")
    out = capsys.readouterr().out
    assert "units: GPT2Block x 2, from the model's _no_split_modules (Accelerate's convention)" in out

    run_ok(shell, "%%fsdp --world-size 2 --mixed-precision FULL --wrap-cls GPT2MLP\ngpt(input_ids=tokens).logits.sum()")
    run = nbfsdp.last_run()
    assert run.config["fsdp_units"]["gpt"] == ["transformer.h.0.mlp", "transformer.h.1.mlp", ""]
    assert run.config["fsdp_wrap"]["gpt"] == {"wrap_cls": ["GPT2MLP"], "source": "wrap_cls", "rule": "from wrap_cls"}
    assert gpt.lm_head.weight is gpt.transformer.wte.weight


def test_wrapping_lm_head_apart_from_wte_is_refused_before_anything_runs(shell, gpt):
    runs = len(nbfsdp.runs())
    error, _ = run_failing(shell, "%%fsdp --world-size 2 --wrap-cls GPT2Block,Linear\ngpt(input_ids=tokens)\n")
    assert isinstance(error, UsageError)
    assert "transformer.wte.weight and lm_head.weight are one tied parameter" in str(error)
    assert "leave out Linear" in str(error) and "the tie stays in the root" in str(error)
    assert len(nbfsdp.runs()) == runs


BERT = """
from transformers import BertConfig, BertForMaskedLM

bert_config = BertConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)
torch.manual_seed(0)
bert = BertForMaskedLM(bert_config)
masked = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))
"""
BERT_TRAIN = f"""%%fsdp --world-size 2 --mixed-precision FULL
opt = torch.optim.SGD(bert.parameters(), lr=0.1)
for step in range({STEPS}):
    half = masked[rank * 2:(rank + 1) * 2]
    loss = bert(input_ids=half, labels=half).loss
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(loss=loss.item())
tied_on_ranks = bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
"""


def test_a_hub_bert_trains_with_its_default_units_its_tie_kept_in_the_root(shell, capsys):
    """Issue 43, point 5: BERT's ``_no_split_modules`` names ``BertEmbeddings``, whose word embeddings are its
    decoder's weight. The default rule leaves that unit out (said in a line and in explain), and the model
    trains as one process does; an explicit ``--wrap-cls`` that splits the tie stays an error."""
    run_ok(shell, "import torch, nbfsdp" + BERT)
    reference = copy.deepcopy(shell.user_ns["bert"])
    capsys.readouterr()
    shell.run_line_magic("fsdp", "explain bert")
    out = capsys.readouterr().out
    assert "units: BertLayer x 2, from the model's _no_split_modules" in out, out
    assert "BertEmbeddings bert.embeddings is not a unit: bert.embeddings.word_embeddings.weight and " in out
    run_ok(shell, BERT_TRAIN)
    said = capsys.readouterr().err
    assert said.count("bert: BertEmbeddings bert.embeddings is not a unit") == 1, said
    assert "kept in the root" in said and shell.user_ns["tied_on_ranks"]
    run = nbfsdp.last_run()
    assert run.config["fsdp_units"]["bert"] == ["bert.encoder.layer.0", "bert.encoder.layer.1", ""]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    masked, expected = shell.user_ns["masked"], []
    for _ in range(STEPS):  # one process, the global batch: the mean of the two ranks' mean losses
        losses = [
            reference(input_ids=masked[r * 2 : (r + 1) * 2], labels=masked[r * 2 : (r + 1) * 2]).loss for r in (0, 1)
        ]
        loss = sum(losses) / 2
        loss.backward(), opt.step(), opt.zero_grad()
        expected.append(loss.item())
    sharded = [(a + b) / 2 for a, b in zip(run.metric("loss", 0), run.metric("loss", 1), strict=True)]
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(expected))
    bert = shell.user_ns["bert"]
    for (name, trained), (_, wanted) in zip(bert.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, wanted, msg=lambda m, name=name: f"{name}: {m}")
    error, _ = run_failing(shell, "%%fsdp --world-size 2 --wrap-cls BertEmbeddings,BertLayer\nbert.training")
    assert isinstance(error, UsageError) and "are one tied parameter" in str(error)
