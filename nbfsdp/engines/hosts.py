"""Which host this engine runs on, as the kernel groups ranks by host (``nbfsdp.kernel.cluster.hosts``).

ipyparallel records no host per engine, so each engine says: its hostname, and a key that tells hosts
apart even where hostnames do not (containers and network namespaces share a kernel and may share a
name): the boot id, the network namespace and the hostname. ``NBFSDP_HOST_ID`` overrides the key for
set-ups where neither tells (two engines that should count as one host, or as two).

Engines of an attached cluster also hold a lifeline to the kernel (``check_in``), and rank 0 opens
the world's rendezvous (``open_rendezvous``).
"""

from __future__ import annotations

import os
import socket

import torch

from nbfsdp.engines import release
from nbfsdp.shared.devices import gpu_capability
from nbfsdp.shared.network import source_address
from nbfsdp.shared.protocol import HostIdentity

#: An environment variable that names this engine's host outright.
HOST_ID_VARIABLE = "NBFSDP_HOST_ID"


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def identity() -> HostIdentity:
    """This engine's host: its name, and the key engines of one host share."""
    hostname = socket.gethostname()
    gpus = torch.cuda.device_count()  # NVML's count: no CUDA context is made
    capability = gpu_capability() if gpus else None
    override = os.environ.get(HOST_ID_VARIABLE)
    if override:
        key = override
    else:
        try:
            namespace = os.readlink("/proc/self/ns/net")  # e.g. net:[4026531840]: one per network namespace
        except OSError:
            namespace = ""
        boot = _read("/proc/sys/kernel/random/boot_id")  # one per booted kernel: a machine, or a VM
        key = f"{hostname}|{boot}|{namespace}"
    return HostIdentity(
        hostname=hostname,
        key=key,
        pid=os.getpid(),
        gpus=gpus,
        capability=capability,
        slurm_procid=int(os.environ["SLURM_PROCID"]) if os.environ.get("SLURM_PROCID", "").isdigit() else None,
        visible_gpus=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


#: Rank 0's rendezvous socket, kept open from ``open_rendezvous`` until the store takes it.
_rendezvous: socket.socket | None = None


def open_rendezvous(toward: str) -> tuple[str, int]:
    """On rank 0: a listening socket for the world's store, on this host's address toward ``toward`` (the
    controller's: the network the hosts share) and a free port, kept open. Bound here, not by the store:
    TCPStore's own server listens on every interface whatever host it is given (pytorch#173909)."""
    global _rendezvous
    if _rendezvous is not None:
        _rendezvous.close()
    address = source_address(toward)
    _rendezvous = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _rendezvous.bind((address, 0))
    _rendezvous.listen(128)
    return address, _rendezvous.getsockname()[1]


def take_rendezvous() -> socket.socket | None:
    """The socket ``open_rendezvous`` left, for the store to listen on (once)."""
    global _rendezvous
    taken, _rendezvous = _rendezvous, None
    return taken


def check_in(kernel: tuple[str, int], secret: str, engine_id: int, seen: str) -> tuple[HostIdentity, bool]:
    """Say which host this engine is on, and whether it sees the notebook's file ``seen`` (holding
    ``secret``): a directory both share. Then hold a lifeline to the kernel at ``kernel``
    (``nbfsdp.engines.release.hold_lifeline``): the kernel sees the connection end the moment this engine
    does, or its host, and tells this engine on it to release a world it gave up."""
    release.hold_lifeline(kernel, secret, engine_id)
    return identity(), _read(seen) == secret
