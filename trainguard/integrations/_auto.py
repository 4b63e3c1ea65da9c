"""An unmodified script trained by Lightning or the HF ``Trainer`` gets the same answers as with a callback.

``trainguard run --monitor`` and ``trainguard monitor`` open a :class:`~trainguard.Monitor` that
attaches to whatever model the script calls. When it attaches, this looks for a framework
trainer running the call (the first frame up the stack whose ``self`` is a Lightning or
``transformers`` ``Trainer``; only when that framework is already imported) and adds a callback
that drives the monitor: steps become the trainer's ``global_step`` (a resumed checkpoint
continues the count) and the gradients are read where the framework has them complete.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("trainguard.integrations")

_LIGHTNING = ("lightning.pytorch", "pytorch_lightning")


def _trainer_classes() -> list[tuple[str, type]]:
    out = []
    for pkg in _LIGHTNING:
        mod = sys.modules.get(f"{pkg}.trainer.trainer")
        if mod is not None and hasattr(mod, "Trainer"):
            out.append(("lightning", mod.Trainer))
    mod = sys.modules.get("transformers.trainer")
    if mod is not None and hasattr(mod, "Trainer"):
        out.append(("transformers", mod.Trainer))
    return out


def find_trainer(frame: Any = None) -> tuple[str, Any] | None:
    """(framework, trainer) of the trainer whose method is running up the stack, or None."""
    classes = _trainer_classes()
    if not classes:
        return None  # neither framework is loaded: nothing to look for
    f = frame or sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
        if obj is not None:
            for name, cls in classes:
                if isinstance(obj, cls):
                    return name, obj
        f = f.f_back
    return None



def loss_holding_model(trainer: Any) -> Any:
    """The trainer's loss module when it holds the trainer's model (sentence-transformers'
    ``SentenceTransformerTrainer.loss``: MultipleNegativesRankingLoss, SoftmaxLoss with a classifier
    of its own), else None. The loss is what the training step calls: watching it watches the model
    and the loss's own parameters, which the optimizer trains too."""
    import torch

    loss, model = getattr(trainer, "loss", None), getattr(trainer, "model", None)
    if not isinstance(loss, torch.nn.Module) or not isinstance(model, torch.nn.Module) or loss is model:
        return None
    return loss if any(m is model for m in loss.modules()) else None


def name_after_trainers_model(monitor: Any, module: Any, trainer: Any) -> None:
    """A root found by its call that holds the trainer's model (the loss module the Trainer calls)
    is named after that model: its ``state_dict`` names, the rest under ``loss.`` (the trainer's
    attribute) or the holder's type."""
    model = getattr(trainer, "model", None)
    if model is None or model is module:
        return
    outer = "loss." if getattr(trainer, "loss", None) is module else type(module).__name__.lower() + "."
    monitor.name_after(module, model, outer)

def _has_ours(callbacks: list) -> bool:
    return any(type(cb).__module__.startswith("trainguard.integrations") for cb in callbacks)


def _attach(monitor: Any, module: Any) -> None:
    if monitor.closed:
        return
    found = find_trainer()
    if found is None:
        return
    name, trainer = found
    if name == "lightning":
        from trainguard.integrations.lightning import TrainguardCallback

        if _has_ours(trainer.callbacks):
            return
        trainer.callbacks.append(TrainguardCallback._driving(monitor))
        step = trainer.global_step
    else:
        from trainguard.integrations.transformers import TrainguardCallback, note_trainer

        if module is not None:
            name_after_trainers_model(monitor, module, trainer)
        if _has_ours(trainer.callback_handler.callbacks):
            return
        trainer.add_callback(TrainguardCallback._driving(monitor))
        note_trainer(monitor, trainer)
        step = trainer.state.global_step
    from trainguard.capture import drive_step

    drive_step(int(step))
    if name == "transformers" and step > 0:  # train(resume_from_checkpoint=...)
        from trainguard.integrations._session import resumed_at

        resumed_at(int(step))
    log.info("trainguard: steps follow the %s trainer's global_step (now %d)", name, step)


def rearm(monitor: Any) -> None:
    """After a trainer finished: look again at the next optimizer step (a second ``fit`` or ``train``)."""
    from trainguard.capture import before_next_optimizer_step

    def look(optimizer):
        try:
            _attach(monitor, None)
        except Exception:  # observing training never kills training
            log.exception("trainguard: looking for the trainer failed")

    before_next_optimizer_step(look)


def watch_frameworks(monitor: Any) -> None:
    """Let ``monitor`` follow a Lightning or HF trainer that trains the models it attaches to.

    Looked for when a model is attached, and at the first optimizer step (a model called before
    ``fit`` was attached outside the trainer).
    """
    monitor.on_attach(_attach)
    rearm(monitor)
