"""Model transfer: a 100M-parameter model sent from the notebook to 4 ranks, in bytes and in peak memory.

Each round is a fresh kernel (``NBFSDP_PREWARM=0``) whose 4-rank world is started, has drawn a dashboard
once and has trained a tiny model (FSDP2's first use costs each engine ~30 MB that is not transfer). Then
every process's peak resident size is reset (``/proc/PID/clear_refs``) and its resident size taken as its
baseline; the notebook builds ``nn.Sequential`` of 24 ``Linear(2048, 2048)`` (100.7M parameters, 403 MB)
and runs one ``%%fsdp --no-gather`` cell that logs each rank's local shard bytes (``p.to_local()``), so no
gather back counts. Afterwards the peaks are read (``VmHWM``):

- bytes the notebook sent each rank (``nbfsdp.last_run().sent_bytes``, as each rank counted its shards)
  against the model's bytes / N: target within 5%;
- each engine's peak above its baseline / its local shard bytes: target at most 1.3 (the worst rank);
- the notebook's (kernel process's) peak above its baseline, taken before the model was built, / the
  model's bytes: target at most 1.1 (the model itself is 1.0);
- the controller's resident size after the cell above its size before, / the model's bytes: no target
  (ipyparallel's default task database kept a copy of every shard sent; nbfsdp's controller runs without one).

``--quick``: 2 ranks and a 10.5M-parameter model, one round. Run alone:
``python -m benchmarks --only transfer``.
"""

from __future__ import annotations

import time

from benchmarks import procmem
from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, median

NAME = "transfer"
MiB = 2**20


def one_round(ctx: Context, world_size: int, width: int, depth: int) -> dict:
    kernel = Kernel(env={**NO_PREWARM, **CPU_ONLY})
    try:
        kernel.execute("%load_ext nbfsdp\nimport gc, json, torch, torch.nn as nn, nbfsdp")
        # before any baseline: the world is up, the dashboard has drawn once, and FSDP2 has sharded and run a
        # tiny model (its first use costs each engine ~30 MB of its own, as any session's first training cell)
        kernel.execute("tiny = nn.Linear(8, 8)")
        kernel.execute(
            f"%%fsdp --world-size {world_size}\ntiny(torch.ones(2, 8)).sum().backward()\nnbfsdp.log(step=0, ready=1)"
        )
        engines = kernel.execute("gc.collect()\nprint(json.dumps(nbfsdp._magics.session.cluster.world.pids))").json()
        controller = kernel.execute("print(nbfsdp._magics.session.cluster.cluster_pids()[1])").json()
        time.sleep(0.5)
        pids = {"notebook": kernel.pid, **{f"rank {r}": pid for r, pid in enumerate(engines)}}
        baseline = {name: procmem.reset_peak(pid) for name, pid in pids.items()}
        controller_baseline = procmem.read(controller)["rss"]
        model_bytes = kernel.execute(
            f"torch.manual_seed(0)\nbig = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({depth})])\n"
            "print(json.dumps(sum(p.numel() * p.element_size() for p in big.parameters())))"
        ).json()
        reply = kernel.execute(
            f"%%fsdp --world-size {world_size} --no-gather\n"
            "shard_bytes = sum(p.to_local().numel() * p.element_size() for p in big.parameters())\n"
            "nbfsdp.log(step=0, shard_bytes=shard_bytes)"
        )
        peak = {name: procmem.read(pid)["hwm"] for name, pid in pids.items()}
        controller_kept = procmem.read(controller)["rss"] - controller_baseline
        run = kernel.execute(
            "_run = nbfsdp.last_run()\n"
            "print(json.dumps({'shard_bytes': {m['rank']: m['shard_bytes'] for m in _run.metrics},"
            " 'sent_bytes': _run.sent_bytes, 'elapsed': _run.elapsed}))"
        ).json()
    finally:
        ctx.shutdown(kernel)
    shard = {int(rank): size for rank, size in run["shard_bytes"].items()}
    engine_ratio = {rank: (peak[f"rank {rank}"] - baseline[f"rank {rank}"]) / shard[rank] for rank in shard}
    sent = run["sent_bytes"]
    ratios = [s / (model_bytes / world_size) for s in sent]
    sent_ratio = max(ratios, key=lambda r: abs(r - 1.0))
    return {
        "model_bytes": model_bytes,
        "shard_bytes": shard,
        "sent_bytes": sent,
        "sent_ratio_worst": sent_ratio,
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "engine_peak_over_shard": engine_ratio,
        "engine_peak_over_shard_worst": max(engine_ratio.values()),
        "notebook_peak_over_model": (peak["notebook"] - baseline["notebook"]) / model_bytes,
        "controller_kept_over_model": controller_kept / model_bytes,
        "cell_s": reply.elapsed,
    }


def run(ctx: Context) -> dict:
    if not procmem.available():
        return {"skipped": "no /proc/PID/clear_refs to reset peak memory"}
    world_size, width, depth = (2, 1024, 10) if ctx.quick else (4, 2048, 24)
    rounds = [one_round(ctx, world_size, width, depth) for _ in range(ctx.rounds(full=2, quick=1))]
    model_mib = rounds[0]["model_bytes"] / MiB
    shard_mib = [max(r["shard_bytes"].values()) / MiB for r in rounds]
    sent = [r["sent_ratio_worst"] for r in rounds]
    engine = [r["engine_peak_over_shard_worst"] for r in rounds]
    notebook = [r["notebook_peak_over_model"] for r in rounds]
    controller = [r["controller_kept_over_model"] for r in rounds]
    engine_mib = [
        max(r["peak_bytes"][k] - r["baseline_bytes"][k] for k in r["peak_bytes"] if k != "notebook") / MiB
        for r in rounds
    ]
    notebook_mib = [(r["peak_bytes"]["notebook"] - r["baseline_bytes"]["notebook"]) / MiB for r in rounds]
    label = f"transfer {model_mib:.0f} MiB model to {world_size} ranks"
    rows = [
        Measurement(
            what=f"{label}: bytes sent per rank / (model / {world_size}), worst rank",
            value=median(sent),
            unit="x",
            target=0.05,
            op="±",
            samples_value=sent,
        ),
        _growth_row(f"{label}: engine peak above baseline / its local shard, worst rank", engine, 1.3,
                    ("local shard", median(shard_mib)), ("engine peak growth", median(engine_mib))),
        _growth_row(f"{label}: notebook peak growth (model built + sent) / model bytes", notebook, 1.1,
                    ("model", model_mib), ("notebook peak growth", median(notebook_mib))),
        Measurement(
            what=f"{label}: controller's resident memory kept after the cell / model bytes",
            value=median(controller), unit="x", samples_value=controller,
            note="ipyparallel's default task database would keep the shards sent (1.0x)",
        ),
    ]  # fmt: skip
    return {
        "measurements": rows,
        "world_size": world_size,
        "model": f"{depth} x Linear({width}, {width})",
        "rounds": rounds,
    }


def _growth_row(
    what: str, ratios: list[float], target: float, base: tuple[str, float], growth: tuple[str, float]
) -> Measurement:
    """A memory growth as a multiple of ``base`` (at most ``target``), both also shown in MiB."""
    return Measurement(
        what=what, value=median(ratios), unit="x", target=target, op="<=", a_label=base[0], a=base[1],
        b_label=growth[0], b=growth[1], ab_unit="MiB", samples_value=ratios,
    )  # fmt: skip
