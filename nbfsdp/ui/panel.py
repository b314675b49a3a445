"""``%fsdp panel``: the settings as controls, the defaults of the next ``%%fsdp`` cells.

Beside the controls, the plan ``%fsdp explain`` would print for the chosen
model at those settings, redrawn on every change, so a person sees what a knob
will do before running anything. Explicit flags and ``--config`` still win.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from nbfsdp.shared.config import ConfigError, FSDPConfig, for_device, resolve, validate
from nbfsdp.shared.devices import Devices
from nbfsdp.ui.controls import SettingsControls
from nbfsdp.ui.widget_events import answer_while_cells_run

#: Where the next cells' ranks would run, for (world size, device asked): the session's cluster decides.
DevicesFor = Callable[[int, str | None], Devices]
#: The plan of the panel's model at (settings, world size, devices), as ``%fsdp explain`` prints it.
Explain = Callable[[FSDPConfig, int, Devices], str]


class SettingsPanel:
    """Controls bound to the next cells' defaults (``defaults``, changed through ``change``), and the plan of the
    chosen model under them (``explain``; None where no model was named). The kernel's side is reached only
    through these callables."""

    def __init__(
        self,
        defaults: dict[str, Any],
        change: Callable[[dict[str, Any]], Any],
        devices_for: DevicesFor,
        explain: Explain | None,
        world_size: int,
    ) -> None:
        self._defaults, self._change, self._devices_for, self._explain = defaults, change, devices_for, explain
        self._world_size = world_size
        config = resolve({}, {}, defaults)
        try:
            config = for_device(config, self._devices(config.device))
        except ConfigError:  # a device this machine lacks: the plan says so; the controls still show the rest
            config = for_device(config, Devices("cpu", world_size))
        # the device asked (auto where none is), not the one auto chose: choosing it again would change nothing
        settings = {
            **dataclasses.asdict(config),
            "device": defaults.get("device", "auto"),
            "world_size": world_size,
        }
        self.controls = SettingsControls(settings, self._changed)
        self.plan = widgets.HTML()
        self.box = widgets.VBox([self.controls.box, self.plan])
        answer_while_cells_run(self.controls.widgets.values())
        self._show_plan()

    def _devices(self, device: str | None) -> Devices:
        return self._devices_for(self._world_size, device)

    def _changed(self, change: dict[str, Any]) -> None:
        self._change(change)
        self._world_size = change.get("world_size", self._world_size)
        self._show_plan()

    def _show_plan(self) -> None:
        if self._explain is None:
            self.plan.value = "<i>these settings are the defaults of the next %%fsdp cells</i>"
            return
        config = resolve({}, {}, self._defaults)
        try:
            # quiet: an explicit BACKWARD_POST is said in the plan, not on stderr at every change
            devices = self._devices(config.device)
            config = validate(config, self._world_size, devices, quiet=True)
            text = self._explain(config, self._world_size, devices)
        except ConfigError as error:
            text = f"not valid: {error}"
        self.plan.value = f"<pre>{html.escape(text)}</pre>"
