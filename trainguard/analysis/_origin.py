"""Where did the first harmful value come from? Walk back through producers and explain.

From the execution where the first harmful value became harmful (a NaN was made, or an inf
reached the loss, a gradient, a parameter or a value the program read; see docs/recorder.md),
follow the inputs on its way back to the origin, the op that made the value (or the inf it
came from) out of finite or intended inputs. Format-3 runs store each execution's origin, so
the walk follows it (and stops at a softmax that made NaN of a fully masked row, whose -inf
inputs were intended); older runs are walked through the inputs that were already non-finite.
Then the origin is explained from its inputs' summaries: ``log of an input with 3 zeros ->
-inf``, ``division by a zero denominator``, ``0 * inf -> NaN``. Pure functions over a reader;
nothing here imports torch.
"""

from __future__ import annotations

import ast
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard._errors import TrainguardError
from trainguard.analysis._context import fmt
from trainguard.analysis._suggest import clipping_words
from trainguard.store import ALIAS_OPS, REACHED, Run, is_collective

# Ops grouped by how they make non-finite values; names are short op names (``log``, ``div``).
_LOGS = {"log", "log2", "log10", "log_"}
# A lower bound only: clamp/clip may bound the maximum alone, which passes zeros on (its arguments
# are not recorded).
_CLAMPS = {"clamp_min"}
_DIVS = {"div", "div_", "reciprocal", "true_divide", "floor_divide", "remainder", "fmod"}
_SQRTS = {"sqrt", "sqrt_"}
_RSQRTS = {"rsqrt", "rsqrt_"}
_EXPS = {"exp", "exp_", "exp2", "expm1", "sinh", "cosh", "pow", "square"}
_ACCUM = {"mm", "addmm", "bmm", "matmul", "baddbmm", "sum", "mean", "linear", "conv2d", "convolution",
          "cumsum", "dot", "mv", "einsum", "_softmax", "softmax", "_log_softmax", "log_softmax"}
_MULS = {"mul", "mul_"}
# Averages: from finite values they make inf when the sum overflows, NaN only over no values (0/0).
_MEANS = {"mean"}
# Ops whose outputs are peers, any of which a consumer may read (the run records the producer, not
# which of its outputs was read).
_SPLITS = {"split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes", "chunk", "unsafe_chunk",
           "tensor_split", "unbind"}
# Reductions with Bessel's correction (default 1): they divide by N - correction.
_STDS = {"std", "var", "std_mean", "var_mean"}
_BATCH_NORMS = {"native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "miopen_batch_norm",
                "_batch_norm_with_update"}
_ADDCDIVS = {"addcdiv", "addcdiv_", "_foreach_addcdiv", "_foreach_addcdiv_"}
_ADDS = {"add", "add_", "sub", "sub_", "rsub", "addcmul", "addcdiv", "addcdiv_", "addcmul_", "lerp_", "lerp"}
_SOFTMAXES = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"}
_NLL = {"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss2d"}  # outputs: (loss, total_weight)
_CTC = {"_ctc_loss", "ctc_loss", "_cudnn_ctc_loss", "_use_cudnn_ctc_loss"}
_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math"}


def op_base(op: str) -> str:
    """``aten.log`` -> ``log``; ``aten.div.Tensor`` -> ``div``; ``aten._softmax`` -> ``_softmax``."""
    parts = op.split(".")
    if parts[0] in ("aten", "prims", "torch") and len(parts) > 1:
        parts = parts[1:]
    return parts[0]


@dataclass
class Link:
    """One execution on the way back to the origin."""

    seq: int
    op: str
    step: int
    phase: str
    module: str | None
    health: list[str]
    file: str | None
    line: int | None
    function: str | None
    explanation: str
    outputs: list[dict] = field(default_factory=list)
    inputs: list[dict] = field(default_factory=list)
    forward_op: dict | None = None  # backward ops: the forward op whose gradient this computes
    taint: str = "finite"  # finite, unknown, pending, harmful (docs/recorder.md)
    origin_seq: int | None = None  # the execution that made this value (pending/harmful)
    # Inputs made inside a compiled graph's decomposition of one eager op (softmax into amax,
    # sub, exp, sum, div) have no summary of their own: ``through`` names those ops (each once, in
    # the order they ran), ``sources``
    # are the summarised values they were computed from (as _input_info describes inputs).
    through: list[str] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)
    # A division by a count of 0: the comparison whose kept elements the denominator counts
    # (``{"op", "seq", "size", "file", "line"}``), when it kept none (see _counted_mask).
    mask: dict | None = None
    # The op ran inside an installed package (gpytorch's kernel, a transformers layer): that
    # package's line (``{"file", "path", "line", "function", "code"}``), which ``file``/``line`` (the
    # user's line that called it) do not show.
    library: dict | None = None
    # The class of the module the op ran in: a loss module called beside the model (smp's DiceLoss)
    # is a root of its own, whose path "" reads like the model's.
    module_type: str | None = None


@dataclass
class Origin:
    """The chain from a non-finite execution back to the op that first made NaN/Inf."""

    chain: list[Link]  # chain[0] is the execution asked about, chain[-1] the origin
    summary: str
    suggestion: str
    # How the value became harmful at chain[0] (nan, loss, gradient, optimizer, parameter, read),
    # when the run says so; ``harm`` is that sentence.
    reason: str | None = None
    harm: str | None = None
    # The run's first harmful value when the walk started where another one reached training
    # (see _damage_elsewhere): {seq, op, file, line, step, phase} of the op that made it.
    earlier: dict | None = None
    # Whether a harmful value with this origin reached the loss, a gradient, optimizer state or a
    # parameter by the end of the recording (meta.first_damage); None: the run does not say.
    reached_training: bool | None = None
    # The iteration the loop skipped itself because this value made its loss non-finite (the
    # program checked the loss and called no backward(), capture/_skips): {step, loss, file, line,
    # check}; None when no skipped iteration follows the origin.
    skipped: dict | None = None
    # Where the program read this value (``.item()``, ``float()``: aten._local_scalar_dense) when it
    # reached no training: {seq, step, file, line, exit_code}, exit_code when the script then exited
    # with an error (MAE's `if not math.isfinite(loss.item()): sys.exit(1)`); None otherwise.
    read: dict | None = None
    # An LR scheduler that read the value (ReduceLROnPlateau.step on a NaN validation metric), when
    # it reached no training otherwise: {steps, first_step, file, line} of the user's call.
    scheduler: dict | None = None
    # The step the script crashed in, when this value reached no training but went on into that
    # step's ops (detr's NaN image into generalized_box_iou's assert, which a comparison absorbs):
    # {step, error, nonfinite (that step's harmful executions), file, line (crash_at)}; None otherwise.
    crashed: dict | None = None

    @property
    def origin(self) -> Link:
        return self.chain[-1]

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "suggestion": self.suggestion, "reason": self.reason, "harm": self.harm,
                "origin": asdict(self.origin), "chain": [asdict(link) for link in self.chain],
                "earlier": self.earlier, "reached_training": self.reached_training, "skipped": self.skipped,
                "read": self.read, "scheduler": self.scheduler, "crashed": self.crashed}


def _count(summary: dict | None, key: str) -> int:
    if not summary:
        return 0
    v = summary.get(key)
    return int(v) if isinstance(v, (int, float)) and v == v else 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def describe_summary(summary: dict | None) -> str:
    """``1280 values: 3 zeros, 1277 positive`` from a stored summary (any mode)."""
    if not summary:
        return "no summary recorded"
    if "nonfinite" in summary:
        return "holds NaN or Inf" if summary["nonfinite"] else "finite"
    parts = []
    for key, word in (("nan", "NaN"), ("pos_inf", "+inf"), ("neg_inf", "-inf"), ("zero", "zero"),
                      ("neg", "negative"), ("pos", "positive")):
        n = _count(summary, key)
        if n:
            parts.append(_plural(n, word) if word == "zero" else f"{n} {word}")
    size = _count(summary, "size")
    text = f"{_plural(size, 'value')}" + (": " + ", ".join(parts) if parts else "")
    if isinstance(summary.get("min"), float) and summary["min"] == summary["min"]:
        text += f" (min {summary['min']:.4g}, max {summary['max']:.4g})"
    return text


def _is_bad(summary: dict | None) -> bool:
    if not summary:
        return False
    if "nonfinite" in summary:
        return bool(summary["nonfinite"])
    return any(_count(summary, k) for k in ("nan", "pos_inf", "neg_inf"))


def _input_info(run: Run, item: dict) -> dict:
    info: dict[str, Any] = {"slot": item["slot"], "kind": item["kind"]}
    prod = item.get("producer_digest")
    if item["kind"] == "op" and prod:
        fr = run.user_frame(prod["stack_id"])
        outs = prod["outputs"]
        summary = outs[0]["summary"] if outs else None
        description = describe_summary(summary)
        shape = outs[0].get("shape") if outs else None
        if (op_base(prod["op"]) in _SPLITS and len({repr((o.get("shape"), o.get("summary"))) for o in outs}) > 1
                and not any(_is_bad(o.get("summary")) for o in outs)):
            # Which piece this input is, the run does not say: output 0's values would be false evidence.
            # (Pieces holding NaN/Inf keep output 0's: the chain's reasons read who passed them on.)
            summary = shape = None
            sizes = [_count(o["summary"], "size") for o in outs if "size" in (o.get("summary") or {})]
            span = f", of {min(sizes)} to {max(sizes)} values" if sizes else ""
            description = (f"one of its {len(outs)} outputs (the run does not record which){span}"
                           + (f"; {sizes.count(0)} of them empty" if 0 in sizes else ""))
        info.update(
            producer=prod["seq"], producer_op=prod["op"], summary=summary, description=description,
            shape=shape, dtype=outs[0].get("dtype") if outs else None,
            file=fr["filename"] if fr else None, line=fr["lineno"] if fr else None,
            taint=prod.get("taint"), origin_seq=prod.get("origin"), producer_phase=prod.get("phase"),
        )
        if prod.get("origin") not in (None, prod["seq"]) and prod.get("taint") == "pending":
            # The op that made the pending inf this input passed on (a log of zeros whose -inf an add,
            # a view and a split carried into a softmax): what _from_log tells a mask from.
            try:
                made = run.execution(prod["origin"])
            except KeyError:
                made = None
            if made is not None:
                mfr = run.user_frame(made["stack_id"])
                info.update(origin_op=made["op"], origin_file=mfr["filename"] if mfr else None,
                            origin_line=mfr["lineno"] if mfr else None,
                            origin_summary=made["outputs"][0]["summary"] if made["outputs"] else None)
    elif item["kind"] == "op":
        info.update(producer=item.get("producer"), description="its producer is no longer in the run (evicted)")
    elif item["kind"] in ("param", "buffer"):
        info.update(name=item.get("name"), description=f"{item['kind']} {item.get('name')}")
    else:
        info.update(description="a tensor not produced by a recorded op (user input or constant)")
    return info


def _unknown(summary: dict | None) -> bool:
    """Whether a stored summary is the unknown one (every count NaN) that an op inside a
    compiled graph's decomposition of an eager op gets (no summary at all, as in no_tensor
    mode, is not that)."""
    counts = [v for k, v in (summary or {}).items() if k != "size"]
    return bool(counts) and all(isinstance(v, float) and v != v for v in counts)


