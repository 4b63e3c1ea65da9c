"""What the loss is made of: its autograd graph read once, before the first backward passes.

The diagnosis judges loss misuse (a softmax before ``cross_entropy``, ``nll_loss`` on raw
logits, ...) from the op graph. A recording stores that graph with ``file:line``; without one
(the monitor alone) the loss's autograd graph still holds it: the loss function's node
(``NllLossBackward0``), the nodes that made its input (``LogSoftmaxBackward0`` <-
``SoftmaxBackward0``), and the tensors they saved (the input of ``nll_loss``, the targets of a
soft-target cross entropy). This module writes those *facts* into the run (meta ``loss_graph``);
the rules in ``analysis/_graph_rules.py`` judge them.

Cost: the graph is walked for the first :data:`INSPECTIONS` backward passes only, a few nodes
deep; the facts of the loss heads are reduced on the device and read to the host together, once,
after the last inspection (or when the run ends first).
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from trainguard.capture import _monitor_tap
from trainguard.store import is_user_file

log = logging.getLogger("trainguard.capture")

# Backward passes whose loss graph is read (a GAN's two losses, a first step that differs).
INSPECTIONS = 3
# How far below the loss a loss function's node may sit (mean, division for accumulation, sums
# of several losses), and how many nodes one inspection looks at in all.
HEAD_DEPTH = 8
MAX_NODES = 96
# Non-view producers named below a loss head (softmax <- addmm is two).
CHAIN_LENGTH = 3
# Rows of a saved tensor the facts are computed on (one reduction, one host copy).
FACT_ROWS = 512

# Module types that make probabilities out of scores (named in the evidence).
PROBABILITY_MODULES = ("Softmax", "Softmax2d", "LogSoftmax", "Softmin", "Sigmoid")
# Autograd nodes that only reshape or copy: the chain looks through them.
_PASS = frozenset({
    "view", "reshape_alias", "unsafe_view", "transpose", "t", "permute", "squeeze", "unsqueeze", "expand",
    "clone", "to_copy", "alias", "select", "slice", "contiguous", "flatten", "as_strided",
})
# A few node names that CamelCase -> snake_case gets wrong.
_RENAME = {"nll_loss2_d": "nll_loss", "nll_loss_nd": "nll_loss"}


def node_op(fn: Any) -> str:
    """``NllLossBackward0`` -> ``nll_loss``: an autograd node as the op that made it."""
    name = re.sub(r"Backward\d*$", "", type(fn).__name__)
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return _RENAME.get(snake, snake)


def _next(fn: Any) -> list[Any]:
    return [nf for nf, _ in getattr(fn, "next_functions", ()) if nf is not None]


def _through(fn: Any) -> Any:
    """The first node at or below ``fn`` that is not a view or copy."""
    for _ in range(16):
        if fn is None or node_op(fn) not in _PASS:
            return fn
        nxt = _next(fn)
        fn = nxt[0] if nxt else None
    return fn


def _chain(fn: Any) -> list[str]:
    out: list[str] = []
    fn = _through(fn)
    while fn is not None and len(out) < CHAIN_LENGTH:
        op = node_op(fn)
        if op == "accumulate_grad":
            out.append("parameter")
            break
        out.append(op)
        nxt = _next(fn)
        fn = _through(nxt[0]) if nxt else None
    return out


def _saved(fn: Any, name: str) -> torch.Tensor | None:
    try:
        t = getattr(fn, name)
    except (AttributeError, RuntimeError):  # not saved by this node, or already freed
        return None
    return t if isinstance(t, torch.Tensor) else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.detach()[:FACT_ROWS].double()


def _class_dim(t: torch.Tensor) -> int:
    return 1 if t.dim() >= 2 else 0


# Facts are reduced on the tensor's device into (names, 1-d tensor) and read to the host together,
# once, after the last inspection (see LossWatch.resolve): no host sync per backward pass.
Facts = tuple[tuple[str, ...], torch.Tensor]


def _facts_nll_input(x: torch.Tensor, dim: int | None = None) -> Facts:
    """Log-probabilities are <= 0 with rows whose exp sums to 1; probabilities are in [0, 1] with rows
    summing to 1. ``dim``: the classes (nll_loss's dim 1 unless given; ctc_loss's are the last)."""
    x = _rows(x)
    d = _class_dim(x) if dim is None else dim
    return (("input_max", "input_min", "logsumexp_dev", "row_sum_dev"),
            torch.stack([x.max(), x.min(), x.logsumexp(d).abs().max(), (x.sum(d) - 1).abs().max()]))


def _facts_range(x: torch.Tensor) -> Facts:
    x = _rows(x)
    return ("input_max", "input_min"), torch.stack([x.max(), x.min()])


def _facts_targets(t: torch.Tensor, dim: int) -> Facts:
    t = _rows(t)
    s = t.sum(dim if t.dim() > 1 else 0)
    return ("target_max", "target_min", "row_sum_max", "row_sum_min"), torch.stack([t.max(), t.min(), s.max(), s.min()])


def _loss_scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss's value as a 1-element float64 tensor on its device (nan unless it is one number)."""
    if loss.numel() != 1:
        return torch.full((1,), math.nan, dtype=torch.float64, device=loss.device)
    return loss.detach().reshape(1).double()


