"""Gradient check: autograd's gradients against central finite differences, in float64.

Each parameter is checked along ``directions`` random directions ``z`` (Gaussian, one value
per entry): the directional derivative ``(L(w + eps z) - L(w - eps z)) / (2 eps)`` against
autograd's ``<grad, z>``. One direction covers every entry of the parameter in two forward
passes, so a gradient wrong in a single entry of a large tensor shows up, where sampling a few
entries would miss it. A parameter whose check fails is then narrowed down to its worst entry by
bisection: the discrepancy is linear in ``z``, so checking the first half of the remaining range
gives the second half's too, two passes per halving (about 2 log2(numel) passes); that entry is
checked on its own, and it is what a finding names. ``samples_per_param`` entries may be checked
on their own as well. The relative difference ``|a - n| / max(|a|, |n|, floor)`` is banded, after
taking off ``|a - n|`` what the loss's round-off makes of the slope at the widest step tried (4 ulps
of the loss over ``2 * 100 * eps``: a true slope of 0 whose loss moved by one ulp is no error):

- below 1e-5: correct;
- above 1e-3: a bug (a wrong ``backward``, a gradient that does not flow), unless the loss has a
  kink there (its one-sided slopes differ: a ReLU at exactly 0), which is suspicious;
- in between: suspicious. Kinks (ReLU at 0, max-pool ties), float64 round-off on tiny
  gradients, or a real but small error; look at the parameter, re-run with another ``eps``.

A check within 10x of the pass band's edge or beyond is re-measured with ``eps`` 10x and 100x
larger and 10x and 100x smaller and keeps its best value: round-off shrinks with a larger step,
the kinks a step crosses (LeakyReLU inputs near 0, thousands of them moved by one conv weight) and
truncation error with a smaller one, while a wrong gradient is wrong at every step. The model runs in float64 (parameters, buffers,
floating inputs and targets, and the default dtype) and is put back to its own dtypes afterwards.
Each evaluation reseeds the RNG, so dropout draws the same mask every time, and puts the
buffers back, so a forward that updates them in place (an EMA codebook) sees the same ones. A cast to a narrower
floating type inside the forward (johnma2006/mamba-minimal's ``self.D.float()``) is kept in
float64 while the check runs (:class:`_KeepFloat64`): float64 differences of a forward that ran
partly in float32 see its round-off, and called the gradient of such a parameter wrong.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainguard.capture._gradcheck import (  # noqa: F401 - the bands are the doctor's API too
    BUG_BAND,
    FLOOR,
    PASS_BAND,
    RETRY_ABOVE,
    RETRY_FACTORS,
    band,
    relative,
    resolution,
)
from trainguard.doctor._detaches import DetachWatch, HeldDetaches, detach_note, site_text
from trainguard.doctor._results import CheckResult, finding, fmt
from trainguard.doctor._state import (
    Buffers,
    DoctorInputError,
    as_float,
    batch_size,
    check_loss_fn,
    check_model,
    check_positive,
    map_tensors,
    model_device,
    preserved,
    seed_host_generators,
    split_batch,
    take,
)
from trainguard.store import Finding

# The bands, the denominator floor and the retries are shared with the monitor's live check of
# custom autograd Functions (capture/_gradcheck.py), so both judge a gradient the same way.
# The gradient check's own sample: few samples keep the forward passes cheap.
MAX_SAMPLES = 8
# Random directions per parameter: two forward passes each.
DIRECTIONS = 2


@dataclass(kw_only=True)
class ParamCheck:
    """One parameter's comparison and how it was banded: ``max_rel`` is the largest relative
    difference of its directions and entries; ``analytic``/``numeric`` are those of its worst
    direction, or of the worst entry (``worst_index``, empty when none was narrowed down)."""

    name: str
    shape: list[int]
    checked: int  # entries the check covered (every entry, with a direction)
    max_rel: float
    status: str  # "ok", "suspicious", "wrong", "detached" (wrong, but exact with the detached values held)
    worst_index: list[int]
    analytic: float
    numeric: float
    no_grad: bool = False
    directions: int = 0
    # The loss is not differentiable there: its one-sided slopes differ (ReLU at exactly 0, max-pool
    # ties), so a difference above the bug band is no evidence of a bug.
    kink: bool = False
    # The largest relative difference again with every .detach() of the forward returning what it
    # returned in the first forward (None: not measured)
    held_rel: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# Why a gradient check compared nothing: the finding's severity and fix.
_CANNOT_CHECK = {
    "loss": ("error", "The loss must be finite and depend on the parameters for a gradient check."),
    "fake_quant": ("warning", "Check the gradients of the float model before prepare_qat (the same module code "
                              "without its observers and fake-quant modules)."),
    "unsteady": ("warning", "Finite differences need the same loss function at every evaluation. A loss that "
                            "updates its own state on each call (DINO's center, an EMA or a counter kept in a "
                            "closure) can be checked when passed as an nn.Module: its buffers are put back before "
                            "each evaluation; else check with that update switched off."),
}


@dataclass(kw_only=True, repr=False)
class GradCheckResult(CheckResult):
    """Per-parameter largest relative difference; ``bad_params`` names the wrong gradients."""

    check = "gradient_check"
    params: list[ParamCheck]
    eps: float
    loss: float
    samples: int
    passed: bool = False
    notes: list[str] = field(default_factory=list)
    # Why no gradient was compared (with ``notes``): a key of _CANNOT_CHECK.
    cannot: str | None = None
    kept_float64: int = 0  # casts to a narrower float inside a forward, kept in float64 (per evaluation)
    # .detach() calls in the forward on tensors computed from parameters: {file, line, code, params}
    detached: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.passed = bool(self.params) and all(p.status == "ok" for p in self.params) and not self.notes

    @property
    def bad_params(self) -> list[str]:
        return [p.name for p in self.params if p.status == "wrong"]

    @property
    def suspicious_params(self) -> list[str]:
        return [p.name for p in self.params if p.status == "suspicious"]

    @property
    def detached_params(self) -> list[str]:
        return [p.name for p in self.params if p.status == "detached"]

    @property
    def max_rel(self) -> float:
        return max((p.max_rel for p in self.params), default=math.nan)

    @property
    def summary(self) -> str:
        if self.notes:
            return "; ".join(self.notes)
        n = len(self.params)
        if self.bad_params:
            return f"wrong gradient in {', '.join(self.bad_params)} (largest relative difference {fmt(self.max_rel)})"
        if self.suspicious_params:
            return f"{len(self.suspicious_params)} of {n} parameters suspicious (largest relative difference {fmt(self.max_rel)})"
        if self.detached_params:
            return (f"{len(self.detached_params)} of {n} parameters differ only through a .detach(): "
                    f"{', '.join(self.detached_params)} agree with finite differences once the detached values are held")
        kept = (f"; {self.kept_float64} cast(s) to a narrower float inside the forward (.float(), .half()) ran in "
                "float64 for the check") if self.kept_float64 else ""
        return f"{n} parameters agree with finite differences (largest relative difference {fmt(self.max_rel)}){kept}"

    def _fields(self) -> dict[str, Any]:
        return {"eps": self.eps, "loss": self.loss, "samples": self.samples, "notes": self.notes, "cannot": self.cannot,
                "kept_float64": self.kept_float64, "detached": self.detached,
                "max_rel": self.max_rel, "bad_params": self.bad_params,
                "suspicious_params": self.suspicious_params, "detached_params": self.detached_params, "params": [p.to_dict() for p in self.params]}

    def _cut_findings(self) -> list[Finding]:
        """One warning per set of .detach() lines for the parameters that differ only through them."""
        groups: dict[tuple, list[ParamCheck]] = {}
        for p in self.params:
            if p.status == "detached":
                _, sites = detach_note(self.detached, p.name)
                groups.setdefault(tuple((s["file"], s["line"]) for s in sites), []).append(p)
        out = []
        for group in groups.values():
            _, sites = detach_note(self.detached, group[0].name)
            at = "; ".join(site_text(s) for s in sites[:3])
            names = [p.name for p in group]
            named = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            what = f"{len(names)} parameters ({named})" if len(names) > 1 else names[0]
            worst = max(p.max_rel for p in group)
            held = max(p.held_rel or 0.0 for p in group)
            out.append(finding(
                "gradient_cut_by_detach", "warning",
                f"Gradient check: {what} differ{'' if len(names) > 1 else 's'} from finite differences by up to "
                f"{fmt(worst)} only through the .detach() at {at}",
                f"Held at the values the forward detached, finite differences agree with autograd (relative "
                f"difference {fmt(held)} at most): the gradient is exact for the graph the code builds, and the "
                f"loss also depends on {'these parameters' if len(names) > 1 else 'this parameter'} through the "
                f"cut at {at}. If the cut is intended (the samples of NeRF's fine pass, a straight-through "
                "estimator, a target network), nothing is wrong; if not, remove the .detach().",
                layers=names, params=[{"name": p.name, "max_rel": p.max_rel, "held_rel": p.held_rel} for p in group],
                eps=self.eps, detached_at=sites))
        return out

    def _detail(self) -> Table:
        t = Table(box=None, padding=(0, 2))
        for col in ("parameter", "entries", "max rel diff", "analytic", "numeric", "status"):
            t.add_column(col)
        style = {"ok": "green", "suspicious": "yellow", "wrong": "red", "detached": "yellow"}
        for p in self.params:
            t.add_row(p.name, str(p.checked), fmt(p.max_rel), fmt(p.analytic, 6), fmt(p.numeric, 6),
                      f"[{style[p.status]}]{p.status}[/]" + (" (no gradient)" if p.no_grad else ""))
        return t

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        if self.notes:
            severity, fix = _CANNOT_CHECK[self.cannot]
            return [finding("gradient_check_failed", severity, "Gradient check: " + "; ".join(self.notes), fix)]
        for p in self.params:
            if p.status == "ok":
                continue
            where = f"{p.name}{p.worst_index}" if p.worst_index else f"{p.name} (along a random direction)"
            if p.status == "detached":
                continue  # one finding per .detach(), below
            if p.status == "wrong":
                why = ("autograd gives no gradient but the loss depends on it"
                       if p.no_grad else f"autograd says {fmt(p.analytic, 6)}, finite differences {fmt(p.numeric, 6)}")
                note, sites = detach_note(self.detached, p.name)
                extra = {"detached_at": sites} if sites else {}
                out.append(finding(
                    "wrong_gradient", "error", f"Gradient check: wrong gradient for {p.name} ({why} at {where})",
                    note + ("Otherwise check" if note else "Check") + " the backward of the code that uses this "
                    "parameter: a custom autograd.Function's backward, a hand-written gradient, or a "
                    ".detach()/in-place op on its path.",
                    layers=[p.name], **p.to_dict(), eps=self.eps, **extra))
            elif p.kink:
                out.append(finding(
                    "suspicious_gradient", "warning",
                    f"Gradient check: {p.name} differs from finite differences by {fmt(p.max_rel)} at a kink (at {where})",
                    "The loss is not differentiable there: its slopes to either side differ (a ReLU at exactly 0, "
                    "as after a zero-initialised batch norm in a residual block, or max-pool ties), so finite "
                    "differences cannot judge autograd's value; check on other samples or after a few training "
                    "steps.",
                    layers=[p.name], **p.to_dict(), eps=self.eps))
            else:
                out.append(finding(
                    "suspicious_gradient", "warning",
                    f"Gradient check: {p.name} differs from finite differences by {fmt(p.max_rel)} (at {where})",
                    "Between 1e-5 and 1e-3: often a kink (ReLU at 0, max-pool ties) or round-off on a tiny "
                    "gradient; re-run with another eps or on other samples before suspecting the backward.",
                    layers=[p.name], **p.to_dict(), eps=self.eps))
        out += self._cut_findings()
        if not out:
            out.append(finding("gradient_check_ok", "info", f"Gradient check: {self.summary}",
                               max_rel=self.max_rel, eps=self.eps))
        return out


def _select(model: nn.Module, params: Any) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (p.is_floating_point() or p.is_complex())]
    if params is None:
        return named
    if isinstance(params, (str, nn.Parameter)) or not isinstance(params, Iterable):
        params = [params]
    by_name = dict(named)
    by_id = {id(p): n for n, p in named}
    chosen: list[tuple[str, nn.Parameter]] = []
    for item in params:
        if isinstance(item, str):
            if item not in by_name:
                raise DoctorInputError(f"no trainable parameter named {item!r}; parameters: {sorted(by_name)}")
            chosen.append((item, by_name[item]))
        elif isinstance(item, torch.Tensor) and id(item) in by_id:
            chosen.append((by_id[id(item)], item))
        else:
            raise DoctorInputError(f"params must hold parameter names or parameters of the model, got {item!r}")
    return chosen


def _sample(numel: int, k: int, gen: torch.Generator) -> list[int]:
    """``k`` distinct flat indices (all of them for a small tensor), without a full permutation."""
    if numel <= k:
        return list(range(numel))
    if numel <= 8 * k:
        return sorted(torch.randperm(numel, generator=gen)[:k].tolist())
    drawn: dict[int, None] = {}  # distinct draws, in the order drawn
    while len(drawn) < k:
        for i in torch.randint(numel, (2 * k,), generator=gen).tolist():
            drawn.setdefault(i, None)
    return sorted(list(drawn)[:k])


def _fake_quant_modules(model: nn.Module) -> int:
    """How many torch.ao.quantization fake-quant modules the model holds (prepare_qat puts them in)."""
    try:
        from torch.ao.quantization import FakeQuantizeBase
    except ImportError:  # a torch without torch.ao.quantization
        return 0
    return sum(isinstance(m, FakeQuantizeBase) for m in model.modules())


def gradient_check(
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    eps: float = 1e-6,
    params: Any = None,
    samples_per_param: int = 0,
    *,
    directions: int = DIRECTIONS,
    max_samples: int | None = MAX_SAMPLES,
    seed: int = 0,
) -> GradCheckResult:
    """Compare autograd with float64 central differences along ``directions`` random directions
    of each parameter (all trainable ones, or ``params``: names or parameters), each covering
    every entry, and on ``samples_per_param`` entries of it on their own; a parameter that
    disagrees is narrowed down to its worst entry.

    ``max_samples`` samples of the batch are used (None: all). ``passed`` is True when every
    relative difference is below 1e-5; ``bad_params`` names the parameters above 1e-3. The model's
    dtypes, values, RNG and modes are restored afterwards.

    >>> result = gradient_check(model, (x, y), nn.CrossEntropyLoss())
    >>> result.passed, result.bad_params
    """
    check_model(model)
    check_loss_fn(loss_fn)
    check_positive("eps", eps)
    check_positive("directions", directions, integer=True)
    if not isinstance(samples_per_param, int) or isinstance(samples_per_param, bool) or samples_per_param < 0:
        raise DoctorInputError(f"samples_per_param must be an integer >= 0, got {samples_per_param!r}")
    inputs, targets = split_batch(batch)
    if max_samples is not None:
        check_positive("max_samples", max_samples, integer=True)
        inputs, targets = take(inputs, max_samples), take(targets, max_samples)
    chosen = _select(model, params)
    if not chosen:
        raise DoctorInputError("the model has no trainable floating-point parameters to check")
    device = model_device(model)
    samples = batch_size(inputs) or 0
    fake = _fake_quant_modules(model)
    if fake:
        return GradCheckResult(params=[], eps=eps, loss=math.nan, samples=samples, cannot="fake_quant", notes=[
            f"the model fake-quantizes ({fake} fake-quant module(s), quantization-aware training): rounding is a "
            "step function whose straight-through gradient differs from finite differences by design"])

    def to64(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float64) if t.is_floating_point() else t.to(device)

    inputs, targets = map_tensors(inputs, to64), map_tensors(targets, to64)
    loss_module = _loss_modules(loss_fn, model)
    default_dtype = torch.get_default_dtype()
    with preserved(model), preserved(loss_module):
        try:
            torch.set_default_dtype(torch.float64)
            tables = _to_float64(model)
            _to_float64(loss_module)

            keep = _KeepFloat64()
            # One forward first, as training's first step: a model whose first forward writes its
            # parameters (gpytorch's variational strategy initialises the variational mean while
            # its buffer variational_params_initialized is 0) is checked as training sees it after,
            # not re-initialised over each perturbation (finite differences 0). `preserved` puts
            # the parameters and buffers back afterwards.
            _seed(seed, device)
            with torch.no_grad(), keep:  # casts kept here too: nanochat's x.to(float32) meets float64 weights
                try:
                    loss_fn(model(inputs), targets)
                except Exception:
                    if not tables:
                        raise
                    # A forward that insists on its constant tables' dtype (nanochat asserts its
                    # rotary cos/sin are float32): they go back to theirs, and the float64
                    # activations that meet them stay float64 (type promotion).
                    for m, k, b in tables:
                        m._buffers[k] = b
                    _seed(seed, device)
                    loss_fn(model(inputs), targets)
            # A forward that updates buffers in place (vector-quantize-pytorch's EMA codebook, in
            # every training forward) would give each evaluation another function of the weights;
            # so would a loss that moves its own (DINO's center).
            buffers = Buffers(model, loss_module)

            def loss_at() -> torch.Tensor:
                _seed(seed, device)  # dropout draws the same mask in every evaluation
                buffers.restore()
                if not keep.needed:
                    return as_float(loss_fn(model(inputs), targets))
                keep.casts = 0
                with keep:
                    return as_float(loss_fn(model(inputs), targets))

            for _, p in model.named_parameters():
                p.grad = None
            with torch.enable_grad():
                with DetachWatch(dict(model.named_parameters())) as watch:
                    loss = loss_at()
                if not loss.requires_grad:
                    raise DoctorInputError("the loss does not depend on any trainable parameter (no gradient path)")
                loss.backward()
            base = float(loss.detach())
            kept = keep.casts
            keep.needed = kept > 0  # a forward without casts runs without the mode (each op through Python)
            if not math.isfinite(base):
                return GradCheckResult(params=[], eps=eps, loss=base, samples=samples, cannot="loss",
                                       notes=[f"the loss is {fmt(base)} on this batch"])
            with torch.no_grad():
                again = float(loss_at())
            if abs(again - base) > 1e-10 * max(1.0, abs(base)):
                # State out of reach (a buffer of a module behind a function, a counter, an unseeded
                # draw) changed the loss: finite differences would measure that, not the gradient.
                return GradCheckResult(params=[], eps=eps, loss=base, samples=samples, cannot="unsteady", notes=[
                    f"the loss changes between evaluations at the same weights ({fmt(base, 6)}, then "
                    f"{fmt(again, 6)}): something it reads moves on every call"])
            analytic = {n: (None if p.grad is None else p.grad.detach().to_dense().clone()) for n, p in chosen}
            # the finest slope the widest retried step resolves on this loss: a difference within it is round-off
            tolerance = resolution(base, eps * max(RETRY_FACTORS))
            gen = torch.Generator().manual_seed(seed)
            results = []
            with torch.no_grad():
                for name, p in chosen:
                    entries = _sample(p.numel(), samples_per_param, gen) if samples_per_param else []
                    results.append(_check_param(name, p, analytic[name], entries, loss_at, eps, directions, gen,
                                                tolerance))
                _hold_detached(results, dict(chosen), analytic, watch, loss_at, base, eps, directions, gen,
                               tolerance)
        finally:
            torch.set_default_dtype(default_dtype)
    return GradCheckResult(params=results, eps=eps, loss=base, samples=samples, kept_float64=kept,
                           detached=watch.sites)


def _hold_detached(results: list[ParamCheck], params: dict[str, nn.Parameter], analytic: dict, watch: DetachWatch,
                   loss_at: Any, base: float, eps: float, directions: int, gen: torch.Generator,
                   tolerance: float) -> None:
    """A wrong gradient of a parameter that reaches the loss through a ``.detach()`` as well, checked
    again with the forward's detached values held at the first forward's: agreement then makes it
    "detached" (exact for the graph the code builds). A gradient that is zero everywhere stays
    wrong: every path of the parameter is cut, and it never learns (held, its slope is nil)."""
    cut = {n for s in watch.sites for n in s["params"]}
    todo = [r for r in results if r.status == "wrong" and r.name in cut and analytic[r.name] is not None
            and bool(analytic[r.name].ne(0).any())]
    if not todo:
        return
    holders: list[HeldDetaches] = []

    def held_loss_at() -> torch.Tensor:
        with HeldDetaches(watch.outputs) as held:
            holders.append(held)
            return loss_at()

    if abs(float(held_loss_at()) - base) > 1e-10 * max(1.0, abs(base)) or holders[-1].failed:
        return  # the detaches do not replay (another count or shape): nothing to hold
    for r in todo:
        holders.clear()
        again = _check_param(r.name, params[r.name], analytic[r.name], [], held_loss_at, eps, directions, gen,
                             tolerance)
        learns = abs(again.numeric) > max(tolerance, 1e-6 * abs(r.numeric))  # through a path not cut
        if not any(h.failed for h in holders) and again.status == "ok" and learns:
            r.status, r.held_rel = "detached", again.max_rel


_NARROW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _KeepFloat64(TorchDispatchMode):
    """While the model runs in float64 for the check: a float64 tensor cast to a narrower float
    (``x.float()``, ``x.to(torch.float32)``) stays float64, so that no part of the forward runs
    at the precision the finite differences would then measure. ``casts`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0
        self.needed = True  # until the first forward shows whether the model casts at all

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in _NARROW_FLOATS
                and args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64):
            self.casts += 1
            kwargs = {**kwargs, "dtype": torch.float64}
        elif kwargs.get("dtype") == torch.complex64:
            # a complex tensor made or cast at single precision (FNO's out_ft: zeros(dtype=torch.cfloat))
            self.casts += 1
            kwargs = {**kwargs, "dtype": torch.complex128}
        return func(*args, **kwargs)


def _seed(seed: int, device: torch.device) -> None:
    """Seed only the generators the model draws from: ``torch.manual_seed`` would also queue a
    seed for every CUDA device, applied when CUDA starts later, outside the restored state."""
    torch.default_generator.manual_seed(seed)
    seed_host_generators(seed)  # teacher forcing drawn with random.random() takes the same path each time
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _loss_modules(loss_fn: Any, model: nn.Module) -> nn.Module:
    """The modules the loss runs besides the model, as one module: ``loss_fn`` itself, the object
    of a bound method, a ``functools.partial``'s function and arguments, and the modules a
    function holds in its closure or reads as globals (DETR's ``criterion``, DINO's loss behind a
    function that passes the epoch). They run in float64 with the model and their buffers are put
    back before each evaluation."""
    found: list[nn.Module] = []
    todo, seen = [loss_fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, nn.Module):
            if f is not model and not any(f is m for m in model.modules()):
                found.append(f)
            continue
        if isinstance(f, functools.partial):
            todo += [f.func, *f.args, *f.keywords.values()]
        elif inspect.ismethod(f):
            todo += [f.__self__, f.__func__]
        elif inspect.isfunction(f):
            for cell in f.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # a cell not assigned yet
                    pass
            todo += [f.__globals__[n] for n in f.__code__.co_names if isinstance(f.__globals__.get(n), nn.Module)]
    return nn.ModuleList(found)


def _to_float64(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Convert floating parameters (in place, keeping the objects) and buffers to float64, complex
    ones to complex128. Returns the non-persistent buffers converted, as (module, name, the buffer
    as it was): constant tables a forward may insist on in their own dtype."""
    for p in nn.Module.parameters(module):  # all of them: MAML-Pytorch's Learner.parameters() lists its vars only
        if p.is_floating_point() or p.is_complex():
            p.data = p.data.to(torch.complex128 if p.is_complex() else torch.float64)
    tables = []
    for m in module.modules():
        for k, b in m._buffers.items():
            if b is not None and (b.is_floating_point() or b.is_complex()):
                m._buffers[k] = b.to(torch.complex128 if b.is_complex() else torch.float64)
                if k in m._non_persistent_buffers_set:
                    tables.append((m, k, b))
    return tables


def _check_param(name: str, p: nn.Parameter, grad: torch.Tensor | None, indices: list[int], loss_at: Any,
                 eps: float, directions: int, gen: torch.Generator, tolerance: float = 0.0) -> ParamCheck:
    values = p.data
    if values.is_complex():  # real and imaginary parts as two real entries (the gradient is dL/dRe + i dL/dIm)
        values = torch.view_as_real(values)
        grad = None if grad is None else torch.view_as_real(grad.resolve_conj())
    g = None if grad is None else grad.reshape(values.shape)
    worst = (-1.0, 0.0, 0.0, False, None)  # rel, analytic, numeric, kink, direction
    for _ in range(directions):
        z = torch.randn(values.shape, generator=gen, dtype=torch.float64).to(values.device, values.dtype)
        rel, a, n, kink = _best(lambda e, z=z: _directional(values, z, g, loss_at, e, tolerance=tolerance), eps)
        if rel > worst[0]:
            worst = (rel, a, n, kink, z)
    rel, a, n, kink, z = worst
    index: tuple[int, ...] = (0,) * values.dim() if values.numel() == 1 else ()
    if band(rel) != "ok" and values.is_contiguous() and values.numel() > 1:
        flat = _narrow(values, z, g, loss_at, eps)
        indices = [flat, *[i for i in indices if i != flat]]
    entry = None  # (rel, index, analytic, numeric, kink) of the worst entry checked on its own
    for flat in indices:
        idx = _unravel(flat, values.shape)
        e_a = 0.0 if g is None else float(g[idx])
        e_rel, e_n, e_kink = _best(lambda e, idx=idx, e_a=e_a: _rel_at(values, idx, e_a, loss_at, e, tolerance), eps)
        if entry is None or e_rel > entry[0]:
            entry = (e_rel, idx, e_a, e_n, e_kink)
    if entry is not None and entry[0] >= rel:
        rel, index, a, n, kink = entry
    elif entry is not None:
        index = entry[1]
    status = band(rel)
    if status == "wrong" and kink and grad is not None:
        status = "suspicious"
    return ParamCheck(name=name, shape=list(values.shape), checked=values.numel(), max_rel=rel, status=status,
                      worst_index=list(index), analytic=a, numeric=n, no_grad=grad is None, directions=directions,
                      kink=kink and status == "suspicious")


def _best(measure: Any, eps: float) -> tuple:
    """``measure(eps)`` -> (rel, ...); measured again with larger steps when it is
    near the pass band or beyond, keeping the best: round-off shrinks with a larger step, a wrong
    gradient does not."""
    rel, *rest = measure(eps)
    if rel >= RETRY_ABOVE:
        for factor in RETRY_FACTORS:
            rel2, *rest2 = measure(eps * factor)
            if rel2 < rel:
                rel, rest = rel2, rest2
    return (rel, *rest)


def _directional(values: torch.Tensor, z: torch.Tensor, g: torch.Tensor | None, loss_at: Any,
                 eps: float, kinks: bool = True, tolerance: float = 0.0) -> tuple[float, float, float, bool]:
    """(rel, analytic, numeric, kink) of the derivative along ``z`` (``kinks``: look for one;
    ``tolerance``: the loss's round-off, see :func:`relative`)."""
    a = 0.0 if g is None else float((g * z).sum())
    orig = values.clone()
    values.add_(z, alpha=eps)
    plus = float(loss_at())
    values.copy_(orig).sub_(z, alpha=eps)
    minus = float(loss_at())
    values.copy_(orig)
    n = (plus - minus) / (2 * eps)
    rel = relative(a, n, tolerance)
    return rel, a, n, kinks and rel > BUG_BAND and _kink(plus, minus, loss_at, eps)


def _kink(plus: float, minus: float, loss_at: Any, eps: float) -> bool:
    """Whether the loss has a kink at the current values along the step just measured: its one-sided
    slopes differ beyond the bug band (a smooth loss's differ by eps times its curvature), so the
    central difference is no derivative to compare autograd's (a subgradient there) with."""
    base = float(loss_at())
    return relative((base - minus) / eps, (plus - base) / eps) > BUG_BAND


def _narrow(values: torch.Tensor, z: torch.Tensor, g: torch.Tensor | None, loss_at: Any, eps: float) -> int:
    """The flat index of the entry with the largest share of the discrepancy along ``z``: the
    discrepancy of a range is the sum of its halves' (it is linear in ``z``), so one half's
    measurement gives both; the larger one is kept until one entry is left."""
    zf = z.reshape(-1)

    def error(lo: int, hi: int) -> float:
        part = torch.zeros_like(zf)
        part[lo:hi] = zf[lo:hi]
        _, a, n, _ = _directional(values, part.view(values.shape), g, loss_at, eps, kinks=False)
        return a - n

    lo, hi = 0, zf.numel()
    total = error(lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        left = error(lo, mid)
        right = total - left
        if abs(left) >= abs(right):
            hi, total = mid, left
        else:
            lo, total = mid, right
    return lo


def _rel_at(values: torch.Tensor, idx: tuple[int, ...], a: float, loss_at: Any,
            eps: float, tolerance: float = 0.0) -> tuple[float, float, bool]:
    orig = float(values[idx])
    values[idx] = orig + eps
    plus = float(loss_at())
    values[idx] = orig - eps
    minus = float(loss_at())
    values[idx] = orig
    n = (plus - minus) / (2 * eps)
    rel = relative(a, n, tolerance)
    return rel, n, rel > BUG_BAND and _kink(plus, minus, loss_at, eps)


def _unravel(flat: int, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(tuple(shape)):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))
