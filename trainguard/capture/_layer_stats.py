"""Per-layer statistics computed on the tensor's device, as small vectors to be fetched in one batch.

Nothing here reads a value back to the host: every function returns tensors (and the names of
their elements) that the monitor concatenates and copies once per recording step.
"""

from __future__ import annotations

import torch
from torch import nn

# Output of these modules is bounded; a unit is "saturated" when it sits within 1% of a bound,
# where the local derivative is below ~2% of its maximum (tanh'(2.65) = 0.02).
_TANH_LIKE = (nn.Tanh, nn.Hardtanh, nn.Softsign)
_SIGMOID_LIKE = (nn.Sigmoid, nn.Hardsigmoid)
SATURATION_MARGIN = 0.01

# Modules whose output's unit (feature) axis is dim 1 (channels), not the last dim.
_CHANNEL_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
)

# Modules whose output does not change with train/eval mode are not "mode modules".
MODE_MODULES = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)

ACTIVATION_STATS = ("mean", "std", "min", "max", "zero_frac", "dead_frac")
INPUT_STATS = ("mean", "std", "min", "max", "feat_mean_absmax", "feat_std_max", "feat_std_min")


def saturation_kind(module: nn.Module) -> str | None:
    if isinstance(module, _SIGMOID_LIKE):
        return "sigmoid"
    if isinstance(module, _TANH_LIKE):
        return "tanh"
    return None


def is_channel_first(module: nn.Module) -> bool:
    return isinstance(module, _CHANNEL_FIRST)


