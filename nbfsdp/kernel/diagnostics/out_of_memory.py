"""The report of a cell whose rank ran out of memory: what each rank held, what the planner says it holds at
that moment, and the settings that fit, each traced by the planner before it is offered. Runs in the kernel.

The ranks send their bytes by category where they stopped and the shapes the failed rank's model was last
called with (``nbfsdp.engines.memory_limit``). The planner (``%fsdp explain``'s trace on the meta device)
runs the same step with that batch and stops where its bytes first pass the limit: the two columns then
describe the same moment, category by category. Its search (``--suggest``) lists the changes that fit; on
CPU ranks, whose limit is nbfsdp's exact accounting, only those whose traced peak stays under ``MARGIN`` of
the limit are offered, so the planner's few percent of error cannot make a fix fail again.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from nbfsdp.kernel.cluster.rank_calls import RankOutOfMemory
from nbfsdp.kernel.planning import peak
from nbfsdp.kernel.planning.fitting import DeviceMemory
from nbfsdp.kernel.planning.plans import StepTrace, plan
from nbfsdp.kernel.planning.predicted import workload_of_call
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices

#: An offered fix's traced peak stays under this share of a CPU rank's ``--memory-limit``.
MARGIN = 0.9
#: The search for fixes makes at most this many recordings of the step (the asked settings', then the changes
#: that need one: checkpointing every block, every 2nd, attention alone, PURE); changes a recording replays
#: (sharding, offload) are tried too, the rest left untried. A budget of work, not of seconds, so that the report
#: offers the same fixes on any machine: one recording of a 124M GPT-2 takes about half a second, so the report
#: comes within the 5 s it is due in (``%fsdp explain --suggest`` tries every change).
SEARCH_RECORDINGS = 5
#: How a change of settings is pasted: each fsdp_config key's flag (None: not a flag, said in words).
_FLAGS = {
    "activation_checkpointing": lambda value: "--activation-checkpointing",
    "checkpoint_every": lambda value: f"--checkpoint-every {value}",
    "checkpoint_scope": lambda value: f"--checkpoint-scope {value}",
    "cpu_offload": lambda value: "--cpu-offload",
    "mixed_precision": lambda value: f"--mixed-precision {value}",
    "sharding_strategy": lambda value: f"--sharding-strategy {value}",
    "replicas": lambda value: f"--replicas {value}",
    "world_size": lambda value: f"--world-size {value}",
}


def explain(
    error: RankOutOfMemory, models: dict[str, nn.Module], config: FSDPConfig, world_size: int, devices: Devices
) -> dict[str, Any]:
    """The report of ``error`` (also set as its ``report``, which the notebook shows): the measured bytes
    beside the planner's for the cell's first model, and the fixes that fit."""
    failed = next(
        (
            rank
            for rank in sorted(error.memories, key=lambda r: r != error.rank)
            if error.memories[rank]["out_of_memory"]
        ),
    )
    memory = error.memories[failed]
    limit: int = memory["limit"]
    report: dict[str, Any] = {
        "rank": failed,
        "limit": limit,
        "doing": memory["doing"],
        "measured": {rank: m["at_failure"] for rank, m in error.memories.items()},
        "planned": None,
        "planned_at": "",
        "planned_peak": None,
        "fixes": [],
    }
    model = next(iter(models.values()), None)
    workload = workload_of_call(memory.get("batch"))
    if model is not None and workload is not None:
        try:
            report.update(_planned(model, config, world_size, devices, workload, memory=memory))
        except Exception as failure:  # the measured side still stands: say why the planner's is missing
            report["planner_error"] = f"{type(failure).__name__}: {failure}"
    report["text"] = error.report = _text(report, devices)
    return report


def _planned(
    model: nn.Module,
    config: FSDPConfig,
    world_size: int,
    devices: Devices,
    workload: peak.Workload,
    *,
    memory: dict[str, Any],
) -> dict[str, Any]:
    """The planner's side, of the failed rank's ``memory``: its bytes where the step passes the rank's limit, the
    step's peak, the fixes that fit."""
    limit: int = memory["limit"]
    first_step = memory["at_failure"]["optim"] == 0  # no optimizer state yet: the failure is in the first step
    cache = peak.TraceCache(most=SEARCH_RECORDINGS)  # the crossing's recording is the asked plan's too
    failure = peak.Failure(limit=limit, first_step=first_step)
    crossed = peak.crossing(model, config, devices, workload, failure, cache=cache)
    share = MARGIN if devices.type == "cpu" else None
    limited = DeviceMemory(f"{size_text(limit)} a rank", limit, step_share=share)
    trace = StepTrace(workload=workload, memory=limited, suggest=True, cache=cache)
    planned = plan(model, config, world_size, devices=devices, trace=trace)
    return {
        "untried": planned.untried,
        "planned": crossed.as_dict() if crossed is not None else None,
        "planned_at": crossed.at if crossed is not None else "",
        "planned_peak": max(r["total"] for r in planned.peak),
        "batch": planned.batch,
        "fixes": [
            {"flags": fix_flags(s.change_settings), "change": s.change, "peak": max(r["total"] for r in s.peak)}
            for s in planned.suggestions
        ],
    }


