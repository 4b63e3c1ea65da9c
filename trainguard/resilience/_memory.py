"""An in-memory snapshot of a TrainState: what the guard rewinds to between checkpoints.

The same capture a checkpoint makes (every object's ``state_dict()``, every RNG, the data
position), kept in host memory instead of written to disk: tensors go into the reusable host
buffers of the asynchronous checkpoint's staging (:class:`~trainguard.resilience._engine.Stager`),
everything else through the checkpoint codec, so nothing is pickled and a snapshot holds
exactly what a checkpoint would.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.resilience import _engine
from trainguard.resilience._codec import Encoder, decode
from trainguard.resilience._grads import optimizer_params
from trainguard.resilience._state import TrainState


class MemorySnapshot:
    """One copy of a :class:`TrainState` in host memory; :meth:`take` replaces the previous one.

    ``take(state)`` copies every tensor into host buffers kept between takes (pinned, and with
    ``wait=False`` not waited for, on accelerators) and encodes the rest. ``restore(state)``
    copies the values back into the live tensors (parameters and optimizer moments keep their
    identity, so nothing holds the snapshot's buffers afterwards) and loads every object, the
    RNG last, exactly as a checkpoint restore does. ``step``, ``epoch`` and ``nbytes`` (host
    memory held by the tensors) describe the snapshot held.

    Example::

        snap = MemorySnapshot()
        snap.take(state)          # state.step == 100
        ...                       # training goes on, or goes wrong
        snap.restore(state)       # state.step == 100 again, bitwise
    """

    def __init__(self) -> None:
        self._stager = _engine.Stager()
        self._shared: dict[str, Any] | None = None
        self._local: dict[str, Any] | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._grads: list[tuple[torch.Tensor, str | None]] = []  # each parameter, its gradient's key
        self.step: int | None = None
        self.epoch: int | None = None
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"MemorySnapshot(step={self.step}, nbytes={self.nbytes})"

    @property
    def taken(self) -> bool:
        return self._shared is not None

    def take(self, state: TrainState, *, wait: bool = True, grads: bool = False) -> None:
        """Snapshot ``state`` now; later updates never reach the snapshot. ``grads``: also keep
        the gradients of the optimizers' parameters (an accumulation window under way); without
        it, :meth:`restore` leaves no gradient behind, as a checkpoint's restore in a new process."""
        captured = state.capture()
        enc = Encoder()
        shared = {n: enc.encode(v, n) for n, v in captured.shared.items()}
        local = {n: enc.encode(v, f"local/{n}") for n, v in captured.local.items()}
        tensors = dict(enc.tensors)
        self._grads = []
        for i, p in enumerate(optimizer_params(state)):
            key = f"grad/{i}" if grads and p.grad is not None else None
            if key is not None:
                tensors[key] = p.grad.detach()
            self._grads.append((p, key))
        self._tensors = self._stager.stage(tensors, wait=wait)
        self._shared, self._local = shared, local
        self.step, self.epoch = captured.step, captured.epoch
        self.nbytes = sum(t.numel() * t.element_size() for t in self._tensors.values())

    def restore(self, state: TrainState) -> None:
        """Put ``state`` back to the snapshot, in place."""
        if self._shared is None or self._local is None:
            raise RuntimeError("no snapshot taken yet")
        self._stager.wait()
        enc = Encoder()
        current = state.capture()
        for n, v in current.shared.items():
            enc.encode(v, n)
        for n, v in current.local.items():
            enc.encode(v, f"local/{n}")
        live = enc.tensors
        targets: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for key, saved in self._tensors.items():
                cur = live.get(key)
                if (cur is not None and cur.shape == saved.shape and cur.dtype == saved.dtype
                        and not _engine._is_dtensor(cur)):
                    cur = cur.detach()
                    cur.copy_(saved, non_blocking=cur.device.type == "cuda")
                    targets[key] = cur
                else:
                    # e.g. optimizer moments the snapshot has and the live optimizer lacks: a
                    # fresh tensor, so that training never writes into the snapshot's buffers.
                    device = cur.device if cur is not None else saved.device
                    targets[key] = saved.to(device, copy=True)
            for p, key in self._grads:
                # The gradients the snapshot's step had: none, or an accumulation window's. Never
                # the ones of the steps rewound, which may hold the NaN the rewind is about.
                saved = self._tensors.get(key) if key is not None else None
                if saved is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == saved.shape and p.grad.dtype == saved.dtype:
                    p.grad.copy_(saved)
                else:
                    p.grad = saved.to(p.device, copy=True)
        shared = {n: decode(v, targets) for n, v in self._shared.items()}
        local = {n: decode(v, targets) for n, v in self._local.items()}
        state.apply(shared, local, step=int(self.step or 0), epoch=int(self.epoch or 0))

    def release(self) -> None:
        """Free the host buffers."""
        self._stager.release()
        self._shared = self._local = None
        self._tensors = {}
        self._grads = []
        self.step = self.epoch = None
        self.nbytes = 0
