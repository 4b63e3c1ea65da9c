"""trainguard for the Hugging Face ``Trainer``: ``TrainguardCallback``.

Example::

    from transformers import Trainer, TrainingArguments
    from trainguard.integrations.transformers import TrainguardCallback

    trainer = Trainer(model=model, args=TrainingArguments("out", max_steps=1000), train_dataset=ds,
                      callbacks=[TrainguardCallback("runs/exp1")])
    trainer.train()                             # then: trainguard report runs/exp1

Steps are ``state.global_step`` (optimizer steps: ``gradient_accumulation_steps`` micro-batches
make one, and ``resume_from_checkpoint`` continues the count); the loss of a step is the sum of
its micro-batches' losses, as the Trainer logs it; the gradient norm is read before
``max_grad_norm`` clips it, as the Trainer logs ``grad_norm``; each process writes
``logdir/rank-K`` (``args.process_index``).
"""

from __future__ import annotations

import os
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "trainguard.integrations.transformers needs transformers: pip install 'trainguard[transformers]' "
        "(next to the torch you have)"
    ) from None

from trainguard.integrations._auto import find_trainer, loss_holding_model
from trainguard.integrations._session import Session, resumed_at

__all__ = ["TrainguardCallback"]


def note_trainer(monitor: Any, trainer: Any) -> None:
    """Tell ``monitor`` how ``trainer`` scales the loss under gradient accumulation: with
    ``model_accepts_loss_kwargs`` it passes ``num_items_in_batch`` to the model and leaves the loss
    undivided by ``gradient_accumulation_steps``, which is right only for a model whose loss uses that count."""
    if monitor is None:
        return
    model = getattr(trainer, "model", None)
    monitor.trained_by("transformers", model=type(model).__name__,
                       accepts_loss_kwargs=bool(getattr(trainer, "model_accepts_loss_kwargs", False)),
                       compute_loss_func=getattr(trainer, "compute_loss_func", None) is not None,
                       gradient_accumulation_steps=int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1))


class TrainguardCallback(TrainerCallback):
    """Record and monitor a Hugging Face ``Trainer`` run with its own step, loss and rank.

    Options as for the Lightning callback: ``logdir`` (``logdir/rank-K`` per process when
    ``world_size > 1``; a resumed ``train(resume_from_checkpoint=...)`` appends to the run),
    ``record``/``mode``, ``monitor``/``every``, ``check_numerics``; ``guard`` is reserved for
    ``trainguard.Guard`` (not in this version: passing one is an error).
    """

    def __init__(self, logdir: str | os.PathLike, *, record: bool = False, mode: str = "full_health",
                 monitor: bool = True, every: int = 10, guard: Any = None, check_numerics: bool = False):
        self._session = Session(logdir, record=record, mode=mode, monitor=monitor, every=every, guard=guard,
                                check_numerics=check_numerics)

    @classmethod
    def _driving(cls, monitor: Any) -> TrainguardCallback:
        """A callback that only drives ``monitor`` (opened by ``trainguard run --monitor``)."""
        self = cls.__new__(cls)
        self._session = Session(attached=monitor)
        return self

    @property
    def monitor(self):
        """The run's :class:`trainguard.Monitor` while training (None before and after)."""
        return self._session.monitor

    @property
    def logdir(self):
        """The directory this process writes to, once training started."""
        return self._session.run_dir or self._session.logdir

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A Trainer whose training step calls a loss module holding the model (sentence-transformers'):
        # watch that module, under the model's own names, so that the loss's own parameters are watched too.
        found = find_trainer()
        holder = loss_holding_model(found[1]) if found is not None and found[1].model is model else None
        self._session.start(model, step=state.global_step, rank=args.process_index, world_size=args.world_size,
                            resumed=state.global_step > 0, holder=holder)
        if found is not None and found[0] == "transformers":
            note_trainer(self._session.monitor, found[1])
        if state.global_step > 0:  # train(resume_from_checkpoint=...)
            resumed_at(int(state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        self._session.step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # After clipping: the monitor has read the gradients before it (clip_grad_norm_); this
        # covers a Trainer that clips another way.
        if optimizer is not None:
            self._session.gradients_ready(getattr(optimizer, "optimizer", optimizer))

    def on_step_end(self, args, state, control, **kwargs):
        self._session.step(state.global_step)  # global_step moved on: that step is done

    def on_save(self, args, state, control, **kwargs):
        self._session.checkpoint_saved()

    def on_train_end(self, args, state, control, **kwargs):
        self._session.close()
