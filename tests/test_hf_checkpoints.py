"""A Hugging Face checkpoint directory loaded onto the ranks (issue 43, point 1; the rest of that issue is
open): ``%fsdp load DIR`` and ``%fsdp load DIR/model.safetensors.index.json`` for what ``save_pretrained``
writes (several safetensors files and their index, or one ``model.safetensors``), each rank reading only its
rows; names matched as ``from_pretrained`` matches them (a tie kept once in the file; the base model's
prefix); the notebook model's dtype; a checkpoint of another model refused, naming what does not fit, before
anything changes. Tiny models built from configs: nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
import transformers  # the examples extra: make test installs it, so these tests always run there
from IPython.core.error import UsageError

from tests.conftest import forget_after_each_test, run_failing, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(300)]

#: The shell is shared: the models made here would fit a later test's checkpoints as well as its own
_forget = forget_after_each_test("llama", "gpt")

LLAMA = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _llama_checkpoint(directory, dtype=torch.float32):
    """A Llama with grouped-query attention and rotary buffers, saved in several files with an index."""
    torch.manual_seed(7)
    pretrained = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(dtype)
    pretrained.save_pretrained(directory, max_shard_size="40KB")
    return pretrained


def _same_weights(model, reference) -> None:
    reference_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, reference_state[name].to(tensor.dtype), rtol=0, atol=0, msg=name)


def _notebook_llama(shell, cls="LlamaForCausalLM"):
    """The notebook's own model of the same config, initialized otherwise."""
    shell.user_ns["llama_config"] = transformers.LlamaConfig(**LLAMA)
    run_ok(shell, f"import torch, transformers\ntorch.manual_seed(0)\nllama = transformers.{cls}(llama_config)")


@pytest.mark.parametrize("named", ["directory", "index"])
def test_a_checkpoint_of_several_files_loads_onto_the_ranks_and_into_the_notebook(shell, tmp_path, capsys, named):
    directory = tmp_path / "llama"
    pretrained = _llama_checkpoint(directory)
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) >= 3 and (directory / "model.safetensors.index.json").exists(), files
    _notebook_llama(shell)
    target = directory if named == "directory" else directory / "model.safetensors.index.json"
    capsys.readouterr()
    run_ok(shell, f"%fsdp load {target} --world-size 2")
    said = capsys.readouterr().out
    assert f"loaded {target} into llama on 2 ranks, each reading its shard" in said, said
    llama = shell.user_ns["llama"]
    _same_weights(llama, pretrained)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, reloaded(tokens).logits, rtol=0, atol=0)


def test_tied_embeddings_kept_once_in_the_file_load_and_stay_tied(shell, tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(5)
    pretrained = transformers.GPT2LMHeadModel(config)
    pretrained.save_pretrained(tmp_path / "gpt2")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "gpt2" / "model.safetensors"), framework="pt") as saved:
        assert "lm_head.weight" not in list(saved.keys())  # transformers keeps a tie once
    shell.user_ns["config"] = config
    run_ok(shell, "import transformers\ntorch.manual_seed(0)\ngpt = transformers.GPT2LMHeadModel(config)")
    run_ok(shell, f"%fsdp load {tmp_path / 'gpt2'} --world-size 2")
    gpt = shell.user_ns["gpt"]
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    _same_weights(gpt, pretrained)


def test_a_model_with_a_head_loads_into_its_bare_base_as_from_pretrained_does(shell, tmp_path):
    """``model.`` taken away (Llama's ``base_model_prefix``); the head's ``lm_head.weight`` left, as
    ``from_pretrained`` leaves it."""
    pretrained = _llama_checkpoint(tmp_path / "llama")
    _notebook_llama(shell, "LlamaModel")
    run_ok(shell, f"%fsdp load {tmp_path / 'llama'} --world-size 2")
    _same_weights(shell.user_ns["llama"], pretrained.model)


def test_a_bf16_checkpoint_loads_in_the_notebook_models_dtype(shell, tmp_path):
    pretrained = _llama_checkpoint(tmp_path / "llama", dtype=torch.bfloat16)
    _notebook_llama(shell)
    run_ok(shell, f"%fsdp load {tmp_path / 'llama'} --world-size 2")
    llama = shell.user_ns["llama"]
    assert next(llama.parameters()).dtype == torch.float32
    _same_weights(llama, pretrained)  # bf16 values, exactly, in fp32


def test_a_checkpoint_of_another_model_is_refused_naming_what_does_not_fit_and_nothing_changes(shell, tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    _notebook_llama(shell)
    before = {name: tensor.clone() for name, tensor in shell.user_ns["llama"].state_dict().items()}
    error, _ = run_failing(shell, f"%fsdp load {tmp_path / 'gpt2'} --model llama --world-size 2")
    said = str(error)
    assert isinstance(error, UsageError), error
    assert "does not fit llama" in said and "not in the weights: model.embed_tokens.weight" in said, said
    assert "only in the weights: transformer.h.0.attn.c_attn.bias" in said, said
    _same_weights(shell.user_ns["llama"], type("Held", (), {"state_dict": lambda self: before})())
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}'
    )
    error, _ = run_failing(shell, f"%fsdp load {tmp_path / 'broken'} --world-size 2")
    assert isinstance(error, UsageError) and "names files that are not there: model-00001-of-00002" in str(error)


def test_a_directory_that_is_no_checkpoint_says_what_it_lacks(shell, tmp_path):
    """Before, any directory without nbfsdp's manifest was called an nbfsdp save that did not finish."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "pytorch_model.bin").write_bytes(b"")
    error, _ = run_failing(shell, f"%fsdp load {tmp_path / 'weights'}")
    assert isinstance(error, UsageError), error
    assert "not a checkpoint: no nbfsdp.json (nbfsdp's) and no model.safetensors" in str(error), error
