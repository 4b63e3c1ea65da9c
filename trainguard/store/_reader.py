"""Read a run directory: digests for lists, full records by id, nothing that imports torch."""

from __future__ import annotations

import math
import os
import sqlite3
from array import array
from pathlib import Path
from typing import Any

from trainguard._errors import CorruptRun, RunNotFound, SchemaTooNew
from trainguard.store._codec import (
    DB_NAME,
    MODE_FIELDS,
    NAN,
    NEG_INF,
    PHASE_ID,
    PHASES,
    POS_INF,
    REPLAYS_DIR,
    SCHEMA_VERSION,
    decode_float,
    health_names,
    loads,
)

_HEALTH_FILTERS = {
    "nonfinite": "e.health != 0",
    "bad": "e.health != 0",
    # "e.health != 0 AND" lets SQLite use the partial index of non-finite executions.
    "nan": f"e.health != 0 AND (e.health & {NAN}) != 0",
    "inf": f"e.health != 0 AND (e.health & {POS_INF | NEG_INF}) != 0",
    "+inf": f"e.health != 0 AND (e.health & {POS_INF}) != 0",
    "-inf": f"e.health != 0 AND (e.health & {NEG_INF}) != 0",
    "ok": "e.health = 0",
    "finite": "e.health = 0",
}

_DIGEST_SQL = (
    "SELECT e.seq, e.step, e.phase, o.name, m.path, m.type, e.health, e.outputs, e.summary, e.stack_id,"
    " e.fwd_seq FROM executions e JOIN op_types o ON o.id = e.op_id LEFT JOIN modules m ON m.id = e.module_id"
)


def short_op(name: str) -> str:
    """``aten.log.default`` -> ``aten.log``; other overloads keep their name (``aten.add.Tensor``)."""
    return name[: -len(".default")] if name.endswith(".default") else name


def find_runs(root: str | os.PathLike, max_depth: int = 4) -> list[Path]:
    """Run directories under ``root`` (itself included, and the runs in a run's ``replays/``),
    sorted by path."""
    root = Path(root)
    found: list[Path] = []
    if not root.is_dir():
        return found

    def walk(d: Path, depth: int) -> None:
        if (d / DB_NAME).is_file() or _rank_dirs(d):
            found.append(d)
            replays = d / REPLAYS_DIR
            if replays.is_dir() and not replays.is_symlink() and depth < max_depth:
                walk(replays, depth + 1)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return found


def _rank_dirs(d: Path) -> list[Path]:
    try:
        ranks = [p for p in d.iterdir() if p.name.startswith("rank-") and (p / DB_NAME).is_file()]
    except OSError:
        return []
    return sorted(ranks, key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else 1 << 30)


def open_run(logdir: str | os.PathLike, rank: int | None = None) -> Run:
    """Open a recorded run for reading. Raises RunNotFound, CorruptRun or SchemaTooNew."""
    path = Path(logdir)
    if not path.exists():
        raise RunNotFound(f"no such run directory: {str(path)!r}")
    if path.is_file():
        if path.name == DB_NAME:
            path = path.parent
        else:
            raise RunNotFound(f"{str(path)!r} is a file, not a run directory")
    ranks = _rank_dirs(path)
    if (path / DB_NAME).is_file():
        return Run(path, ranks=[])
    if ranks:
        names = [int(p.name[5:]) for p in ranks if p.name[5:].isdigit()]
        want = names[0] if rank is None else rank
        if want not in names:
            raise RunNotFound(f"run {str(path)!r} has no rank {want}; ranks: {names}")
        return Run(path / f"rank-{want}", ranks=names)
    try:
        empty = not any(path.iterdir())
    except OSError as exc:
        raise RunNotFound(f"cannot read {str(path)!r}: {exc.strerror}") from None
    what = "is empty" if empty else f"holds no trainguard run (no {DB_NAME})"
    raise RunNotFound(f"{str(path)!r} {what}")