def _through(run: Run, inputs: list[dict], limit: int = 16) -> tuple[list[str], list[dict]]:
    """The ops without a summary behind ``inputs`` (walked back up to ``limit`` of them) and the
    summarised values they were computed from."""
    through: dict[int, str] = {}
    sources: list[dict] = []
    seen: set[int] = set()
    todo = [i for i in inputs if i["kind"] == "op" and i.get("producer") is not None and _unknown(i.get("summary"))]
    while todo:
        i = todo.pop(0)
        if not _unknown(i.get("summary")):
            if all(j.get("producer") != i.get("producer") for j in sources):
                sources.append(i)
            continue
        seq = i["producer"]
        if seq in seen or len(seen) >= limit:
            continue
        seen.add(seq)
        try:
            e = run.execution(seq)
        except KeyError:
            continue
        through[seq] = op_base(e["op"])
        todo.extend(j for j in (_input_info(run, x) for x in e["inputs"])
                    if j["kind"] == "op" and j.get("producer") is not None and j.get("summary") is not None)
    # Each op name once, in the order the graph ran them.
    return list(dict.fromkeys(through[k] for k in sorted(through))), sources


# Installed packages whose frames are the machinery, never the place a user looks for a cause;
# but torch.distributions is code the user calls with values of their own (a Normal's scale).
_NOT_LIBRARY = ("torch", "functorch", "torchgen", "triton", "trainguard")
_DISTRIBUTIONS = "torch/distributions/"


def _library_frame(run: Run, stack_id: int | None) -> dict | None:
    """The innermost frame of an installed package inside the user's innermost frame, with its line."""
    if stack_id is None:
        return None
    frames = run.stack(stack_id)
    user = max((i for i, f in enumerate(frames) if f["user"]), default=-1)
    for f in reversed(frames[user + 1:]):
        name = f["filename"].replace("\\", "/")
        cut = next((name.split(d, 1)[1] for d in ("/site-packages/", "/dist-packages/") if d in name), None)
        if cut is None or (cut.split("/", 1)[0] in _NOT_LIBRARY and not cut.startswith(_DISTRIBUTIONS)):
            continue
        try:
            lines = run.source(f["filename"]).splitlines()
            code = lines[f["lineno"] - 1].strip() if 0 < f["lineno"] <= len(lines) else None
        except KeyError:
            code = None
        # ``path``: inside the package folder, as the user would look it up (gpytorch/kernels/kernel.py)
        return {"file": f["filename"], "path": cut, "line": f["lineno"], "function": f["name"], "code": code}
    return None


def _link(run: Run, seq: int) -> Link:
    e = run.execution(seq)
    fr = run.user_frame(e["stack_id"])
    inputs = [_input_info(run, i) for i in e["inputs"]]
    through, sources = _through(run, inputs)
    fwd = None
    if e["phase"] == "backward" and e.get("fwd_seq") is not None:
        try:
            f = run.execution(e["fwd_seq"])
            ffr = run.user_frame(f["stack_id"])
            fwd = {"seq": f["seq"], "op": f["op"], "file": ffr["filename"] if ffr else None,
                   "line": ffr["lineno"] if ffr else None}
        except KeyError:
            fwd = {"seq": e["fwd_seq"], "op": None, "file": None, "line": None}
    link = Link(
        seq=e["seq"], op=e["op"], step=e["step"], phase=e["phase"], module=e["module"], health=e["health"],
        file=fr["filename"] if fr else None, line=fr["lineno"] if fr else None,
        function=fr["name"] if fr else None, explanation="",
        outputs=[{"dtype": o["dtype"], "shape": o["shape"], "summary": o["summary"],
                  "description": describe_summary(o["summary"])} for o in e["outputs"]],
        inputs=inputs, forward_op=fwd, taint=e.get("taint", "finite"), origin_seq=e.get("origin"),
        through=through, sources=sources, library=_library_frame(run, e["stack_id"]),
        module_type=e.get("module_type"),
    )
    link.mask = _counted_mask(run, link)
    link.explanation = explain(link)
    if _IGNORED in link.explanation:
        value = _ignore_index(run, link)
        if value is not None:
            link.explanation = explain(link, ignore_index=value)
    return link


# Ops a count passes through on its way to the denominator (summed over micro-batches, divided
# among processes, cast), and the comparisons that make the mask it counts.
_COUNT_PASS = {"add", "add_", "sub", "div", "div_", "mul", "mul_", "_to_copy", "to", "clone", "view", "reshape",
               "squeeze", "unsqueeze", "expand", "detach", "alias", "lift_fresh", "copy_"}
_COMPARISONS = {"ne", "eq", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "isfinite",
                "isnan", "isinf", "bitwise_and", "bitwise_or", "bitwise_not"}


def _counted_mask(run: Run, link: Link) -> dict | None:
    """For a division by a zero denominator that counts the elements a mask keeps (a masked mean:
    ``(loss * mask).sum() / mask.sum()``, transformers' LabelSmoother over the labels that are not
    -100): the comparison that made the mask, which kept none."""
    if op_base(link.op) not in ("div", "div_", "true_divide") or len(link.inputs) < 2:
        return None
    den = link.inputs[1]
    if den.get("kind") != "op" or not _count(den.get("summary"), "zero"):
        return None
    seq = den.get("producer")
    for _ in range(8):
        try:
            e = run.execution(seq)
        except (KeyError, TypeError):
            return None
        base = op_base(e["op"])
        # the count is the first input all the way back (count + 0, count / world_size, count.float())
        src = e["inputs"][0].get("producer_digest") if e["inputs"] and e["inputs"][0].get("kind") == "op" else None
        if src is None or (base not in _COUNT_PASS and base not in ("sum", "count_nonzero")):
            return None
        if base in _COUNT_PASS:
            seq = src["seq"]
            continue
        if op_base(src["op"]) not in _COMPARISONS:
            return None
        out = src["outputs"][0] if src["outputs"] else {}
        fr = run.user_frame(src["stack_id"])
        return {"op": src["op"], "seq": src["seq"], "size": (out.get("summary") or {}).get("size"),
                "file": fr["filename"] if fr else None, "line": fr["lineno"] if fr else None}
    return None


_IGNORED = "ignore_index (-100 unless set)"
_IGNORE_KWARG = re.compile(r"\bignore_index\s*=\s*([^,()\s]+)")


def _ignore_index(run: Run, link: Link) -> str | None:
    """The ignore_index of a loss over no target, where the run says it: the keyword on the
    call's line (``ignore_index=0``, ``ignore_index=pad_id``), or else the value every target
    holds when no class weights could have made their weight 0 instead (the targets' summary:
    stats' min and max, or all zeros)."""
    if link.file and link.line:
        try:
            lines = run.source(link.file).splitlines()
        except KeyError:
            lines = []
        text = ""
        for ln in lines[link.line - 1:link.line + 5]:  # a call over several lines, to its last
            text += ln + " "
            if text.count("(") <= text.count(")"):
                break
        m = _IGNORE_KWARG.search(text)
        # ``ignore_index=self.ignore_index`` names nothing the message does not already say
        if m and m.group(1).rsplit(".", 1)[-1] != "ignore_index":
            return m.group(1)
    if op_base(link.op) in _NLL and len(link.inputs) == 2:  # (input, target): no weight tensor
        t = link.inputs[1].get("summary") or {}
        size = t.get("size")
        if size:
            lo, hi = t.get("min"), t.get("max")
            if isinstance(lo, float) and lo == hi and math.isfinite(lo):
                return str(int(lo))
            if _count(t, "zero") == size:
                return "0"
    return None


