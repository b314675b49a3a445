"""Where a world's ranks run: ``--device {auto,cuda,cpu}`` and the GPUs there are, as one decision.

``cuda`` puts every rank on a GPU, rank ``r`` on GPU ``r mod G``, so 4 ranks share 1 GPU. Each rank stays
its own process with its own CUDA context and allocator. NCCL refuses two ranks of one communicator on one
device unless it takes them for different hosts, so the ranks that share a GPU get different
``NCCL_HOSTID``s (``Devices.nccl_hosts``). Between those "hosts" NCCL uses its network transport, sockets
over loopback, not NVLink: correct, and slow (``docs/guide/gpus.md``). ``cpu`` is gloo on the CPU.
``auto`` (not given) takes a GPU a rank when there are enough and the CPU otherwise, saying why when GPUs
were there.

Decided in the kernel (nbfsdp's own cluster, ``%fsdp explain``, the panel) from the GPUs its machine has;
an attached cluster decides from what its engines report (``nbfsdp.kernel.cluster.hosts``). Imports nothing heavy.

The GPUs' compute capability decides the low precision nbfsdp defaults to (``low_precision_for``): a GPU
below 8.0 (T4, V100) has no bf16 tensor cores, and bf16 there is emulated, slow, and a common source of
NaNs, so it gets fp16 with its losses scaled (``nbfsdp.engines.scaling``). The capability is read through
NVML (``gpu_capability``), which makes no CUDA context: the kernel that decides must not hold one.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

from nbfsdp.shared.errors import ConfigError

#: ``--device``'s choices.
DeviceChoice = Literal["auto", "cuda", "cpu"]
DEVICE_CHOICES: tuple[DeviceChoice, ...] = get_args(DeviceChoice)

#: The default of ``--device`` when a cell, ``--config`` and the panel say nothing (``make test-gpu`` runs the
#: course with it set to ``cuda``, so ranks share the GPUs there are).
DEFAULT_DEVICE_VARIABLE = "NBFSDP_DEVICE"

#: The first compute capability with bf16 tensor cores (Ampere, A100).
BF16_CAPABILITY = (8, 0)


def low_precision_for(capability: tuple[int, int] | None) -> Literal["bf16", "fp16"]:
    """The low precision of GPUs of ``capability`` (major, minor): fp16 below 8.0 (T4 is 7.5, V100 7.0),
    which has no bf16 tensor cores; bf16 from 8.0, on the CPU and where the capability is unknown (None)."""
    return "fp16" if capability is not None and tuple(capability) < BF16_CAPABILITY else "bf16"


@functools.cache
def gpu_capability() -> tuple[int, int] | None:
    """The lowest compute capability among this machine's GPUs, from NVML (the driver's library: no CUDA
    context is made: ``torch.cuda.get_device_capability`` would initialize CUDA in the kernel); None without an
    NVIDIA driver or GPU.
    Every GPU of the machine counts, those ``CUDA_VISIBLE_DEVICES`` hides too: on a machine that mixes
    generations the oldest decides, the safe side (``--precision bf16`` says otherwise)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        found = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0:
                found.append((major.value, minor.value))
        return min(found, default=None)
    finally:
        nvml.nvmlShutdown()


