"""The validation pass, seen by the monitor: the loss and accuracy a script computes in evaluation.

A forward pass of a watched model under ``torch.no_grad()`` / ``torch.inference_mode()``, or in
eval mode with no ``backward`` after it, is an evaluation forward. While one has run since the last training forward, the losses the script
computes (``torch.nn`` loss modules call ``torch.nn.functional``, so wrapping the functional
losses sees both spellings; ``from torch.nn.functional import cross_entropy`` done before the
monitor starts keeps the unwrapped function and is not seen) are summed on the device, with the argmax accuracy when the loss
compares class scores with integer targets. At the end of the step they become the per-step
scalars ``val_loss`` and ``val_accuracy`` (the mean over every evaluation batch of that step),
shipped with the other scalars: no host sync.

Batches are grouped into passes by where the script computed them: the chain of its own frames
(everything outside torch and trainguard) at the loss call, reaching past an installed engine's
frames to the script's own (``pass_key``). The batches of one evaluation loop
share it; pytorch/examples gcn evaluates the training rows and then the validation rows through
one ``test()`` called from two lines, which differ. When one step has several passes, the last
one to start is the validation (gcn's order, and ``evaluate(train); evaluate(val)``'s): averaging
the training rows in would hide a validation loss that rises while the training loss falls. A
variable of the script's frames whose value names a split tells passes apart too, and a pass
named as a validation split is the validation (nanoGPT's ``estimate_loss``: both splits from one
line, in ``for split in ['train', 'val']``). Once known, the validation is the pass computed
where it was: a test set evaluated after training, in the last step, is not a validation point.

The wrappers are installed while at least one monitor listens, as ``_monitor_tap`` does for
``backward``; a training loss costs one Python call and a flag test.

A loss computed inside a compiled model (nanoGPT's ``forward(idx, targets)``) is traced by
Dynamo with its wrapper: there the wrapper only emits ``trainguard::loss_tap`` (the loss, its
prediction and target, the keyword constants on_loss reads), a side-effect op the compiled code
calls at every run, whose kernel calls the listeners as the eager wrapper does. Tracing the
listeners themselves would bake their Python state into the graph (graph breaks, and a
recompile whenever an evaluation flips it).
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import site
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from trainguard.capture._monitor_tap import quiet

# The functional losses a validation pass computes, whose first two arguments are the
# prediction and the target. Classification losses among them get an argmax accuracy.
LOSSES = (
    "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss",
    "soft_margin_loss", "multi_margin_loss", "multilabel_soft_margin_loss",
)
_CLASS_LOSSES = ("cross_entropy", "nll_loss", "multi_margin_loss")

_lock = threading.Lock()
_listeners: list[Callable[[str, tuple, dict, Any], None]] = []
_originals: dict[str, Callable] = {}


_lib = torch.library.Library("trainguard", "FRAGMENT")
_lib.define("loss_tap(Tensor[] tensors, str name, str reduction, int ignore_index, bool grad) -> ()")


def _loss_tap(tensors, name, reduction, ignore_index, grad) -> None:
    """Run time of a loss traced into compiled code: ``tensors`` are the loss, its prediction and
    target; ``grad`` whether grad mode was on where it was traced (a training loss: inside the
    compiled forward nothing requires grad)."""
    out, pred, target = tensors
    kwargs = {"reduction": reduction, "ignore_index": ignore_index}
    for listener in list(_listeners):
        try:
            listener(name, (pred, target), kwargs, out, requires_grad=grad)
        except Exception:  # observing training never kills training
            pass


def _loss_tap_meta(tensors, name, reduction, ignore_index, grad) -> None:
    return None


_lib.impl("loss_tap", _loss_tap, "CompositeExplicitAutograd")
_lib.impl("loss_tap", _loss_tap_meta, "Meta")
_tap = torch.ops.trainguard.loss_tap.default
torch.fx.node.has_side_effect(_tap)


def _trace(name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Under Dynamo: the loss becomes a tap in the graph, when on_loss could use it."""
    pred, target = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
    reduction, ignore = kwargs.get("reduction", "mean"), kwargs.get("ignore_index", -100)
    if (isinstance(out, torch.Tensor) and isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor)
            and isinstance(reduction, str) and isinstance(ignore, int)):
        _tap([out, pred, target], name, reduction, ignore, torch.is_grad_enabled())