def explain(link: Link, ignore_index: str | None = None) -> str:
    """A plain-language reason why this op's output is non-finite, from its inputs' summaries
    (``ignore_index``: a loss's, where the run says it)."""
    base = op_base(link.op)
    ins = link.inputs
    made = "/".join(link.health) or "a non-finite value"
    bad_inputs = [i for i in ins if _is_bad(i.get("summary"))]
    known = _masked_rows(link) or _ctc_unalignable(link)
    if known:
        return known
    if _arrived_in_storage(link):
        return (f"{base} put the tensor onto memory that no recorded op wrote, and it held {made} already: a batch "
                "a DataLoader worker process built arrives this way, through shared memory (the worker's ops run in "
                "another process and are not recorded), as does a tensor unpickled or loaded from a file")
    if bad_inputs and link.origin_seq is not None and link.origin_seq == link.seq and link.taint != "finite":
        bad_inputs = []  # the run says the value was made here: its inputs' infinities were intended
    if bad_inputs:
        i = bad_inputs[0]
        others = [j for j in ins if j is not i]
        if base in _MULS and any(_count(j.get("summary"), "zero") for j in others) and (
                _count(i.get("summary"), "pos_inf") or _count(i.get("summary"), "neg_inf")):
            return "0 * inf -> NaN: one input holds infinities and the other zeros"
        if base in _ADDS and "nan" in link.health and not _count(i.get("summary"), "nan"):
            return "inf - inf -> NaN: infinities of opposite sign meet"
        src = i.get("producer_op") or i.get("name") or "an input"
        return f"{base} passed on the non-finite values of input {i['slot']} ({src})"
    held = [i for i in ins if i["kind"] in ("param", "buffer")]
    if (held and link.origin_seq is not None and link.origin_seq != link.seq
            and all(i["kind"] in ("op", "param", "buffer") for i in ins)):
        # The value was made elsewhere and reached this op through a parameter or buffer (stored by
        # name, without a summary of its own): a noise schedule's buffer made at construction.
        if len(held) == 1:
            i = held[0]
            return f"{base} passed on the non-finite values that input {i['slot']} ({i['kind']} {i['name']}) holds"
        names = ", ".join(f"{i['kind']} {i['name']}" for i in held)
        return f"{base} passed on the non-finite values that one of its inputs ({names}) holds"
    gone = [i for i in ins if i["kind"] == "op" and i.get("summary") is None]
    if gone and link.origin_seq is not None and link.origin_seq != link.seq and link.taint == "harmful":
        # The run says the value was made elsewhere (#origin) and came in: through an input whose
        # execution is not stored (a circular buffer's eviction, the monitor's recording that keeps
        # one harmful execution per op type and step), so no summary shows it; not an overflow.
        return (f"{base} passed on the non-finite values made by #{link.origin_seq}, through input "
                f"{gone[0]['slot']} (its execution is not stored in the run)")
    empty = _empty_input(link)
    if empty is not None:
        src = empty.get("producer_op") or empty.get("name") or "an input"
        if (empty.get("summary") or {}).get("size") != 0:
            return (f"{base} reduced an empty input to {made}: from finite values a mean is NaN only when it "
                    f"averages no values (0/0), so input {empty['slot']} ({src}, {empty.get('description')}) was "
                    "empty")
        return (f"{base} reduced an empty input to {made}: input {empty['slot']} ({src}) holds 0 values, and "
                "the mean of no values is 0/0")
    ignored = _IGNORED if ignore_index is None else f"ignore_index ({ignore_index})"
    if _no_target_counted(link):
        return (f"{base} averaged over no target: every target is {ignored} or weighs 0, "
                "so the total weight is 0 and the mean is 0/0")
    if _compiled_no_target(link):
        through = link.through or [op_base(link.inputs[0].get("producer_op") or "sum")]
        return (f"the loss averaged over no target: every target is {ignored} or weighs 0, "
                f"so the total weight (input 1, 0) is 0 and the mean is 0/0 (inside the compiled graph's nll_loss: "
                f"{', '.join(through)}, then {base} by the count of targets it kept)")
    via = received_input(link)
    if via is not None:
        return (f"{base} read what {via['producer_op']} (#{via['producer']}) wrote: the non-finite value came "
                "from another rank")
    if link.phase == "backward" and link.forward_op and link.forward_op.get("op"):
        fbase = op_base(link.forward_op["op"])
        return f"the gradient of {fbase} is {made} here: " + _forward_reason(fbase)
    garbage = uninitialised_input(link)
    if garbage is not None:
        return (f"{base} computed on uninitialised memory: input {garbage['slot']} is what "
                f"{garbage['producer_op']} (#{garbage['producer']}) allocated, and nothing wrote it before this op "
                f"read it; it holds whatever the allocator left there, and the {made} came from it")
    if link.through:  # some input has no summary of its own
        src = link.sources[0] if link.sources else None
        behind = (f"; they were computed from {src.get('producer_op')} (#{src.get('producer')}), which holds "
                  f"{src.get('description')}") if src else ""
        return (f"{base} made {made} from values the compiled graph computed without a summary of their own "
                f"({', '.join(link.through)}){behind}")
    s0 = ins[0].get("summary") if ins else None
    if base in _LOGS:
        zeros, negs = _count(s0, "zero"), _count(s0, "neg")
        if zeros or negs:
            bits = []
            if zeros:
                bits.append(f"{_plural(zeros, 'zero')} -> -inf")
            if negs:
                bits.append(f"{negs} negative -> NaN")
            return f"log of an input with {', '.join(bits)}"
        return f"log made {made} (no summary of its input shows zeros)"
    if base in _ADDCDIVS:
        # self + value * tensor1 / tensor2 (a foreach op's inputs: n of each, n its outputs)
        n = max(len(link.outputs), 1)
        num, den = ins[n:2 * n], ins[2 * n:3 * n]
        zeros = sum(_count(i.get("summary"), "zero") for i in den)
        if zeros:
            tail = (" (0/0 -> NaN where tensor1 is zero too)"
                    if "nan" in link.health and any(_count(i.get("summary"), "zero") for i in num) else "")
            return (f"{base} divides by tensor2, which holds {_plural(zeros, 'zero')}{tail}; in an optimizer's "
                    "update m / (sqrt(v) + eps) that is an eps of 0 over zero second moments")
    if link.mask is not None:
        m = link.mask
        where = f" at {m['file']}:{m['line']}" if m.get("file") else ""
        size = f" of {int(m['size'])}" if isinstance(m.get("size"), (int, float)) and m["size"] == m["size"] else ""
        tail = " (0/0 -> NaN where the numerator is zero too)" if "nan" in link.health else ""
        return (f"division by a count of 0: the denominator counts the elements the mask {m['op']} (#{m['seq']}{where}) "
                f"keeps, and it kept none{size}: every element was masked out (e.g. labels all ignore_index, or padding){tail}")
    if base in _DIVS:
        denom = ins[1].get("summary") if len(ins) > 1 else s0
        zeros = _count(denom, "zero")
        if base == "reciprocal":
            return f"reciprocal of an input with {_plural(zeros, 'zero')} -> inf" if zeros else f"reciprocal made {made}"
        if zeros:
            tail = " (0/0 -> NaN where the numerator is zero too)" if _count(s0, "zero") and "nan" in link.health else ""
            return f"division by a zero denominator: {_plural(zeros, 'zero')} in the denominator{tail}"
        if len(ins) < 2 or ins[1]["kind"] != "op":
            return "division by a zero denominator (a scalar or unrecorded tensor)"
        if "nan" in link.health and all(_finite_known(i.get("summary")) for i in ins[:2]):
            # Summaries without zero counts (curt_health): a quotient of finite values overflows
            # to inf, never to NaN.
            return "0/0 -> NaN: the numerator and the denominator are both zero where the NaN is"
        return f"division made {made}: the quotient overflowed"
    if base in _SQRTS:
        negs = _count(s0, "neg")
        return f"sqrt of {negs} negative values -> NaN" if negs else f"sqrt made {made}"
    if base in _RSQRTS:
        return f"rsqrt of an input with {_plural(_count(s0, 'zero'), 'zero')} and {_count(s0, 'neg')} negative values"
    if _power_of_zero(link):
        return (f"{base} of an input with {_plural(_count(s0, 'zero'), 'zero')} -> +inf: a negative power of 0 "
                "(1 / 0)")
    unseen = [i for i in ins if i["kind"] not in ("op", "param", "buffer")]
    if base in _EXPS and not _nan_from_unseen(link):
        mx = (s0 or {}).get("max")
        if isinstance(mx, float) and mx == mx:
            return f"{base} overflow: input max {mx:.4g}"
        return _overflow_bound(base, link)
    if base in _STDS and "nan" in link.health and _reduced_count(link) == 1:
        return (f"{base} over 1 value -> NaN: with its default correction (Bessel's, correction=1) it divides by "
                "N - 1 = 0 (a batch, episode or group of one)")
    if base in _ACCUM and not unseen:  # an input never summarised may have held the value already
        return f"overflow in {base}: finite inputs accumulate past the dtype's largest value"
    if base in _BATCH_NORMS and len(link.outputs) >= 5 and _is_bad(link.outputs[-1].get("summary")):
        # It returns 3 or 4 tensors; in training the running statistics follow (capture/_taint.STATS_WRITES).
        dtype = link.outputs[-1].get("dtype") or "its dtype"
        return (f"the batch's variance overflowed {dtype}: {base} wrote {made} into running_var, the module's "
                "buffer, while its normalised output stayed finite; in eval mode the layer then maps every input "
                "to its bias")
    if base in ("lift_fresh", "lift_fresh_copy"):
        if any(_count(o.get("summary"), "size") > 1 for o in link.outputs):
            # a row or batch: the data (a DataLoader's collate converting a NumPy row, torch.tensor(rows))
            return (f"values from outside torch (a NumPy array or a Python list: the data) became a tensor here "
                    f"holding {made}: no recorded op made them")
        return (f"a Python constant holding {made} became a tensor here (`x[...] = float('nan')`, "
                "`torch.tensor(...)`): no recorded op made the value")
    number = _nan_from_number(link)
    if number is not None:
        return (f"{base} made {made} of finite values and a Python number (an operand that is no recorded "
                f"tensor): the number was {number}")
    if unseen:
        return (f"{base} made {made} from input {unseen[0]['slot']}, which came from outside the recording "
                "(the data, or a tensor made before recording started): its values were never summarised and "
                f"may have held {made} already")
    held = [i for i in ins if i["kind"] in ("param", "buffer") and i.get("summary") is None]
    if held and link.origin_seq in (None, link.seq):
        # no recorded op wrote it: its values are those it had when the recording began
        i = held[0]
        verb = "held" if base in _PASS_THROUGH else "may have held"
        kind = "parameter" if i["kind"] == "param" else i["kind"]
        return (f"{base} made {made} from input {i['slot']} ({kind} {i['name']}), which no recorded op wrote: it "
                f"{verb} {made} before the recording began (an update made before it: an EMA teacher's, the weights "
                "a guard's replay starts from)")
    return f"{base} turned finite inputs into {made}"


# The largest finite value of each floating dtype (torch.finfo(dtype).max).
_LARGEST = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
            "float16": 65504.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _overflow_bound(base: str, link: Link) -> str:
    """An exp-like overflow without the input's max (only stats summaries have one): where the
    op passes the output dtype's largest value."""
    dtype = next((o.get("dtype") for o in link.outputs if o.get("dtype")), None)
    top = _LARGEST.get(dtype)
    if top is None:
        return f"{base} overflow: an input value too large for the dtype"
    if base in ("pow", "square"):
        bound = f"{math.sqrt(top):.3g}"
        if base == "pow":  # the exponent is not recorded: the square's bound, as an example
            return f"pow overflow: an input value too large for a power in {dtype} (x**2 passes its largest value above about {bound})"
        return f"square overflow: an input value too large for {dtype} (above about {bound})"
    bound = math.log2(top) if base == "exp2" else math.log(2 * top) if base in ("sinh", "cosh") else math.log(top)
    return f"{base} overflow: an input value too large for {dtype} (above about {bound:.3g})"


def _masked_rows(link: Link) -> str | None:
    """softmax (or attention) NaN from -inf inputs: a row with every position masked."""
    base = op_base(link.op)
    if "nan" not in link.health or not link.inputs:
        return None
    s0 = link.inputs[0].get("summary")
    if base in _SOFTMAXES and not _count(s0, "nan") and not _count(s0, "pos_inf") and (
            _count(s0, "neg_inf") or (s0 or {}).get("nonfinite")):
        what = "log_softmax" if "log" in base else "softmax"
        if _from_log(link):
            src = link.inputs[0]
            if op_base(src.get("producer_op") or "") in _LOGS:
                log = f"{src['producer_op']}, #{src.get('producer')}"
            else:  # carried here from the log by other ops
                at = f" at {src['origin_file']}:{src['origin_line']}" if src.get("origin_file") else ""
                log = f"{src['origin_op']}{at}, #{src['origin_seq']}"
            return (f"{what} over a row whose inputs are all -inf -> NaN: the row's max is -inf, and -inf - (-inf) "
                    f"is NaN; the -infs are the log of zeros ({log}), not a mask")
        return (f"{what} over a row whose inputs are all -inf (a fully masked row) -> NaN: "
                "the row's max is -inf, and -inf - (-inf) is NaN")
    if base in _ATTENTION and not any(_count(i.get("summary"), "nan") for i in link.inputs):
        return "attention over a row whose positions are all masked -> NaN (no key left to attend to)"
    # A compiled graph's softmax, decomposed: its row maxima and exponentials have no summary,
    # and the scores they were computed from are the first summarised values behind them.
    if {"amax", "exp"} <= set(link.through) and link.sources:
        s = link.sources[0].get("summary")
        if not _count(s, "nan") and not _count(s, "pos_inf") and _count(s, "neg_inf"):
            what = "log_softmax" if "log" in link.through or base == "log" else "softmax"
            return (f"{what} over a row whose inputs are all -inf (a fully masked row) -> NaN: the row's max is "
                    f"-inf, and -inf - (-inf) is NaN (inside the compiled graph's {what}: "
                    f"{', '.join(link.through)}, then {base})")
    return None


def _ctc_unalignable(link: Link) -> str | None:
    """CTC loss +inf: a sample whose target no alignment fits into its input frames."""
    if op_base(link.op) not in _CTC or "+inf" not in link.health or not link.outputs:
        return None
    loss = link.outputs[0].get("summary")
    n, size = _count(loss, "pos_inf"), _count(loss, "size")
    which = f"{n} of {size} samples" if n and size else "a sample"
    return (f"the CTC loss is +inf for {which}: no alignment fits the target into the input's frames, which "
            "needs at least one frame per label plus one for a blank between each pair of repeated labels; the "
            "target is too long for the input length (after the model's downsampling)")


def _reduced_count(link: Link) -> int | None:
    """How many values a reduction reduced into each of its outputs (input size over output size)."""
    shapes = [link.inputs[0].get("shape") if link.inputs else None, link.outputs[0].get("shape") if link.outputs else None]
    if any(s is None for s in shapes):
        return None
    n_in, n_out = (math.prod(s) for s in shapes)
    return n_in // n_out if n_out else None


def _from_log(link: Link) -> bool:
    """A softmax whose -inf inputs a log made (of zeros), not a mask."""
    src = link.inputs[0] if link.inputs else {}
    if src.get("kind") != "op":
        return False
    if op_base(src.get("producer_op") or "") in _LOGS:
        return True
    # A log whose -inf other ops carried here; not the log of a 0/1 mask (only 0 and -inf out),
    # an additive mask made that way.
    made = src.get("origin_summary")
    mask = _count(made, "zero") and not _count(made, "neg") and not _count(made, "pos")
    return op_base(src.get("origin_op") or "") in _LOGS and not mask


# ``Tensor.set_`` onto a storage: the tensor's values are whatever that memory holds.
_STORAGE_SETS = frozenset({"aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset"})


