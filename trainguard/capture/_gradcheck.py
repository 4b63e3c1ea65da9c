"""The live gradient check: each custom ``torch.autograd.Function`` checked once, in float64.

While a monitor runs, ``Function.apply`` is wrapped: the first call of each user-defined
Function class with an input that requires grad keeps a small copy of its inputs (a few rows of
the batch, non-tensor arguments as they are). At the next backward pass the check is handed to
a background thread, which compares the Function's ``backward`` with central differences of its
``forward`` on float64 copies of those inputs, and stops at :data:`BUDGET_SECONDS`. The results
go into the run (meta ``gradcheck``); ``analysis`` turns a wrong one into an ``error`` finding.

The comparison uses the doctor's bands (``doctor/_gradcheck.py`` imports them from here): a
random projection ``f = sum(v * forward(x))`` of the outputs, the analytic ``df/dx`` from the
Function's backward, and ``(f(x + eps) - f(x - eps)) / 2 eps`` for a sample of entries of each
input; relative differences below 1e-5 are correct, above 1e-3 wrong, and entries near the
edge are measured again with larger steps.

What is not checked (recorded as ``skipped`` with the reason, never an alarm): Functions that do
not run in float64 or return another dtype, whose forward is not deterministic, that return no
differentiable output, or whose forward is piecewise constant where the backward is not (a
straight-through estimator: a surrogate gradient by design).

The check draws no numbers from torch's global generators (its projection has its own), but a
Function whose forward itself draws random numbers advances them when the check calls it.
"""

from __future__ import annotations

import inspect
import logging
import math
import queue
import threading
import time
from typing import Any

import torch

from trainguard.capture import _monitor_tap

log = logging.getLogger("trainguard.monitor")

# Relative differences below this are correct (float64 central differences).
PASS_BAND = 1e-5
# Relative differences above this are a bug.
BUG_BAND = 1e-3
# Denominator floor: entries whose gradients are both below this (in loss units per unit of the
# input) are compared on an absolute scale, because at eps=1e-6 float64 round-off in the loss
# alone is about 1e-10 * |loss|, i.e. up to 1e-5 relative on a 1e-5 gradient.
FLOOR = 1e-7
# Entries above this are measured again with larger steps (round-off shrinks as eps grows) and
# smaller ones (a step that moves thousands of ReLU-like inputs crosses some of their kinks, more
# the larger it is: pytorch/examples' DCGAN discriminator differed by 4e-4..2e-1 at 1e-6 and 1e-5,
# and agreed at 1e-7). The best is kept: a wrong gradient is wrong at every step.
RETRY_ABOVE = PASS_BAND / 10
RETRY_FACTORS = (10.0, 100.0, 0.1, 0.01)
EPS = 1e-6
# Units in the last place of the loss that two evaluations may differ by with the true slope 0 (a
# bias before a softmax, which takes it off again: Time-Series-Library's Autoformer moved its loss
# of 1.28 by one ulp over its widest step, a slope of 1.1e-12 against autograd's 1.6e-18).
ROUNDOFF_ULPS = 4

# Seconds one Function's check may take on the background thread.
BUDGET_SECONDS = 2.0
# Rows of the batch dimension kept of each input (inputs whose first dimension is the batch's).
MAX_ROWS = 4
# Entries of each input compared with central differences (2 forward calls each).
MAX_ENTRIES = 16
# Inputs up to this size are also kept whole, for Functions that need their full shape.
MAX_FULL_NUMEL = 1 << 16
# Modules whose Functions are torch's or trainguard's own, not the user's.
_OWN_MODULES = ("torch.", "trainguard.")


def relative(a: float, n: float, tolerance: float = 0.0) -> float:
    """The relative difference of an analytic and a numerical derivative, ``|a - n| /
    max(|a|, |n|, FLOOR)`` (infinite when not finite); the part of ``|a - n|`` within
    ``tolerance`` (a :func:`resolution`) is no difference."""
    rel = max(abs(a - n) - tolerance, 0.0) / max(abs(a), abs(n), FLOOR)
    return rel if math.isfinite(rel) else math.inf


