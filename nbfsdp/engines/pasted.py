"""A torchrun script pasted into a ``%%fsdp`` cell: its own process-group calls, taken as the world's.

A script written for ``torchrun`` starts with ``dist.init_process_group(...)`` and ends with
``dist.destroy_process_group()``. In a cell the world already exists: the first would fail on every rank
("trying to initialize the default process group twice!") and the second would take down the world the
next cell needs. Both are replaced, once per process when the first world is set up (``install``), and act
only while a cell runs (``cell_calls``): an ``init_process_group`` whose backend and world
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


@dataclass
class _WorldCalls:
    """What the replacements of ``init_process_group`` and ``destroy_process_group`` act on: this rank's world,
    and whether a cell runs now (they are the originals otherwise)."""

    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    in_cell: bool = False
    said: set[str] = field(default_factory=set)
    """What was said in the running cell: each once."""
    originals: tuple[Callable[..., Any], Callable[..., Any]] | None = None
    """``dist``'s own two functions, once replaced."""


_world = _WorldCalls()


def install(rank: int, device: torch.device) -> None:
    """At a world's set-up (``engine.setup``): the world's cells take a script's ``init_process_group`` and
    ``destroy_process_group`` as the world's. ``dist``'s two functions are replaced once per process; the
    replacements act as above only while a cell runs (``cell_calls``), and call the originals otherwise (the
    engine's own set-up and teardown)."""
    _world.rank, _world.device = rank, device
    if _world.originals is None:
        _world.originals = (dist.init_process_group, dist.destroy_process_group)
        dist.init_process_group, dist.destroy_process_group = _init_process_group, _destroy_process_group


@contextlib.contextmanager
def cell_calls(filename: str) -> Iterator[None]:
    """While a cell runs: the replacements act, and ``sys.argv`` is a script's without arguments (``filename``:
    the cell's)."""
    original_argv = sys.argv
    _world.in_cell, _world.said = True, set()
    sys.argv = [filename]
    try:
        yield
    finally:
        _world.in_cell = False
        sys.argv = original_argv


def _say(key: str, line: str) -> None:
    if _world.rank == 0 and key not in _world.said:
        _world.said.add(key)
        print(f"nbfsdp: {line}")


def _init_process_group(*args: Any, **kwargs: Any) -> None:
    assert _world.originals is not None  # installed
    if not _world.in_cell:
        return _world.originals[0](*args, **kwargs)
    backend = args[0] if args else kwargs.get("backend")
    world_size, device_id = kwargs.get("world_size", -1), kwargs.get("device_id")
    running, size = dist.get_backend(), dist.get_world_size()
    asked = str(backend).split(":")[-1] if backend is not None else None  # "cpu:gloo,cuda:nccl" forms too
    if (asked is not None and asked not in str(running)) or world_size not in (-1, size):
        raise WorldMismatch(
            f"init_process_group(backend={backend!r}, world_size={world_size}) in a cell, but the running "
            f"world is {running} with {size} ranks: leave them out, or run the cell with --world-size or "
            "--device to match"
        )
    _say("init", f"init_process_group: the cell runs in the world already started ({running}, {size} ranks)")
    if device_id is not None:
        _say("device_id", device_id_line(device_id, _world.device))
    return None


def _destroy_process_group(group: Any = None) -> None:
    assert _world.originals is not None  # installed
    if _world.in_cell and (group is None or group is dist.group.WORLD):
        _say("destroy", "destroy_process_group: the world is kept for the next cell")
        return
    _world.originals[1](group)
