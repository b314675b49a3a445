"""Fine-tuning as people do it (issue 44, points 1 and 2): LoRA with peft on a frozen bf16 base, on real weights in
the notebook or on the meta device with its weights read by the ranks from a checkpoint directory; each unit's
parameters kept in the dtype the model stores them in, units split where their trainable parameters mix dtypes;
only the adapters have gradients and optimizer state on the ranks, and only they come back. Tiny models built from
configs, real ranks, peft itself."""

from __future__ import annotations

import copy

import bitsandbytes  # the qlora extra, as peft the peft extra: make test installs both, so neither test skips
import peft
import pytest
import torch
import torch.nn as nn
import transformers

import nbfsdp
from tests.conftest import forget_after_each_test, run_failing, run_ok

pytestmark = pytest.mark.timeout(300)

LLAMA = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
STEPS = 10
LORA = "peft.LoraConfig(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'])"

#: Each rank its half of the global batch; AdamW over the trainable parameters only, as a LoRA loop builds it.
TRAIN = """%%fsdp --world-size 2
opt = torch.optim.AdamW([p for p in {model}.parameters() if p.requires_grad], lr=1e-2)
for step in range({steps}):
    tokens = batches[step][rank::world_size]
    loss = {model}(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if step == {steps} - 1:
        grads = sum(p.grad.to_local().nbytes for p in {model}.parameters() if p.grad is not None)
    opt.step()
    opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
optim_bytes = sum(
    (t.to_local() if hasattr(t, "to_local") else t).nbytes for state in opt.state.values() for t in state.values()
)
nbfsdp.log(step={steps}, grads=grads, optim=optim_bytes)
"""


_forget = forget_after_each_test(
    "base", "model", "batches", "opt", "loss", "tokens", "step", "grads", "optim_bytes", "initial", "peft"
)


def _batches(shell) -> torch.Tensor:
    batches = torch.randint(0, 96, (STEPS, 4, 12), generator=torch.Generator().manual_seed(11))
    shell.user_ns["batches"] = batches
    run_ok(shell, "import torch, transformers, peft, nbfsdp")
    return batches


def _one_process(model: nn.Module, batches: torch.Tensor) -> list[float]:
    """The same peft model trained in this process on the whole global batch."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(len(batches)):
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _losses() -> list[float]:
    run = nbfsdp.last_run()
    return [(a + b) / 2 for a, b in zip(run.metric("loss", 0), run.metric("loss", 1), strict=True)]


def _adapter_share(model: nn.Module, rank: int, world_size: int = 2) -> int:
    """Bytes of this rank's rows of every trainable parameter (FSDP2 shards dim 0 as ``torch.chunk`` does)."""
    share = 0
    for param in model.parameters():
        if param.requires_grad:
            rows = param.shape[0]
            per = -(-rows // world_size)
            mine = max(0, min(per, rows - per * rank))
            share += mine * param[0].numel() * param.element_size()
    return share


def _assert_adapters_only_train(model: nn.Module, plan) -> None:
    """Each rank's gradients and AdamW state, measured on it, are its share of the adapters to the byte (a step
    counter each besides), as explain predicts: the frozen base has none."""
    run, trainable = nbfsdp.last_run(), sum(p.requires_grad for p in model.parameters())
    for rank in range(2):
        grads, optim = run.metric("grads", rank)[0], run.metric("optim", rank)[0]
        assert grads == _adapter_share(model, rank) == plan.memory[rank]["grads"]
        assert optim == 2 * _adapter_share(model, rank) + 4 * trainable  # exp_avg, exp_avg_sq, a step each


#: ``torch.testing.assert_close``'s defaults for bfloat16.
_BF16_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-5}


def test_lora_on_a_bf16_base_trains_as_one_process_and_only_the_adapters_come_back(shell, tmp_path):
    batches = _batches(shell)
    run_ok(
        shell,
        "torch.manual_seed(0)\n"
        f"base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{LLAMA!r})).to(torch.bfloat16)\n"
        f"model = peft.get_peft_model(base, {LORA})\n",
    )
    model = shell.user_ns["model"]
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n and p.dtype == torch.float32 for n, p in adapters.items())  # peft's fp32
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    plan = nbfsdp.explain(model, world_size=2)
    assert plan.dtypes["param_dtype"] == "as stored (bfloat16 and float32)"  # FULL casts nothing up
    assert {u.cls for u in plan.units[1:]} == {"LlamaDecoderLayer"}  # the base's layers, through peft's wrappers
    assert sum(u.frozen for u in plan.units) == sum(p.numel() for p in frozen.values())
    assert "have no gradient and no optimizer state" in str(plan)

    run_ok(shell, TRAIN.format(model="model", steps=STEPS))
    torch.testing.assert_close(_losses(), _one_process(reference, batches), rtol=1e-5, atol=0)
    # the adapters trained as one process's, within the tolerance of the dtype they are computed through: their
    # gradients come back through the bf16 base, whose matmuls round by the CPU's kernels (one machine's
    # oneDNN summed in another order than another's: lora_A differed at fp32's tolerance)
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param, dict(reference.named_parameters())[name], msg=name, **_BF16_TOLERANCE if "lora_" in name else {}
        )
    for name, tensor in frozen.items():
        assert torch.equal(dict(model.named_parameters())[name], tensor), name

    run = nbfsdp.last_run()
    assert run.gathered_bytes == {"model": sum(p.nbytes for p in adapters.values())}  # the adapters, not the base
    _assert_adapters_only_train(model, plan)

    tokens = batches[0]
    with torch.no_grad():
        adapted = model(input_ids=tokens).logits
    merged = model.merge_and_unload()  # in the notebook, on what came back
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits, adapted, rtol=2e-2, atol=2e-2)  # bf16 merge


