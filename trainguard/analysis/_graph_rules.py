"""Loss misuse read off the op graph: what made the loss function's input.

Two sources, one judgement:

- a **recording** stores every op with the ops that produced its inputs and the user's
  ``file:line``: the chain ``softmax -> log_softmax -> nll_loss`` is read from the stored
  executions (the recorder pins the loss chains of the first backward passes, so a small
  circular buffer keeps them), with the output summaries as value evidence;
- the **monitor alone** (no recording) reads the loss's autograd graph before the first backward
  passes (``capture/_loss_watch.py``, run meta ``loss_graph``): the same chain as autograd node
  names, and facts computed on the tensors the loss function saved (the range of
  ``nll_loss``'s input, the row sums of soft targets).

Each misuse is its own rule (its own finding kind) with the exact fix.
"""

from __future__ import annotations

import math
from typing import Any

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._rules import register_rule
from trainguard.analysis._thresholds import Thresholds
from trainguard.store import Finding

SOURCE = "graph"

# Recorded loss executions read per loss op (the first ones: the recorder pins their chains).
MAX_HEADS = 4
# Recorded ops that only reshape or copy: the chain looks through them.
_PASS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "squeeze", "unsqueeze",
    "expand", "clone", "_to_copy", "alias", "detach", "select", "slice", "contiguous", "flatten", "as_strided",
})
_RECORDED_LOSSES = {
    "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss",
    "binary_cross_entropy_with_logits": "binary_cross_entropy_with_logits", "_ctc_loss": "ctc_loss",
}
# Producers that make log-probabilities: nll_loss is right on their output.
_LOG_PROB_OPS = ("log_softmax", "log", "log_sigmoid", "log_sigmoid_forward")
# Producers that make raw scores (logits) out of a layer.
_SCORE_OPS = ("addmm", "mm", "bmm", "matmul", "linear", "convolution", "add", "baddbmm")

KINDS = {
    "softmax_before_cross_entropy": (
        "cross_entropy is applied to softmax outputs: it takes logits and applies log_softmax itself",
        "remove the softmax before the loss: pass the logits to `F.cross_entropy` / `nn.CrossEntropyLoss` "
        "(softmax twice squashes the scores, gradients shrink and training crawls); apply `softmax` only "
        "where probabilities are needed, e.g. at inference",
    ),
    "sigmoid_before_bce_with_logits": (
        "binary_cross_entropy_with_logits is applied to sigmoid outputs: it takes logits and applies the sigmoid itself",
        "remove the sigmoid before the loss: pass the logits to `F.binary_cross_entropy_with_logits` / "
        "`nn.BCEWithLogitsLoss` (or keep the sigmoid and use `nn.BCELoss`, which is less stable)",
    ),
    "nll_loss_on_probabilities": (
        "nll_loss is applied to probabilities: it expects log-probabilities",
        "use `F.log_softmax(logits, dim=1)` instead of `softmax` before `nll_loss`, or pass the logits to "
        "`F.cross_entropy` (log_softmax + nll_loss in one, numerically stable); on probabilities nll_loss "
        "minimises -p instead of -log p",
    ),
    "nll_loss_on_logits": (
        "nll_loss is applied to raw scores (logits): it expects log-probabilities",
        "apply `F.log_softmax(logits, dim=1)` before `nll_loss`, or use `F.cross_entropy(logits, target)` "
        "(on raw scores nll_loss just pushes the true class's score up without bound: the loss goes to -inf)",
    ),
    "ctc_loss_on_probabilities": (
        "ctc_loss is applied to probabilities: it expects log-probabilities",
        "apply `F.log_softmax(x, dim=2)` instead of `softmax` before `nn.CTCLoss` / `F.ctc_loss` (over the "
        "classes, the last dimension of its `[T, N, C]` input); on probabilities the loss is not -log p of the "
        "target (it goes below 0) and the model learns no alignment",
    ),
    "ctc_loss_on_logits": (
        "ctc_loss is applied to raw scores (logits): it expects log-probabilities",
        "apply `F.log_softmax(x, dim=2)` before `nn.CTCLoss` / `F.ctc_loss` (over the classes, the last "
        "dimension of its `[T, N, C]` input): torch's CTC loss does not normalise its input as warp-ctc did; "
        "on raw scores the loss is not -log p of the target (it goes below 0) and the model learns no alignment",
    ),
    "ctc_log_softmax_wrong_dim": (
        "ctc_loss's log_softmax is not over the classes: its input's rows over the last dimension are no "
        "log-probabilities",
        "take `log_softmax` over the classes, the last dimension of the `[T, N, C]` input: "
        "`F.log_softmax(x, dim=2)` (or `dim=-1`); over dim 0 or 1 it normalises across time steps or samples, "
        "and the loss pushes the scores of other frames or samples down instead of learning the alignment",
    ),
    "bce_targets_not_probabilities": (
        "binary_cross_entropy's targets are not in [0, 1]",
        "give BCE targets in [0, 1]: a mask stored as 0/255 (an 8-bit PNG) becomes `mask / 255` or "
        "`(mask > 0).float()`; outside [0, 1] the loss has no minimum (it falls below 0 and keeps falling as "
        "the logits grow), so a falling loss says nothing about the fit",
    ),
    "cross_entropy_one_class": (
        "cross_entropy over 1 class: log_softmax of a single score is 0, so the loss is 0 and every gradient "
        "is 0 whatever the model outputs",
        "the model gives one output per sample: for regression use `F.mse_loss(output, target)`; for a yes/no "
        "label use `F.binary_cross_entropy_with_logits(output, target)` on that one output; for C classes give "
        "the last layer C outputs",
    ),
    "cross_entropy_targets_not_probabilities": (
        "cross_entropy gets float (one-hot or soft) targets that are not probabilities",
        "pass class indices (`target.argmax(1)` or the integer labels) to `F.cross_entropy`, or targets whose "
        "rows are probabilities (each in [0, 1], summing to 1: for label smoothing use "
        "`F.cross_entropy(logits, labels, label_smoothing=0.1)`); multi-label targets (several 1s per row) "
        "need `nn.BCEWithLogitsLoss`",
    ),
}


