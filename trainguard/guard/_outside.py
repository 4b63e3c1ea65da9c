"""Optimizers that step outside the train state, rewound with it.

pyro's optimizers (``pyro.optim.Adam``, a ``PyroOptim``) hold one torch optimizer per parameter,
made the first time ``svi.step()`` hands that parameter over, inside the step; a ``PyroOptim`` has
no ``state_dict()``, so the user's ``TrainState`` holds the model and the loader only. Such an
optimizer is not in the snapshot: a rewind put the weights back and left its moments as the failing
step made them (NaN), and the replay of the first step made every weight NaN. The guard saw them
step (its sentry reads every optimizer's gradients before ``step()``), so it keeps their state
beside the snapshot: at the snapshot, a copy in host memory; at a rewind, that copy loaded back, or,
for one first seen after the snapshot with no state then (made inside a later step), its state
cleared as it was.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any

import torch

from trainguard.resilience import TrainState
from trainguard.resilience._grads import optimizer_params

log = logging.getLogger("trainguard.guard")


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


class OutsideOptimizers:
    """The state of the optimizers that stepped whose parameters the train state's optimizers do
    not hold, taken with each snapshot and put back with each rewind to it."""

    def __init__(self) -> None:
        self._saved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned: set[int] = set()

    @staticmethod
    def find(state: TrainState, seen: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        held = {id(p) for p in optimizer_params(state)}
        return [o for o in seen if any(id(p) not in held for g in o.param_groups for p in g["params"])]

    def take(self, state: TrainState, seen: list[torch.optim.Optimizer]) -> None:
        self._saved = weakref.WeakKeyDictionary({o: _to_host(o.state_dict()) for o in self.find(state, seen)})

    def restore(self, state: TrainState, seen: list[torch.optim.Optimizer], fresh) -> None:
        """``fresh(o)``: ``o`` had no state when first seen (made after the snapshot, inside a step)."""
        for o in self.find(state, seen):
            saved = self._saved.get(o)
            if saved is not None:
                o.load_state_dict(copy.deepcopy(saved))  # a copy: training must not write into the snapshot
            elif fresh(o):
                o.state.clear()
            elif id(o) not in self._warned:
                self._warned.add(id(o))
                log.warning("trainguard: a %s optimizer outside the TrainState stepped with state it had before "
                            "the guard saw it: a rewind cannot put its state back; give it to TrainState(...)",
                            type(o).__name__)
