"""torchrun's cold start of a world, for ``cold_start``: import torch, join the process group, one all_reduce.

Launched as ``python -m torch.distributed.run --standalone --nproc-per-node N -m benchmarks.torchrun_cold``;
the benchmark times the whole launch (the launcher's own start included) from outside.
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