class Run:
    """A recorded run. Lists return small digests (paged with begin/end); details are fetched by id."""

    def __init__(self, path: Path, ranks: list[int]):
        self.path = path
        self.ranks = ranks
        db = path / DB_NAME
        try:
            # Read-write open of a WAL database lets SQLite recover a run left by a killed
            # process; the reader itself never writes.
            self._con = sqlite3.connect(f"file:{db}?mode=rw", uri=True, check_same_thread=False, timeout=10)
            self._con.execute("PRAGMA query_only=1")
            self._con.execute("PRAGMA busy_timeout=10000")
            rows = self._con.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as exc:
            raise CorruptRun(f"{str(db)!r} is not a readable trainguard run: {exc}") from None
        meta = {}
        for k, v in rows:
            try:
                meta[k] = loads(v)
            except ValueError:
                meta[k] = v
        version = meta.get("schema_version")
        if not isinstance(version, int):
            raise CorruptRun(f"{str(db)!r} has no schema version: not a trainguard run, or damaged")
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"{str(db)!r} was written with run format {version}; this trainguard reads up to "
                f"{SCHEMA_VERSION}: upgrade trainguard"
            )
        self.meta: dict[str, Any] = meta
        self.mode: str = meta.get("mode", "no_tensor")
        self.fields = MODE_FIELDS.get(self.mode, ())
        self._ops: dict[int, str] | None = None
        # Touch the main table so a truncated file fails here, not later.
        self._q("SELECT count(*) FROM executions WHERE seq >= (SELECT max(seq) FROM executions)")

    # ------------------------------------------------------------------ plumbing
    def _q(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        try:
            return self._con.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise CorruptRun(f"run {str(self.path)!r} is damaged: {exc}") from None

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh(self) -> None:
        """Re-read the metadata (for a run that is still being written)."""
        for k, v in self._q("SELECT key, value FROM meta"):
            self.meta[k] = loads(v)
        self._ops = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def status(self) -> str:
        """'finished', 'running' (still written, or its process was killed), or 'crashed'."""
        return self.meta.get("status", "unknown")

    # ------------------------------------------------------------------ executions
    def _where(self, step, op, module, phase, health) -> tuple[str, list]:
        clauses, params = [], []
        if step is not None:
            if isinstance(step, (tuple, list)):
                clauses.append("e.step BETWEEN ? AND ?")
                params += [int(step[0]), int(step[1])]
            else:
                clauses.append("e.step = ?")
                params.append(int(step))
        if op:
            # "log", "aten.log", "mul.Tensor", "aten.mul.Tensor" and the full overload name all match.
            clauses.append("(o.name IN (?, ?, ?, ?) OR o.name LIKE ? OR o.name LIKE ?)")
            params += [op, op + ".default", f"aten.{op}", f"aten.{op}.default", f"{op}.%", f"aten.{op}.%"]
        if module is not None:
            clauses.append("(m.path = ? OR m.path LIKE ?)")
            params += [module, module + ".%"]
        if phase is not None:
            if phase not in PHASE_ID:
                raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")
            clauses.append("e.phase = ?")
            params.append(PHASE_ID[phase])
        if health is not None:
            if health not in _HEALTH_FILTERS:
                raise ValueError(f"health must be one of {sorted(_HEALTH_FILTERS)}, got {health!r}")
            clauses.append(_HEALTH_FILTERS[health])
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def count(self, *, step=None, op=None, module=None, phase=None, health=None) -> int:
        where, params = self._where(step, op, module, phase, health)
        if not where:
            return self._q("SELECT count(*) FROM executions")[0][0]
        sql = (
            "SELECT count(*) FROM executions e JOIN op_types o ON o.id = e.op_id "
            "LEFT JOIN modules m ON m.id = e.module_id" + where
        )
        return self._q(sql, params)[0][0]

    def executions(
        self, begin: int = 0, end: int | None = None, *, step=None, op=None, module=None, phase=None, health=None
    ) -> list[dict]:
        """Digests of executions ``begin:end`` (row offsets, in execution order) matching the filters."""
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"need 0 <= begin <= end, got begin={begin}, end={end}")
        where, params = self._where(step, op, module, phase, health)
        limit = -1 if end is None else end - begin
        if not where:
            # Seek by rank through the primary key: fast paging over millions of rows.
            sql = _DIGEST_SQL + " WHERE e.seq >= (SELECT seq FROM executions ORDER BY seq LIMIT 1 OFFSET ?)"
            sql += " ORDER BY e.seq LIMIT ?"
            return [self._digest(r) for r in self._q(sql, [begin, limit])]
        sql = _DIGEST_SQL + where + " ORDER BY e.seq LIMIT ? OFFSET ?"
        return [self._digest(r) for r in self._q(sql, params + [limit, begin])]

    def index_of(self, seq: int, **filters: Any) -> int:
        """Row offset of execution ``seq`` among the executions matching ``filters``."""
        where, params = self._where(
            filters.get("step"), filters.get("op"), filters.get("module"), filters.get("phase"), filters.get("health")
        )
        if not where:
            return self._q("SELECT count(*) FROM executions WHERE seq < ?", (seq,))[0][0]
        where = where + " AND e.seq < ?"
        sql = (
            "SELECT count(*) FROM executions e JOIN op_types o ON o.id = e.op_id "
            "LEFT JOIN modules m ON m.id = e.module_id" + where
        )
        return self._q(sql, params + [seq])[0][0]

    def _summaries(self, blob: bytes | None, n_outputs: int) -> list[dict | None]:
        nf = len(self.fields)
        if blob is None or not nf:
            return [None] * n_outputs
        flat = array("d")
        flat.frombytes(blob)
        out = []
        for i in range(len(flat) // nf):
            vals = flat[i * nf : (i + 1) * nf]
            d = {}
            for name, v in zip(self.fields, vals):
                d[name] = int(v) if name not in ("min", "max", "mean", "std") and math.isfinite(v) else v
            out.append(d)
        out += [None] * (n_outputs - len(out))
        return out

    def _digest(self, row: tuple) -> dict:
        seq, step, phase, op, mpath, mtype, health, outputs, blob, stack_id, fwd_seq = row
        outs = loads(outputs) or []
        sums = self._summaries(blob, len(outs))
        return {
            "seq": seq,
            "step": step,
            "phase": PHASES[phase],
            "op": short_op(op),
            "module": mpath,
            "module_type": mtype,
            "health": health_names(health),
            "stack_id": stack_id,
            "fwd_seq": fwd_seq,
            "outputs": [
                {"dtype": o[0], "shape": o[1], "device": o[2], "summary": s} for o, s in zip(outs, sums)
            ],
        }

    def execution(self, seq: int) -> dict:
        """One execution in full: digest, stack frames, inputs with their producers, payloads."""
        rows = self._q(_DIGEST_SQL + " WHERE e.seq = ?", (int(seq),))
        if not rows:
            raise KeyError(f"no execution {seq} in run {self.path.name!r} (evicted by the circular buffer?)")
        d = self._digest(rows[0])
        inputs = loads(self._q("SELECT inputs FROM executions WHERE seq = ?", (int(seq),))[0][0]) or []
        d["inputs"] = [self._input(slot, kind, ref) for slot, (kind, ref) in enumerate(inputs)]
        d["stack"] = self.stack(d["stack_id"]) if d["stack_id"] is not None else []
        d["payloads"] = {
            slot: path for slot, path in self._q("SELECT slot, path FROM payloads WHERE seq = ?", (int(seq),))
        }
        return d

    def _input(self, slot: int, kind: str, ref: Any) -> dict:
        item: dict[str, Any] = {"slot": slot, "kind": kind}
        if kind == "op":
            item["producer"] = ref
            rows = self._q(_DIGEST_SQL + " WHERE e.seq = ?", (ref,))
            item["producer_digest"] = self._digest(rows[0]) if rows else None
            if not rows:
                item["evicted"] = True
        elif kind in ("param", "buffer"):
            item["name"] = ref
        elif isinstance(ref, dict):
            item.update(ref)
        return item

    def producers(self, seq: int) -> list[dict]:
        """Digests of the executions that produced ``seq``'s inputs (with the input slot)."""
        out = []
        for i in self.execution(seq)["inputs"]:
            if i.get("producer_digest"):
                out.append(dict(i["producer_digest"], slot=i["slot"]))
        return out

    def consumers(self, seq: int, limit: int = 100) -> list[dict]:
        rows = self._q(
            _DIGEST_SQL + " JOIN edges g ON g.consumer = e.seq WHERE g.producer = ? ORDER BY e.seq LIMIT ?",
            (int(seq), limit),
        )
        return [self._digest(r) for r in rows]

    def stack(self, stack_id: int) -> list[dict]:
        """Frames of an interned stack, outermost first."""
        rows = self._q("SELECT frames FROM stacks WHERE id = ?", (int(stack_id),))
        if not rows:
            return []
        ids = loads(rows[0][0])
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        by_id = {
            r[0]: {"frame_id": r[0], "file_id": r[1], "filename": r[2], "lineno": r[3], "name": r[4], "user": bool(r[5])}
            for r in self._q(f"SELECT id, file_id, filename, lineno, name, user FROM frames WHERE id IN ({marks})", ids)
        }
        return [by_id[i] for i in ids if i in by_id]

    def user_frame(self, stack_id: int | None) -> dict | None:
        """The innermost frame of user code in a stack (outside torch, trainguard, stdlib)."""
        if stack_id is None:
            return None
        frames = self.stack(stack_id)
        for f in reversed(frames):
            if f["user"]:
                return f
        return frames[-1] if frames else None

    def source_files(self) -> list[dict]:
        return [
            {"file_id": r[0], "path": r[1], "user": bool(r[2]), "available": r[3]}
            for r in self._q("SELECT id, path, user, text IS NOT NULL FROM source_files ORDER BY id")
        ]

    def source(self, file: int | str) -> str:
        """The text of a source file as it was when it was recorded (by file id or recorded path)."""
        if isinstance(file, int):
            rows = self._q("SELECT text, path FROM source_files WHERE id = ?", (file,))
        else:
            rows = self._q("SELECT text, path FROM source_files WHERE path = ?", (file,))
        if not rows:
            raise KeyError(f"no source file {file!r} stored in run {self.path.name!r}")
        if rows[0][0] is None:
            raise KeyError(f"source of {rows[0][1]!r} was not readable when the run was recorded")
        return rows[0][0]

    # ------------------------------------------------------------------ aggregates
    def op_counts(self) -> list[dict]:
        rows = self._q(
            "SELECT o.name, count(*) FROM executions e JOIN op_types o ON o.id = e.op_id GROUP BY o.name "
            "ORDER BY count(*) DESC"
        )
        return [{"op": short_op(n), "count": c} for n, c in rows]

    def steps(self) -> list[dict]:
        """Per step: first and last sequence number, execution count, non-finite count."""
        rows = self._q(
            "SELECT step, min(seq), max(seq), count(*), sum(health != 0) FROM executions GROUP BY step ORDER BY step"
        )
        return [{"step": s, "first": a, "last": b, "count": c, "nonfinite": n or 0} for s, a, b, c, n in rows]

    def alerts(self) -> dict:
        """Non-finite events counted by op type, with the first one of each and overall."""
        rows = self._q(
            "SELECT o.name, count(*), min(e.seq) FROM executions e JOIN op_types o ON o.id = e.op_id "
            "WHERE e.health != 0 GROUP BY o.name ORDER BY min(e.seq)"
        )
        by_op = [{"op": short_op(n), "count": c, "first_seq": f} for n, c, f in rows]
        first = self.first_nonfinite()
        return {
            "total": sum(r["count"] for r in by_op),
            "by_op": by_op,
            "first_seq": first["seq"] if first else None,
        }

    def first_nonfinite(self) -> dict | None:
        """The first execution (in order) whose output holds NaN or Inf, in full; None if none."""
        rows = self._q("SELECT seq FROM executions WHERE health != 0 ORDER BY seq LIMIT 1")
        return self.execution(rows[0][0]) if rows else None

    # ------------------------------------------------------------------ training data
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
