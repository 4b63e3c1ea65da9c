"""Init and shape checks: one forward pass before any training.

- the output has the batch's number of samples, and its shape fits the targets (an output of
  ``[N, 1]`` against targets of ``[N]`` broadcasts to ``[N, N]`` inside an MSE and trains on
  nonsense without an error);
- class labels lie in ``[0, C)``; a negative label the loss accepted is its ignore index (minGPT
  masks prompt positions with -1), reported as such;
- the loss is a finite scalar that depends on the parameters; a NaN or Inf one is run again under
  ``check_numerics``, whose origin (op, ``file:line``, why, fix) the finding names;
- a model that returns a tuple, a dict or a Hugging Face ``ModelOutput`` is judged by its logits
  (the ``logits`` entry, else the first tensor); the class axis is dim 1, or the last one for
  ``[B, T, V]`` logits against ``[B, T]`` targets;
- the initial loss matches chance: ``ln C`` for a C-class cross-entropy (``ln 2`` for a binary
  one), since freshly initialised logits are near zero and the softmax near uniform; a loss with
  more in it (UNet's cross entropy + dice) is judged against its own value at all-zero logits. Far above
  means over-confident logits (an initialisation scale too large); far below means the model
  already "knows" the labels, which points at a leak;
- parameter count, trainable and frozen counts, per top-level module.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table
from torch import nn

from trainguard._errors import NonFiniteError
from trainguard.capture import check_numerics
from trainguard.capture._numerics import short_path, source_line
from trainguard.doctor._results import CheckResult, finding, fmt
from trainguard.doctor._state import (
    DoctorInputError,
    _rng_state,
    _set_rng_state,
    check_loss_fn,
    check_model,
    model_device,
    preserved,
    split_batch,
    to_device,
)
from trainguard.store import Finding

# The initial cross-entropy is judged against ln C: within [INIT_LOW, INIT_HIGH] times it is fine.
# Default initialisations land within a few percent; 1.5x means logits already large at init.
INIT_HIGH = 1.5
# Below half of chance at init, the model predicts labels it has never been trained on.
INIT_LOW = 0.5
# A loss at all-zero logits this far from ln C holds more than the cross entropy (a dice term):
# its own value there is the chance level (float32 rounding of ln C stays far below).
UNIFORM_REL = 0.01
# CrossEntropyLoss's default ignore_index: targets equal to it are not class labels.
IGNORE_INDEX = -100


@dataclass(kw_only=True, repr=False)
class InitReport(CheckResult):
    """Output shape, initial loss against chance, and parameter counts."""

    check = "init_checks"
    input_shape: list[int] | None
    output_shape: list[int] | None
    target_shape: list[int] | None
    task: str
    num_classes: int | None
    initial_loss: float | None
    expected_loss: float | None
    expected_rule: str
    parameters: int
    trainable: int
    frozen: int
    by_module: dict[str, dict[str, int]]
    training_mode: bool
    issues: list[Finding] = field(default_factory=list)
    passed: bool = True

    def __post_init__(self) -> None:
        self.passed = not any(f.is_problem for f in self.issues)

    @property
    def summary(self) -> str:
        loss = f"initial loss {fmt(self.initial_loss)}"
        if self.expected_loss is not None:
            loss += f" (expected {fmt(self.expected_loss)}: {self.expected_rule})"
        return f"output {self.output_shape}, {loss}, {self.trainable:,} of {self.parameters:,} parameters trainable"

    def findings(self) -> list[Finding]:
        return list(self.issues)

    def _fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "input_shape", "output_shape", "target_shape", "task", "num_classes", "initial_loss", "expected_loss",
            "expected_rule", "parameters", "trainable", "frozen", "by_module", "training_mode")}

    def _detail(self) -> Table:
        t = Table(box=None, padding=(0, 2))
        for col in ("module", "parameters", "trainable"):
            t.add_column(col)
        for name, c in self.by_module.items():
            t.add_row(name, f"{c['parameters']:,}", f"{c['trainable']:,}")
        t.add_row("[bold]total[/]", f"[bold]{self.parameters:,}[/]", f"[bold]{self.trainable:,}[/]")
        return t


def _nonfinite_origin(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any) -> dict[str, Any] | None:
    """The op and line that made the first harmful NaN/Inf of one forward pass and loss, as
    ``check_numerics`` names it (its message's first op, the error's ``execution`` line and the
    message's inputs); None when it does not stop there (the data held the value already, or it
    cannot run here)."""
    try:
        with check_numerics():
            loss = loss_fn(model(inputs), targets)
            float(loss.detach())  # read: an inf that reached the loss is harmful here
    except NonFiniteError as exc:
        where = exc.execution
        if "file" not in where:
            return None
        lines = str(exc).splitlines()
        return {"op": lines[0].split(" ", 1)[0], "message": str(exc),
                "file": where["file"], "line": where["line"], "function": where["function"],
                "code": source_line(where["file"], where["line"]),
                "inputs": [t.strip() for t in lines[1:] if t.strip().startswith("input ")]}
    except Exception:  # noqa: BLE001 - the finding stands without an origin; the check must not fail here
        return None
    return None


def _counts(model: nn.Module) -> tuple[int, int, dict[str, dict[str, int]]]:
    seen: set[int] = set()
    total = trainable = 0
    by_module: dict[str, dict[str, int]] = {}
    children = list(model.named_children()) or [("(model)", model)]
    owner = {}
    for name, child in children:
        for p in nn.Module.parameters(child):
            owner.setdefault(id(p), name)
    for p in nn.Module.parameters(model):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        trainable += n if p.requires_grad else 0
        c = by_module.setdefault(owner.get(id(p), "(own)"), {"parameters": 0, "trainable": 0})
        c["parameters"] += n
        c["trainable"] += n if p.requires_grad else 0
    return total, trainable, by_module


def _shape(obj: Any) -> list[int] | None:
    return list(obj.shape) if isinstance(obj, torch.Tensor) else None


def _primary(outputs: Any) -> Any:
    """The tensor a model's output is judged by: itself, its ``logits`` entry (a dict or a Hugging
    Face ``ModelOutput``), else its first tensor (minGPT and nanoGPT return ``(logits, loss)``)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        if isinstance(outputs.get("logits"), torch.Tensor):
            return outputs["logits"]
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return next((o for o in outputs if isinstance(o, torch.Tensor)), None)
    return None


