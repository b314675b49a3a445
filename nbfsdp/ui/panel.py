"""``%fsdp panel``: the settings as controls, the defaults of the next ``%%fsdp`` cells.

Beside the controls, the plan ``%fsdp explain`` would print for the chosen
model at those settings, redrawn on every change, so a person sees what a knob
will do before running anything. Explicit flags and ``--config`` still win.
"""

from __future__ import annotations

import dataclasses
import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import torch.nn as nn

from nbfsdp.kernel.planning import plan
from nbfsdp.shared.config import ConfigError, for_device, resolve, validate
from nbfsdp.shared.devices import Devices
from nbfsdp.ui.controls import SettingsControls
from nbfsdp.ui.widget_events import answer_while_cells_run

if TYPE_CHECKING:
    from nbfsdp.kernel.session import Session


class SettingsPanel:
    """Controls bound to the session's defaults, and the plan of ``model`` under them."""

    def __init__(self, session: Session, model: nn.Module | None, world_size: int) -> None:
        self._session = session
        self._model = model
        self._world_size = world_size
        config = resolve({}, {}, session.panel)
        try:
            config = for_device(config, self._devices(config.device))
        except ConfigError:  # a device this machine lacks: the plan says so; the controls still show the rest
            config = for_device(config, Devices("cpu", world_size))
        # the device asked (auto where none is), not the one auto chose: choosing it again would change nothing
        settings = {
            **dataclasses.asdict(config),
            "device": session.panel.get("device", "auto"),
            "world_size": world_size,
        }
        self.controls = SettingsControls(settings, self._changed)
        self.plan = widgets.HTML()
        self.box = widgets.VBox([self.controls.box, self.plan])
        answer_while_cells_run(self.controls.widgets.values())
        self._show_plan()

    def _devices(self, device: str | None) -> Devices:
        """Where the next cells' ranks would run: the session's cluster decides, as for a cell."""
        return self._session.cluster.devices(self._world_size, device, planning=True)

    def _changed(self, change: dict[str, Any]) -> None:
        self._session.change_settings(change)
        self._world_size = change.get("world_size", self._world_size)
        self._show_plan()

    def _show_plan(self) -> None:
        if self._model is None:
            self.plan.value = "<i>these settings are the defaults of the next %%fsdp cells</i>"
            return
        config = resolve({}, {}, self._session.panel)
        try:
            # quiet: an explicit BACKWARD_POST is said in the plan, not on stderr at every change
            devices = self._devices(config.device)
            config = validate(config, self._world_size, devices, quiet=True)
            text = str(plan(self._model, config, self._world_size, devices=devices))
        except ConfigError as error:
            text = f"not valid: {error}"
        self.plan.value = f"<pre>{html.escape(text)}</pre>"
