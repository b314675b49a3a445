"""Which engines of an attached cluster are still there, known within seconds (the kernel's side).

ipyparallel's controller drops an engine after ten missed heartbeats, half a minute by default, and a
cell on a host that died would wait that long. So each engine of an attached cluster holds one TCP
connection to the kernel (``nbfsdp.engines.release.hold_lifeline``): an engine that ends closes it at once
(its host's kernel does), and a host that vanishes (power, network) is found by TCP keepalive probes
within ``KEEPALIVE_SECONDS``. The kernel listens on the one address that reaches the engines, on a free
port, and takes only connections that present the attach's secret (sent over ipyparallel's signed
channel). One word goes the other way: ``release <generation>``, when the kernel gives up a world whose
host died, so that the ranks left end the collective they wait in (``nbfsdp.engines.release``).
"""

from __future__ import annotations

import contextlib
import secrets
import selectors
import socket
import threading

from nbfsdp.shared.network import keep_alive

#: A silent peer is probed after this many seconds, every second, and given up after three missed probes.
KEEPALIVE_SECONDS = (1, 1, 3)
_SECRET_BYTES = 16


class Lifelines:
    """The kernel's listening socket and one connection per engine; ``lost`` names those that ended."""

    def __init__(self, address: str) -> None:
        self.secret = secrets.token_hex(_SECRET_BYTES)
        self._listener = socket.create_server((address, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._held: dict[int, socket.socket] = {}
        self._lost: dict[int, str] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="nbfsdp-lifelines", daemon=True)
        self._thread.start()

    def held(self) -> set[int]:
        """Engines whose connection is open."""
        with self._lock:
            return set(self._held)

    def release(self, engine_ids: list[int], generation: int) -> None:
        """Tell these engines that the kernel gave up their world ``generation``: each ends the collectives
        it waits in, at once (those whose lifeline has ended hear nothing)."""
        word = f"release {generation}\n".encode()
        with self._lock:
            connections = [self._held[i] for i in engine_ids if i in self._held]
        for connection in connections:
            with contextlib.suppress(OSError):  # a few bytes into an empty buffer; or closed meanwhile
                connection.send(word)

    def lost(self) -> dict[int, str]:
        """Engines whose connection ended, with how."""
        with self._lock:
            return dict(self._lost)

    def close(self) -> None:
        self._closing = True
        self._listener.close()  # wakes the selector
        self._thread.join(timeout=2)
        for key in list(self._selector.get_map().values()):
            connection = key.fileobj
            assert isinstance(connection, socket.socket)  # only sockets are registered
            with contextlib.suppress(OSError):
                connection.close()
        self._selector.close()

    # ------------------------------------------------------------ the serving thread
    def _serve(self) -> None:
        while not self._closing:
            try:
                events = self._selector.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key)

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except OSError:
            return
        connection.settimeout(2)
        try:  # "<secret> <engine id>\n": a stranger's connection is closed unanswered
            line = connection.makefile("rb").readline(100).decode(errors="replace").split()
        except OSError:
            line = []
        if len(line) != 2 or not secrets.compare_digest(line[0], self.secret) or not line[1].isdigit():
            connection.close()
            return
        engine_id = int(line[1])
        keep_alive(connection, *KEEPALIVE_SECONDS)
        connection.setblocking(False)  # noqa: FBT003 (socket.setblocking takes its flag positionally only)
        self._selector.register(connection, selectors.EVENT_READ, engine_id)
        with self._lock:
            self._held[engine_id] = connection
            self._lost.pop(engine_id, None)

    def _read(self, key: selectors.SelectorKey) -> None:
        connection: socket.socket = key.fileobj  # type: ignore[assignment]
        try:
            if connection.recv(64):
                return  # an engine sends nothing after its line; ignore anything that comes
            how = "its connection to the notebook closed"
        except BlockingIOError:
            return
        except OSError as error:
            how = f"its connection to the notebook failed ({error.strerror or error})"
        self._selector.unregister(connection)
        connection.close()
        with self._lock:
            self._held.pop(key.data, None)
            self._lost[key.data] = how
