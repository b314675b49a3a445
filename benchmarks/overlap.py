"""overlap: how much of a step's communication compute hides on CPU ranks, by prefetch setting.

The course's 4-block model (blocks of 1024-4096-1024 MLPs, a unit each), fp32, 64 rows a rank, on 2 and 4 CPU
ranks (gloo): each step captured (``--timeline``), and in each captured step the share of the all-gathers' and
reduce-scatters' time in flight that the rank spent computing (``nbfsdp.shared.timeline.exposure``). Three
settings: prefetch off (``--backward-prefetch NONE``), backward (``BACKWARD_PRE``, FSDP2's default) and forward
and backward (``--forward-prefetch``). On gloo FSDP2 issues its gathers synchronously, so before nbfsdp issued them
asynchronously (``torch_private.set_unshard_async_op``) a prefetch hid nothing: 0% whatever the setting (issue 56).
Target: forward and backward hide at least 30 points more than off at world size 2. Medians of the captured steps
after the first two, over rounds that alternate the settings.

Run alone: ``python -m benchmarks --only overlap``.
"""

from __future__ import annotations

import statistics

from benchmarks.context import Context
from benchmarks.measurement import Measurement

NAME = "overlap"
TARGET_POINTS = 30.0
SETTINGS = {
    "off": "--backward-prefetch NONE",
    "backward": "--backward-prefetch BACKWARD_PRE",
    "forward+backward": "--forward-prefetch --backward-prefetch BACKWARD_PRE",
}

_MODEL = """
import torch, torch.nn as nn
class MLPBlock(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
torch.manual_seed(0)
overlap_model = nn.Sequential(*[MLPBlock({width}, {hidden}) for _ in range(4)])
"""
_CELL = """%%fsdp --world-size {ws} --wrap-cls MLPBlock --mixed-precision FULL --no-gather --timeline 0.001 {flags}
opt = torch.optim.SGD(overlap_model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for step in range({steps}):
    loss = overlap_model(torch.randn(64, {width}, generator=g)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
"""
_HIDDEN = """
import json as _json, nbfsdp as _nbfsdp
from nbfsdp.shared.timeline import hidden_percent as _hidden
print(_json.dumps([_hidden(c) for c in _nbfsdp.last_run().timeline if c["forward"] >= 2]))
"""


def run(ctx: Context) -> dict:
    width, hidden, steps = (512, 2048, 5) if ctx.quick else (1024, 4096, 8)
    sizes = (2,) if ctx.quick else (2, 4)
    rounds = ctx.rounds(full=3, quick=1)
    kernel = ctx.warm_kernel()
    kernel.execute("%load_ext nbfsdp\n" + _MODEL.format(width=width, hidden=hidden))
    hidden_by: dict[tuple[int, str], list[float]] = {}
    for ws in sizes:
        kernel.execute(f"%%fsdp --world-size {ws} --no-gather\npass")  # the world up before anything is timed
        for index in range(rounds):
            names = list(SETTINGS) if index % 2 == 0 else list(reversed(SETTINGS))
            for name in names:
                cell = _CELL.format(ws=ws, flags=SETTINGS[name], steps=steps, width=width)
                kernel.execute(cell)
                hidden_by.setdefault((ws, name), []).extend(kernel.execute(_HIDDEN).json())
    rows = []
    for ws in sizes:
        off = statistics.median(hidden_by[ws, "off"])
        both = statistics.median(hidden_by[ws, "forward+backward"])
        back = statistics.median(hidden_by[ws, "backward"])
        rows.append(
            Measurement(
                what=f"CPU ws{ws}: communication hidden behind compute, forward+backward prefetch less off "
                f"(4 blocks of {width}-{hidden}-{width})",
                value=both - off,
                unit="points",
                target=TARGET_POINTS if ws == 2 else None,
                op=">=",
                a_label="off",
                a=off,
                b_label="forward+backward",
                b=both,
                ab_unit="%",
                samples_a=hidden_by[ws, "off"],
                samples_b=hidden_by[ws, "forward+backward"],
                note=f"backward alone (FSDP2's default): {back:.0f}%; captured steps: "
                f"{len(hidden_by[ws, 'off'])} a setting",
            )
        )
    return {"measurements": rows, "hidden_percent": {f"ws{ws} {name}": v for (ws, name), v in hidden_by.items()}}
