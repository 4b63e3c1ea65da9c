"""Overfit one batch: a model that cannot memorise a handful of samples will not learn a dataset.

The test trains on one small batch and passes when the loss gets near zero (and, for
classification, every sample is classified right). When it fails it says which way, because
each way has a different fix:

- ``nan``: the loss became NaN/Inf (learning rate too high, log of 0, division by zero, overflow);
- ``flat``: gradients do not reach (some) parameters, so nothing learns there;
- ``unstable``: the loss jumps around or rises: the learning rate is too high;
- ``slow``: the loss was still falling when the steps ran out: the learning rate is too low (or a
  CTC model still on its blank plateau);
- ``floor``: the loss settled above zero: too little capacity or a loss that cannot reach zero (or
  samples with the same input but other targets, at the accuracy they allow);
- ``random``: the loss of the same batch with the same weights differs from call to call (the model
  or loss draws random numbers: a diffusion model's timesteps and noise, a VAE's sample; or, when it
  differs with the generators seeded alike, ``stateful``, it moves state it keeps: DINO's center), so
  its jumps say nothing about the learning rate and it cannot settle near zero.

A loss short of near zero that is only its own slow tail passes: every sample classified right, or
(no accuracy to judge) still falling geometrically, nine tenths of its way down.

"Near zero" is measured from the loss's own floor: the least ``loss_fn`` can be on these targets
with any output at all, found by fitting a free tensor of the output's shape (label smoothing's
floor is above zero: 0.349 for 4 classes at 0.1; mixup's soft targets', their entropy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table
from torch import nn

from trainguard.doctor._gradcheck import _fake_quant_modules
from trainguard.doctor._linear_floor import least_squares_loss
from trainguard.doctor._results import CheckResult, finding, fmt
from trainguard.doctor._state import (
    DoctorInputError,
    as_float,
    batch_size,
    check_loss_fn,
    check_model,
    check_positive,
    make_optimizer,
    model_device,
    optimizer_step,
    preserved,
    seeded,
    split_batch,
    take,
    to_device,
    trainable,
)
from trainguard.store import Finding

# The lesson's 8-32 samples: few enough that any network worth training can memorise them.
MAX_SAMPLES = 32
# Adam at 3e-3 memorises 32 samples with a small network in well under 200 steps.
DEFAULT_LR = 3e-3
# "Near zero": two orders of magnitude below where the loss started ...
NEAR_ZERO_REL = 0.01
# ... or below this absolute value, for losses that start small.
NEAR_ZERO_ABS = 1e-4
# A gradient norm below this at the first step means nothing will move (vanished gradients).
VANISHING_GRAD = 1e-10
# Still falling: the last quarter of the steps made at least this share of the total progress.
STILL_FALLING = 0.10
# ... or it closed this share of its remaining distance to the loss's floor in the last quarter
# (Time-Series-Library's PatchTST: 29% at 200 steps, passed at 400; a linear map that cannot fit
# its windows closed 5%).
STILL_FALLING_GAP = 0.2
# Unstable: it ended this share above where it started (it got worse) ...
RISE = 0.05
# ... or this share of its progress above its best loss (it rebounded) ...
REBOUND = 0.25
# ... or it spiked this share above where it started on the way ...
SPIKE = 0.5
# ... or it zig-zagged: the rises add up to this share of the net progress, and to more than
# ZIGZAG_AMPLITUDE of the starting loss (not the last digits' jitter near a floor).
ZIGZAG = 0.5
ZIGZAG_AMPLITUDE = 0.05

# Memorised short of the target: a "slow" loss that has closed all but this share of its way to the
# floor passes when every sample is classified right (mamba.py's LM's cross entropy, 4.15 -> 0.045,
# 100%) or, with no accuracy to judge, when at its last quarter's pace in log space it reaches the
# target within as many steps again (trl's DPO, 0.693 -> 0.0343: falling geometrically).
GEOMETRIC_DONE = 0.1
# ... or, for dense class targets (a label per pixel or token, at least DENSE_PREDICTIONS of them:
# all right is no luck), all but this share: cross entropy plus a dice on the softmax (Pytorch-UNet's
# loss) keeps falling slowly long after every pixel is right (1.72 -> 0.297 at 100%, 83% of the way).
DENSE_DONE = 0.5
DENSE_PREDICTIONS = 256
# CTC's blank plateau: at least this share of the samples get the blank at every frame.
BLANK_SHARE = 0.5

REASONS = ("nan", "flat", "unstable", "slow", "floor", "random")
# Random: evaluations of the same batch with the same weights differ by more than this share
# (a deterministic forward repeats exactly on CPU, and within about 1e-7 where an accelerator's
# atomics reorder sums; anything larger is drawn) ...
RANDOM_REL = 1e-6
# ... in any pair of this many (two draws of a diffusion loss came out 2e-5 apart)
RANDOM_EVALS = 3
# The loss's floor: Adam on a free copy of the outputs, this many steps from this rate decaying
# linearly to 0: logits move about the rate per step, so cross entropy's margins pass 50 (the loss
# 1e-20) and settle on label smoothing's optimum (log(0.925/0.025) = 3.6 for 4 classes at 0.1).
FLOOR_STEPS = 300
FLOOR_LR = 1.0


def _adam(lr: float):
    return lambda params: torch.optim.Adam(params, lr=lr)


@dataclass(kw_only=True, repr=False)
class OverfitResult(CheckResult):
    """The outcome of :func:`overfit_one_batch`; ``reason`` is None when it passed."""

    check = "overfit_one_batch"
    passed: bool
    reason: str | None
    losses: list[float]
    initial_loss: float
    final_loss: float
    target_loss: float
    accuracy: float | None
    steps: int
    samples: int
    lr: float | None
    optimizer: str
    unreached: list[str] = field(default_factory=list)
    nan_step: int | None = None
    grad_norm_first: float | None = None
    grad_norm_last: float | None = None
    loss_floor: float = 0.0  # the least the loss can be on these targets (see _loss_floor)
    redrawn: tuple[float, float] | None = None  # the least and most loss of the same batch and weights, when they differed
    train_only: bool = False  # the redrawn loss is fixed in eval mode: a dropout no module switch turns off
    stateful: bool = False  # the redrawn loss differs with the random numbers seeded alike: state it keeps moves
    fake_quant: int = 0  # stateful: the fake-quant modules prepare_qat put in (their observers and fused BN move)
    identical: dict | None = None  # at a floor: samples with the same input but other targets (see _identical_samples)
    identical_groups: int = 0  # how many groups of such samples that input holds
    accuracy_ceiling: float | None = None  # the most accuracy those groups allow (1-D class targets)
    memorised: str | None = None  # passed short of the target: "accuracy" (every sample right) or "falling" (geometrically)
    projected_steps: int | None = None  # "falling": steps more to the target at the last quarter's pace
    ctc_blank: int = 0  # slow: the samples a CTC model gives blank at every frame (CTC's blank plateau)
    least_squares: float | None = None  # floor: the least loss of a model linear in its parameters (its MSE fit)

    @property
    def summary(self) -> str:
        acc = "" if self.accuracy is None else f", accuracy {self.accuracy:.0%}"
        head = f"loss {fmt(self.initial_loss)} -> {fmt(self.final_loss)} in {self.steps} steps on {self.samples} samples{acc}"
        if self.passed and self.memorised == "accuracy":
            return f"{head}: every sample right, the loss still falling"
        if self.passed and self.memorised == "falling":
            return (f"{head}: still falling geometrically, under {fmt(self.target_loss)} in about "
                    f"{self.projected_steps} more steps at its last quarter's pace")
        if self.passed and self.loss_floor:
            # a loss that passed far from 0: label smoothing's, or a language model's first tokens
            return f"{head}: the least this loss can be on these targets is {fmt(self.loss_floor)}"
        if self.passed:
            return head
        if self.reason == "slow" and self.ctc_blank:
            return f"{head}: slow (CTC's blank plateau: {self.ctc_blank} of {self.samples} samples all blank)"
        if self.reason == "flat" and self.unreached:
            return f"{head}: flat ({len(self.unreached)} parameters never receive a gradient)"
        return f"{head}: {self.reason}"

    def _fell(self) -> bool:
        """Whether the loss went more than half its way to the floor (through the parameters reached)."""
        start, end, floor = self.initial_loss, self.final_loss, self.loss_floor or 0.0
        return math.isfinite(start) and math.isfinite(end) and end < start - 0.5 * (start - floor)

    def _fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "reason", "losses", "initial_loss", "final_loss", "target_loss", "accuracy", "steps", "samples", "lr",
            "optimizer", "unreached", "nan_step", "grad_norm_first", "grad_norm_last", "loss_floor", "redrawn", "train_only", "stateful", "fake_quant", "identical",
            "identical_groups", "accuracy_ceiling", "memorised", "projected_steps", "ctc_blank")}

    def _at_least_squares(self) -> bool:
        """At a floor, and a model linear in its parameters whose least-squares fit on the batch is
        itself above the target: no parameters memorise it."""
        return self.reason == "floor" and self.least_squares is not None and self.least_squares > self.target_loss

    def _at_ceiling(self) -> bool:
        return (self.identical is not None and self.accuracy_ceiling is not None and self.accuracy is not None
                and self.accuracy >= self.accuracy_ceiling - 1e-9)

    def _ctc_text(self) -> str:
        lr = self.lr
        return ("CTC training first predicts blank at every frame and sits on that plateau before it learns to "
                "align frames to labels (Holmeyoung/crnn-pytorch's CRNN: past 300 steps at lr 1e-3); free outputs "
                f"reach a loss of {fmt(self.loss_floor)} on these labels, so this is no floor of the model's. Give the "
                f"test more steps (steps={3 * self.steps})" + (f" or a higher rate (lr={fmt(lr * 3)})" if lr else "")
                + ". If it still emits only blanks then, check that every input length is at least its label's "
                "length (plus one per repeated letter) and that the blank index is the one the loss is given.")

    def _detail(self) -> Table:
        t = Table(show_header=False, box=None, padding=(0, 2))
        t.add_row("initial / final loss", f"{fmt(self.initial_loss)} / {fmt(self.final_loss)}")
        t.add_row("target (near zero)" if self.loss_floor == 0 else f"target (near the loss's floor, {fmt(self.loss_floor)})",
                  f"<= {fmt(self.target_loss)}")
        if self.accuracy is not None:
            t.add_row("accuracy", f"{self.accuracy:.1%}")
        t.add_row("optimizer", f"{self.optimizer}, lr {fmt(self.lr)}")
        return t

    def findings(self) -> list[Finding]:
        ev = {"initial_loss": self.initial_loss, "final_loss": self.final_loss, "target_loss": self.target_loss,
              "accuracy": self.accuracy, "steps": self.steps, "samples": self.samples, "lr": self.lr,
              "optimizer": self.optimizer, "loss_floor": self.loss_floor}
        out: list[Finding] = []
        if self.passed:
            out.append(finding("overfit_ok", "info", f"Overfit one batch: {self.summary}", **ev))
        if self.unreached:
            names = ", ".join(self.unreached[:8]) + (" ..." if len(self.unreached) > 8 else "")
            out.append(finding(
                "no_gradient", "error" if self.reason == "flat" else "warning",
                f"{len(self.unreached)} trainable parameter(s) never receive a gradient: {names}",
                "Look for .detach(), .data, .item(), a NumPy round trip or torch.no_grad() between these "
                "parameters and the loss; if they are unused on purpose, set requires_grad=False.",
                layers=self.unreached, unreached=self.unreached))
        if self.passed:
            return out
        lr = self.lr
        texts = {
            "nan": (f"Overfit one batch: the loss became non-finite at step {self.nan_step}",
                    "Lower the learning rate" + (f" (try {fmt(lr / 10)})" if lr else "")
                    + "; check log/exp/division in the model and loss (a log of 0, exp overflow); "
                    "trainguard.check_numerics names the first op that made the NaN."),
            "flat": (f"Overfit one batch: gradients do not reach {len(self.unreached)} parameters (the loss fell from "
                     f"{fmt(self.initial_loss)} to {fmt(self.final_loss)} through the others, short of memorising the batch)"
                     if self.unreached and self._fell() else
                     "Overfit one batch: the loss is flat because gradients do not reach the parameters",
                     "Gradients must flow from the loss to every layer: remove .detach()/.data/no_grad on the "
                     "path, make sure the loss is computed from the model output, and check requires_grad."),
            "unstable": ("Overfit one batch: the loss jumps around instead of falling: learning rate too high",
                         "Lower the learning rate" + (f" (try {fmt(lr / 10)})" if lr else "")
                         + ", or run lr_range_test to pick one."),
            "slow": ((f"Overfit one batch: the model still emits only blanks for {self.ctc_blank} of {self.samples} "
                      f"samples after {self.steps} steps (CTC's blank plateau, loss {fmt(self.final_loss)})",
                      self._ctc_text())
                     if self.ctc_blank else
                     (f"Overfit one batch: the loss was still falling after {self.steps} steps: learning rate too low",
                      "Raise the test's learning rate" + (f" (try lr={fmt(lr * 10)})" if lr else "")
                      + f" or give it more steps (steps={2 * self.steps}). That is the rate of this test's "
                      f"{self.optimizer} on one batch, not your optimizer's rate for training the data set: "
                      "lr_range_test suggests that one, from your optimizer and data.")),
            "random": ("Overfit one batch: the loss is random for a fixed batch and weights ("
                       + (f"from {self.redrawn[0]:.6g} to {self.redrawn[1]:.6g}" if self.redrawn else "it varies")
                       + " over 3 calls on the same inputs): its jumps are its own draws, and it cannot settle near zero",
                       ("The draws stop in eval mode: a dropout this test cannot switch off, such as "
                        "`F.dropout(x, training=self.training)` in forward (pytorch/examples' and ignite's MNIST "
                        "nets). Use an nn.Dropout module instead, which the test switches off (and which does "
                        "the same in training); then a loss that still jumps is the learning rate's."
                        if self.train_only else
                        f"The loss differs on each call even with the random numbers seeded alike: the model is "
                        f"prepared for quantization-aware training ({self.fake_quant} fake-quant module(s)), and in "
                        "training mode its observers move the quantization ranges and a fused Conv-BN folds the "
                        "running BN statistics, which move too, into its weight, so one batch has no fixed loss. "
                        "Keep them still for this test: model.apply(torch.ao.quantization.disable_observer) and "
                        "model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats) after a few batches, or run it on "
                        "the float model before prepare_qat."
                        if self.stateful and self.fake_quant else
                        "The loss differs on each call even with the random numbers seeded alike: the model or "
                        "loss updates state it keeps between calls (DINO's center buffer, an EMA such as a VQ codebook's, or "
                        "a counter), so "
                        "one batch has no fixed loss to drive to zero. A self-supervised target that moves by "
                        "design is judged by training, not by this test; else pass that state in, or keep it still "
                        "for the test."
                        if self.stateful else
                        "The model or loss draws random numbers on each call (a diffusion model's timesteps and "
                        "noise, a VAE's sample, random masking, teacher forcing decided by random.random()), so one "
                        "batch has no fixed loss to drive to zero. "
                        "To run this test, fix the draws: seed a torch.Generator inside the call, or pass the "
                        "timesteps and noise in (a teacher_forcing_ratio of 1); then a loss that still jumps is the "
                        "learning rate's.")),
            "floor": (f"Overfit one batch: the loss is stuck at a floor of {fmt(self.final_loss)}"
                      + (f" (the least this loss can be on these targets is {fmt(self.loss_floor)})"
                         if self.loss_floor else ""),
                      "The model cannot memorise a few samples: too little capacity (a bottleneck, a missing "
                      "non-linearity) or a loss that cannot reach its floor from the model's output (wrong "
                      "target format, probabilities passed where logits are expected)."),
        }
        title, suggestion = texts[self.reason or "floor"]
        if self._at_least_squares():
            title = (f"Overfit one batch: the loss stopped at {fmt(self.final_loss)}; a model linear in its parameters "
                     f"can reach no less than {fmt(self.least_squares)} here (its least-squares fit)")
            suggestion = ("The model's output is linear in its parameters (DLinear, NLinear, a linear regression): it "
                          "cannot memorise a batch, and the least any of its parameters reach on these samples is the "
                          f"least-squares fit, {fmt(self.least_squares)} (the test's optimizer approaches it slowly on "
                          "correlated inputs). This test shows no bug in it; judge it by its validation loss.")
            ev["least_squares_loss"] = self.least_squares
        if self.reason == "floor" and self.identical and self.accuracy_ceiling is not None and not self._at_ceiling():
            # the duplicates cost only part of this floor: the model is short of what they allow
            *head, last = self.identical["samples"]
            suggestion += (f" The batch also has samples {', '.join(map(str, head))} and {last} with the same input "
                           f"{self.identical['input']} but different targets, which no model can tell apart; they "
                           f"explain only part of this floor: accuracy {self.accuracy:.0%} is below the "
                           f"{self.accuracy_ceiling:.0%} they allow ({round(self.accuracy_ceiling * self.samples)} "
                           f"of {self.samples}).")
            ev["identical"] = self.identical
            ev["accuracy_ceiling"] = self.accuracy_ceiling
        elif self.reason == "floor" and self.identical:
            *head, last = self.identical["samples"]
            more = (f" ({self.identical_groups} groups of such samples in all)" if self.identical_groups > 1 else "")
            ceiling = ""
            if self._at_ceiling():
                ceiling = (f" Accuracy {self.accuracy:.0%} is the most they allow ({round(self.accuracy_ceiling * self.samples)} "
                           f"of {self.samples}): the model memorised what it can.")
            suggestion = (f"The batch's samples {', '.join(map(str, head))} and {last} have the same input "
                          f"{self.identical['input']} but different targets{more}: no model can tell them apart, so the "
                          f"loss cannot go below what that costs.{ceiling} In contrastive training (CLIP's in-batch targets, "
                          "each sample its own class) a caption or image that appears twice in a batch is a false "
                          "negative: deduplicate the data set, or overfit a batch without repeats.")
            ev["identical"] = self.identical
            ev["accuracy_ceiling"] = self.accuracy_ceiling
        # the model memorised all the duplicates let it: the data's problem, not the model's
        severity = ("warning" if self.reason == "random" or (self.reason == "floor" and self._at_ceiling())
                    or self._at_least_squares() else "error")
        out.append(finding(f"overfit_{self.reason}", severity, title, suggestion, layers=self.unreached,
                           reason=self.reason, nan_step=self.nan_step, unreached=self.unreached,
                           grad_norm_first=self.grad_norm_first, grad_norm_last=self.grad_norm_last, **ev))
        return out


def _task(outputs: torch.Tensor, targets: Any, loss_fn: Any, task: str) -> str:
    if task != "auto":
        return task
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return "regression"
    if isinstance(loss_fn, (nn.BCEWithLogitsLoss, nn.BCELoss)) and outputs.shape == targets.shape:
        return "binary"
    if (not targets.is_floating_point() and not targets.is_complex() and outputs.dim() == targets.dim() + 1
            and outputs.shape[0] == targets.shape[0] and outputs.shape[2:] == targets.shape[1:]):
        return "classification"
    return "regression"


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor, task: str, loss_fn: Any) -> float | None:
    if task == "classification":
        return float((outputs.argmax(dim=1) == targets).float().mean())
    if task == "binary":
        threshold = 0.5 if isinstance(loss_fn, nn.BCELoss) else 0.0
        return float(((outputs > threshold).float() == (targets > 0.5).float()).float().mean())
    return None


def _done_share(targets: Any) -> float:
    """How much of its way to the floor a slow loss may have left when every prediction is right."""
    dense = (isinstance(targets, torch.Tensor) and targets.dim() >= 2 and not targets.is_floating_point()
             and targets.numel() >= DENSE_PREDICTIONS)
    return DENSE_DONE if dense else GEOMETRIC_DONE


def _classify(losses: list[float], floor: float = 0.0) -> str:
    """Which way a finite run whose gradients reach every parameter failed: unstable, slow or floor."""
    n = len(losses)
    first, last, best = losses[0], losses[-1], min(losses)
    rises = sum(max(0.0, b - a) for a, b in zip(losses, losses[1:]))
    progress = first - last
    if (last > first + RISE * abs(first) or last - best > REBOUND * (first - best)
            or max(losses) > first + SPIKE * abs(first)
            or (rises > ZIGZAG * max(progress, 0.0) and rises > ZIGZAG_AMPLITUDE * abs(first))):
        return "unstable"
    q = losses[int(0.75 * (n - 1))]
    quarter = q - last
    if progress <= 0 or quarter >= STILL_FALLING * progress:
        return "slow"
    # A loss that falls fast at first and then steadily (a regression's MSE under Adam) makes little
    # of its total progress late, yet is far from settled: judge the last quarter by the distance
    # it had left to the loss's floor.
    if q - floor > 0 and quarter >= STILL_FALLING_GAP * (q - floor):
        return "slow"
    return "floor"


def overfit_one_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    steps: int = 200,
    lr: float | None = None,
    *,
    optimizer_factory: Any = None,
    max_samples: int | None = MAX_SAMPLES,
    task: str = "auto",
    disable_dropout: bool = True,
) -> OverfitResult:
    """Train on one batch of ``batch = (inputs, targets)`` and check the loss reaches near zero.

    ``max_samples`` samples of the batch are used (None: all). The optimizer is Adam at ``lr``
    (default 3e-3) unless ``optimizer_factory`` (``params -> Optimizer``, or an optimizer whose
    state is restored afterwards) is given. Dropout is switched off during the test, since a
    network with dropout cannot memorise exactly. ``task`` is "auto", "classification",
    "binary" or "regression"; classification also requires 100% accuracy. The model, optimizer
    and RNG states are restored afterwards.

    >>> result = overfit_one_batch(model, next(iter(loader)), nn.CrossEntropyLoss())
    >>> result.passed, result.reason
    """
    check_model(model)
    check_loss_fn(loss_fn)
    check_positive("steps", steps, integer=True)
    if steps < 4:
        raise DoctorInputError(f"steps must be at least 4 to judge a loss curve, got {steps}")
    if lr is not None:
        check_positive("lr", lr)
    if task not in ("auto", "classification", "binary", "regression"):
        raise DoctorInputError(f"task must be auto, classification, binary or regression, got {task!r}")
    inputs, targets = split_batch(batch)
    if max_samples is not None:
        check_positive("max_samples", max_samples, integer=True)
        inputs, targets = take(inputs, max_samples), take(targets, max_samples)
    samples = batch_size(inputs) or 0
    named = trainable(model)
    if not named:
        raise DoctorInputError("the model has no trainable parameters (all have requires_grad=False)")
    given = optimizer_factory if isinstance(optimizer_factory, torch.optim.Optimizer) else None
    device = model_device(model)
    inputs, targets = to_device(inputs, device), to_device(targets, device)

    with preserved(model, optimizer=given), torch.enable_grad():
        model.train()
        if disable_dropout:
            _dropout_off(model)
        opt, _ = make_optimizer(optimizer_factory, [p for _, p in named], _adam(lr or DEFAULT_LR), model)
        if given is not None and lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        used_lr = float(opt.param_groups[0]["lr"]) if "lr" in opt.param_groups[0] else None
        with torch.no_grad():  # the same batch and weights again: a loss that draws differs
            evals = [float(as_float(loss_fn(model(inputs), targets))) for _ in range(RANDOM_EVALS)]
        redrawn = _spread(evals)
        # Still different with the random numbers seeded alike: state the call moves (before asking eval
        # mode: an EMA codebook, lucidrains' VectorQuantize, moves in a training forward only, as a
        # dropout draws in one only)
        stateful = redrawn is not None and _spread(_seeded_evals(model, inputs, targets, loss_fn)) is not None
        train_only = False
        if redrawn is not None and not stateful:  # the same in eval mode? then a dropout no module switch reached draws
            model.eval()
            with torch.no_grad():
                train_only = _spread([float(as_float(loss_fn(model(inputs), targets)))
                                      for _ in range(RANDOM_EVALS)]) is None
            model.train()
            if disable_dropout:
                _dropout_off(model)
        for _, p in named:
            p.grad = None
        reached = [torch.zeros((), dtype=torch.bool, device=p.device) for _, p in named]
        losses: list[float] = []
        nan_step = None
        no_path = False
        norms: list[torch.Tensor] = []
        loss = None
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = as_float(loss_fn(model(inputs), targets))
            value = float(loss.detach())  # one host sync per step: the doctor is not the hot path
            losses.append(value)
            if not math.isfinite(value):
                nan_step = step
                break
            if not loss.requires_grad:
                no_path = True
                break
            loss.backward()
            sq = []
            for i, (_, p) in enumerate(named):
                if p.grad is not None:
                    g = p.grad.detach()
                    g = g.coalesce().values() if g.is_sparse else g
                    reached[i] |= g.ne(0).any()
                    sq.append(g.double().pow(2).sum())
            norms.append(torch.stack(sq).sum().sqrt() if sq else torch.zeros((), dtype=torch.float64))
            optimizer_step(opt, loss, lambda: loss_fn(model(inputs), targets))
        with torch.no_grad():
            outputs = model(inputs)
            final = float(as_float(loss_fn(outputs, targets)))
            kind = _task(outputs, targets, loss_fn, task)
            accuracy = _accuracy(outputs, targets, kind, loss_fn)
        floor = max(_loss_floor(outputs, targets, loss_fn),
                    _loss_floor(outputs, targets, loss_fn, groups=_prefix_groups(inputs, outputs, targets)))

    unreached = [] if nan_step is not None else [n for (n, _), r in zip(named, reached) if not bool(r)]
    first_norm = float(norms[0]) if norms else None
    last_norm = float(norms[-1]) if norms else None
    initial = losses[0]
    target = floor + (max(NEAR_ZERO_REL * abs(initial - floor), NEAR_ZERO_ABS) if math.isfinite(initial) else NEAR_ZERO_ABS)
    passed = (nan_step is None and not no_path and math.isfinite(final) and final <= target
              and (accuracy is None or accuracy >= 1.0))
    reason = None
    if not passed:
        if nan_step is not None or not math.isfinite(final):
            reason = "nan"
            nan_step = len(losses) if nan_step is None else nan_step
        elif no_path or unreached or (first_norm is not None and first_norm < VANISHING_GRAD):
            reason = "flat"
        elif redrawn is not None:
            reason = "random"
        else:
            reason = _classify(losses + [final], floor)
    identical, groups, ceiling = (_identical_samples(inputs, targets) if reason in ("slow", "floor")
                                  else (None, 0, None))
    memorised, projected, ctc_blank = None, None, 0
    if reason in ("slow", "floor") and identical is not None and ceiling is not None and accuracy is not None \
            and accuracy >= ceiling - 1e-9:
        reason = "floor"  # the floor the duplicates impose: every sample the data lets it tell apart is right
    elif (reason == "slow" and accuracy is not None and accuracy >= 1.0
          and final - floor <= _done_share(targets) * (initial - floor)):
        passed, reason, memorised = True, None, "accuracy"  # every sample right; cross entropy never settles
    elif reason == "slow" and accuracy is None:
        projected = _projected_steps(losses + [final], floor, target)
        if projected is not None and projected <= len(losses):
            passed, reason, memorised = True, None, "falling"
    if reason in ("slow", "floor"):
        ctc_blank = _blank_plateau(outputs, loss, loss_fn)
        reason = "slow" if ctc_blank else reason
    if reason != "floor":
        identical, groups, ceiling = None, 0, None
    least_squares = least_squares_loss(model, inputs, targets, loss_fn) if reason == "floor" else None
    return OverfitResult(
        passed=passed, reason=reason, losses=losses, initial_loss=initial, final_loss=final, target_loss=target,
        accuracy=accuracy, steps=len(losses), samples=samples, lr=used_lr, optimizer=type(opt).__name__,
        unreached=[n for n, _ in named] if no_path else unreached, nan_step=nan_step,
        grad_norm_first=first_norm, grad_norm_last=last_norm, loss_floor=floor, redrawn=redrawn,
        train_only=train_only and reason == "random", stateful=stateful and reason == "random", identical=identical,
        identical_groups=groups, accuracy_ceiling=ceiling, memorised=memorised,
        projected_steps=projected if memorised else None, ctc_blank=ctc_blank,
        fake_quant=_fake_quant_modules(model) if stateful and reason == "random" else 0, least_squares=least_squares,
    )


def _identical_samples(inputs: Any, targets: Any) -> tuple[dict | None, int, float | None]:
    """The first input tensor (its index among the inputs, or its key) in which samples are
    identical while their targets differ, and the first such group: ``{"input": "1", "samples": [2, 5]}``;
    how many such groups it holds; and, for 1-D targets (class indices: CLIP's in-batch ones), the
    most accuracy they allow: one prediction per group, right for its commonest target (13/16 for
    three captions twice in 16 pairs). (None, 0, None) when there are none (or the targets are no tensor)."""
    if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
        return None, 0, None
    n = targets.shape[0]
    named = (inputs.items() if isinstance(inputs, dict) else enumerate(inputs) if isinstance(inputs, (tuple, list))
             else [(0, inputs)])
    rows_t = targets.reshape(n, -1)
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            continue
        _, inverse = torch.unique(t.detach().reshape(n, -1), dim=0, return_inverse=True)
        groups, wrong = [], 0
        for group in inverse.unique():
            same = (inverse == group).nonzero().flatten()
            if len(same) > 1 and not bool((rows_t[same] == rows_t[same[0]]).all()):
                groups.append([int(i) for i in same])
                _, counts = torch.unique(rows_t[same], dim=0, return_counts=True)
                wrong += len(same) - int(counts.max())
        if groups:
            ceiling = (n - wrong) / n if targets.dim() == 1 else None
            return {"input": str(name), "samples": groups[0]}, len(groups), ceiling
    return None, 0, None


def _projected_steps(curve: list[float], floor: float, target: float) -> int | None:
    """Steps more the loss needs to reach ``target`` at the pace its distance to the floor shrank
    by, in log space, over the last quarter of ``curve``; None unless it already closed nine tenths
    of its way to the floor and is still shrinking (a loss falling geometrically toward its floor:
    cross entropy's and DPO's under Adam, whose margins grow about linearly)."""
    n = len(curve)
    q, first, last = curve[int(0.75 * (n - 1))], curve[0], curve[-1]
    if not (last - floor > 0 and q - floor > last - floor and first - floor > 0 and target - floor > 0):
        return None
    if last - floor > GEOMETRIC_DONE * (first - floor):
        return None
    rate = (math.log(q - floor) - math.log(last - floor)) / (n - 1 - int(0.75 * (n - 1)))
    return max(1, math.ceil((math.log(last - floor) - math.log(target - floor)) / rate))


def _blank_plateau(outputs: Any, loss: Any, loss_fn: Any) -> int:
    """How many samples get the blank (``loss_fn.blank``, else 0) as the best class of every frame
    from a CTC loss's (``nn.CTCLoss``, or a ``ctc_loss`` in the last step's graph) ``[T, N, C]``
    outputs, when that is at least half of them: they decode to nothing, which no label is; 0 otherwise.
    (crnn-pytorch's CRNN at 200 steps: 10 of 16, the others leaving the plateau with a letter or two.)"""
    if not (isinstance(outputs, torch.Tensor) and outputs.dim() == 3 and outputs.is_floating_point()):
        return 0
    ctc = isinstance(loss_fn, nn.CTCLoss)
    if not ctc and isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
        seen, todo = 0, [loss.grad_fn]
        while todo and seen < 64 and not ctc:  # the loss's own few nodes, not the model's graph
            node = todo.pop(0)
            seen += 1
            ctc = "ctcloss" in type(node).__name__.lower()
            todo.extend(f for f, _ in node.next_functions if f is not None)
    if not ctc:
        return 0
    blank = getattr(loss_fn, "blank", 0)
    silent = int((outputs.argmax(-1) == blank).all(0).sum())
    return silent if silent >= BLANK_SHARE * outputs.shape[1] else 0


def _seeded_evals(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any) -> list[float]:
    """The loss of the same batch and weights, each call with the random generators seeded alike
    (restored afterwards): it still differs when state the call keeps changes, not its draws."""
    out = []
    with torch.no_grad():
        for _ in range(RANDOM_EVALS):
            with seeded(0):  # Python's random too: teacher forcing draws from it
                out.append(float(as_float(loss_fn(model(inputs), targets))))
    return out


# Modules that drop values while they train: nn.Dropout and its kin, and attention that takes a
# ``dropout=`` of its own (nn.MultiheadAttention, inside nn.Transformer's layers: DETR's transformer).
_DROPOUTS = (nn.modules.dropout._DropoutNd, nn.MultiheadAttention)


def _dropout_rate(value: object) -> bool:
    """A dropout probability above 0, or a list of them (PyG's MLP keeps one per layer)."""
    if isinstance(value, (list, tuple)):
        return any(_dropout_rate(v) for v in value)
    return isinstance(value, float) and 0 < value <= 1


def _dropout_off(model: nn.Module) -> None:
    """Put the modules that draw dropout masks in eval mode (the caller restores the flags).

    A module that keeps a rate and drops with ``F.dropout(x, p=self.dropout, training=self.training)``
    (PyG's GATConv(dropout=0.6), its MLP(dropout=[0.5, 0.0]), attention with ``attention_dropout``)
    has its own flag turned off, not its children's: an MLP's batch norms keep training."""
    for m in model.modules():
        if isinstance(m, _DROPOUTS):
            m.eval()
        elif any("dropout" in k and _dropout_rate(v) for k, v in vars(m).items() if not k.startswith("_")):
            m.training = False


def _spread(values: list[float]) -> tuple[float, float] | None:
    """(least, most) of finite losses of the same batch and weights that differ by more than
    RANDOM_REL; None when they agree (or one is not finite)."""
    lo, hi = min(values), max(values)
    if all(math.isfinite(v) for v in values) and hi - lo > RANDOM_REL * max(abs(lo), abs(hi)):
        return (lo, hi)
    return None


def _loss_floor(outputs: Any, targets: Any, loss_fn: Any, groups: torch.Tensor | None = None) -> float:
    """The least ``loss_fn(o, targets)`` reaches over free outputs ``o`` of the outputs' shape, when
    above 0 (label smoothing, soft targets); 0 otherwise, or when the outputs are no float tensor.
    ``groups`` ([samples, positions] ids, see :func:`_prefix_groups`): positions of one id share one
    output, as a causal model's do where the inputs so far are the same."""
    if groups is None and not (isinstance(outputs, torch.Tensor) and outputs.is_floating_point() and outputs.numel()):
        return 0.0
    try:
        with torch.enable_grad():
            if groups is None:
                free = outputs.detach().clone().requires_grad_(True)
                shaped = lambda: free  # noqa: E731
            else:
                free = torch.zeros((int(groups.max()) + 1, *outputs.shape[2:]), dtype=outputs.dtype,
                                   device=outputs.device, requires_grad=True)
                shaped = lambda: free[groups]  # noqa: E731
            opt = torch.optim.Adam([free], lr=FLOOR_LR)
            best = math.inf
            for i in range(FLOOR_STEPS):
                opt.param_groups[0]["lr"] = FLOOR_LR * (1 - i / FLOOR_STEPS)
                opt.zero_grad(set_to_none=True)
                loss = as_float(loss_fn(shaped(), targets))
                if not loss.requires_grad:
                    return 0.0
                best = min(best, float(loss.detach()))
                loss.backward()
                opt.step()
            with torch.no_grad():
                best = min(best, float(as_float(loss_fn(shaped(), targets))))
    except Exception:  # a loss that needs more than outputs and targets: no floor to tell
        return 0.0
    return best if math.isfinite(best) and best > NEAR_ZERO_ABS else 0.0


def _prefix_groups(inputs: Any, outputs: Any, targets: Any) -> torch.Tensor | None:
    """For a language model's batch, ids [samples, positions] equal where the tokens so far are equal:
    a causal model's output at position t sees ``inputs[:, :t + 1]`` alone, so where two samples begin
    alike it is one prediction for both, and their next tokens differ (every name of karpathy/makemore's
    batch begins with the start token: no model learns their first letters, and its overfit test failed at
    a "floor" of 0.50 that was the batch's own). A batch is a language model's when the targets are
    the token inputs (the loss shifts them: Hugging Face's) or the inputs shifted by one (nanoGPT's,
    makemore's, whose ignored targets, negative, are skipped) and the outputs are [samples, positions,
    vocabulary]. None otherwise."""
    x = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    if not (isinstance(x, torch.Tensor) and isinstance(targets, torch.Tensor) and isinstance(outputs, torch.Tensor)
            and x.dim() == 2 and x.shape == targets.shape and x.shape[1] > 1 and outputs.dim() == 3
            and outputs.shape[:2] == x.shape and outputs.is_floating_point()
            and not x.is_floating_point() and not targets.is_floating_point()):
        return None
    counted = targets >= 0
    same = bool(((targets == x) | ~counted).all())
    shifted = bool(((targets[:, :-1] == x[:, 1:]) | ~counted[:, :-1]).all())
    if not (same or shifted) or not bool(counted.any()):
        return None
    ids = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    out = torch.empty_like(x, dtype=torch.long)
    for t in range(x.shape[1]):  # the id of (the prefix before t, the token at t)
        _, ids = torch.unique(torch.stack([ids, x[:, t].long()], dim=1), dim=0, return_inverse=True)
        out[:, t] = ids + (int(out[:, t - 1].max()) + 1 if t else 0)
    if int(out.max()) + 1 == out.numel():
        return None  # no two prefixes alike: the free outputs' floor already says it
    return out
