"""A fresh Jupyter kernel driven the way a notebook front end drives it, through jupyter_client.

``Kernel()`` starts an IPython kernel with this interpreter (``sys.executable``, the repository's venv under
``make bench``), in a temporary working directory, with ``os.environ`` plus the given variables, and waits
until it answers. ``execute`` sends one cell and returns when the kernel has both replied and gone idle:
the round trip a notebook sees, with the cell's stdout and error. ``shutdown`` stops nbfsdp's
cluster (``%fsdp stop``), shuts the kernel down and waits until every process it started has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

KERNEL_NAME = "nbfsdp-bench"
STARTUP_TIMEOUT_S = 120.0
#: Ends nbfsdp's cluster if the extension was loaded (what ``%fsdp stop`` does).
STOP_NBFSDP = """import sys as _sys
if "nbfsdp" in _sys.modules and _sys.modules["nbfsdp"]._magics:
    get_ipython().run_line_magic("fsdp", "stop")
"""


class CellError(RuntimeError):
    """A cell ended with an error; carries the kernel's own traceback."""


@dataclass
class Reply:
    """One executed cell as the front end saw it."""

    status: str
    elapsed: float
    """Seconds from sending the execute request to having both its reply and the kernel's idle status."""
    stdout: str = ""
    error: str = ""

    def json(self) -> object:
        """The last stdout line, parsed as JSON (cells print their results that way)."""
        return json.loads(self.stdout.strip().splitlines()[-1])


class Kernel:
    """A kernel process and a blocking client on its channels."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="nbfsdp-bench-kernel-"))
        spec_dir = self._dir / "kernels" / KERNEL_NAME
        spec_dir.mkdir(parents=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        spec = {"argv": argv, "display_name": "nbfsdp bench", "language": "python"}
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        self.cwd = self._dir / "work"
        self.cwd.mkdir()
        self.manager = KernelManager(
            kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(self._dir / "kernels")])
        )
        self.log_path = self._dir / "kernel.log"  # the kernel process's own stdout and stderr
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in shutdown)
        full_env = {**os.environ, **(env or {})}
        self.manager.start_kernel(env=full_env, cwd=str(self.cwd), stdout=self._log, stderr=subprocess.STDOUT)
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=STARTUP_TIMEOUT_S)
        except RuntimeError:
            self.shutdown()
            raise
        self.pid: int = self.manager.provisioner.pid

    def execute(self, code: str, timeout: float = 300, check: bool = True) -> Reply:
        """Run one cell; raise ``CellError`` (when ``check``) if it failed."""
        started = time.perf_counter()
        msg_id = self.client.execute(code)
        reply = None
        stdout, error = [], ""
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:  # the cell's output, up to the kernel's idle status
            msg = self._next(self.client.get_iopub_msg, deadline, code)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content["name"] == "stdout":
                stdout.append(content["text"])
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        while reply is None:  # usually already waiting: the reply comes just before idle
            msg = self._next(self.client.get_shell_msg, deadline, code)
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg
        elapsed = time.perf_counter() - started
        result = Reply(reply["content"]["status"], elapsed, "".join(stdout), error)
        if check and result.status != "ok":
            raise CellError(f"cell failed: {result.error or result.status}\n--- cell ---\n{code[:500]}")
        return result

    def _next(self, get, deadline: float, code: str) -> dict:
        """The next message from ``get``; a dead kernel or the deadline ends the wait with the kernel's log."""
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                return get(timeout=min(left, 1.0))
            if not self.manager.is_alive():
                raise RuntimeError(f"the kernel died running:\n{code[:300]}\n--- its log ---\n{self.log_tail()}")
        raise TimeoutError(f"cell did not finish in time:\n{code[:300]}\n--- kernel log ---\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def descendants(self) -> list[psutil.Process]:
        """Every process below the kernel now (nbfsdp's controller, engines and reaper among them)."""
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except (psutil.NoSuchProcess, AttributeError):
            return []

    def shutdown(self, wait: float = 30) -> list[str]:
        """Stop nbfsdp's cluster, then the kernel; the processes still alive after ``wait`` s (should be none)."""
        started_here = self.descendants() if hasattr(self, "pid") else []
        if hasattr(self, "pid"):
            with contextlib.suppress(Exception):
                self.execute(STOP_NBFSDP, timeout=60, check=False)
        with contextlib.suppress(Exception):
            self.client.stop_channels()
        with contextlib.suppress(Exception):
            self.manager.shutdown_kernel(now=False)
        deadline = time.monotonic() + wait
        alive = [p for p in started_here if _alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _alive(p)]
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        return [f"{p.pid} {' '.join(_cmdline(p))[:120]}" for p in alive]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return ["?"]
