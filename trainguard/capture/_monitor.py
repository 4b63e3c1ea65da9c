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
recorder agree: step ``s`` is the work before the ``s``-th ``optimizer.step()`` (counting from 0),
or the framework's ``global_step`` when an integration drives the clock. In a loop with no
optimizer a step ends at the next training forward or ``backward()`` after a ``backward()``
whose gradients were then used (cleared, replaced, or the parameters changed in place), so
hand-written updates count one step each and gradient accumulation still counts once.

The hooks this puts on a model are in :mod:`._monitor_hooks` (they never reach its pickle); what it
does on ``backward``, clipping and the optimizer's hooks in :mod:`._monitor_events`; the gradient readings in :mod:`._monitor_grads`; the taps on ``backward``, clipping and
``GradScaler`` in :mod:`._monitor_tap` and :mod:`._amp_tap`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.capture import (
    _amp_tap,
    _compile_monitor,
    _loss_watch,
    _monitor_hooks,
    _monitor_tap,
    _skips,
    _steps,
    _swap,
)
from trainguard.capture._ending import ending, uncaught, watch_uncaught
from trainguard.capture._gradcheck import LiveGradcheck
from trainguard.capture._monitor_eval import EvalWatch
from trainguard.capture._monitor_events import EventsMixin
from trainguard.capture._monitor_grads import GradientWatch
from trainguard.capture._monitor_hooks import HookMixin
from trainguard.capture._monitor_leak import LeakWatch
from trainguard.capture._monitor_model import Param, Root, named_models, structure
from trainguard.capture._monitor_ship import Shipper
from trainguard.capture._monitor_time import TimeWatch
from trainguard.store import acquire_writer, default_name, release_writer
from trainguard.store import rank_dir as _rank_dir

log = logging.getLogger("trainguard.monitor")

# Reinforcement-learning environment packages: a script that imported one trains on what its own
# policy collected, and the run's meta says so (analysis judges such a loss's trend differently).
_RL_ENVIRONMENTS = ("gymnasium", "gym", "dm_control", "pettingzoo")

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
    return Path("runs") / default_name("monitor")