def _unpack_hint(model: nn.Module, inputs: Any, exc: Exception) -> str | None:
    """The fix for a forward of several arguments that got the batch's tuple (or dict) of inputs
    as its one argument (a TypeError about its arguments): wrap the model so that it unpacks them.
    None for any other failure."""
    if not isinstance(exc, TypeError) or not isinstance(inputs, (tuple, list, dict)) or "argument" not in str(exc):
        return None
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    if len(params) < 2:
        return None
    star = "**" if isinstance(inputs, dict) else "*"
    names = ", ".join(p.name for p in params)
    return (f"the doctor calls model(inputs) with the batch's inputs, a {type(inputs).__name__} of {len(inputs)}, as one "
            f"argument, and {type(model).__name__}.forward takes ({names}): pass a model that unpacks them, e.g. "
            "`class Unpack(nn.Module): def __init__(self, m): super().__init__(); self.m = m` with "
            f"`def forward(self, inputs): return self.m({star}inputs)`, i.e. model({star}inputs)")


def init_checks(model: nn.Module, batch: Any, loss_fn: Any, *, num_classes: int | None = None) -> InitReport:
    """One forward pass on ``batch = (inputs, targets)``: shapes, initial loss against chance
    (``ln C`` for cross-entropy; ``num_classes`` overrides C read off the output), parameter
    counts. Runs in the model's current train/eval mode; all state is restored afterwards.

    >>> init_checks(model, (x, y), nn.CrossEntropyLoss()).summary
    """
    check_model(model)
    check_loss_fn(loss_fn)
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or num_classes < 2):
        raise DoctorInputError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    inputs, targets = split_batch(batch)
    device = model_device(model)
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    total, trainable, by_module = _counts(model)
    issues: list[Finding] = []
    out_shape = t_shape = None
    task, classes, value = "unknown", num_classes, None
    with preserved(model), torch.enable_grad():
        try:
            outputs = model(inputs)
        except Exception as exc:
            outputs = None
            issues.append(finding("forward_failed", "critical", f"model(inputs) raised {type(exc).__name__}: {exc}",
                                  _unpack_hint(model, inputs, exc)
                                  or "Fix the forward pass for this batch (shapes, dtypes, devices) before anything else.",
                                  error=f"{type(exc).__name__}: {exc}", input_shape=_shape(inputs)))
        loss = None
        if outputs is not None:
            primary = _primary(outputs)
            out_shape, t_shape = _shape(primary), _shape(targets)
            task, classes = _task(primary, targets, loss_fn, num_classes)
            failed = None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # a broadcast warning: reported below
                    loss = loss_fn(outputs, targets)
            except Exception as exc:
                failed = finding(
                    "loss_failed", "critical", f"loss_fn(outputs, targets) raised {type(exc).__name__}: {exc}",
                    "Make the output and target shapes and dtypes what the loss expects (class indices as "
                    "int64 for cross-entropy, float targets of the output's shape for MSE/BCE).",
                    error=f"{type(exc).__name__}: {exc}", output_shape=out_shape, target_shape=t_shape)
            if (failed is None and isinstance(primary, torch.Tensor) and primary.dim() == 0
                    and (loss is primary or loss is outputs)):
                # loss_fn passes the model's output through: the model computes its own loss
                # (GaussianDiffusion, a Hugging Face model given labels); no output to fit the targets
                issues.append(finding(
                    "model_returns_loss", "info",
                    "The model returns its own loss (a scalar that loss_fn passes through): the output and "
                    "target shape checks do not apply",
                    "", output_shape=out_shape))
            else:
                issues += _shape_issues(inputs, primary, targets, task, classes, loss_accepted=failed is None)
            if failed is not None:
                issues.append(failed)
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise DoctorInputError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        if loss is None:
            pass
        elif loss.numel() != 1:
            issues.append(finding(
                "loss_not_scalar", "error", f"The loss is a tensor of shape {list(loss.shape)}, not a scalar",
                "Reduce it (reduction='mean'): backward() needs a scalar, and the LR scale depends on the reduction.",
                shape=list(loss.shape)))
        else:
            value = float(loss.detach())
            if not math.isfinite(value):
                where = _nonfinite_origin(model, inputs, targets, loss_fn)
                fix = "Check the inputs for NaN/Inf (validate_data) and the loss for log(0)."
                if where is not None:
                    fix = (f"{where['op']} at {short_path(where['file'])}:{where['line']} made the first NaN/Inf "
                           f"(`{where['code']}`)" + "".join(f"; {i}" for i in where["inputs"])
                           + "; `trainguard.check_numerics()` around one step says more")
                issues.append(finding("initial_loss_nonfinite", "critical", f"The initial loss is {fmt(value)}",
                                      fix, initial_loss=value, **({"origin": where} if where else {})))
            if value == 0 and loss.requires_grad:
                one = isinstance(primary, torch.Tensor) and primary.dim() >= 2 and primary.shape[-1] == 1
                issues.append(finding(
                    "initial_loss_zero", "warning", "The initial loss is exactly 0 before any training",
                    "A loss of 0 gives every parameter a zero gradient, so nothing trains. "
                    + ("The model gives one output per sample, and `cross_entropy` takes the log_softmax of a "
                       "single score, which is 0: for regression use `F.mse_loss(output, target)`, for a yes/no "
                       "label `F.binary_cross_entropy_with_logits(output, target)`, for C classes give the last "
                       "layer C outputs." if one else
                       "Look for a target that is the output itself, a mask or weight that keeps nothing, or a "
                       "margin the untrained model already meets."),
                    initial_loss=value, output_shape=out_shape))
            if not loss.requires_grad:
                issues.append(finding(
                    "no_gradient_path", "critical", "The loss does not depend on any trainable parameter",
                    "Something between the parameters and the loss cuts the graph (.detach(), .item(), "
                    "torch.no_grad(), a NumPy round trip) or every parameter has requires_grad=False."))
    expected, rule = _expected(task, classes)
    if expected is not None and value is not None and math.isfinite(value):
        uniform = None if num_classes is not None else _uniform_loss(outputs, targets, loss_fn)
        if uniform is not None and abs(uniform - expected) > UNIFORM_REL * expected:
            # a loss with more than the cross entropy in it (UNet's + dice): chance is its value at uniform predictions
            expected, rule = uniform, "the loss at all-zero logits"

        ratio = value / expected
        if ratio > INIT_HIGH:
            issues.append(finding(
                "initial_loss_high", "warning",
                f"The initial loss {fmt(value)} is {ratio:.1f}x chance ({rule} = {fmt(expected)})",
                "The logits are already large at initialisation: scale down the last layer's initial weights "
                "(e.g. by 0.01), check the init scheme and any input scaling.",
                initial_loss=value, expected=expected, ratio=ratio))
        elif ratio < INIT_LOW:
            issues.append(finding(
                "initial_loss_low", "warning",
                f"The initial loss {fmt(value)} is well below chance ({rule} = {fmt(expected)}) before any training",
                "An untrained model should not know the labels: look for the target leaking into the inputs, "
                "or a loss that is not the mean cross-entropy.",
                initial_loss=value, expected=expected, ratio=ratio))
    if trainable == 0:
        issues.append(finding("no_trainable_parameters", "critical", "The model has no trainable parameters",
                              "Set requires_grad=True on the parameters to train."))
    if not model.training:
        issues.append(finding("model_in_eval_mode", "info", "The model is in eval mode",
                              "Call model.train() before training: dropout and batch norm behave differently."))
    issues.append(finding(
        "parameter_count", "info", f"{total:,} parameters, {trainable:,} trainable, {total - trainable:,} frozen",
        parameters=total, trainable=trainable, frozen=total - trainable, by_module=by_module))
    return InitReport(
        input_shape=_shape(inputs), output_shape=out_shape, target_shape=t_shape, task=task, num_classes=classes,
        initial_loss=value, expected_loss=expected, expected_rule=rule, parameters=total, trainable=trainable,
        frozen=total - trainable, by_module=by_module, training_mode=model.training, issues=issues)