def is_mode_module(module: nn.Module) -> bool:
    """Modules whose output depends on train/eval mode (dropout with p > 0, batch norm)."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats


def first_tensor(value) -> torch.Tensor | None:
    """The tensor a layer produced: the output itself, or the first tensor of a tuple (LSTM, attention)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
        return None
    data = getattr(value, "data", None)  # PackedSequence
    return data if isinstance(data, torch.Tensor) else None


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _mean_std(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sample std of a 1-D tensor in two passes (sum, then a dot product of the centred values).

    ``torch.std_mean`` is 10-25x slower than this on CPU for activation-sized tensors.
    """
    n = flat.numel()
    mean = flat.sum() / n
    if n < 2:
        return mean, torch.zeros_like(mean)
    c = flat - mean
    return mean, torch.sqrt(torch.dot(c, c) / (n - 1))


def activation_stats(
    x: torch.Tensor, unit_dim: int, prev_dead: torch.Tensor | None, saturation: str | None
) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
    """Stats of one activation: a float32 vector, its element names, and this batch's dead-unit mask.

    A unit (a feature, or a channel for convolutions) is dead when it is zero for every sample and
    position of the batch. ``dead_stay`` is the fraction of the units dead at the previous recording
    step that are still dead now.
    """
    x = _float(x.detach())
    flat = x.reshape(-1)  # a view when contiguous
    n = flat.numel()
    mean, std = _mean_std(flat)
    mn, mx = torch.aminmax(flat)
    a = flat.abs()
    # sign(|x|) is 1 for every nonzero value: float passes, faster than counting a bool mask.
    zero_frac = 1.0 - torch.sign(a).sum() / n
    values = [mean, std, mn, mx, zero_frac]
    names = list(ACTIVATION_STATS[:5])
    dead = None
    if x.dim() >= 2:
        dim = unit_dim % x.dim()
        others = tuple(d for d in range(x.dim()) if d != dim)
        dead = a.view(x.shape).amax(dim=others) == 0
        units = dead.numel()
        values.append(dead.sum(dtype=torch.float32) / units)
        names.append("dead_frac")
        if prev_dead is not None and prev_dead.shape == dead.shape:
            still = (dead & prev_dead).sum(dtype=torch.float32)
            values.append(still / prev_dead.sum(dtype=torch.float32).clamp_min(1.0))
            names.append("dead_stay")
    if saturation == "tanh":
        # Bound of tanh-like outputs is 1 (Hardtanh's default); within 1% of it counts as saturated.
        values.append(a.gt(1.0 - SATURATION_MARGIN).sum(dtype=torch.float32) / n)
        names.append("sat_frac")
    elif saturation == "sigmoid":
        values.append((flat - 0.5).abs().gt(0.5 - SATURATION_MARGIN).sum(dtype=torch.float32) / n)
        names.append("sat_frac")
    vec = torch.stack([v.to(torch.float32) for v in values])
    return vec, names, dead


def input_stats(x: torch.Tensor) -> tuple[torch.Tensor, list[str]] | None:
    """Scale of a model's input: overall and per feature (dim 1: features, or image channels)."""
    if not x.is_floating_point() or x.numel() < 2:
        return None
    x = _float(x.detach())
    flat = x.reshape(-1)
    mean, std = _mean_std(flat)
    mn, mx = torch.aminmax(flat)
    values = [mean, std, mn, mx]
    names = list(INPUT_STATS[:4])
    if x.dim() >= 2 and x.shape[0] > 1:
        others = tuple(d for d in range(x.dim()) if d != 1)
        count = x.numel() // x.shape[1]
        # Per-feature moments from sums (inputs are O(1)..O(1000): float64 keeps E[x^2]-E[x]^2 exact enough).
        s1 = x.sum(dim=others, dtype=torch.float64)
        s2 = x.square().sum(dim=others, dtype=torch.float64)
        fmean = s1 / count
        fstd = torch.sqrt(((s2 - s1 * fmean) / max(count - 1, 1)).clamp_min(0))
        values += [fmean.abs().max(), fstd.max(), fstd.min()]
        names += list(INPUT_STATS[4:])
    return torch.stack([v.to(torch.float32) for v in values]), names


def histogram(x: torch.Tensor, bins: int) -> torch.Tensor:
    """[min, max, count_0 .. count_{bins-1}] over the finite values, without a host sync.

    ``torch.histc`` and ``bincount`` read their range or size back to the host on accelerators;
    a scatter-add into fixed bins does not.
    """
    x = _float(x.detach()).reshape(-1)
    finite = torch.isfinite(x)
    big = torch.finfo(x.dtype).max
    lo = torch.where(finite, x, torch.full_like(x, big)).min()
    hi = torch.where(finite, x, torch.full_like(x, -big)).max()
    width = (hi - lo).clamp_min(torch.finfo(x.dtype).tiny)
    idx = ((x - lo) / width * bins).nan_to_num(0.0, 0.0, 0.0).clamp(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=torch.float32, device=x.device)
    counts.index_add_(0, idx, finite.to(torch.float32))
    return torch.cat([torch.stack([lo, hi]).to(torch.float32), counts])


def grad_stats(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[str], list[torch.Tensor]]:
    """Per gradient: mean |g|, max |g|, L2 norm, NaN/Inf count, as an (n, 4) float32 matrix; and the
    L2 norms themselves (for the global norm, so that it costs no second pass)."""
    l1 = torch._foreach_norm(grads, 1)
    l2 = torch._foreach_norm(grads, 2)
    linf = torch._foreach_norm(grads, float("inf"))
    rows = []
    # g - g is 0 for every finite value and NaN for NaN and +-Inf: one subtraction and a count,
    # several times faster than counting ~isfinite(g).
    bad = [torch.count_nonzero(d) for d in torch._foreach_sub(grads, grads)]
    for g, a, b, c, k in zip(grads, l1, l2, linf, bad):
        rows.append(torch.stack([a.float() / max(g.numel(), 1), c.float(), b.float(), k.float()]))
    return torch.stack(rows), ["mean_abs", "max_abs", "norm", "nonfinite"], list(l2)


def squared_norm_sum(tensors: list[torch.Tensor], norms: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sum of squared L2 norms (for the global gradient norm), on the first tensor's device."""
    if norms is None:
        norms = torch._foreach_norm(tensors, 2)
    dev = norms[0].device
    return torch.stack([n.float().to(dev) for n in norms]).square().sum()