# ---------------------------------------------------------------------- the recorded op graph
def _op(name: str | None) -> str:
    """``aten._log_softmax.default`` -> ``log_softmax``; ``aten.nll_loss_forward`` -> ``nll_loss``."""
    parts = (name or "?").split(".")
    if parts[0] in ("aten", "prims") and len(parts) > 1:
        parts = parts[1:]
    base = parts[0]
    base = _RECORDED_LOSSES.get(base, base)
    return base.lstrip("_") if base not in _PASS else base


def _link(run: Any, digest: dict) -> dict:
    frame = run.user_frame(digest.get("stack_id"))
    return {"op": _op(digest.get("op")), "seq": digest.get("seq"), "module": digest.get("module"),
            "file": frame["filename"] if frame else None, "line": frame["lineno"] if frame else None}


def _producer(run: Any, ex: dict, slot: int = 0) -> tuple[dict | None, str | None]:
    """(digest of the op that made input ``slot`` through views and copies, or the input's kind)."""
    inputs = ex.get("inputs") or []
    for _ in range(16):
        if slot >= len(inputs):
            return None, None
        inp = inputs[slot]
        d = inp.get("producer_digest")
        if inp.get("kind") != "op" or d is None:
            return None, inp.get("kind")
        base = (d.get("op") or "").split(".")
        base = base[1] if base[0] == "aten" and len(base) > 1 else base[0]
        if base not in _PASS:
            return d, None
        ex, slot = run.execution(d["seq"]), 0
        inputs = ex.get("inputs") or []
    return None, None


def _recorded_chain(run: Any, ex: dict, slot: int = 0) -> list[dict]:
    """The links below input ``slot`` of ``ex``, nearest first, up to three ops."""
    out = []
    for _ in range(3):
        d, kind = _producer(run, ex, slot)
        if d is None:
            if kind in ("param", "buffer", "input"):
                out.append({"op": "parameter" if kind != "input" else "input"})
            break
        out.append(_link(run, d))
        ex, slot = run.execution(d["seq"]), 0
    return out


def _summary(digest: dict | None) -> dict:
    outs = (digest or {}).get("outputs") or []
    return (outs[0].get("summary") or {}) if outs else {}


def _classes(digest: dict | None) -> int | None:
    """The classes a loss's log-probabilities hold (dim 1, as cross_entropy and nll_loss take them):
    one only where the summary agrees that every value is 0 (log_softmax of one score)."""
    outs = (digest or {}).get("outputs") or []
    shape = outs[0].get("shape") if outs else None
    if not shape:
        return None
    n = int(shape[1] if len(shape) >= 2 else shape[0])
    s = _summary(digest)
    if n == 1 and "zero" in s and s.get("zero") != s.get("size"):
        return None
    return n


