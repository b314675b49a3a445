"""The kernel's handle on the engines' fork server (``nbfsdp.helpers.forkserver``): start it, ask it for
engines, learn how they end. Why engines are forked, and the line protocol: see that module."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from typing import Any

import psutil

from nbfsdp.shared.processes import ProcessRef

SPAWN_TIMEOUT = 120.0


class ForkServerError(RuntimeError):
    """The fork server could not fork an engine, or is gone."""


class ForkServer:
    """The kernel's end: starts the server, asks it for engines, learns how they end."""

    def __init__(self, env: dict[str, str], private_dir: str) -> None:
        """Start the server now, with ``env`` (what it imports may read its environment), for the cluster whose
        directory ``private_dir`` is: its log goes there, and the directory goes on its command line, which the
        engines it forks keep (the server does not read it; ``nbfsdp.helpers.reaper`` and ``ps`` do)."""
        self._log_path = os.path.join(private_dir, "forkserver.log")
        with open(self._log_path, "ab") as log:
            self._process = psutil.Popen(
                [sys.executable, "-m", "nbfsdp.helpers.forkserver", private_dir],
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
        self._outputs: list[tuple[int, str]] = []  # every engine forked, in order: its pid and its output file
        self._exit_codes: dict[int, int | None] = {}
        self._last_output: dict[int, str] = {}  # the end of each ended engine's output, read as it ended
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

    @property
    def forked_count(self) -> int:
        """How many engines this server has forked: ``forked_since`` takes it to name the ones forked after."""
        return len(self._outputs)

    def forked_since(self, count: int) -> dict[int, str]:
        """The engines forked after the first ``count``, whether or not they still run: pid -> output file. Their
        own record, as ipyparallel's engine set drops an engine that ended once its loop hears of it."""
        return dict(self._outputs[count:])

    def last_output(self, pid: int) -> str:
        """The last lines engine ``pid`` wrote, read as the server reported its end ('' while it runs): the
        file is gone once ipyparallel's launcher hears of the end, which it can only do after that."""
        with self._changed:
            return self._last_output.get(pid, "")

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
                    pid = message["exited"]
                    self._last_output[pid] = _last_lines(dict(self._outputs).get(pid, ""))
                    self._exit_codes[pid] = message["code"]
                else:
                    if "pid" in message:  # recorded here, before the server can report the engine's end
                        self._outputs.append((message["pid"], message["output"]))
                    self._spawned.append(message)
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()


def _last_lines(path: str, count: int = 12) -> str:
    """The file's last ``count`` lines, from at most its last 64 KiB ('' if it cannot be read)."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 65536))
            return b"".join(file.readlines()[-count:]).decode(errors="replace").rstrip()
    except OSError:
        return ""
