"""The GPT-2 loop people bring to FSDP (the TorchAcc FSDP document's): its source, and the two ways it runs
outside a notebook.

Hugging Face GPT-2 built from its config (124M; dropout off, so every side computes the same function),
batches of 16 x 512 tokens read through ``tqdm`` from a shuffled DataLoader of dict batches, each moved with
``{k: v.to(device)}``, AdamW, bf16 autocast, ``loss.item()`` every step. ``SETUP_SOURCE`` builds the model,
the data and the loader (in the notebook, or in each process here); ``LOOP_SOURCE`` is the loop, the same
text in every side: plain (one process, the model on the device, fp32 parameters under autocast), FSDP2
under torchrun (``fully_shard`` on every ``GPT2Block`` and the root, ``MixedPrecisionPolicy(bf16, fp32)``:
nbfsdp's DEFAULT, Composer's and torchtitan's default), and a ``%%fsdp`` cell (``benchmarks/gpu_loop.py``).

    python -m benchmarks.gpt2_loop plain CONFIG OUT
    python -m torch.distributed.run --standalone --nproc-per-node 1 -m benchmarks.gpt2_loop fsdp CONFIG OUT

CONFIG is a JSON file of ``Sizes`` fields plus ``device``; OUT gets rank 0's step times, losses, FSDP units
and CUDA memory (after the last step, and the peak).
"""

from __future__ import annotations

import builtins
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Sizes:
    layers: int
    width: int
    heads: int
    batch: int
    """Sequences per step: the global batch (a ``%%fsdp`` cell splits it over its ranks)."""
    sequence: int
    steps: int
    warmup: int
    """Leading steps left out of the median (lazy init, AdamW's state, the allocator growing)."""
    seed: int = 0
    vocab: int = 50257
    """GPT-2's; the quick sizes' is small: on a CPU without bf16 instructions (AVX2 only) the head's bf16 matmul
    over 50,257 tokens took a quick step to seconds (torch's fallback there runs bf16 at under 1 GFLOP/s)."""

    def as_dict(self) -> dict:
        return asdict(self)


#: GPT-2 124M at the document's batch; a tiny one for ``--quick`` and the CPU test of the benchmark itself.
FULL = Sizes(layers=12, width=768, heads=12, batch=16, sequence=512, steps=40, warmup=10)
QUICK = Sizes(layers=2, width=64, heads=2, batch=4, sequence=64, steps=8, warmup=3, vocab=1024)
#: The modules both FSDP sides shard one by one (``GPT2Block`` is GPT-2's ``_no_split_modules``).
WRAP_CLS = "GPT2Block"

SETUP_SOURCE = """
import time

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel


class Tokens(Dataset):
    '''Token ids made locally (nothing downloaded): each item a dict, as a tokenized dataset gives them.'''

    def __init__(self, rows, sequence, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, sequence), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


config = GPT2Config(
    n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=SEQUENCE, vocab_size=VOCAB,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
torch.manual_seed(SEED)
model = GPT2LMHeadModel(config)
data = Tokens(STEPS * BATCH, SEQUENCE, config.vocab_size, SEED)
loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED))
"""

LOOP_SOURCE = """
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
losses, step_times = [], []
started = time.perf_counter()
for step, batch in enumerate(tqdm(loader, mininterval=5)):
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # after a step, on this GPU
    if LOG_EACH_STEP:
        nbfsdp.log(step=step, loss=losses[-1])
    step_times.append(time.perf_counter() - started)
    started = time.perf_counter()
del opt, batch, loss
"""


def constants(sizes: Sizes) -> str:
    """The sizes as the notebook's (and each process's) globals."""
    return "".join(f"{field.upper()} = {value!r}\n" for field, value in sizes.as_dict().items())


def sharded(model: Any, device_type: str) -> tuple[Any, list[str]]:
    """A torchrun process's world started and ``model`` sharded in place as both FSDP sides shard it: its device
    and its FSDP units."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [name for name, module in model.named_modules() if type(module).__name__ == WRAP_CLS]
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: FSDP2's own reshard choice, as nbfsdp's
    return device, [*units, ""]


def main(mode: str, config_path: str, out_path: str) -> None:
    import torch

    with open(config_path) as file:
        config = json.load(file)
    device_type = config.pop("device")
    sizes = Sizes(**config)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(constants(sizes) + SETUP_SOURCE, "<setup>", "exec"), namespace)
    model = namespace["model"]
    units: list[str] = []
    if mode == "fsdp":
        device, units = sharded(model, device_type)
    else:
        device = torch.device(device_type)
        model.to(device)
    namespace.update(model=model, device=device, LOG_EACH_STEP=False)
    exec(compile(LOOP_SOURCE, "<loop>", "exec"), namespace)
    result = {"step_times": namespace["step_times"], "losses": namespace["losses"], "units": units}
    if device.type == "cuda":
        result["cuda_allocated"] = namespace["allocated"]
        result["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
    if mode != "fsdp" or torch.distributed.get_rank() == 0:
        with open(out_path, "w") as file:
            json.dump(result, file)
    if mode == "fsdp":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