def _facts_value(value: torch.Tensor, loss: torch.Tensor, logp: torch.Tensor, dim: int) -> Facts:
    """What the loss analysis compares with ln C: the cross entropy this head computes (``value``),
    the loss backward ran on (``loss``: equal to it when the loss is this cross entropy and nothing
    else), and the mean spread of the log-probabilities over the classes of a row (``logit_std``: the
    logits' own, log_softmax only shifts a row; a uniform guess has 0)."""
    x = _rows(logp)
    spread = x.std(dim).mean() if x.shape[dim] > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
    return (("value", "loss", "logit_std"),
            torch.cat([value.detach().reshape(1).double().to(x.device), _loss_scalar(loss).to(x.device),
                       spread.reshape(1)]))


def _join(a: Facts, b: Facts) -> Facts:
    return a[0] + b[0], torch.cat([a[1], b[1]])


def _ignore_index(fn: Any) -> int:
    ignore = getattr(fn, "_saved_ignore_index", -100)
    return int(ignore) - 2**64 if int(ignore) >= 2**63 else int(ignore)  # a saved negative int reads unsigned


def _facts_class_targets(target: torch.Tensor, ignore: int) -> Facts:
    """Class targets: the most frequent one, its share of all targets, the share ignored, how many."""
    n = target.numel()
    t = target.detach().reshape(-1)[:FACT_ROWS * 128]  # a language model's millions of tokens: a sample
    mode = t.mode().values
    return (("target_mode", "target_mode_share", "target_ignored_share", "targets"),
            torch.stack([mode.double(), (t == mode).double().mean(), (t == ignore).double().mean(),
                         torch.tensor(float(n), dtype=torch.float64, device=t.device)]))


def _facts_padding(x: torch.Tensor, dim: int) -> Facts:
    """A 2-D integer input read along ``dim`` as sequences: the value most sequences end with, and the
    share of sequences ending in a run of it (their last two positions), as padding to the longest."""
    last, prev = x.detach().select(dim, -1).reshape(-1), x.detach().select(dim, -2).reshape(-1)
    v = last.mode().values
    return (("value", "run_share"), torch.stack([v.double(), ((last == v) & (prev == v)).double().mean()]))


def padding_facts(args: Any) -> list[dict]:
    """Padding evidence of a model's integer inputs (``[B, T]`` or ``[T, B]``: both dimensions read);
    ``args`` positional (each named by its index) or a dict of keyword inputs (named by key)."""
    out: list[dict] = []
    items = args.items() if isinstance(args, dict) else enumerate(args if isinstance(args, (tuple, list)) else (args,))
    for i, x in items:
        if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.is_floating_point() or x.is_complex()
                or x.dtype == torch.bool or min(x.shape) < 3):
            continue
        out += [{"input": i, "dim": d, "shape": [int(n) for n in x.shape], "facts": _facts_padding(x, d)}
                for d in (0, 1)]
    return out