def _arrived_in_storage(link: Link) -> bool:
    """A tensor set onto memory no recorded op wrote, that made its non-finite value itself (a batch a
    DataLoader worker sent through shared memory; a deepcopy's set_ keeps its source's origin)."""
    return (link.op in _STORAGE_SETS and link.phase != "backward"
            and link.origin_seq in (None, link.seq))


def _empty_input(link: Link) -> dict | None:
    """The input with no values of an op that made NaN from it (a mean, or a loss averaged, over an
    empty batch or selection: only an average makes a value out of nothing, and it is 0/0)."""
    if "nan" not in link.health:
        return None
    empty = next((i for i in link.inputs if (i.get("summary") or {}).get("size") == 0), None)
    if empty is None and op_base(link.op) in _MEANS and link.health == ["nan"] and link.inputs \
            and link.inputs[0]["kind"] in ("op", "param", "buffer") and not _is_bad(link.inputs[0].get("summary")):
        # NaN and no inf from a recorded input that held none: an overflow makes inf, so 0/0 over no
        # values is what is left (the input's own summary may be unknown: a piece of a split)
        return link.inputs[0]
    return empty


def _no_target_counted(link: Link) -> bool:
    """An nll_loss whose second output, the total weight of the targets it counted, is 0."""
    if "nan" not in link.health or op_base(link.op) not in _NLL or len(link.outputs) < 2:
        return False
    weight = link.outputs[1].get("summary") or {}
    if "zero" in weight:
        return weight.get("size") == 1 and _count(weight, "zero") == 1
    # Summaries without zero counts (curt_health): from finite log-probabilities and a finite
    # total weight, the mean is NaN only as 0/0.
    return bool(link.inputs) and _finite_known(weight) and _finite_known(link.inputs[0].get("summary"))


def _compiled_no_target(link: Link) -> bool:
    """Inductor's nll_loss_forward (F.cross_entropy's mean), decomposed: the sum of the kept
    targets' log-probabilities (no summary of its own) divided by their count cast to float, a
    single 0 when every target is ignore_index. Under summaries without zero counts
    (check_numerics' curt_health) the sum has a summary, and a NaN quotient of two finite values
    says the count is 0 (0/0)."""
    if "nan" not in link.health or op_base(link.op) not in ("div", "div_") or len(link.inputs) < 2:
        return False
    num, den = link.inputs[0], link.inputs[1]
    if den.get("producer_op") not in ("prims.convert_element_type", "aten._to_copy"):
        return False
    if not (link.through or den.get("producer_op") == "prims.convert_element_type"):
        return False  # not inside a compiled graph
    weight = den.get("summary") or {}
    if "zero" in weight:
        return _unknown(num.get("summary")) and weight.get("size") == 1 and _count(weight, "zero") == 1
    return num.get("producer_op") == "aten.sum" and _finite_known(num.get("summary")) and _finite_known(weight)


def _finite_known(summary: dict | None) -> bool:
    """Whether a stored summary says all its values are finite (no_tensor and shape say nothing)."""
    has_health = any(k in (summary or {}) for k in ("nonfinite", "nan", "pos_inf", "neg_inf"))
    return has_health and not _unknown(summary) and not _is_bad(summary)


def _nan_from_unseen(link: Link) -> bool:
    """NaN and no inf from an op with an input from outside the recording (a batch made before a
    guard's replay): no overflow of finite values makes that (an exp or a power overflows to inf),
    the input held it."""
    return (all("inf" not in h for h in link.health)
            and any(i["kind"] not in ("op", "param", "buffer") for i in link.inputs))


# Elementwise ops that take a Python number as an operand (``x * 0.5``, ``x + eps``, ``1 - x``).
_NUMBER_OPERAND = frozenset({"mul", "mul_", "add", "add_", "sub", "sub_", "rsub"})


def _nan_from_number(link: Link) -> str | None:
    """What the Python number of ``x * number`` (``+``, ``-``) was, when the op made NaN of
    recorded finite tensors and that number: no recorded tensor holds a number (a wrapped scalar),
    so the only operand that can have held NaN (or +-inf, times the input's zeros) is the number
    itself. None when that is not the case."""
    base = op_base(link.op)
    if base not in _NUMBER_OPERAND or link.phase == "backward" or "nan" not in link.health:
        return None
    overload = link.op.split(".")[-1] if link.op.count(".") >= 2 else ""
    ins = link.inputs
    if not ins or any(i["kind"] not in ("op", "param", "buffer") or not _finite_known(i.get("summary")) for i in ins):
        return None
    if not (overload == "Scalar" or (overload == "Tensor" and [i["slot"] for i in ins] == [0])):
        return None  # both operands are tensors: one was recorded finite, the other not at all
    if any("inf" in h for h in link.health):
        return "+-inf (inf times the input's zeros is NaN)"
    zeros = _count(ins[0].get("summary"), "zero") if base.startswith("mul") else 0
    return f"NaN, or +-inf times the input's {_plural(zeros, 'zero')}" if zeros else "NaN"

def _power_of_zero(link: Link) -> bool:
    """``x ** p`` with ``p < 0`` where ``x`` holds zeros (a node's degree of 0 in a GCN
    normalisation written by hand, ``deg.pow(-0.5)``): no more ``+inf`` than the base has zeros.
    The exponent is not recorded; an overflow of a positive power needs large values, not zeros."""
    if op_base(link.op) not in ("pow", "pow_") or not link.inputs or not link.outputs:
        return False
    zeros = _count(link.inputs[0].get("summary"), "zero")
    infs = _count(link.outputs[0].get("summary"), "pos_inf")
    return 0 < infs <= zeros


def _forward_reason(fbase: str) -> str:
    if fbase in _SQRTS or fbase in ("norm", "linalg_vector_norm", "vector_norm"):
        return f"d/dx {fbase}(x) divides by {fbase}(x), which is 0 at x = 0 (e.g. the norm of a zero vector)"
    if fbase in _LOGS:
        return "d/dx log(x) = 1/x is infinite at x = 0"
    if fbase in _DIVS:
        return "the gradient of a division divides by the squared denominator, which is 0 here"
    if fbase == "pow":
        return "the gradient of pow(x, p) with p < 1 is infinite at x = 0"
    if fbase in _STDS:
        return (f"d/dx {fbase}(x) divides by the std, which is 0 where every value reduced is the same (a constant "
                "row): 0/0 -> NaN, even when the std is clamped or has an epsilon added after it")
    return "the backward formula of this op made it out of finite values"