def resolution(loss: float, eps: float) -> float:
    """The smallest slope a central difference with step ``eps`` tells from 0 on a loss of this
    size: ``ROUNDOFF_ULPS`` units in its last place over the step's width."""
    return ROUNDOFF_ULPS * math.ulp(abs(loss)) / (2 * eps) if math.isfinite(loss) else 0.0


def band(rel: float) -> str:
    """``ok`` below 1e-5, ``wrong`` above 1e-3 (or NaN), ``suspicious`` in between."""
    if not rel <= BUG_BAND:  # NaN and Inf are wrong too
        return "wrong"
    return "ok" if rel < PASS_BAND else "suspicious"


class _Skip(Exception):
    """The Function cannot be checked this way; the message says why."""


# ---------------------------------------------------------------------- the check itself
def _input_names(cls: type, n: int) -> list[str]:
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        params = []
    base = getattr(torch.autograd.function, "_SingleLevelFunction", torch.autograd.Function)
    # forward(ctx, ...) unless the Function has a separate setup_context (then forward(...)).
    if getattr(cls, "setup_context", None) is getattr(base, "setup_context", None) and params:
        params = params[1:]
    return [params[i] if i < len(params) else f"input {i}" for i in range(n)]


def _where(cls: type) -> tuple[str | None, int | None]:
    try:
        target = cls.__dict__.get("backward", cls.backward)
        target = getattr(target, "__func__", target)
        return inspect.getsourcefile(target), inspect.getsourcelines(target)[1]
    except (TypeError, OSError, AttributeError):
        return None, None


def _outputs(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in items if isinstance(o, torch.Tensor)]


class _Case:
    """A Function's inputs in float64, the projection of its outputs, and ``f(x)``."""

    def __init__(self, cls: type, args: list, kwargs: dict):
        self.cls = cls
        self.kwargs = kwargs
        self.args = []
        self.diff: list[int] = []  # positions of the inputs whose gradients are checked
        for i, a in enumerate(args):
            if isinstance(a, _Kept):
                t = a.value.to(torch.float64) if a.value.is_floating_point() else a.value
                if a.requires_grad and t.is_floating_point():
                    t = t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(True)
                    self.diff.append(i)
                self.args.append(t)
            else:
                self.args.append(a)
        if not self.diff:
            raise _Skip("no floating input that requires grad")
        with torch.enable_grad():
            outs = self._call()
        diff_out = [o for o in outs if o.requires_grad]
        if not diff_out:
            raise _Skip("no differentiable output")
        if any(o.dtype != torch.float64 for o in diff_out):
            raise _Skip(f"it does not compute in float64 (float64 inputs give {diff_out[0].dtype} outputs)")
        g = torch.Generator().manual_seed(0)
        self.proj = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device) if o.requires_grad
                     else None for o in outs]
        f = sum((o * v).sum() for o, v in zip(outs, self.proj) if v is not None)
        grads = torch.autograd.grad(f, [self.args[i] for i in self.diff], allow_unused=True)
        self.analytic = [torch.zeros_like(self.args[i]) if gr is None else gr.detach() for i, gr in zip(self.diff, grads)]
        self.f0 = float(f.detach())
        if self.value() != self.f0:
            raise _Skip("its forward is not deterministic")

    def _call(self) -> list[torch.Tensor]:
        try:
            out = self.cls.apply(*self.args, **self.kwargs)
        except Exception as exc:
            raise _Skip(f"its forward fails in float64: {type(exc).__name__}: {exc}"[:200]) from None
        return _outputs(out)

    def value(self) -> float:
        with torch.no_grad():
            outs = self._call()
            return float(sum((o * v).sum() for o, v in zip(outs, self.proj) if v is not None))


def _numeric(case: _Case, x: torch.Tensor, flat: int, eps: float) -> float:
    view = x.detach().view(-1)
    old = float(view[flat])
    with torch.no_grad():
        view[flat] = old + eps
        hi = case.value()
        view[flat] = old - eps
        lo = case.value()
        view[flat] = old
    return (hi - lo) / (2 * eps)


