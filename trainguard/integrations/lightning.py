"""trainguard for PyTorch Lightning: ``TrainguardCallback``.

Example::

    import lightning as L
    from trainguard.integrations.lightning import TrainguardCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[TrainguardCallback("runs/exp1", record=True)])
    trainer.fit(model, datamodule=dm)          # then: trainguard report runs/exp1

Steps are ``trainer.global_step`` (optimizer steps, so accumulation and a resumed ``ckpt_path``
count as Lightning counts); the gradients are read in ``on_before_optimizer_step``, after the
backward of the last accumulated batch and before clipping, so the gradient norm is the one
``lightning.pytorch.utilities.grad_norm`` reports there; each rank writes ``logdir/rank-K``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError:
        raise ImportError(
            "trainguard.integrations.lightning needs Lightning: pip install 'trainguard[lightning]' "
            "(next to the torch you have)"
        ) from None

from trainguard.integrations._session import Session

__all__ = ["TrainguardCallback"]


class TrainguardCallback(Callback):
    """Record and monitor a Lightning run with the trainer's own step, loss and rank.

    ``logdir``: the run directory (``logdir/rank-K`` per rank when ``world_size > 1``); a fit
    resumed from a checkpoint (``trainer.fit(..., ckpt_path=...)``) appends to the run there.
    ``record``: record every op (``trainguard.record``, summary ``mode``); ``monitor``: the health
    monitor (per-step loss, gradient norm, learning rates; layer statistics every ``every``
    steps; findings when training ends); ``check_numerics``: stop at the first op that makes a
    NaN/Inf, naming it. ``guard`` is reserved for ``trainguard.Guard`` (not in this version:
    passing one is an error).
    """

    def __init__(self, logdir: str | os.PathLike, *, record: bool = False, mode: str = "full_health",
                 monitor: bool = True, every: int = 10, guard: Any = None, check_numerics: bool = False):
        super().__init__()
        self._session = Session(logdir, record=record, mode=mode, monitor=monitor, every=every, guard=guard,
                                check_numerics=check_numerics)

    @classmethod
    def _driving(cls, monitor: Any) -> TrainguardCallback:
        """A callback that only drives ``monitor`` (opened by ``trainguard run --monitor``)."""
        self = cls.__new__(cls)
        Callback.__init__(self)
        self._session = Session(attached=monitor)
        return self

    @property
    def monitor(self):
        """The run's :class:`trainguard.Monitor` while training (None before and after)."""
        return self._session.monitor

    @property
    def logdir(self):
        """The directory this rank writes to, once training started."""
        return self._session.run_dir or self._session.logdir

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer, pl_module) -> None:
        self._session.start(pl_module, step=trainer.global_step, rank=trainer.global_rank,
                            world_size=trainer.world_size, resumed=trainer.ckpt_path is not None)

    def on_train_start(self, trainer, pl_module) -> None:
        self._session.step(trainer.global_step)  # restored from the checkpoint after on_fit_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._session.step(trainer.global_step)
        # Lightning calls training_step, not the module: its mode and input are taken here.
        self._session.forward_started(pl_module, batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._session.gradients_ready(optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._session.step(trainer.global_step)  # moved on after an optimizer step: that step is done

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._session.checkpoint_saved()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._session.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._session.close(error=exception)
