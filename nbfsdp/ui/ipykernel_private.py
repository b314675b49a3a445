"""Every private or internal ipykernel API nbfsdp relies on, in one place (kernel side).

ipykernel 7 has kernel subshells (JEP 91) but no public Python call to create one from inside
the kernel, nor to route a comm's messages to one. Each function says what it relies on;
``tests/test_ipykernel_private.py`` calls each one in a real kernel, so an ipykernel release that
moves one fails there, by name.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any


def has_subshells(kernel: Any) -> bool:
    """The kernel runs subshells: ``Kernel._supports_kernel_subshells`` and its ``control_thread``."""
    return bool(getattr(kernel, "_supports_kernel_subshells", False)) and kernel.control_thread is not None


def create_subshell(kernel: Any, timeout: float = 10) -> str:
    """A new subshell's id, created as a frontend's ``create_subshell_request`` creates it.

    Relies on ``kernel.shell_channel_thread.manager.control_to_shell_channel.from_socket``, the
    socket the control thread asks the subshell manager on; a zmq socket belongs to one thread,
    so the request runs on the control thread's ``io_loop``.
    """
    created: concurrent.futures.Future[str] = concurrent.futures.Future()

    def create() -> None:
        try:
            socket = kernel.shell_channel_thread.manager.control_to_shell_channel.from_socket
            socket.send_json({"type": "create"})
            created.set_result(socket.recv_json()["subshell_id"])
        except Exception as error:  # handed to the waiting thread
            created.set_exception(error)

    kernel.control_thread.io_loop.add_callback(create)
    return created.result(timeout=timeout)


def route_comm_to_subshell(comm: Any, subshell_id: str) -> None:
    """Have ``comm``'s messages handled on ``subshell_id``: ipykernel's ``Comm._reply_subshell_for``, which
    it consults for each message and re-points at the subshell of each message it publishes, so it is
    replaced by a function rather than set once."""
    comm._reply_subshell_for = lambda data, default, subshell_id=subshell_id: subshell_id
