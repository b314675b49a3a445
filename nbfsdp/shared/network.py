"""The network the ranks talk over: loopback on one machine, so nothing outside it can reach a rank; over
several hosts, the one interface that routes toward the others."""

from __future__ import annotations

import socket

import psutil


def loopback_interface() -> str | None:
    """The network interface of 127.0.0.1, which collectives are pinned to."""
    return interface_of("127.0.0.1")


def source_address(target: str) -> str:
    """This host's address on the route to ``target`` (a UDP connect sends nothing; it only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address``."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def keep_alive(connection: socket.socket, idle: int, interval: int, count: int) -> None:
    """TCP keepalive on ``connection``: a peer that vanishes without closing (its host lost power or
    network) fails the connection after ``idle + interval * count`` seconds of silence."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's (hours-long) defaults apply
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
