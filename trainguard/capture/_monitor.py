"""The training-health monitor: loss, learning rate and gradient norm per step, layer statistics
every ``every`` steps, written to a run directory for the diagnosis rules.

How it stays cheap:

- Per step it keeps two or three 0-d tensors (loss, squared gradient norm) on the device; per
  recording step the layer statistics are reductions on the device. Everything is concatenated and
  copied to the host **once per recording step** (asynchronously on accelerators; see
  ``_monitor_ship``).
- Per-layer forward hooks exist only during recording steps; between them the model runs with no
  hooks but one forward pre-hook on each root module.
- Modules and parameters are held through weak references; activations are reduced inside the
  hook and never kept.

Step numbers come from the shared clock (:mod:`trainguard.capture._steps`), so the monitor and the
recorder agree: step ``s`` is the work before the ``s``-th ``optimizer.step()`` (counting from 0).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.capture import _compile_monitor, _monitor_tap, _steps
from trainguard.capture._compile import keep_dynamo_out
from trainguard.capture._layer_stats import (
    activation_stats,
    first_tensor,
    histogram,
    input_stats,
)
from trainguard.capture._monitor_grads import GradientWatch
from trainguard.capture._monitor_model import Layer, Param, Root, build_root, named_models, structure
from trainguard.capture._monitor_ship import Shipper
from trainguard.store import acquire_writer, release_writer

log = logging.getLogger("trainguard.monitor")

# With a large ``every``, per-step scalars still reach the run (for a live view) after this many
# steps: one more batched, non-blocking copy, never one per step.
MAX_BUFFERED_STEPS = 50


def _validate(every: Any, bins: Any, histograms: Any) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
        raise ValueError(f"bins must be an int >= 2, got {bins!r}")
    if histograms not in (None, True, False) and not (
        isinstance(histograms, (list, tuple, set)) and all(isinstance(h, str) for h in histograms)
    ):
        raise ValueError(f"histograms must be None, True or a list of layer/parameter names, got {histograms!r}")


def _default_logdir() -> Path:
    return Path("runs") / time.strftime("monitor-%Y%m%d-%H%M%S")


class Monitor:
    """Watch training health: per step loss, learning rate and global gradient norm; every
    ``every`` steps, per layer, activation, gradient, weight and update statistics.

    ``model`` is an ``nn.Module``, a list or dict of them (a GAN's two networks), or None: then the
    monitor attaches to every module with parameters that is called at the top level (how
    ``trainguard monitor script.py`` watches an unmodified script). Steps end automatically when
    ``optimizer.step()`` runs; the loss is the scalar ``backward()`` is called on, or what you pass
    to :meth:`step`. In a loop with no ``torch.optim`` optimizer, call ``monitor.step(loss)`` after
    the update: it ends the step.

    ``histograms``: True for every layer and parameter, or a list of layer/parameter names.
    Writes to ``logdir`` (shared with ``trainguard.record`` when both name the same directory);
    by default ``runs/monitor-<date>-<time>``. ``close()`` (or leaving the ``with`` block) ships
    what is pending, diagnoses the run (:func:`trainguard.analysis.diagnose`, with ``thresholds``)
    and stores the findings in it and in ``monitor.findings`` (``diagnose=False`` skips that).

    Example::

        with trainguard.Monitor(model, "runs/exp1", every=10) as mon:
            for x, y in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
        for f in mon.findings:
            print(f.severity, f.title, f.suggestion)
    """

    def __init__(
        self,
        model: nn.Module | Iterable[nn.Module] | dict[str, nn.Module] | None = None,
        logdir: str | os.PathLike | None = None,
        every: int = 10,
        *,
        histograms: bool | list[str] | None = None,
        bins: int = 30,
        capture_loss: bool = True,
        updates: bool = True,
        diagnose: bool | Callable = True,
        thresholds: Any = None,
        overwrite: bool = False,
    ):
        _validate(every, bins, histograms)
        models = named_models(model)  # a bad model fails before anything is installed
        self.every = every
        self.bins = bins
        self.histograms = histograms
        self.capture_loss = capture_loss
        self.updates = updates
        self.diagnose = diagnose
        self.thresholds = thresholds
        self.findings: list | None = None
        self.logdir = Path(logdir) if logdir is not None else _default_logdir()
        self._writer = acquire_writer(self.logdir, overwrite=overwrite)
        self._closed = False

        self._roots: list[Root] = []
        self._params: list[Param] = []
        self._known: weakref.WeakSet = weakref.WeakSet()  # modules inside attached roots
        self._no_params: weakref.WeakSet = weakref.WeakSet()  # top-level modules without parameters
        self._auto = model is None
        self._discover_handle = None
        self._layer_hooks_on = False
        self._hooks_pinned = False  # once Dynamo compiles, layer hooks stay (see compiling)
        self._order: list[str] = []  # layers in the order their forward ran

        # Per-step state.
        self._cur = _steps.clock.step
        self._recording = False
        self._auto_losses: list[torch.Tensor] = []
        self._manual_loss: dict[int, Any] = {}
        self._user_gives_loss = False
        self._backward_step: int | None = None
        self._chan_out: dict[int, tuple] = {}
        self._inputs_seen: set[str] = set()
        self._last_train_fwd: tuple[int, int, bool] | None = None

        # Shipping: tensors waiting for the next batched transfer, and copies in flight.
        self._out = Shipper(self._writer, bins)
        self._grads = GradientWatch(self._out, self._wants_hist, bins)
        self.modes = {
            "train_steps_in_eval": 0,
            "first_train_step_in_eval": None,
            "eval_forwards": 0,
            "eval_forwards_in_train": 0,
            "first_eval_forward_in_train": None,
        }
        self._modes_written: dict = {}

        if _steps.clock.users == 0:
            _steps.reset()
            self._cur = 0
        _steps.acquire()
        _steps.clock.on_step.append(self._on_step)
        _steps.clock.before_optimizer_step.append(self._before_optimizer)
        _steps.clock.on_optimizer_step.append(self._after_optimizer)
        _monitor_tap.add_listener(self._on_backward)
        self._writer.set_meta(monitor={"every": every, "status": "running"})

        self._taps: list[tuple] = []  # compiled code's hooks (see _compile_monitor)
        for prefix, module in models:
            self._attach(module, prefix)
        self._begin_step(self._cur)
        _OPEN.add(self)

    # ------------------------------------------------------------------ public
    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    @property
    def current_step(self) -> int:
        return self._cur

    @property
    def layers(self) -> list[str]:
        """Names of the layers watched, in forward order once a recording step has run."""
        names = [la.name for r in self._roots for la in r.layers]
        order = {n: i for i, n in enumerate(self._order)}
        return sorted(names, key=lambda n: order.get(n, len(order)))

    def step(self, loss: Any = None) -> int:
        """Give the loss of the step whose ``backward()`` ran last; end the step if no optimizer does.

        Call it after ``optimizer.step()``. Once called with a loss, that loss replaces the one
        seen through ``backward()`` (pass it when the backward runs on a scaled loss, as with AMP's
        ``GradScaler``). Returns the current step.
        """
        if self._closed:
            raise RuntimeError("this monitor is closed")
        s = self._backward_step if self._backward_step is not None else self._cur
        if loss is not None:
            if isinstance(loss, torch.Tensor):
                with self._no_record():
                    loss = loss.detach().reshape(-1)[0] if loss.numel() else float("nan")
            if s < self._cur or s in self._out.scalars:
                self._out.scalars.setdefault(s, {})["loss"] = loss  # the step is already finished
            else:
                self._manual_loss[s] = loss
            self._user_gives_loss = True
        self._backward_step = None
        if s == self._cur and (not self._grads.saw_optimizer or _steps.clock.manual):
            with self._no_record():
                self._grads.capture(self._all_params(), self._cur, self._recording, in_optimizer=None)
            _steps.step()
        return self._cur

    def flush(self) -> None:
        """Send what is buffered to the run (one transfer) and wait until it is written."""
        if self._closed:
            return
        with self._no_record():
            self._out.ship()
            self._out.resolve(wait=True)
        self._writer.flush()

    def close(self) -> None:
        """Ship what is pending, detach every hook, diagnose the run and store the findings."""
        if self._closed:
            return
        try:
            with self._no_record():
                if self._backward_step == self._cur or self._auto_losses:
                    self._finish_step(self._cur)  # a last step whose optimizer never ran
                self._out.ship()
                self._out.resolve(wait=True)
        finally:
            self._closed = True
            self._detach_all()
            with contextlib.suppress(ValueError):
                _steps.clock.on_step.remove(self._on_step)
            with contextlib.suppress(ValueError):
                _steps.clock.before_optimizer_step.remove(self._before_optimizer)
            with contextlib.suppress(ValueError):
                _steps.clock.on_optimizer_step.remove(self._after_optimizer)
            _steps.release()
            _monitor_tap.remove_listener(self._on_backward)
            _compile_monitor.unwatch(self)
            _OPEN.discard(self)
        self._write_meta(status="finished", final_step=self._cur)
        if self.diagnose:
            self._store_findings()
        release_writer(self._writer)

    # ------------------------------------------------------------------ attaching
    def _attach(self, module: nn.Module, prefix: str) -> Root:
        wrapper, module = module, getattr(module, "_orig_mod", module)  # torch.compile(model): the model
        self._known.add(wrapper)
        # A module that contains roots attached earlier (called on its own first) replaces them.
        inner = [r for r in self._roots if r.ref() is not None and any(r.ref() is m for m in module.modules())]
        for r in inner:
            self._detach_root(r)
        root = build_root(module, prefix)
        for m in module.modules():
            self._known.add(m)
        root.handle = module.register_forward_pre_hook(self._make_root_hook(root), with_kwargs=True)
        self._listen(module, lambda ts, grad: self._root_pre(root, root.ref(), (ts[0],) if ts else (), {}, grad))
        for la in root.layers:
            if la.ref() is not None:
                self._listen(la.ref(), lambda ts, grad, la=la: self._on_layer(la, ts[1:], ts[0], grad))
        self._roots.append(root)
        self._params = [p for r in self._roots for p in r.params]
        if self._layer_hooks_on:
            for la in root.layers:
                self._hook_layer(la)
        if self._recording:
            self._grads.hook_params(root.params, lambda: self._cur)
        self._grads.forget_optimizers()
        self._write_structure()
        return root

    def _listen(self, module: nn.Module, fn: Callable) -> None:
        tok = _compile_monitor.token(module)
        _compile_monitor.listen(tok, fn)
        self._taps.append((tok, fn, id(module)))

    def _detach_root(self, root: Root) -> None:
        mods = {id(m) for m in (root.ref(), *(la.ref() for la in root.layers)) if m is not None}
        for tap in [t for t in self._taps if t[2] in mods]:
            _compile_monitor.unlisten(tap[0], tap[1])
            self._taps.remove(tap)
        if root.handle is not None:
            root.handle.remove()
        for la in root.layers:
            if la.handle is not None:
                la.handle.remove()
                la.handle = None
        self._roots.remove(root)
        self._params = [p for r in self._roots for p in r.params]

    def _detach_all(self) -> None:
        for r in list(self._roots):
            self._detach_root(r)
        self._grads.unhook_params()
        if self._discover_handle is not None:
            self._discover_handle.remove()
            self._discover_handle = None

    def _discover(self, module: nn.Module, args) -> None:
        # A global forward pre-hook (model=None): the outermost module with parameters is a root.
        if torch.compiler.is_compiling() or module in self._known or module in self._no_params:
            return
        if not any(True for _ in module.parameters()):
            self._no_params.add(module)
            return
        prefix = ""
        outside = [r for r in self._roots if r.ref() is not None and all(r.ref() is not m for m in module.modules())]
        if outside:  # a second model: name its layers apart
            base = type(module).__name__.lower()
            taken = {r.prefix for r in self._roots}
            prefix, k = base + ".", 1
            while prefix in taken:
                k += 1
                prefix = f"{base}{k}."
        root = self._attach(module, prefix)
        # This call's pre-hooks were collected before the root hook existed: run it now.
        self._root_pre(root, module, args, {})

    def _set_discovery(self, on: bool) -> None:
        if on and self._discover_handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._discover_handle = register_module_forward_pre_hook(self._discover)
        elif not on and self._discover_handle is not None:
            self._discover_handle.remove()
            self._discover_handle = None

    def _all_params(self) -> list[Param]:
        return self._params

    def _write_structure(self) -> None:
        self._write_meta(**structure(self._roots))

    def _write_meta(self, **values: Any) -> None:
        meta = dict(getattr(self, "_meta", {}) or {})
        meta.update(values)
        meta["every"] = self.every
        meta.setdefault("status", "running")
        self._meta = meta
        self._writer.set_meta(monitor=meta)

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _no_record():
        return _monitor_tap.quiet()

    def _make_root_hook(self, root: Root):
        tok = _compile_monitor.token(root.ref())

        def hook(module, args, kwargs):
            if torch.compiler.is_compiling():  # traced: the compiled code calls back (see _compile_monitor)
                x = next((t for t in map(first_tensor, (*args, *kwargs.values())) if t is not None), None)
                _compile_monitor.tap([] if x is None else [x], tok, torch.is_grad_enabled())
                return
            self._root_pre(root, module, args, kwargs)

        keep_dynamo_out(hook)
        return hook

    def _root_pre(self, root: Root, module, args, kwargs, grad: bool | None = None) -> None:
        with self._no_record():
            self._root_pre_quiet(root, module, args, kwargs, grad)

    def _root_pre_quiet(self, root: Root, module, args, kwargs, grad: bool | None = None) -> None:
        try:
            grad_on = torch.is_grad_enabled() if grad is None else grad
            if root.mode_modules:
                mods = [m() for m in root.mode_modules]
                n_train = sum(1 for m in mods if m is not None and m.training)
                if grad_on:
                    # A whole model put in eval mode, not single layers frozen on purpose (frozen BN).
                    self._last_train_fwd = (n_train, len(mods), module.training)
                else:
                    self.modes["eval_forwards"] += 1
                    if n_train:
                        self.modes["eval_forwards_in_train"] += 1
                        if self.modes["first_eval_forward_in_train"] is None:
                            self.modes["first_eval_forward_in_train"] = self._cur
            if self._recording and grad_on and root.ref() is not None:
                name = root.prefix + "<input>"
                if name not in self._inputs_seen:
                    self._inputs_seen.add(name)
                    x = None
                    for v in (*args, *kwargs.values()):
                        x = first_tensor(v)
                        if x is not None:
                            break
                    if x is not None and x.is_floating_point():
                        with self._no_record():
                            out = input_stats(x)
                        if out is not None:
                            self._out.stats.append((("l", name, "input", tuple(out[1]), self._cur), out[0]))
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: root hook failed")

    def _hook_layer(self, layer: Layer) -> None:
        m = layer.ref()
        if m is None or layer.handle is not None:
            return

        tok = _compile_monitor.token(m)

        def hook(module, args, output):
            if torch.compiler.is_compiling():  # traced: the compiled code calls back (see _compile_monitor)
                x, inp = first_tensor(output), first_tensor(args)
                if x is not None:
                    _compile_monitor.tap([x] if inp is None else [x, inp], tok, torch.is_grad_enabled())
                return
            self._on_layer(layer, args, output)

        keep_dynamo_out(hook)
        layer.handle = m.register_forward_hook(hook)

    def _set_layer_hooks(self, on: bool) -> None:
        if on == self._layer_hooks_on:
            return
        self._layer_hooks_on = on
        for r in self._roots:
            for la in r.layers:
                if on:
                    self._hook_layer(la)
                elif la.handle is not None:
                    la.handle.remove()
                    la.handle = None

    def _wants_hist(self, name: str) -> bool:
        h = self.histograms
        return bool(h) and (h is True or name in h)

    def compiling(self, on: bool) -> None:
        """Dynamo starts (True) or ends a compilation. The layer hooks must be there to be traced,
        and stay from then on: Dynamo guards on the number of hooks, so toggling them per step
        (as in eager code) would recompile at every step."""
        if on:
            self._hooks_pinned = True
            self._set_layer_hooks(True)
            self._set_discovery(self._auto)

    def _on_layer(self, layer: Layer, args, output, grad: bool | None = None) -> None:
        if not self._recording or not (torch.is_grad_enabled() if grad is None else grad) or layer.seen_step == self._cur:
            return
        with self._no_record():
            self._layer_stats(layer, args, output)

    def _layer_stats(self, layer: Layer, args, output) -> None:
        try:
            x = first_tensor(output)
            if x is None or not x.is_floating_point() or x.numel() == 0:
                return
            layer.seen_step = self._cur
            if layer.name not in self._order:
                self._order.append(layer.name)
            if layer.channel_first:
                unit_dim = 1
                self._chan_out[id(x)] = tuple(x.shape)
            else:
                inp = first_tensor(args)
                inherit = inp is not None and self._chan_out.get(id(inp)) == tuple(inp.shape)
                unit_dim = 1 if inherit and x.dim() >= 3 else -1
                if inherit:
                    self._chan_out[id(x)] = tuple(x.shape)
            with self._no_record():
                raw, names, dead, finish = activation_stats(x, unit_dim, layer.prev_dead, layer.saturation)
                if self._wants_hist(layer.name):
                    self._out.stats.append((("h", layer.name, "activation", self._cur), histogram(x, self.bins)))
            layer.prev_dead = dead
            desc = ("l", layer.name, "activation", tuple(names), self._cur, finish, raw.numel())
            self._out.stats.append((desc, raw))
        except Exception:
            log.exception("trainguard monitor: layer hook failed on %s", layer.name)

    def _on_backward(self, loss: torch.Tensor | None) -> None:
        self._backward_step = self._cur
        if loss is not None and self.capture_loss and not self._user_gives_loss and self._roots:
            self._auto_losses.append(loss)

    # ------------------------------------------------------------------ optimizer
    def _before_optimizer(self, opt: torch.optim.Optimizer) -> None:
        try:
            params = self._grads.params_in(opt, self._all_params())
            if not params:
                return
            self._grads.saw_optimizer = True
            if self._last_train_fwd is not None:
                n_train, n_total, root_training = self._last_train_fwd
                if n_total and not n_train and not root_training:
                    self.modes["train_steps_in_eval"] += 1
                    if self.modes["first_train_step_in_eval"] is None:
                        self.modes["first_train_step_in_eval"] = self._cur
                self._last_train_fwd = None
            with self._no_record():
                self._grads.capture(params, self._cur, self._recording, in_optimizer=True)
                if self._recording and self.updates:
                    self._grads.snapshot(opt, params)
        except Exception:
            log.exception("trainguard monitor: optimizer pre-hook failed")

    def _after_optimizer(self, opt: torch.optim.Optimizer) -> None:
        try:
            if self._grads.params_in(opt, self._all_params()):
                with self._no_record():
                    self._grads.after(opt, self._cur)
        except Exception:
            log.exception("trainguard monitor: optimizer post-hook failed")

    # ------------------------------------------------------------------ steps
    def _on_step(self, new_step: int) -> None:
        if self._closed:
            return
        try:
            with self._no_record():
                self._finish_step(self._cur)
        except Exception:
            log.exception("trainguard monitor: finishing step %s failed", self._cur)
        self._cur = new_step
        self._begin_step(new_step)

    def _begin_step(self, step: int) -> None:
        if _compile_monitor.watch(self):  # Dynamo is imported: something may be compiled
            self._hooks_pinned = True
        self._recording = step % self.every == 0
        self._set_layer_hooks(self._recording or self._hooks_pinned)
        self._grads.unhook_params()
        if self._recording:
            self._grads.hook_params(self._all_params(), lambda: self._cur)
        # Roots are looked for while none is known, and at recording steps (a model built later);
        # once Dynamo compiles, always: it guards on whether global hooks exist.
        self._set_discovery(self._auto and (self._recording or not self._roots or self._hooks_pinned))

    def _finish_step(self, s: int) -> None:
        values: dict[str, Any] = {}
        if s in self._manual_loss:
            values["loss"] = self._manual_loss.pop(s)
        elif self._auto_losses:
            ls = self._auto_losses
            values["loss"] = ls[0] if len(ls) == 1 else torch.stack([v.float() for v in ls]).mean()
        values.update(self._grads.finish(self._all_params(), s, self._recording))
        if values:
            self._out.scalars[s] = values
        self._auto_losses = []
        self._chan_out = {}
        self._inputs_seen = set()
        if self._recording or len(self._out.scalars) > MAX_BUFFERED_STEPS:
            self._out.ship(keep=s)
        self._out.resolve(wait=False)
        if self.modes != self._modes_written:
            self._modes_written = dict(self.modes)
            self._write_meta(modes=dict(self.modes), order=list(self._order))

    # ------------------------------------------------------------------ findings
    def _store_findings(self) -> None:
        from trainguard.store import open_run

        # Training is over: the monitor hands the finished run to the analysis layer's pure rules
        # and stores what they return. The capture layer does not import the analysis layer: the
        # public ``trainguard.Monitor`` installs ``analysis.diagnose`` as the default.
        diagnose = self.diagnose if callable(self.diagnose) else DEFAULT_DIAGNOSE
        if diagnose is None:
            return
        try:
            self._writer.flush()
            with open_run(self.logdir) as run:
                findings = diagnose(run, thresholds=self.thresholds)
            self.findings = findings
            self._writer.add_findings("monitor", [f.to_dict() for f in findings], replace=True)
        except Exception:
            log.exception("trainguard monitor: diagnosis failed")


_OPEN: weakref.WeakSet = weakref.WeakSet()

# Set by trainguard._wiring (the public ``trainguard.Monitor``) to ``trainguard.analysis.diagnose``.
DEFAULT_DIAGNOSE: Callable | None = None


keep_dynamo_out(Monitor._discover)


@atexit.register
def _close_at_exit() -> None:
    for mon in list(_OPEN):
        with contextlib.suppress(Exception):
            mon.close()