def _nll_value(fn: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``nll_loss``'s own value, recomputed from what its node saved (one gather: O(rows))."""
    target = _saved(fn, "_saved_target")
    if target is None:
        return None
    ignore = _ignore_index(fn)
    reduction = {0: "none", 1: "mean", 2: "sum"}.get(int(getattr(fn, "_saved_reduction", 1)), "mean")
    try:
        value = torch.nn.functional.nll_loss(x.detach(), target, weight=_saved(fn, "_saved_weight"),
                                             ignore_index=ignore, reduction=reduction)
    except (RuntimeError, ValueError, IndexError):
        return None
    return value if value.numel() == 1 else None


def resolve_facts(heads: list[dict]) -> None:
    """Replace each head's device facts by a dict of floats (one host copy for all of them)."""
    pending = [h for h in heads if isinstance(h.get("facts"), tuple)]
    if not pending:
        return
    values = torch.cat([h["facts"][1].reshape(-1).cpu() for h in pending]).tolist()
    i = 0
    for h in pending:
        names = h["facts"][0]
        h["facts"] = dict(zip(names, values[i:i + len(names)]))
        i += len(names)


def _log_softmax_below(fn: Any) -> Any:
    """The ``log_softmax`` node a ``gather`` node reads from (through views), or None."""
    nxt = _next(fn)
    below = _through(nxt[0]) if nxt else None
    return below if below is not None and node_op(below) == "log_softmax" else None


def _soft_ce(fn: Any) -> tuple[Any, torch.Tensor, int] | None:
    """A ``mul(log_softmax(x), target)`` node (cross entropy on probability targets)."""
    nxt = getattr(fn, "next_functions", ())
    if len(nxt) != 2:
        return None
    heads = [(i, _through(nf)) for i, (nf, _) in enumerate(nxt) if nf is not None]
    if len(heads) != 1 or heads[0][1] is None or node_op(heads[0][1]) != "log_softmax":
        return None
    target = _saved(fn, "_saved_other" if heads[0][0] == 0 else "_saved_self")
    if target is None or target.requires_grad or not target.is_floating_point():
        return None
    result = _saved(heads[0][1], "_saved_result")
    if result is not None and tuple(result.shape) != tuple(target.shape):  # a weight or mask, not targets
        return None
    dim = getattr(heads[0][1], "_saved_dim", 1)
    dim = int(dim) if isinstance(dim, int) else 1
    if dim >= 2**63:  # autograd hands a saved negative int back as unsigned: dim=-1 reads 2**64 - 1
        dim -= 2**64
    return heads[0][1], target, dim % target.dim() if target.dim() else 0


# Regression losses that broadcast their prediction against the target (torch only warns).
_REGRESSION_LOSSES = ("mse_loss", "smooth_l1_loss", "huber_loss")
# Loss functions that compare a prediction with targets, as autograd nodes (``l1_loss`` is
# ``abs(sub)``, found as a head only when broadcast): a loss with none is a likelihood of the data
# itself (a flow's or a GP's), an ELBO, or written by hand.
COMPARISONS = frozenset({
    "nll_loss", "soft_cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss",
    "smooth_l1_loss", "huber_loss", "l1_loss", "kl_div", "ctc_loss", "soft_margin_loss", "multilabel_margin_loss",
    "multi_margin_loss", "nll_loss2_d", "poisson_nll_loss", "cosine_embedding_loss", "margin_ranking_loss",
    "squared_error",
})


def _broadcast(fn: Any, op: str) -> dict | None:
    """The prediction's shape and the shape it was broadcast to against the target, when a
    regression loss (F.mse_loss, smooth_l1, huber; l1_loss as ``abs(sub(...))``) had to expand it:
    a prediction of [N, 1] against targets of [N] compares every prediction with every target."""
    if op == "abs":  # F.l1_loss: abs(expand(input) - expand(target))
        nxt = _next(fn)
        if len(nxt) != 1 or nxt[0] is None or node_op(nxt[0]) != "sub":
            return None
        sub = nxt[0]
        saved = _saved(fn, "_saved_self")
    else:
        sub = fn
        saved = _saved(fn, "_saved_self")
    pair = [nf for nf, _ in getattr(sub, "next_functions", ())]
    if len(pair) != 2 or pair[0] is None or node_op(pair[0]) != "expand" or saved is None:
        return None
    before = getattr(pair[0], "_saved_self_sym_sizes", None)
    after = [int(d) for d in saved.shape]
    if before is None or math.prod(after) <= math.prod(int(d) for d in before):
        return None
    return {"loss": "l1_loss" if op == "abs" else op, "prediction_shape": [int(d) for d in before],
            "broadcast_shape": after, "chain": _chain(pair[0])}


# Ops whose output lies within fixed bounds: a prediction made by one cannot reach a target beyond them.
_BOUNDED = {"sigmoid": (0.0, 1.0), "hardsigmoid": (0.0, 1.0), "softmax": (0.0, 1.0), "tanh": (-1.0, 1.0),
            "hardtanh": (-1.0, 1.0)}
# Ops that pick elements out of a tensor without changing them (DETR's ``pred_boxes[idx]``).
_SELECT = frozenset({"index", "gather", "index_select", "masked_select", "narrow", "split", "split_with_sizes",
                     "unbind", "chunk"})


def _bound_of(fn: Any) -> tuple[str, float, float] | None:
    """The bounded op that made a prediction (through views and selections), with its bounds; None when
    the prediction is not bounded."""
    fn = _through(fn)
    for _ in range(4):
        if fn is None:
            return None
        op = node_op(fn)
        if op in _BOUNDED:
            return (op, *_BOUNDED[op])
        nxt = _next(fn)
        if op not in _SELECT or len(nxt) != 1:
            return None
        fn = _through(nxt[0])
    return None


def _regression(fn: Any, op: str) -> dict | None:
    """A regression loss (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``; ``l1_loss`` as
    ``abs(pred - target)``) whose prediction comes out of a bounded op (a sigmoid box head), with facts
    that bound its targets: ``target_max_at_least`` and ``target_min_at_most`` (the targets' own max
    and min where the node saved them; for ``abs``, read off the saved difference and the bounds)."""
    if op == "abs":
        nxt = _next(fn)
        sub = nxt[0] if len(nxt) == 1 else None
        pair = [nf for nf, _ in getattr(sub, "next_functions", ())] if sub is not None else []
        diff = _saved(fn, "_saved_self")
        if sub is None or node_op(sub) != "sub" or len(pair) != 2 or (pair[0] is None) == (pair[1] is None) \
                or diff is None or not diff.numel() or not diff.is_floating_point():
            return None
        pred_fn, first = (pair[0], True) if pair[0] is not None else (pair[1], False)
        bound = _bound_of(pred_fn)
        if bound is None:
            return None
        d = diff.detach().reshape(-1)[:FACT_ROWS * 64].double()
        lo, hi = bound[1], bound[2]
        # pred - target = d: target = pred - d lies in [lo - d, hi - d]; target - pred = d: in [lo + d, hi + d]
        facts = (torch.stack([lo - d.min(), hi - d.max()]) if first else torch.stack([d.max() + lo, d.min() + hi]))
        name = "l1_loss"
    else:
        nxt = [nf for nf, _ in getattr(fn, "next_functions", ())]
        target = _saved(fn, "_saved_target")
        if not nxt or nxt[0] is None or target is None or not target.numel() or not target.is_floating_point() \
                or target.requires_grad:
            return None
        pred_fn = nxt[0]
        bound = _bound_of(pred_fn)
        if bound is None:
            return None
        t = target.detach().reshape(-1)[:FACT_ROWS * 64].double()
        facts = torch.stack([t.max(), t.min()])
        name = op
    return {"loss": name, "bounded_by": bound[0], "reach": [bound[1], bound[2]], "chain": _chain(pred_fn),
            "facts": (("target_max_at_least", "target_min_at_most"), facts)}


def _within(fn: Any, depth: int) -> list[Any]:
    """The nodes at most ``depth`` below ``fn`` (``fn`` first)."""
    out, todo = [], [(fn, 0)]
    while todo and len(out) < 32:
        f, d = todo.pop(0)
        out.append(f)
        if d < depth:
            todo += [(nf, d + 1) for nf in _next(f)]
    return out


def soft_dice(fn: Any) -> dict | None:
    """A ``div`` node that is a soft dice (or IoU) ratio: its numerator made of ``sum(x * target)``
    (a target without gradient), its denominator of ``sum(x)``, for the same ``x`` (milesial/Pytorch-UNet's
    ``dice_coeff``), as the ops that made ``x`` (``mul`` saves no ``x`` when the target needs no gradient:
    what made it says whether it is bounded, a softmax or a convolution)."""
    nxt = [nf for nf, _ in getattr(fn, "next_functions", ())]
    if len(nxt) != 2 or nxt[0] is None or nxt[1] is None:
        return None
    for mul in _within(nxt[0], 4):
        pair = [nf for nf, _ in getattr(mul, "next_functions", ())]
        if node_op(mul) != "mul" or len(pair) != 2 or (pair[0] is None) == (pair[1] is None):
            continue
        i = 0 if pair[0] is not None else 1
        t = _saved(mul, ("_saved_other", "_saved_self")[i])
        if t is None or not t.is_floating_point() or t.requires_grad:
            continue
        if any(node_op(n) == "sum" and pair[i] in _next(n) for n in _within(nxt[1], 4)):
            return {"chain": _chain(pair[i])}
    return None


def inspect_loss(loss: torch.Tensor, ops: set[str] | None = None, dice: list[dict] | None = None,
                 regression: list[dict] | None = None) -> list[dict]:
    """The loss heads below ``loss``: which loss function, the ops that made its input, facts.
    ``ops``: filled with the ops of the nodes looked at; ``regression``: with the regression losses
    whose prediction is bounded (see :func:`_regression`)."""
    heads: list[dict] = []
    seen: set[int] = set()
    # negs: the negations between the loss and the node; cross entropy is -sum(target * log_softmax),
    # so a target multiplied in under an even number of them is the negated probabilities
    # (timm's SoftTargetCrossEntropy: sum(-target * log_softmax(x)))
    todo = [(loss.grad_fn, 0, 0)]
    visited = 0
    while todo and visited < MAX_NODES:
        fn, depth, negs = todo.pop(0)
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        visited += 1
        op = node_op(fn)
        if ops is not None:
            ops.add(op)
            if op == "pow" and getattr(fn, "_saved_exponent", None) == 2 and any(node_op(n) == "sub" for n in _next(fn)):
                ops.add("squared_error")  # (target - output) ** 2 by hand: DiT's mean_flat((target - model_output) ** 2)
        head: dict | None = None
        if op == "nll_loss":
            nxt = _next(fn)
            head = {"loss": "nll_loss", "chain": _chain(nxt[0]) if nxt else []}
            x = _saved(fn, "_saved_self")
            if x is not None and x.is_floating_point() and x.numel():
                head["facts"] = _facts_nll_input(x)
                head["classes"] = int(x.shape[_class_dim(x)])
                reduction = int(getattr(fn, "_saved_reduction", 1))
                head["reduction"] = {0: "none", 1: "mean", 2: "sum"}.get(reduction, str(reduction))
                value = _nll_value(fn, x)
                if value is not None:
                    head["facts"] = _join(head["facts"], _facts_value(value, loss, x, _class_dim(x)))
                target = _saved(fn, "_saved_target")
                if target is not None and target.numel() and not target.is_floating_point():
                    ignore = _ignore_index(fn)
                    head["ignore_index"] = ignore
                    head["facts"] = _join(head["facts"], _facts_class_targets(target, ignore))
        elif op == "ctc_loss":
            # log_probs [T, N, C] (or [T, C]): log_softmax over the classes, the last dimension
            nxt = _next(fn)
            head = {"loss": "ctc_loss", "chain": _chain(nxt[0]) if nxt else []}
            x = _saved(fn, "_saved_log_probs")
            if x is not None and x.is_floating_point() and x.numel():
                names, values = _facts_nll_input(x, dim=-1)
                nll = _saved(fn, "_saved_result0")  # per sample; +inf where no alignment fits the target
                if nll is not None and nll.numel() and getattr(fn, "_saved_zero_infinity", False):
                    names += ("zeroed", "samples")
                    values = torch.cat([values, torch.stack([
                        torch.isinf(nll.detach()).sum().double(), torch.tensor(float(nll.numel()), device=nll.device,
                                                                             dtype=torch.float64)])])
                head["facts"] = (names, values)
                head["classes"] = int(x.shape[-1])
        elif op in ("binary_cross_entropy_with_logits", "binary_cross_entropy"):
            nxt = _next(fn)
            head = {"loss": op, "chain": _chain(nxt[0]) if nxt else []}
            x = _saved(fn, "_saved_self")
            if x is not None and x.numel():
                head["facts"] = _facts_range(x)
                t = _saved(fn, "_saved_target")
                if t is not None and t.is_floating_point() and t.numel():
                    # probabilities in [0, 1]: a mask stored as 0/255 gives a loss with no minimum
                    t = _rows(t)
                    head["facts"] = _join(head["facts"], (("target_max", "target_min"), torch.stack([t.max(), t.min()])))
        elif op == "gather" and _log_softmax_below(fn) is not None:
            # -log_softmax(x).gather(dim, target): a cross entropy written by hand (smp's
            # SoftCrossEntropyLoss, fairseq's label_smoothed_nll_loss); no class count: a policy
            # gradient's log-probability of its actions reads the same
            lsm = _log_softmax_below(fn)
            head = {"loss": "nll_loss", "chain": _chain(lsm)}
            x = _saved(lsm, "_saved_result")
            if x is not None and x.is_floating_point() and x.numel():
                head["facts"] = _facts_nll_input(x)
        elif op == "mul":
            soft = _soft_ce(fn)
            if soft is not None:
                lsm, target, dim = soft
                target = target if negs % 2 else -target
                head = {"loss": "soft_cross_entropy", "chain": _chain(lsm)}
                if target.numel():
                    head["facts"] = _facts_targets(target, dim)
                    head["classes"] = int(target.shape[dim]) if target.dim() else 1
                    logp = _saved(lsm, "_saved_result")
                    if logp is not None and target.dim() and tuple(logp.shape) == tuple(target.shape):
                        # its value as the mean over rows of -sum(target * log_softmax)
                        value = -(target.detach().double() * logp.detach().double()).sum(dim).mean()
                        head["facts"] = _join(head["facts"], _facts_value(value, loss, logp, dim))
        elif op in _REGRESSION_LOSSES or op == "abs":
            head = _broadcast(fn, op)
            if head is None and regression is not None and len(regression) < 4:
                found = _regression(fn, op)
                if found is not None:
                    regression.append(found)
        elif op == "div" and dice is not None and not dice:
            found = soft_dice(fn)
            if found is not None:
                dice.append(found)
        if head is not None:
            heads.append(head)
            continue
        if depth < HEAD_DEPTH:
            todo.extend((nf, depth + 1, negs + _negates(op, i))
                        for i, (nf, _) in enumerate(getattr(fn, "next_functions", ())) if nf is not None)
    return heads


def soft_targets(loss: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The targets of the soft-target cross entropies below ``loss`` (a teacher's probabilities:
    DINO's ``sum(-q * log_softmax(s))``), with their class dimension; only the ``mul`` nodes are
    looked at, within :data:`HEAD_DEPTH` and :data:`MAX_NODES`."""
    out: list[tuple[torch.Tensor, int]] = []
    seen: set[int] = set()
    todo = [(loss.grad_fn, 0, 0)]
    while todo and len(seen) < MAX_NODES and len(out) < 4:
        fn, depth, negs = todo.pop(0)
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        op = node_op(fn)
        soft = _soft_ce(fn) if op == "mul" else None
        if soft is not None:
            _, target, dim = soft
            if target.dim() and target.shape[dim] > 1:
                out.append((target if negs % 2 else -target, dim))
            continue
        if depth < HEAD_DEPTH:
            todo.extend((nf, depth + 1, negs + _negates(op, i))
                        for i, (nf, _) in enumerate(getattr(fn, "next_functions", ())) if nf is not None)
    return out


TARGET_STATS = ("row_entropy", "mean_entropy", "classes")


def target_entropies(targets: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """On the targets' device, over all of them: the mean entropy of a row's target distribution, the
    entropy of the rows' mean distribution (nats; 0 when every row puts its mass on the same class),
    and the classes (see :data:`TARGET_STATS`)."""
    rows, means = [], []
    for t, dim in targets:
        p = t.detach().movedim(dim, -1).reshape(-1, t.shape[dim])[:FACT_ROWS * 8].double()
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        rows.append(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
        m = p.mean(0)
        means.append(-(m * m.clamp_min(1e-30).log()).sum())
    classes = float(targets[0][0].shape[targets[0][1]])
    return torch.stack([torch.stack(rows).mean(), torch.stack(means).mean(),
                        torch.tensor(classes, dtype=torch.float64, device=rows[0].device)])


def _negates(op: str, operand: int) -> bool:
    """Whether node ``op`` negates its ``operand``-th input: ``neg``, ``a - b`` for b (F.kl_div is
    ``xlogy(t, t) - t * log_softmax``), ``rsub`` for its first."""
    return op == "neg" or (op == "sub" and operand == 1) or (op == "rsub" and operand == 0)


def user_frame() -> dict | None:
    """The user's line that called ``backward`` (the frame outside torch and trainguard)."""
    f = sys._getframe(1)
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            return {"file": f.f_code.co_filename, "line": f.f_lineno, "function": f.f_code.co_name}
        f = f.f_back
    return None


class LossWatch:
    """Reads the loss graph of the first :data:`INSPECTIONS` backward passes into ``writer``'s meta.

    One per run directory (the recorder and the monitor share it, see :func:`acquire`).
    ``modules`` names the watched model's probability layers (``nn.Softmax`` at ``head.2``).
    """

    def __init__(self, writer: Any):
        self.writer = writer
        self.users = 0
        self.seen = 0
        self.records: list[dict] = []
        self.written = 0
        self.modules: Callable[[], list[dict]] | None = None
        # the padding_idx of the watched model's embeddings ({"name", "padding_idx"})
        self.tables: Callable[[], list[dict]] | None = None
        self.inputs: list[dict] = []  # padding evidence of the training forwards' integer inputs

    @property
    def wants_inputs(self) -> bool:
        """Whether a forward's inputs are still read: within the first INSPECTIONS losses, 8 at most."""
        return self.seen < INSPECTIONS and len(self.inputs) < 8

    def see_inputs(self, args: Any) -> None:
        """A training forward's positional inputs (or keyword ones, a dict), before the loss graphs are
        read (no host sync)."""
        if not self.wants_inputs:
            return
        try:
            with _monitor_tap.quiet(), torch.no_grad():
                self.inputs += padding_facts(args)[:8]
        except Exception:  # observing training never kills training
            log.exception("trainguard: reading the inputs' padding failed")

    def __call__(self, loss: torch.Tensor) -> None:
        if self.seen >= INSPECTIONS:
            return
        self.seen += 1
        try:
            with _monitor_tap.quiet(), torch.no_grad():
                ops: set[str] = set()
                dice: list[dict] = []
                regression: list[dict] = []
                heads = inspect_loss(loss, ops, dice, regression)
            # the loss functions comparing predictions with targets within the walk (HEAD_DEPTH, MAX_NODES)
            functions = sorted({h["loss"] for h in heads} | (ops & COMPARISONS))
            rec: dict[str, Any] = {"heads": heads, "loss_functions": functions, "backward_at": user_frame()}
            if "log_sigmoid" in ops:  # -logsigmoid(beta * margin): DPO's, a reward model's pairwise loss
                rec["log_sigmoid"] = True
            if self.modules is not None:
                rec["modules"] = self.modules()
            if self.tables is not None:
                rec["padding_idx"] = self.tables()
            rec["inputs"], self.inputs = self.inputs, []
            if dice:
                rec["dice"] = dice
            if regression:
                rec["regression"] = regression
            self.records.append(rec)
        except Exception:  # observing training never kills training
            log.exception("trainguard: reading the loss graph failed")
        if self.seen == INSPECTIONS:
            self.resolve()

    def resolve(self) -> None:
        """Read the facts to the host (once) and write the records into the run."""
        if not self.records or self.written == len(self.records):
            return
        try:
            with _monitor_tap.quiet(), torch.no_grad():
                resolve_facts([h for rec in self.records
                               for h in rec["heads"] + rec.get("inputs", []) + rec.get("regression", [])])
            self.writer.set_meta(loss_graph=list(self.records))
            self.written = len(self.records)
        except Exception:
            log.exception("trainguard: reading the loss graph failed")


_watches: dict[int, LossWatch] = {}
_watch_lock = threading.Lock()


def acquire(writer: Any) -> LossWatch:
    """The run's loss watch, installed on the backward tap while any user holds it."""
    with _watch_lock:
        w = _watches.get(id(writer))
        if w is None:
            w = _watches[id(writer)] = LossWatch(writer)
            _monitor_tap.add_listener("loss_graph", w)
        w.users += 1
        return w


def release(watch: LossWatch) -> None:
    with _watch_lock:
        watch.users -= 1
        watch.resolve()  # a run with fewer backward passes than INSPECTIONS
        if watch.users <= 0:
            _watches.pop(id(watch.writer), None)
            _monitor_tap.remove_listener("loss_graph", watch)
