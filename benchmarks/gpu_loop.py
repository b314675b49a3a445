"""gpu-loop: the GPT-2 loop people bring (``benchmarks/gpt2_loop.py``) at the GPU default precision, four ways.

Each round runs, each side alone (nbfsdp's world is stopped while the others run):

- plain: one process, no FSDP, fp32 parameters under bf16 autocast, as the document's loop runs;
- torchrun FSDP2 at world size 1: ``fully_shard`` per ``GPT2Block`` and the root, bf16 parameters and fp32
  reduction (nbfsdp's DEFAULT);
- ``%%fsdp --world-size 1`` in a kernel, at its defaults on GPU (DEFAULT, said outright so that the CPU run
  of tests/test_bench.py compares the same math; ``GPT2Block`` units from ``_no_split_modules``), logging
  every step with the dashboard on;
- ``%%fsdp --world-size 2 --device cuda``: two ranks sharing the one GPU, NCCL between them over sockets.

Reported: %%fsdp / torchrun at the same settings (target at most 1.02), FSDP2 / plain (what FSDP2 itself costs
on this model, no target), the shared-GPU step against plain, each rank's CUDA memory after a step and at its
peak, and the losses (torchrun and ``%%fsdp`` at world size 1 run the same math: within 1e-3). Median step
after the warm-up. The notebook's model, data and loader are built afresh before each ``%%fsdp`` side, so
each side trains the same weights on the same batches. Without a GPU: ``{"skipped": "no GPU"}``
(``compare`` runs on the CPU too, which is how tests/test_bench.py checks the benchmark itself).

Run alone: ``python -m benchmarks --only gpu_loop``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks import gpt2_loop, launch, notebook_loop
from benchmarks.context import NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, median
from benchmarks.step_time import parity

NAME = "gpu_loop"
TARGET_RATIO = 1.02
LOSS_TOLERANCE = 1e-3
SIDES = ("plain", "torchrun", "fsdp_ws1", "fsdp_ws2")

#: Read back after a %%fsdp side: rank 0's names, and every rank's CUDA figures from its records.
_READ_BACK = """
import json as _json
import nbfsdp as _nbfsdp
_run = _nbfsdp.last_run()
_ranks = sorted({m["rank"] for m in _run.metrics})
print(_json.dumps({
    "step_times": step_times, "losses": losses, "units": _run.config["fsdp_units"]["model"],
    "mixed_precision": _run.config["mixed_precision"], "devices": _run.config["devices"],
    "cuda_allocated": [[m.get("cuda_allocated", 0) for m in _run.metrics if m["rank"] == r][-1] for r in _ranks],
    "cuda_max_allocated": [max(m.get("cuda_max_allocated", 0) for m in _run.metrics if m["rank"] == r) for r in _ranks],
}))
"""


def _process(mode: str, sizes: gpt2_loop.Sizes, device: str) -> dict:
    """The loop in a fresh process: plain, or FSDP2 under torchrun at world size 1."""
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-gpt2-") as tmp:
        config, out = Path(tmp, "config.json"), Path(tmp, "out.json")
        config.write_text(json.dumps({**sizes.as_dict(), "device": device}))
        arguments = [mode, str(config), str(out)]
        if mode == "fsdp":
            launch.torchrun(1, "benchmarks.gpt2_loop", arguments, cpu_only=device == "cpu", timeout=600)
        else:
            launch.python_module("benchmarks.gpt2_loop", arguments, cpu_only=device == "cpu", timeout=600)
        return json.loads(out.read_text())


def _cell(kernel: Kernel, world_size: int, sizes: gpt2_loop.Sizes, device: str) -> dict:
    """The loop as a ``%%fsdp`` cell at nbfsdp's defaults, on fresh weights, data and loader; the world is
    started untimed first."""
    kernel.execute(f"%%fsdp --world-size {world_size} --device {device}\npass")
    kernel.execute(gpt2_loop.constants(sizes) + gpt2_loop.SETUP_SOURCE + "LOG_EACH_STEP = True\n")
    flags = f"--world-size {world_size} --device {device} --mixed-precision DEFAULT --no-gather"
    kernel.execute(f"%%fsdp {flags}\n{gpt2_loop.LOOP_SOURCE}", 900)
    return kernel.execute(_READ_BACK).json()


def compare(sizes: gpt2_loop.Sizes, device: str, rounds: int, shutdown: Callable[[Kernel], None]) -> dict:
    """``rounds`` rounds of the four sides (in turn forwards and backwards); per side its rounds' median
    steps, and the first round's losses, units and memory."""
    # a fresh kernel, as the GPU rows' is: the first side runs a process, and stopping nbfsdp's world for it
    # loads the extension first (``notebook_loop.stop_world``)
    kernel = Kernel(env={**NO_PREWARM, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})})
    stopped: list[bool] = []
    try:
        run = {
            "plain": lambda: _process("plain", sizes, device),
            "torchrun": lambda: _process("fsdp", sizes, device),
            "fsdp_ws1": lambda: _cell(kernel, 1, sizes, device),
            "fsdp_ws2": lambda: _cell(kernel, 2, sizes, device),
        }
        medians: dict[str, list[float]] = {side: [] for side in SIDES}
        first: dict[str, dict] = {}
        for index in range(rounds):
            for side in SIDES if index % 2 == 0 else reversed(SIDES):
                if not side.startswith("fsdp"):
                    stopped.append(notebook_loop.stop_world(kernel))  # each side alone on the GPU and the cores
                print(f"[bench] gpu_loop round {index}: {side}", file=sys.stderr, flush=True)
                result = run[side]()
                medians[side].append(statistics.median(result["step_times"][sizes.warmup :]))
                first.setdefault(side, result)
        params = kernel.execute(
            gpt2_loop.constants(sizes) + gpt2_loop.SETUP_SOURCE + "print(sum(p.numel() for p in model.parameters()))"
        ).stdout.split()[-1]
    finally:
        shutdown(kernel)
    return {
        "sizes": sizes.as_dict(), "params": int(params), "device": device, "round_medians_s": medians,
        "world_stopped_for_processes": stopped, **first,
    }  # fmt: skip


