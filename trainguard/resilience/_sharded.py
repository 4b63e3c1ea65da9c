"""Sharded (DTensor) state that a fresh object has not created yet: where to load it.

An FSDP2 model's parameters are DTensors, and so is its optimizer's state (Adam's moments) once
a step has run. A freshly built optimizer has no state, so a restore has nothing sharded to load
the moments into: loaded as plain tensors of the full shape, they would meet DTensor parameters
in the next step and fail. A moment of a DTensor parameter with the parameter's shape is loaded
into an empty DTensor laid out like that parameter instead: DCP then reads only this rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.resilience._codec import _segment


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and hasattr(t, "placements")


def sharded_target(objects: dict[str, Any], key: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor | None:
    """An empty DTensor to load the optimizer state tensor ``key`` into, or None when the state
    belongs to no DTensor parameter (or has another shape: a scalar step count)."""
    for name, obj in objects.items():
        prefix = f"{_segment(name)}/state/"
        if isinstance(obj, torch.optim.Optimizer) and key.startswith(prefix):
            pid = key[len(prefix):].split("/", 1)[0]
            param = _params_by_id(obj).get(pid)
            if _is_dtensor(param) and list(param.shape) == list(shape):
                return torch.empty_like(param.detach(), dtype=dtype)
            return None
    return None


def _params_by_id(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameter by the id ``state_dict()`` gives it (its position over the param groups), as the
    id appears in a tensor key."""
    ids = [pid for group in opt.state_dict()["param_groups"] for pid in group["params"]]
    params = [p for group in opt.param_groups for p in group["params"]]
    return {_segment(pid): p for pid, p in zip(ids, params, strict=True)}
