"""Per-layer statistics computed on the tensor's device, as small vectors to be fetched in one batch.

Nothing here reads a value back to the host: every function returns tensors (and the names of
their elements) that the monitor concatenates and copies once per recording step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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

# Activations up to this many elements (1 MB of float32) are summarised with full-size temporaries.
_SMALL = 1 << 18

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


def layer_output(value) -> torch.Tensor | None:
    """The tensor a layer's output statistics describe: ``first_tensor``, skipping 0-d tensors
    before a tensor with elements to spread over: a quantizer returns ``(loss, quantized, ...)``
    (zalandoresearch/pytorch-vq-vae), and the loss is no activation. A layer that returns only a
    scalar (a criterion inside the model) is measured by it."""
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return v
    return first_tensor(value)


def first_tensor(value) -> torch.Tensor | None:
    """The tensor a layer produced: the output itself, or the first tensor of a tuple (LSTM, attention);
    a PackedSequence's data, also first in a tuple (a packed LSTM's ``(PackedSequence, (h, c))``)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
        head = value[0] if value else None
        if isinstance(head, tuple) and isinstance(getattr(head, "data", None), torch.Tensor):
            return head.data  # PackedSequence (a named tuple)
        return None
    data = getattr(value, "data", None)  # PackedSequence
    return data if isinstance(data, torch.Tensor) else None


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def activation_stats(
    x: torch.Tensor, unit_dim: int, prev_dead: torch.Tensor | None, saturation: str | None
) -> tuple[torch.Tensor, list[str], torch.Tensor | None, Callable[[list[float]], list[float]]]:
    """Stats of one activation, as raw sums to ship and the host-side step that finishes them.

    Returns (raw vector on the device, the names of the finished stats, this batch's dead-unit
    mask, ``finish(raw_values) -> stat values``). Counts are divided on the host: fewer small ops
    on the device, where each costs a dispatch. A unit (a feature, or a channel for convolutions)
    is dead when it is zero for every sample and position of the batch; ``dead_stay`` is the
    fraction of the units dead at the previous recording that are still dead now; ``dead_rows``
    the number of values (samples x positions) each unit had to be zero on.
    """
    x = _float(x.detach())
    flat = x.reshape(-1)  # a view when contiguous
    n = flat.numel()
    dt = x.dtype
    total = flat.sum()
    mean = total / n
    mn, mx = torch.aminmax(flat)
    dim = unit_dim % x.dim() if x.dim() >= 2 else None
    others = tuple(d for d in range(x.dim()) if d != dim)
    # Centred squares, |x| and sign(|x|) are fast float passes, but each needs a temporary as large
    # as its input, and on CPU a fresh buffer above ~1 MB is mapped page by page. Large activations
    # are therefore summarised in slices of at most _SMALL elements along the batch dimension.
    step = n if n <= _SMALL or dim == 0 else max(1, _SMALL // max(1, n // x.shape[0]))
    centred_sq = nonzero = unit_max = None
    for part in (x,) if x.dim() < 2 or step >= x.shape[0] else x.split(step, dim=0):
        pf = part.reshape(-1)
        c = pf - mean
        sq = torch.dot(c, c)
        a = pf.abs()
        nz = torch.sign(a).sum()
        centred_sq = sq if centred_sq is None else centred_sq + sq
        nonzero = nz if nonzero is None else nonzero + nz
        if dim is not None:
            m = a.view(part.shape).amax(dim=others)
            unit_max = m if unit_max is None else torch.maximum(unit_max, m)
        del c, a
    raw = [total, centred_sq, mn, mx, nonzero]
    names = list(ACTIVATION_STATS[:5])
    dead = None
    units = 1
    stay = False
    if dim is not None:
        dead = unit_max == 0
        units = dead.numel()
        raw.append(dead.sum(dtype=dt))
        names.append("dead_frac")
        if prev_dead is not None and prev_dead.shape == dead.shape:
            raw += [(dead & prev_dead).sum(dtype=dt), prev_dead.sum(dtype=dt)]
            names.append("dead_stay")
            stay = True
        names.append("dead_rows")  # how many values each unit had to be 0 on (known here: no device work)
    if saturation == "tanh":
        # Bound of tanh-like outputs is 1 (Hardtanh's default); within 1% of it counts as saturated.
        bound = 1.0 - SATURATION_MARGIN
        raw.append((flat.gt(bound) | flat.lt(-bound)).sum(dtype=dt))
        names.append("sat_frac")
    elif saturation == "sigmoid":
        raw.append((flat.gt(1.0 - SATURATION_MARGIN) | flat.lt(SATURATION_MARGIN)).sum(dtype=dt))
        names.append("sat_frac")
    # A [rows, units] output (an embedding, a projector's or a head's output): how much its rows
    # differ, per unit, pooled over the units. Near 0 when every input gets the same output (a
    # self-supervised representation collapse), whatever the spread of the values within a row.
    # One pass more (the unit means), no temporary as large as x: the squares about each unit's mean
    # are those about the overall mean less rows x the squared distance of the unit means from it,
    # which resolves rows 1,000x closer than the values are spread (the rule asks 10x).
    rows = x.shape[0] if x.dim() == 2 and dim == 1 else 0
    if rows > 1:
        d = x.sum(dim=0) / rows - mean
        raw.append(centred_sq - rows * torch.dot(d, d))
        names.append("row_std")
    has_dead = dead is not None
    has_sat = saturation is not None

    def finish(v: list[float]) -> list[float]:
        # One value (a one-unit head run on one sample) has no spread to measure: NaN, not 0.
        out = [v[0] / n, math.sqrt(max(v[1], 0.0) / (n - 1)) if n > 1 else math.nan, v[2], v[3], 1.0 - v[4] / n]
        i = 5
        if has_dead:
            out.append(v[i] / units)
            i += 1
            if stay:
                out.append(v[i] / max(v[i + 1], 1.0))
                i += 2
            out.append(n / units)
        if has_sat:
            out.append(v[i] / n)
            i += 1
        if rows > 1:
            out.append(math.sqrt(max(v[i], 0.0) / ((rows - 1) * (n // rows))))
        return out

    return torch.stack(raw), names, dead, finish


# Rows (positions: every index but the unit axis) hashed per output for ``count_codes``: a quantizer
# that uses 1-2 codes shows in a few hundred rows as plainly as in all of them, at a fixed cost.
CODE_ROWS = 256
# Hashes closer than this (relative to the largest) are one row: a straight-through estimator's
# ``z + (q - z)`` rounds a code by ~1e-7 of |z|, which may be 100x the code's own size.
CODE_TOLERANCE = 1e-3
_hash_vectors: dict[tuple, torch.Tensor] = {}


def _hash_vector(units: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # A fixed vector of no RNG (the user's random stream stays untouched): cosines of a golden angle.
    key = (units, device, dtype)
    v = _hash_vectors.get(key)
    if v is None:
        if len(_hash_vectors) > 64:
            _hash_vectors.clear()
        i = torch.arange(units, dtype=torch.float64)
        v = torch.stack([torch.cos(i * 2.399963229728653 + 0.5), torch.cos(i * 1.324717957244746 + 1.5)], 1)
        v = v.to(device, dtype)
        _hash_vectors[key] = v
    return v


def row_hashes(x: torch.Tensor, unit_dim: int) -> torch.Tensor | None:
    """Up to ``CODE_ROWS`` rows of an output (vectors along the unit axis, one per sample and
    position), each projected onto two fixed vectors: ``[rows, 2]``, for :func:`count_codes`. One
    small matrix product per layer; the counting is batched over the layers of a step."""
    if (type(x) is not torch.Tensor or x.layout != torch.strided or x.is_nested or not x.is_floating_point()
            or x.dim() < 2 or not x.numel()):
        return None  # a sparse input (a GCN's features), a subclass (DTensor): not hashed
    x = x.detach()
    dim = unit_dim % x.dim()
    if dim == 0:
        return None
    units = x.shape[dim]
    rows = x.numel() // units
    if rows < 2:
        return None
    per = max(1, rows // x.shape[0])
    flat = _float(x[: min(x.shape[0], -(-CODE_ROWS // per))]).movedim(dim, -1).reshape(-1, units)
    if flat.shape[0] > CODE_ROWS:
        flat = flat[:: flat.shape[0] // CODE_ROWS][:CODE_ROWS]
    return flat @ _hash_vector(units, flat.device, flat.dtype)


def count_codes(hashes: list[torch.Tensor]) -> torch.Tensor:
    """For each ``[rows, 2]`` of :func:`row_hashes` (on one device): ``[perplexity of its distinct
    non-zero rows, non-zero rows]``, as an ``[n, 2]`` tensor. A vector quantizer's output takes as
    many values as codes it uses (a collapsed codebook: 1-2); a layer with continuous outputs, one
    per row. All-zero rows (ReLU positions with no unit on; their projections are exactly 0) are
    left out: they are ``dead_units``' business, not codes; so are rows holding NaN/Inf (weights
    gone NaN give every row the same NaN, which is the NaN's symptom, not one code).

    Rows are sorted by their first projection; a new row starts where either projection moves by
    more than ``CODE_TOLERANCE`` of its largest value. No host sync: the group sizes are summed into
    a fixed-size tensor."""
    h = torch.nn.utils.rnn.pad_sequence([t.to(torch.float32) for t in hashes], batch_first=True)  # zero rows pad
    n = h.shape[1]
    live = (h != 0).any(2) & torch.isfinite(h).all(2)  # a NaN output is the NaN's symptom, not a code
    # from the live rows alone: one +inf row (a float16 overflow) made the tolerance inf and every row one code
    tol = torch.where(live.unsqueeze(2), h.abs(), 0).amax(1, keepdim=True) * CODE_TOLERANCE
    h = torch.where(live.unsqueeze(2), h, math.inf)  # all-zero rows sort last, as one group
    order = h[..., 0].argsort(1)
    h = h.gather(1, order.unsqueeze(2).expand(-1, -1, 2))
    new = torch.ones_like(live)
    new[:, 1:] = ((h[:, 1:] - h[:, :-1]).abs() > tol).any(2)  # inf - inf is NaN: not a new row
    counts = torch.zeros(h.shape[0], n + 1, device=h.device).scatter_add_(
        1, new.cumsum(1), live.gather(1, order).to(torch.float32))
    m = counts.sum(1)
    p = counts / m.clamp_min(1).unsqueeze(1)
    return torch.stack([torch.exp(-torch.special.xlogy(p, p).sum(1)), m], 1)


def input_stats(x: torch.Tensor) -> tuple[torch.Tensor, list[str]] | None:
    """Scale of a model's input: overall and per feature (dim 1: features, or image channels);
    overall only for a sparse one.

    Every number comes from per-feature sums of x and x*x (the overall ones too): inputs are
    judged for their scale, where E[x^2] - E[x]^2 is precise enough, and each pass counts.
    """
    if not x.is_floating_point() or x.numel() < 2:
        return None
    if x.layout != torch.strided:
        return _sparse_input_stats(x)
    x = _float(x.detach())
    mn, mx = torch.aminmax(x.reshape(-1))
    n = x.numel()
    if x.dim() >= 2 and x.shape[0] > 1:
        others = tuple(d for d in range(x.dim()) if d != 1)
        count = n // x.shape[1]
        fsum = x.sum(dim=others)
        fsq = (x * x).sum(dim=others)
        total, total_sq = fsum.sum(), fsq.sum()
        fmean = fsum / count
        fstd = ((fsq - fmean * fsum) / max(count - 1, 1)).clamp_min(0).sqrt()
        extra = [fmean.abs().max(), fstd.max(), fstd.min()]
        names = list(INPUT_STATS)
    else:
        flat = x.reshape(-1)
        total, total_sq = flat.sum(), torch.dot(flat, flat)
        extra = []
        names = list(INPUT_STATS[:4])
    mean = total / n
    std = ((total_sq - mean * total) / max(n - 1, 1)).clamp_min(0).sqrt()
    return torch.stack([mean, std, mn, mx, *extra]).to(torch.float32), names


def _sparse_input_stats(x: torch.Tensor) -> tuple[torch.Tensor, list[str]] | None:
    """The overall scale of a sparse input (COO, CSR, ...: pytorch/examples gcn's node features),
    its implicit zeros counted, from its stored values only (never densified)."""
    if x.layout == torch.sparse_coo:
        x = x.coalesce()  # duplicate indices sum: the values as the dense tensor holds them
    try:
        values = _float(x.detach().values()).reshape(-1)
    except RuntimeError:  # a layout without values(): not measured
        return None
    n = x.numel()
    zeros = n - values.numel()
    total, total_sq = values.sum(), torch.dot(values, values)
    if values.numel():
        mn, mx = torch.aminmax(values)
        if zeros:
            mn, mx = mn.clamp_max(0), mx.clamp_min(0)
    else:
        mn = mx = total  # all zeros
    mean = total / n
    std = ((total_sq - mean * total) / max(n - 1, 1)).clamp_min(0).sqrt()
    return torch.stack([mean, std, mn, mx]).to(torch.float32), list(INPUT_STATS[:4])


def histogram(x: torch.Tensor, bins: int) -> torch.Tensor:
    """[min, max, count_0 .. count_{bins-1}] over the finite values, without a host sync.

    ``torch.histc`` and ``bincount`` read their range or size back to the host on accelerators;
    a scatter-add into fixed bins does not.
    """
    x = x.detach()
    if x.is_complex():  # FNO's spectral weights: both parts, as optimizers see them (view_as_real)
        x = torch.view_as_real(x)
    x = _float(x).reshape(-1)
    if not x.numel():  # an empty shard (FSDP2 splits a size-1 bias over two ranks): no range, no counts
        return torch.cat([torch.full((2,), math.nan, device=x.device), torch.zeros(bins, device=x.device)])
    finite = torch.isfinite(x)
    big = torch.finfo(x.dtype).max
    lo = torch.where(finite, x, torch.full_like(x, big)).min()
    hi = torch.where(finite, x, torch.full_like(x, -big)).max()
    tiny = torch.finfo(x.dtype).tiny
    width = (hi - lo).clamp_min(tiny)
    # A range below the smallest normal number (one value, or subnormal neighbours) is one bin.
    spread = (hi - lo >= tiny).to(x.dtype)
    idx = ((x - lo) / width * bins * spread).nan_to_num(0.0, 0.0, 0.0).clamp(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=torch.float32, device=x.device)
    counts.index_add_(0, idx, finite.to(torch.float32))
    return torch.cat([torch.stack([lo, hi]).to(torch.float32), counts])


def grad_stats(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[str], list[torch.Tensor]]:
    """Per gradient: L1 norm, max |g|, L2 norm and NaN/Inf count as an (n, 4) matrix (the host divides
    the L1 norm by the size for mean |g|); and the L2 norms (the global norm needs no second pass).

    One |g| copy serves the L1 norm, the maximum and the NaN/Inf count; on CPU this is several times
    faster than ``_foreach_norm`` with ord 1 and inf.
    """
    absg = torch._foreach_abs(grads)
    l1 = [a.sum() for a in absg]
    linf = [a.amax() if a.numel() else a.new_zeros(()) for a in absg]
    l2 = torch._foreach_norm(grads, 2)
    # |g| - |g| is 0 for every finite value and NaN for NaN and +-Inf: count what is left.
    torch._foreach_sub_(absg, absg)
    bad = [torch.count_nonzero(a) for a in absg]
    cols = [_stack32(l1), _stack32(linf), _stack32(l2), _stack32(bad)]
    return torch.stack(cols, dim=1), ["mean_abs", "max_abs", "norm", "nonfinite"], list(l2)


def sparse_values(g: torch.Tensor) -> torch.Tensor | None:
    """The values a sparse gradient holds, with duplicate indices summed as in the dense tensor
    (``nn.EmbeddingBag(sparse=True)`` leaves one row per lookup), padded with zero rows; None for a
    layout without values. Its norm, maximum, L1 norm and NaN/Inf count are the dense tensor's.

    ``coalesce()`` reads the number of distinct indices back to the host; a sort, a cumulative sum
    and an ``index_add_`` into a tensor of the values' own shape need no sync.
    """
    if g.layout != torch.sparse_coo:
        try:
            return g.values()  # compressed layouts store each index once
        except RuntimeError:
            return None
    if g.is_coalesced():
        return g._values()
    idx, vals = g._indices(), g._values()
    if not vals.shape[0]:
        return vals
    flat = idx[0]
    for d in range(1, idx.shape[0]):
        flat = flat * g.shape[d] + idx[d]
    ordered, perm = torch.sort(flat)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    slot = torch.cumsum(first, 0) - 1  # the index's rank among the distinct ones
    return torch.zeros_like(vals).index_add_(0, slot, vals[perm])


def _stack32(ts: list[torch.Tensor]) -> torch.Tensor:
    if all(t.dtype == torch.float32 for t in ts):
        return torch.stack(ts)
    return torch.stack([t.to(torch.float32) for t in ts])


def squared_norm_sum(tensors: list[torch.Tensor], norms: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sum of squared L2 norms (for the global gradient norm), on the first tensor's device.

    Three small ops on the common path (one dtype, one device): it runs every step.
    """
    if norms is None:
        norms = torch._foreach_norm(tensors, 2)
    first = norms[0]
    if any(n.dtype != torch.float32 or n.device != first.device for n in norms):
        # float64 gradients are summed in float64, as clip_grad_norm_ does (squares overflow float32 at 1.8e19)
        dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
        norms = [n.to(first.device, dtype) for n in norms]
    stacked = torch.stack(norms)
    return torch.dot(stacked, stacked)
