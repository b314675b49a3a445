"""Both clusters are what the session drives: every member of the ``Cluster`` Protocol is on ``FSDPCluster`` and
on ``AttachedCluster`` (``make typecheck`` checks their types; this checks, without mypy, that none is missing).

Data members are set in ``__init__``, so they are read from its source with ``ast``: no cluster is started.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing

import pytest

from nbfsdp.kernel.cluster.attached import AttachedCluster
from nbfsdp.kernel.cluster.local import FSDPCluster
from nbfsdp.kernel.cluster.world import Cluster


def _protocol_members(protocol: type) -> set[str]:
    """The names a Protocol declares: ``typing.get_protocol_members`` (3.13), else its annotations and its
    own methods and properties."""
    get = getattr(typing, "get_protocol_members", None)
    if get is not None:
        return set(get(protocol))
    own = {name for name, value in vars(protocol).items() if callable(value) or isinstance(value, property)}
    return {name for name in {*protocol.__annotations__, *own} if not name.startswith("_")}


def _set_in_init(cls: type) -> set[str]:
    """The ``self.NAME`` that ``cls.__init__`` assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def _missing(cls: type, protocol: type) -> set[str]:
    return {name for name in _protocol_members(protocol) if not hasattr(cls, name) and name not in _set_in_init(cls)}


def test_the_protocol_lists_what_the_session_uses():
    members = _protocol_members(Cluster)
    assert {"world", "background_error", "client", "private_dir", "starting", "ensure_world", "stop"} <= members


@pytest.mark.parametrize("cls", [FSDPCluster, AttachedCluster])
def test_each_cluster_has_every_member_of_the_protocol(cls):
    assert _missing(cls, Cluster) == set()


def test_the_check_sees_a_missing_member():
    class Partial:
        def __init__(self) -> None:
            self.world = None

        def stop(self) -> None: ...

    missing = _missing(Partial, Cluster)
    assert "stop" not in missing and "world" not in missing
    assert {"background_error", "ensure_world", "private_dir"} <= missing
