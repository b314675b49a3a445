"""The benchmark's training loop under torchrun, sharded with plain FSDP2 calls (no nbfsdp code).

Launched by the benchmarks as
``python -m torch.distributed.run --standalone --nproc-per-node N -m benchmarks.torchrun_loop CONFIG OUT``:
CONFIG is a JSON file of ``loops.LoopSizes`` fields plus ``device`` (cpu or cuda); rank 0 writes OUT, a JSON
file with its per-step times (wall and CPU) and losses, the FSDP units, and its thread settings (and, for a
loop from a loader, the samples all ranks read at each step).

Same model, seed, per-rank batch and loop text as the ``%%fsdp`` cell (``loops.py``), a loop from a loader
reading the same data through a ``DistributedSampler``; the same modules are FSDP units, with the same mixed
precision, as nbfsdp's flags in ``loops.cell_flags`` ask for.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from benchmarks import loops


def main(config_path: str, out_path: str) -> None:
    with open(config_path) as file:
        config = json.load(file)
    device_type = config.pop("device")
    # benchmarks.slurm: when rank 0 leaves its first collective ("only": then end, no loop)
    mark_ready = config.pop("mark_ready", False)
    sizes = loops.LoopSizes(**{k: v for k, v in config.items() if k != "params"})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if mark_ready:
        dist.barrier()
        ready_at = time.time()
        if mark_ready == "only":  # the start-up alone
            if rank == 0:  # whole or not there: the launcher may read it while the job still ends
                partial = f"{out_path}.partial"
                with open(partial, "w") as file:
                    json.dump({"ready_at": ready_at}, file)
                os.replace(partial, out_path)
            dist.destroy_process_group()
            return

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(loops.setup_source(sizes), "<setup>", "exec"), namespace)
    exec(compile(loops.NEW_MODEL_SOURCE, "<model>", "exec"), namespace)
    model = namespace["model"]

    mesh = init_device_mesh(device.type, (world_size,))
    param_dtype, reduce_dtype = (getattr(torch, d) for d in loops.MIXED_PRECISION_DTYPES[sizes.mixed_precision])
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = [name for name, module in model.named_modules() if type(module).__name__ == loops.WRAP_CLS]
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: FSDP2's own reshard choice, as nbfsdp leaves it

    namespace.update(model=model, rank=rank, world_size=world_size, device=device, LOG_EACH_STEP=False)
    if sizes.from_loader:
        data = loops.dataset_source(sizes, world_size) + loops.TORCHRUN_LOADER_SOURCE
        exec(compile(data, "<data>", "exec"), namespace)
    exec(compile(loops.loop_source(sizes), "<loop>", "exec"), namespace)

    if rank == 0:
        result = {
            "step_times": namespace["step_times"],
            "step_cpu_times": namespace["step_cpu_times"],
            "losses": namespace["losses"],
            "units": [*units, ""],
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        }
        if sizes.from_loader:
            result["global_batches"] = namespace["global_batches"]
        if mark_ready:
            result["ready_at"] = ready_at
        with open(out_path, "w") as file:
            json.dump(result, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
