"""Repairs for problems the monitor diagnoses.

``revive_dead_units(model, inputs)`` finds ReLU units that output 0 for every sample of a batch
and re-initialises their incoming weights (Kaiming), so that training can use them again.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["RevivedUnits", "revive_dead_units"]

# Activations whose output is exactly 0 over half their input range: their units can die.
_RELU_TYPES = (nn.ReLU, nn.ReLU6)
# Layers whose output units a following ReLU switches: the weights we re-initialise.
_WEIGHT_TYPES = (nn.Linear, nn.modules.conv._ConvNd)
# Per-channel affine layers that may sit between the weights and the ReLU.
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


@dataclass
class RevivedUnits:
    """What :func:`revive_dead_units` did: per weight layer, (units revived, units in the layer)."""

    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    activations: dict[str, str] = field(default_factory=dict)  # weight layer -> the ReLU that was dead

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.layers.values())

    @property
    def units(self) -> int:
        return sum(u for _, u in self.layers.values())

    def __str__(self) -> str:
        if not self.layers:
            return "no dead units found"
        parts = [f"{name}: {n}/{u}" for name, (n, u) in self.layers.items()]
        return f"revived {self.total} of {self.units} units ({', '.join(parts)})"


def revive_dead_units(
    model: nn.Module,
    inputs: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    layers: list[str] | None = None,
    generator: torch.Generator | None = None,
) -> RevivedUnits:
    """Re-initialise the incoming weights of ReLU units that are dead on ``inputs``.

    A unit is dead when its ReLU outputs 0 for every sample (and position) of the batch: no
    gradient reaches its weights, so training never brings it back. For each such unit the row
    of the Linear/Conv weight feeding it gets fresh Kaiming-normal values and its bias 0; a batch
    or group norm in between gets weight 1 and bias 0 for that channel. With ``optimizer``, the
    unit's optimizer state (momentum, Adam moments) is reset too.

    ``inputs`` is one batch (a tensor, or a tuple/dict of model arguments); it is run through the
    model once without gradients, in the model's current mode, and any buffers the forward pass
    changes (batch-norm running statistics) are restored. ``layers`` limits the repair to these
    weight-layer names. Returns what was revived, per layer.

    Example::

        report = trainguard.fix.revive_dead_units(model, x_batch, optimizer=opt)
        print(report)   # revived 181 of 256 units (0: 92/128, 2: 89/128)
    """
    names = {m: n for n, m in model.named_modules()}
    # id(tensor) -> (weak reference, module that produced it); the reference guards against a
    # freed tensor's id being reused by a tensor a functional op made.
    produced_by: dict[int, tuple[weakref.ref, nn.Module]] = {}
    norm_inputs: dict[int, torch.Tensor] = {}
    dead_at: list[tuple[nn.Module, nn.Module | None, nn.Module, torch.Tensor]] = []

    def producer_of(t: torch.Tensor | None) -> nn.Module | None:
        hit = produced_by.get(id(t)) if t is not None else None
        return hit[1] if hit is not None and hit[0]() is t else None

    def before(module, args):
        if isinstance(module, _NORM_TYPES) and args and isinstance(args[0], torch.Tensor):
            norm_inputs[id(module)] = args[0]

    def after(module, args, output):
        if not isinstance(output, torch.Tensor):
            return
        if not isinstance(module, _RELU_TYPES):
            produced_by[id(output)] = (weakref.ref(output), module)
            return
        producer = producer_of(args[0] if args and isinstance(args[0], torch.Tensor) else None)
        norm = None
        if isinstance(producer, _NORM_TYPES):
            norm = producer
            producer = producer_of(norm_inputs.get(id(norm)))
        if not isinstance(producer, _WEIGHT_TYPES) or output.dim() < 2:
            return
        unit_dim = 1 if isinstance(producer, nn.modules.conv._ConvNd) else output.dim() - 1
        others = tuple(d for d in range(output.dim()) if d != unit_dim)
        dead = ~output.ne(0).any(dim=others)
        dead_at.append((producer, norm, module, dead))

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(before))
        handles.append(m.register_forward_hook(after))
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with torch.no_grad():
            if isinstance(inputs, dict):
                model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
        produced_by.clear()
        norm_inputs.clear()

    report = RevivedUnits()
    seen: set[int] = set()
    for producer, norm, relu, dead in dead_at:
        name = names.get(producer, type(producer).__name__)
        if layers is not None and name not in layers:
            continue
        if id(producer) in seen:
            continue  # a layer feeding several ReLUs: revive once, on its first use
        seen.add(id(producer))
        idx = torch.nonzero(dead, as_tuple=False).flatten().to(producer.weight.device)
        units = int(producer.weight.shape[0])
        if len(idx):
            _reinit_rows(producer, norm, idx, optimizer, generator)
        report.layers[name] = (int(len(idx)), units)
        report.activations[name] = names.get(relu, type(relu).__name__)
    return report


def _reinit_rows(
    layer: nn.Module,
    norm: nn.Module | None,
    idx: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
    generator: torch.Generator | None,
) -> None:
    w = layer.weight
    fan_in = w[0].numel()
    std = math.sqrt(2.0) / math.sqrt(fan_in)  # Kaiming normal, gain sqrt(2) for ReLU
    with torch.no_grad():
        fresh = torch.randn((len(idx),) + tuple(w.shape[1:]), generator=generator, dtype=torch.float32)
        w[idx] = (fresh * std).to(device=w.device, dtype=w.dtype)
        if getattr(layer, "bias", None) is not None:
            layer.bias[idx] = 0
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.dim() == 1:
            if norm.weight.shape[0] == w.shape[0]:
                norm.weight[idx] = 1
                if norm.bias is not None:
                    norm.bias[idx] = 0
    if optimizer is not None:
        params = [layer.weight, getattr(layer, "bias", None)]
        if norm is not None:
            params += [getattr(norm, "weight", None), getattr(norm, "bias", None)]
        for p in params:
            if p is None or p not in optimizer.state:
                continue
            for value in optimizer.state[p].values():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == p.shape[0]:
                    with torch.no_grad():
                        value[idx.to(value.device)] = 0
