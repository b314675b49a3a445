"""A cell never rewrites what the notebook defined (issue 42, point 2): values that come back from the ranks
and refer to the notebook's functions and classes are bound to the notebook's own objects; each class keeps
the methods, ``__module__``, ``__qualname__`` and source compiled from its cell. Before, cloudpickle's load
copied the round-tripped methods onto the notebook's classes (their code then said ``<dynamic-code>``)."""

from __future__ import annotations

import inspect

import pytest

from tests.conftest import run_ok

pytestmark = pytest.mark.timeout(300)

DEFINITIONS = """
import torch, torch.nn as nn
from dataclasses import dataclass, field
from typing import NamedTuple

def helper(x):
    return x + 1

@dataclass(frozen=True)
class Config:
    width: int = 8
    tags: list = field(default_factory=list)

class Point(NamedTuple):
    x: int
    y: int = 0

class Base(nn.Module):
    def describe(self):
        return type(self).__name__

class Layer(Base):
    class Options:
        def kind(self):
            return "options"

    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.width, config.width)

    def forward(self, x):
        return helper(self.linear(x))

class Net(Base):
    layer_cls = Layer          # a class attribute naming another notebook class
    config_cls = Config

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([self.layer_cls(config) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

def make_scale(k):
    def scale(x):
        return k * x
    return scale

scale = make_scale(3)
config = Config(tags=["a"])
"""

#: A cell that defines a function of its own over the notebook's classes (a pasted script's ``main``) and
#: sends back values that refer to every kind of definition.
ROUND_TRIP = """%%fsdp --world-size 2
def main():
    return Net(config).describe(), Point(1, 2), Layer.Options().kind()
made = main()
back = {"config": config, "helper": helper, "Net": Net, "options": Layer.Options(), "point": Point(3),
        "scale": scale, "made_scale": make_scale(5), "Config": Config}
"""

CLASSES = ("Config", "Point", "Base", "Layer", "Net")


def _methods(cls) -> dict[str, object]:
    """Each function of a class (and of its nested classes) by qualified name, with its code object."""
    found = {}
    for name, member in vars(cls).items():
        function = getattr(member, "__func__", member)
        if inspect.isfunction(function):
            found[f"{cls.__qualname__}.{name}"] = function.__code__
        elif inspect.isclass(member) and member.__module__ == "__main__":
            found.update(_methods(member))
    return found


def test_values_from_the_ranks_leave_the_notebooks_definitions_as_compiled(shell):
    run_ok(shell, DEFINITIONS)
    ns = shell.user_ns
    before = {name: (ns[name], ns[name].__module__, ns[name].__qualname__, _methods(ns[name])) for name in CLASSES}
    cell_files = {code.co_filename for _, _, _, codes in before.values() for code in codes.values()}
    scale = ns["scale"]

    run_ok(shell, ROUND_TRIP)
    run_ok(shell, ROUND_TRIP)  # twice: a second round trip finds the classes the first brought back

    for name, (cls, module, qualname, codes) in before.items():
        assert ns[name] is cls and (cls.__module__, cls.__qualname__) == (module, qualname)
        now = _methods(cls)
        assert now.keys() == codes.keys()
        for method, code in codes.items():
            assert now[method] is code, f"{method} was rewritten: {now[method].co_filename}"
    assert all(not f.startswith("<dynamic") for f in cell_files)  # the cells' own files
    assert "return helper(self.linear(x))" in inspect.getsource(ns["Layer"].forward)
    assert "self.layers = nn.ModuleList" in inspect.getsource(ns["Net"].__init__)

    back = ns["back"]
    assert back["config"] == ns["config"] and type(back["config"]) is ns["Config"] and back["Config"] is ns["Config"]
    assert back["helper"] is ns["helper"] and back["Net"] is ns["Net"]
    assert type(back["options"]) is ns["Layer"].Options and type(back["point"]) is ns["Point"]
    assert ns["Net"].layer_cls is ns["Layer"] and ns["Net"].config_cls is ns["Config"]
    assert ns["made"] == ("Net", (1, 2), "options")
    # closures: the notebook's stays as it was; those from the ranks are copies that work
    assert ns["scale"] is scale and scale.__closure__[0].cell_contents == 3 and scale(2) == 6
    assert back["scale"](2) == 6 and back["made_scale"](2) == 10
    # the function the cell defined refers to the notebook's classes, not to copies of them
    assert ns["main"].__globals__["Net"] is ns["Net"] and ns["main"].__globals__["Point"] is ns["Point"]
