"""What a model's `forward` takes, read from its signature once per model class: the engine's decode step and the
trainer's shared-prefix pass both pass a KV cache, under the name the installed transformers uses."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel


@functools.cache
def forward_parameters(function: Callable[..., Any]) -> frozenset[str]:
    """A function's parameter names, read once per function (a model class's `forward`)."""
    return frozenset(inspect.signature(function).parameters)


def cache_argument(model: PreTrainedModel) -> str | None:
    """The name `model.forward` takes its KV cache by: `cache` since transformers 5.24, `past_key_values` before."""
    params = forward_parameters(type(model).forward)
    return next((name for name in ("cache", "past_key_values") if name in params), None)
