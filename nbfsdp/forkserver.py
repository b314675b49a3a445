"""Engines forked from one process that has already imported what they need.

A fresh engine process spends about 2.5 s of CPU importing ipykernel, torch,
FSDP2 and ``nbfsdp.engine``; four of them on two cores took about 5 s of
wall time before any could register, which made the first cell slower than
torchrun's cold start. The fork server is started once per cluster,

    python -m nbfsdp.forkserver PRIVATE_DIR

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
``{"pid": N, "started": T}`` (the engine's start time, read while it cannot
yet have been reaped); whenever a child ends the server reaps it and writes
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
import subprocess
import sys
import threading
import traceback
from typing import Any

import psutil

from nbfsdp.reaper import ProcessRef

SPAWN_TIMEOUT = 120.0
#: What every engine imports, found by listing the modules an engine imported after the fork
#: (the debugger's debugpy alone was 0.45 s of each engine's start)
ENGINE_IMPORTS = (
    "ipyparallel.engine.app",
    "ipykernel.debugger",
    "IPython.core.completerlib",
    "IPython.extensions.storemagic",
    "sqlite3",
    "nbfsdp.engine",  # torch, FSDP2, distributed checkpoint
)


class ForkServerError(RuntimeError):
    """The fork server could not fork an engine, or is gone."""


class ForkServer:
    """The kernel's end: starts the server, asks it for engines, learns how they end."""

    def __init__(self, env: dict[str, str], private_dir: str) -> None:
        """Start the server now, with ``env`` (what it imports may read its environment), for the cluster whose
        directory ``private_dir`` is: its log goes there, and the directory goes on its command line, which the
        engines it forks keep (the server does not read it; ``nbfsdp.reaper`` and ``ps`` do)."""
        self._log_path = os.path.join(private_dir, "forkserver.log")
        with open(self._log_path, "ab") as log:
            self._process = psutil.Popen(
                [sys.executable, "-m", "nbfsdp.forkserver", private_dir],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # a Ctrl-C in the notebook's terminal reaches neither it nor its engines
            )
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._spawned: list[dict[str, Any]] = []  # replies not yet taken by ``spawn``
        self._engines: dict[int, ProcessRef] = {}  # every engine forked, by pid
        self._exit_codes: dict[int, int | None] = {}
        self._gone = False
        threading.Thread(target=self._read_replies, name="nbfsdp-forkserver-replies", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        """The server can still fork engines (it has not exited)."""
        return self._process.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int:
        """Fork an engine running ``argv`` (ipengine's arguments) and return its process id."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "output": output}).encode() + b"\n"
        with self._lock:
            try:
                self._process.stdin.write(request)
                self._process.stdin.flush()
            except (BrokenPipeError, ValueError) as error:
                raise ForkServerError(f"the engine fork server is gone (log: {self._log_path})") from error
            with self._changed:
                if not self._changed.wait_for(lambda: self._spawned or self._gone, SPAWN_TIMEOUT):
                    raise ForkServerError(f"the engine fork server did not answer in {SPAWN_TIMEOUT:.0f} s")
                if not self._spawned:
                    raise ForkServerError(f"the engine fork server ended (log: {self._log_path})")
                reply = self._spawned.pop(0)
        if "error" in reply:
            raise ForkServerError(f"the engine fork server could not fork an engine: {reply['error']}")
        self._engines[reply["pid"]] = ProcessRef(reply["pid"], reply["started"])
        return reply["pid"]

    def engine(self, pid: int) -> ProcessRef | None:
        """Engine ``pid`` as this server forked it (with its start time); None if it forked no such engine."""
        return self._engines.get(pid)

    def wait(self, pid: int, timeout: float | None = None) -> int | None:
        """Engine ``pid``'s exit code (negative: the signal) once it ends; None if it has not ended within
        ``timeout`` seconds (None: no limit) or the server is gone."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exit_codes or self._gone, timeout)
            return self._exit_codes.get(pid)

    def stop(self) -> None:
        """Close the server's stdin: it kills the engines it forked that still run, and exits."""
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.close()
        with contextlib.suppress(psutil.TimeoutExpired):
            self._process.wait(timeout=5)
            return
        self._process.kill()  # its own child, not yet waited for: the pid cannot be another process's
        self._process.wait()

    def _read_replies(self) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exit_codes[message["exited"]] = message["code"]
                else:
                    self._spawned.append(message)
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()


# ------------------------------------------------------------------ the server process
def _become_engine(request: dict[str, Any], selector: selectors.BaseSelector, wake_fds: tuple[int, int]) -> None:
    """In the forked child: take the engine's session, files, environment and argv, and run it."""
    code = 1
    try:
        os.setsid()
        _die_with_parent(request["server"])
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


def _die_with_parent(server: int) -> None:
    """Have Linux kill this engine when the server ends, even killed by SIGKILL, which runs no clean-up."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server:  # the server ended before the signal was asked for
        os._exit(1)


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
                reply({"pid": pid, "started": children[pid].started})


if __name__ == "__main__":
    serve()