def _facts_from_summary(s: dict, target: bool = False, negate: bool = False) -> dict:
    """Sign evidence from a full_health summary (min/max too in ``stats`` mode); ``negate``: of -tensor."""
    facts: dict[str, float] = {}
    if "min" in s and "max" in s and isinstance(s["min"], (int, float)):
        lo, hi = (-float(s["max"]), -float(s["min"])) if negate else (float(s["min"]), float(s["max"]))
        facts["target_min" if target else "input_min"] = lo
        facts["target_max" if target else "input_max"] = hi
    elif "neg" in s and "pos" in s:
        key = "target_min" if target else "input_min"
        facts[key] = -1.0 if s["pos" if negate else "neg"] else 0.0
        if not target:
            facts["input_max"] = 1.0 if s["pos"] else 0.0
            facts["signs_only"] = 1.0
    return facts


def recorded_heads(run: Any) -> list[dict]:
    """Loss heads of the recording, each with the chain of its input (far end first) and facts."""
    try:
        if not run.count():
            return []
    except Exception:
        return []
    heads: list[dict] = []
    for rec_op, loss in _RECORDED_LOSSES.items():
        for d in run.executions(0, MAX_HEADS, op=rec_op):
            ex = run.execution(d["seq"])
            chain = _recorded_chain(run, ex)
            head = {"loss": loss, "link": _link(run, d), "chain": chain}
            near = next((c for c in chain if "seq" in c), None)
            if near is not None:
                near_ex = run.execution(near["seq"])
                head["facts"] = _facts_from_summary(_summary(near_ex))
                if near["op"] == "log_softmax":
                    head["classes"] = _classes(near_ex)
            heads.append(head)
    for d in run.executions(0, MAX_HEADS, op="_log_softmax"):
        for c in run.consumers(d["seq"], limit=8):
            if _op(c.get("op")) != "mul":
                continue
            ex = run.execution(c["seq"])
            ins = ex.get("inputs") or []
            mine = [i for i, inp in enumerate(ins) if inp.get("producer") == d["seq"]]
            if len(ins) != 2 or len(mine) != 1:
                continue
            sums = [s for s in run.consumers(c["seq"], limit=4) if _op(s.get("op")) == "sum"]
            if not sums:
                continue
            # cross entropy is -sum(target * log_softmax): without a neg after the sum (F.cross_entropy
            # has one), the target went in negated (timm's SoftTargetCrossEntropy: sum(-target * lsm))
            negated = not any(_op(n.get("op")) == "neg" for n in run.consumers(sums[0]["seq"], limit=4))
            other = 1 - mine[0]
            target, _ = _producer(run, ex, other)
            below = _recorded_chain(run, run.execution(d["seq"]))
            head = {"loss": "soft_cross_entropy", "link": dict(_link(run, d), op="cross_entropy"),
                    "chain": [_link(run, d), *below],
                    "target": _link(run, target) if target else None}
            head["facts"] = _facts_from_summary(_summary(ins[other].get("producer_digest")), target=True,
                                                negate=negated)
            head["classes"] = _classes(run.execution(d["seq"]))
            heads.append(head)
    return heads


