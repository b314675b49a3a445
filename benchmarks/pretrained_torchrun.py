"""The reference side of ``benchmarks.pretrained``'s load row: a Hugging Face checkpoint read under torchrun as
torchtitan reads one, into a ``fully_shard``-ed model built on the meta device.

    torchrun --nproc-per-node 2 -m benchmarks.pretrained_torchrun DIR OUT.json

Each rank, from a barrier after ``init_process_group``: the model built on the meta device from the
checkpoint's config (``from_config`` under ``torch.device("meta")``, in the config's dtype), ``fully_shard``
on each decoder layer and the root, ``to_empty`` on the CPU, DCP's ``HuggingFaceStorageReader`` into the
sharded state dict, the rotary buffers made again (they are in no checkpoint: ``_init_weights``), to a
barrier. Rank 0 writes the slowest rank's seconds, and the largest peak growth of a rank over that time
(``VmHWM`` after a reset at the first barrier), to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.fsdp import fully_shard

from benchmarks import procmem


def main(directory: str, out: str) -> None:
    dist.init_process_group("gloo")
    config = transformers.AutoConfig.from_pretrained(directory)
    dist.barrier()
    baseline = procmem.reset_peak(os.getpid())
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    state = model.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(directory))
    with torch.no_grad():  # the rotary buffers, non-persistent: transformers 5's _init_weights makes them
        model._init_weights(model.model.rotary_emb)
    dist.barrier()
    seconds = torch.tensor([time.perf_counter() - started])
    peak = torch.tensor([procmem.read(os.getpid())["hwm"] - baseline], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(out, "w") as file:
            json.dump({"seconds": seconds.item(), "peak_bytes": peak.item()}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
