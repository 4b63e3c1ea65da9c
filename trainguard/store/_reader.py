"""Read a run directory: digests for lists, full records by id, nothing that imports torch."""

from __future__ import annotations

import json
import math
import sqlite3
from array import array
from pathlib import Path
from typing import Any

from trainguard._errors import CorruptRun, SchemaTooNew, TrainguardError
from trainguard.store._codec import (
    DB_NAME,
    MODE_FIELDS,
    NAN,
    NEG_INF,
    PHASE_ID,
    PHASES,
    POS_INF,
    SCHEMA_VERSION,
    T_HARMFUL,
    T_PENDING,
    T_UNKNOWN,
    TAINTS,
    WRITER_STATUS_PREFIX,
    health_names,
    loads,
)
from trainguard.store._reader_data import RunData
from trainguard.store._reader_harm import RunHarm, short_op
from trainguard.store._sqlite import connect_for_reading

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
    # By taint (format 3; in older runs every non-finite execution is harmful, none pending).
    "harmful": f"e.taint = {T_HARMFUL}",
    "pending": f"e.taint = {T_PENDING}",
    "unknown": f"e.taint = {T_UNKNOWN}",
}
# Before format 3 there is no taint column: what it would have held.
_LEGACY_TAINT = f"(CASE WHEN e.health != 0 THEN {T_HARMFUL} ELSE 0 END)"

_DIGEST_SQL = (
    "SELECT e.seq, e.step, e.phase, o.name, m.path, m.type, e.health, e.outputs, e.summary, e.stack_id,"
    " e.fwd_seq, e.taint, e.origin FROM executions e JOIN op_types o ON o.id = e.op_id"
    " LEFT JOIN modules m ON m.id = e.module_id"
)


def _merge_writer_status(path: Path, meta: dict[str, Any]) -> None:
    """Add what a sink that could no longer write the database left beside it (see the sink)."""
    lost = 0
    for p in sorted(path.glob(WRITER_STATUS_PREFIX + "*")):
        try:
            with open(p, "rb") as fh:
                doc = json.loads(fh.read(65536).strip() or b"null")
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue  # reserved and never needed
        if doc.get("writer_error") and not meta.get("writer_error"):
            meta["writer_error"] = str(doc["writer_error"])
        if isinstance(doc.get("lost"), int):
            lost += doc["lost"]
    if lost > (meta.get("lost") if isinstance(meta.get("lost"), int) else 0):
        meta["lost"] = lost


class _Damaged(Exception):
    """A row that cannot be decoded (garbage JSON or summary bytes)."""


