"""See what an unmodified training loop does around its gradients, by wrapping three torch functions.

- ``torch.autograd.backward`` (``Tensor.backward`` calls it through the module attribute, so one
  wrapper sees both spellings): the scalar ``backward()`` is called on (unscaled when it came
  from ``GradScaler.scale``, see :mod:`._amp_tap`), before the pass (``"backward"``), and the end
  of the pass (``"after_backward"``). Only outermost calls are announced: gradient
  checkpointing runs nested ``backward`` calls inside the outer pass; opacus' ghost clipping's
  second, re-weighted pass is announced to ``"root"`` only (see ``_reweighted_pass``). ``"loss_graph"`` gets the
  scalar loss itself, graph attached, before the pass frees what it saved (the loss-graph watch
  and the live gradient check read it; a listener must not keep it).
- ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_`` and ``clip_grads_with_norm_`` (the
  second call of ``get_total_norm`` + ``clip_grads_with_norm_``, as accelerate clips): ``"clip"``,
  with the parameters, before they are clipped. Frameworks clip right before the update and log
  the norm before clipping, so the gradients are complete and not yet changed here. Code that imported the
  function by name before the monitor started is not seen; the optimizer hook still is.

The recorder listens to ``"root"``: backward's own first argument, before an outermost pass —
the tensor backward() runs from is the loss, a sink for harmful values. Its listeners are not
guarded: check_numerics stops the program there, before the pass.

The wrappers are installed while at least one listener listens and the originals are restored
when the last one leaves. They keep nothing but a detached view of the 0-d loss (no graph, no
host sync), and a listener's failure never reaches the training loop.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.utils._python_dispatch import _disable_current_modes

from trainguard.capture import _amp_tap

log = logging.getLogger("trainguard.monitor")

_lock = threading.Lock()
_EVENTS = ("root", "backward", "after_backward", "clip", "loss_graph")
_listeners: dict[str, list[Callable]] = {e: [] for e in _EVENTS}
_originals: dict[str, Callable] = {}
# Guards watching (see pass_nonfinite_norms): while any does, a non-finite norm is not clip_grad_norm_'s error.
_passing = 0
# True while an announced backward pass runs: checkpointed segments call backward inside it, on
# the autograd engine's threads for accelerators, so this is not thread-local.
_in_backward = False


def _announce(event: str, *args) -> None:
    for fn in list(_listeners[event]):
        try:
            fn(*args)
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: %s listener failed", event)


def _on_meta(tensors) -> bool:
    first = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
    return isinstance(first, torch.Tensor) and first.is_meta


def _backward(tensors, grad_tensors=None, *args, **kwargs):
    global _in_backward
    if _in_backward or _on_meta(tensors):  # meta: shapes without values (flop counting), no training
        return _originals["backward"](tensors, grad_tensors, *args, **kwargs)
    for fn in list(_listeners["root"]):
        fn(tensors)
    if _reweighted_pass(tensors):
        # Not the loss and not the step's gradients as backward() leaves them: seen by the
        # recorder (a root) only.
        _in_backward = True
        try:
            return _originals["backward"](tensors, grad_tensors, *args, **kwargs)
        finally:
            _in_backward = False
    loss = None
    weight = _scalar_gradient(tensors, grad_tensors)
    if isinstance(tensors, torch.Tensor) and (grad_tensors is None or weight is not None) and tensors.numel() == 1:
        if tensors.is_floating_point():
            with quiet():
                loss = _amp_tap.unscaled(tensors)
                loss = (tensors if loss is None else loss).detach().reshape(())
                if weight is not None:  # backward(c) minimises c * tensors: WGAN's D_real.backward(mone)
                    loss = loss * weight
    _announce("backward", loss)
    if loss is not None and tensors.grad_fn is not None:
        _announce("loss_graph", tensors)
    _in_backward = True
    try:
        out = _originals["backward"](tensors, grad_tensors, *args, **kwargs)
    finally:
        _in_backward = False
    _announce("after_backward")
    return out


def _scalar_gradient(tensors, grad_tensors) -> torch.Tensor | None:
    """The 0-d weight ``c`` of ``tensors.backward(c)`` when both are one-element floating tensors on
    one device (the objective whose gradient it takes is ``c * tensors``), else None."""
    g = grad_tensors[0] if isinstance(grad_tensors, (tuple, list)) and len(grad_tensors) == 1 else grad_tensors
    if not (isinstance(tensors, torch.Tensor) and isinstance(g, torch.Tensor)) or g.numel() != 1:
        return None
    if not g.is_floating_point() or g.device != tensors.device:
        return None
    return g.detach().reshape(())


def _reweighted_pass(tensors) -> bool:
    """Whether this ``backward`` is the second pass of opacus' ghost clipping: the
    ``backward()`` of its loss (a ``DPTensorFastGradientClipping``, ``grad_sample_mode="ghost"``)
    runs the loss itself (``reduced_loss``, what the loss's ``item()`` reads), zeroes the
    gradients, then ``second_loss``, the per-sample losses weighted by their clipping
    coefficients, to get the clipped gradients: that sum is no loss, and the step does not begin
    again. Read off the calling frames (Tensor.backward, then opacus' backward)."""
    f = sys._getframe(1)
    for _ in range(3):
        f = f.f_back
        if f is None:
            return False
        # the code's names first: f_locals builds a dict, and Tensor.backward is on every stack
        if f.f_code.co_name == "backward" and "second_loss" in f.f_code.co_varnames:
            if type(f.f_locals.get("self")).__name__ == "DPTensorFastGradientClipping":
                return f.f_locals.get("second_loss") is tensors
    return False


def accumulation_divisor() -> int:
    """k when the ``backward()`` being announced runs inside accelerate's ``Accelerator.backward``,
    which divides every micro-batch's loss by its ``gradient_accumulation_steps`` k (also in the
    last step of an epoch, which syncs on fewer micro-batches); 1 otherwise. Read off the calling
    frames, only when accelerate is already imported (trainguard never imports it)."""
    if "accelerate" not in sys.modules:
        return 1
    f = sys._getframe(1)
    for _ in range(8):  # the listener, _announce, _backward, Tensor.backward, Accelerator.backward
        f = f.f_back
        if f is None:
            break
        if f.f_code.co_name != "backward" or "self" not in f.f_code.co_varnames:
            continue
        obj = f.f_locals.get("self")
        if type(obj).__module__.startswith("accelerate."):
            k = getattr(obj, "gradient_accumulation_steps", 1)
            kind = getattr(obj, "distributed_type", None)
            # DeepSpeed scales by k in its own engine, not in the loss backward() is called on
            if isinstance(k, int) and k > 1 and getattr(kind, "value", kind) != "DEEPSPEED":
                return k
            return 1
    return 1


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clipping_record(function: str, threshold: object, first_step: int) -> dict:
    """A run's ``clipping`` record: the function and its threshold as a number (a tensor's on the
    CPU only: reading an accelerator's would sync), from ``first_step`` on."""
    value = threshold
    if isinstance(threshold, torch.Tensor) and threshold.device.type == "cpu":
        with quiet():  # not the program's read of a tensor
            value = threshold.item()
    value = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return {"function": function, "value": value, "first_step": first_step}


def _setting(function: str, name: str, args: tuple, kwargs: dict) -> tuple[str, object]:
    """The clipping function called and its threshold (``max_norm`` or ``clip_value``), as given."""
    return function, (args[0] if args else kwargs.get(name))


def _clip_norm(parameters, *args, **kwargs):
    params = _as_list(parameters)  # a generator can be read once: the original gets the list
    _announce("clip", params, _setting("clip_grad_norm_", "max_norm", args, kwargs))
    if _passing:  # the guard reads the norm and rewinds: the error would end the script first
        if len(args) > 2:
            args = (*args[:2], False, *args[3:])
        else:
            kwargs["error_if_nonfinite"] = False
    return _originals["clip_grad_norm_"](params, *args, **kwargs)


def _clip_value(parameters, *args, **kwargs):
    params = _as_list(parameters)
    _announce("clip", params, _setting("clip_grad_value_", "clip_value", args, kwargs))
    return _originals["clip_grad_value_"](params, *args, **kwargs)


def _clip_with_norm(parameters, *args, **kwargs):
    params = _as_list(parameters)
    _announce("clip", params, _setting("clip_grads_with_norm_", "max_norm", args, kwargs))
    return _originals["clip_grads_with_norm_"](params, *args, **kwargs)


_WRAPPERS = {"clip_grad_norm_": _clip_norm, "clip_grad_value_": _clip_value,
             "clip_grads_with_norm_": _clip_with_norm}
# torch.nn.utils.clip_grad has clip_grads_with_norm_ only as a private name, which clip_grad_norm_
# calls: it stays unwrapped, so one clip_grad_norm_ is announced once.
_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)


def quiet():
    """Keep ``trainguard.record`` (either backend) from recording the monitor's own tensor ops."""
    from trainguard.capture._native._backend import paused

    if torch._C._len_torch_dispatch_stack() > 0:
        # The dispatch modes are taken off the stack (the Python recorder's among them), not the
        # Python dispatch key: torch._C._DisableTorchDispatch would also turn off the
        # __torch_dispatch__ of tensor subclasses, and an op on FSDP2's DTensor gradients (the
        # guard's _foreach_norm) would run its kernel on the storage-less wrapper: SIGSEGV.
        stack = contextlib.ExitStack()
        stack.enter_context(_disable_current_modes())
        stack.enter_context(paused())
        return stack
    return paused()


def _install() -> None:
    from trainguard.capture._compile import keep_dynamo_out

    # Dynamo must not trace trainguard's wrappers as frames of a compiled training step.
    keep_dynamo_out(_backward, *_WRAPPERS.values())
    _originals["backward"] = torch.autograd.backward
    torch.autograd.backward = _backward
    for name, wrapper in _WRAPPERS.items():
        if not hasattr(torch.nn.utils, name):  # clip_grads_with_norm_ is torch >= 2.6
            continue
        _originals[name] = getattr(torch.nn.utils, name)
        for mod in _MODULES:
            if hasattr(mod, name):
                setattr(mod, name, wrapper)


def _uninstall() -> None:
    if torch.autograd.backward is _backward:
        torch.autograd.backward = _originals["backward"]
    for name, wrapper in _WRAPPERS.items():
        for mod in _MODULES:
            if getattr(mod, name, None) is wrapper:
                setattr(mod, name, _originals[name])
    _originals.clear()


def pass_nonfinite_norms(on: bool) -> None:
    """A guard starts (``on``) or stops watching. While one watches, ``clip_grad_norm_(...,
    error_if_nonfinite=True)`` (Fabric's ``clip_gradients`` default) clips a NaN/Inf norm
    instead of raising: the guard sees the non-finite gradients before the update and rewinds,
    replays and skips that step, which the error would have ended the script before."""
    global _passing
    with _lock:
        _passing += 1 if on else -1


def add_listener(event: str, fn: Callable) -> None:
    """``"root"``: ``fn(tensors)`` with backward's first argument (a tensor or a sequence of
    them) before an outermost backward, unguarded; ``"backward"``: ``fn(loss_or_None)`` before
    it (``loss`` a detached 0-d tensor, unscaled); ``"after_backward"``: ``fn()`` when it returned; ``"clip"``: ``fn(params, (function, threshold))``
    before gradients are clipped (the threshold as given: ``max_norm`` or ``clip_value``); ``"loss_graph"``: ``fn(loss)`` before that backward, with the
    floating 0-d loss itself (as given to ``backward``, scaled under AMP), graph attached."""
    if event not in _listeners:
        raise ValueError(f"event must be one of {_EVENTS}, got {event!r}")
    with _lock:
        if not any(_listeners.values()):
            _install()
        _listeners[event].append(fn)


def remove_listener(event: str, fn: Callable) -> None:
    with _lock:
        if fn in _listeners.get(event, ()):
            _listeners[event].remove(fn)
        if not any(_listeners.values()) and _originals:
            _uninstall()
