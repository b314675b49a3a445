"""where-ledger: what ``%fsdp where``'s ledger of collectives (``nbfsdp.engines.where``) costs a step.

Every engine wraps ``torch.distributed``'s collective functions so that ``%fsdp where`` and ``--hang-report`` can
say which collective each rank waits in and which line issued it: Python work per collective on the step path.
Here the GPT-2 loop (``benchmarks/gpt2_loop.py``, FSDP2 over each ``GPT2Block`` and the root) runs under torchrun
on 2 CPU ranks with the ledger as an engine has it (``where.watch``: the wrappers and the watcher thread). The
model has GPT-2's 12 blocks, so a step issues the 124M model's collectives (38 at world size 2), at a size the
CPU steps through in about a tenth of a second, as a GPU steps through the 124M model (61.7 to 105 ms,
docs/guide/gpus.md). Two figures:

- the ledger's own time a step against the step (target: at most 1%): a few rounds with a clock around the
  ledger's work in each wrapper (its entry, and its exit after the collective returns), per step;
- the whole loop with the wrappers on (B) and taken off again (A, the watcher thread still running), a round
  each in the order A B, B A, ... in the same processes: the median step's overhead, with its interval over the
  rounds. It includes what the clock cannot see (the wrapper's call itself, caches), but the 2 shared cores
  spread single rounds by several percent, so it is reported without a target.

Run alone: ``python -m benchmarks --only where_ledger --out benchmarks/results/where_ledger``.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import gpt2_loop, launch
from benchmarks.context import Context
from benchmarks.measurement import Measurement, in_turn, median

NAME = "where_ledger"
TARGET_PERCENT = 1.0
WORLD_SIZE = 2
#: GPT-2's 12 blocks (13 FSDP units: the 124M model's collectives a step), small enough for a CPU step of about a
#: tenth of a second; a round is one run of the loop, its first steps (AdamW made anew, its state) left out.
CPU_SIZES = gpt2_loop.Sizes(layers=12, width=64, heads=2, batch=2, sequence=32, steps=14, warmup=4)
QUICK_SIZES = dataclasses.replace(gpt2_loop.QUICK, steps=6, warmup=2)


def overhead_percent(off: list[float], on: list[float]) -> float:
    """What the ledger adds, in percent of the step, from rounds' median steps without and with it."""
    return (statistics.median(on) / statistics.median(off) - 1) * 100


def run(ctx: Context) -> dict:
    sizes = QUICK_SIZES if ctx.quick else CPU_SIZES
    rounds, timed_rounds = ctx.rounds(full=30, quick=2), ctx.rounds(full=4, quick=1)
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-where-") as tmp:
        config, out = Path(tmp, "config.json"), Path(tmp, "out.json")
        config.write_text(json.dumps({**sizes.as_dict(), "rounds": rounds, "timed_rounds": timed_rounds}))
        launch.torchrun_again_on_abort(
            WORLD_SIZE, "benchmarks.where_ledger", [str(config), str(out)], cpu_only=True, timeout=1800
        )
        result = json.loads(out.read_text())
    off, on = result["median_step_ms"]["off"], result["median_step_ms"]["on"]
    per_round = [overhead_percent([a], [b]) for a, b in zip(off, on, strict=True)]
    ledger_ms, collectives = result["ledger_us_per_step"] / 1000, result["collectives_per_step"]
    step_ms = statistics.median(off)
    rows = [
        Measurement(
            what=f"CPU ws{WORLD_SIZE}: %fsdp where's ledger, its own time in a GPT-2 loop step ({sizes.layers} blocks)",
            value=ledger_ms / step_ms * 100,
            unit="%",
            target=TARGET_PERCENT,
            op="<=",
            a_label="step",
            a=step_ms,
            b_label="ledger",
            b=ledger_ms,
            ab_unit="ms",
            note=(
                f"{collectives:g} collectives a step, {ledger_ms * 1000 / collectives:.1f} us of the ledger's each "
                f"(timed over {timed_rounds} rounds)"
            ),
        ),
        Measurement.compared(
            f"CPU ws{WORLD_SIZE}: the GPT-2 loop, the ledger's wrappers on vs off, overhead of the median step",
            overhead_percent,
            ("ledger off", off),
            ("ledger on", on),
            unit="%",
            ab_unit="ms",
            samples_value=per_round,
            note=(
                f"no target: rounds spread too widely here to resolve 1% (per round {min(per_round):+.2f} to "
                f"{max(per_round):+.2f}%, median {median(per_round):+.2f}%); the row above is the judged figure"
            ),
        ),
    ]
    return {
        "measurements": rows,
        "rounds": rounds,
        "timed_rounds": timed_rounds,
        "world_size": WORLD_SIZE,
        "sizes": sizes.as_dict(),
        "median_step_ms": result["median_step_ms"],
        "collectives_per_step": collectives,
        "ledger_us_per_step": result["ledger_us_per_step"],
        "losses": result["losses"],
    }