# ---------------------------------------------------------------------- judging a head
def judge(head: dict, tol: float) -> tuple[str, list[dict]] | None:
    """(kind, the links that show it, far end first) for a misused loss head; None when it is fine."""
    loss = head["loss"]
    chain = head.get("chain") or []
    ops = [c["op"] for c in chain]
    facts = head.get("facts") or {}
    end = head.get("link") or {"op": loss}
    if loss in ("nll_loss", "soft_cross_entropy") and ops[:1] == ["log_softmax"] and head.get("classes") == 1:
        return "cross_entropy_one_class", [chain[1] if len(chain) > 1 else chain[0], end]
    if loss in ("nll_loss", "soft_cross_entropy") and ops[:2] == ["log_softmax", "softmax"]:
        if loss == "soft_cross_entropy":
            return "softmax_before_cross_entropy", [chain[1], chain[0]]
        return "softmax_before_cross_entropy", [chain[1], chain[0], end]
    if loss == "binary_cross_entropy_with_logits" and ops[:1] == ["sigmoid"]:
        return "sigmoid_before_bce_with_logits", [chain[0], end]
    if loss in ("binary_cross_entropy_with_logits", "binary_cross_entropy") and (
            facts.get("target_min", 0) < -tol or facts.get("target_max", 0) > 1 + tol):
        return "bce_targets_not_probabilities", [*chain[:1], end]
    if loss == "nll_loss" and ops and ops[0] not in _LOG_PROB_OPS:
        lo, hi = facts.get("input_min"), facts.get("input_max")
        rows = facts.get("row_sum_dev")
        probs = ops[0] == "softmax" or (
            lo is not None and lo >= -tol and hi is not None and hi > 0 and (rows is None or rows <= tol))
        if probs:
            return "nll_loss_on_probabilities", [chain[0], end]
        lse = facts.get("logsumexp_dev")
        if hi is not None:
            if hi > tol and (lse is None or lse > tol):
                return "nll_loss_on_logits", [chain[0], end]
        elif ops[0] in _SCORE_OPS:
            return "nll_loss_on_logits", [chain[0], end]
    if loss == "ctc_loss" and ops:
        return _judge_ctc(ops, chain, facts, end, tol)
    if loss == "soft_cross_entropy" and facts:
        lo, hi = facts.get("target_min"), facts.get("target_max")
        smax, smin = facts.get("row_sum_max"), facts.get("row_sum_min")
        bad = (lo is not None and lo < -tol) or (hi is not None and hi > 1 + tol) or (
            smax is not None and abs(smax - 1) > tol) or (smin is not None and abs(smin - 1) > tol)
        if bad:
            links = [head["target"]] if head.get("target") else []
            return "cross_entropy_targets_not_probabilities", [*links, end]
    return None


def _judge_ctc(ops: list[str], chain: list[dict], facts: dict, end: dict, tol: float) -> tuple[str, list[dict]] | None:
    """ctc_loss's input must be log-probabilities over its last dimension (the classes)."""
    lo, hi = facts.get("input_min"), facts.get("input_max")
    lse, rows = facts.get("logsumexp_dev"), facts.get("row_sum_dev")
    if ops[0] in _LOG_PROB_OPS:
        # log_softmax over dim 0 or 1 of [T, N, C] still gives values <= 0: only the rows tell
        if ops[0] == "log_softmax" and lse is not None and lse > tol:
            return "ctc_log_softmax_wrong_dim", [chain[0], end]
        return None
    if ops[0] == "softmax" or (lo is not None and lo >= -tol and hi is not None and hi > 0
                               and (rows is None or rows <= tol)):
        return "ctc_loss_on_probabilities", [chain[0], end]
    if hi is not None:
        if hi > tol and (lse is None or lse > tol):
            return "ctc_loss_on_logits", [chain[0], end]
    elif ops[0] in _SCORE_OPS:
        return "ctc_loss_on_logits", [chain[0], end]
    return None


def _where(link: dict) -> str:
    if link.get("file"):
        return f"{link['op']} ({link['file']}:{link['line']})"
    return link["op"]


def _detail(kind: str, facts: dict) -> str:
    """The numbers behind a judgement, for the title."""
    if kind == "cross_entropy_targets_not_probabilities" and "row_sum_max" in facts:
        lo, hi = facts["row_sum_min"], facts["row_sum_max"]
        sums = fmt(hi) if abs(hi - lo) < 1e-6 else f"{fmt(lo)} to {fmt(hi)}"
        return f"target rows sum to {sums}, values in [{fmt(facts['target_min'])}, {fmt(facts['target_max'])}]"
    if kind == "cross_entropy_targets_not_probabilities" and facts.get("target_min", 0) < 0:
        return "targets hold negative values"
    if kind == "bce_targets_not_probabilities" and "target_max" in facts:
        return f"targets in [{fmt(facts['target_min'])}, {fmt(facts['target_max'])}]"
    if kind == "ctc_log_softmax_wrong_dim" and "logsumexp_dev" in facts:
        return f"logsumexp over the last dimension is {fmt(facts['logsumexp_dev'])} away from 0"
    if kind in ("nll_loss_on_logits", "ctc_loss_on_logits") and "input_max" in facts and not facts.get("signs_only"):
        return f"its input reaches {fmt(facts['input_max'])} (log-probabilities are <= 0)"
    if kind in ("nll_loss_on_logits", "ctc_loss_on_logits") and facts.get("signs_only"):
        return "its input holds positive values (log-probabilities are <= 0)"
    return ""


