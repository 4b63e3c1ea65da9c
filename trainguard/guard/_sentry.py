"""The sentry: each step's loss and global gradient norm, read on the host one step late.

Per step it keeps the scalar ``backward()`` ran on (or the one given to ``loop.report``; with
``optimizer.step(closure)``, the closure's first call's: LBFGS calls it again on moved weights and
line-search trial points, whose losses count only when they are not finite) and,
before each ``optimizer.step()``, the norms of that optimizer's gradients (one fused
``_foreach_norm``), all as 0-d tensors on their device. On an accelerator, when the step ends,
they are reduced into one small vector copied into a pinned host buffer without waiting. The
guard reads it when the *next* step ends, by which time the copy has long landed: no
host-device sync per step. On CPU the step is read when it ends (nothing waits). The pass over the gradients is the whole cost
(``benchmarks/bench_guard.py``).
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.capture import StepWatch
from trainguard.capture._layer_stats import sparse_values
from trainguard.capture._monitor_tap import pass_nonfinite_norms

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
    losses: list  # 0-d CPU tensors (their mean is the loss) or one Python float; [] when unseen
    norms: list  # 0-d CPU tensors whose root-sum-square is the gradient norm; [] when unseen
    later: list = field(default_factory=list)  # losses of a closure's later calls (LBFGS): only a non-finite one counts
    host: torch.Tensor | None = None  # accelerators: [loss?, grad_norm?], copied to pinned memory
    event: Any = None
    has_loss: bool = False
    has_grad: bool = False


def _on_cpu(ts: list) -> bool:
    return all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in ts)


class Sentry:
    """Watches the steps between :meth:`start` and :meth:`stop`; see the module docstring.

    On CPU nothing is combined on the device: reading a CPU tensor is no sync, so the 0-d
    tensors themselves wait for the next step and are combined on the host then. On an
    accelerator they are reduced to one small vector and copied to pinned memory, not waited for.
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._later: list[torch.Tensor] = []
        self._watch = StepWatch(self._on_loss, self._before_optimizer, self._later.append)
        self._reported: Any = None
        self._raised = False  # an op of this step raised on NaN/Inf and gave NaN instead (_raising)
        self._norms: list[torch.Tensor] = []
        self._pending: deque[_Pending] = deque()
        self._params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._fresh: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> no state when first seen
        self._ring: list[torch.Tensor] = []
        self._ring_next = 0

    def start(self) -> None:
        self._watch.start()
        pass_nonfinite_norms(True)

    def stop(self) -> None:
        pass_nonfinite_norms(False)
        self._watch.stop()
        self.clear()
        self._ring = []

    def clear(self) -> None:
        """Forget everything not read yet (after a rewind, those steps did not happen)."""
        self._losses, self._norms, self._reported = [], [], None
        self._raised = False
        self._later.clear()
        self._pending.clear()

    # -- what training does ------------------------------------------------------------------

    def report(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(-1)[0] if loss.numel() else torch.tensor(float("nan"))
        else:
            loss = float(loss)
        self._reported = loss

    def raised(self) -> None:
        """An op of this step raised on NaN/Inf (``_raising``): the step's loss is NaN, whatever
        reached ``backward()`` (an index 0 in place of a multinomial draw may leave it finite)."""
        self._raised = True

    def step_nonfinite(self) -> bool:
        """Whether a loss or a gradient norm the running step showed so far is NaN/Inf (a sync:
        only after the loop body raised, see ``Guard.guarded``)."""
        seen = [self._reported] if self._reported is not None else self._losses
        for v in [*seen, *self._norms]:
            if isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all()):
                return True
            if isinstance(v, float) and not math.isfinite(v):
                return True
        return False

    def _on_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss)

    def _before_optimizer(self, opt: torch.optim.Optimizer) -> None:
        # a sparse gradient (nn.EmbeddingBag(sparse=True)): its values, as the monitor reads them
        grads = [g if g.layout == torch.strided else sparse_values(g)
                 for p in self._params_of(opt) if (g := p.grad) is not None]
        grads = [g for g in grads if g is not None]
        if not grads:
            return
        with torch.no_grad():
            first = grads[0].device
            if all(g.device == first for g in grads):
                norms = torch._foreach_norm(grads)  # one fused pass: the cost of the sentry
            else:  # model parallel: per device, gathered where the first gradient lives
                by_device: dict[torch.device, list[torch.Tensor]] = {}
                for g in grads:
                    by_device.setdefault(g.device, []).append(g)
                norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs))).to(first, non_blocking=True)
                         for gs in by_device.values()]
            if first.type == "cpu":
                self._norms.extend(norms)
            else:
                self._norms.append(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])))

    def _params_of(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        sig = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self._params.get(opt)
        if hit is None:
            self._fresh[opt] = not opt.state
        if hit is None or hit[0] != sig:
            hit = (sig, [p for g in opt.param_groups for p in g["params"]])
            self._params[opt] = hit
        return hit[1]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer seen stepping, in the order first seen."""
        return list(self._params.keys())

    def fresh(self, opt: torch.optim.Optimizer) -> bool:
        """``opt`` had no state when it first stepped: made inside the loop."""
        return bool(self._fresh.get(opt, False))

    # -- the step boundary -------------------------------------------------------------------

    def end_step(self, step: int) -> None:
        """The step's body ended: keep what it showed; on an accelerator start the copy to the host."""
        reported, losses, norms = self._reported, self._losses, self._norms
        self._reported, self._losses, self._norms = None, [], []
        later = self._later[:]
        self._later.clear()
        if reported is not None:
            losses = [reported]
        if self._raised:
            self._raised, losses = False, [float("nan")]
        p = _Pending(step, losses, norms, later if losses else [], has_loss=bool(losses), has_grad=bool(norms))
        if not (_on_cpu(losses) and _on_cpu(norms) and _on_cpu(later)):
            self._to_device_vector(p)
        self._pending.append(p)

    def _to_device_vector(self, p: _Pending) -> None:
        from trainguard.capture import unrecorded

        with torch.no_grad(), unrecorded():
            parts = []
            if p.losses:
                ls = [v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in p.losses]
                loss = ls[0] if len(ls) == 1 else torch.stack([v.float() for v in ls]).mean()
                loss = loss.float().reshape(())
                if p.later:  # a non-finite later evaluation is the step's loss; their sum keeps it so
                    lt = torch.stack([v.float().to(loss.device) for v in p.later])
                    loss = torch.where(torch.isfinite(lt).all(), loss, lt.sum())
                parts.append(loss)
            if p.norms:
                gn = p.norms[0] if len(p.norms) == 1 else torch.linalg.vector_norm(torch.stack(p.norms))
                parts.append(gn.float())
            device = next(t.device for t in parts if t.device.type != "cpu")
            vec = torch.stack([t.to(device, non_blocking=True) for t in parts])
            p.host, p.event = self._to_host(vec)
        p.losses, p.norms, p.later = [], [], []

    def _to_host(self, vec: torch.Tensor) -> tuple[torch.Tensor, Any]:
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
        copy: the guard does that only when it must (before a snapshot or a save, in a replay).
        A step whose values are CPU tensors is read whatever ``before`` says: that waits for
        nothing, and a step left unread lets the next one run on what it broke (gpytorch's next
        forward raises ``NanError`` on the NaN weights before the guard could rewind)."""
        out = []
        while self._pending and (before is None or self._pending[0].step < before or self._pending[0].host is None):
            p = self._pending.popleft()
            if p.host is not None:
                p.event.synchronize()
                vals = p.host.tolist()
                loss = vals.pop(0) if p.has_loss else None
                grad = vals.pop(0) if p.has_grad else None
            else:
                loss = statistics.fmean(float(v) for v in p.losses) if p.losses else None
                bad = [v for v in map(float, p.later) if not math.isfinite(v)]
                if bad and loss is not None and math.isfinite(loss):
                    loss = bad[0]
                grad = math.sqrt(math.fsum(float(n) ** 2 for n in p.norms)) if p.norms else None
            out.append(StepValues(p.step, loss, grad))
        return out

    @property
    def unread(self) -> int:
        return len(self._pending)
