"""The monitor's way to the host: buffer small device tensors, then one copy per device per batch.

Descriptors say what each element is: ``("s", step, name)`` a per-step scalar; ``("l", layer,
kind, stat_names, step[, finish, n_raw])`` a vector of one layer's statistics; ``("m", layers, kind,
stat_names, step[, finish])`` a (layers x stats) matrix, row-major; ``("h", layer, kind, step)`` a
histogram ``[min, max, counts...]``. ``finish`` turns the raw values into the statistics on the
host (divisions, square roots): ``finish(values)`` for a vector, ``finish(row, values)`` per row. On CPU a batch is read back at once; on an accelerator the copy goes to
pinned memory without blocking and is written when its event has completed.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

log = logging.getLogger("trainguard.monitor")


class Shipper:
    def __init__(self, writer: Any, bins: int):
        self.writer = writer
        self.bins = bins
        self.scalars: dict[int, dict[str, Any]] = {}  # step -> name -> 0-d tensor or float
        self.stats: list[tuple[tuple, torch.Tensor]] = []  # (descriptor, 1-D tensor)
        self.consts: list[tuple] = []  # (step, layer, kind, stat, value) known on the host
        self._pending: list[tuple[list, list]] = []
        self._warned_nonfinite = False

    def ship(self, keep: int | None = None) -> None:
        """Concatenate everything buffered and start one copy to the host per device.

        The per-step scalars of step ``keep`` stay behind: ``monitor.step(loss)`` may still name
        that step's loss.
        """
        items: list[tuple[tuple, torch.Tensor]] = []
        consts: list[tuple] = list(self.consts)
        for s in sorted(self.scalars):
            if s == keep:
                continue
            for name, v in self.scalars.pop(s).items():
                if isinstance(v, torch.Tensor):
                    items.append((("s", s, name), v.detach().reshape(1)))
                else:
                    consts.append(("s", s, name, float(v)))
        items.extend(self.stats)
        self.stats = []
        self.consts = []
        if not items and not consts:
            return
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for desc, t in items:
            entry = by_dev.setdefault(t.device, ([], []))
            entry[0].append(desc)
            entry[1].append(t)
        parts = []
        with torch.no_grad():
            for dev, (descs, ts) in by_dev.items():
                # float64 values (a float64 model's loss) stay float64: in float32 a finite 1e53 is inf.
                dtype = torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32
                flat = torch.cat([t.to(dtype) for t in ts])
                if dev.type == "cpu":
                    parts.append((descs, flat, None))
                    continue
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=torch.cuda.is_available())
                host.copy_(flat, non_blocking=True)
                event = None
                if dev.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                parts.append((descs, host, event))
        self._pending.append((parts, consts))

    def resolve(self, *, wait: bool) -> None:
        """Write the batches whose host copies are complete (all of them when ``wait``)."""
        while self._pending:
            parts, consts = self._pending[0]
            for _, _, event in parts:
                if event is not None and not event.query():
                    if not wait:
                        return
                    event.synchronize()  # close/flush only: the copy must land before it is written
            self._pending.pop(0)
            self._emit(parts, consts)

    def _emit(self, parts: list, consts: list) -> None:
        scalars: dict[int, dict[str, float]] = {}
        rows: list[tuple] = []
        for descs, host, _ in parts:
            values = host.tolist()  # host memory: no device sync here
            i = 0
            for desc in descs:
                if desc[0] == "s":
                    scalars.setdefault(desc[1], {})[desc[2]] = values[i]
                    i += 1
                elif desc[0] == "l":
                    layer, kind, names, step = desc[1:5]
                    finish, n_raw = desc[5:7] if len(desc) > 5 else (None, len(names))
                    vals = values[i : i + n_raw]
                    i += n_raw
                    if finish is not None:
                        vals = finish(vals)
                    rows.extend((step, layer, kind, name, v) for name, v in zip(names, vals))
                elif desc[0] == "m":
                    layers, kind, names, step = desc[1:5]
                    k = len(names)
                    for r, layer in enumerate(layers):
                        vals = values[i + r * k : i + (r + 1) * k]
                        if len(desc) > 5:
                            vals = desc[5](r, vals)
                        rows.extend((step, layer, kind, name, v) for name, v in zip(names, vals))
                    i += k * len(layers)
                else:
                    _, layer, kind, step = desc
                    lo, hi = values[i], values[i + 1]
                    counts = values[i + 2 : i + 2 + self.bins]
                    i += 2 + self.bins
                    width = (hi - lo) / self.bins if math.isfinite(hi - lo) else 0.0
                    self.writer.add_histogram(step, layer, kind, [lo + width * b for b in range(self.bins + 1)], counts)
        for c in consts:
            if c[0] == "s":
                scalars.setdefault(c[1], {})[c[2]] = c[3]
            else:
                rows.append(c)
        for step in sorted(scalars):
            vals = scalars[step]
            loss = vals.get("loss")
            if loss is not None and not math.isfinite(loss) and not self._warned_nonfinite:
                self._warned_nonfinite = True
                log.warning("trainguard monitor: loss is %s at step %d", loss, step)
            self.writer.add_scalars(step, vals)
        if rows:
            self.writer.add_layer_stats(rows)
