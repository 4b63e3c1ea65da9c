"""Ops that raise on a NaN/Inf instead of passing it on, made to pass it on inside a guarded step.

``nn.BCELoss`` raises ``all elements of input should be between 0 and 1`` on a NaN probability
(eriklindernoren/PyTorch-GAN's dcgan.py: Sigmoid, then BCELoss), ``torch.multinomial`` raises
``probability tensor contains either inf, nan or element < 0``, ``torch.distributions`` with
argument validation raises ``Expected parameter ... found invalid values``, and
``torch.linalg.cholesky`` raises ``not positive-definite``. The error ends the loop body before
the sentry sees a loss, so the guard could not rewind. While a guarded step runs, such an error
on inputs that hold NaN/Inf gives NaN instead (an index 0 for ``multinomial``; the distribution
is built unvalidated), and the step is marked bad (:meth:`Raised.take`): the guard rewinds,
replays it under recording (the origin names the op that made the NaN) and applies its policy.
On finite inputs the error is a bug in the code and is raised unchanged.

An index out of range is a bad step too: ``F.cross_entropy``/``F.nll_loss`` with a target past the
classes (``Target 4 is out of bounds.``), ``F.embedding`` with a token id past its rows,
``F.one_hot`` past ``num_classes``, ``gather``/``index_select`` past the dimension. When one of them
raises and its index does hold values out of range, the op runs again on the index clamped into
range, its result times NaN is returned, and the note holds the bad values, their rows and the
index itself (the guard finds it in the batch: ``_replay.index_in_batch``). One bad label in a
million is the data's, not the code's; the guard skips its batch, and stops when the next batch
raises the same way (a head with fewer classes than the data). Nothing is read on a healthy step.

Only the eager entry points are wrapped (``torch.nn.functional.binary_cross_entropy``,
``torch.multinomial``, ``Tensor.multinomial``, ``torch.linalg.cholesky``,
``Distribution.__init__``, and for indices ``F.cross_entropy``, ``F.nll_loss``, ``F.embedding``,
``F.one_hot``, ``torch.gather``, ``torch.index_select`` and their ``Tensor`` methods), while at least
one guard watches a loop. On CUDA, BCELoss and
multinomial check on the device (a device-side assert ends the process): nothing to catch there;
so do the index checks of every op above.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import torch

from trainguard.capture import unrecorded

_MISSING = object()
_lock = threading.Lock()
_users = 0
_saved: list[tuple[Any, str, Any, Any]] = []
_state = threading.local()  # .step: the Raised of the guarded step running on this thread, or None


class Raised:
    """What a guarded step's ops raised on NaN/Inf or on an index out of range (the first), as the
    guard's event keeps it; apart from that, the first that raised under ``torch.no_grad()`` (an
    evaluation inside the loop body: it changes no parameter, so it is no bad step)."""

    def __init__(self) -> None:
        self.first: dict | None = None
        self.no_grad: dict | None = None

    def note(self, op: str, error: BaseException, index: dict | None = None, *, carries_nan: bool = True) -> None:
        """``carries_nan``: the result given in place of the error holds NaN, so a use of it in
        training shows in the loss; an integer result (``one_hot``, a ``multinomial`` draw of 0,
        an index clamped into range) does not, and is a bad step under ``no_grad`` too."""
        no_grad = carries_nan and not torch.is_grad_enabled()
        if (self.no_grad if no_grad else self.first) is not None:
            return
        note = {"op": op, "error": f"{type(error).__name__}: {error}".splitlines()[0][:300].rstrip(":")}
        frame = _user_frame()
        if index is not None or no_grad:
            if index is not None:
                note["index"] = index
            if frame is not None:
                note.update(file=frame.f_code.co_filename, line=frame.f_lineno)
        if no_grad:
            try:
                loader = _loader_batch(frame, index) if frame is not None else None
            except Exception:  # noqa: BLE001 - a guess at where the eval's data came from; the note goes on without
                loader = None
            if loader is not None:
                note["loader"] = loader
            self.no_grad = note
        else:
            self.first = note

    def note_body(self, error: BaseException) -> None:
        """The loop body raised ``error`` on the step's NaN/Inf (``Guard.guarded``): the step is bad,
        the error named with the innermost line of the user's code it came from."""
        if self.first is not None:
            return
        from trainguard.guard._replay import short_path
        from trainguard.store import is_user_file

        where, tb = "", error.__traceback__
        while tb is not None:
            if is_user_file(tb.tb_frame.f_code.co_filename):
                where = f" at {short_path(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
            tb = tb.tb_next
        text = f"{type(error).__name__}{where}" + (f": {error}" if str(error) else "")
        self.first = {"op": "the loop body", "error": text.splitlines()[0][:300].rstrip(":")}

    def take(self) -> dict | None:
        first, self.first = self.first, None
        return first

    def take_no_grad(self) -> dict | None:
        first, self.no_grad = self.no_grad, None
        return first


