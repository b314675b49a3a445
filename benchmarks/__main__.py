"""``make bench``: nbfsdp measured against its reference in one run, alternating A B A B.

    python -m benchmarks [--quick] [--only NAME [NAME ...]] [--out DIR]

Benchmarks (each module's docstring says what it measures and how):

1. ``step_time``    the same FSDP loop in ``%%fsdp`` (log each step, dashboard on) vs torchrun, ws 2 and 4
2. ``dataloader``   that loop reading the notebook's DataLoader split by ``%%fsdp`` vs torchrun's
                    ``DistributedSampler``, same global batch, ws 2 and 4
3. ``warm_cell``    a trivial ``%%fsdp --world-size 4`` cell on a warm cluster vs a raw ipyparallel execute
4. ``cold_start``   the first ``%%fsdp --world-size 4`` cell in a fresh kernel vs torchrun's cold start
5. ``transfer``     a 100M-parameter model sent to 4 ranks: bytes per rank, engine and notebook peak memory
   ``read_only_cell`` a cell that moves no weights vs ``--no-gather``, at 50M and 1B parameters, and the
                    kernel's memory beyond the model
   ``lora_cell``    a LoRA training cell on a 246M bf16 Llama: adapters gathered back vs ``--no-gather``, the
                    bytes that come back against the adapters' and the whole model's
   ``pretrained``   a 1B Hugging Face checkpoint: ``%fsdp load`` vs torchrun + DCP's HF reader, each rank's
                    peak; the kernel's memory and a warm cell's overhead on models living on the ranks
6. ``log_overhead`` ``nbfsdp.log`` each step and the live plot vs no logging, at ~10 steps a second
   ``where_ledger`` ``%fsdp where``'s ledger of collectives on vs off, on the GPT-2 loop's step (torchrun, ws 2)
   ``explain_suggest`` ``%fsdp explain --suggest`` on Llama-3-70B's shapes (64 x H100) vs the plan alone
   ``timeline``     a 200-step loop capturing steps (``--timeline``'s default) vs ``--timeline 0``, and a
                    captured step vs its cell's median step
   ``overlap``      communication hidden behind compute on CPU ranks, prefetch off / backward / forward+backward,
                    the course's 4-block model, ws 2 and 4
7. ``gpu``          the step-time loop on one GPU (NCCL) vs torchrun, with MFU; skipped without a GPU
   ``gpu_loop``     the GPT-2 loop people bring, at the GPU default precision: plain, torchrun FSDP2 ws1,
                    ``%%fsdp --world-size 1`` and ``--world-size 2 --device cuda`` on one GPU; skipped without one
8. ``checkpoint``   ``%fsdp save`` / ``load`` vs ``dcp.save`` / ``load`` direct on the same engines, vs the
                    disk's write speed, and the engines' peak memory while saving, ws 2
9. ``hosts``        2 hosts x 2 ranks (network namespaces, an SSH-launched cluster ``%fsdp attach``-ed): the
                    step-time loop vs ``torchrun --nnodes 2``, and the bytes each host receives / its shards;
                    skipped where namespaces cannot be made
   ``slurm``        2 nodes x 2 ranks through a real Slurm (network namespaces): ``%fsdp attach --slurm`` to ready
                    vs ``sbatch`` + ``srun torchrun`` to its first collective, and the step-time loop vs
                    ``srun torchrun --nnodes 2``; skipped where Slurm cannot be made
10. ``weight_moves`` a 1B bf16 model with AdamW state living on the ranks moved 4 -> 2 -> 4 ranks vs
                    ``%fsdp save`` + ``%fsdp load`` of the same vs DCP's save and load direct; the kernel's growth

Writes ``results.json``, ``results.md`` and ``results.png`` under ``--out`` (default ``benchmarks/results``)
and prints the table. ``--quick`` runs tiny sizes, few rounds and world size 2 where the point allows (the
smoke test in ``tests/test_bench.py``). Exit status 1 if a benchmark failed to run (not if a target is
missed: the table says that).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

import psutil

from benchmarks import (
    checkpoint,
    cold_start,
    dataloader,
    explain_suggest,
    gpu,
    gpu_loop,
    hosts,
    log_overhead,
    lora_cell,
    machine,
    model_transfer,
    overlap,
    pretrained,
    read_only_cell,
    report,
    slurm,
    step_time,
    timeline_cost,
    warm_cell,
    weight_moves,
    where_ledger,
)
from benchmarks.context import Context

#: Report order (the issue's numbering).
BENCHMARKS = {
    m.NAME: m
    for m in (
        step_time,
        dataloader,
        warm_cell,
        cold_start,
        model_transfer,
        read_only_cell,
        lora_cell,
        pretrained,
        log_overhead,
        where_ledger,
        explain_suggest,
        timeline_cost,
        overlap,
        gpu,
        gpu_loop,
        checkpoint,
        hosts,
        slurm,
        weight_moves,
    )  # fmt: skip
}
#: Run order: the four that share the warm kernel first (the two step-time comparisons start and stop its
#: world each round anyway), then those with kernels of their own.
RUN_ORDER = (
    "timeline",
    "overlap",
    "log_overhead",
    "step_time",
    "dataloader",
    "warm_cell",
    "cold_start",
    "transfer",
    "read_only_cell",
    "lora_cell",
    "pretrained",
    "where_ledger",
    "explain_suggest",
    "checkpoint",
    "weight_moves",
    "hosts",
    "slurm",
    "gpu",
    "gpu_loop",
)
SHARE_WARM_KERNEL = {"timeline", "overlap", "log_overhead", "step_time", "dataloader", "warm_cell"}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (smoke test, ~3 minutes)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


#: Set in this process's environment at the start of a run, with a value of its own: every process the run
#: starts inherits it (kernels, engines, torchrun), so an orphan is told from other programs' processes, such as
#: a test suite's other worker (pytest-xdist) whose engines outlive their kernels for a moment.
RUN_MARK = "NBFSDP_BENCH_RUN"


def _orphans(mark: str) -> list[psutil.Process]:
    """Processes this run started (they carry its ``mark``) that outlived their parents (a controller's
    schedulers, a nanny): no longer below this process, so ``children`` misses them. A few seconds' grace
    for those still ending."""
    found = []
    for process in psutil.process_iter(["cmdline", "ppid"]):
        info = process.info
        if info["ppid"] != 1 or (info["cmdline"] or [""])[0] != sys.executable:
            continue
        with contextlib.suppress(psutil.Error):
            if process.environ().get(RUN_MARK) == mark:
                found.append(process)
    return psutil.wait_procs(found, timeout=5)[1]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    chosen = [name for name in RUN_ORDER if not args.only or name in args.only]
    info = machine.info()
    ctx = Context(quick=args.quick)
    results: dict[str, dict] = {}
    timings: dict[str, float] = {}
    started, mark = time.perf_counter(), secrets.token_hex(8)
    os.environ[RUN_MARK] = mark
    try:
        for name in chosen:
            if name not in SHARE_WARM_KERNEL:
                ctx.close_warm_kernel()  # its idle engines would share the cores with what comes next
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            began = time.perf_counter()
            try:
                results[name] = BENCHMARKS[name].run(ctx)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                print(results[name]["error"], file=sys.stderr)
            timings[name] = time.perf_counter() - began
            print(f"[bench] {name}: {timings[name]:.0f} s", file=sys.stderr, flush=True)
    finally:
        ctx.close_warm_kernel()
    children = []
    for process in [*psutil.Process().children(recursive=True), *_orphans(mark)]:
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile is not left over
            children.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
    extra = {
        "quick": args.quick,
        "seconds": {**timings, "total": time.perf_counter() - started},
        "leftover_processes": ctx.leftovers + children,
    }
    ordered = {name: results[name] for name in BENCHMARKS if name in results}
    text = report.write(ordered, info, args.out, extra)
    print(text)
    print(f"[bench] written under {args.out} in {extra['seconds']['total']:.0f} s", file=sys.stderr)
    if extra["leftover_processes"]:
        print(f"[bench] processes left running: {extra['leftover_processes']}", file=sys.stderr)
    return 1 if any("error" in r for r in results.values()) or extra["leftover_processes"] else 0


if __name__ == "__main__":
    sys.exit(main())