def _finding(kind: str, links: list[dict], head: dict, source: str, extra: dict) -> Finding:
    title, fix = KINDS[kind]
    detail = _detail(kind, head.get("facts") or {})
    if detail:
        title = f"{title} ({detail})"
    ev: dict[str, Any] = {"source": source, "chain": links, "chain_text": " -> ".join(_where(lk) for lk in links)}
    ev.update({k: v for k, v in (head.get("facts") or {}).items() if k != "signs_only" and math.isfinite(v)})
    if head.get("classes") is not None:
        ev["classes"] = head["classes"]
    ev.update(extra)
    where = ""
    if not any(lk.get("file") for lk in links) and extra.get("backward_at"):
        b = extra["backward_at"]
        where = f" (the loss backpropagated at {b['file']}:{b['line']})"
    return Finding(kind=kind, severity="warning", title=f"{title}: {ev['chain_text']}{where}", evidence=ev,
                   suggestion=fix, source=SOURCE)


ZEROED_FIX = (
    "drop or shorten the samples whose target is longer than their output frames (each label needs a "
    "frame, and a repeated label one more for the blank between), or downsample the input less (fewer "
    "strides or poolings along time, a wider image); zero_infinity=True keeps the loss finite, but these "
    "samples add nothing to it or to the gradient"
)


def _zeroed_findings(ctx: Context) -> list[Finding]:
    """CTC samples that zero_infinity=True dropped from the loss: no alignment fits their targets."""
    zeroed = samples = 0
    b = None
    for rec in ctx.run.meta.get("loss_graph") or []:
        for head in rec.get("heads") or []:
            facts = head.get("facts") or {}
            if head.get("loss") == "ctc_loss" and facts.get("samples"):
                zeroed += int(facts.get("zeroed") or 0)
                samples += int(facts["samples"])
                b = b or rec.get("backward_at")
    if not zeroed:
        return []
    where = f" (the loss backpropagated at {b['file']}:{b['line']})" if b else ""
    return [Finding(
        kind="ctc_targets_zeroed", severity="warning",
        title=f"ctc_loss with zero_infinity=True dropped {zeroed} of {samples} samples of the first batches: "
              f"no alignment fits their targets into their input frames, so they teach nothing{where}",
        evidence={"source": "autograd graph", "zeroed": zeroed, "samples": samples, "backward_at": b},
        suggestion=ZEROED_FIX, source=SOURCE)]


@register_rule("ctc_targets_zeroed")
def ctc_targets_zeroed(ctx: Context) -> list[Finding]:
    """CTC loss with zero_infinity=True zeroed samples whose targets no alignment fits (the loss's autograd graph)."""
    return [f for f in graph_findings(ctx) if f.kind == "ctc_targets_zeroed"]


def _monitor_findings(ctx: Context, tol: float) -> list[Finding]:
    out = []
    for rec in ctx.run.meta.get("loss_graph") or []:
        for head in rec.get("heads") or []:
            head = dict(head, chain=[{"op": op} for op in head.get("chain") or []],
                        link={"op": "cross_entropy" if head["loss"] == "soft_cross_entropy" else head["loss"]})
            got = judge(head, tol)
            if got is None:
                continue
            kind, links = got
            extra: dict[str, Any] = {"backward_at": rec.get("backward_at")}
            mods = [m for m in rec.get("modules") or [] if _module_matches(kind, m.get("type"))]
            if mods:
                extra["modules"] = mods
            out.append(_finding(kind, links, head, "autograd graph", extra))
    return out


def _module_matches(kind: str, type_name: str | None) -> bool:
    want = {"softmax_before_cross_entropy": ("Softmax",), "nll_loss_on_probabilities": ("Softmax",),
            "ctc_loss_on_probabilities": ("Softmax",),
            "sigmoid_before_bce_with_logits": ("Sigmoid",)}.get(kind, ())
    return type_name in want


BROADCAST_FIX = (
    "make the prediction and the target the same shape before the loss: `output.squeeze(-1)` for a model "
    "with one output per sample (or `target.unsqueeze(-1)` / `target.view_as(output)`); as it is, the loss "
    "compares every prediction with every target of the batch, and the model learns their batch mean"
)


