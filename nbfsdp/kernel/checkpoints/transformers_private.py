"""The private transformers API nbfsdp relies on, in one place (kernel side): building a model class from its
config. ``tests/test_pretrained.py`` builds real models through it, so a transformers release that moves it
fails there, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def config_builder(model_class: Any) -> Callable[[Any], Any] | None:
    """What builds ``model_class`` from a config: an auto class's ``from_config``, else a model class's
    ``_from_config`` (``PreTrainedModel``'s, private: what ``from_config`` calls, and what ``from_pretrained``
    builds with before loading); None for a class that is neither."""
    if hasattr(model_class, "from_config"):
        return model_class.from_config
    return getattr(model_class, "_from_config", None)
