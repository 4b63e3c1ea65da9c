"""The training-health monitor: loss, learning rate and gradient norm per step, layer statistics
every ``every`` steps, written to a run directory for the diagnosis rules.

How it stays cheap:

- Per step it keeps two or three 0-d tensors (loss, squared gradient norm) on the device; per
  recording step the layer statistics are reductions on the device. Everything is concatenated and
  copied to the host **once per recording step** (asynchronously on accelerators; see ``_ship``).
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
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.capture import _monitor_tap, _steps
from trainguard.capture._layer_stats import (
    activation_stats,
    first_tensor,
    grad_stats,
    histogram,
    input_stats,
    is_channel_first,
    is_mode_module,
    saturation_kind,
    squared_norm_sum,
)
from trainguard.store import acquire_writer, release_writer

log = logging.getLogger("trainguard.monitor")

# Modules whose output is not a "layer" worth a row: containers and pass-through modules.
_SKIP_TYPES = (nn.Identity, nn.modules.dropout._DropoutNd, nn.Flatten, nn.Unflatten)


class _Layer:
    __slots__ = ("name", "type", "ref", "channel_first", "saturation", "prev_dead", "seen_step", "handle")

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.type = type(module).__name__
        self.ref = weakref.ref(module)
        self.channel_first = is_channel_first(module)
        self.saturation = saturation_kind(module)
        self.prev_dead: torch.Tensor | None = None
        self.seen_step = -1
        self.handle = None


class _Param:
    __slots__ = ("name", "ref", "layer", "module_type", "shape")

    def __init__(self, name: str, param: nn.Parameter, layer: str, module_type: str):
        self.name = name
        self.ref = weakref.ref(param)
        self.layer = layer
        self.module_type = module_type
        self.shape = list(param.shape)


class _Root:
    __slots__ = ("ref", "prefix", "mode_modules", "handle", "layers", "params")

    def __init__(self, module: nn.Module, prefix: str):
        self.ref = weakref.ref(module)
        self.prefix = prefix
        self.mode_modules = [weakref.ref(m) for m in module.modules() if is_mode_module(m)]
        self.handle = None
        self.layers: list[_Layer] = []
        self.params: list[_Param] = []


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

        self._roots: list[_Root] = []
        self._known: weakref.WeakSet = weakref.WeakSet()  # modules inside attached roots
        self._no_params: weakref.WeakSet = weakref.WeakSet()  # top-level modules without parameters
        self._auto = model is None
        self._discover_handle = None
        self._layer_hooks_on = False
        self._param_hooks: list = []
        self._order: list[str] = []  # layers in the order their forward ran
        self._opt_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._opt_index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._opt_params: set[int] = set()  # ids of parameters some optimizer owns
        self._saw_optimizer = False
        self._snap: dict[int, tuple[list[_Param], list[torch.Tensor]]] = {}

        # Per-step state.
        self._cur = _steps.clock.step
        self._recording = False
        self._grad_seen: set[int] = set()
        self._stale_seen: set[int] = set()
        self._sq: list[torch.Tensor] = []
        self._auto_losses: list[torch.Tensor] = []
        self._manual_loss: dict[int, Any] = {}
        self._user_gives_loss = False
        self._backward_step: int | None = None
        self._lrs: dict[str, Any] = {}
        self._chan_out: dict[int, tuple] = {}
        self._inputs_seen: set[str] = set()
        self._last_train_fwd: tuple[int, int, bool] | None = None

        # Shipping: tensors waiting for the next batched transfer, and copies in flight.
        self._scalars: dict[int, dict[str, Any]] = {}
        self._rec: list[tuple[tuple, torch.Tensor]] = []  # (descriptor, 1-D float32 vector)
        self._consts: list[tuple[int, str, str, str, float]] = []
        self._pending: list[tuple[list, Any, Any]] = []
        self._last_finished: int | None = None
        self._warned_nonfinite = False
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

        for prefix, module in self._named_models(model):
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
            if s < self._cur or s in self._scalars:
                self._scalars.setdefault(s, {})["loss"] = loss  # the step is already finished
            else:
                self._manual_loss[s] = loss
            self._user_gives_loss = True
        self._backward_step = None
        if s == self._cur and (not self._saw_optimizer or _steps.clock.manual):
            with self._no_record():
                self._capture_grads(self._all_params(), in_optimizer=None)
            _steps.step()
        return self._cur

    def flush(self) -> None:
        """Send what is buffered to the run (one transfer) and wait until it is written."""
        if self._closed:
            return
        with self._no_record():
            self._ship(final=False, include_last=True)
            self._resolve(wait=True)
        self._writer.flush()

    def close(self) -> None:
        """Ship what is pending, detach every hook, diagnose the run and store the findings."""
        if self._closed:
            return
        try:
            with self._no_record():
                if self._backward_step == self._cur or self._auto_losses or self._grad_seen:
                    self._finish_step(self._cur)  # a last step whose optimizer never ran
                self._ship(final=True, include_last=True)
                self._resolve(wait=True)
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
            _OPEN.discard(self)
        self._write_meta(status="finished", final_step=self._cur)
        if self.diagnose:
            self._store_findings()
        release_writer(self._writer)

    # ------------------------------------------------------------------ attaching
    @staticmethod
    def _named_models(model) -> list[tuple[str, nn.Module]]:
        if model is None:
            return []
        if isinstance(model, nn.Module):
            return [("", model)]
        if isinstance(model, dict):
            items = list(model.items())
        else:
            items = [(f"model{i}", m) for i, m in enumerate(model)]
        for name, m in items:
            if not isinstance(m, nn.Module):
                raise TypeError(f"model {name!r} must be an nn.Module, got {type(m).__name__}")
        return [(f"{name}.", m) for name, m in items]

    def _attach(self, module: nn.Module, prefix: str) -> _Root:
        # A module that contains roots attached earlier (called on its own first) replaces them.
        inner = [r for r in self._roots if r.ref() is not None and any(r.ref() is m for m in module.modules())]
        for r in inner:
            self._detach_root(r)
        root = _Root(module, prefix)
        root_label = type(module).__name__.lower()
        for name, m in module.named_modules():
            self._known.add(m)
            if m is module and list(m.children()):
                continue
            if isinstance(m, _SKIP_TYPES):
                continue
            has_direct = any(True for _ in m.parameters(recurse=False))
            if list(m.children()) and not has_direct:
                continue
            root.layers.append(_Layer(prefix + (name or root_label), m))
        owner = {}
        for mname, m in module.named_modules():
            for pname, _ in m.named_parameters(recurse=False):
                owner[(mname + "." + pname) if mname else pname] = (prefix + (mname or root_label), type(m).__name__)
        for pname, p in module.named_parameters():
            layer, mtype = owner.get(pname, (prefix + pname.rsplit(".", 1)[0], ""))
            root.params.append(_Param(prefix + pname, p, layer, mtype))
        root.handle = module.register_forward_pre_hook(self._make_root_hook(root), with_kwargs=True)
        self._roots.append(root)
        if self._layer_hooks_on:
            for la in root.layers:
                self._hook_layer(la)
        if self._recording:
            self._hook_params(root.params)
        self._opt_cache = weakref.WeakKeyDictionary()
        self._write_structure()
        return root

    def _detach_root(self, root: _Root) -> None:
        if root.handle is not None:
            root.handle.remove()
        for la in root.layers:
            if la.handle is not None:
                la.handle.remove()
                la.handle = None
        self._roots.remove(root)

    def _detach_all(self) -> None:
        for r in list(self._roots):
            self._detach_root(r)
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        if self._discover_handle is not None:
            self._discover_handle.remove()
            self._discover_handle = None

    def _discover(self, module: nn.Module, args) -> None:
        # A global forward pre-hook (model=None): the outermost module with parameters is a root.
        if module in self._known or module in self._no_params:
            return
        if not any(True for _ in module.parameters()):
            self._no_params.add(module)
            return
        prefix = ""
        if self._roots:
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

    def _all_params(self) -> list[_Param]:
        return [p for r in self._roots for p in r.params]

    def _write_structure(self) -> None:
        self._write_meta(
            layers=[
                {"name": la.name, "type": la.type, "saturation": la.saturation, "channel_first": la.channel_first}
                for r in self._roots
                for la in r.layers
            ],
            params={
                p.name: {"layer": p.layer, "module_type": p.module_type, "shape": p.shape,
                         "requires_grad": bool(p.ref() is not None and p.ref().requires_grad)}
                for r in self._roots
                for p in r.params
            },
            roots=[{"prefix": r.prefix, "type": type(r.ref()).__name__ if r.ref() is not None else None,
                    "mode_modules": len(r.mode_modules)} for r in self._roots],
        )

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

    def _make_root_hook(self, root: _Root):
        def hook(module, args, kwargs):
            self._root_pre(root, module, args, kwargs)

        return hook

    def _root_pre(self, root: _Root, module, args, kwargs) -> None:
        with self._no_record():
            self._root_pre_quiet(root, module, args, kwargs)

    def _root_pre_quiet(self, root: _Root, module, args, kwargs) -> None:
        try:
            grad_on = torch.is_grad_enabled()
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
                            self._rec.append((("l", name, "input", tuple(out[1]), self._cur), out[0]))
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: root hook failed")

    def _hook_layer(self, layer: _Layer) -> None:
        m = layer.ref()
        if m is None or layer.handle is not None:
            return

        def hook(module, args, output):
            self._on_layer(layer, args, output)

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

    def _on_layer(self, layer: _Layer, args, output) -> None:
        if not self._recording or not torch.is_grad_enabled() or layer.seen_step == self._cur:
            return
        with self._no_record():
            self._layer_stats(layer, args, output)

    def _layer_stats(self, layer: _Layer, args, output) -> None:
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
                vec, names, dead = activation_stats(x, unit_dim, layer.prev_dead, layer.saturation)
                if self._wants_hist(layer.name):
                    self._rec.append((("h", layer.name, "activation", self._cur), histogram(x, self.bins)))
            layer.prev_dead = dead
            self._rec.append((("l", layer.name, "activation", tuple(names), self._cur), vec))
        except Exception:
            log.exception("trainguard monitor: layer hook failed on %s", layer.name)

    def _hook_params(self, params: list[_Param]) -> None:
        # Recording steps only: the first gradient of the step to reach a parameter finds its .grad
        # still holding the previous step's gradient when zero_grad was not called.
        for p in params:
            t = p.ref()
            if t is None or not t.requires_grad:
                continue
            self._param_hooks.append(t.register_hook(self._make_param_hook(p)))

    def _make_param_hook(self, p: _Param):
        def hook(grad):
            self._on_param_grad(p)

        return hook

    def _on_param_grad(self, p: _Param) -> None:
        with self._no_record():
            self._on_param_grad_quiet(p)

    def _on_param_grad_quiet(self, p: _Param) -> None:
        key = id(p)
        if key in self._stale_seen:
            return
        self._stale_seen.add(key)
        t = p.ref()
        if t is None:
            return
        prior = t.grad
        if prior is None or prior.is_sparse:
            self._consts.append((self._cur, p.name, "gradient", "stale", 0.0))
            return
        with self._no_record():
            flag = prior.ne(0).any().to(torch.float32).reshape(1)
        self._rec.append((("l", p.name, "gradient", ("stale",), self._cur), flag))

    def _on_backward(self, loss: torch.Tensor | None) -> None:
        self._backward_step = self._cur
        if loss is not None and self.capture_loss and not self._user_gives_loss and self._roots:
            self._auto_losses.append(loss)

    # ------------------------------------------------------------------ optimizer
    def _params_in(self, opt: torch.optim.Optimizer) -> list[_Param]:
        sig = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self._opt_cache.get(opt)
        if hit is not None and hit[0] == sig:
            return hit[1]
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        self._opt_params |= ids
        mine = [p for p in self._all_params() if p.ref() is not None and id(p.ref()) in ids]
        self._opt_cache[opt] = (sig, mine)
        if opt not in self._opt_index:
            self._opt_index[opt] = len(self._opt_index)
        return mine

    def _before_optimizer(self, opt: torch.optim.Optimizer) -> None:
        with self._no_record():
            self._before_optimizer_quiet(opt)

    def _before_optimizer_quiet(self, opt: torch.optim.Optimizer) -> None:
        try:
            params = self._params_in(opt)
            if not params:
                return
            self._saw_optimizer = True
            if self._last_train_fwd is not None:
                n_train, n_total, root_training = self._last_train_fwd
                if n_total and not n_train and not root_training:
                    self.modes["train_steps_in_eval"] += 1
                    if self.modes["first_train_step_in_eval"] is None:
                        self.modes["first_train_step_in_eval"] = self._cur
                self._last_train_fwd = None
            self._capture_grads(params, in_optimizer=True)
            if self._recording and self.updates:
                live = [(p, p.ref()) for p in params]
                live = [(p, t) for p, t in live if t is not None and not t.is_sparse]
                if live:
                    with self._no_record(), torch.no_grad():
                        copies = torch._foreach_mul([t.detach() for _, t in live], 1.0)
                    self._snap[id(opt)] = ([p for p, _ in live], copies)
        except Exception:
            log.exception("trainguard monitor: optimizer pre-hook failed")

    def _after_optimizer(self, opt: torch.optim.Optimizer) -> None:
        with self._no_record():
            self._after_optimizer_quiet(opt)

    def _after_optimizer_quiet(self, opt: torch.optim.Optimizer) -> None:
        try:
            params = self._params_in(opt)
            if not params:
                return
            k = self._opt_index.get(opt, 0)
            for gi, g in enumerate(opt.param_groups):
                lr = g.get("lr")
                if lr is None:
                    continue
                if isinstance(lr, torch.Tensor):
                    lr = lr.detach().reshape(-1)[0].clone()
                self._lrs[f"lr/{gi}" if k == 0 else f"lr/{k}.{gi}"] = lr
            snap = self._snap.pop(id(opt), None)
            if snap is not None:
                ps, old = snap
                now = [p.ref() for p in ps]
                if all(t is not None for t in now):
                    with self._no_record(), torch.no_grad():
                        new = [t.detach() for t in now]
                        un = torch._foreach_norm(torch._foreach_sub(new, old))
                        wn = torch._foreach_norm(new)
                        for p, u, w in zip(ps, un, wn):
                            vec = torch.stack([u.float(), (u / w).float()])
                            self._rec.append((("l", p.name, "update", ("norm", "ratio"), self._cur), vec))
        except Exception:
            log.exception("trainguard monitor: optimizer post-hook failed")

    def _capture_grads(self, params: list[_Param], *, in_optimizer: bool | None) -> None:
        grads, owners = [], []
        for p in params:
            key = id(p)
            if key in self._grad_seen:
                continue
            self._grad_seen.add(key)
            t = p.ref()
            if t is None:
                continue
            g = t.grad
            flag = None
            if in_optimizer is not None:
                flag = 1.0 if (in_optimizer or id(t) in self._opt_params) else 0.0
            if self._recording:
                if flag is not None:
                    self._consts.append((self._cur, p.name, "gradient", "in_optimizer", flag))
                self._consts.append((self._cur, p.name, "gradient", "present", 0.0 if g is None else 1.0))
            if g is None or g.is_sparse:
                continue
            grads.append(g.detach())
            owners.append(p)
        if not grads:
            return
        with self._no_record(), torch.no_grad():
            self._sq.append(squared_norm_sum(grads))
            if self._recording:
                mat, names = grad_stats(grads)
                names = tuple(names)
                for p, row in zip(owners, mat):
                    self._rec.append((("l", p.name, "gradient", names, self._cur), row))
                    if self._wants_hist(p.name):
                        self._rec.append((("h", p.name, "gradient", self._cur), histogram(p.ref().grad, self.bins)))

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
        self._recording = step % self.every == 0
        self._set_layer_hooks(self._recording)
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        if self._recording:
            self._hook_params(self._all_params())
        # Roots are looked for while none is known, and at recording steps (a model built later).
        self._set_discovery(self._auto and (self._recording or not self._roots))

    def _finish_step(self, s: int) -> None:
        if self._saw_optimizer:
            # Gradients that no optimizer took: parameters missing from the optimizer.
            rest = [p for p in self._all_params() if id(p) not in self._grad_seen]
            if rest:
                self._capture_grads(rest, in_optimizer=False)
        values: dict[str, Any] = {}
        if s in self._manual_loss:
            values["loss"] = self._manual_loss.pop(s)
        elif self._auto_losses:
            ls = self._auto_losses
            values["loss"] = ls[0] if len(ls) == 1 else torch.stack([v.float() for v in ls]).mean()
        if self._sq:
            with self._no_record():
                values["grad_norm"] = (self._sq[0] if len(self._sq) == 1 else torch.stack(self._sq).sum()).sqrt()
        values.update(self._lrs)
        if values:
            self._scalars[s] = values
        if self._recording:
            self._record_weights(s)
        self._last_finished = s
        self._auto_losses = []
        self._sq = []
        self._lrs = {}
        self._grad_seen = set()
        self._stale_seen = set()
        self._chan_out = {}
        self._inputs_seen = set()
        self._snap = {}
        if self._recording:
            self._ship(final=False)
        self._resolve(wait=False)
        if self.modes != self._modes_written:
            self._modes_written = dict(self.modes)
            self._write_meta(modes=dict(self.modes), order=list(self._order))

    def _record_weights(self, s: int) -> None:
        live = [(p, p.ref()) for p in self._all_params()]
        live = [(p, t) for p, t in live if t is not None and not t.is_sparse]
        if not live:
            return
        with self._no_record(), torch.no_grad():
            norms = torch._foreach_norm([t.detach() for _, t in live])
            for (p, t), n in zip(live, norms):
                self._rec.append((("l", p.name, "weight", ("norm",), s), n.float().reshape(1)))
                self._consts.append((s, p.name, "weight", "requires_grad", 1.0 if t.requires_grad else 0.0))
                if self._wants_hist(p.name):
                    self._rec.append((("h", p.name, "weight", s), histogram(t, self.bins)))

    # ------------------------------------------------------------------ shipping
    def _ship(self, *, final: bool, include_last: bool = False) -> None:
        """Concatenate everything buffered and start one copy to the host per device.

        The per-step scalars of the last finished step stay behind (unless ``include_last``):
        ``monitor.step(loss)`` may still name its loss.
        """
        items: list[tuple[tuple, torch.Tensor]] = []
        consts: list[tuple] = list(self._consts)
        for s in sorted(self._scalars):
            if not (final or include_last) and s == self._last_finished:
                continue
            for name, v in self._scalars.pop(s).items():
                if isinstance(v, torch.Tensor):
                    items.append((("s", s, name), v.detach().reshape(1)))
                else:
                    consts.append(("s", s, name, float(v)))
        items.extend(self._rec)
        self._rec = []
        self._consts = []
        if not items and not consts:
            return
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for desc, t in items:
            entry = by_dev.setdefault(t.device, ([], []))
            entry[0].append(desc)
            entry[1].append(t)
        parts = []
        with self._no_record(), torch.no_grad():
            for dev, (descs, ts) in by_dev.items():
                flat = torch.cat([t.to(torch.float32) for t in ts])
                if dev.type == "cpu":
                    parts.append((descs, flat, None))
                else:
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=torch.cuda.is_available())
                    host.copy_(flat, non_blocking=True)
                    event = None
                    if dev.type == "cuda":
                        event = torch.cuda.Event()
                        event.record()
                    parts.append((descs, host, event))
        self._pending.append((parts, consts, [len(t) for _, t in items]))

    def _resolve(self, *, wait: bool) -> None:
        """Write the batches whose host copies are complete (all of them when ``wait``)."""
        while self._pending:
            parts, consts, _ = self._pending[0]
            for _, _, event in parts:
                if event is not None and not event.query():
                    if not wait:
                        return
                    event.synchronize()  # close/flush only: the copy must land before it is written
            self._pending.pop(0)
            self._emit(parts, consts)

    def _emit(self, parts: list, consts: list) -> None:
        scalars: dict[int, dict[str, float]] = {}
        rows: list[tuple] = []
        for descs, host, _ in parts:
            values = host.tolist()  # host memory: no device sync here
            i = 0
            for desc in descs:
                kind = desc[0]
                if kind == "s":
                    scalars.setdefault(desc[1], {})[desc[2]] = values[i]
                    i += 1
                elif kind == "l":
                    _, layer, lkind, names, step = desc
                    for j, name in enumerate(names):
                        rows.append((step, layer, lkind, name, values[i + j]))
                    i += len(names)
                else:
                    _, layer, hkind, step = desc
                    lo, hi = values[i], values[i + 1]
                    counts = values[i + 2 : i + 2 + self.bins]
                    i += 2 + self.bins
                    width = (hi - lo) / self.bins if math.isfinite(hi - lo) else 0.0
                    edges = [lo + width * b for b in range(self.bins + 1)]
                    self._writer.add_histogram(step, layer, hkind, edges, counts)
        for c in consts:
            if c[0] == "s":
                scalars.setdefault(c[1], {})[c[2]] = c[3]
            else:
                rows.append(c)
        for step in sorted(scalars):
            vals = scalars[step]
            loss = vals.get("loss")
            if loss is not None and not math.isfinite(loss) and not self._warned_nonfinite:
                self._warned_nonfinite = True
                log.warning("trainguard monitor: loss is %s at step %d", loss, step)
            self._writer.add_scalars(step, vals)
        if rows:
            self._writer.add_layer_stats(rows)

    # ------------------------------------------------------------------ findings
    def _store_findings(self) -> None:
        from trainguard.store import open_run

        if callable(self.diagnose):
            diagnose = self.diagnose
        else:
            # Training is over: the monitor hands the finished run to the analysis layer's pure
            # rules (imported here, never on the hot path) and stores what they return.
            from trainguard.analysis import diagnose
        try:
            self._writer.flush()
            with open_run(self.logdir) as run:
                findings = diagnose(run, thresholds=self.thresholds)
            self.findings = findings
            self._writer.add_findings("monitor", [f.to_dict() for f in findings], replace=True)
        except Exception:
            log.exception("trainguard monitor: diagnosis failed")


_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for mon in list(_OPEN):
        with contextlib.suppress(Exception):
            mon.close()
