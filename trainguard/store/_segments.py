"""Full tensors (mode ``full_tensor``) on disk: raw bytes appended to segment files, written
before the row that points at them can be committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Full tensors (mode full_tensor) are appended to segment files of about this size; the sink
# deletes a segment once the circular buffer has evicted every tensor in it.
SEGMENT_BYTES = 64 << 20


class SegmentFiles:
    """Mixin of :class:`trainguard.store._writer.RunWriter`: the current segment file."""

    run_dir: Path
    _seg: Any
    _seg_bytes: int
    _seg_index: int
    _seg_rel: str | None
    _seg_token: str

    def _save_tensor(self, seq: int, slot: int, tensor: Any) -> tuple:
        """Store a full tensor (already a host copy); returns its payload row for the sink.

        Its raw bytes are appended to the current segment file, unbuffered, so they are in the
        file before the row that points at them can be committed: a killed process leaves no row
        pointing past the end. A tensor without plain strided memory (sparse, quantized) gets a
        file of its own, read back with ``torch.load(weights_only=True)``.
        """
        import torch

        dtype = str(tensor.dtype).replace("torch.", "")
        shape = json.dumps(list(tensor.shape), separators=(",", ":"))
        raw = _raw_bytes(tensor)
        if raw is None:
            rel = f"tensors/{seq}-{slot}.pt"
            (self.run_dir / "tensors").mkdir(exist_ok=True)
            torch.save(tensor, self.run_dir / rel)
            return seq, slot, rel, None, None, dtype, shape
        if self._seg is None or self._seg_bytes >= SEGMENT_BYTES:
            self._roll_segment()
        offset = self._seg_bytes
        view = memoryview(raw).cast("B")
        try:
            while view:
                view = view[self._seg.write(view):]
        except BaseException:
            # A partial write (disk full) would shift every later offset: start a new segment.
            self._close_segment()
            raise
        self._seg_bytes += raw.nbytes
        return seq, slot, self._seg_rel, offset, raw.nbytes, dtype, shape

    def _roll_segment(self) -> None:
        self._close_segment()
        self._seg_index += 1
        # A token per writer: several processes may append to one run.
        self._seg_rel = f"tensors/seg-{self._seg_token}-{self._seg_index:06d}.bin"
        (self.run_dir / "tensors").mkdir(exist_ok=True)
        self._seg = open(self.run_dir / self._seg_rel, "xb", buffering=0)  # noqa: SIM115 - kept open
        self._seg_bytes = 0

    def _close_segment(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None


def _raw_bytes(tensor: Any):
    """A contiguous host tensor's bytes as a flat uint8 NumPy array (no copy), or None."""
    import numpy as np
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized:
        return None
    t = tensor.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()