_SUGGESTIONS = {
    "masked": "every row needs at least one unmasked position: check the padding or attention mask (a "
    "sequence of length 0 masks its whole row), handle empty sequences before attention, or fill the masked "
    "scores with a large finite negative, torch.finfo(scores.dtype).min, instead of -inf",
    "log": "clamp the input before the log, e.g. torch.log(p.clamp(min=1e-6)); for a softmax followed by log, "
    "use torch.log_softmax or F.cross_entropy, which never take the log of 0",
    "log_clamped": "the input is already clamped ({where}) and still holds zeros: its lower bound is 0 (an eps or "
    "min of 0.0, e.g. a loss built with eps=0): clamp at a positive value, e.g. torch.log(p.clamp(min=1e-7)), or give "
    "the loss a positive eps",
    "log_sigmoid": "the log is taken of a sigmoid's output (a binary cross-entropy written by hand), which rounds "
    "to exactly 0 or 1 once a logit is large: take it on the logits instead, F.logsigmoid(x) for "
    "log(sigmoid(x)){complement}, or compute the loss with F.binary_cross_entropy_with_logits / "
    "nn.BCEWithLogitsLoss on the logits (a clamp or nn.BCELoss only bounds the log at a finite value)",
    "log_distribution": "the log is torch.distributions' own ({where}): it takes the log of a parameter the code "
    "gave the distribution (a Normal's scale, a Gamma's rate), which holds {held}: keep it above 0 where it is made, "
    "std = F.softplus(x) + 1e-5, or clamp the log-std before exp, std = log_std.clamp(-20, 2).exp(); leave "
    "validate_args on (torch's default; pyro.enable_validation(True)) to stop at the constructor instead",
    "div": "keep the denominator away from zero: x / (d + 1e-8) or x / d.clamp(min=1e-8)",
    "div_distribution": "the division is torch.distributions' own ({where}): its denominator is made from a "
    "parameter the code gave the distribution, which holds zeros (a Normal's scale: the std collapsed to 0). Keep "
    "it above 0 where it is made: clamp the log-std before exp, std = log_std.clamp(-20, 2).exp() (as SAC implementations do), or "
    "std = F.softplus(x) + 1e-5; leave validate_args on (torch's default) to stop at the constructor instead",
    "div_count": "the denominator is a count that was 0 (nothing matched): divide by it clamped to at least 1, "
    "x / n.clamp(min=1) (a mean over no elements is then 0), or skip the batch when n == 0; an epsilon added to "
    "a count of 0 divides by the epsilon instead",
    "sqrt": "add an epsilon inside the root, torch.sqrt(x + 1e-12), or clamp(min=0) a value that can dip below 0",
    "norm": "the norm of a zero vector has no gradient (0/0): write it with an epsilon inside the root, "
    "torch.sqrt((x ** 2).sum(dim) + 1e-12) for x.norm(2, dim=dim) (a WGAN-GP penalty over a critic that is flat at "
    "some points), or mask the rows whose vector is all zeros",
    "pow_zero": "a negative power of 0 is inf: clamp the base first, x.clamp(min=1e-12) ** p, or set the infinities "
    "to 0 right after, as PyG's gcn_norm does for nodes of degree 0 "
    "(deg_inv_sqrt.masked_fill_(deg_inv_sqrt == float('inf'), 0)), or add self loops so that no degree is 0",
    "pow_grad": "x ** p with 0 < p < 1 has an infinite gradient where x is 0 (a focal loss's (1 - pt) ** gamma with "
    "gamma < 1 once pt rounds to 1): keep the base off 0, e.g. (1 - pt).clamp(min=1e-6) ** gamma, or use an exponent "
    ">= 1 (gamma >= 1)",
    "exp": "subtract the maximum first (logsumexp / softmax do) or clamp the input, e.g. x.clamp(max=80)",
    "power": "an input holds values too large to raise to this power in its dtype: normalise the input (data "
    "straight from a loader: `trainguard doctor` validates it), clamp it before the power, e.g. "
    "x.clamp(-1e4, 1e4) ** 2, or compute the power in float64",
    "exp_scale": "this exp is a scale (it multiplies a value: a flow's coupling scale, z * exp(s); a VAE's "
    "std = exp(0.5 * logvar); a Gaussian's exp(log_std)), and its exponent grew past the dtype's range: bound the "
    "exponent where it is made, e.g. s = torch.tanh(s) or a soft clamp s = c * torch.tanh(s / c) (normflows' "
    "AffineCouplingBlock(scale_map='sigmoid'); a log-std clamped to [-20, 2]), and lower the learning rate if the "
    "updates grew it",
    "power_updated": "the values raised to this power grew after {updates} of this recording: a divisor the "
    "updates shrank towards 0 (a kernel's lengthscale, a temperature, a std) or weights they grew make the input "
    "this large: lower the learning rate, and keep such a divisor away from 0 (a positive constraint with a floor, "
    "e.g. F.softplus(raw) + 1e-4, gpytorch's GreaterThan(1e-4)); or clamp the input before the power, or compute "
    "it in float64",
    "exp_negated": "the exponent is minus a product (exp(-x * d)) and overflowed because x is negative: x is a rate or "
    "a density (NeRF's sigma in alpha = 1 - exp(-sigma * delta), an attenuation, a decay), which must not be negative: "
    "pass it through F.relu or F.softplus before the exp (nerf-pytorch's raw2alpha applies F.relu to the raw density); "
    "clamping the exponent would leave alpha = 1 - e^80 and train on negative densities",
    "softplus": "log(1 + exp(x)) is torch.nn.functional.softplus(x), which computes it without overflow (x itself "
    "where x is large)",
    "empty": "the batch is empty: check the mask or index that selects it (a split at fixed indices past the "
    "dataset's size, a filter that keeps nothing, a last batch of 0 rows), and skip an empty batch before the "
    "loss, e.g. `if target.numel() == 0: continue`",
    "ignored": "no target of the batch counts: each is ignore_index (padding, or labels masked to -100) or has "
    "weight 0; check the label masking (a sequence shorter than its prompt masks every label; a masked-LM collator "
    "with mlm_probability 0, as transformers' DataCollatorForLanguageModeling under run_mlm.py --mlm_probability 0, "
    "masks no token), skip such a batch "
    "(`if (labels != -100).any():`), or sum the loss and divide by max(count, 1)",
    "std": "a std or var over one value is NaN with the default correction: pass correction=0 (unbiased=False), "
    "or skip the normalisation when there is a single value, e.g. `if x.numel() > 1:`",
    "std_grad": "take the square root yourself with the epsilon inside: torch.sqrt(x.var(dim, keepdim=True) + 1e-5) "
    "instead of x.std(dim) (as nn.LayerNorm does), or detach the std when no gradient should flow through it",
    "mask_count": "no element of the batch passes the mask the denominator counts (labels all -100 or padding, an "
    "all-zero attention mask): check the label masking (a sequence shorter than its prompt masks every label), "
    "skip such a batch (`if mask.any():`), or divide by the count clamped to 1, "
    "`(loss * mask).sum() / mask.sum().clamp_min(1)`",
    "ctc": "pass zero_infinity=True (nn.CTCLoss(zero_infinity=True), F.ctc_loss(..., zero_infinity=True); for "
    "transformers' CTC models, config.ctc_zero_infinity=True) so that such a sample adds 0 to the loss and "
    "gradient, or drop the samples whose target is longer than their output frames, or downsample the input less",
    "uninitialised": "write the tensor before anything reads it: torch.zeros, torch.ones or torch.randn instead of "
    "torch.empty (or fill it first with .zero_() or .copy_()); a dummy input made with torch.empty for a shape or "
    "FLOP probe is such a tensor",
    "accum": "values are overflowing: lower the learning rate or clip gradients (torch.nn.utils.clip_grad_norm_)",
    "number": "a Python number this line computes with is NaN or inf (`x * float('nan')`; a scale, weight or "
    "temperature computed with math or NumPy from a zero or an empty list, e.g. np.mean([]) or 0.0 / 0.0 in "
    "NumPy): check it where it is made, e.g. `assert math.isfinite(scale)`",
    "constant": "the code wrote this value itself (a log-probability of 0 for a sample outside a bounded support, "
    "as a uniform base distribution's log_prob does; a sentinel): keep it out of the loss, e.g. "
    "torch.where(torch.isfinite(log_p), log_p, 0) or a loss over the finite rows only, or use a distribution whose "
    "support covers the data (a Gaussian base for a flow)",
    "written": "the code wrote this value into a tensor that training read later (a sample of the data set, "
    "`x[i, j] = float('inf')`, or state kept across steps): repair or drop that sample before training, e.g. "
    "torch.nan_to_num(x, posinf=..., neginf=...) or keep the rows where torch.isfinite(x).all(dim=1); "
    "`trainguard doctor` validates a data set",
    "input": "the data or the parameters already held NaN/Inf: check the inputs (trainguard doctor validates data) "
    "and the previous step",
    "array": "the array converted here already held NaN/Inf before torch saw it (a data set's sample, an "
    "environment's observation or reward, a file): check it where it is made, e.g. "
    "`assert np.isfinite(a).all()`, and repair or drop those values there (np.nan_to_num, a gymnasium "
    "observation wrapper); `trainguard doctor` validates a data set",
    "table": "the array held {made} before torch saw it, in every step; only the steps whose indices pick those "
    "entries go wrong: check it where it is computed, e.g. `assert np.isfinite(table).all()` (NumPy warns \"divide by "
    "zero encountered\" at the line that made an inf). A diffusion schedule whose alphas_cumprod reaches 0 at the last "
    "timestep makes sqrt(1 / alphas_cumprod) inf there: cap each beta below 1 (max_beta=0.999 in "
    "betas_for_alpha_bar, or np.clip(betas, 0, 0.999)); for samples indexed by their positions, repair or drop "
    "those samples where they are read",
    "loader_array": "a sample the DataLoader fetched already held NaN/Inf before torch saw it: the data set holds it "
    "(a missing value in the file it reads: an empty CSV cell that pandas reads as NaN, which a StandardScaler "
    "keeps; or a value its __getitem__ computes): find those samples, e.g. "
    "`[i for i in range(len(ds)) if not np.isfinite(ds[i][0]).all()]` or `df.isna().sum()`, and fill or drop them "
    "where the data is read (df.interpolate(), df.dropna()); `trainguard doctor` validates a data set",
    "worker": "a DataLoader worker process built this batch, so its samples held NaN/Inf when the data set "
    "handed them out (the worker's ops are not recorded): find them, e.g. "
    "`[i for i in range(len(ds)) if not torch.isfinite(torch.as_tensor(ds[i][0])).all()]`, and repair or drop them "
    "where the data is read; run once with num_workers=0 to have the recording follow the value back to the line "
    "that made it; `trainguard doctor` validates a data set",
    "received": "this rank only received the value from another rank: see the report of the rank that made it "
    "(trainguard report RUN names it on its first line; --rank K details one rank)",
}


def uninitialised_input(link: Link) -> dict | None:
    """The input of ``link`` that is uninitialised memory (an ``empty*`` output, or a view or copy
    of one, never written: the recorder's taint "unknown"), if any. A tensor of no values holds no
    memory to be uninitialised: opacus' DPDataLoader makes an empty batch with ``torch.empty``."""
    return next((i for i in link.inputs if i.get("kind") == "op" and i.get("taint") == "unknown"
                 and (i.get("summary") or {}).get("size") != 0), None)


def received_input(link: Link) -> dict | None:
    """The input of ``link`` that a collective wrote (values from other ranks), if any."""
    return next((i for i in link.inputs if i.get("kind") == "op" and is_collective(i.get("producer_op"))), None)


# Floating types narrow enough that computing the op in float32 avoids the overflow.
_NARROW = frozenset({"float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})


def fed_back(run: Run, link: Link) -> int | None:
    """The input slot of a forward ``link`` that the same line, in an earlier pass of a loop, fed
    back (``x = a * x + b``: the ``add`` that made input ``x`` took the output of an earlier ``mul``
    of the same frames); None if there is none, or its producers were evicted. A producer on the
    same line alone is no loop: ``conv(torch.full(...))`` makes its input on its own line."""
    if link.phase != "forward":
        return None
    frames: dict[int | None, tuple] = {}

    def where(stack_id: int | None) -> tuple:  # stack ids differ per op of one line: compare frames
        if stack_id not in frames:
            frames[stack_id] = tuple((f["filename"], f["lineno"]) for f in run.stack(stack_id)) if stack_id else ()
        return frames[stack_id]

    try:
        me = run.execution(link.seq)
        here = where(me["stack_id"])
        if not here:
            return None
        for inp in me["inputs"]:
            p = inp.get("producer_digest")
            if not p or where(p.get("stack_id")) != here:
                continue
            for q in run.execution(p["seq"])["inputs"]:
                d = q.get("producer_digest")
                if d and d.get("op") == me["op"] and d["seq"] < p["seq"] and where(d.get("stack_id")) == here:
                    return int(inp["slot"])
                if q.get("evicted") and op_base(p["op"]).rstrip("_") in _loop_assignment(run, link.file, link.line):
                    return int(inp["slot"])  # the circular buffer dropped the earlier pass: the line tells
    except (KeyError, TrainguardError):  # evicted or damaged: no loop to show
        return None
    return None


def made_in_loader(run: Run, link: Link) -> bool:
    """Whether ``link`` ran inside a DataLoader's fetch (a Dataset's ``__getitem__``, a collate): a
    value it made is part of a sample of the data, however few values it has."""
    try:
        frames = run.stack(run.execution(link.seq)["stack_id"])
    except (KeyError, TrainguardError):  # evicted or damaged: no stack to read
        return False
    return any("/torch/utils/data/" in str(f.get("filename", "")).replace("\\", "/") for f in frames)


# Ops whose output holds only values of their first input (a sigmoid's output reshaped, indexed or
# cast on its way to the log): the recorder's aliases, and selections of part of the input.
_PASS_THROUGH = frozenset({op_base(n) for n in ALIAS_OPS} | {"select", "slice", "expand", "contiguous", "_to_copy"})


def _clamped_at_zero(link: Link) -> str | None:
    """When a log's input is a clamp's output that holds zeros (``p.clamp_min(eps)`` with eps = 0:
    segmentation_models_pytorch's DiceLoss(log_loss=True, eps=0.0) on a class absent from the
    batch): the clamp, as ``op at file:line``; else None."""
    first = link.inputs[0] if link.inputs else None
    if not first or first.get("kind") != "op" or op_base(first.get("producer_op") or "").rstrip("_") not in _CLAMPS:
        return None
    if not _count(first.get("summary"), "zero"):
        return None
    op = first["producer_op"]
    name = str(first.get("file") or "").replace("\\", "/").rsplit("/", 1)[-1]
    where = f"{op} at {name}:{first['line']}" if name else op
    lib = link.library
    return where + (f", inside {lib['path']}:{lib['line']}" if lib else "")


def log_of_sigmoid(run: Run, link: Link) -> str | None:
    """When a log's input is a sigmoid's output, through reshapes, or one minus it (a binary
    cross-entropy written by hand): ``"sigmoid"`` or ``"1 - sigmoid"``; else None (or evicted)."""
    if op_base(link.op) not in _LOGS:
        return None
    complement = False
    try:
        digest = next((i.get("producer_digest") for i in run.execution(link.seq)["inputs"]), None)
        for _ in range(8):
            if not digest:
                return None
            base = op_base(digest["op"]).rstrip("_")
            if base == "sigmoid":
                return "1 - sigmoid" if complement else "sigmoid"
            if base == "rsub" and not complement:
                complement = True  # 1 - x (torch's rsub.Scalar)
            elif base not in _PASS_THROUGH:
                return None
            digest = next((i.get("producer_digest") for i in run.execution(digest["seq"])["inputs"]), None)
    except (KeyError, TrainguardError):
        return None
    return None


def parameter_behind_view(run: Run, link: Link) -> str | None:
    """When an exp's input is a parameter read through reshapes or an expand (cleanrl's
    ``torch.exp(self.actor_logstd.expand_as(mean))``): its name, ``""`` when the run knows it only
    as what the optimizer wrote; else None (or evicted)."""
    if op_base(link.op) not in ("exp", "exp_") or link.phase != "forward":
        return None
    try:
        inputs = run.execution(link.seq)["inputs"]
        for _ in range(8):
            first = inputs[0] if inputs else None
            if first is None:
                return None
            if first.get("kind") == "param":
                return first.get("name") or ""
            digest = first.get("producer_digest")
            if not digest:
                return None
            if digest.get("phase") == "optimizer":
                return ""
            if op_base(digest["op"]).rstrip("_") not in _PASS_THROUGH:
                return None
            inputs = run.execution(digest["seq"])["inputs"]
    except (KeyError, TrainguardError):
        return None
    return None


def negated_exponent(run: Run, link: Link) -> bool:
    """Whether an exp's input is minus something, negated on the exp's own line and reached through
    products and views (nerf's ``1. - torch.exp(-act_fn(raw) * dists)``): ``exp(-x * d)``, whose
    overflow means a negative rate, not a large logit."""
    if op_base(link.op) not in ("exp", "exp_") or link.phase != "forward" or link.file is None:
        return False
    try:
        inputs = run.execution(link.seq)["inputs"]
        for _ in range(6):
            digest = inputs[0].get("producer_digest") if inputs else None
            if not digest:  # evicted from the circular buffer: the line says
                return _source_negates_exp(run, link.file, link.line)
            fr = run.user_frame(digest["stack_id"])
            if fr is None or (fr["filename"], fr["lineno"]) != (link.file, link.line):
                return False
            base = op_base(digest["op"]).rstrip("_")
            if base == "neg":
                return True
            if base not in _PASS_THROUGH | {"mul", "div"}:
                return False
            ins = run.execution(digest["seq"])["inputs"]
            # a product: follow the factor made on this line by a negation, else the first
            inputs = sorted(ins, key=lambda i: op_base((i.get("producer_digest") or {}).get("op", "")) != "neg")
    except (KeyError, TrainguardError):
        return False
    return False


def _source_negates_exp(run: Run, file: str, line: int | None) -> bool:
    """Whether the stored source's ``line`` calls ``exp`` on minus a value or minus a product
    (``torch.exp(-x * d)``, ``(-x * d).exp()``)."""
    try:
        tree = ast.parse(run.source(file).splitlines()[line - 1].strip())
    except (KeyError, IndexError, TypeError, SyntaxError):
        return False

    def negated(e: ast.expr) -> bool:
        while isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Mult, ast.Div)):
            e = e.left
        return isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("exp", "exp_"):
                arg = node.args[0] if node.args else getattr(node.func, "value", None)
                if arg is not None and negated(arg):
                    return True
    return False