def _task(outputs: Any, targets: Any, loss_fn: Any, num_classes: int | None) -> tuple[str, int | None]:
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return "unknown", num_classes
    if isinstance(loss_fn, (nn.BCEWithLogitsLoss, nn.BCELoss)):
        return "binary", 2
    if isinstance(loss_fn, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)):
        return "regression", None
    integer = not targets.is_floating_point() and not targets.is_complex() and targets.dtype != torch.bool
    if integer and outputs.dim() == targets.dim() + 1 and outputs.dim() >= 2:
        axis = _class_axis(outputs, targets)
        # Neither layout fits (llama2.c's [B, 1, V] of the last position against [B, T]): no dim is
        # known to be the classes, and dim 1 taken for them made labels "out of range" of 1 class.
        return "classification", num_classes or (None if axis is None else int(outputs.shape[axis]))
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and outputs.dim() >= 2:
        return "classification", num_classes or int(outputs.shape[1])  # soft (probability) targets
    return "regression", None


def _class_axis(outputs: torch.Tensor, targets: torch.Tensor) -> int | None:
    """Dim 1 (what cross_entropy expects: ``[B, C, ...]`` against ``[B, ...]``), unless only the
    last fits: language-model logits ``[B, T, V]`` against targets ``[B, T]``, flattened by the loss;
    None when neither fits."""
    if outputs.shape[:1] + outputs.shape[2:] == targets.shape:
        return 1
    return -1 if outputs.shape[:-1] == targets.shape else None