def begin(raised: Raised) -> None:
    _state.step = raised


def end() -> None:
    _state.step = None


def _nonfinite(*values: Any) -> bool:
    with torch.no_grad(), unrecorded():
        for v in values:
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.numel():
                if not bool(torch.isfinite(v).all()):
                    return True
    return False


def _user_frame() -> Any:
    """The user's frame that called the op (the innermost outside torch and trainguard)."""
    from trainguard.store import is_user_file

    f = sys._getframe(2)
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            return f
        f = f.f_back
    return None


_LOADER_FRAMES = 4  # user frames searched for the loader an evaluation iterates (its function, its caller, ...)


def _loader_batch(frame: Any, index: dict | None) -> dict | None:
    """The ``DataLoader`` a local of the user's frame (or of its callers) names that is being iterated
    there: ``{"name", "batch", "samples"}``, the batch being the one its iterator handed out last, and
    the samples those of the index's bad rows, when the index is (a view or a copy of) a tensor local of
    that frame (``target``) and the loader draws in order. Cold: an op under ``no_grad`` raised."""
    import gc

    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from trainguard.guard._replay import index_in_batch

    for _ in range(_LOADER_FRAMES):
        if frame is None:
            return None
        for name, loader in list(frame.f_locals.items()):
            if not isinstance(loader, DataLoader):
                continue
            its = [r for r in gc.get_referrers(loader._index_sampler)
                   if isinstance(r, _BaseDataLoaderIter) and r._num_yielded > 0]
            if len(its) != 1:
                continue
            found = {"name": name, "batch": its[0]._num_yielded - 1, "samples": []}
            if index is None:
                return found
            bs, samples = loader.batch_sampler, None
            if isinstance(bs, BatchSampler) and type(bs.sampler) is SequentialSampler:
                first = found["batch"] * bs.batch_size
                samples = list(range(first, min(first + bs.batch_size, len(bs.sampler))))
            tensors = {k: v for k, v in frame.f_locals.items() if isinstance(v, torch.Tensor)}
            at = index_in_batch(tensors, index, samples)
            if at is None:  # the index is none of this loop's batch tensors: another loader's, further out
                continue
            index["in_batch"] = at
            found["samples"] = at["samples"]
            return found
        frame = frame.f_back
    return None


def _out_of_range(index: Any, high: int, ignore: int | None = None) -> dict | None:
    """The entries of an integer tensor ``index`` outside ``[0, high)`` (``ignore`` excepted):
    ``{"values", "distinct", "count", "range", "shape", "rows"}`` (the first 8 distinct values) (``rows``: along its first dimension), with the
    tensor and its mask under ``tensor`` and ``mask`` for the guard to find them in the batch; None
    when every entry is in range (the error was something else). Cold: the op raised already."""
    if (not isinstance(index, torch.Tensor) or index.is_floating_point() or index.is_complex()
            or index.dtype == torch.bool or index.device.type not in ("cpu",) or not index.numel()):
        return None
    with torch.no_grad(), unrecorded():
        i = index.detach()
        mask = (i < 0) | (i >= high)
        if ignore is not None:
            mask &= i != ignore
        if not bool(mask.any()):
            return None
        values = i[mask].unique()
        rows = mask.reshape(mask.shape[0], -1).any(1).nonzero().flatten() if mask.dim() else None
        return {"values": [int(v) for v in values[:8]], "distinct": int(values.numel()), "count": int(mask.sum()),
                "range": [0, int(high)],
                "shape": list(i.shape), "rows": rows[:_MAX_ROWS].tolist() if rows is not None else [],
                "tensor": i, "mask": mask}


