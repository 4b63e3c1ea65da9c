"""The sentry: each step's loss and global gradient norm, read on the host one step late.

Per step it keeps the scalar ``backward()`` ran on (or the one given to ``loop.report``) and,
before each ``optimizer.step()``, the norm of that optimizer's gradients, all as 0-d tensors on
their device. When the step ends they are stacked into one small vector and, on an accelerator,
copied into a pinned host buffer without waiting. The guard reads that vector when the *next*
step ends, by which time the copy has long landed: no host-device sync per step. A few tiny
device ops per step are the whole cost (``benchmarks/bench_guard.py``).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.capture import StepWatch

# Pinned host buffers the step vectors are copied into on accelerators, reused in turn (the
# guard reads one step late, so two are in use at most).
_RING = 4


@dataclass(frozen=True)
class StepValues:
    """What the sentry saw of one step, on the host: None where it saw nothing."""

    step: int
    loss: float | None
    grad_norm: float | None


@dataclass
class _Pending:
    step: int
    values: torch.Tensor  # [loss?, grad_norm?] on the host once ``event`` completed
    event: Any
    has_loss: bool
    has_grad: bool
    host_loss: float | None  # a loss reported as a Python number


class Sentry:
    """Watches the steps between :meth:`start` and :meth:`stop`; see the module docstring."""

    def __init__(self) -> None:
        self._watch = StepWatch(self._on_loss, self._before_optimizer)
        self._losses: list[torch.Tensor] = []
        self._reported: Any = None
        self._norms: list[torch.Tensor] = []
        self._pending: deque[_Pending] = deque()
        self._params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._ring: list[torch.Tensor] = []
        self._ring_next = 0

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()
        self.clear()
        self._ring = []

    def clear(self) -> None:
        """Forget everything not read yet (after a rewind, those steps did not happen)."""
        self._losses, self._norms, self._reported = [], [], None
        self._pending.clear()

    # -- what training does ------------------------------------------------------------------

    def report(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(-1)[0] if loss.numel() else torch.tensor(float("nan"))
        else:
            loss = float(loss)
        self._reported = loss

    def _on_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss)

    def _before_optimizer(self, opt: torch.optim.Optimizer) -> None:
        grads = [g for p in self._params_of(opt) if (g := p.grad) is not None and not g.is_sparse]
        if not grads:
            return
        with torch.no_grad():
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            norms = []
            first = grads[0].device
            for device, gs in by_device.items():
                n = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32)))
                norms.append(n if device == first else n.to(first, non_blocking=True))
            self._norms.append(norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms)))

    def _params_of(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        sig = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self._params.get(opt)
        if hit is None or hit[0] != sig:
            hit = (sig, [p for g in opt.param_groups for p in g["params"]])
            self._params[opt] = hit
        return hit[1]

    # -- the step boundary -------------------------------------------------------------------

    def end_step(self, step: int) -> None:
        """The step's body ended: stack what it showed and start the copy to the host."""
        from trainguard.capture import unrecorded

        reported, losses, norms = self._reported, self._losses, self._norms
        self._reported, self._losses, self._norms = None, [], []
        host_loss = reported if isinstance(reported, float) else None
        loss = reported if isinstance(reported, torch.Tensor) else None
        if loss is None and host_loss is None and losses:
            loss = losses[0] if len(losses) == 1 else torch.stack([v.float() for v in losses]).mean()
        parts = []
        with torch.no_grad(), unrecorded():
            if loss is not None:
                parts.append(loss.float().reshape(()))
            if norms:
                gn = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
                parts.append(gn if not parts or gn.device == parts[0].device else gn.to(parts[0].device))
            if not parts:
                values, event = torch.empty(0), None
            else:
                vec = parts[0].reshape(1) if len(parts) == 1 else torch.stack(parts)
                values, event = self._to_host(vec)
        self._pending.append(_Pending(step, values, event, loss is not None, bool(norms), host_loss))

    def _to_host(self, vec: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if vec.device.type == "cpu":
            return vec, None
        if not self._ring:
            self._ring = [torch.empty(2, dtype=torch.float32, pin_memory=True) for _ in range(_RING)]
        if len(self._pending) >= _RING:
            # Every ring buffer may still be unread (never with the one-step lag): a buffer of its own.
            buf = torch.empty(vec.numel(), dtype=torch.float32, pin_memory=True)
        else:
            # The slot after the newest pending one was read already: at most _RING - 1 are pending.
            buf = self._ring[self._ring_next][: vec.numel()]
            self._ring_next = (self._ring_next + 1) % _RING
        buf.copy_(vec, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return buf, event

    def read(self, *, before: int | None) -> list[StepValues]:
        """The values of the steps ended so far with a step number below ``before`` (all when
        None), oldest first, removed from the pending list. Reading the newest step waits for its
        copy: the guard does that only when it must (before a snapshot or a save, in a replay)."""
        out = []
        while self._pending and (before is None or self._pending[0].step < before):
            p = self._pending.popleft()
            if p.event is not None:
                p.event.synchronize()
            vals = p.values.tolist()
            loss = vals.pop(0) if p.has_loss else p.host_loss
            grad = vals.pop(0) if p.has_grad else None
            out.append(StepValues(p.step, loss, grad))
        return out

    @property
    def unread(self) -> int:
        return len(self._pending)