def check_function(cls: type, args: list, kwargs: dict, deadline: float) -> dict:
    """Compare ``cls.backward`` with central differences of ``cls.forward`` on ``args`` (kept inputs)."""
    case = _Case(cls, args, kwargs)
    names = _input_names(cls, len(case.args))
    inputs = []
    timed_out = False
    for i, a in zip(case.diff, case.analytic):
        x = case.args[i]
        n = x.numel()
        if not n:
            continue
        k = min(MAX_ENTRIES, n)
        picks = sorted({int(round(j * (n - 1) / max(k - 1, 1))) for j in range(k)})
        worst = {"max_rel": 0.0, "index": None, "analytic": 0.0, "numeric": 0.0}
        flat_a = a.reshape(-1)
        checked = 0
        all_flat = True
        for p in picks:
            if time.monotonic() > deadline:
                timed_out = True
                break
            an = float(flat_a[p])
            best = math.inf
            nu = 0.0
            for factor in (1.0, *RETRY_FACTORS):
                num = _numeric(case, x, p, EPS * factor)
                rel = relative(an, num)
                if rel < best:
                    best, nu = rel, num
                if best <= RETRY_ABOVE:
                    break
            checked += 1
            if abs(nu) >= FLOOR:
                all_flat = False
            if not best <= worst["max_rel"]:
                worst = {"max_rel": best, "index": p, "analytic": an, "numeric": nu}
        if not checked:
            break
        status = band(worst["max_rel"])
        if status != "ok" and all_flat:
            raise _Skip(f"its forward is piecewise constant in {names[i]!r} where the backward is not "
                        "(a surrogate gradient, e.g. a straight-through estimator)")
        idx = list(torch.unravel_index(torch.tensor(worst["index"]), tuple(x.shape))) if worst["index"] is not None \
            else []
        inputs.append({"index": i, "name": names[i], "shape": list(x.shape), "checked": checked,
                       "max_rel": worst["max_rel"], "analytic": worst["analytic"], "numeric": worst["numeric"],
                       "worst_index": [int(v) for v in idx], "status": status})
        if timed_out:
            break
    if not inputs:
        raise _Skip(f"out of time ({BUDGET_SECONDS:g} s) before one entry was compared")
    order = {"ok": 0, "suspicious": 1, "wrong": 2}
    status = max((inp["status"] for inp in inputs), key=order.__getitem__)
    out = {"status": status, "inputs": inputs}
    if timed_out:
        out["timed_out"] = True
    return out


# ---------------------------------------------------------------------- what is kept of a call
class _Kept:
    __slots__ = ("value", "requires_grad")

    def __init__(self, value: torch.Tensor, requires_grad: bool):
        self.value = value
        self.requires_grad = requires_grad


def _keep(args: tuple) -> tuple[list | None, list | None]:
    """(inputs cut to MAX_ROWS rows of the batch, whole inputs when small); copies, detached."""
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
    rows = first.shape[0] if first is not None else None
    sliced: list | None = [] if rows is not None and rows > MAX_ROWS else None
    whole: list | None = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            if sliced is not None:
                sliced.append(a)
            if whole is not None:
                whole.append(a)
            continue
        d = a.detach()
        if sliced is not None:
            cut = d[:MAX_ROWS] if d.dim() >= 1 and d.shape[0] == rows else d
            sliced.append(_Kept(cut.clone(), a.requires_grad) if cut.numel() <= MAX_FULL_NUMEL else None)
            if sliced[-1] is None:
                sliced = None
        if whole is not None:
            if d.numel() <= MAX_FULL_NUMEL:
                whole.append(_Kept(d.clone(), a.requires_grad))
            else:
                whole = None
    return sliced, whole


