"""A torchrun script pasted into a ``%%fsdp`` cell: its own process-group calls, taken as the world's.

A script written for ``torchrun`` starts with ``dist.init_process_group(...)`` and ends with
``dist.destroy_process_group()``. In a cell the world already exists: the first would fail on every rank
("trying to initialize the default process group twice!") and the second would take down the world the
next cell needs. While a cell runs, both are replaced: an ``init_process_group`` whose backend and world
size match the running world (or leave them out, as the env:// default does) is the world's own, and one
that does not is a clear error naming both; its ``device_id`` binds nothing (the world was set up on this
rank's device), and a line says what it would have done; ``destroy_process_group()`` of the default group
keeps the world. Each says so once, on rank 0. The script's ``argparse`` sees what torchrun would give a
script started without arguments (``sys.argv`` is the cell's name alone), not the engine's own command
line, and its relative paths and imports start from the notebook's working directory, as a torchrun worker's
start from the directory it was launched in. torchrun's variables (``RANK``, ``LOCAL_RANK``...) are set when the world
starts (``engine.setup``). Runs on the ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class WorldMismatch(RuntimeError):
    """An ``init_process_group`` in a cell asked for another world than the running one."""


def device_id_line(device_id: Any, device: torch.device) -> str:
    """What an ``init_process_group(device_id=...)`` did in a cell whose rank runs on ``device``: nothing, said
    in one line (the world was set up on this rank's device; torch 2.13 refuses a CPU ``device_id``)."""
    asked = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cpu":
        return (
            f"init_process_group(device_id={asked}): not used, the ranks run on the CPU with gloo, which binds "
            "no device (under torchrun, torch 2.13 refuses a CPU device_id)"
        )
    if asked.type == device.type and (asked.index or 0) == (device.index or 0):
        return f"init_process_group(device_id={asked}): the world is bound to this rank's {device} already"
    return (
        f"init_process_group(device_id={asked}): not used, this rank's GPU is {device} (each engine sees only "
        "its own GPU): use `device`"
    )


@contextlib.contextmanager
def notebook_directory(cwd: str) -> Iterator[None]:
    """While a cell's inputs are read and it runs: the notebook's working directory ``cwd``, where this host
    has it, first on ``sys.path`` too, so a module beside the notebook imports on the ranks as in the notebook
    (IPython puts the working directory first on the kernel's path)."""
    before, path = os.getcwd(), list(sys.path)
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        os.chdir(before)
        sys.path[:] = path


@contextlib.contextmanager
def world_owned_calls(rank: int, device: torch.device, filename: str) -> Iterator[None]:
    """While a cell runs: ``dist.init_process_group`` and ``dist.destroy_process_group`` as described above,
    and ``sys.argv`` as a script's without arguments (``filename``: the cell's)."""
    original_init, original_destroy, original_argv = dist.init_process_group, dist.destroy_process_group, sys.argv
    said: set[str] = set()

    def say(key: str, line: str) -> None:
        if rank == 0 and key not in said:
            said.add(key)
            print(f"nbfsdp: {line}")

    def init_process_group(
        backend: Any = None, *_: Any, world_size: int = -1, device_id: Any = None, **__: Any
    ) -> None:
        running, size = dist.get_backend(), dist.get_world_size()
        asked = str(backend).split(":")[-1] if backend is not None else None  # "cpu:gloo,cuda:nccl" forms too
        if (asked is not None and asked not in str(running)) or world_size not in (-1, size):
            raise WorldMismatch(
                f"init_process_group(backend={backend!r}, world_size={world_size}) in a cell, but the running "
                f"world is {running} with {size} ranks: leave them out, or run the cell with --world-size or "
                "--device to match"
            )
        say("init", f"init_process_group: the cell runs in the world already started ({running}, {size} ranks)")
        if device_id is not None:
            say("device_id", device_id_line(device_id, device))

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            say("destroy", "destroy_process_group: the world is kept for the next cell")
            return
        original_destroy(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    sys.argv = [filename]
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = original_init, original_destroy
        sys.argv = original_argv
