"""Gradients through a recurrent loop: the gradient norm at each call of a module called many
times in one forward pass (a hand-written RNN cell over the time steps).

On recording steps only, each call's output gets a tensor hook; during the backward pass the hook
keeps the norm of the gradient reaching that call (a 0-d device tensor). When the step ends,
layers called at least ``MIN_CALLS`` times ship the norms in call order, and the host turns them
into ``through_time`` statistics: the number of calls, the gradient norm at the first and at the
last call, and the growth factor per call, ``(first / last) ** (1 / (calls - 1))``: above 1 the
gradient grows going back in time (exploding through time), below 1 it fades (vanishing). Only
the first forward of a step is followed (gradient accumulation runs the loop again). A layer
whose call is differentiated before its next call is no loop: torchdiffeq's ``odeint_adjoint``
calls the dynamics in the backward pass, one vector-Jacobian product per call, going back from
the last time to the first, and each call's gradient is the adjoint at that time, not a gradient
passed on through the calls after it; a damped ODE read as a loop in call order "exploded".
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainguard.capture._layer_stats import first_tensor
from trainguard.capture._monitor_ship import Shipper
from trainguard.capture._monitor_tap import quiet

MIN_CALLS = 4  # fewer calls are a module reused once or twice (tied embeddings), not a loop
MAX_CALLS = 512  # calls followed per layer and step
STATS = ("calls", "grad_first", "grad_last", "growth_per_call")


def _finish(values: list[float]) -> list[float]:
    calls = len(values)
    first, last = values[0], values[-1]
    if first > 0 and last > 0 and math.isfinite(first) and math.isfinite(last):
        growth = (first / last) ** (1.0 / (calls - 1))
    else:
        growth = math.inf if first > 0 and not last > 0 else math.nan
    return [float(calls), first, last, growth]


class TimeWatch:
    def __init__(self, out: Shipper):
        self.out = out
        self._loops: dict[str, int] = {}  # layer -> calls per forward, at the last recording
        self._reset()

    def _reset(self) -> None:
        self._calls: dict[str, int] = {}
        self._norms: dict[str, dict[int, torch.Tensor]] = {}
        self._forwards = 0
        self._graded: set[str] = set()  # layers a gradient reached in this step
        self._unchained: set[str] = set()  # layers called again after that: no loop through time

    def on_root_forward(self) -> None:
        self._forwards += 1

    def on_call(self, layer: str, output: Any, weighted: bool = True) -> bool:
        """A watched layer's forward returned, on a recording step with gradients enabled.

        ``weighted``: the layer holds parameters. Only then are its calls followed through time:
        a parameterless module called several times (an activation reused on several inputs,
        gpytorch's one Softplus behind every constraint) is not a recurrent cell.

        Returns whether this call's output is the one to summarise: the first, or for a layer the
        last recording saw called in a loop, the middle call (the first sees the initial state,
        a zero hidden state that would read as dead units).
        """
        if self._forwards > 1:
            return True
        i = self._calls.get(layer, 0)
        self._calls[layer] = i + 1
        if layer in self._graded:
            self._unchained.add(layer)
        x = first_tensor(output)
        if weighted and i < MAX_CALLS and layer not in self._unchained and x is not None and x.requires_grad and x.is_floating_point():
            x.register_hook(lambda g, layer=layer, i=i: self._grad(layer, i, g))
        return i == self._loops.get(layer, 0) // 2

    def _grad(self, layer: str, i: int, g: torch.Tensor) -> None:
        self._graded.add(layer)
        if self._calls.get(layer, 0) < MIN_CALLS or layer in self._unchained:  # finish() drops its norms
            return
        with quiet(), torch.no_grad():
            self._norms.setdefault(layer, {})[i] = torch.linalg.vector_norm(g.detach().float())

    def finish(self, step: int) -> None:
        """Ship the step's norms of the layers called in a loop; forget the step."""
        if self._calls:
            self._loops = {la: n for la, n in self._calls.items() if n >= MIN_CALLS}
        for layer, norms in self._norms.items():
            if len(norms) < MIN_CALLS or layer in self._unchained:
                continue
            order = sorted(norms)
            with quiet(), torch.no_grad():
                flat = torch.stack([norms[i] for i in order])
            desc = ("l", layer, "through_time", STATS, step, _finish, len(order))
            self.out.stats.append((desc, flat))
        self._reset()
