"""Which host this engine runs on, as the kernel groups ranks by host (``nbfsdp.kernel.hosts``).

ipyparallel records no host per engine, so each engine says: its hostname, and a key that tells hosts
apart even where hostnames do not (containers and network namespaces share a kernel and may share a
name): the boot id, the network namespace and the hostname. ``NBFSDP_HOST_ID`` overrides the key for
set-ups where neither tells (two engines that should count as one host, or as two).
"""

from __future__ import annotations

import os
import socket

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
    override = os.environ.get(HOST_ID_VARIABLE)
    if override:
        return HostIdentity(hostname=hostname, key=override, pid=os.getpid())
    try:
        namespace = os.readlink("/proc/self/ns/net")  # e.g. net:[4026531840]: one per network namespace
    except OSError:
        namespace = ""
    boot = _read("/proc/sys/kernel/random/boot_id")  # one per booted kernel: a machine, or a VM
    return HostIdentity(hostname=hostname, key=f"{hostname}|{boot}|{namespace}", pid=os.getpid())
