"""Engines forked from one process that has already imported what they need.

A fresh engine process spends about 2.5 s of CPU importing ipykernel, torch,
FSDP2 and ``nbfsdp.engines.engine``; four of them on two cores took about 5 s of
wall time before any could register, which made the first cell slower than
torchrun's cold start. The fork server is started once per cluster,

    python -m nbfsdp.helpers.forkserver PRIVATE_DIR

imports all of that once, and then forks each engine on request, so an engine
starts with those modules already loaded (pages shared copy-on-write).

Forking is safe here because the server does nothing but import: no zmq
context, no event loop, no OpenMP region and no CUDA call happen before the
fork (torch initializes CUDA lazily; each child sets ``CUDA_VISIBLE_DEVICES``
before it starts). Python's ``multiprocessing`` forkserver is not used because
its children are ``multiprocessing`` processes, not ipyparallel engines with
their own argv, environment, session and output file.

The protocol is one JSON object per line: a request on the server's stdin,
``{"argv", "env", "cwd", "output"}``, answered on its stdout by
``{"pid": N, "started": T, "output": O}`` (the engine's start time, read
while it cannot yet have been reaped, and the request's output file);
whenever a child ends the server reaps it and writes
``{"exited": N, "code": C}`` (``C`` negative for a signal, as psutil has it).

The server ends the engines it forked when it ends: when its stdin closes
(the kernel stopped it, or died), on SIGTERM or SIGINT, or on an error of its
own, it kills those still running (by pid and start time) and exits; killed
itself (SIGKILL), the kernel's parent-death signal kills them on Linux. So a
kernel killed mid-start leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import sys
import traceback
from typing import Any

import psutil

from nbfsdp.shared.processes import ProcessRef, die_with_parent

#: What every engine imports, found by listing the modules an engine imported after the fork
#: (the debugger's debugpy alone was 0.45 s of each engine's start)
ENGINE_IMPORTS = (
    "ipyparallel.engine.app",
    "ipykernel.debugger",
    "IPython.core.completerlib",
    "IPython.extensions.storemagic",
    "sqlite3",
    "nbfsdp.engines.engine",  # torch, FSDP2, distributed checkpoint
    # FSDP2's first fully_shard imports it (0.65 s of CPU an engine, each world, measured: the ranks of a
    # loaded machine then reach their first collectives that much further apart). Importing it makes no CUDA
    # call (none of torch.cuda's queries ran, watched on a CPU build), so the fork stays safe for GPU ranks
    "torch._dynamo",
)


# ------------------------------------------------------------------ the server process
def _become_engine(request: dict[str, Any], selector: selectors.BaseSelector, wake_fds: tuple[int, int]) -> None:
    """In the forked child: take the engine's session, files, environment and argv, and run it."""
    code = 1
    try:
        os.setsid()
        die_with_parent(request["server"])
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM):  # as a fresh ipengine has them
            signal.signal(signum, signal.SIG_DFL)
        selector.close()
        for fd in wake_fds:
            os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        from ipyparallel.engine.app import main

        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _stop_server(signum: int, frame: Any) -> None:
    """SIGTERM: unwind through ``serve``, which ends the engines (by default the server would just vanish)."""
    raise SystemExit(128 + signum)


def serve() -> None:
    """Import what every engine needs, then fork engines on request until stdin closes; end them on the way
    out, however the server is stopped."""
    # a stop asked for while importing ends the server at once: it has forked nothing yet
    signal.signal(signal.SIGTERM, _stop_server)
    for module in ENGINE_IMPORTS:
        importlib.import_module(module)
    children: dict[int, ProcessRef] = {}
    try:
        _serve(children)
    finally:
        for child in children.values():
            child.signal(signal.SIGKILL)  # an engine may be stuck in a collective, deaf to anything milder


def _serve(children: dict[int, ProcessRef]) -> None:
    """Fork an engine for each request until stdin closes; ``children`` holds those still running."""
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector through the wakeup fd
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    pending = b""
    server = os.getpid()

    def reply(message: dict[str, Any]) -> None:
        os.write(1, json.dumps(message).encode() + b"\n")

    def reap() -> None:
        for pid in list(children):
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    del children[pid]
                    reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    while True:
        for key, _ in selector.select():
            if key.fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                reap()
                continue
            chunk = os.read(0, 65536)
            if not chunk:  # the kernel stopped the cluster, or died: ``serve`` ends the engines
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line) | {"server": server}
                # the imported objects out of the collector's reach: an engine's collections neither walk
                # them nor write their headers (which would copy the shared pages), as Python's gc docs advise
                gc.freeze()
                try:
                    pid = os.fork()
                except OSError as error:
                    reply({"error": str(error)})
                    continue
                if pid == 0:
                    _become_engine(request, selector, (wake_read, wake_write))
                # not reaped until ``reap`` runs, so the pid is still the child's here
                children[pid] = ProcessRef(pid, psutil.Process(pid).create_time())
                reply({"pid": pid, "started": children[pid].started, "output": request["output"]})


if __name__ == "__main__":
    serve()
