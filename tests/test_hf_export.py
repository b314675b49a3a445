"""Out to a Hugging Face directory (issue 43, point 4): ``%fsdp save OUT --hf`` from the live ranks and
``%fsdp export CKPT OUT --hf`` from an nbfsdp checkpoint write what ``save_pretrained`` writes (the same
files, split and index, the config; a tie once), and ``from_pretrained(OUT)`` gives the ranks' logits. Tiny
Llama (grouped-query attention, rotary) and GPT-2 (tied embeddings) built from configs: nothing downloaded.

The ranks write with DCP's ``HuggingFaceStorageWriter`` where torch has it (>= 2.8); torch 2.6 and 2.7 write
file by file from rank 0 (``writer="rank0"``), checked here on this torch too. (Not marked ``floor``: the floor's
environment has no transformers; with transformers, safetensors and huggingface_hub on its path every test here
passes on torch 2.6.)
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the examples extra: make test installs it, so these tests always run there
from IPython.core.error import UsageError
from safetensors import safe_open

import nbfsdp
from nbfsdp.engines import hf_saving
from nbfsdp.kernel.checkpoints import hf_export, sharded
from tests.conftest import forget_after_each_test, run_failing, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(300)]

MODELS = {
    "llama": "transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, "
    "num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)",
    "gpt2": "transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, "
    "embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)",
}


#: The shell is shared: a model left in it (``kept`` is the trained ``lm`` under another name) would match a
#: later test's checkpoint as well as that test's own model
_forget = forget_after_each_test("lm", "kept")


@pytest.fixture(autouse=True)
def _a_world_of_its_own(shell):
    """The shell is shared: an earlier test's world may hold other models, which a save without --model names.
    Its engines killed, the next cell starts a new world that holds none; the fork server stays (a ``%fsdp stop``
    would start a new one, its imports seconds of CPU a test)."""
    nbfsdp._magics.session.cluster.kill_engines()


#: Small enough that each tiny model takes 3 files or more.
SHARD = "40KB"

TRAIN = """%%fsdp --world-size 2 --mixed-precision FULL
opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
ids = tokens[2 * rank : 2 * rank + 2]
loss = lm(input_ids=ids, labels=ids).loss
loss.backward(); opt.step(); opt.zero_grad()
with torch.no_grad():
    ranks_logits = lm(input_ids=probe).logits
"""


def _trained(shell, kind: str) -> torch.nn.Module:
    """The notebook's ``lm`` after one step on two ranks (the ranks hold it sharded)."""
    run_ok(
        shell,
        f"import torch, transformers\nconfig = {MODELS[kind]}\ntorch.manual_seed(0)\n"
        "lm = transformers.AutoModelForCausalLM.from_config(config)\n"
        "tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))\n"
        "probe = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))",
    )
    run_ok(shell, TRAIN)
    return shell.user_ns["lm"]


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _same_as_save_pretrained(out, reference) -> None:
    """``out`` holds what ``reference`` (``save_pretrained`` of the same weights, same shard size) holds:
    the same files, each with the same tensors, the same index and config."""
    assert _files(out) == _files(reference), (_files(out), _files(reference))
    for path in reference.glob("*.safetensors"):
        with safe_open(str(path), "pt") as expected, safe_open(str(out / path.name), "pt") as written:
            keys = sorted(expected.keys())
            assert sorted(written.keys()) == keys, path.name
            for key in keys:
                torch.testing.assert_close(written.get_tensor(key), expected.get_tensor(key), rtol=0, atol=0)
    index = "model.safetensors.index.json"
    if (reference / index).exists():  # transformers 5 adds metadata.total_parameters, 4 has not
        written, expected = (json.loads((where / index).read_text()) for where in (out, reference))
        assert written["weight_map"] == expected["weight_map"]
        assert written["metadata"]["total_size"] == expected["metadata"]["total_size"]
    for name in ("config.json", "generation_config.json"):
        if (reference / name).exists():
            assert json.loads((out / name).read_text()) == json.loads((reference / name).read_text()), name


def _reloaded_logits(out, shell) -> torch.Tensor:
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        return reloaded(input_ids=shell.user_ns["probe"]).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_save_and_export_hf_write_what_save_pretrained_writes_and_reload_to_the_ranks_logits(shell, tmp_path, kind):
    lm = _trained(shell, kind)
    reference = tmp_path / "reference"
    lm.save_pretrained(reference, max_shard_size=SHARD)
    assert len(list(reference.glob("*.safetensors"))) >= 3

    run_ok(shell, f"%fsdp save {tmp_path / 'saved'} --hf --max-shard-size {SHARD}")
    run_ok(shell, f"%fsdp save {tmp_path / 'ckpt'}")
    run_ok(shell, f"%fsdp export {tmp_path / 'ckpt'} {tmp_path / 'exported'} --hf --max-shard-size {SHARD}")
    with torch.no_grad():
        notebook_logits = lm(input_ids=shell.user_ns["probe"]).logits
    torch.testing.assert_close(shell.user_ns["ranks_logits"], notebook_logits)
    for out in (tmp_path / "saved", tmp_path / "exported"):
        _same_as_save_pretrained(out, reference)
        torch.testing.assert_close(_reloaded_logits(out, shell), shell.user_ns["ranks_logits"])

    # no --max-shard-size: one model.safetensors and no index, as save_pretrained writes a small model
    run_ok(shell, f"%fsdp save {tmp_path / 'one'} --hf")
    lm.save_pretrained(tmp_path / "one-reference")
    assert "model.safetensors" in _files(tmp_path / "one")
    _same_as_save_pretrained(tmp_path / "one", tmp_path / "one-reference")