class Monitor(EventsMixin, HookMixin):
    """Watch training health: per step loss, learning rate and global gradient norm; every
    ``every`` steps, per layer, activation, gradient, weight and update statistics.

    ``model`` is an ``nn.Module``, a list or dict of them (a GAN's two networks), or None: then the
    monitor attaches to every module with parameters that is called at the top level (how
    ``trainguard monitor script.py`` watches an unmodified script). Steps end automatically when
    ``optimizer.step()`` runs (or a ``GradScaler`` skips it); in a loop with no ``torch.optim``
    optimizer, after each ``backward()`` whose gradients the loop then applies. The loss is the
    sum of the scalars ``backward()`` is called on in the step (unscaled when ``GradScaler.scale``
    made them), or what you pass to :meth:`step`.

    ``histograms``: True for every layer and parameter, or a list of layer/parameter names.
    ``validation`` (default True) watches the evaluation passes the script runs (under
    ``no_grad`` or in eval mode): the loss and argmax accuracy computed there become the scalars
    ``val_loss`` / ``val_accuracy``, and sampled input rows are hashed to find validation samples
    that copy training samples.
    Writes to ``logdir`` (shared with ``trainguard.record`` when both name the same directory);
    by default ``runs/monitor-<date>-<time>``; ``append=True`` continues a run already there (a
    resumed training job). ``start_step``: the step training is at (a monitor started mid-training;
    counting stays automatic). ``close()`` (or leaving the ``with`` block) ships what is pending,
    diagnoses the run (:func:`trainguard.analysis.diagnose`, with ``thresholds``) and stores the
    findings in it and in ``monitor.findings`` (``diagnose=False`` skips that).

    The monitor changes nothing a model can do: ``torch.save(model)``, ``pickle`` and
    ``copy.deepcopy`` see the model without trainguard's hooks, and ``torch.jit.trace`` traces
    the model's own graph.

    ``gradcheck`` (default True): the first time a custom ``torch.autograd.Function`` runs before
    a backward pass, check its ``backward`` once against central differences in float64 on a few
    rows of its inputs, on a background thread (at most 2 s per Function); a wrong gradient is an
    ``error`` finding ``custom_gradient_wrong``.

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
        gradcheck: bool = True,
        append: bool = False,
        start_step: int | None = None,
        rank_dir: bool = True,
        validation: bool = True,
    ):
        _validate(every, bins, histograms)
        if start_step is not None and (isinstance(start_step, bool) or not isinstance(start_step, int)
                                       or start_step < 0):
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        models = named_models(model)  # a bad model fails before anything is installed
        self.every = every
        self.bins = bins
        self.histograms = histograms
        self.capture_loss = capture_loss
        self.updates = updates
        self.diagnose = diagnose
        self.thresholds = thresholds
        self.findings: list | None = None
        # Under torch.distributed each rank watches its own replica (or shard) into logdir/rank-K;
        # ``rank_dir=False``: the caller (a framework integration) already chose the rank's directory.
        logdir = Path(logdir) if logdir is not None else _default_logdir()
        self.logdir = _rank_dir(logdir) if rank_dir else logdir
        self._writer = acquire_writer(self.logdir, overwrite=overwrite, append=append)
        self._closed = False
        self._meta: dict = _existing_meta(self.logdir) if append else {}
        self._meta.pop("error", None)

        self._roots: list[Root] = []
        # backward() passes while no model was attached: a script that calls module.forward(x)
        # directly (pytorch/examples mnist_forward_forward) never triggers the hooks models are found by.
        self._unattached_backwards = 0
        # Whether a model no hook ever announced was looked for from a loss (see _adopt_from_loss).
        self._adopt_tried = False
        self._params_outside = 0  # leaf tensors the first unattached loss trains that no module holds
        # The type of a model called only inside a torch.func transform (functional_call under
        # vmap or grad, as model ensembles are): the monitor does not attach there (see _discover).
        self._torch_func_model: str | None = None
        self._params: list[Param] = []
        self._known: weakref.WeakSet = weakref.WeakSet()  # modules inside attached roots
        self._no_params: weakref.WeakSet = weakref.WeakSet()  # top-level modules without parameters
        self._auto = model is None
        self._discover_handle = None
        self._layer_hooks_on = False
        self._hooks_pinned = False  # once Dynamo compiles, layer hooks stay (see compiling)
        self._order: list[str] = []  # layers in the order their forward ran
        self._order_step: int | None = None  # the recording step that set that order
        self._order_written = 0  # how many of them the run's metadata holds
        self._attach_listeners: list[Callable] = []

        # Per-step state.
        self._cur = _steps.clock.step
        self._recording = False
        self._auto_losses: list[torch.Tensor] = []
        self._auto_divisors: list[int] = []  # accelerate's k each of them was divided by (1: none)
        # The step's forwards of a root with gradients, and without before its first backward (in
        # train mode): k and k with k backwards are features cached for contrastive accumulation
        # (open_clip's --accum-freq); the no-grad ones' counts in ``modes`` (evaluations, in train mode).
        self._fwd_grad = 0
        self._fwd_cached = 0
        self._cached_modes = [0, 0]
        self._losses_at_update = 0  # the step's losses before the last update of a watched model
        self._targets_read = -1  # the last step whose soft targets were read (see _read_soft_targets)
        self._update_opt: Any = None  # weak reference to the optimizer of that update
        # A backward came after an update in this step: separate objectives (a GAN's) unless the
        # same optimizer updates next (a layer's optimizer taking over ending steps, see _steps._count).
        self._pending_separate = False
        self._separate_losses = bool(self._meta.get("separate_losses"))
        self._manual_loss: dict[int, Any] = {}
        self._user_gives_loss = False
        self._backward_step: int | None = None
        self._chan_out: dict[int, tuple] = {}
        # id(output) -> (shape, row_hashes) of the layers recorded this step: the next layer's input
        # is mostly the one before's output, hashed once
        self._codes_out: dict[int, tuple] = {}
        self._code_rows: list[tuple] = []  # (layer, output's row_hashes, input's or None) this step
        self._compiled = False  # Dynamo compiled while this monitor was open (see compiling)
        self._inputs_seen: set[str] = set()
        self._input_wanted: dict[str, str] = {}
        self._last_train_fwd: tuple[int, int, bool] | None = None
        self._trained_any = False  # a watched model has run a forward with gradients enabled
        self._amp: dict[str, Any] = {}
        # Iterations the loop skipped itself (see capture/_skips): this step's scalars, and the
        # run's account of them (run.meta["monitor"]["skipped_iterations"]).
        self._skipped: dict[str, Any] = {}
        self._skip_account: dict | None = self._meta.get("skipped_iterations")
        # No optimizer: after a backward(), what the step's end is recognised by (see pending_refs).
        self._pending_end: list | None = None
        # The gradients read after the last backward() (see pending_refs), and whether the update
        # gets others: an optimizer wrapper replaced them first (Opacus' DPOptimizer clips and adds
        # noise), so the reading after backward() is the step's.
        self._read_refs: list | None = None
        self._grads_replaced = bool(self._meta.get("gradients_replaced"))
        self._initial_written = "weights_initial" in self._meta  # a resumed run keeps what it knew

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
        self.modes.update({k: v for k, v in (self._meta.get("modes") or {}).items() if k in self.modes})
        self._modes_written: dict = {}
        # Layers that ran with grad mode off inside a training forward, and why: "checkpoint" inside
        # torch.utils.checkpoint (a reentrant checkpoint whose inputs need no grad runs its forward
        # under no_grad and never again), "no_grad" otherwise. param_no_gradient names the fix.
        self.no_grad_layers: dict[str, str] = dict(self._meta.get("no_grad_layers") or {})
        self._no_grad_written = dict(self.no_grad_layers)
        self._root_grad = False  # grad mode where the last root forward began
        # The validation pass (see _monitor_eval, _monitor_leak): its loss and accuracy per step,
        # and signatures of sampled input rows in each mode.
        self._eval = EvalWatch() if validation else None
        self._leak = LeakWatch() if validation else None
        self._time = TimeWatch(self._out)  # gradients through a recurrent loop
        self._shipped_at = time.monotonic()  # the last shipment of buffered steps (see _finish_step)

        if _steps.clock.users == 0:
            _steps.reset(start_step or 0)
            self._cur = start_step or 0
        _steps.acquire()
        _monitor_hooks.hide_hooks_from_pickle()
        c = _steps.clock
        self._subscriptions = [
            (c.on_step, self._on_step),
            (c.on_restore, self._on_restore),
            (c.on_save, self._on_save),
            (c.before_optimizer_step, self._before_optimizer),
            (c.grads_ready, self.gradients_ready),
            (c.on_optimizer_step, self._after_optimizer),
            (_amp_tap.step_listeners, self._on_scaler_step),
        ]
        for registry, fn in self._subscriptions:
            registry.append(fn)
        self._taps = [("root", self._before_backward), ("backward", self._on_backward), ("after_backward", self._after_backward),
                      ("clip", self._on_clip)]
        for event, fn in self._taps:
            _monitor_tap.add_listener(event, fn)
        _swap.hold(self._release)
        _skips.acquire(self._on_skip)
        self._write_meta(status="running")
        self._loss_watch = _loss_watch.acquire(self._writer)
        self._loss_watch.modules = self._probability_layers
        self._loss_watch.tables = self._padding_indices
        # The live gradient check of custom autograd Functions (capture/_gradcheck.py).
        self._gradcheck = LiveGradcheck(self._writer) if gradcheck else None
        if self._gradcheck is not None:
            _monitor_tap.add_listener("loss_graph", self._gradcheck.on_backward)

        self._compiled_taps: list[tuple] = []  # compiled code's hooks (see _compile_monitor)
        for prefix, module in models:
            self._attach(module, prefix)
        self._begin_step(self._cur)
        _OPEN.add(self)
        watch_uncaught()  # a monitor still open at exit is closed with the script's error

    # ------------------------------------------------------------------ public
    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)

    @property
    def closed(self) -> bool:
        return self._closed

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

        Call it after ``optimizer.step()`` (or the update made by hand). Once called with a loss,
        that loss replaces the one seen through ``backward()``. Returns the current step.
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
        self._pending_end = None
        if s == self._cur and _steps.clock.driver != "framework" and (
            not self._grads.saw_optimizer or _steps.clock.driver == "user"
        ):
            _steps.step()
        return self._cur

    def gradients_ready(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients ``optimizer`` will apply are complete (before clipping and the update).

        Frameworks' "before optimizer step" callbacks call this; the monitor also finds the moment
        itself (clipping, a closure's return, ``optimizer.step()``). Reading twice is harmless.
        """
        if self._closed:
            return
        try:
            params = self._grads.params_in(optimizer, self._params)
            if params:
                self._grads.saw_optimizer = True  # an optimizer updates this model (found after its pre-hook)
                with self._no_record():
                    self._grads.read(params, self._cur, self._recording)
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: reading gradients failed")

    def forward_started(self, model: nn.Module, inputs: Any) -> None:
        """A training forward of ``model`` (an attached model) starts with ``inputs``.

        For frameworks that run a model's training step without calling the model itself
        (Lightning calls ``training_step``): train/eval mode and the input statistics are taken
        here, as the model's forward pre-hook would.
        """
        root = next((r for r in self._roots if r.ref() is model), None)
        if root is not None and not self._closed:
            self._root_pre(root, model, (inputs,))

    def on_attach(self, fn: Callable[[Monitor, nn.Module], None]) -> None:
        """Call ``fn(monitor, module)`` whenever a model is attached (integrations find their framework)."""
        self._attach_listeners.append(fn)

    def framework_checkpoint(self) -> None:
        """A framework saved a checkpoint of its model (the HF Trainer's ``checkpoint-N``): noted once,
        with its step, so that the diagnosis can name what such a checkpoint leaves out."""
        if not self._closed and "framework_checkpoint" not in self._meta:
            self._write_meta(framework_checkpoint={"first_step": self._cur})

    def trained_by(self, framework: str, **facts: Any) -> None:
        """The framework trainer running the training step (``"transformers"``) and what the
        diagnosis needs of it (``accepts_loss_kwargs``: the HF Trainer leaves the loss undivided by
        ``gradient_accumulation_steps`` for the model to normalise), so that a fix names the
        trainer's setting rather than the script's ``train()`` line."""
        if not self._closed:
            self._write_meta(trainer={"framework": framework, **facts})

    def flush(self) -> None:
        """Send what is buffered to the run (one transfer) and wait until it is written."""
        if self._closed:
            return
        with self._no_record():
            self._out.ship()
            self._out.resolve(wait=True)
        self._writer.flush()

    def close(self, error: BaseException | str | None = None) -> None:
        """Ship what is pending, detach every hook, diagnose the run and store the findings.

        ``error``: the exception (or its text) that ended training; the run stores it as
        ``trainguard run`` does (status ``crashed``, ``error``, ``crash_step``; ``interrupted`` for
        ``KeyboardInterrupt``), so the diagnosis leads with a ``script_crashed`` error, never "healthy".
        """
        if self._closed:
            return
        # Which parameters trained, and each layer's units, are known now (see structure); the
        # roots go with the hooks.
        known = (structure(self._roots, self._grads.trainable, self._grads.updaters, self._grads.gradient_steps)
                 if self._roots else {})
        if self._skip_account and _skips.watch.pending is not None:
            # The last iteration's loss was checked non-finite, and no backward() followed, in a
            # loop seen skipping such iterations: skipped too, though no forward came after it.
            _skips.watch.boundary()
        try:
            with self._no_record():
                if self._backward_step == self._cur or self._auto_losses:
                    self._finish_step(self._cur)  # a last step whose optimizer never ran
                elif self._eval is not None:  # an evaluation after the last training step
                    pending = self._eval.take()
                    if pending:
                        self._out.scalars.setdefault(self._cur, {}).update(pending)
                self._grads.settle_stale()
                self._out.ship()
                self._out.resolve(wait=True)
        except Exception:  # observing training never kills training: what was written stays
            log.exception("trainguard monitor: shipping the last statistics failed")
        finally:
            self._closed = True
            self._detach_all()
            for registry, fn in self._subscriptions:
                with contextlib.suppress(ValueError):
                    registry.remove(fn)
            for event, fn in self._taps:
                _monitor_tap.remove_listener(event, fn)
            _skips.release(self._on_skip)
            _steps.release()
            _compile_monitor.unwatch(self)
            _monitor_hooks.release_pickle_hiding()
            _swap.unhold(self._release)
            _loss_watch.release(self._loss_watch)
            if self._gradcheck is not None:
                _monitor_tap.remove_listener("loss_graph", self._gradcheck.on_backward)
                self._gradcheck.close()
            if self._eval is not None:
                self._eval.close()
            _OPEN.discard(self)
        ended = ending(error, self._cur)
        if not self._roots and self._unattached_backwards:
            known["unattached_backwards"] = self._unattached_backwards
        if not self._roots and self._params_outside:
            known["parameters_outside_modules"] = self._params_outside
        if not self._roots and self._torch_func_model:
            known["torch_func_model"] = self._torch_func_model
        if self.no_grad_layers:
            known["no_grad_layers"] = dict(self.no_grad_layers)
        if self._grads.lr_by_hand and "ignite" not in sys.modules:  # ignite's PiecewiseLinear sets rates too
            known["lr_by_hand"] = True
        if self._skip_account:
            known["skipped_iterations"] = dict(self._skip_account)
        env = next((m for m in _RL_ENVIRONMENTS if m in sys.modules), None)
        if env is not None:  # a reinforcement-learning loop: the loss's targets move with the policy
            known["environment"] = env
        self._write_meta(final_step=self._cur, status=ended.get("status", "finished"), **self._validation_meta(),
                         **known)
        if ended:  # the run's own record of the crash, which the diagnosis reads (analysis._outcome)
            self._writer.set_meta(**ended)
        if self.diagnose:
            self._store_findings()
        release_writer(self._writer, **ended)

    def _release(self, t: torch.Tensor):
        """torch is about to swap ``t`` (capture/_swap): let go of it, and watch it again after
        the swap (a swapped parameter keeps its identity)."""
        mine = [p for p in self._params if p.ref() is t]
        if not mine:
            return None
        for p in mine:
            p.ref = _gone

        def restore() -> None:
            for p in mine:
                p.ref = weakref.ref(t)

        return restore

    def _probability_layers(self) -> list[dict]:
        """Layers that turn scores into probabilities (the loss-graph evidence names them)."""
        return [{"name": la.name, "type": la.type} for r in self._roots for la in r.layers
                if la.type in _loss_watch.PROBABILITY_MODULES]

    def _padding_indices(self) -> list[dict]:
        """Embeddings with a padding_idx (the loss-graph evidence of padding)."""
        out = []
        for r in self._roots:
            for la in r.layers:
                m = la.ref() if la.type in ("Embedding", "EmbeddingBag") else None
                if m is not None and getattr(m, "padding_idx", None) is not None:
                    out.append({"name": la.name, "padding_idx": int(m.padding_idx)})
        return out

    # ------------------------------------------------------------------ metadata
    def _write_meta(self, **values: Any) -> None:
        meta = dict(self._meta)
        meta.update(values)
        meta["every"] = self.every
        meta.setdefault("status", "running")
        self._meta = meta
        self._writer.set_meta(monitor=meta)

    def _validation_meta(self) -> dict:
        if self._eval is None:
            return {}
        try:
            return {"validation": dict(self._eval.summary(), leak=self._leak.summary())}
        except Exception:
            log.exception("trainguard monitor: summarising the validation pass failed")
            return {}

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


def _gone() -> None:
    """A Param's reference while torch swaps its tensor (see Monitor._release)."""
    return None


def _existing_meta(logdir: Path) -> dict:
    """The monitor metadata of a run being continued (a resumed training job), or nothing."""
    from trainguard.store import open_run

    try:
        with open_run(logdir) as run:
            return dict(run.meta.get("monitor") or {})
    except Exception:  # a new run, or one without a monitor
        return {}


_OPEN: weakref.WeakSet = weakref.WeakSet()

# Set by trainguard._wiring (the public ``trainguard.Monitor``) to ``trainguard.analysis.diagnose``.
DEFAULT_DIAGNOSE: Callable | None = None


@atexit.register
def _close_at_exit() -> None:
    for mon in list(_OPEN):
        with contextlib.suppress(Exception):
            mon.close(error=uncaught())