def plural(number: int, noun: str) -> str:
    """``1 rank``, ``4 ranks``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


@dataclass(frozen=True, slots=True)
class Devices:
    """The device of a world's ranks: which GPU each rank takes, and which ranks share one."""

    type: str
    """``cuda`` (NCCL) or ``cpu`` (gloo)."""
    world_size: int
    gpus: int = 0
    """GPUs the ranks use, on all their hosts together; 0 on the CPU."""
    rank_gpus: tuple[int, ...] = ()
    """Each rank's GPU, numbered as its host numbers them (``torch.cuda.device_count()`` there); empty on
    the CPU."""
    nccl_hosts: tuple[str, ...] = ()
    """Where ranks share a GPU, each rank's part of ``NCCL_HOSTID``: ranks with the same part are on
    different GPUs, and ranks that share a GPU have different parts. Empty where no GPU is shared."""
    why: str | None = None
    """Why ``auto`` chose the CPU on a machine with a GPU (None otherwise)."""
    planned: bool = False
    """Planned for GPUs the deciding process does not see (``%fsdp explain --device cuda`` on a CPU kernel)."""
    capability: tuple[int, int] | None = None
    """The compute capability (major, minor) of the ranks' oldest GPU; None on the CPU or where unknown (a plan
    for GPUs this process does not see). It decides the default low precision (``low_precision_for``)."""

    @property
    def backend(self) -> str:
        return "nccl" if self.type == "cuda" else "gloo"

    @property
    def shared(self) -> bool:
        """Several ranks on one GPU: NCCL must take them for different hosts."""
        return bool(self.nccl_hosts)

    @property
    def ranks_per_gpu(self) -> int:
        """The most ranks that share one GPU (ranks go round the GPUs): 1 where none is shared or on the CPU."""
        return -(-self.world_size // self.gpus) if self.shared else 1

    def __str__(self) -> str:
        ranks = plural(self.world_size, "rank")
        if self.type == "cpu":
            return f"{ranks} on the CPU (gloo)"
        if self.planned:
            return f"{ranks}, a GPU each (planned: this kernel sees no GPU)"
        return f"{ranks} on {plural(self.gpus, 'GPU')}{' (shared)' if self.shared else ''}"


def on_gpus(world_size: int, gpus: int, **extra: Any) -> Devices:
    """``world_size`` ranks on one machine's ``gpus`` GPUs: rank ``r`` on GPU ``r mod G``. Where they share,
    ranks ``[k * G, (k + 1) * G)`` are NCCL's host ``k``: on different GPUs, so NCCL's own transports
    (NVLink, PCIe) still connect them."""
    used = min(gpus, world_size)
    shared = tuple(str(rank // used) for rank in range(world_size)) if world_size > used else ()
    return Devices("cuda", world_size, used, tuple(rank % used for rank in range(world_size)), shared, **extra)


def requested_device(value: str | None) -> str:
    """The ``device`` a cell asked for; not given, ``$NBFSDP_DEVICE`` or ``auto``."""
    asked = value if value is not None else os.environ.get(DEFAULT_DEVICE_VARIABLE) or "auto"
    if asked.lower() not in DEVICE_CHOICES:
        source = "device" if value is not None else f"${DEFAULT_DEVICE_VARIABLE}"
        raise ConfigError(f"{source} must be one of {', '.join(DEVICE_CHOICES)}; got {asked!r}")
    return asked.lower()


def choose(
    requested: str | None,
    world_size: int,
    gpus: int,
    *,
    planning: bool = False,
    capability: tuple[int, int] | None = None,
) -> Devices:
    """Where ``world_size`` ranks run, asked ``requested`` (None: not given) on a machine with ``gpus`` GPUs of
    ``capability`` (the oldest's; None: unknown).

    ``cuda`` with no GPU is a ConfigError, unless ``planning``: a plan for GPUs this process does not have,
    one GPU a rank."""
    match requested_device(requested):
        case "cpu":
            return Devices("cpu", world_size)
        case "cuda" if gpus:
            return on_gpus(world_size, gpus, capability=capability)
        case "cuda" if planning:
            return on_gpus(world_size, world_size, planned=True)
        case "cuda":
            raise ConfigError(
                "--device cuda: this machine has no GPU (torch.cuda.device_count() is 0); choose auto or cpu"
            )
        case _ if gpus >= world_size:
            return on_gpus(world_size, gpus, capability=capability)
        case _ if gpus:
            why = (
                f"{plural(world_size, 'rank')} and {plural(gpus, 'GPU')}: auto takes a GPU a rank only when there "
                f"are enough, so the CPU (gloo); --device cuda puts the ranks on the {plural(gpus, 'GPU')}, shared"
            )
            return Devices("cpu", world_size, why=why)
        case _:
            return Devices("cpu", world_size)
