"""Objects that keep training state in plain attributes and have no ``state_dict()``.

Time-Series-Library's ``EarlyStopping`` (utils/tools.py) counts epochs without improvement in
``counter`` and keeps ``best_score``, ``early_stop`` and ``val_loss_min``: numbers and bools, no
``state_dict()``. Left out of the checkpoint, a resumed run starts its patience over and trains
epochs the uninterrupted run never trained. When every instance attribute is a plain value (None, a
bool, an int, a float, a string, a NumPy scalar), the TrainState holds the object through
:class:`PlainAttrs`: saved as JSON in the manifest, never pickled, and set back attribute by attribute.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trainguard._errors import CheckpointError

_PLAIN = (type(None), bool, int, float, str, np.generic)


def plain_attrs(obj: Any) -> dict[str, Any] | None:
    """``vars(obj)`` when ``obj`` is an instance whose attributes are all plain values (at least
    one), else None: classes, modules, functions, tensors, modules of torch, containers and objects
    holding anything else are not."""
    if (isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor, torch.nn.Module,
                         Mapping, list, tuple, set, np.generic)) or callable(getattr(obj, "state_dict", None))):
        return None
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict) or not attrs:
        return None
    return attrs if all(isinstance(v, _PLAIN) and not isinstance(v, np.ndarray) for v in attrs.values()) else None


def same_value(a: Any, b: Any) -> bool:
    """Equal, of the same type, NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, np.floating)) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


class PlainAttrs:
    """The state of an object whose attributes are plain values: those attributes."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        attrs = plain_attrs(self.obj)
        if attrs is None:
            other = {k: type(v).__name__ for k, v in vars(self.obj).items() if not isinstance(v, _PLAIN)}
            raise CheckpointError(
                f"{type(self.obj).__name__} was held by its plain attributes, but now holds {other}: "
                "give it state_dict() and load_state_dict()")
        return dict(attrs)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self.obj, name, value)
