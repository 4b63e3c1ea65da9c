"""The floor of a model whose output is linear in its parameters: its least-squares fit.

DLinear and NLinear (cure-lab/LTSF-Linear, thuml/Time-Series-Library) are linear maps over time
shared by the channels; they cannot memorise a batch, and ``overfit_one_batch`` stops at a floor
that is no bug. For an MSE, that floor is exact: the outputs are ``J p + c`` for the Jacobian ``J``
of the outputs by the parameters ``p``, and the least loss any parameters reach is a least-squares
problem, solved once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jacrev

# The second difference of the outputs along a parameter direction, relative to the first: float32
# rounding leaves about 1e-6 on a linear map; a ReLU or a product of two weights, far more.
LINEAR_TOL = 1e-4
# Jacobians larger than this many entries (outputs x parameters) are not built: the check is cheap or absent.
MAX_JACOBIAN = 50_000_000


def least_squares_loss(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any) -> float | None:
    """The least a mean-reduced MSE of ``model(inputs)`` against ``targets`` can be over all values
    of the model's trainable parameters, when its output is linear in them; None when it is not,
    or when the loss is no mean MSE, or the Jacobian would be too large or cannot be built."""
    if not (isinstance(loss_fn, nn.MSELoss) and loss_fn.reduction == "mean") or not isinstance(targets, torch.Tensor):
        return None
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in params.values())
    if not params or not targets.is_floating_point() or total * targets.numel() > MAX_JACOBIAN:
        return None
    names = list(params)
    shapes = [params[n].shape for n in names]
    flat0 = torch.cat([params[n].reshape(-1) for n in names])

    def out(flat: torch.Tensor) -> torch.Tensor:
        parts = torch.split(flat, [math.prod(s) for s in shapes])
        y = functional_call(model, {n: v.reshape(s) for n, v, s in zip(names, parts, shapes)}, (inputs,))
        return y.reshape(-1)

    try:
        with torch.no_grad():
            g = torch.Generator(device="cpu").manual_seed(0)
            d = torch.randn(flat0.shape, generator=g).to(flat0) * (flat0.abs().mean() + 1e-3)
            f0, f1, f2 = out(flat0), out(flat0 + d), out(flat0 + 2 * d)
            if f0.shape != targets.reshape(-1).shape:
                return None
            first = float((f1 - f0).norm())
            if not first > 0 or float((f2 - 2 * f1 + f0).norm()) > LINEAR_TOL * first:
                return None
            c = out(torch.zeros_like(flat0))
        with torch.enable_grad():
            jac = jacrev(out)(flat0).detach()
        rhs = (targets.reshape(-1) - c).double()
        sol = torch.linalg.lstsq(jac.double(), rhs[:, None], driver="gelsd").solution
        res = float(((jac.double() @ sol)[:, 0] - rhs).pow(2).mean())
    except Exception:  # noqa: BLE001 - a forward functional_call or vmap cannot run (in-place ops, hooks): no floor to tell
        return None
    return res if math.isfinite(res) else None