class LiveGradcheck:
    """Checks each custom Function the first time it runs before a backward pass (see module doc).

    ``writer`` receives the results as run meta ``gradcheck``. :meth:`close` waits for the
    checks in flight (each bounded by ``budget`` seconds) and uninstalls the wrapper.
    """

    def __init__(self, writer: Any, budget: float = BUDGET_SECONDS):
        self.writer = writer
        self.budget = budget
        self.seen: set[type] = set()
        self.kept: list[tuple[type, list | None, list | None, dict]] = []
        self.results: list[dict] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._worker_ident: int | None = None
        _install(self)

    # training thread ---------------------------------------------------------------
    def on_apply(self, cls: type, args: tuple, kwargs: dict) -> None:
        if cls in self.seen or threading.get_ident() == self._worker_ident or not torch.is_grad_enabled():
            return
        if (cls.__module__ or "").startswith(_OWN_MODULES):
            self.seen.add(cls)
            return
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
            return  # a call without gradients says nothing about backward
        self.seen.add(cls)
        sliced, whole = _keep(args)
        self.kept.append((cls, sliced, whole, dict(kwargs)))

    def on_backward(self, loss: torch.Tensor) -> None:
        if not self.kept:
            return
        for item in self.kept:
            self._queue.put(item)
        self.kept = []
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="trainguard-gradcheck", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Wait for the checks in flight, write the results, uninstall the wrapper."""
        _uninstall(self)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self.budget * (self._queue.qsize() + 1) + 5.0)
        self._write()

    # background thread -------------------------------------------------------------
    def _work(self) -> None:
        self._worker_ident = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                return
            cls, sliced, whole, kwargs = item
            result = self._check(cls, sliced, whole, kwargs)
            with self._lock:
                self.results.append(result)
            self._write()

    def _check(self, cls: type, sliced: list | None, whole: list | None, kwargs: dict) -> dict:
        file, line = _where(cls)
        rec: dict[str, Any] = {"function": f"{cls.__module__}.{cls.__qualname__}", "name": cls.__qualname__,
                               "file": file, "line": line}
        start = time.monotonic()
        deadline = start + self.budget
        reason = "its inputs are too large to keep"
        for variant, args in (("sliced", sliced), ("whole", whole)):
            if args is None:
                continue
            try:
                rec.update(check_function(cls, args, kwargs, deadline))
                rec["sliced"] = variant == "sliced"
                break
            except _Skip as exc:
                reason = str(exc)
                if not reason.startswith("its forward fails"):
                    break  # the whole inputs would not change that
            except Exception as exc:  # a check never hurts training
                reason = f"the check failed: {type(exc).__name__}: {exc}"[:200]
                break
        if "status" not in rec:
            rec.update(status="skipped", reason=reason)
        rec["seconds"] = round(time.monotonic() - start, 4)
        return rec

    def _write(self) -> None:
        with self._lock:
            results = list(self.results)
        if results:
            try:
                self.writer.set_meta(gradcheck=results)
            except Exception:
                log.exception("trainguard monitor: storing the gradient check failed")


# ---------------------------------------------------------------------- the Function.apply wrapper
_checkers: list[LiveGradcheck] = []
_install_lock = threading.Lock()
_original_apply: Any = None


def _apply(cls, *args, **kwargs):
    if _checkers and not torch.compiler.is_compiling():
        for c in list(_checkers):
            if cls in c.seen:
                continue
            try:
                with _monitor_tap.quiet():  # the copies are trainguard's, not the program's ops
                    c.on_apply(cls, args, kwargs)
            except Exception:  # observing training never kills training
                log.exception("trainguard monitor: keeping the inputs of %s failed", getattr(cls, "__name__", cls))
    return _original_apply.__func__(cls, *args, **kwargs)


def _install(checker: LiveGradcheck) -> None:
    global _original_apply
    with _install_lock:
        if not _checkers:
            _original_apply = torch.autograd.Function.__dict__["apply"]
            torch.autograd.Function.apply = classmethod(_apply)
        _checkers.append(checker)


def _uninstall(checker: LiveGradcheck) -> None:
    global _original_apply
    with _install_lock:
        if checker in _checkers:
            _checkers.remove(checker)
        if not _checkers and _original_apply is not None:
            if getattr(torch.autograd.Function.__dict__.get("apply"), "__func__", None) is _apply:
                torch.autograd.Function.apply = _original_apply
            _original_apply = None
