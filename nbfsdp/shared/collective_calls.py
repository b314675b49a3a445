"""``torch.distributed``'s collective functions wrapped once per process, for whoever watches them: the ranks'
ledger of collectives (``engines.where``, from a world's set-up on) and the course's ``CollectiveMeter`` (while
it measures). One wrapper for both, so neither wraps the other's wrapper, and a function is never wrapped
twice.

FSDP2, DCP and a cell's own ``dist.all_reduce`` call these functions by their module attribute (``dist``'s or
``distributed_c10d``'s), so the wrapper, put on both, sees them all. Functional collectives (DTensor's
redistributions) go through ``torch.ops`` and are not seen. A collective that calls another (torch 2.13's
``all_gather_into_tensor`` calls ``all_gather_single``) is seen once, as the one called. Runs wherever torch
runs.
"""

from __future__ import annotations

import functools
import threading
from types import CodeType
from typing import Any, Protocol

import torch.distributed as dist

#: The collective functions wrapped (those this torch has).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
)  # fmt: skip


class Watcher(Protocol):
    """What the wrapper tells about each call: ``entered`` before it (what it returns comes back to ``left``),
    ``left`` after it returns or raises. A watcher with an ``issued(token, work)`` method also hears of a call
    made with ``async_op=True``: the ``Work`` it returned, which the caller waits on later (FSDP2's prefetched
    all-gathers on gloo)."""

    def entered(self, name: str, function: Any, args: tuple, kwargs: dict) -> Any: ...

    def left(self, token: Any) -> None: ...


_watchers: list[Watcher] = []
_installed = False
#: ``inside``: this thread is in a wrapped call (one it makes of another collective is not told again).
_calling = threading.local()


def watch(watcher: Watcher) -> None:
    """``watcher`` sees every collective call from now on (the wrapper goes on first where it is not yet)."""
    _install()
    if watcher not in _watchers:
        _watchers.append(watcher)


def unwatch(watcher: Watcher) -> None:
    if watcher in _watchers:
        _watchers.remove(watcher)


def _install() -> None:
    global _installed
    if _installed:
        return
    for name in COLLECTIVES:
        # one wrapper a function, put on each module that has it: torch compares them (P2POp takes only an op that
        # is distributed_c10d's isend or irecv, and torch.distributed.pipelining hands it dist.isend)
        wrappers: dict[int, Any] = {}
        for module in (dist, dist.distributed_c10d):
            function = getattr(module, name, None)
            if function is not None and not getattr(function, "__wrapped_by_nbfsdp__", False):
                if id(function) not in wrappers:
                    wrappers[id(function)] = _wrap(name, function)
                setattr(module, name, wrappers[id(function)])
    _installed = True


def is_wrapper(code: CodeType) -> bool:
    """``code`` is the wrapper's: a frame of it is a collective call under way (``where`` reads the line above)."""
    return code is _wrap_code


def _wrap(name: str, function: Any) -> Any:
    @functools.wraps(function)
    def called(*args: Any, **kwargs: Any) -> Any:
        if getattr(_calling, "inside", False):
            return function(*args, **kwargs)
        _calling.inside = True
        watching = tuple(_watchers)
        tokens: list[Any] = []
        try:
            for watcher in watching:
                tokens.append(watcher.entered(name, function, args, kwargs))
            result = function(*args, **kwargs)
            if isinstance(result, dist.Work):  # async_op=True: it runs on, and is waited on later
                for watcher, token in zip(watching, tokens, strict=True):
                    if (issued := getattr(watcher, "issued", None)) is not None:
                        issued(token, result)
            return result
        finally:
            _calling.inside = False
            for watcher, token in zip(watching, tokens, strict=False):  # those told it began
                watcher.left(token)

    called.__wrapped_by_nbfsdp__ = True  # type: ignore[attr-defined]  # a mark on the function
    return called


#: The code object every wrapper runs.
_wrap_code = _wrap("barrier", lambda: None).__code__
