"""Launching torchrun worlds for the benchmarks: the command, its environment, its wall time.

Every launch is ``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGS`` from the
repository root, with this interpreter. ``OMP_NUM_THREADS`` is removed from the environment so that torchrun
applies its own default (1 thread per process when it starts several), as a user's torchrun would; gloo is
pinned to the loopback interface, as nbfsdp pins its engines, so both sides talk over the same transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import loops
from nbfsdp.shared.network import loopback_interface

REPO = Path(__file__).resolve().parent.parent


def torchrun_env(cpu_only: bool) -> dict[str, str]:
    env = dict(os.environ)
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    loopback = loopback_interface()
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
    return env


def torchrun(nproc: int, module: str, args: list[str], cpu_only: bool, timeout: float = 300) -> float:
    """Run ``module`` on ``nproc`` processes under torchrun; its wall time in seconds (launcher included).

    ``cpu_only`` hides the GPUs, as the CPU benchmarks' kernels hide them from nbfsdp's engines."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", module, *args,
    ]  # fmt: skip
    return _run(command, f"torchrun {module} on {nproc} processes", cpu_only, timeout)


def python_module(module: str, args: list[str], cpu_only: bool, timeout: float = 300) -> float:
    """Run ``module`` in one plain process (no torchrun, no process group); its wall time in seconds."""
    return _run([sys.executable, "-m", module, *args], f"python -m {module}", cpu_only, timeout)


def _run(command: list[str], what: str, cpu_only: bool, timeout: float) -> float:
    # torchrun makes a log directory under the temporary directory at each launch and leaves it there
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-torchrun-") as scratch:
        env = {**torchrun_env(cpu_only), "TMPDIR": scratch}
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        elapsed = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{tail}")
    return elapsed


#: How torchrun's ranks sometimes end on this VM, both at once, with no Python traceback: 2 of 3 full
#: ``--only dataloader`` runs once each, never in 19 launches of the same script alone. Such a launch is
#: run once more and says so on stderr; anything else, or a second abort, fails the benchmark.
ABORT = "terminate called without an active exception"


def torchrun_again_on_abort(nproc: int, module: str, args: list[str], cpu_only: bool, timeout: float = 300) -> float:
    """``torchrun``, launched once more where its ranks aborted as described above."""
    try:
        return torchrun(nproc, module, args, cpu_only, timeout)
    except RuntimeError as error:
        if ABORT not in str(error):
            raise
        print(f"[bench] torchrun's ranks aborted ({ABORT}); running that launch again", file=sys.stderr)
        return torchrun(nproc, module, args, cpu_only, timeout)


def torchrun_loop(world_size: int, sizes: loops.LoopSizes, device: str = "cpu") -> dict:
    """One torchrun run of the benchmark loop; rank 0's step times, losses, units and threads."""
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-") as tmp:
        config, out = Path(tmp, "config.json"), Path(tmp, "out.json")
        config.write_text(json.dumps({**sizes.as_dict(), "device": device}))
        wall = torchrun_again_on_abort(
            world_size, "benchmarks.torchrun_loop", [str(config), str(out)], cpu_only=device == "cpu"
        )
        result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result