def _show_at_caller(msg: Any) -> None:
    """``warnings._showwarnmsg`` while the losses are wrapped: torch warns at its caller's line
    (``stacklevel=2``: "Using a target size ... different to the input size"), which is the
    wrapper's; the warning is shown at the user's call instead, where the wrapper was called.
    (Filters and "once per line" judged it at the wrapper's line already: a warning seen from one
    of the user's lines is not shown again from another.)"""
    if msg.filename == __file__:
        f = sys._getframe(1)
        while f is not None and f.f_code is not _LOSS_CODE:
            f = f.f_back
        if f is not None and f.f_back is not None:
            caller = f.f_back
            msg = warnings.WarningMessage(msg.message, msg.category, caller.f_code.co_filename, caller.f_lineno,
                                          msg.file, None, msg.source)
    _shown[0](msg)


_shown: list[Callable] = []  # warnings._showwarnmsg before _show_at_caller replaced it
_LOSS_CODE: Any = None  # the wrappers' code (one for all of them)


def _wrap(name: str, fn: Callable) -> Callable:
    def loss(*args, **kwargs):
        out = fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            _trace(name, args, kwargs, out)
        elif _listeners and not (isinstance(out, torch.Tensor) and out.is_meta):  # a shape pass: no values
            for listener in list(_listeners):
                try:
                    listener(name, args, kwargs, out)
                except Exception:  # observing training never kills training
                    pass
        return out

    global _LOSS_CODE
    _LOSS_CODE = loss.__code__
    loss.__wrapped__ = fn  # type: ignore[attr-defined]
    loss.__name__ = fn.__name__
    loss.__doc__ = fn.__doc__
    loss._trainguard_eval = True  # type: ignore[attr-defined]
    return loss


def add_listener(fn: Callable[[str, tuple, dict, Any], None]) -> None:
    """Call ``fn(loss_name, args, kwargs, result)`` for every functional loss computed without grad."""
    with _lock:
        if not _listeners:
            for name in LOSSES:
                orig = getattr(F, name, None)
                if orig is None or getattr(orig, "_trainguard_eval", False):
                    continue
                _originals[name] = orig
                setattr(F, name, _wrap(name, orig))
            if not _shown:
                _shown.append(warnings._showwarnmsg)
                warnings._showwarnmsg = _show_at_caller
        _listeners.append(fn)


def remove_listener(fn: Callable) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
        if not _listeners:
            for name, orig in _originals.items():
                if getattr(getattr(F, name, None), "__wrapped__", None) is orig:
                    setattr(F, name, orig)
            _originals.clear()
            if _shown:
                if warnings._showwarnmsg is _show_at_caller:
                    warnings._showwarnmsg = _shown[0]
                _shown.clear()


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


# Frames of these packages are not the script's: a pass is told apart by the script's own frames.
_NOT_SCRIPT = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The script frames a pass is keyed by, innermost first: the loss call's line and its callers.
_PASS_FRAMES = 6
# Installed code (the standard library, site-packages): a framework's engine. Its frames key a pass
# too, but the key also reaches out to _OWN_FRAMES frames of the user's own code.
_LIBRARIES = tuple(
    sorted({os.path.join(os.path.abspath(p), "") for p in
            [*(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")),
             *getattr(site, "getsitepackages", list)(), getattr(site, "getusersitepackages", str)()] if p})
) + ("<frozen ",)
_OWN_FRAMES = 3


def pass_key() -> tuple:
    """The script's frames at this call (file and line, innermost first): where the script
    computed a loss (or ran a forward), which the batches of one evaluation loop share; then the
    split names its frames hold (see ``split_of``).

    The innermost ``_PASS_FRAMES`` frames outside torch and trainguard, then further out until
    ``_OWN_FRAMES`` of them are the user's own (outside installed packages): an engine computes
    every pass's loss in its own code (pytorch-ignite's ``Loss.update`` under
    ``Engine._fire_event`` and four more frames of ``Engine.run``), the same frames for
    ``evaluator.run(train_loader)`` and ``evaluator.run(val_loader)``; the script's lines that
    ran them differ."""
    key: list = []
    splits: list = []
    words: list = []
    own = 0
    f = sys._getframe(1)
    while f is not None and (len(key) < _PASS_FRAMES or own < _OWN_FRAMES):
        name = f.f_code.co_filename
        if not name.startswith(_NOT_SCRIPT):
            mine = not name.startswith(_LIBRARIES)
            if len(key) < _PASS_FRAMES or mine:
                key.append((name, f.f_lineno))
                splits.extend(_split_names(f))
                words.append(_line_split(name, f.f_lineno))
                own += mine
        f = f.f_back
    if any(words):
        key.append(("args", tuple(words)))
    if splits:
        key.append(("split", tuple(splits)))
    return tuple(key)


# The names a script gives its splits. nanoGPT's estimate_loss computes both splits' losses on one
# line, in ``for split in ['train', 'val']``: the line alone makes them one pass; the loop
# variable tells them apart.
TRAIN_SPLITS = frozenset({"train", "training"})
VAL_SPLITS = frozenset({"val", "vali", "valid", "validation", "dev", "eval", "evaluation", "holdout"})
_SPLITS = TRAIN_SPLITS | VAL_SPLITS | {"test", "testing"}


def _split_names(frame: Any) -> list[tuple[str, str]]:
    """The variables of ``frame`` whose value is a split's name (plain strings only: Lightning's
    stage enums are str subclasses, named the same in every pass)."""
    try:
        names = frame.f_locals
    except Exception:
        return []
    return [(k, v.lower()) for k, v in list(names.items()) if type(v) is str and len(v) <= 10 and v.lower() in _SPLITS]


@functools.lru_cache(maxsize=4096)
def _line_split(filename: str, lineno: int) -> str | None:
    """The split that the arguments of the calls on a script's line name, as one word of their
    variables' names: Time-Series-Library evaluates ``self.vali(vali_data, vali_loader, criterion)``
    and then ``self.vali(test_data, test_loader, criterion)``, one function called from two lines
    with no split in a string. None when the line names none, or several (``evaluate(model,
    train_loader, val_loader)``), or does not parse on its own."""
    text = linecache.getline(filename, lineno).strip()
    tree = None
    for src in (text, text + " pass"):  # a ``for ... in vali_loader:`` header needs a body
        try:
            tree = ast.parse(src)
            break
        except (SyntaxError, ValueError):
            continue
    if tree is None:
        return None
    found = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call):
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                for node in ast.walk(arg):
                    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
                    found.update(w for w in name.lower().split("_") if w in _SPLITS)
    return found.pop() if len(found) == 1 else None


