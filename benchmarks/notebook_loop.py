"""The benchmark loop as a ``%%fsdp`` cell in a kernel: the notebook side of each step-time comparison.

Each run defines the sizes, model class and batch function in the notebook (``loops.setup_source``) and, for
a loop from a loader, the data and the notebook's loader of the global batch; builds a fresh model under the
seed (so every round starts from the same weights and the model is sent again), runs ``loops.fsdp_cell`` and
reads back rank 0's step times (wall and CPU) and losses (names the cell assigned), the FSDP units nbfsdp
chose and the engines' thread counts (and what a loader's ranks read). In a kernel the live dashboard is
always on.
"""

from __future__ import annotations

from benchmarks import loops
from benchmarks.kernel import Kernel

#: Printed after the cell, in the notebook: what the cell left and how nbfsdp ran it.
_READ_BACK = """
import json as _json
import nbfsdp as _nbfsdp
_run = _nbfsdp.last_run()
_world = _nbfsdp._magics.session.cluster.world
print(_json.dumps({
    "step_times": step_times, "step_cpu_times": step_cpu_times, "losses": losses,
    "units": _run.config["fsdp_units"]["model"],
    "records": len(_run.metrics), "backend": _world.backend,
    "engine_threads": [e.threads for e in _world.engines], "devices": [e.device for e in _world.engines],
}))
"""


def start_world(kernel: Kernel, world_size: int, sizes: loops.LoopSizes) -> None:
    """Load nbfsdp and have the world of this size running (engines, torch, process group): not timed."""
    kernel.execute("%load_ext nbfsdp")
    kernel.execute(f"%%fsdp {loops.cell_flags(world_size, sizes)}\npass")


def stop_world(kernel: Kernel) -> bool:
    """Stop nbfsdp's engines, controller and fork server (the kernel stays); whether none is left running.
    In a fresh kernel (the GPU benchmark's first round runs torchrun first) the extension loads first: it
    starts nothing, so there is nothing to stop."""
    kernel.execute("%load_ext nbfsdp\n%fsdp stop")
    return not kernel.execute("import nbfsdp as _nbfsdp\nprint(int(_nbfsdp._magics.session.cluster.running))").json()


#: After a loop from a loader: what the ranks read, how nbfsdp split the loader; the data leaves the notebook.
_READ_BACK_LOADER = """
import json as _json
import nbfsdp as _nbfsdp
print(_json.dumps({"global_batches": global_batches, "loader_plan": _nbfsdp.last_run().config["loaders"]["loader"]}))
del dataset, loader, global_batches
"""


def run(kernel: Kernel, world_size: int, sizes: loops.LoopSizes, log_each_step: bool = True, flags: str = "") -> dict:
    """One ``%%fsdp`` run of the loop on a warm world; rank 0's step times and losses and how it ran. ``flags``:
    more of ``%%fsdp``'s (``--timeline 0``)."""
    kernel.execute(loops.setup_source(sizes))
    if sizes.from_loader:
        kernel.execute(loops.dataset_source(sizes, world_size) + loops.NOTEBOOK_LOADER_SOURCE)
    kernel.execute(f"LOG_EACH_STEP = {log_each_step}\n{loops.NEW_MODEL_SOURCE}")
    reply = kernel.execute(loops.fsdp_cell(world_size, sizes).replace("%%fsdp ", f"%%fsdp {flags}", 1))
    result = kernel.execute(_READ_BACK).json()
    if sizes.from_loader:
        result.update(kernel.execute(_READ_BACK_LOADER).json())
    result["cell_round_trip_s"] = reply.elapsed
    return result
