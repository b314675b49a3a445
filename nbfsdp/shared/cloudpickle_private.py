"""cloudpickle's private reconstructors, for an unpickler that must not let a round trip rewrite the process's
own definitions. The one place nbfsdp reads cloudpickle's internals; ``tests/test_cloudpickle_private.py``
tests each name directly, so a cloudpickle release that renames one fails there first.

cloudpickle writes a class defined in ``__main__`` by value, with a tracker id; unpickled in the process that
defined it, the id finds the original class, and cloudpickle then sets the pickled attributes on it
(``_class_setstate``): methods that made a round trip replace the notebook's own, and their code says
``<dynamic-code>`` (cloudpickle 3.1.3). Functions are not tracked: each unpickle makes a copy.
``OwnDefinitions`` keeps both: a class the process already had is taken as it is, and a function whose code
equals one of the notebook's own (its bytecode, constants, names, first line and qualified name; and that
closes over nothing) is the notebook's object, not a copy.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

from cloudpickle import cloudpickle as _cloudpickle

_Key = tuple[int, str]


def _key(code: types.CodeType) -> _Key:
    """A function's code as it looks after a round trip: cloudpickle writes every code object's file name as
    ``<dynamic-code>``, so a copy is known by its first line, its qualified name and (``==``) its code."""
    return code.co_firstlineno, getattr(code, "co_qualname", code.co_name)


def _functions_in(values: Iterable[Any]) -> Iterable[types.FunctionType]:
    """The functions among ``values``, and those of the classes among them (methods, static and class
    methods, nested classes' too)."""
    classes: list[type] = []
    for value in values:
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type):
            classes.append(value)
    seen: set[int] = set()
    while classes:
        cls = classes.pop()
        if id(cls) in seen or cls.__module__ != "__main__":
            continue
        seen.add(id(cls))
        for member in vars(cls).values():
            member = getattr(member, "__func__", member)
            if isinstance(member, types.FunctionType):
                yield member
            elif isinstance(member, type):
                classes.append(member)


class OwnDefinitions:
    """What one unpickle of a value from the ranks may bind to: the classes this process tracks now, and the
    functions of ``namespace`` (the notebook's)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self._classes = {id(cls) for cls in list(_cloudpickle._DYNAMIC_CLASS_TRACKER_BY_ID.values())}
        self._namespace = namespace
        self._functions: dict[_Key, types.FunctionType] | None = None  # built on the first function met
        self._kept: set[int] = set()  # the originals handed out: their state is not set again

    def reconstructor(self, found: Callable[..., Any]) -> Callable[..., Any]:
        """What an unpickler's ``find_class`` returns for ``found``: cloudpickle's own reconstructor, or one
        that keeps this process's definitions."""
        if found is _cloudpickle._class_setstate:
            return self._class_setstate
        if found is _cloudpickle._make_function:
            return self._make_function
        if found is _cloudpickle._function_setstate:
            return self._function_setstate
        return found

    def _class_setstate(self, cls: type, state: Any) -> type:
        if id(cls) in self._classes:
            return cls  # the notebook's own class: its methods, module and source stay those of its cell
        return _cloudpickle._class_setstate(cls, state)

    def _make_function(self, code: types.CodeType, globals_: dict, name: str, argdefs: Any, closure: Any) -> Any:
        if closure is None:  # a closure's cells are filled later: which of the notebook's it is cannot be told
            if self._functions is None:
                self._functions = {_key(f.__code__): f for f in _functions_in(list(self._namespace.values()))}
            own = self._functions.get(_key(code))
            if own is not None and own.__code__ == code and own.__closure__ is None:
                self._kept.add(id(own))
                return own
        return _cloudpickle._make_function(code, globals_, name, argdefs, closure)

    def _function_setstate(self, function: types.FunctionType, state: Any) -> None:
        if id(function) not in self._kept:
            _cloudpickle._function_setstate(function, state)