def test_a_tie_is_written_once_and_reloads_tied_from_either_writer(shell, tmp_path, capsys):
    """GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``: written once, under the embedding's name, as
    ``save_pretrained`` keeps it; the same from rank 0's file-by-file writer, torch 2.6's and 2.7's path."""
    lm = _trained(shell, "gpt2")
    lm.save_pretrained(tmp_path / "reference", max_shard_size=SHARD)
    session = nbfsdp._magics.session
    capsys.readouterr()
    hf_export.save(session, tmp_path / "rank0", hf_export.HFOptions(max_shard_size=SHARD), overwrite=False,
                   on_every_rank=sharded._on_every_rank, writer="rank0")  # fmt: skip
    assert "written by rank 0 one file at a time" in capsys.readouterr().out
    run_ok(shell, f"%fsdp save {tmp_path / 'default'} --hf --max-shard-size {SHARD}")
    default = "every rank, joined on disk" if hf_saving.dcp_writer_usable() else "rank 0 one file at a time"
    assert f"written by {default}" in capsys.readouterr().out
    for out in (tmp_path / "rank0", tmp_path / "default"):
        _same_as_save_pretrained(out, tmp_path / "reference")
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=shell.user_ns["probe"]).logits, shell.user_ns["ranks_logits"])


def test_bad_flags_a_directory_in_the_way_and_a_model_without_config_are_usage_errors(shell, tmp_path, tiny_model):
    _trained(shell, "llama")
    for line, said in [
        (f"save {tmp_path / 'a'} --hf --max-shard-size lots", "use a size such as 200MB, 5GB"),
        (f"save {tmp_path / 'a'} --hf --max-shard-size 0MB", "use a size such as 200MB, 5GB"),
        (f"save {tmp_path / 'a'} --max-shard-size 200MB", "--max-shard-size: only with --hf"),
        (f"save {tmp_path / 'a'} --hf --async", "leave out --async"),
        (f"save {tmp_path / 'a'} --hf --model nothing", "no model 'nothing': --model one of lm"),
        (f"export {tmp_path / 'a'} {tmp_path / 'b'} --max-shard-size 1GB", "go with --hf"),
    ]:
        error, _ = run_failing(shell, f"%fsdp {line}")
        assert isinstance(error, UsageError) and said in str(error), (line, error)
    assert not (tmp_path / "a").exists()

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    error, _ = run_failing(shell, f"%fsdp save {tmp_path / 'data'} --hf --overwrite")
    assert isinstance(error, UsageError) and "other files than a Hugging Face model's" in str(error), error
    assert _files(tmp_path / "data") == ["notes.txt"]
    run_ok(shell, f"%fsdp save {tmp_path / 'out'} --hf")
    error, _ = run_failing(shell, f"%fsdp save {tmp_path / 'out'} --hf")
    assert isinstance(error, UsageError) and "--overwrite (overwrite=True) replaces it" in str(error), error
    run_ok(shell, f"%fsdp save {tmp_path / 'out'} --hf --overwrite --max-shard-size {SHARD}")
    assert "model.safetensors.index.json" in _files(tmp_path / "out") and "model.safetensors" not in _files(
        tmp_path / "out"
    )

    run_ok(shell, f"%fsdp save {tmp_path / 'ckpt'}")
    shell.user_ns["kept"] = shell.user_ns.pop("lm")
    error, _ = run_failing(shell, f"%fsdp export {tmp_path / 'ckpt'} {tmp_path / 'b'} --hf")
    assert isinstance(error, UsageError) and "the notebook has none: build it first" in str(error), error
    assert not (tmp_path / "b").exists()

    # a model with no Hugging Face config: Net, trained on the ranks
    run_ok(shell, "%%fsdp --world-size 2\nout = model(torch.randn(4, 8)).sum()\nout.backward()")
    error, _ = run_failing(shell, f"%fsdp save {tmp_path / 'net'} --hf --model model")
    assert isinstance(error, UsageError) and "model (Net) has no Hugging Face .config" in str(error), error
    assert not (tmp_path / "net").exists()