def test_the_adapters_saved_after_a_cell_are_what_peft_loads(shell, tmp_path):
    batches = _batches(shell)
    run_ok(
        shell,
        f"torch.manual_seed(0)\nbase = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{LLAMA!r}))\n",
    )
    pristine = copy.deepcopy(shell.user_ns["base"])  # the base as it is, without adapters
    run_ok(shell, f"model = peft.get_peft_model(base, {LORA})\n")
    run_ok(shell, TRAIN.format(model="model", steps=3))
    model = shell.user_ns["model"]
    model.save_pretrained(tmp_path / "adapters")
    assert (tmp_path / "adapters" / "adapter_model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(pristine, tmp_path / "adapters")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batches[0]).logits, model(input_ids=batches[0]).logits)


def test_lora_on_a_meta_base_read_by_the_ranks_trains_as_one_process(shell, tmp_path):
    directory = tmp_path / "llama"
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(directory, max_shard_size="40KB")
    batches = _batches(shell)
    run_ok(shell, f"base = nbfsdp.from_pretrained({str(directory)!r})\nmodel = peft.get_peft_model(base, {LORA})\n")
    model = shell.user_ns["model"]
    assert all(p.is_meta for p in model.parameters())  # peft put its adapters on the base's device
    plan = nbfsdp.explain(model, world_size=2)
    # the adapters, made on the ranks as peft makes them, as the cell found them
    run_ok(shell, "%%fsdp --world-size 2\ninitial = {n: p.full_tensor() for n, p in model.named_parameters() "
           "if p.requires_grad}\n")  # fmt: skip
    initial = shell.user_ns["initial"]
    assert all(torch.count_nonzero(t) == 0 for n, t in initial.items() if "lora_B" in n)  # starts as the base
    assert all(torch.count_nonzero(t) > 0 for n, t in initial.items() if "lora_A" in n)
    run_ok(shell, TRAIN.format(model="model", steps=STEPS))
    losses = _losses()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(not p.is_meta for p in adapters.values())  # the trained adapters came back
    assert all(p.is_meta for n, p in model.named_parameters() if n not in adapters)  # the base did not
    assert nbfsdp.last_run().gathered_bytes == {"model": sum(p.nbytes for p in adapters.values())}
    assert "on the 2 ranks only" in repr(model) and "its trained parameters (3.5 KiB) here too" in repr(model)
    _assert_adapters_only_train(model, plan)
    model.save_pretrained(tmp_path / "adapters")  # what peft loads, with the base still on the ranks
    run_ok(shell, "%%fsdp --world-size 2\nmode = model.training\n")  # reads only: nothing comes back
    assert nbfsdp.last_run().gathered_bytes == {}

    reference = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(directory), eval(LORA))
    reference.load_state_dict(initial, strict=False)
    torch.testing.assert_close(losses, _one_process(reference, batches), rtol=1e-5, atol=0)

    nbfsdp.gather(model)  # the base as read and the trained adapters, here
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, msg=name)
    saved = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(directory), tmp_path / "adapters"
    )
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=batches[0]).logits, reference(input_ids=batches[0]).logits)
        expected = reference(input_ids=batches[0]).logits
        torch.testing.assert_close(model.merge_and_unload()(input_ids=batches[0]).logits, expected)


def test_a_lora_init_that_reads_the_base_is_refused_on_a_meta_base(shell, tmp_path):
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(directory)
    _batches(shell)
    run_ok(
        shell,
        f"base = nbfsdp.from_pretrained({str(directory)!r})\n"
        "model = peft.get_peft_model(\n"
        "    base, peft.LoraConfig(r=4, target_modules=['q_proj'], init_lora_weights='orthogonal')\n"
        ")",
    )
    error, _ = run_failing(shell, "%%fsdp --world-size 2\nmodel.train()\n")
    assert "init_lora_weights='orthogonal', which the ranks cannot apply to one adapter matrix" in str(error)
    assert "init_lora_weights=True" in str(error)


def test_qlora_4bit_storage_is_refused_before_any_rank_sees_it(shell):
    shell.user_ns["model"] = nn.Sequential(bitsandbytes.nn.Linear4bit(16, 16, compute_dtype=torch.float32))
    error, _ = run_failing(shell, "%%fsdp --world-size 2\nmodel.train()\n")
    assert "model.0.weight is a bitsandbytes 4-bit parameter (QLoRA): FSDP2's sharding drops" in str(error)
    assert "nbfsdp.from_pretrained(DIR, dtype=torch.bfloat16)" in str(error)
