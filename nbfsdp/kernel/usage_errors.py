"""Settings errors shown in the notebook as IPython's ``UsageError``: the message alone, no traceback.

The settings rules are shared with the engines (``nbfsdp.shared``), which raise
``ConfigError``, a ``ValueError``: shared code does not depend on IPython. The
kernel's entry points (the magics, ``nbfsdp.explain``) turn it into a
``UsageError`` here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from IPython.core.error import UsageError

from nbfsdp.shared.config import ConfigError

P = ParamSpec("P")
R = TypeVar("R")


def as_usage_errors(function: Callable[P, R]) -> Callable[P, R]:
    """``function``, raising ``UsageError`` where it raised ``ConfigError`` (its attributes, such as a magic's
    argument parser, kept)."""

    @functools.wraps(function)
    def shown(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except ConfigError as error:
            raise UsageError(str(error)) from None

    return shown
