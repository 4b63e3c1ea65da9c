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

import sys
import types
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from trainguard.resilience._plain import plain_attrs, same_value
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


def warn_unheld(state: TrainState, namespace: dict[str, Any], *, stacklevel: int) -> Still:
    """One warning per object of :func:`unheld`, pointing at the caller ``stacklevel`` frames up.
    Returns the modules without trainable parameters the state does not reach, to check later
    whether they moved (:class:`Still`)."""
    for name, obj in unheld(state, namespace):
        warnings.warn(
            f"{name} ({type(obj).__name__}) has state_dict() and load_state_dict() but is not in the "
            f"TrainState: checkpoints do not save it, a resumed run starts it over, and a guard's rewind "
            f"leaves it as the rewound steps left it (an EMA keeps the weights of a failed step); pass it "
            f"by name, TrainState(..., {name}={name}) or state.{name} = {name}",
            stacklevel=stacklevel + 1)
    frame = sys._getframe(stacklevel)
    return Still(state, namespace, (frame.f_code.co_filename, frame.f_lineno, frame.f_globals))


_SAMPLE = 4096  # elements compared per tensor: an EMA or a running center moves every one of them


def _sample(t: torch.Tensor) -> Any:
    """A copy of the first elements of ``t``, taken through NumPy (no aten op that a recording
    would see) when ``t`` lives on the CPU."""
    flat = t.reshape(-1)[:_SAMPLE] if t.device.type != "cpu" else t
    with torch.no_grad():
        if t.device.type != "cpu":
            flat = flat.detach().cpu()
        if flat.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2) or flat.is_quantized:
            return None  # NumPy has no such dtype: compared by identity alone
        return flat.numpy(force=flat.requires_grad).reshape(-1)[:_SAMPLE].copy()


def _fingerprint(module: torch.nn.Module) -> dict[str, tuple]:
    out = {}
    for key, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and t.numel() and not t.is_sparse:
            out[key] = (t.untyped_storage().data_ptr(), tuple(t.shape), _sample(t))
    return out


def _same(a: tuple, b: tuple) -> bool:
    """Whether a tensor's fingerprint is unchanged: its sampled values when both have them, else its storage."""
    if a[1] != b[1]:
        return False
    if a[2] is None or b[2] is None:
        return a[0] == b[0]
    return a[2].tobytes() == b[2].tobytes()


class Still:
    """Modules without trainable parameters among the locals of the line that started the loop,
    that the state neither holds nor reaches: a frozen VAE or a loss stays as it is, but an EMA
    teacher (DINO's, under ``no_grad`` with ``requires_grad=False``), a momentum encoder or a
    loss's running center (DINOLoss' ``center``) moves, and a resumed run would start it over.
    :meth:`check` warns once about each that changed since the loop started."""

    def __init__(self, state: TrainState, namespace: dict[str, Any], where: tuple[str, int, dict]):
        reached, _ = _reached(state)
        self._where = where
        self._watched: list[tuple[str, weakref.ref, dict[str, tuple]]] = []
        # objects without state_dict() whose attributes are all plain values (Time-Series-Library's
        # EarlyStopping): most never move (a config); one that does is training state, lost on resume
        self._plain: list[tuple[str, weakref.ref, dict[str, Any]]] = []
        ids: set[int] = set()
        for name, obj in namespace.items():
            if not name.startswith("_") and id(obj) not in reached and id(obj) not in ids:
                attrs = plain_attrs(obj)
                if attrs is not None:
                    ids.add(id(obj))
                    try:
                        self._plain.append((name, weakref.ref(obj), dict(attrs)))
                    except TypeError:  # no weak references to it
                        pass
                    continue
            if (name.startswith("_") or not isinstance(obj, torch.nn.Module) or id(obj) in reached
                    or id(obj) in ids or any(p.requires_grad for p in obj.parameters())):
                continue
            ids.add(id(obj))
            try:
                self._watched.append((name, weakref.ref(obj), _fingerprint(obj)))
            except Exception:  # noqa: BLE001 - an odd module's state is no reason to stop training
                continue

    def check(self) -> None:
        self._check_plain()
        still = []
        for name, ref, before in self._watched:
            obj = ref()
            if obj is None:
                continue
            try:
                now = _fingerprint(obj)
            except Exception:  # noqa: BLE001
                continue
            moved = [k for k in before if k in now and not _same(before[k], now[k])]
            if not moved:
                still.append((name, ref, before))
                continue
            bad = [k for k in moved if now[k][2] is not None and now[k][2].dtype.kind in "fc"
                   and not np.isfinite(now[k][2]).all()]
            self._warn(
                f"{name} ({type(obj).__name__}) has no trainable parameters but its state changed since the loop "
                f"started ({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}): moved by hand, as an EMA "
                f"teacher, a momentum encoder or a running center is, and not in the TrainState: checkpoints do "
                f"not save it, a resumed run starts it over, and a guard's rewind leaves it as the rewound steps "
                f"left it{f'; it holds NaN/Inf now ({bad[0]})' if bad else ''}; pass it by name, "
                f"TrainState(..., {name}={name}) or state.{name} = {name}")
        self._watched = still

    def _warn(self, text: str) -> None:
        """A warning pointing at the line that started the loop."""
        filename, lineno, module_globals = self._where
        warnings.warn_explicit(text, UserWarning, filename, lineno, module=module_globals.get("__name__"),
                               registry=module_globals.setdefault("__warningregistry__", {}),
                               module_globals=module_globals)

    def _check_plain(self) -> None:
        still = []
        for name, ref, before in self._plain:
            obj = ref()
            if obj is None:
                continue
            now = vars(obj)
            moved = [k for k in {**before, **now} if k not in before or k not in now
                     or not same_value(before[k], now[k])]
            if not moved:
                still.append((name, ref, before))
                continue
            plain = plain_attrs(obj) is not None
            self._warn(
                f"{name} ({type(obj).__name__}) has no state_dict() but its attributes changed since the loop "
                f"started ({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}) and it is not in the "
                f"TrainState: checkpoints do not save it, a resumed run starts it over (an early stopping's "
                f"counter and best score), and a guard's rewind leaves it as the rewound steps left it; "
                + (f"its attributes are plain values, so the TrainState can hold it: pass it by name, "
                   f"TrainState(..., {name}={name}) or state.{name} = {name}" if plain else
                   "give it state_dict() and load_state_dict() and pass it to the TrainState by name"))
        self._plain = still
