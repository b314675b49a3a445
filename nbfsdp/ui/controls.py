"""The FSDP settings as widgets, for ``%fsdp panel`` and every cell's dashboard.

Each control reports a person's change through one callback with the
``fsdp_config`` key and the new value; the session decides what it means (the
next cell's defaults, and, while a cell runs, a live change on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
from ipywidgets.widgets.widget_bool import CheckboxStyle
from ipywidgets.widgets.widget_description import DescriptionStyle
from ipywidgets.widgets.widget_string import TextStyle

from nbfsdp.shared.config import BACKWARD_PREFETCHES, DEVICE_CHOICES, MIXED_PRECISIONS, SHARDING_STRATEGIES
from nbfsdp.shared.limits import MAX_WORLD_SIZE

#: A mixed_precision dict (param/reduce/buffer dtypes) is shown as this choice.
CUSTOM_PRECISION = "custom"
#: Each control as wide as its description and value, a gap after it (a checkbox's label otherwise runs on into
#: the next control's), wrapping to the next line where the notebook is narrow.
GAP = "2px 1.2em 2px 0"
_LAYOUT = {"width": "auto", "margin": GAP}
_STYLE = {"description_width": "initial"}
#: A dropdown's width, in em of its font: each letter of its description, each of its longest choice (capitals,
#: wider), and its select's padding, arrow and the gap between the two. Left to "auto", JupyterLab gives the
#: select a fixed 148 px whatever its choices, which cut BACKWARD_POST to "BACKWARD_PO" at its usual width.
DESCRIPTION_EM = 0.6
CHOICE_EM = 0.8
DROPDOWN_PADDING_EM = 3.5

_shared: dict[tuple[Any, ...], widgets.Widget] = {}


def shared(kind: type[widgets.Widget], **traits: Any) -> widgets.Widget:
    """One ``kind`` (a ``Layout`` or a style) of these traits for every widget drawn so, made once per kernel.

    Each layout and style is a widget of its own, its comm opened and its state sent when it is made: given
    as dicts or left to their defaults they were 30 of a dashboard's 47 widgets, made again for every cell.
    Nothing changes one once it is made; one that was closed is made anew."""
    from IPython import get_ipython

    key = (kind, id(getattr(get_ipython(), "kernel", None)), tuple(sorted(traits.items())))
    made = _shared.get(key)
    if made is None or made.comm is None:
        made = _shared[key] = kind(**traits)
    return made


def _dropdown(description: str, options: tuple[str, ...], value: str) -> widgets.Dropdown:
    return widgets.Dropdown(
        options=options,
        value=value,
        description=description,
        layout=shared(widgets.Layout, **{**_LAYOUT, "width": dropdown_width(description, options)}),
        style=shared(DescriptionStyle, **_STYLE),
    )


def dropdown_width(description: str, options: tuple[str, ...]) -> str:
    """Room for the description and every choice in full (``DESCRIPTION_EM``)."""
    longest = max(len(option) for option in options)
    return f"{DESCRIPTION_EM * len(description) + CHOICE_EM * longest + DROPDOWN_PADDING_EM:.1f}em"


def _checkbox(description: str, *, value: bool) -> widgets.Checkbox:
    return widgets.Checkbox(
        value=value,
        description=description,
        indent=False,
        layout=shared(widgets.Layout, **_LAYOUT),
        style=shared(CheckboxStyle),
    )


def size_words(size: int | None) -> str:
    """A memory limit in bytes as the text box shows it: a whole number of GiB, MiB, KiB, GB or MB where it is
    one (it reads back as the same bytes), else bytes; '' for none."""
    if size is None:
        return ""
    for unit, name in ((2**30, "GiB"), (10**9, "GB"), (2**20, "MiB"), (10**6, "MB"), (2**10, "KiB")):
        if size % unit == 0:
            return f"{size // unit}{name}"
    return str(size)


class SettingsControls:
    """Sharding, mixed precision, prefetch, checkpointing, CPU offload, device, memory limit and world size, as
    widgets."""

    def __init__(self, values: dict[str, Any], on_change: Callable[[dict[str, Any]], object]) -> None:
        precision = values["mixed_precision"]
        custom = isinstance(precision, dict)
        # each made with its value (one message to the frontend each, not two), observed after: only a person's
        # changes are reported
        shown = {
            **values,
            "mixed_precision": CUSTOM_PRECISION if custom else precision,
            "memory_limit": size_words(values.get("memory_limit")),
        }
        self.widgets: dict[str, widgets.ValueWidget] = {
            "sharding_strategy": _dropdown("sharding", SHARDING_STRATEGIES, shown["sharding_strategy"]),
            "mixed_precision": _dropdown(
                "mixed precision", (*MIXED_PRECISIONS, *([CUSTOM_PRECISION] * custom)), shown["mixed_precision"]
            ),
            "backward_prefetch": _dropdown("backward prefetch", BACKWARD_PREFETCHES, shown["backward_prefetch"]),
            "forward_prefetch": _checkbox("forward prefetch", value=shown["forward_prefetch"]),
            "activation_checkpointing": _checkbox("activation checkpointing", value=shown["activation_checkpointing"]),
            "cpu_offload": _checkbox("CPU offload", value=shown["cpu_offload"]),
            "device": _dropdown("device", DEVICE_CHOICES, shown["device"]),
            "memory_limit": widgets.Text(
                value=shown["memory_limit"],
                description="memory limit a rank",
                placeholder="none (e.g. 512MiB)",
                continuous_update=False,
                layout=shared(widgets.Layout, width="17em", margin=GAP),
                style=shared(TextStyle, **_STYLE),
            ),
            "world_size": widgets.BoundedIntText(
                value=shown["world_size"],
                min=1,
                max=MAX_WORLD_SIZE,
                description="world size",
                layout=shared(widgets.Layout, width="11em", margin=GAP),
                style=shared(DescriptionStyle, **_STYLE),
            ),
        }
        for key, control in self.widgets.items():
            control.observe(lambda change, key=key: self._changed(key, change["new"]), names="value")
        self._on_change = on_change
        self.box = widgets.HBox(list(self.widgets.values()), layout=shared(widgets.Layout, flex_flow="row wrap"))

    def _changed(self, key: str, value: Any) -> None:
        if key == "memory_limit":  # text: empty is no limit; a size is checked where the change lands
            self._on_change({key: value.strip() or None})
        elif value != CUSTOM_PRECISION:
            self._on_change({key: value})

    def values(self) -> dict[str, Any]:
        return {key: control.value for key, control in self.widgets.items()}