def measurements(result: dict, label: str) -> list[Measurement]:
    medians = result["round_medians_s"]
    ms = {side: median([x * 1000 for x in values]) for side, values in medians.items()}

    def ratio(b: str, a: str) -> float:
        return statistics.median(medians[b]) / statistics.median(medians[a])

    shared = result["fsdp_ws2"]
    memory = ", ".join(
        f"rank {rank} {after / 2**30:.2f} GiB after a step, {peak / 2**30:.2f} GiB peak"
        for rank, (after, peak) in enumerate(zip(shared["cuda_allocated"], shared["cuda_max_allocated"], strict=True))
    )
    same_units = result["torchrun"]["units"] == result["fsdp_ws1"]["units"]
    return [
        Measurement(
            what=f"{label}: step time, %%fsdp ws1 / torchrun FSDP2 ws1 (both {result['fsdp_ws1']['mixed_precision']})",
            value=ratio("fsdp_ws1", "torchrun"),
            unit="x",
            target=TARGET_RATIO,
            op="<=",
            a_label="torchrun",
            a=ms["torchrun"],
            b_label="%%fsdp",
            b=ms["fsdp_ws1"],
            ab_unit="ms",
            samples_a=medians["torchrun"],
            samples_b=medians["fsdp_ws1"],
            note=f"FSDP units {'the same' if same_units else 'DIFFER'}",
        ),
        Measurement(
            what=f"{label}: what FSDP2 itself costs, torchrun FSDP2 ws1 (bf16 params) / plain (fp32 params, autocast)",
            value=ratio("torchrun", "plain"),
            unit="x",
            a_label="plain",
            a=ms["plain"],
            b_label="FSDP2",
            b=ms["torchrun"],
            ab_unit="ms",
            note="no target",
        ),
        Measurement(
            what=f"{label}: %%fsdp ws2 --device cuda ({shared['devices']}) / plain",
            value=ratio("fsdp_ws2", "plain"),
            unit="x",
            a_label="plain",
            a=ms["plain"],
            b_label="ws2 shared",
            b=ms["fsdp_ws2"],
            ab_unit="ms",
            note=f"no target: NCCL between the ranks over sockets; {memory}",
        ),
        Measurement(
            what=f"{label}: rank-0 losses max |torchrun FSDP2 - %%fsdp| ws1 ({len(result['plain']['losses'])} steps)",
            value=parity(result["torchrun"]["losses"], result["fsdp_ws1"]["losses"]) if same_units else float("inf"),
            unit="",
            target=LOSS_TOLERANCE,
            op="<=",
            note=f"plain (fp32 params) against FSDP2 (bf16 params): "
            f"{parity(result['plain']['losses'], result['torchrun']['losses']):.3g}",
        ),
    ]


def run(ctx: Context) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (the examples extra)"}
    device_name = torch.cuda.get_device_name(0)
    sizes = gpt2_loop.QUICK if ctx.quick else gpt2_loop.FULL
    result = compare(sizes, "cuda", ctx.rounds(full=2, quick=1), ctx.shutdown)
    label = f"gpu-loop GPT-2 {result['params'] / 1e6:.0f}M {sizes.batch}x{sizes.sequence} ({device_name})"
    return {"measurements": measurements(result, label), "device_name": device_name, **result}