def inner_update(run: Run, link: Link) -> dict | None:
    """The input of a forward ``link`` that the program made itself, inside the step, by a gradient
    step on a weight: MAML's fast weights ``w - lr * grad`` of a ``torch.autograd.grad`` (a
    backward-pass output), read through views (``F.linear``'s ``t``); ``{"slot", "file", "line"}``
    of that update's line, else None (or evicted)."""
    if link.phase != "forward":
        return None

    def from_backward(digest: dict | None) -> bool:
        return bool(digest) and digest.get("phase") == "backward"

    try:
        for inp in run.execution(link.seq)["inputs"]:
            p = inp.get("producer_digest")
            for _ in range(4):  # views of the update: w.t(), w.view(...)
                if not p or op_base(p["op"]).rstrip("_") not in _PASS_THROUGH:
                    break
                p = next((i.get("producer_digest") for i in run.execution(p["seq"])["inputs"]), None)
            if not p or p.get("phase") != "forward" or op_base(p["op"]).rstrip("_") not in ("sub", "add"):
                continue
            for q in run.execution(p["seq"])["inputs"]:
                d = q.get("producer_digest")
                scaled = (d and op_base(d["op"]).rstrip("_") in ("mul", "div")
                          and any(from_backward(r.get("producer_digest")) for r in run.execution(d["seq"])["inputs"]))
                if from_backward(d) or scaled:  # w - lr * g, or torch.add(w, g, alpha=-lr)
                    fr = run.user_frame(p["stack_id"])
                    return {"slot": int(inp["slot"]), "file": fr["filename"] if fr else None,
                            "line": fr["lineno"] if fr else None}
    except (KeyError, TrainguardError):
        return None
    return None


def _inner_learning_rate(inner: dict) -> str:
    """An overflow whose input is a weight the step adapted itself (:func:`inner_update`)."""
    where = f" at {os.path.basename(inner['file'])}:{inner['line']}" if inner.get("file") else ""
    return (f"values are overflowing: input {inner['slot']} is a weight the program adapted itself inside this "
            f"step{where}, a gradient step of its own (w - lr * grad on torch.autograd.grad's gradients, as "
            "MAML's inner loop takes on its fast weights), not the optimizer's: that inner learning rate made "
            "the weights this large; lower it (MAML uses 0.01-0.4), or take fewer inner steps")


# The ops an expression's outermost operator runs as (``a * x + b`` is an add).
_BINOPS = {ast.Add: {"add"}, ast.Sub: {"sub", "rsub"}, ast.Mult: {"mul"}, ast.Div: {"div"},
           ast.MatMult: {"matmul", "mm", "bmm", "addmm", "baddbmm"}, ast.Pow: {"pow"}}


def _loop_assignment(run: Run, file: str | None, line: int | None) -> set[str]:
    """When the stored source's ``line`` assigns a name from an expression that reads it
    (``x = a * x + b``) inside a ``for``/``while`` loop of the same function: the ops its
    outermost operator runs as (``{"add"}``), which made the value fed back; else empty."""
    try:
        lines = run.source(file).splitlines()
        tree = ast.parse(lines[line - 1].strip())
    except (KeyError, IndexError, TypeError, SyntaxError):
        return set()
    stmt = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(stmt, ast.Assign):
        targets, value = {t.id for t in stmt.targets if isinstance(t, ast.Name)}, stmt.value
    elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
        targets, value = {stmt.target.id}, ast.BinOp(left=stmt.target, op=stmt.op, right=stmt.value)
    else:
        return set()
    if not targets & {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}:
        return set()
    if isinstance(value, ast.BinOp):
        ops = _BINOPS.get(type(value.op), set())
    elif isinstance(value, ast.Call) and isinstance(value.func, (ast.Attribute, ast.Name)):
        name = value.func.attr if isinstance(value.func, ast.Attribute) else value.func.id
        ops = {name.rstrip("_")}
    else:
        return set()
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    for text in reversed(lines[: line - 1]):
        stripped = text.lstrip()
        if not stripped or stripped.startswith("#") or len(text) - len(stripped) >= indent:
            continue
        if stripped.startswith(("for ", "while ", "async for ")):
            return ops
        if stripped.startswith(("def ", "async def ", "class ")):
            return set()
        indent = len(text) - len(stripped)
    return set()


def _overflow_before_any_update(fed: int | None) -> str:
    """An overflow in the first step's forward pass: no update made it (johnma2006/mamba-minimal's
    selective scan with the sign of A dropped was told to lower the learning rate)."""
    text = ("values are overflowing in the forward pass of step 0, before any optimizer step of this recording: "
            "with the initial weights no learning rate made them this large; the forward computation itself grows "
            "them")
    if fed is not None:
        return (f"{text}: input {fed} is made by this same line (a loop feeding it back, as in x = a * x + b), "
                "a recurrence whose factor above 1 in magnitude grows the values geometrically with the loop's length; "
                "keep the factor below 1 (a decay written exp(-softplus(.)) or -exp(log_a), a gate, a normalisation "
                "inside the loop)")
    return f"{text}: check the scale of the initialisation and of the inputs (normalise them)"


def _python_ref(name: str) -> str:
    """A parameter's dotted name as Python that reaches it from the model: a ModuleList's index
    is a subscript (``layers.1.A_log`` is ``layers[1].A_log``), a key that is no identifier a
    ModuleDict's (``["a-b"]``)."""
    out = ""
    for part in name.split("."):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}"
        else:
            out += f"[{part!r}]"
    return out


def _exp_of_parameter(name: str, initial: bool = False, decay: bool = False) -> str:
    """The exp of a parameter overflowed: a learned log-scale or log-temperature (CLIP's
    ``logit_scale.exp()``) that the updates grew past the dtype's range, not a computation whose
    maximum can be subtracted. ``initial``: in the first forward pass, before any update: the
    value it was initialised with (open_clip's ``init_logit_scale``) is too large. ``decay``: the
    exp is negated next, ``A = -torch.exp(A_log)``, a state-space model's log decay rate (Mamba's):
    bounded from above only, since a value below 0 is a slow decay, no fault."""
    named = f" '{name}'" if name else ""
    ref = "model" + _python_ref(name) if name else ("A_log" if decay else "logit_scale")
    if decay:
        clamp = f"`with torch.no_grad(): {ref}.clamp_(max=math.log(1e4))`"
        what = (f"the exponent is the parameter{named}, a learned log decay rate (A = -exp(A_log), as in "
                "Mamba's selective scan; a rate of 1e4 already forgets the state in one step)")
    else:
        clamp = f"`with torch.no_grad(): {ref}.clamp_(0, math.log(100))` (a log-std: `.clamp_(-20, 2)`)"
        what = (f"the exponent is the parameter{named} (a learned log-scale, as CLIP's logit_scale or a Gaussian "
                "policy's log-std)")
    bound = "as open_clip does, " if not decay else ""
    if initial:
        start = ("initialise it lower, as Mamba does, `torch.log(torch.arange(1, d_state + 1))`" if decay else
                 "initialise it lower, as CLIP does, `nn.Parameter(torch.tensor(math.log(1 / 0.07)))` "
                 "(2.66, a temperature of 0.07)")
        return (f"{what}, whose initial value is already too large for exp: this is the forward pass of step 0, "
                f"before any optimizer step of this recording; {start}, and keep it "
                f"bounded after each optimizer.step() {bound}{clamp}")
    return (f"{what}, which the optimizer grew past what exp can hold: bound it after each optimizer.step(), "
            f"{bound}{clamp}, and/or give it a lower learning rate")


def _as_scale(consumers: list[str]) -> bool:
    """Whether the ops after an exp (nearest first) multiply it into a value (``z * exp(s)``, then a
    ``cat``, ``add`` or ``sub``: normflows' coupling), not summed or divided next as in a softmax
    written by hand (``exp(x) * mask / sum``)."""
    bases = [op_base(op) for op in consumers[:2]]
    softmax = bases[1:2] in (["sum"], ["sum_"]) or (len(bases) > 1 and bases[1] in _DIVS)
    return bases[:1] in (["mul"], ["mul_"]) and not softmax


def _made_by_an_op(link: Link) -> bool:
    """Whether the op's first input was made by a recorded op of the program (not converted from
    data: ``lift_fresh`` of a NumPy array or a list)."""
    p = link.inputs[0].get("producer_op") if link.inputs else None
    return bool(p) and op_base(p) not in ("lift_fresh", "lift_fresh_copy")


# Ops that read entries of their first input by index: a table looked up per batch.
_LOOKUPS = frozenset({"index", "index_select", "gather", "take", "embedding"})


def table_lookup(link: Link, consumers: list[str]) -> bool:
    """Whether ``link`` converted a 1-D array from outside torch that an indexing op read next (its
    first consumer): a table of constants looked up per batch (DiT's diffusion schedule,
    ``th.from_numpy(arr)[timesteps]``), whose non-finite entry only some batches pick."""
    return (op_base(link.op) in ("lift_fresh", "lift_fresh_copy") and link.phase != "backward"
            and bool(consumers) and op_base(consumers[0]) in _LOOKUPS
            and any(len(o.get("shape") or ()) == 1 and _count(o.get("summary"), "size") > 1 for o in link.outputs))


def _into_log_one_plus(consumers: list[str]) -> bool:
    """Whether the ops after the origin (nearest first) take ``log1p`` of it, or ``log`` of it plus
    something (``log(1 + exp(x))``)."""
    bases = [op_base(op) for op in consumers[:2]]
    return bases[:1] == ["log1p"] or (bases[:1] in (["add"], ["add_"]) and bases[1:2] == ["log"])


# The gap between a narrow float type's values just below 1.
_SPACING = {"bfloat16": "2^-8", "float16": "2^-11", "float8_e4m3fn": "2^-4", "float8_e4m3fnuz": "2^-4",
            "float8_e5m2": "2^-3", "float8_e5m2fnuz": "2^-3"}