def _unfit_classes(outputs: torch.Tensor, targets: torch.Tensor) -> Finding:
    """Class-index targets that fit neither class axis of the output, refused by the loss."""
    out, tgt = list(outputs.shape), list(targets.shape)
    title = f"Output {out} does not fit targets {tgt}"
    fix = ("Give the loss the output cross_entropy expects, [B, C, ...] against targets [B, ...], or a "
           "language model's [B, T, V] against [B, T] (flattened by the loss)")
    if outputs.dim() == 3 and out[0] == tgt[0] and out[1] < tgt[1]:
        title += f": it holds {out[1]} position{'s' if out[1] != 1 else ''} of the targets' {tgt[1]}"
        fix = (f"Return the logits of every position the targets cover ({tgt[1]}, not {out[1]}): a model that "
               "keeps only the last position's logits when it is given no targets (`h[:, [-1], :]`, an "
               "inference shortcut, as llama2.c's and nanoGPT's forward(idx, targets=None)) needs them: wrap it "
               "so that it is called as model(x, y), or give the doctor a forward that returns all positions")
    return finding("output_target_shape", "error", title, fix + ".", output_shape=out, target_shape=tgt)


def _uniform_loss(outputs: Any, targets: Any, loss_fn: Any) -> float | None:
    """``loss_fn`` at all-zero logits (uniform predictions): the chance level of any loss over them;
    None for an output that is not one float tensor, or a loss that fails on it."""
    if not (isinstance(outputs, torch.Tensor) and outputs.is_floating_point()):
        return None
    rng = _rng_state()  # the loss alone runs: no copy of the model's parameters, only the RNGs it may draw from
    try:
        with torch.no_grad():
            value = float(loss_fn(torch.zeros_like(outputs), targets))
    except Exception:  # a loss that needs more than outputs and targets: ln C stays the level
        return None
    finally:
        _set_rng_state(rng)
    return value if math.isfinite(value) else None


