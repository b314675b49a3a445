"""Full (unsharded) state dicts to a folder, one subfolder per save, in the shape of pytorch/examples'
FSDP2 ``checkpoint.py``: rank 0 writes what every rank helped gather."""

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

MODEL_CHECKPOINT = "model_state_dict.pt"
OPTIM_CHECKPOINT = "optim_state_dict.pt"


class Checkpointer:
    def __init__(self, folder: str):
        self.folder = folder
        saves = [int(name) for name in os.listdir(folder) if name.isdigit()] if os.path.isdir(folder) else []
        self.last_training_time = max(saves, default=None)

    def save(self, model, optim):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optim, options=options)
        if dist.get_rank() == 0:
            folder = os.path.join(self.folder, str(int(time.time() * 1000)))
            os.makedirs(folder, exist_ok=True)
            torch.save(model_state, os.path.join(folder, MODEL_CHECKPOINT))
            torch.save(optim_state, os.path.join(folder, OPTIM_CHECKPOINT))