_MAX_ROWS = 256  # rows of an index kept in an event (every row of a batch can be bad)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _with_arg(args: tuple, kwargs: dict, i: int, name: str, value: Any) -> tuple[tuple, dict]:
    if len(args) > i:
        return (*args[:i], value, *args[i + 1:]), kwargs
    return args, {**kwargs, name: value}


def _class_index(args: tuple, kwargs: dict) -> tuple[Any, int, int | None, int, str] | None:
    """cross_entropy's and nll_loss's class target: (target, classes, ignore_index, position, name)."""
    x, t = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    return t, int(x.shape[1] if x.dim() >= 2 else x.shape[0]), _arg(args, kwargs, 4, "ignore_index", -100), 1, "target"


def _embedding_index(args: tuple, kwargs: dict):
    w = _arg(args, kwargs, 1, "weight")
    return (_arg(args, kwargs, 0, "input"), int(w.shape[0]), None, 0, "input") if isinstance(w, torch.Tensor) else None


def _one_hot_index(args: tuple, kwargs: dict):
    t, n = _arg(args, kwargs, 0, "tensor"), _arg(args, kwargs, 1, "num_classes", -1)
    if not isinstance(t, torch.Tensor) or not t.numel():
        return None
    return t, int(n) if n >= 0 else int(t.max()) + 1, None, 0, "tensor"


def _dim_index(args: tuple, kwargs: dict):
    """gather's and index_select's (input, dim, index): the index into ``input``'s dimension ``dim``."""
    x, dim = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "dim")
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() == 0 or kwargs.get("out") is not None:
        return None
    return _arg(args, kwargs, 2, "index"), int(x.shape[dim]), None, 2, "index"


def _index_guarded(op: str, matches: tuple[str, ...], where, nan: bool = True):
    """Wrap ``fn``: inside a guarded step, an error whose message holds one of ``matches`` on an
    index out of range (``where(args, kwargs)``: the index, its bound, the value ignored, its
    position and name) is noted for the guard with the bad entries, and ``fn`` runs again on the
    index clamped into range; its result times NaN (``nan``, a floating result: in the graph, so
    backward() runs and gives NaN gradients) is returned. Nothing is checked unless ``fn`` raised."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (IndexError, RuntimeError) as error:
                raised = getattr(_state, "step", None)
                if raised is None or not any(m in str(error) for m in matches):
                    raise
                found = where(args, kwargs)
                bad = _out_of_range(found[0], found[1], found[2]) if found is not None and found[1] > 0 else None
                if bad is None:
                    raise
                index, high, _, i, name = found
                bad["argument"] = {"input": "index", "tensor": "class"}.get(name, name)  # embedding's, one_hot's
                a, k = _with_arg(args, kwargs, i, name, index.clamp(0, high - 1))
                with unrecorded():
                    out = fn(*a, **k)
                    carries = nan and out.is_floating_point()
                    out = out * float("nan") if carries else out
                raised.note(op, error, bad, carries_nan=carries)
                return out

        wrapper.__trainguard_wrapped__ = fn
        return wrapper

    return wrap


def _guarded(op: str, matches: tuple[str, ...], substitute, inputs=lambda *a, **k: a, carries_nan: bool = True):
    """Wrap ``fn``: inside a guarded step, an error whose message holds one of ``matches`` on
    inputs with NaN/Inf returns ``substitute(*args, **kwargs)`` and is noted for the guard
    (``carries_nan``: that result holds NaN, see :meth:`Raised.note`)."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (RuntimeError, ValueError) as error:
                raised = getattr(_state, "step", None)
                if (raised is None or not any(m in str(error) for m in matches)
                        or not _nonfinite(*inputs(*args, **kwargs))):
                    raise
                raised.note(op, error, carries_nan=carries_nan)
                return substitute(*args, **kwargs)

        wrapper.__trainguard_wrapped__ = fn
        return wrapper

    return wrap


