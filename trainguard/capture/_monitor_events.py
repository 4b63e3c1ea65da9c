"""What the monitor does when training calls ``backward()``, clips gradients, runs the optimizer
or ends a step: the part of :class:`~trainguard.capture._monitor.Monitor` that listens to the
shared clock (:mod:`._steps`) and to the taps of :mod:`._monitor_tap` and :mod:`._amp_tap`.

Every method here runs inside the training loop; an exception is logged, never raised into
training (observing training never kills it).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch

from trainguard.capture import (
    _amp_tap,
    _compile_monitor,
    _loss_watch,
    _monitor_buffers,
    _monitor_tap,
    _skips,
    _steps,
)
from trainguard.capture._monitor_grads import pending_refs, replaced, used
from trainguard.capture._monitor_model import rebind

log = logging.getLogger("trainguard.monitor")

# With a large ``every``, per-step scalars still reach the run (for a live view) after this many
# steps, or once this many seconds passed since the last shipment, so that a process killed
# between recording steps loses seconds of them, not steps (slow steps, a resumed run's curve):
# one more batched, non-blocking copy, never one per step.
MAX_BUFFERED_STEPS = 50
SHIP_SECONDS = 2.0
# Runs of equal micro-batch counts per step kept in the run's metadata (see _note_window).
LOSS_WINDOW_RUNS = 64


class EventsMixin:
    """The monitor's listeners for backward, clipping, the optimizer step and GradScaler, and the
    start and end of each step."""

    @staticmethod
    def _no_record():
        return _monitor_tap.quiet()

    # ------------------------------------------------------------------ backward and clipping
    def _before_backward(self, tensors: Any) -> None:
        # The tensors backward() was called on, graph attached (the "backward" event's loss is detached).
        if (self._auto and not self._adopt_tried and not self._closed
                and isinstance(tensors, torch.Tensor) and tensors.grad_fn is not None):
            self._adopt_from_loss(tensors)
        if (self._recording and self._roots and not self._closed and self._targets_read != self._cur
                and isinstance(tensors, torch.Tensor) and tensors.grad_fn is not None):
            self._read_soft_targets(tensors)

    def _read_soft_targets(self, loss: torch.Tensor) -> None:
        """At a recording step's first backward, the entropies of the loss's soft targets (a teacher's
        probabilities), reduced on their device and shipped with the step's statistics."""
        self._targets_read = self._cur
        try:
            with self._no_record(), torch.no_grad():
                targets = _loss_watch.soft_targets(loss)
                if targets:
                    self._out.stats.append((("l", "<loss>", "soft_target", _loss_watch.TARGET_STATS, self._cur),
                                            _loss_watch.target_entropies(targets)))
        except Exception:  # observing training never kills training
            log.exception("trainguard: reading the loss's soft targets failed")

    def _on_backward(self, loss: torch.Tensor | None) -> None:
        # The training forward is over: a layer run with gradients off from now on belongs to an
        # evaluation (an evaluator calling the model that the loss module found as the root holds),
        # not to a no_grad block inside that forward (see _on_layer).
        self._root_grad = False
        if not self._roots:
            self._unattached_backwards += 1
        self._maybe_end_manual_step()  # a backward after a completed update starts the next step
        self._backward_step = self._cur
        if self._eval is not None:
            self._eval.on_backward()
        if _steps.clock.closure_call > 1:
            return  # a closure called again (LBFGS) evaluates the moved weights: not the step's loss
        if loss is not None and self.capture_loss and not self._user_gives_loss and self._roots:
            if self._losses_at_update and not self._separate_losses:
                # A backward after an optimizer's update in the same step, when a loss came before
                # that update: separate objectives, each with its optimizer (a GAN's), not one loss;
                # unless that same optimizer updates next (see _after_optimizer).
                self._pending_separate = True
            self._auto_losses.append(loss)
            self._auto_divisors.append(_monitor_tap.accumulation_divisor())

    def _after_backward(self) -> None:
        if self._closed or not self._roots or (self._grads.saw_optimizer and not self._grads_replaced):
            return  # with an optimizer, the gradients are read once, right before the update
        if _steps.clock.closure_call:
            # Inside optimizer.step(closure) whose pre-hook ran before the model was found (model=None,
            # first forward in the closure): that optimizer reads the gradients when the closure
            # returns and ends the step; LBFGS's further closure calls must not end steps.
            return
        with self._no_record():
            manual = not self._grads.saw_optimizer
            self._grads.read(self._params, self._cur, self._recording, tentative=True,
                             snapshot=self.updates and manual)
            if manual:  # what the first update tells replaced gradients by (see _before_optimizer)
                self._read_refs = pending_refs(self._params)
                if _steps.clock.driver is None:
                    self._pending_end = self._read_refs

    def _on_clip(self, params: list, setting: tuple[str, object] | None = None) -> None:
        if self._closed or not self._roots:
            return
        if setting is not None:
            self._note_clipping(*setting)
        if self._grads.saw_optimizer:
            ids = {id(t) for t in params}
            mine = [p for p in self._params if p.ref() is not None and id(p.ref()) in ids]
        else:
            mine = self._params  # complete since the last backward, and unscaled by now (GradScaler.unscale_)
        if mine:
            with self._no_record():
                self._grads.read(mine, self._cur, self._recording)

    def _note_clipping(self, function: str, threshold: object) -> None:
        """Store how the loop clips (the diagnosis must not advise clipping to a loop that does);
        written when it changes, not per step."""
        known = self._meta.get("clipping")
        now = _monitor_tap.clipping_record(function, threshold, known["first_step"] if known is not None else self._cur)
        if known is not None and known["function"] == function and known["value"] == now["value"]:
            return
        self._write_meta(clipping=now)

    def _maybe_end_manual_step(self) -> None:
        refs = self._pending_end
        if refs is None:
            return
        if self._grads.saw_optimizer or _steps.clock.driver is not None:
            self._pending_end = None
        elif used(refs):
            self._pending_end = None
            _steps.advance()

    # ------------------------------------------------------------------ optimizer
    def _before_optimizer(self, opt: torch.optim.Optimizer, has_closure: bool) -> None:
        try:
            params = self._grads.params_in(opt, self._params)
            if not params:
                return
            first = not self._grads.saw_optimizer
            self._grads.saw_optimizer = True
            self._pending_end = None
            if (first and not has_closure and self._grads.tentative and self._read_refs is not None
                    and replaced(self._read_refs) and not _amp_tap.scaling()):
                self._grads_replaced = True
                self._write_meta(gradients_replaced=True)
            self._read_refs = None  # weak references to gradients stop torch.utils.swap_tensors
            if len(self._grads.trainable) < len(self._params):
                self._grads.trainable.update(id(p) for p in params if (t := p.ref()) is not None and t.requires_grad)
            with self._no_record():
                self._grads.stale_applied(params)
                if self._grads_replaced:
                    self._grads.settle()  # read after backward(), before they were replaced
                elif not has_closure:  # a closure has not run the backward yet: read when it returns
                    self._grads.read(params, self._cur, self._recording)
                if self._recording and self.updates:
                    self._grads.snapshot(opt, params)
        except Exception:
            log.exception("trainguard monitor: optimizer pre-hook failed")

    def _after_optimizer(self, opt: torch.optim.Optimizer) -> None:
        try:
            if not self._grads.params_in(opt, self._params):
                return
            if self._last_train_fwd is not None:
                n_train, n_total, root_training = self._last_train_fwd
                if n_total and not n_train and not root_training:
                    self.modes["train_steps_in_eval"] += 1
                    if self.modes["first_train_step_in_eval"] is None:
                        self.modes["first_train_step_in_eval"] = self._cur
                self._last_train_fwd = None
            if self._pending_separate:
                self._pending_separate = False
                if self._update_opt is not None and self._update_opt() is opt:
                    # The same optimizer updated twice in one step: iterations of one objective (in
                    # pytorch/examples mnist_forward_forward, the next layer's optimizer taking over
                    # ending steps, which shares its first update's step). The step's loss is this
                    # iteration's, not the sum of two.
                    self._auto_losses = self._auto_losses[self._losses_at_update:]
                    if not self._meta.get("objectives_in_sequence"):
                        self._write_meta(objectives_in_sequence=self._cur)  # each layer's loss from here
                else:
                    self._confirm_separate()
            self._losses_at_update = len(self._auto_losses)
            self._update_opt = weakref.ref(opt)
            with self._no_record():
                self._grads.after(opt, self._cur)
        except Exception:
            log.exception("trainguard monitor: optimizer post-hook failed")

    def _confirm_separate(self) -> None:
        if not self._separate_losses:
            self._separate_losses = True
            self._write_meta(separate_losses=True)

    def _on_scaler_step(self, opt: torch.optim.Optimizer, step: int, scale: Any, ran: bool) -> None:
        if self._closed or not self._grads.params_in(opt, self._params):
            return
        values = {"amp/skipped": 0.0 if ran else 1.0}
        if scale is not None:
            values["amp/scale"] = scale
        if step == self._cur:
            self._amp.update(values)
        else:  # the update ended the step already; its scalars wait for late values (see Shipper.ship)
            self._out.scalars.setdefault(step, {}).update(values)

    def _on_skip(self, skip) -> None:
        """The loop skipped an iteration itself (capture/_skips): its loss was non-finite and no
        backward() followed. The step gets ``skipped`` = 1 and ``skipped_loss`` (the value its
        check saw); the run's metadata counts them, with the first one's step, value and line."""
        if self._closed:
            return
        values = {"skipped": 1.0, "skipped_loss": skip.loss}
        if skip.step == self._cur:
            self._skipped.update(values)
        else:  # the clock moved on since the check (a guard's loop aligns it first)
            self._out.scalars.setdefault(skip.step, {}).update(values)
        sk = self._skip_account = _skips.count(self._skip_account, skip)
        if sk["count"] == 1:  # the rest when the monitor closes: one metadata write, not one per skip
            self._write_meta(skipped_iterations=dict(sk))

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

    def _on_restore(self, step: int) -> None:
        """A checkpoint of ``step`` was restored: the run's curves from ``step`` on are replaced by
        the steps that run again (what is buffered is written first, so the drop covers it)."""
        if self._closed:
            return
        with self._no_record():
            self._out.ship()
            self._out.resolve(wait=True)
        self._writer.forget_steps(step)
        if self._skip_account:  # iterations skipped from there run again: counted again if skipped again
            self._skip_account = _skips.forget(self._skip_account, step)
            self._write_meta(skipped_iterations=self._skip_account)

    def _rebind(self) -> None:
        moved = rebind(self._params)
        if moved:
            self._grads.rebound(moved)

    def _on_save(self, step: int) -> None:
        """A checkpoint of ``step`` is about to be saved: write the steps buffered so far, so that a
        process killed after the save keeps the curve the checkpoint covers (a resume starts after it)."""
        if self._closed:
            return
        try:
            self.flush()
        except Exception:
            log.exception("trainguard monitor: writing before a checkpoint failed")

    def _begin_step(self, step: int) -> None:
        if _compile_monitor.watch(self):  # Dynamo is imported: something may be compiled
            self._hooks_pinned = True
        self._recording = step % self.every == 0
        self._set_layer_hooks(self._recording or self._hooks_pinned)
        self._grads.unhook_params()
        if self._recording:
            self._rebind()
            self._grads.hook_params(self._params, lambda: self._cur)
        # Roots are looked for while none is known, and at recording steps (a model built later);
        # once Dynamo compiles, always: it guards on whether global hooks exist.
        self._set_discovery(self._auto and (self._recording or not self._roots or self._hooks_pinned))

    def _finish_step(self, s: int) -> None:
        # A step in which nothing trained (a framework's clock jumped past it, evaluation only)
        # records no weights: they would pass for that step's, or for the initial ones.
        trained = self._backward_step == s or bool(self._auto_losses) or s in self._manual_loss or self._grads.active
        recording = self._recording and trained
        values: dict[str, Any] = {}
        if s in self._manual_loss:
            values["loss"] = self._manual_loss.pop(s)
            self._note_window(s, 0)  # the user's own loss: no window to rescale
        elif self._auto_losses:
            # Micro-batches of gradient accumulation each backward loss / k: the step's loss is their sum.
            ls = self._auto_losses
            dtype = torch.float64 if any(v.dtype == torch.float64 for v in ls) else torch.float32
            values["loss"] = ls[0] if len(ls) == 1 else torch.stack([v.to(dtype) for v in ls]).sum()
            k = self._auto_divisors[0] if self._auto_divisors else 1
            window = len(ls)
            if k > 1 and all(d == k for d in self._auto_divisors):
                window = k
                if len(ls) != k:
                    # accelerate divided each by k, also in a step of fewer micro-batches: their mean
                    values["loss"] = values["loss"] * (k / len(ls))
            elif len(ls) > 1 and self._fwd_cached == len(ls) == self._fwd_grad:
                window = 0  # each backward's loss was the step's: their mean is, whatever their number
                # Contrastive accumulation with cached features (open_clip's --accum-freq, GradCache):
                # k no-grad forwards cache every micro-batch's features, then per micro-batch a
                # forward with gradients and a backward of the loss over all k micro-batches (its
                # fresh features, the others' cached): each backward's loss is the step's loss.
                values["loss"] = values["loss"] / len(ls)
                # those no-grad forwards in train mode were the training step's, not evaluations
                self.modes["eval_forwards"] -= self._cached_modes[0]
                self.modes["eval_forwards_in_train"] -= self._cached_modes[1]
                if not self.modes["eval_forwards_in_train"]:
                    self.modes["first_eval_forward_in_train"] = None
                if not self._meta.get("cached_features"):
                    self._write_meta(cached_features=s)
            self._note_window(s, window)
        if recording:
            self._rebind()  # a forward may have assigned new Parameters (an EMA codebook's)
            self._add_stand_ins()
            _monitor_buffers.read([b for r in self._roots for b in r.buffers], s, self._out.consts)
        values.update(self._grads.finish(self._params, s, recording))
        values.update(self._amp)
        values.update(self._skipped)
        if self._eval is not None:
            values.update(self._eval.take())
        if values:
            self._out.scalars[s] = values
        if recording and not self._initial_written and self._params:
            # Weights measured before the first update of a fresh run are the initial ones; after a
            # resume (or with optimizer state already there) they are not, and no rule may say so.
            self._initial_written = True
            self._write_meta(weights_initial=bool(s == 0 and not self._grads.optimizer_had_state),
                             first_recording=s)
        if self._recording:
            self._time.finish(s)
        if self._code_rows:
            if recording:
                self._ship_codes(s)
            self._code_rows = []
        if self._pending_separate:  # no update followed the backward that came after one
            self._confirm_separate()
        self._pending_separate = False
        self._auto_losses = []
        self._auto_divisors = []
        self._fwd_grad = self._fwd_cached = 0
        self._cached_modes = [0, 0]
        self._losses_at_update = 0
        self._update_opt = None
        self._amp = {}
        self._skipped = {}
        self._pending_end = None
        self._chan_out = {}
        self._codes_out = {}
        self._inputs_seen = set()
        self._input_wanted = {}
        now = time.monotonic()
        if self._recording or len(self._out.scalars) > MAX_BUFFERED_STEPS or now - self._shipped_at >= SHIP_SECONDS:
            self._out.ship(keep=s)
            self._shipped_at = now
        self._out.resolve(wait=False)
        if self.modes != self._modes_written or len(self._order) != self._order_written:
            self._modes_written = dict(self.modes)
            self._order_written = len(self._order)
            self._write_meta(modes=dict(self.modes), order=list(self._order))
        if self.no_grad_layers != self._no_grad_written:
            self._no_grad_written = dict(self.no_grad_layers)
            self._write_meta(no_grad_layers=dict(self.no_grad_layers))

    def _note_window(self, s: int, n: int) -> None:
        """Keep how many micro-batch losses step ``s`` summed, as runs of equal counts in the run's
        metadata (``loss_windows``: [[first step, count], ...]; 0: a count not to rescale). Gradient
        accumulation written by hand with a short window (accelerate's nlp_example.py steps on
        ``step % k == 0``: its first window holds one micro-batch, each loss divided by k) sums part
        of a step's loss: the analysis scales such steps to the usual window."""
        windows = self._meta.get("loss_windows")
        windows = list(windows) if isinstance(windows, list) else []
        if windows and (windows[-1][1] == n or len(windows) >= LOSS_WINDOW_RUNS):
            return
        if len(windows) == LOSS_WINDOW_RUNS - 1:
            n = 0  # counts changing every few steps: no usual window to scale to, from here on
        self._write_meta(loss_windows=windows + [[s, n]])