class Run(RunHarm, RunData):
    """A recorded run. Lists return small digests (paged with begin/end); details are fetched by id."""

    def __init__(self, path: Path, ranks: list[int]):
        self.path = path
        self.ranks = ranks
        db = path / DB_NAME
        try:
            # Read-write where allowed lets SQLite recover a run left by a killed process; the
            # reader itself never writes (query_only), and creates no file where it may not write.
            self._con, self.access = connect_for_reading(db)
            rows = self._con.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as exc:
            raise CorruptRun(f"{str(db)!r} is not a readable trainguard run: {exc}") from None
        meta = {}
        for k, v in rows:
            try:
                meta[k] = loads(v)
            except ValueError:
                meta[k] = v
        _merge_writer_status(path, meta)
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
        # Format 3 stores a taint per execution; older runs read as if every non-finite one were harmful.
        self.tainted = any(r[1] == "taint" for r in self._q("PRAGMA table_info(executions)"))
        self._digest_sql = _DIGEST_SQL if self.tainted else _DIGEST_SQL.replace(
            "e.taint, e.origin", f"{_LEGACY_TAINT}, CASE WHEN e.health != 0 THEN e.seq END")

    # ------------------------------------------------------------------ plumbing
    def _q(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        try:
            return self._con.execute(sql, params).fetchall()
        except sqlite3.ProgrammingError as exc:  # misuse, not damage
            if "closed" in str(exc):
                raise TrainguardError(f"run {str(self.path)!r} is closed") from None
            raise TypeError(f"a wrong argument for run {str(self.path)!r} ({params!r}): {exc}") from None
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
        _merge_writer_status(self.path, self.meta)
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
            clause = _HEALTH_FILTERS[health]
            if not self.tainted and "e.taint" in clause:
                clause = clause.replace("e.taint", _LEGACY_TAINT)
            clauses.append(clause)
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
            sql = self._digest_sql + " WHERE e.seq >= (SELECT seq FROM executions ORDER BY seq LIMIT 1 OFFSET ?)"
            sql += " ORDER BY e.seq LIMIT ?"
            return self._digests(self._q(sql, [begin, limit]))
        sql = self._digest_sql + where + " ORDER BY e.seq LIMIT ? OFFSET ?"
        return self._digests(self._q(sql, params + [limit, begin]))

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
        flat.frombytes(blob)  # ValueError for a length that is not whole float64s
        if len(flat) % nf:
            raise ValueError(f"a summary of {len(flat)} values, not a multiple of {nf}")
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
        """One execution's digest; :class:`_Damaged` when its row cannot be decoded."""
        seq, step, phase, op, mpath, mtype, health, outputs, blob, stack_id, fwd_seq, taint, origin = row
        try:
            outs = loads(outputs) or []
            sums = self._summaries(blob, len(outs))
            outputs_list = [
                {"dtype": o[0], "shape": o[1], "device": o[2], "summary": s} for o, s in zip(outs, sums)
            ]
            phase_name = PHASES[phase]
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise _Damaged(f"execution {seq} is damaged: {exc}") from None
        return {
            "seq": seq,
            "step": step,
            "phase": phase_name,
            "op": short_op(op),
            "module": mpath,
            "module_type": mtype,
            "health": health_names(health),
            "stack_id": stack_id,
            "fwd_seq": fwd_seq,
            "taint": TAINTS[taint] if isinstance(taint, int) and 0 <= taint < len(TAINTS) else "finite",
            "origin": origin,
            "outputs": outputs_list,
        }

    def _digests(self, rows: list[tuple]) -> list[dict]:
        """Digests of the rows that decode; damaged ones are left out (``damaged`` counts them)."""
        out = []
        for r in rows:
            try:
                out.append(self._digest(r))
            except _Damaged:
                continue
        return out

    def execution(self, seq: int) -> dict:
        """One execution in full: digest, stack frames, inputs with their producers, payloads."""
        rows = self._q(self._digest_sql + " WHERE e.seq = ?", (int(seq),))
        if not rows:
            raise KeyError(f"no execution {seq} in run {self.path.name!r} (evicted by the circular buffer?)")
        try:
            d = self._digest(rows[0])
            inputs = loads(self._q("SELECT inputs FROM executions WHERE seq = ?", (int(seq),))[0][0]) or []
            d["inputs"] = [self._input(slot, kind, ref) for slot, (kind, ref) in enumerate(inputs)]
        except _Damaged as exc:
            raise CorruptRun(str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise CorruptRun(f"execution {seq} is damaged: its inputs: {exc}") from None
        d["stack"] = self.stack(d["stack_id"]) if d["stack_id"] is not None else []
        d["payloads"] = {
            slot: path for slot, path in self._q("SELECT slot, path FROM payloads WHERE seq = ?", (int(seq),))
        }
        return d

    def _input(self, slot: int, kind: str, ref: Any) -> dict:
        item: dict[str, Any] = {"slot": slot, "kind": kind}
        if kind == "op":
            item["producer"] = ref
            rows = self._digests(self._q(self._digest_sql + " WHERE e.seq = ?", (ref,)))
            item["producer_digest"] = rows[0] if rows else None
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
            self._digest_sql + " JOIN edges g ON g.consumer = e.seq WHERE g.producer = ? ORDER BY e.seq LIMIT ?",
            (int(seq), limit),
        )
        return self._digests(rows)

    def stack(self, stack_id: int) -> list[dict]:
        """Frames of an interned stack, outermost first (none for a damaged stack row)."""
        rows = self._q("SELECT frames FROM stacks WHERE id = ?", (int(stack_id),))
        if not rows:
            return []
        try:
            ids = loads(rows[0][0])
        except ValueError:
            return []
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids:
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

    def first_nonfinite(self) -> dict | None:
        """The first execution (in order) whose output holds NaN or Inf, in full; None if none."""
        for (seq,) in self._q("SELECT seq FROM executions WHERE health != 0 ORDER BY seq LIMIT 100"):
            try:
                return self.execution(seq)
            except CorruptRun:  # a damaged row: the next one that reads
                continue
        return None

    @property
    def damaged(self) -> dict[str, int]:
        """Rows that cannot be decoded, by table (only those with any); readers skip them."""
        nf = len(self.fields)
        bad_summary = f"(summary IS NOT NULL AND length(summary) % {8 * nf} != 0)" if nf else "0"
        checks = {
            "executions": "SELECT count(*) FROM executions WHERE NOT json_valid(outputs) "
                          "OR json_type(outputs) != 'array' "
                          "OR EXISTS (SELECT 1 FROM json_each(outputs) WHERE type != 'array') "
                          f"OR (inputs IS NOT NULL AND NOT json_valid(inputs)) OR {bad_summary}",
            "stacks": "SELECT count(*) FROM stacks WHERE NOT json_valid(frames) OR json_type(frames) != 'array'",
        }
        out = {}
        for table, sql in checks.items():
            try:
                n = self._con.execute(sql).fetchone()[0]
            except sqlite3.OperationalError:  # a SQLite without JSON functions: not known
                continue
            if n:
                out[table] = n
        return out