def _bce_nan(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    out = input * float("nan")  # in the graph: backward() runs and gives NaN gradients
    return out if reduction == "none" else out.sum() if reduction == "sum" else out.mean()


def _multinomial_zeros(input, num_samples, *args, **kwargs):
    return torch.zeros((*input.shape[:-1], num_samples), dtype=torch.long, device=input.device)


def _cholesky_nan(A, *args, **kwargs):
    return A * float("nan")


def _wrap_distribution_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            return init(self, *args, **kwargs)
        except ValueError as error:
            raised = getattr(_state, "step", None)
            if (raised is None or "found invalid values" not in str(error)
                    or not _nonfinite(*vars(self).values())):
                raise
            raised.note(f"{type(self).__name__}(validate_args=True)", error)
            if len(args) >= 3:
                args = (*args[:2], False, *args[3:])
            else:
                kwargs["validate_args"] = False
            return init(self, *args, **kwargs)

    __init__.__trainguard_wrapped__ = init
    return __init__


def _targets() -> list[tuple[Any, str, Any]]:
    dist = torch.distributions.Distribution
    return [
        (torch.nn.functional, "binary_cross_entropy",
         _guarded("aten.binary_cross_entropy", ("between 0 and 1",), _bce_nan)),
        (torch, "multinomial",
         _guarded("aten.multinomial", ("or element < 0",), _multinomial_zeros, carries_nan=False)),
        (torch.Tensor, "multinomial",
         _guarded("aten.multinomial", ("or element < 0",), _multinomial_zeros, carries_nan=False)),
        (torch.linalg, "cholesky", _guarded("aten.linalg_cholesky", ("positive-definite",), _cholesky_nan)),
        (dist, "__init__", _wrap_distribution_init),
        (torch.nn.functional, "cross_entropy",
         _index_guarded("F.cross_entropy", ("out of bounds",), _class_index)),
        (torch.nn.functional, "nll_loss", _index_guarded("F.nll_loss", ("out of bounds",), _class_index)),
        (torch.nn.functional, "embedding", _index_guarded("F.embedding", ("out of range",), _embedding_index)),
        (torch.nn.functional, "one_hot",
         _index_guarded("F.one_hot", ("smaller than num_classes", "non-negative"), _one_hot_index)),
        (torch, "gather", _index_guarded("torch.gather", ("out of bounds",), _dim_index)),
        (torch.Tensor, "gather", _index_guarded("Tensor.gather", ("out of bounds",), _dim_index)),
        (torch, "index_select", _index_guarded("torch.index_select", ("out of range", "out of DATA bounds"), _dim_index)),
        (torch.Tensor, "index_select", _index_guarded("Tensor.index_select", ("out of range", "out of DATA bounds"), _dim_index)),
    ]


def install() -> None:
    """Wrap the ops (once, however many guards watch a loop)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for owner, name, wrap in _targets():
            wrapper = wrap(getattr(owner, name))
            _saved.append((owner, name, owner.__dict__.get(name, _MISSING), wrapper))
            setattr(owner, name, wrapper)


def remove() -> None:
    global _users
    with _lock:
        _users = max(_users - 1, 0)
        if _users:
            return
        while _saved:
            owner, name, original, wrapper = _saved.pop()
            if owner.__dict__.get(name) is not wrapper:
                # wrapped again since (a monitor's loss listener on F.cross_entropy): that wrapper
                # stays, and with it this one, which does nothing outside a guarded step
                continue
            if original is _MISSING:  # Tensor.multinomial: inherited from torch._C.TensorBase
                delattr(owner, name)
            else:
                setattr(owner, name, original)