def _broadcast_findings(ctx: Context) -> list[Finding]:
    """A regression loss that broadcast its prediction against its target (capture/_loss_watch)."""
    for rec in ctx.run.meta.get("loss_graph") or []:
        for head in rec.get("heads") or []:
            if "broadcast_shape" not in head:
                continue
            pred, to = head["prediction_shape"], head["broadcast_shape"]
            b = rec.get("backward_at")
            where = f" (the loss backpropagated at {b['file']}:{b['line']})" if b else ""
            ev = {"source": "autograd graph", "loss": head["loss"], "prediction_shape": pred, "broadcast_shape": to,
                  "chain": [{"op": op} for op in head.get("chain") or []], "backward_at": b}
            return [Finding(kind="loss_broadcast", severity="error",
                            title=f"{head['loss']} broadcast predictions of shape {pred} against their targets to "
                                  f"{to}: every prediction is compared with every target{where}",
                            evidence=ev, suggestion=BROADCAST_FIX, source=SOURCE)]
    return []


def _pad_values(rec: dict, targets: float, th: Thresholds) -> dict[int, str]:
    """The padding values of the model's integer inputs in one loss-graph record, each with what shows
    it: the value a quarter of the input sequences end in a run of, or an embedding's padding_idx.
    Only for a token-level loss (more targets than the padded input's longest dimension)."""
    shown = [x for x in rec.get("inputs") or [] if targets > max(x.get("shape") or [math.inf])]
    if not shown:
        return {}
    out: dict[int, str] = {}
    for x in shown:
        f = x.get("facts") or {}
        if f.get("run_share", 0) >= th.pad_run_share and math.isfinite(f.get("value", math.nan)):
            name = f"input {x['input']}" if isinstance(x["input"], int) else f"`{x['input']}`"
            out.setdefault(int(f["value"]), f"{fmt(100 * f['run_share'])}% of {name}'s sequences "
                                             f"(dimension {x['dim']} of {x['shape']}) end in a run of it")
    for e in rec.get("padding_idx") or []:
        out.setdefault(int(e["padding_idx"]), f"{e['name']}'s padding_idx")
    return out


def _padding_findings(ctx: Context) -> list[Finding]:
    """A token-level cross entropy scoring the inputs' padding value as a target (no ignore_index for it)."""
    for rec in ctx.run.meta.get("loss_graph") or []:
        for head in rec.get("heads") or []:
            f = head.get("facts") or {}
            if head.get("loss") != "nll_loss" or "target_mode" not in f or f.get("target_ignored_share"):
                continue
            cls, share = int(f["target_mode"]), f["target_mode_share"]
            pads = _pad_values(rec, f["targets"], ctx.th)
            if share < ctx.th.pad_target_share or cls == head.get("ignore_index") or cls not in pads:
                continue
            b = rec.get("backward_at")
            where = f" (the loss backpropagated at {b['file']}:{b['line']})" if b else ""
            ev = {"source": "autograd graph", "class": cls, "share": share, "targets": int(f["targets"]),
                  "ignore_index": head.get("ignore_index"), "padding": pads[cls], "backward_at": b}
            fix = (f"pass ignore_index={cls} to the loss (nn.CrossEntropyLoss(ignore_index={cls}), "
                   f"F.cross_entropy(..., ignore_index={cls}); bentrevett/pytorch-seq2seq's TRG_PAD_IDX), or label "
                   "the padded positions -100: as it is, the model is trained to predict padding after each "
                   "sequence's end, and the loss (and any accuracy) counts those easy positions beside the real ones")
            return [Finding(kind="padding_in_loss", severity="warning",
                            title=f"cross entropy scores padding: {fmt(100 * share)}% of the targets are class {cls}, "
                                  f"the padding of the model's inputs ({pads[cls]}), and the loss does not ignore "
                                  f"it{where}",
                            evidence=ev, suggestion=fix, source=SOURCE)]
    return []


# Ops whose outputs are unbounded scores (a layer's own output): a soft dice over them is over logits.
_SCORE_OPS = frozenset({"convolution", "addmm", "mm", "bmm", "baddbmm", "linear", "matmul", "upsample_bilinear2d",
                        "upsample_nearest2d"})