def _expected(task: str, classes: int | None) -> tuple[float | None, str]:
    if task == "classification" and classes and classes >= 2:
        return math.log(classes), f"ln {classes}"
    if task == "binary":
        return math.log(2), "ln 2"
    return None, "no chance level for this loss"


def _shape_issues(inputs: Any, outputs: Any, targets: Any, task: str, classes: int | None, *,
                  loss_accepted: bool) -> list[Finding]:
    out: list[Finding] = []
    if not isinstance(outputs, torch.Tensor):
        return out
    n_in = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() else None
    # time first, [T, N, ...]: the layout nn.CTCLoss takes and RNNs give without batch_first; the
    # batch is dim 1 when the loss accepted the output as it is
    time_first = loss_accepted and outputs.dim() >= 3 and outputs.shape[1] == n_in
    if n_in is not None and (outputs.dim() == 0 or outputs.shape[0] != n_in) and not time_first:
        out.append(finding(
            "output_batch_mismatch", "error",
            f"The output has shape {list(outputs.shape)} for a batch of {n_in} samples",
            "The first output dimension must be the batch: look for a flatten/view that merges the batch "
            "dimension (x.view(-1) instead of x.view(x.size(0), -1)).",
            output_shape=list(outputs.shape), batch=n_in))
        return out
    if not isinstance(targets, torch.Tensor):
        return out
    if (task == "classification" and not loss_accepted and not targets.is_floating_point()
            and outputs.dim() == targets.dim() + 1 and _class_axis(outputs, targets) is None):
        out.append(_unfit_classes(outputs, targets))
    if task == "classification" and not targets.is_floating_point():
        valid = targets[targets != IGNORE_INDEX]
        negative = valid[valid < 0].unique()
        if loss_accepted and negative.numel() == 1:
            # cross_entropy refuses a label below 0 unless it is the ignore index: one value the
            # loss took is that index (minGPT's -1), not a label.
            value = int(negative)
            out.append(finding(
                "ignored_targets", "info",
                f"{int((targets == value).sum()):,} of {targets.numel():,} targets are {value}, which the loss "
                "ignores", "Nothing to do if these positions are masked on purpose (padding, a prompt).",
                value=value, count=int((targets == value).sum()), of=targets.numel()))
            valid = valid[valid != value]
        if valid.numel():
            lo, hi = int(valid.min()), int(valid.max())
            if lo < 0 or (classes is not None and hi >= classes):
                out.append(finding(
                    "labels_out_of_range", "error",
                    f"Class labels span [{lo}, {hi}] but the output has {classes} classes",
                    f"Labels must be in [0, {classes}): re-map them, or give the last layer {hi + 1} outputs.",
                    min_label=lo, max_label=hi, classes=classes))
    elif task in ("regression", "binary") and outputs.shape != targets.shape:
        try:
            broadcast = list(torch.broadcast_shapes(outputs.shape, targets.shape))
        except RuntimeError:
            broadcast = None
        if broadcast is not None:
            grown = broadcast != list(outputs.shape) and broadcast != list(targets.shape)
            what = f"broadcast to {broadcast} in the loss" if grown else f"differ (broadcast to {broadcast})"
            out.append(finding(
                "output_target_shape", "error" if grown else "warning",
                f"Output {list(outputs.shape)} and targets {list(targets.shape)} {what}",
                "Make the shapes equal (e.g. output.squeeze(-1) or targets.unsqueeze(-1)): a broadcast loss "
                "compares every output with every target and trains on nonsense without an error.",
                output_shape=list(outputs.shape), target_shape=list(targets.shape), broadcast=broadcast))
    return out