def fix_flags(settings: dict[str, Any]) -> str:
    """A change as what to add to the ``%%fsdp`` line; micro-batches are the cell's own loop, said in words."""
    flags = [_FLAGS[key](value) for key, value in settings.items() if key in _FLAGS]
    micro = settings.get("micro_batches")
    if micro:
        flags.append(f"(in the cell: each step's batch in {micro} micro-batches, loss / {micro}, one step after)")
    return " ".join(flags)


def _text(report: dict[str, Any], devices: Devices) -> str:
    limit = report["limit"]
    what = "--memory-limit" if devices.type == "cpu" else "its share of the GPU"
    lines = [f"nbfsdp: rank {report['rank']} ran out of memory ({what}: {size_text(limit)}) at {report['doing']}."]
    measured = report["measured"]
    planned = report["planned"]
    header = "".join(f"{f'rank {rank}':>12}" for rank in measured)
    lines.append(
        f"  {'bytes a rank':<14}{header}{'planned':>12}   (measured where each rank stopped; planned: "
        "the planner's trace where the step passes the limit)"
    )
    for key in (*peak.CATEGORIES, "total"):
        row = "".join(f"{size_text(sum(m.values()) if key == 'total' else m[key]):>12}" for m in measured.values())
        plan_cell = size_text(planned[key]) if planned is not None else "-"
        lines.append(f"  {key:<14}{row}{plan_cell:>12}")
    if report["planned_peak"] is not None:
        where = f", passing the limit at {report['planned_at']}" if planned is not None else ""
        lines.append(
            f"The planner: the whole step peaks at {size_text(report['planned_peak'])} a rank "
            f"({report['planned_peak'] / limit:.1f}x the limit{where}), traced with the batch rank "
            f"{report['rank']} ran: {report['batch']}."
        )
    if report["fixes"]:
        share = f"under {MARGIN:.0%} of the limit" if devices.type == "cpu" else "within the GPU's share"
        lines.append(f"These fit ({share}, each traced by the planner; add to the %%fsdp line):")
        for fix in report["fixes"]:
            lines.append(f"  {fix['flags']:<60} peak {size_text(fix['peak'])}   {fix['change']}")
    if report.get("untried"):
        lines.append(
            f"({report['untried']} more changes were not tried: the report traces the step at most "
            f"{SEARCH_RECORDINGS} ways; %fsdp explain --batch ... --suggest tries them all)"
        )
    if "planner_error" in report:
        lines.append(f"The planner could not trace this step: {report['planner_error']}")
    elif not report["fixes"] and report["planned_peak"] is not None and not report.get("untried"):
        lines.append("No setting the planner tries fits: a larger --memory-limit, or a smaller batch or model.")
    lines.append("The world is torn down; the next cell starts a fresh one on the same engines.")
    return "\n".join(lines)
