"""Objects with training state of their own that the program holds beside its TrainState.

A checkpoint saves what the ``TrainState`` holds and nothing else, and a guard's rewind puts back
only that. An object the loop moves every step but that the state was not given — diffusers'
``EMAModel`` beside the UNet it averages (``train_unconditional.py --use_ema``), a second
optimizer, an enabled ``GradScaler`` — is lost without a word: a resumed run starts it over, and
after a rewind it keeps what the rewound steps did to it (the EMA absorbs the NaN weights of the
failed step, and the pipeline saved from it is all NaN). :func:`warn_unheld` names such objects
when the loop starts, reading the locals of the frame that starts it.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import torch

from trainguard.resilience._state import TrainState, _stateful

_REACH_LIMIT = 20_000  # objects walked from the state's own: wrappers nest a few levels, never thousands


def _reached(state: TrainState) -> tuple[set[int], set[int]]:
    """Ids of the objects the state holds or reaches through their attributes (accelerate's
    ``AcceleratedOptimizer.optimizer``, a loader's dataset), and of the parameters of its modules."""
    seen: set[int] = set()
    params: set[int] = set()
    todo = list(state._objects.values())
    while todo and len(seen) < _REACH_LIMIT:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                seen.add(id(m))
            params.update(id(p) for p in obj.parameters())
            continue
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
            todo.extend(v for v in vars(obj).values() if not isinstance(v, dict))
    return seen, params


def _keeps_state(obj: Any, reached: set[int], params: set[int]) -> bool:
    if isinstance(obj, (type, types.ModuleType, types.FunctionType)) or not _stateful(obj) or id(obj) in reached:
        return False
    if isinstance(obj, torch.nn.Module):
        # a module without trainable parameters (a loss, a frozen VAE or text encoder) does not move;
        # one whose parameters the state's model holds is that model (accelerator.unwrap_model)
        trainable = [p for p in obj.parameters() if p.requires_grad]
        return any(id(p) not in params for p in trainable)
    enabled = getattr(obj, "is_enabled", None)
    if callable(enabled):  # a disabled GradScaler keeps nothing
        try:
            if not enabled():
                return False
        except Exception:  # noqa: BLE001 - a foreign is_enabled() is no reason to stop training
            pass
    # a wrapper of an object the state holds (the AcceleratedOptimizer around the optimizer passed)
    return not (hasattr(obj, "__dict__") and any(id(v) in reached for v in vars(obj).values()))


def unheld(state: TrainState, namespace: dict[str, Any]) -> list[tuple[str, Any]]:
    """The ``(name, object)`` pairs of ``namespace`` that keep training state of their own
    (``state_dict()`` and ``load_state_dict()``, trainable parameters for a module) that ``state``
    neither holds nor reaches, each object once."""
    reached, params = _reached(state)
    found, ids = [], set()
    for name, obj in namespace.items():
        if name.startswith("_") or id(obj) in ids or obj is state:
            continue
        if _keeps_state(obj, reached, params):
            ids.add(id(obj))
            found.append((name, obj))
    return found


def warn_unheld(state: TrainState, namespace: dict[str, Any], *, stacklevel: int) -> None:
    """One warning per object of :func:`unheld`, pointing at the caller ``stacklevel`` frames up."""
    for name, obj in unheld(state, namespace):
        warnings.warn(
            f"{name} ({type(obj).__name__}) has state_dict() and load_state_dict() but is not in the "
            f"TrainState: checkpoints do not save it, a resumed run starts it over, and a guard's rewind "
            f"leaves it as the rewound steps left it (an EMA keeps the weights of a failed step); pass it "
            f"by name, TrainState(..., {name}={name}) or state.{name} = {name}",
            stacklevel=stacklevel + 1)
