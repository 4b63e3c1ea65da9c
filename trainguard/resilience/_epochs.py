"""Samplers whose order is a function of their epoch (``DistributedSampler``)."""

from __future__ import annotations

from typing import Any

from trainguard._errors import CheckpointError


def has_epoch(obj: Any) -> bool:
    """A sampler whose order is a function of its epoch: ``set_epoch()`` and an int ``epoch``
    (``DistributedSampler``: the shuffle of an epoch is drawn from ``seed + epoch``)."""
    return callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None), int)


class SamplerEpoch:
    """The state of a sampler that has ``set_epoch()`` but no ``state_dict()``: its epoch."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.sampler.epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.sampler.set_epoch(int(state["epoch"]))
        except KeyError:
            raise CheckpointError("sampler state lacks 'epoch'") from None
