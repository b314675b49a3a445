"""``%load_ext nbfsdp``: the magics registered, and the engines started on a background thread
(``NBFSDP_PREWARM``); ``%unload_ext nbfsdp``. Runs in the kernel.

Imports nothing heavy at module level: ``import nbfsdp`` reads ``prewarm_world_size`` from here without torch.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from nbfsdp.kernel.cluster.threads import KernelThread

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from nbfsdp.kernel.magics import FSDPMagics

PREWARM_ENV = "NBFSDP_PREWARM"
PREWARM_OFF = ("0", "off", "false", "no")

_magics: FSDPMagics | None = None
"""The loaded ``%%fsdp`` magics: their ``session`` and its ``cluster``."""
_loading: _Loading | None = None


def prewarm_world_size() -> int | None:
    """What ``NBFSDP_PREWARM`` asks of ``%load_ext``: None the default world size, 0 nothing, else N ranks.

    A value that is none of these is reported, and nothing starts in the background.
    """
    from nbfsdp.shared.limits import MAX_WORLD_SIZE, world_size_error

    value = os.environ.get(PREWARM_ENV, "").strip()
    if not value:
        return None
    if value.lower() in PREWARM_OFF:
        return 0
    if value.isdigit() and world_size_error(int(value)) is None:
        return int(value)
    print(
        f"nbfsdp: {PREWARM_ENV}={value!r} is not valid, so nothing starts in the background; use 0, off, false "
        f"or no (no background start), a world size from 1 to {MAX_WORLD_SIZE}, or leave it unset (the default "
        "world size: the number of GPUs, or 2)",
        file=sys.stderr,
    )
    return 0


def load_ipython_extension(shell: InteractiveShell) -> None:
    """Register ``%%fsdp`` and ``%fsdp`` and start the engines in the background (``NBFSDP_PREWARM``).

    A second load keeps the running session.
    """
    global _loading
    if (_magics is not None and _magics.shell is shell) or (_loading is not None and _loading.shell is shell):
        return
    world_size = prewarm_world_size()
    if world_size == 0:
        _register(shell)
        return
    _loading = _Loading(shell, world_size)
    # IPython's functools.wraps of an unbound method gives it MagicsManager.register_function's self
    shell.register_magic_function(_loading.magic, "line_cell", "fsdp")  # type: ignore[arg-type]
    shell.events.register("pre_run_cell", _loading.wait_for_imports)
    _loading.thread.start()


def unload_ipython_extension(shell: InteractiveShell) -> None:
    """Stop the cluster this extension started (once a background start has finished)."""
    global _magics, _loading
    if _loading is not None:
        _loading.join()
        _loading = None
    if _magics is not None:
        _magics.stop()
        _magics = None


def _register(shell: InteractiveShell) -> FSDPMagics:
    global _magics
    from nbfsdp.kernel.magics import FSDPMagics

    magics = FSDPMagics(shell)
    shell.register_magics(magics)
    _magics = magics
    return magics


class _Loading:
    """The rest of ``%load_ext nbfsdp`` on a daemon thread: torch, the magics, the engines.

    Until it is done, ``%%fsdp`` and ``%fsdp`` are ``magic``, which waits for it
    (interruptibly) and hands over; ``%fsdp status`` answers without waiting.
    The thread registers the real magics once the cluster's own background
    start is under way, so every later use of the cluster waits for that.
    """

    def __init__(self, shell: InteractiveShell, world_size: int | None) -> None:
        self.shell = shell
        self.world_size = world_size
        self.started = time.monotonic()
        self.error: BaseException | None = None
        """Why loading in the background failed, if it did: the foreground load raises it again if it is still
        there, and ``%fsdp status`` shows it."""
        self.imported = threading.Event()
        """The thread's imports (torch, FSDP2, ipyparallel, the magics) are done, or failed."""
        self.thread = KernelThread(target=self._load, name="nbfsdp-load")

    def _load(self) -> None:
        global _magics
        cluster = None
        try:
            from nbfsdp.kernel.cluster.local import FSDPCluster

            cluster = FSDPCluster()
            cluster.start_fork_server()  # the engines' imports run alongside this thread's
            import ipyparallel  # noqa: F401  (what the cluster's start imports, imported before cells run again)

            import nbfsdp.engines.engine  # noqa: F401  (torch, torch.distributed, FSDP2)
            from nbfsdp.kernel.magics import FSDPMagics
            from nbfsdp.shared.limits import DEFAULT_TIMEOUT_SECONDS

            self.imported.set()

            magics = FSDPMagics(self.shell, cluster)
            self.world_size = magics.world_size_for(self.world_size)  # the GPUs counted (torch is imported above)
            magics.session.cluster.start_in_background(self.world_size, DEFAULT_TIMEOUT_SECONDS, since=self.started)
            self.shell.register_magics(magics)
            _magics = magics
        except BaseException as error:  # the magics then load in the foreground, where the error shows
            self.error = error
            if cluster is not None:  # the fork server and the reaper it started must not outlive the failure
                with contextlib.suppress(Exception):
                    cluster.stop()
        finally:
            self.imported.set()

    def wait_for_imports(self, info: Any) -> None:
        """Before a cell, while the thread imports: a cell importing torch alongside it could get a half-made
        module (Python breaks a cycle of per-module import locks by handing one thread the partial module).

        ``%%fsdp`` and ``%fsdp`` cells go on at once: they wait for the whole load themselves, and a Ctrl-C
        ends that wait with the cell. A Ctrl-C here ends the cell too: IPython runs a cell whatever its
        ``pre_run_cell`` callbacks raise, so the cell is rejected before it runs (``_RejectNextCell``)."""
        first_word = (info.raw_cell.split(None, 1) or [""])[0]
        if first_word in ("%fsdp", "%%fsdp") and not self.imported.is_set():
            return
        try:
            while not self.imported.wait(0.05):
                pass
        except KeyboardInterrupt:
            self.shell.ast_transformers.append(_RejectNextCell(self.shell))
            return
        self.shell.events.unregister("pre_run_cell", self.wait_for_imports)

    def join(self) -> None:
        """Wait for the thread; Ctrl-C still interrupts the wait."""
        self.thread.join()

    def wait(self) -> FSDPMagics:
        """The loaded magics, once the thread is done (loading them here if it failed)."""
        self.join()
        if _magics is None or _magics.shell is not self.shell:
            magics = _register(self.shell)
            magics.session.cluster.background_error = self.error  # for ``%fsdp status``, as a failed start's
            return magics
        return _magics

    def magic(self, line: str, cell: str | None = None) -> Any:
        """``%%fsdp`` / ``%fsdp`` while nbfsdp loads in the background; ``%%fsdp?`` shows every flag once loaded."""
        if cell is None and line.split()[:1] == ["status"] and self.thread.is_alive():
            engines = f"{self.world_size} engines" if self.world_size else "the engines"
            print(f"nbfsdp: starting {engines} in the background (since {time.monotonic() - self.started:.1f} s)")
            return None
        magics = self.wait()
        return magics.fsdp_line(line) if cell is None else magics.fsdp(line, cell)


class _RejectNextCell(ast.NodeTransformer):
    """Rejects the cell being run, once: IPython's way for an extension to stop a cell before it runs."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self.cell = shell.execution_count  # a cell that fails to compile never reaches this: spare the next one

    def visit(self, node: ast.AST) -> ast.AST:
        from IPython.core.error import InputRejected

        self.shell.ast_transformers.remove(self)
        if self.shell.execution_count != self.cell:
            return node
        raise InputRejected(
            "nbfsdp: interrupted while torch was still loading in the background (from %load_ext nbfsdp); "
            "this cell did not run. Run it again: it waits until that loading is done."
        )