def _dice_findings(ctx: Context) -> list[Finding]:
    """A soft dice ratio computed over a layer's raw outputs (capture/_loss_watch.soft_dice)."""
    for rec in ctx.run.meta.get("loss_graph") or []:
        for d in rec.get("dice") or []:
            chain = d.get("chain") or []
            if not chain or chain[0] not in _SCORE_OPS:
                continue
            b = rec.get("backward_at")
            where = f" (the loss backpropagated at {b['file']}:{b['line']})" if b else ""
            ev = {"source": "autograd graph", "made_by": chain[0], "chain": [{"op": op} for op in chain],
                  "backward_at": b}
            fix = ("pass probabilities to the dice loss: F.softmax(logits, dim=1) over the classes (multi-class, "
                   "as milesial/Pytorch-UNet's train.py does) or torch.sigmoid(logits) (one class); a dice over "
                   "unbounded scores is no overlap of masks: negative scores shrink its denominator, so the loss "
                   "rewards values that are no prediction")
            return [Finding(kind="dice_not_probabilities", severity="warning",
                            title=f"A soft dice loss (sum(x * target) / (sum(x) + ...)) is computed over {chain[0]}'s "
                                  f"raw outputs: scores, not probabilities in [0, 1]{where}",
                            evidence=ev, suggestion=fix, source=SOURCE)]
    return []


@register_rule("dice_not_probabilities")
def dice_not_probabilities(ctx: Context) -> list[Finding]:
    """A soft dice loss computed over values outside [0, 1] (logits, not probabilities)."""
    return [f for f in graph_findings(ctx) if f.kind == "dice_not_probabilities"]


@register_rule("padding_in_loss")
def padding_in_loss(ctx: Context) -> list[Finding]:
    """A token-level cross entropy whose frequent target is the inputs' padding value, not ignored."""
    return [f for f in graph_findings(ctx) if f.kind == "padding_in_loss"]


@register_rule("loss_broadcast")
def loss_broadcast(ctx: Context) -> list[Finding]:
    """A regression loss broadcast its prediction against the targets (read off the loss's autograd graph)."""
    return [f for f in graph_findings(ctx) if f.kind == "loss_broadcast"]


def recording_findings(run: Any, findings: list[dict]) -> list[dict]:
    """The loss-misuse findings of a recording that ``findings`` (those stored in it) lack:
    ``trainguard run`` without ``--monitor`` stores none, and its report still names them."""
    have = {f.get("kind") for f in findings}
    if have & (set(KINDS) | {"loss_broadcast", "ctc_targets_zeroed"}):
        return []
    ctx = Context(run, Thresholds())
    return [f.to_dict() for f in graph_findings(ctx)]


def graph_findings(ctx: Context) -> list[Finding]:
    """Every loss misuse in the run, one finding per kind (the recording's evidence first)."""
    cached = getattr(ctx, "_graph_findings", None)
    if cached is not None:
        return cached
    tol = ctx.th.prob_tolerance
    found: list[Finding] = []
    meta_heads = [h for rec in ctx.run.meta.get("loss_graph") or [] for h in rec.get("heads") or []]
    for head in recorded_heads(ctx.run):
        # The loss graph read in the same run knows values a summary cannot (row sums).
        same = next((h for h in meta_heads if h["loss"] == head["loss"]
                     and (h.get("chain") or [None])[:1] == [c["op"] for c in head["chain"]][:1]), None)
        if same is not None and same.get("facts"):
            head["facts"] = same["facts"]
        got = judge(head, tol)
        if got is not None:
            found.append(_finding(got[0], got[1], head, "recorded op graph", {}))
    found += _monitor_findings(ctx, tol)
    found += _broadcast_findings(ctx)
    found += _zeroed_findings(ctx)
    found += _padding_findings(ctx)
    found += _dice_findings(ctx)
    by_kind: dict[str, Finding] = {}
    for f in found:
        by_kind.setdefault(f.kind, f)
    ctx._graph_findings = list(by_kind.values())
    return ctx._graph_findings


def _rule(kind: str):
    def rule(ctx: Context) -> list[Finding]:
        return [f for f in graph_findings(ctx) if f.kind == kind]

    rule.__name__ = kind
    rule.__doc__ = f"{KINDS[kind][0]} (from the recorded op graph or the loss's autograd graph)."
    return register_rule(kind)(rule)


for _kind in KINDS:
    _rule(_kind)

__all__ = ["KINDS", "ctc_targets_zeroed", "graph_findings", "judge", "dice_not_probabilities", "loss_broadcast", "padding_in_loss", "recorded_heads", "recording_findings"]