def _wrappers() -> list[tuple[Any, str, Any, Any]]:
    """Each collective function the ledger watches (``collective_calls``' one wrapper): its module, its name, the
    function and the wrapper."""
    import torch.distributed as dist

    from nbfsdp.shared import collective_calls

    found = []
    for name in collective_calls.COLLECTIVES:
        for module in (dist, dist.distributed_c10d):
            wrapper = getattr(module, name, None)
            if getattr(wrapper, "__wrapped_by_nbfsdp__", False):
                found.append((module, name, wrapper.__wrapped__, wrapper))
    return found


class Timed:
    """The ledger's wrappers with a clock around the ledger's own work (its entry, and its exit after the
    collective): what it costs each collective, without the collective's own time in the sum."""

    def __init__(self) -> None:
        self.ns = 0

    def wrap(self, name: str, function: Any) -> Any:
        from nbfsdp.engines import where

        ledger = where.ledger

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            entry = ledger.entered(name, function, args, kwargs)
            entered = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                returned = time.perf_counter_ns()
                ledger.left(entry)
                self.ns += entered - started + time.perf_counter_ns() - returned

        return timed


def main(config_path: str, out_path: str) -> None:
    """A torchrun process: the loop in rounds, the ledger's wrappers on and off in turn, then timed."""
    import torch.distributed as dist

    from nbfsdp.engines import where

    config = json.loads(Path(config_path).read_text())
    rounds, timed_rounds = config.pop("rounds"), config.pop("timed_rounds")
    sizes = gpt2_loop.Sizes(**config)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(gpt2_loop.constants(sizes) + gpt2_loop.SETUP_SOURCE, "<setup>", "exec"), namespace)
    device, _ = gpt2_loop.sharded(namespace["model"], "cpu")
    namespace.update(device=device, LOG_EACH_STEP=False)
    loop = compile(gpt2_loop.LOOP_SOURCE, "<loop>", "exec")
    medians: dict[str, list[float]] = {"off": [], "on": []}
    counted, steps_on, losses = 0, 0, []
    timer = Timed()
    with tempfile.TemporaryDirectory(prefix="nbfsdp-bench-where-watched-") as watched:
        where.watch(watched, dist.get_rank())  # as engine.setup: the wrappers and the watcher thread
        wrappers = _wrappers()
        timers = [(module, name, timer.wrap(name, function)) for module, name, function, _ in wrappers]
        sides = [side for index in range(rounds) for side in in_turn("off", "on", index)]
        for side in sides + ["timed"] * timed_rounds:
            for (module, name, function, wrapper), (_, _, timed) in zip(wrappers, timers, strict=True):
                setattr(module, name, {"off": function, "on": wrapper, "timed": timed}[side])
            before = sum(where.ledger.counts.values())
            exec(loop, namespace)
            losses.append(namespace["losses"])
            if side in medians:
                medians[side].append(statistics.median(namespace["step_times"][sizes.warmup :]) * 1000)
            if side == "on":
                counted += sum(where.ledger.counts.values()) - before
                steps_on += len(namespace["step_times"])
        for module, name, _, wrapper in wrappers:
            setattr(module, name, wrapper)
        where.watch(None, dist.get_rank())
    if dist.get_rank() == 0:
        result = {
            "median_step_ms": medians,
            "collectives_per_step": counted / steps_on,
            "ledger_us_per_step": timer.ns / 1000 / (timed_rounds * sizes.steps),
            "losses": losses,
        }
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
