"""A data-parallel FSDP2 script as PyTorch's distributed tutorials write one for ``torchrun``: the process
group from the environment (env://), a ``DistributedSampler`` given this rank, the optimizer built after
``fully_shard``. Run with ``torchrun --nproc-per-node 2 tutorial.py``."""

import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class ToyModel(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def make_dataset(samples=128, width=32):
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, width, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) / width)


def main():
    dist.init_process_group()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = ToyModel().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item()}")
    del model, optimizer
    gc.collect()  # the sharded model's last collectives freed while the group lives: gloo aborts otherwise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
