"""The step-time comparison on one GPU (NCCL, world size 1), with model FLOPs utilization.

Where ``torch.cuda.is_available()``: the ``step_time`` loop, sized for a GPU (``loops.GPU_FULL``: ~273M
parameters, 8192 tokens a step, bf16 compute with ``--mixed-precision PURE`` on both sides), alternating
torchrun (A) and ``%%fsdp --world-size 1`` in a fresh kernel (B). Reported: %%fsdp's speed relative to
torchrun, A/B of the median step times (target at least 0.98); MFU of each side, from the model FLOPs of a
step (6 * parameters * tokens) over the step time and the device's dense peak for the compute dtype, looked
up by device name in ``PEAK_TFLOPS`` (vendor datasheets; None for a device not in the table). The device's
name is saved with the results. Without a GPU the benchmark records ``{"skipped": "no GPU"}``.

Run alone (e.g. on a GPU machine, after ``pip install -e '.[test]'``): ``python -m benchmarks --only gpu``.
"""

from __future__ import annotations

from benchmarks import loops, step_time
from benchmarks.context import NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement

NAME = "gpu"
WORLD_SIZE = 1

#: Dense (no sparsity) peak TFLOP/s by device-name fragment, first match wins; from the vendors' datasheets.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "tf32": 183.1, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
]


def peak_tflops(device_name: str, dtype: str) -> float | None:
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in device_name:
            return peaks[dtype]
    return None


def compute_dtype(sizes: loops.LoopSizes) -> str:
    """The dtype the matmuls run in: the parameters' dtype under the mixed-precision setting."""
    import torch

    if loops.MIXED_PRECISION_DTYPES[sizes.mixed_precision][0] == "bfloat16":
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def run(ctx: Context) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    device_name = torch.cuda.get_device_name(0)
    sizes = loops.GPU_QUICK if ctx.quick else loops.GPU_FULL
    kernel = Kernel(env=NO_PREWARM)
    try:
        # an H100 VM's step times drift between regimes (35 and 43 ms, for about a second each, torchrun too):
        # many short rounds rather than a few long ones
        rounds = ctx.rounds(full=9, quick=2)
        result = step_time.compare(kernel, WORLD_SIZE, sizes, rounds, device="cuda")
    finally:
        ctx.shutdown(kernel)
    dtype = compute_dtype(sizes)
    peak = peak_tflops(device_name, dtype)
    flops = sizes.flops_per_step(WORLD_SIZE)

    def mfu(step_s: float) -> float | None:
        return flops / step_s / (peak * 1e12) if peak else None

    mfu_a, mfu_b = mfu(result["torchrun_median_s"]), mfu(result["fsdp_median_s"])
    rows = step_time.measurements(result, f"GPU ws1 ({device_name})", throughput=True, loss_tolerance=1e-3)
    rows.append(
        Measurement(
            what=f"GPU ws1 ({device_name}): MFU, {dtype} dense peak {peak} TFLOP/s, {flops / 1e12:.1f} TFLOP/step",
            value=mfu_b * 100 if mfu_b is not None else None,
            unit="% MFU",
            a_label="torchrun",
            a=mfu_a * 100 if mfu_a is not None else None,
            b_label="%%fsdp",
            b=mfu_b * 100 if mfu_b is not None else None,
            ab_unit="% MFU",
            note="" if peak else f"{device_name} is not in benchmarks/gpu.py's PEAK_TFLOPS",
        )
    )
    return {
        "measurements": rows,
        "device": device_name,
        "compute_dtype": dtype,
        "peak_tflops": peak,
        "model_flops_per_step": flops,
        "mfu_torchrun": mfu_a,
        "mfu_fsdp": mfu_b,
        **result,
    }
