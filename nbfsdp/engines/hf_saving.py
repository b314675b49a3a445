"""What each rank runs for ``%fsdp save OUT --hf``: the model the ranks hold, written as ``save_pretrained``
writes it (``nbfsdp.shared.hf_files``), no process ever holding more of it than its shard and one file.

Where torch has DCP's ``HuggingFaceStorageWriter`` with consolidation (public since torch 2.8), every rank
writes its own shards of every tensor (``OUT/sharded/``), then rank 0 joins them into the planned files
tensor by tensor from disk and the shards are removed. Elsewhere (torch 2.6, 2.7) rank 0 writes file by
file: every rank takes part in the all-gather of each tensor of one file (``full_tensor()``), rank 0
writes that file and drops it before the next. Either way rank 0 then writes the config the kernel made,
the index when there are several files, and renames the directory into place: it appears complete or not
at all.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from nbfsdp.engines import world as worlds
from nbfsdp.shared import hf_files
from nbfsdp.shared.checkpoints import CheckpointError
from nbfsdp.shared.hf_files import HFSave

Writer = Literal["dcp", "rank0"]


def dcp_writer_usable() -> bool:
    """DCP's HF writer with every rank writing its shards and a consolidation into full files (torch >= 2.8)."""
    writer = getattr(dcp, "HuggingFaceStorageWriter", None)
    if writer is None:
        return False
    parameters = inspect.signature(writer).parameters
    return {"fqn_to_index_mapping", "save_distributed", "enable_consolidation"} <= set(parameters)


def save(request: HFSave, writer: Writer | None = None) -> dict[str, Any] | None:
    """On every rank at once; rank 0 returns what it wrote (files, bytes, how). ``writer``: "dcp" (DCP's
    HF writer) or "rank0" (file by file from rank 0); by default DCP's where torch has it."""
    world = worlds.of_generation(request.generation)
    if request.model not in world.models:
        raise CheckpointError(f"the ranks hold no model {request.model!r}: they hold {', '.join(sorted(world.models))}")
    module = world.models[request.model][1].module
    dtype = hf_files.written_dtype(request.dtype)
    names = hf_files.kept_names(module)
    full = get_model_state_dict(module)  # this rank's shards (DTensors), under the module's own names
    state = {name: _cast(full[name], dtype) for name in names}
    del full
    sizes = {name: hf_files.nbytes(tensor.shape, tensor.dtype) for name, tensor in state.items()}
    plan = hf_files.file_plan(sizes, request.max_shard_bytes)
    partial = Path(request.partial)
    partial.mkdir(parents=True, exist_ok=True)
    how = writer or ("dcp" if dcp_writer_usable() else "rank0")
    if how == "dcp":
        _write_with_dcp(state, plan, partial)
    else:
        _write_file_by_file(state, plan, partial, world.rank)
    dist.barrier()  # every file is written: only now may rank 0 complete the directory
    if world.rank != 0:
        return None
    files = sorted(set(plan.values()))
    written = dict(request.extra_files)
    if len(files) > 1:
        parameters = sum(p.numel() for p in module.parameters())  # global sizes; a tie once, as num_parameters()
        written[hf_files.INDEX_NAME] = hf_files.index_json(plan, sizes, parameters)
    hf_files.write_text(partial, written)
    hf_files.finish(partial, request.final, overwrite=request.overwrite)
    return {"files": files, "bytes": sum(sizes.values()), "writer": how}


def _cast(tensor: Any, dtype: torch.dtype | None) -> torch.Tensor:
    assert isinstance(tensor, torch.Tensor)  # a model's state dict: tensors (DTensors where sharded)
    tensor = tensor.detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _write_with_dcp(state: dict[str, torch.Tensor], plan: dict[str, str], partial: Path) -> None:
    """DCP's HF writer: each rank its shards under ``partial/sharded``, rank 0 (DCP's coordinator) then
    consolidating them into the planned files from disk."""
    files = sorted(set(plan.values()))
    number = {file: index for index, file in enumerate(files, start=1)}
    writer = dcp.HuggingFaceStorageWriter(  # torch >= 2.8 (dcp_writer_usable)
        str(partial),
        fqn_to_index_mapping={name: number[file] for name, file in plan.items()},
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(state, storage_writer=writer)
    if (
        dist.get_rank() == 0
    ):  # DCP named the files model-0000k-of-0000n as save_pretrained does; one file it calls otherwise
        shutil.rmtree(partial / "sharded", ignore_errors=True)
        (partial / hf_files.INDEX_NAME).unlink(missing_ok=True)  # rank 0 writes save_pretrained's own
        if files == [hf_files.WEIGHTS_NAME]:
            (partial / "model-00001-of-00001.safetensors").rename(partial / hf_files.WEIGHTS_NAME)


def _write_file_by_file(state: dict[str, torch.Tensor], plan: dict[str, str], partial: Path, rank: int) -> None:
    """Torch without DCP's HF writer: one file at a time, each tensor gathered whole (every rank takes part
    in each all-gather, in the same order), rank 0 keeping that file's tensors until it is written."""
    try:
        from safetensors.torch import save_file
    except ImportError:  # on every rank, before any collective: they fail together
        raise CheckpointError("--hf needs safetensors on the ranks (pip install safetensors)") from None
    by_file: dict[str, list[str]] = {}
    for name, file in plan.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        tensors = {}
        for name in names:
            tensor = state[name]
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if rank == 0:
                tensors[name] = whole.cpu().contiguous()
        if rank == 0:
            save_file(tensors, str(partial / file), metadata={"format": "pt"})
        del tensors