def _narrow_difference(link: Link) -> str | None:
    """The dtype, when the division's denominator (its second input) holds zeros made by a
    subtraction in float16 or bfloat16 (values that differ by less than the dtype's spacing
    cancel to 0: ``1 - alphas_cumprod`` at small t); else None."""
    if len(link.inputs) < 2:
        return None
    d = link.inputs[1]
    dtype = str(d.get("dtype") or "").replace("torch.", "")
    if dtype not in _NARROW or op_base(d.get("producer_op") or "") not in ("sub", "sub_", "rsub"):
        return None
    return dtype if _count(d.get("summary"), "zero") else None


def _integer_denominator(link: Link) -> bool:
    """Whether the division's denominator (its second input) holds integers: a count."""
    if len(link.inputs) < 2:
        return False
    dtype = str(link.inputs[1].get("dtype") or (link.inputs[1].get("summary") or {}).get("dtype") or "")
    return dtype.replace("torch.", "") in ("int64", "int32", "int16", "int8", "uint8")


def suggest(link: Link, first_forward: bool = False, fed: int | None = None, consumers: list[str] | None = None,
            log_of: str | None = None, held: bool = False, exp_param: str | None = None,
            loader: bool = False, clipping: dict | None = None, inner: dict | None = None,
            negated: bool = False, neg_exponent: bool = False) -> str:
    """A concrete fix for the origin op, naming a value where one applies. ``first_forward``:
    a recording whose step 0 had no update before it (a guard's replay of step N records from
    step 0 too, with trained weights: not that); ``fed``: the input a loop fed back (:func:`fed_back`);
    ``consumers``: the ops the value went through after ``link``, nearest first; ``log_of``: what a
    log's input is (:func:`log_of_sigmoid`); ``held``: the value became harmful in a later step than
    it was made (it sat in a tensor meanwhile), or was made in a sample of the data (:func:`made_in_loader`)
    or went through the model (:func:`_fed_to_model`); ``exp_param``: the parameter an exp's input is, read
    through reshapes (:func:`parameter_behind_view`); ``loader``: made in a DataLoader's fetch
    (:func:`made_in_loader`); ``clipping``: how the loop clips its gradients (the run's ``clipping``), if it does;
    ``inner``: the input the step adapted itself by a gradient step (:func:`inner_update`); ``negated``:
    the value is negated next on the line that made it (``A = -torch.exp(A_log)``: a decay rate);
    ``neg_exponent``: an exp's input is minus a product made on its line (:func:`negated_exponent`)."""
    consumers = consumers or []
    if received_input(link) is not None:
        return _SUGGESTIONS["received"]
    if _arrived_in_storage(link):
        return _SUGGESTIONS["worker" if loader else "input"]
    if uninitialised_input(link) is not None:
        return _SUGGESTIONS["uninitialised"]
    if _masked_rows(link):
        return _SUGGESTIONS["log" if _from_log(link) else "masked"]
    if _ctc_unalignable(link):
        return _SUGGESTIONS["ctc"]
    if link.mask is not None:
        return _SUGGESTIONS["mask_count"]
    if _empty_input(link) is not None:
        return _SUGGESTIONS["empty"]
    if _no_target_counted(link) or _compiled_no_target(link):
        return _SUGGESTIONS["ignored"]
    base = op_base(link.op)
    if link.phase == "backward" and link.forward_op and link.forward_op.get("op"):
        base = op_base(link.forward_op["op"])
        if base in ("norm", "linalg_vector_norm"):
            return _SUGGESTIONS["norm"]
        elif base in _STDS:
            return _SUGGESTIONS["std_grad"]
    if base in _LOGS:
        if log_of is not None:
            complement = " and F.logsigmoid(-x) for log(1 - sigmoid(x))" if log_of == "1 - sigmoid" else ""
            return _SUGGESTIONS["log_sigmoid"].format(complement=complement)
        clamped = _clamped_at_zero(link)
        if clamped is not None:
            return _SUGGESTIONS["log_clamped"].format(where=clamped)
        if link.library and link.library["path"].startswith(_DISTRIBUTIONS):
            lib, held = link.library, link.inputs[0].get("summary") if link.inputs else None
            what = [_plural(n, w) for n, w in ((_count(held, "neg"), "negative value"), (_count(held, "zero"), "zero"))
                    if n]
            return _SUGGESTIONS["log_distribution"].format(
                where=f"{lib['path']}:{lib['line']} in {lib['function']}", held=" and ".join(what) or "values <= 0")
        return _SUGGESTIONS["log"]
    if link.phase != "backward" and _power_of_zero(link):
        return _SUGGESTIONS["pow_zero"]
    if (link.phase == "backward" and base == "pow" and link.inputs
            and _count(link.inputs[0].get("summary"), "zero")):
        return _SUGGESTIONS["pow_grad"]
    if base in _DIVS:
        if link.phase != "backward" and _integer_denominator(link):
            return _SUGGESTIONS["div_count"]
        cancelled = _narrow_difference(link)
        if cancelled is not None:
            return (f"the zeros in the denominator are a difference taken in {cancelled}, whose values just below 1 "
                    f"are {_SPACING.get(cancelled, 'far')} apart (0.9999 rounds to 1, and 1 - 0.9999 is 0): compute it "
                    "in float32, e.g. (1 - a.float()), and cast back after the division; then " + _SUGGESTIONS["div"])
        if link.library and link.library["path"].startswith(_DISTRIBUTIONS):
            lib = link.library
            return _SUGGESTIONS["div_distribution"].format(where=f"{lib['path']}:{lib['line']} in {lib['function']}")
        return _SUGGESTIONS["div"]
    if base in _SQRTS or base in _RSQRTS:
        return _SUGGESTIONS["sqrt"]
    if base in _EXPS and not _nan_from_unseen(link):
        if base in ("exp", "exp_") and link.phase == "forward":
            # the exponent is a parameter: by name once its module ran, else as what the optimizer wrote
            param = next((i.get("name") or "" for i in link.inputs if i.get("kind") == "param"
                          or i.get("producer_phase") == "optimizer"), exp_param)
            if param is not None:
                return _exp_of_parameter(param, initial=first_forward and link.step == 0,
                                         decay=negated)
        if base in ("pow", "square"):
            if link.phase != "backward" and (link.step or 0) > 0 and not loader and not held and _made_by_an_op(link):
                # made in this step from what the updates changed, not data straight from a loader (gpytorch's
                # kernels run in an autograd.Function outside any module: the "other" phase)
                n = link.step if first_forward else None
                return _SUGGESTIONS["power_updated"].format(
                    updates=f"{n} update{'s' if n != 1 else ''}" if n is not None else "the updates")
            return _SUGGESTIONS["power"]
        if base == "exp" and _into_log_one_plus(consumers):
            return _SUGGESTIONS["softplus"]
        if base in ("exp", "exp_") and _as_scale(consumers):
            return _SUGGESTIONS["exp_scale"]
        if neg_exponent:
            return _SUGGESTIONS["exp_negated"]
        return _SUGGESTIONS["exp"]
    if base in _STDS and _reduced_count(link) == 1:
        return _SUGGESTIONS["std"]
    if (base in ("lift_fresh", "lift_fresh_copy") and link.phase != "backward"
            and all(_count(o.get("summary"), "size") == 1 for o in link.outputs)):
        # one value: a constant the code wrote (``-np.inf``), not a batch read from the data; kept
        # in a tensor until a later step read it, it was written into the data (``x[5, 3] = inf``);
        # a NaN is no sentinel (a log-probability is -inf): written into the data too
        nan = any(_count(o.get("summary"), "nan") for o in link.outputs)
        return _SUGGESTIONS["written" if held or nan else "constant"]
    if base in ("lift_fresh", "lift_fresh_copy") and link.phase != "backward":
        # a row or batch from NumPy or a list: nothing recorded made it; a DataLoader fetched a sample of the data set
        if not loader and table_lookup(link, consumers):
            return _SUGGESTIONS["table"].format(made="/".join(link.health) or "non-finite values")
        return _SUGGESTIONS["loader_array" if loader else "array"]
    if _nan_from_number(link) is not None:
        return _SUGGESTIONS["number"]
    if base not in _ACCUM and not any(i.get("summary") for i in link.inputs):
        return _SUGGESTIONS["input"]  # nothing recorded made its inputs: they came in non-finite
    if _nan_from_unseen(link):  # the ops that make NaN of finite values are judged above
        return _SUGGESTIONS["input"]
    narrow = any(str(o.get("dtype", "")).replace("torch.", "") in _NARROW for o in link.outputs)
    if inner is not None:
        return _inner_learning_rate(inner) + (", or compute this op in float32" if narrow else "")
    if first_forward and link.step == 0 and link.phase == "forward":
        return _overflow_before_any_update(fed) + (", or compute this op in float32" if narrow else "")
    text = _SUGGESTIONS["accum"]
    if clipping:
        # a clipped gradient still makes a step as large as the learning rate allows
        text = ("values are overflowing: lower the learning rate; " + clipping_words(clipping, norms=False)
                + ": a clipped step is still as large as the learning rate makes it")
    if any(str(o.get("dtype", "")).replace("torch.", "") == "float16" for o in link.outputs):
        # float16's range is the fault first (autocast's --amp); the learning rate only if the values should be smaller
        return (FLOAT16_OVERFLOW + "; if the values should not be this large, "
                + text.removeprefix("values are overflowing: "))
    if narrow:
        return text + ", or compute this op in float32"  # whose range holds what overflowed here
    return text


FLOAT16_OVERFLOW = (
    "values overflow float16's range (largest 65504), which float32 and bfloat16 hold: compute this op in float32 "
    "(its inputs `.float()` inside `torch.autocast(device, enabled=False)`) or train in bfloat16 "
    "(`torch.autocast(device, dtype=torch.bfloat16)`, no GradScaler needed); check the inputs' scale too "
    "(normalise them)"
)


def _fed_to_model(run: Run, chain: list[Link]) -> bool:
    """The value was written outside any module and went through one that is not a loss on its way
    to the harm: a sample the model read (a full-batch graph's node features, written before the
    first epoch and read in that same step 0), not a sentinel the code keeps in its loss (a flow's
    log-density, which meets no module)."""
    if chain[-1].module is not None:
        return False
    for link in chain[:-1]:
        if link.module is None:
            continue
        try:
            mtype = run.execution(link.seq).get("module_type") or ""
        except KeyError:  # evicted by the circular buffer
            continue
        if not mtype.endswith("Loss"):
            return True
    return False


def _damage_elsewhere(run: Run, first: dict, since_step: int | None, handled: bool) -> tuple[int, str] | None:
    """(seq, reason) where a harmful value first reached training (the loss, a gradient, a
    parameter), when its origin is not the first harmful value's: that one was a NaN made in a
    value nothing used (nerf-pytorch's disparity, 0/0 for a ray with no density, made in most
    steps), and the NaN loss of a later step came from elsewhere. None otherwise."""
    try:
        damage = run.first_damage()
    except AttributeError:  # a reader without it
        return None
    if damage is None or damage.get("origin") is None or damage["origin"] == first.get("origin"):
        return None
    if first.get("reason") != "nan" or (since_step is not None and damage.get("step", -1) < since_step):
        return None
    if not isinstance(damage.get("step"), int) or not isinstance(first.get("step"), int) \
            or damage["step"] < first["step"]:
        return None
    if damage["step"] == first["step"] and not _made_from_finite(run, damage["origin"]):
        # The same step: the NaN that reached the loss may be the first one, passed on through
        # values with no record (a compiled graph's, evicted from a circular buffer), whose link
        # the tracker lost: build-nanogpt's fully masked row under bf16, its softmax's NaN
        # reached the loss seen as the cross entropy's own. Only an origin whose inputs are known
        # finite made a NaN of its own there (nerf's sample_pdf 0/0 after the disparity's, in the
        # guard's replay of that one step).
        return None
    if not handled and run.scaler_skipped():
        return None  # the first harm may lie in a skipped step's gradients: first_harm decides there
    for s in (damage["seq"], damage["origin"]):
        try:
            run.execution(s)
        except KeyError:
            continue
        return s, (damage.get("reason") if s == damage["seq"] else None)
    return None


