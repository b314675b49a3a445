"""The fences around other libraries than torch (``*_private.py``), each helper called directly on the real
library: a release that moves what one relies on fails here, by name."""

from __future__ import annotations

import io

import pytest
import torch.nn as nn

pytestmark = pytest.mark.floor


def test_transformers_config_builder_builds_a_model_class_and_an_auto_class():
    transformers = pytest.importorskip("transformers")
    from nbfsdp.kernel.checkpoints.transformers_private import config_builder

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = config_builder(transformers.GPT2LMHeadModel)(config)  # PreTrainedModel's private _from_config
    auto = config_builder(transformers.AutoModelForCausalLM)(config)  # the auto class's public from_config
    assert type(model) is type(auto) is transformers.GPT2LMHeadModel
    assert config_builder(nn.Linear) is None


def test_tqdm_unwrapped_finds_the_file_under_its_wrappers():
    utils = pytest.importorskip("tqdm.utils")

    from nbfsdp.engines.tqdm_private import unwrapped

    file = io.StringIO()
    assert unwrapped(utils.SimpleTextIOWrapper(utils.SimpleTextIOWrapper(file, "utf-8"), "utf-8")) is file
    assert unwrapped(file) is file and unwrapped(None) is None


def test_peft_lora_adapters_and_base_read_as_peft_makes_them():
    peft = pytest.importorskip("peft")
    from nbfsdp.shared import peft_private

    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights="gaussian"))
    adapter_a = next(name for name, _ in model.named_modules() if name.endswith("lora_A.default"))
    assert peft_private.lora_adapter(model, adapter_a) == ("lora_A", "gaussian", 2)
    assert peft_private.lora_adapter(model, adapter_a.replace("lora_A", "lora_B"))[0] == "lora_B"
    assert peft_private.lora_adapter(model, "base_model.model.2") is None
    inside, found = peft_private.wrapped_model(model)
    assert found is base and inside == "base_model.model."
    assert peft_private.name_in_base("base_model.model.0.base_layer.weight", inside) == "0.weight"
    assert peft_private.wrapped_model(base) == ("", base)
    copy = nn.Linear(4, 2)
    # lora_B made zero: the adapted model starts as its base
    peft_private.lora_init("lora_B", how="gaussian", rank=2)(copy)
    assert copy.weight.abs().sum() == 0
    assert peft_private.lora_init("lora_A", how="pissa", rank=2) is None  # reads the base's weights: not on one rank
