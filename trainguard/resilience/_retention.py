"""Retention: which checkpoints a save keeps, counting only those that pass the full check."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trainguard.resilience import _format
from trainguard.resilience._format import CheckpointInfo, Invalid

log = logging.getLogger("trainguard.resilience")

# File times tick coarsely (a few ms): a change made in the same tick as a full check would leave
# the signature as it was. A check is remembered only for files unchanged for this long.
_RACY_NS = 2_000_000_000


class Retention:
    """Prunes a checkpoint directory, remembering full checks while the files are unchanged."""

    def __init__(self) -> None:
        # checkpoint path -> file signature when it last passed the full check here
        self._verified: dict[Path, tuple] = {}

    def remember(self, path: Path, sig: tuple | None = None) -> None:
        """``path`` has just passed the full check (or was just written and digested)."""
        sig = _format.signature(path) if sig is None else sig
        if sig is not None and all(e[-1] < time.time_ns() - _RACY_NS for e in sig):
            self._verified[path] = sig

    def full_reason(self, info: CheckpointInfo) -> str | None:
        """Why ``info`` fails the full check; None when it passes."""
        if not info.valid:
            return info.reason
        sig = _format.signature(info.path)
        if sig is not None and self._verified.get(info.path) == sig:
            return None
        try:
            _format.check(info.path, full=True)
        except Invalid as exc:
            return str(exc)
        self.remember(info.path, sig)
        return None

    def prune(self, entries: list[CheckpointInfo], keep: int) -> None:
        """Keep the ``keep`` newest checkpoints that pass the full check, and the pinned ones.

        Newest first, each checkpoint is fully verified until ``keep`` good ones are found; only
        older ones are removed, so a silently damaged checkpoint never counts as kept and the
        newest good one always stays. Damaged checkpoints older than the newest good one are
        removed; newer damaged ones are left alone (a save of that step replaces them).
        """
        committed = [i for i in entries if i.complete]
        good: list[CheckpointInfo] = []
        damaged: dict[Path, str] = {}
        for info in reversed(committed):
            if len(good) == keep:
                break
            reason = self.full_reason(info)
            if reason is None:
                good.append(info)
            else:
                damaged[info.path] = reason
        if not good:
            return
        newest, oldest_kept = good[0].step, good[-1].step
        kept = {i.path for i in good}
        for info in committed:
            if info.path in kept or info.step >= newest:
                continue
            reason = damaged.get(info.path, None if info.valid else info.reason)
            if reason is not None:
                log.warning("removing damaged checkpoint %s (%s)", info.name, reason)
            elif info.step > oldest_kept or info.pinned:
                continue
            _format.remove_entry(info.path)
            self._verified.pop(info.path, None)
