"""Training with FSDP2 from a model built on the meta device, in the shape of pytorch/examples' FSDP2
``example.py``: run with ``torchrun --nproc-per-node 2 train.py``."""

import argparse
import gc
import os

import torch
from checkpoint import Checkpointer
from model import ModelArgs, Transformer
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def set_modules_to_forward_prefetch(model, num_to_forward_prefetch):
    for i, layer in enumerate(model.layers):
        following = model.layers[i + 1 : i + 1 + num_to_forward_prefetch]
        if len(following):
            layer.set_modules_to_forward_prefetch(list(following))


def set_modules_to_backward_prefetch(model, num_to_backward_prefetch):
    for i, layer in enumerate(model.layers):
        earlier = model.layers[max(0, i - num_to_backward_prefetch) : i]
        if len(earlier):
            layer.set_modules_to_backward_prefetch(list(reversed(earlier)))


def main(args):
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend, device_id=device)

    torch.manual_seed(0)
    vocab_size, batch_size, seq_len = 64, 8, 16
    model_args = ModelArgs(n_layers=2, vocab_size=vocab_size, max_seq_len=seq_len, dropout_p=0.0)
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_kwargs = {}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    if args.explicit_prefetching:
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)

    checkpointer = Checkpointer("checkpoints")
    model.to_empty(device=device)
    model.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    for step in range(5):
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        if torch.distributed.get_rank() == 0:
            print(f"step {step} loss {loss.item()}")

    checkpointer.save(model, optim)
    del model, optim
    gc.collect()  # the sharded model's last collectives freed while the group lives: gloo aborts otherwise
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FSDP2 from the meta device")
    parser.add_argument("--explicit-prefetching", action="store_true", default=False)
    parser.add_argument("--mixed-precision", action="store_true", default=False)
    args = parser.parse_args()
    main(args)
