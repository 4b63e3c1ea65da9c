"""Gradients an optimizer has not applied yet: a window of gradient accumulation under way.

A loop that accumulates gradients over K micro-batches (``accelerator.accumulate``, Fabric's
``no_backward_sync``, ``if (step + 1) % K == 0: opt.step()``) ends most of its steps with
gradients in ``.grad`` that the next optimizer step needs. A checkpoint holds no gradients, so
one taken there would resume with the window's first micro-batches lost; the loop saves at the
next step whose optimizer stepped instead, and the guard's snapshot keeps them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from trainguard.resilience._state import TrainState


def is_accelerator(obj: Any) -> bool:
    """accelerate's ``Accelerator`` (duck-typed: trainguard does not import accelerate)."""
    return (type(obj).__name__ == "Accelerator" and hasattr(obj, "gradient_state")
            and isinstance(getattr(obj, "step", None), int))


class AcceleratorCount:
    """What of an ``Accelerator`` a train state holds: its count of micro-batches.

    ``accelerator.accumulate(model)`` steps the optimizer when ``accelerator.step`` reaches a
    multiple of ``gradient_accumulation_steps``; the count is in no ``state_dict()``. Saved and
    restored with the state (as ``accelerator.save_state`` does), a rewind to the middle of a
    window continues that window instead of starting one shifted by the micro-batches rewound.
    """

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def optimizer_params(state: TrainState) -> Iterator[torch.Tensor]:
    """Every parameter of the state's optimizers, once each."""
    seen: set[int] = set()
    for _, obj in state.items():
        groups = getattr(obj, "param_groups", None)
        if not isinstance(obj, torch.optim.Optimizer) and not isinstance(groups, list):
            continue  # accelerate's AcceleratedOptimizer and Fabric's wrapper pass param_groups through
        for group in groups or ():
            for p in group.get("params", ()) if isinstance(group, dict) else ():
                if isinstance(p, torch.Tensor) and id(p) not in seen:
                    seen.add(id(p))
                    yield p


class StepWatch:
    """Counts ``optimizer.step()`` calls (any optimizer's, through torch's global hook) while open.

    ``pending(state)`` at a step boundary: no optimizer stepped since the previous boundary and
    a parameter of the state's optimizers holds a gradient, i.e. gradients wait for a later step.
    """

    def __init__(self) -> None:
        self._handle: Any = None
        self._stepped = False

    def open(self) -> None:
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._on_step)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True

    def pending(self, state: TrainState) -> bool:
        stepped, self._stepped = self._stepped, False
        return not stepped and any(p.grad is not None for p in optimizer_params(state))
