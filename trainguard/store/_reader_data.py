"""The training-side records of a run (scalars, layer statistics, findings, artifacts, tensors).

A mixin of :class:`trainguard.store._reader.Run`: it only needs the run's ``_q`` query helper,
its ``path`` and its ``meta``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard._errors import CorruptRun
from trainguard.store._codec import decode_float, loads


class RunData:
    path: Path
    meta: dict[str, Any]
    _q: Callable[..., list[tuple]]  # Run's query helper

    def scalar_names(self) -> list[str]:
        return [r[0] for r in self._q("SELECT DISTINCT name FROM scalars ORDER BY name")]

    def scalars(self, name: str | None = None) -> dict[str, list[tuple[int, float]]]:
        """Per-step scalars: {name: [(step, value), ...]} with NaN and Inf restored."""
        if name is None:
            rows = self._q("SELECT name, step, value, flag FROM scalars ORDER BY name, step, rowid")
        else:
            rows = self._q("SELECT name, step, value, flag FROM scalars WHERE name = ? ORDER BY step, rowid", (name,))
        out: dict[str, list[tuple[int, float]]] = {}
        for n, step, value, flag in rows:
            out.setdefault(n, []).append((step, decode_float(value, flag)))
        return out

    def layer_stats(self, *, layer: str | None = None, kind: str | None = None, stat: str | None = None) -> list[dict]:
        clauses, params = [], []
        for col, val in (("layer", layer), ("kind", kind), ("stat", stat)):
            if val is not None:
                clauses.append(f"{col} = ?")
                params.append(val)
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._q(
            "SELECT step, layer, kind, stat, value, flag FROM layer_stats" + where + " ORDER BY step, rowid", params
        )
        return [
            {"step": s, "layer": la, "kind": k, "stat": st, "value": decode_float(v, f)} for s, la, k, st, v, f in rows
        ]

    def layers(self) -> list[str]:
        """Layer names in the order they were first recorded."""
        return [r[0] for r in self._q("SELECT layer FROM layer_stats GROUP BY layer ORDER BY min(rowid)")]

    def histograms(self, *, layer: str | None = None, kind: str | None = None) -> list[dict]:
        clauses, params = [], []
        for col, val in (("layer", layer), ("kind", kind)):
            if val is not None:
                clauses.append(f"{col} = ?")
                params.append(val)
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._q("SELECT step, layer, kind, edges, counts FROM histograms" + where + " ORDER BY step", params)
        return [{"step": s, "layer": la, "kind": k, "edges": loads(e), "counts": loads(c)} for s, la, k, e, c in rows]

    def findings(self, source: str | None = None) -> list[dict]:
        sql = "SELECT id, source, kind, severity, title, data, created FROM findings"
        params: tuple = ()
        if source is not None:
            sql += " WHERE source = ?"
            params = (source,)
        out = []
        for fid, src, kind, sev, title, data, created in self._q(sql + " ORDER BY id", params):
            d = {"id": fid, "source": src, "kind": kind, "severity": sev, "title": title, "created": created}
            d.update(loads(data) or {})
            out.append(d)
        return out

    def artifacts(self) -> list[dict]:
        return [
            {"name": n, "media_type": m, "size": s, "created": c}
            for n, m, s, c in self._q("SELECT name, media_type, length(data), created FROM artifacts ORDER BY name")
        ]

    def artifact(self, name: str) -> tuple[str, bytes]:
        rows = self._q("SELECT media_type, data FROM artifacts WHERE name = ?", (name,))
        if not rows:
            raise KeyError(f"no artifact {name!r} in run {self.path.name!r}")
        return rows[0][0], bytes(rows[0][1])

    def _payload(self, seq: int, slot: int) -> tuple:
        if self.meta.get("schema_version", 1) >= 2:
            rows = self._q("SELECT path, byte_offset, nbytes, dtype, shape FROM payloads WHERE seq = ? AND slot = ?",
                           (int(seq), int(slot)))
        else:  # format 1: one torch.save file per tensor
            rows = [r + (None, None, None, None)
                    for r in self._q("SELECT path FROM payloads WHERE seq = ? AND slot = ?", (int(seq), int(slot)))]
        if not rows:
            raise KeyError(f"no stored tensor for execution {seq} output {slot}")
        return rows[0]

    def payload_path(self, seq: int, slot: int = 0) -> Path:
        """The file holding a full tensor (mode full_tensor), checked to lie inside the run.

        Since run format 2 most tensors share segment files: read them with :meth:`tensor`.
        """
        return self._inside(self._payload(seq, slot)[0])

    def _inside(self, rel: str) -> Path:
        p = (self.path / rel).resolve()
        if self.path.resolve() not in p.parents:
            raise CorruptRun(f"payload path {rel!r} points outside the run")
        return p

    def tensor(self, seq: int, slot: int = 0):
        """The full tensor saved for an execution's output (mode full_tensor), on the CPU.

        Raw bytes are read from their segment, checked against the stored length; a tensor
        stored as a file of its own is read with ``torch.load(weights_only=True)``. No pickled
        code is ever run. KeyError when none was saved (another mode, or evicted by the
        buffer); CorruptRun when the data is missing, short or unreadable.
        """
        import torch

        rel, offset, nbytes, dtype_name, shape = self._payload(seq, slot)
        p = self._inside(rel)
        try:
            if offset is None:
                return torch.load(p, map_location="cpu", weights_only=True)
            dtype = getattr(torch, str(dtype_name), None)
            dims = loads(shape)
            if not isinstance(dtype, torch.dtype) or not isinstance(dims, list):
                raise CorruptRun(f"execution {seq} has a damaged tensor record ({dtype_name!r}, {shape!r})")
            with open(p, "rb") as fh:
                fh.seek(offset)
                data = fh.read(nbytes)
            if len(data) != nbytes:
                raise CorruptRun(f"the tensor of execution {seq} is cut short in {p.name!r} "
                                 f"({len(data)} of {nbytes} bytes)")
            if nbytes == 0:
                return torch.empty(dims, dtype=dtype)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(dims)
        except FileNotFoundError:
            raise CorruptRun(f"the tensor file {p.name!r} of execution {seq} is missing") from None
        except CorruptRun:
            raise
        except Exception as exc:  # truncated zip, unpickling refused, sizes that do not match, ...
            raise CorruptRun(f"the tensor file {p.name!r} of execution {seq} is unreadable: {exc}") from None