def _made_from_finite(run: Run, seq: int) -> bool:
    """Whether execution ``seq`` is stored and every input it took from a recorded op holds a
    known, finite value: it made its harmful value itself, no lost link passed one on to it."""
    try:
        e = run.execution(seq)
    except KeyError:
        return False
    ops = [i for i in e["inputs"] if i["kind"] == "op"]
    outs = [o.get("summary") for i in ops for o in (i.get("producer_digest") or {}).get("outputs") or [None]]
    return bool(ops) and all(s and not _unknown(s) and not _is_bad(s) for s in outs)


def _earlier(run: Run, first: dict) -> dict:
    """Where the run's first harmful value was made, for a line beside another origin."""
    out = {"seq": first.get("origin"), "op": first.get("op"), "file": None, "line": None,
           "step": first.get("step"), "phase": None}
    try:
        link = _link(run, first["origin"])
    except (KeyError, TypeError):  # not stored: what the metadata says
        return out
    return {"seq": link.seq, "op": link.op, "file": link.file, "line": link.line, "step": link.step,
            "phase": link.phase}


def origin(run: Run, seq: int | None = None, max_links: int = 64, since_step: int | None = None,
           handled: bool = False) -> Origin | None:
    """The walk back from execution ``seq`` (default: where the first harmful value became
    harmful, in step ``since_step`` or later when given) to the origin. Returns None when the
    run holds no harmful value. ``handled``: also in the gradients of steps a GradScaler skipped
    (passed over otherwise: they never reached the weights)."""
    reason = earlier = reached = None
    if seq is None:
        first = run.first_harm(since_step=since_step, handled=handled)
        if first is None:
            return None
        seq, reason = first["seq"], first.get("reason")
        damage = _damage_elsewhere(run, first, since_step, handled)
        if damage is not None:
            seq, reason = damage
            earlier, reached = _earlier(run, first), True
        else:
            reached = run.reached_training(first.get("origin"))
        try:
            run.execution(seq)
        except KeyError:  # evicted (it cannot be: it is pinned), or a damaged run: start at the origin
            seq, reason = (first if damage is None else run.first_damage())["origin"], None
    chain = [_link(run, seq)]
    seen = {seq}
    target = chain[0].origin_seq
    while len(chain) < max_links:
        cur = chain[-1]
        if target is not None and cur.seq == target:
            break
        ops = [i for i in cur.inputs if i["kind"] == "op" and i.get("producer") is not None]
        on_way = [i for i in ops if target is not None and i.get("origin_seq") == target]
        if not on_way and target is None:
            on_way = [i for i in ops if _is_bad(i.get("summary"))]  # runs before format 3
        nxt = min((i["producer"] for i in on_way), default=None)
        if nxt is None and target is not None and target not in seen:
            nxt = target  # the links between are gone: jump to the origin, which is kept
        if nxt is None or nxt in seen:
            break
        seen.add(nxt)
        try:
            chain.append(_link(run, nxt))
        except KeyError:
            break
    o = chain[-1]
    consumers = [link.op for link in reversed(chain[:-1])]
    loader = made_in_loader(run, o)
    if not loader and table_lookup(o, consumers):
        size = next((_count(x.get("summary"), "size") for x in o.outputs), 0)
        o.explanation = (f"a 1-D array of {size} values from outside torch (NumPy: a lookup table such as a schedule, "
                         f"or samples read by position) became a tensor here holding {'/'.join(o.health)}, and "
                         f"{consumers[0]} then read it by index: this step's indices picked a non-finite entry")
    where = f" at {o.file}:{o.line}" if o.file else ""
    what = "/".join(o.health) or "a non-finite value"
    out = next((x for x in o.outputs if _is_bad(x["summary"])), o.outputs[0] if o.outputs else None)
    detail = f" ({out['description']})" if out else ""
    if o.library:
        where += f" (inside {o.library['path']}:{o.library['line']} in {o.library['function']})"
    summary = (f"the first harmful value came from {o.op}{where}, in step {o.step} ({o.phase} pass), "
               f"with {what} in its output{detail}: {o.explanation}")
    harm = None
    h = chain[0]
    # "it became NaN in X" says nothing more when X is the origin, which made the NaN itself.
    if (reason in REACHED or len(chain) > 1) and (h is not o or (reason or "nan") != "nan"):
        hwhere = f" at {h.file}:{h.line}" if h.file else ""
        how = REACHED.get(reason or "nan", "became harmful in {op}")
        if (reason or "nan") == "nan" and h is not o and "nan" in o.health:
            # the origin's output held the NaN already (an input from outside the recording, judged
            # where an op first took it): the head of the chain made it harmful, not NaN
            how = "became harmful in {op}"
        harm = "it " + how.format(op=h.op) + hwhere
        if h.step != o.step:
            harm += f" in step {h.step}"
        summary += f". Then {harm}"
    producers = [i for i in o.inputs if i.get("producer_op")]
    if producers:
        p = producers[0]
        pwhere = f" at {p['file']}:{p['line']}" if p.get("file") else ""
        summary += f". Its input {p['slot']} was produced by {p['producer_op']}{pwhere} and holds {p['description']}"
    first_forward = not run.meta.get("guard_replay")  # a replay's step 0 is a trained step N
    fed = fed_back(run, o) if first_forward and o.step == 0 else None
    held = (h.step is not None and o.step is not None and h.step > o.step) or loader or _fed_to_model(run, chain)
    clipping = run.meta.get("clipping") or (run.meta.get("monitor") or {}).get("clipping")
    negated = (len(chain) > 1 and op_base(chain[-2].op) == "neg" and o.file is not None
               and (chain[-2].file, chain[-2].line) == (o.file, o.line))
    suggestion = suggest(o, first_forward, fed, consumers, log_of=log_of_sigmoid(run, o), held=held, negated=negated,
                         exp_param=parameter_behind_view(run, o), loader=loader, clipping=clipping,
                         inner=inner_update(run, o), neg_exponent=negated_exponent(run, o))
    skipped = _skipped_after(run, o.step) if reached is False else None
    if skipped is not None:
        summary += (f". It made the loss {_num(skipped.get('loss'))} in step {skipped['step']}, which the program "
                    f"checked{_at(skipped)} and skipped: no backward(), no update")
    scheduler, read = _program_reads(run, o.seq) if reached is False and skipped is None else (None, None)
    if scheduler is not None:
        summary += (f". ReduceLROnPlateau.step read it in {scheduler['steps']} step(s) from step {scheduler['first_step']}"
                    f"{_at(dict(scheduler, check='scheduler.step'))}: it counts a NaN metric as no improvement and "
                    "lowers the learning rate after `patience` of them")
    if read is not None:
        summary += f". The program read it{_at(read)} in step {read['step']}" + (
            f" and exited with code {read['exit_code']}" if read.get("exit_code") else "")
    crashed = (_crashed_on(run, o.step) if reached is False and skipped is None and scheduler is None
               and read is None else None)
    if crashed is not None:
        at = f" at {crashed['file']}:{crashed['line']}" if crashed.get("file") else ""
        summary += (f". It went on into the ops of step {crashed['step']} ({crashed['nonfinite']} harmful), where the "
                    f"script crashed in step {crashed['step']} ({crashed['error']}{at}), most likely on it")
    return Origin(chain=chain, summary=summary, suggestion=suggestion, reason=reason, harm=harm, earlier=earlier,
                  reached_training=reached, skipped=skipped, read=read, scheduler=scheduler, crashed=crashed)


def _crashed_on(run: Run, since: int | None) -> dict | None:
    """The step the script crashed in, when harmful values ran in it (from ``since`` on): a value that
    reached no loss, gradient or parameter but went into a check that raised (an ``assert`` on a
    comparison, which absorbs the NaN)."""
    meta = getattr(run, "meta", None) or {}
    step, error = meta.get("crash_step"), meta.get("error")
    if not error or not isinstance(step, int) or (since is not None and step < since):
        return None
    try:
        bad = next((d["nonfinite"] for d in run.steps() if d["step"] == step), 0)
    except (AttributeError, KeyError, TypeError):
        return None
    if not bad:
        return None
    at = meta.get("crash_at") if isinstance(meta.get("crash_at"), dict) else {}
    return {"step": step, "error": str(error), "nonfinite": int(bad), "file": at.get("file"), "line": at.get("line")}


# Harmful reads of values the program looked at (``.item()``, ``float()``) among which to tell who read
# a value and how (the first ones: enough to tell).
PROGRAM_READS = 2000


def _program_reads(run: Run, origin_seq: int) -> tuple[dict | None, dict | None]:
    """How the program read the values made non-finite by ``origin_seq`` (harmful
    aten._local_scalar_dense executions), as ``(scheduler, read)``. ``scheduler``: the reads inside an
    LR scheduler's ``step`` (ReduceLROnPlateau reading a NaN validation metric, UNet's dice score),
    counted over all steps, each step's metric a NaN of its own. Else ``read``: the program's first
    read, with the script's exit code when it then exited with an error."""
    steps: list[int] = []
    where, ours, first = None, False, None
    try:
        for d in run.executions(0, PROGRAM_READS, op="_local_scalar_dense"):
            if d.get("taint") != "harmful":
                continue
            frames = run.stack(d["stack_id"]) if d.get("stack_id") is not None else []
            if any(f["name"] == "step" and f["filename"].replace("\\", "/").endswith("torch/optim/lr_scheduler.py")
                   for f in frames):
                steps.append(d["step"])
                ours = ours or d.get("origin") == origin_seq
                where = where or run.user_frame(d["stack_id"])
            elif first is None:
                first = d
        if steps and ours:
            return {"steps": len(set(steps)), "first_step": min(steps), "file": where["filename"] if where else None,
                    "line": where["lineno"] if where else None}, None
        if first is None or first.get("origin") != origin_seq:
            return None, None
        link = _link(run, first["seq"])
    except (KeyError, TypeError, AttributeError):
        return None, None
    code = run.meta.get("exit_code")
    return None, {"seq": first["seq"], "step": link.step, "file": link.file, "line": link.line, "check": ".item()",
                  "exit_code": code if isinstance(code, int) and code != 0 else None}


def _num(v: Any) -> str:
    return fmt(v) if isinstance(v, float) else "non-finite"


def _at(skip: dict) -> str:
    return f" (`{skip.get('check')}` at {skip['file']}:{skip['line']})" if skip.get("file") else ""


def _skipped_after(run: Run, step: int | None) -> dict | None:
    """The first iteration the loop skipped itself (its loss checked non-finite, no backward()) in
    ``step`` or later, as the monitor or the recorder stored it (``skipped_iterations``)."""
    meta = getattr(run, "meta", None) or {}
    for sk in ((meta.get("monitor") or {}).get("skipped_iterations"), meta.get("skipped_iterations")):
        if not isinstance(sk, dict) or not isinstance(sk.get("first"), dict):
            continue
        first = sk["first"]
        if step is None or (isinstance(first.get("step"), int) and first["step"] >= step):
            return dict(first)
        later = [s for s in sk.get("steps") or [] if isinstance(s, int) and s >= step]
        if later:
            last = sk.get("last") if isinstance(sk.get("last"), dict) else {}
            loss = last.get("loss") if last.get("step") == later[0] else None
            return {**first, "step": later[0], "loss": loss}
    return None
