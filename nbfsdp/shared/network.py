"""The network the ranks talk over: loopback on one machine, so nothing outside it can reach a rank."""

from __future__ import annotations

import psutil


def loopback_interface() -> str | None:
    """The network interface of 127.0.0.1, which collectives are pinned to."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    return None
