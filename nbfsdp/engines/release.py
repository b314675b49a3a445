"""A world the kernel gave up, released on the ranks left: an attached cluster's dead host (the ranks' side).

When a host dies mid-cell, the ranks on the living hosts wait in a collective for peers that will never
answer, until ``--timeout``, and the next cell's set-up queues behind them. The kernel knows within
seconds (``nbfsdp.kernel.cluster.lifelines``) and, once it gives the world up, says ``release <generation>``
on each surviving engine's lifeline. This engine's lifeline thread, blocked on that connection, then ends
the world's collectives at once:

- NCCL's communicators are aborted (``torch_private.abort_nccl_communicators``);
- gloo has no abort for a running collective: torch 2.13's ``ProcessGroupGloo.abort()`` returns but leaves
  the waiting thread waiting past the timeout, and ``shutdown()`` releases nothing (measured). So the
  world's TCP connections are shut down under it: those this process opened since the world began
  (gloo's pairs, the store's), never a listening socket, one it had before (ipyparallel's) or the
  lifeline. The blocked collective fails ("Connection closed by peer") within milliseconds.

Either way the cell's own error path then destroys the process group, and the engine takes the next
cell's set-up; nothing is killed (an attached cluster's engines are not nbfsdp's). Linux only (``/proc``);
elsewhere a gloo rank still waits for ``--timeout``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import traceback

from nbfsdp.shared import torch_private
from nbfsdp.shared.network import keep_alive

#: TCP states (``/proc/net/tcp``) never shut down: LISTEN (a store's server socket).
_LISTENING = "0A"


class _State:
    """The world being run (its generation, the sockets the process had before it) and the lifeline."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation: int | None = None
        self.before: set[int] = set()
        self.lifeline: socket.socket | None = None


_state = _State()


def world_begins(generation: int) -> None:
    """A new world ``generation`` is being set up (before its store): the sockets this process has now are
    not the world's."""
    with _state.lock:
        _state.generation = generation
        _state.before = set(_socket_inodes())


def release(generation: int) -> int:
    """End the collectives of world ``generation`` if it is the one this engine runs (a stale word for an
    older world does nothing); the number of connections shut down."""
    with _state.lock:
        if generation != _state.generation:
            return 0
        _state.generation = None  # once
        keep = set(_state.before)
        if _state.lifeline is not None:
            keep.add(os.fstat(_state.lifeline.fileno()).st_ino)
    try:
        torch_private.abort_nccl_communicators()
    finally:  # whatever NCCL did: gloo's groups (an --async save's are gloo's on GPUs too) and the store
        shut = _shut_down_sockets(keep)
    return shut


def hold_lifeline(kernel: tuple[str, int], secret: str, engine_id: int) -> None:
    """Connect to the kernel at ``kernel``, say who this is, and keep the connection: the kernel sees it end
    the moment this engine (or its host) does, and this engine hears ``release`` on it. A kernel out of
    reach (behind a tunnel) gets no lifeline and falls back on the controller's heartbeats."""
    with _state.lock:
        old, _state.lifeline = _state.lifeline, None
    if old is not None:
        with contextlib.suppress(OSError):
            old.shutdown(socket.SHUT_RDWR)  # wakes its thread, blocked reading it
        old.close()
    try:
        connection = socket.create_connection(kernel, timeout=5)
        keep_alive(connection, 1, 1, 3)
        connection.sendall(f"{secret} {engine_id}\n".encode())
    except OSError:
        return
    connection.settimeout(None)
    with _state.lock:
        _state.lifeline = connection
    threading.Thread(target=_hear, args=(connection,), name="nbfsdp-lifeline", daemon=True).start()


def _hear(connection: socket.socket) -> None:
    """The lifeline's thread: each ``release <generation>`` line the kernel sends, acted on."""
    with contextlib.suppress(OSError, ValueError), connection.makefile("rb") as lines:
        for line in lines:
            word, _, generation = line.decode(errors="replace").partition(" ")
            if word == "release" and generation.strip().isdigit():
                try:
                    release(int(generation))
                except Exception:  # said where the cell's output goes; the lifeline still holds
                    print("nbfsdp: releasing the world failed:", file=sys.stderr)
                    traceback.print_exc()


def _socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> a descriptor of it."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    found[int(link[len("socket:[") : -1])] = int(name)
    return found


def _tcp_states() -> dict[int, str]:
    """Every TCP socket of this network namespace: inode -> state (hex, as ``/proc/net/tcp`` has it)."""
    states: dict[int, str] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows, None)  # the header
            for row in rows:
                fields = row.split()
                states[int(fields[9])] = fields[3]
    return states


def _shut_down_sockets(keep: set[int]) -> int:
    """Shut down this process's TCP connections but those in ``keep`` and the listening ones: whatever
    waits on one (gloo's pair, the store's client) fails at once, on both sides."""
    states = _tcp_states()
    shut = 0
    for inode, descriptor in _socket_inodes().items():
        if inode in keep or states.get(inode, _LISTENING) == _LISTENING:
            continue
        try:
            duplicate = os.dup(descriptor)
        except OSError:  # closed since it was listed
            continue
        try:  # the descriptor may have been reused for another file since it was listed
            sock = socket.socket(fileno=duplicate) if os.fstat(duplicate).st_ino == inode else None
        except OSError:
            sock = None
        if sock is None:
            os.close(duplicate)
            continue
        with sock, contextlib.suppress(OSError):  # closing the duplicate leaves the original open
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
    return shut