def split_of(key: tuple | None, among: Any = ()) -> str | None:
    """The split a pass's key names: the innermost frame's split variable, if any; else the split
    named by the arguments at the innermost of its frames where it parted from another pass of
    ``among`` (the keys of the passes evaluated with it): a line that called both passes, as
    ``findings = run(model, train_words, test_words)`` around them, names neither."""
    if not key:
        return None
    if key[-1][0] == "split":
        return key[-1][1][0][1]
    if key[-1][0] != "args":
        return None
    words = key[-1][1]
    for other in among:
        if other == key:
            continue
        for i, word in enumerate(words):
            if i >= len(other) or other[i] != key[i]:
                if word is not None:
                    return word
                break
    return None


def _count_labels(counts: torch.Tensor | None, classes: int, target: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
    """``counts`` (per class, on the device; a new one when absent or of another size) plus the
    valid targets of one batch."""
    if counts is None or counts.numel() != classes:
        counts = torch.zeros(classes, device=target.device)
    # scatter_add, not bincount: bincount reads the largest label back to the host
    idx = target.reshape(-1).clamp(0, classes - 1).to(counts.device)
    return counts.scatter_add_(0, idx, valid.reshape(-1).float().to(counts.device))


class _Pass:
    """One evaluation pass's sums, on the device."""

    __slots__ = ("loss_sum", "loss_n", "correct", "acc_n", "labels", "moments")

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.loss_n = 0
        self.correct: torch.Tensor | None = None
        self.acc_n: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None  # valid targets per class
        self.moments: torch.Tensor | None = None  # an MSE's targets: count, sum, sum of squares


class EvalWatch:
    """Sums the losses and correct predictions of the evaluation forwards of one step, on the device."""

    def __init__(self) -> None:
        self.active = False  # an evaluation forward ran since the last training forward
        self.loss_fn: str | None = None  # the first loss seen in evaluation: the one recorded
        self.classes: int | None = None
        self.batches = 0
        self._by_mode = False
        # Validation labels per class, for the chance level (the loss and accuracy of always
        # guessing the class priors); summed on the device over the whole run.
        self._label_counts: torch.Tensor | None = None
        # An MSE's validation targets: count, sum, sum of squares (float64, on the device); their
        # variance is the loss of always predicting their mean, a regression's chance level.
        self._moments: torch.Tensor | None = None
        self.passes = 0  # the most evaluation passes one step had
        self._val_key: tuple | None = None  # where the validation pass of earlier steps was computed
        self._reset()
        add_listener(self.on_loss)

    def _reset(self) -> None:
        self._passes: dict[tuple, _Pass] = {}  # this step's passes, in the order they started

    def close(self) -> None:
        remove_listener(self.on_loss)

    def on_forward(self, grad_on: bool, training: bool) -> None:
        """A watched model's forward began: evaluation when gradients are off or the model is in
        eval mode (then only until a ``backward`` shows it was a training step in eval mode)."""
        self.active = not grad_on or not training
        self._by_mode = grad_on and not training

    def on_backward(self) -> None:
        if self._by_mode:  # eval mode with gradients, then backward: training, not validation
            self._reset()
            self.active = self._by_mode = False

    def on_loss(self, name: str, args: tuple, kwargs: dict, out: Any, requires_grad: bool | None = None) -> None:
        """``requires_grad``: a loss computed inside compiled code (see ``_loss_tap``)."""
        if not self.active or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if (out.requires_grad if requires_grad is None else requires_grad) and not self._by_mode:
            return  # a training loss after a no-grad forward (a target network's output as the target)
        if self.loss_fn is None:
            self.loss_fn = name
        elif name != self.loss_fn:
            return  # a second loss in the same pass (an auxiliary term): the first one is the metric
        pred = _arg(args, kwargs, 0, "input")
        target = _arg(args, kwargs, 1, "target")
        if not isinstance(pred, torch.Tensor) or not isinstance(target, torch.Tensor) or pred.dim() == 0:
            return
        reduction = kwargs.get("reduction", "mean")
        rows = int(pred.shape[0]) if pred.dim() > 1 or name not in _CLASS_LOSSES else 1
        key = pass_key()
        p = self._passes.get(key)
        if p is None:
            p = self._passes[key] = _Pass()
            self.passes = max(self.passes, len(self._passes))
        with quiet(), torch.no_grad():
            value = out.detach().float()
            if reduction == "none" or value.numel() != 1:
                total, n = value.sum(), value.numel()
            elif reduction == "sum":
                total, n = value.reshape(()), rows
            else:
                total, n = value.reshape(()) * rows, rows
            p.loss_sum = total if p.loss_sum is None else p.loss_sum + total.to(p.loss_sum.device)
            p.loss_n += n
            self.batches += 1
            if name == "mse_loss" and target.is_floating_point():
                t = target.detach().double()
                m = torch.stack([torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device), t.sum(), (t * t).sum()])
                p.moments = m if p.moments is None else p.moments + m.to(p.moments.device)
            if name in _CLASS_LOSSES and pred.dim() >= 2 and not target.is_floating_point():
                if target.shape == pred.shape[:1] + pred.shape[2:]:
                    self.classes = int(pred.shape[1])
                    ignore = kwargs.get("ignore_index", -100)
                    valid = target != ignore
                    p.labels = _count_labels(p.labels, self.classes, target, valid)
                    hit = ((pred.argmax(1) == target) & valid).sum()
                    cnt = valid.sum()
                    if p.correct is None:
                        p.correct, p.acc_n = hit, cnt
                    else:
                        p.correct = p.correct + hit
                        p.acc_n = p.acc_n + cnt

    def take(self) -> dict[str, torch.Tensor]:
        """The step's ``val_loss`` and ``val_accuracy`` (of its validation pass: the one computed
        where earlier steps' was, else the last to start) as 0-d device tensors (empty if none)."""
        out: dict[str, torch.Tensor] = {}
        # The pass computed where earlier steps' validation was, if this step has one: a test set
        # evaluated once after training (gcn's last step) is not the last validation point.
        key = self._val_key if self._val_key in self._passes else None
        if key is None:  # the last pass named a validation split, else the last pass
            named = [k for k in self._passes if split_of(k, self._passes) in VAL_SPLITS]
            key = named[-1] if named else next(reversed(self._passes), None)
        p = self._passes.get(key) if key is not None else None
        if p is not None and p.loss_sum is not None and p.loss_n:
            self._val_key = key
            with quiet(), torch.no_grad():
                out["val_loss"] = p.loss_sum / p.loss_n
                if p.correct is not None:
                    out["val_accuracy"] = p.correct.float() / p.acc_n.clamp(min=1).float()
                if p.labels is not None:
                    c = self._label_counts
                    same = c is not None and c.numel() == p.labels.numel()
                    self._label_counts = c + p.labels.to(c.device) if same else p.labels
                if p.moments is not None:
                    m = self._moments
                    self._moments = p.moments if m is None else m + p.moments.to(m.device)
        self._reset()
        return out

    def summary(self) -> dict[str, Any]:
        """What the run's metadata says about the validation pass."""
        counts = None
        if self._label_counts is not None:
            with quiet():
                counts = [int(v) for v in self._label_counts.cpu().tolist()]  # once, when the monitor closes
        moments = None
        if self._moments is not None:
            with quiet():
                moments = [float(v) for v in self._moments.cpu().tolist()]  # once, when the monitor closes
        return {"loss_fn": self.loss_fn, "classes": self.classes, "batches": self.batches, "passes": self.passes,
                "label_counts": counts, "target_moments": moments}
