"""The run writer: one background thread behind a bounded queue owns the SQLite connection.

The training thread only calls ``put_*`` methods, which enqueue and return. Records reach the
database in transactions committed at least every ``flush_interval`` seconds, so a process killed
with SIGKILL leaves a run that opens and shows everything up to the last commit.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
import sys
import sysconfig
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard._errors import TrainguardError
from trainguard.store._codec import (
    DB_NAME,
    MODE_FIELDS,
    PHASE_ID,
    dumps,
    encode_float,
    health_of,
)
from trainguard.store._schema import connect

log = logging.getLogger("trainguard.store")

# A recorded stack usually has few distinct files; cap what one source file may add to a run.
MAX_SOURCE_BYTES = 2_000_000
# Executions kept beyond ``buffer`` while the run is live, so that producers of a later
# non-finite op are still there to pin; the final trim at close keeps exactly ``buffer``.
EVICTION_SLACK = 10_000

_NOT_USER_PREFIXES = tuple(
    p
    for p in {
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # trainguard itself
        sysconfig.get_paths().get("stdlib", ""),
        sysconfig.get_paths().get("platstdlib", ""),
        sysconfig.get_paths().get("purelib", ""),
        sysconfig.get_paths().get("platlib", ""),
    }
    if p
)


_EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples") + os.sep


def is_user_file(filename: str) -> bool:
    """A frame belongs to the user unless it is in trainguard, torch, the stdlib or site-packages.

    trainguard's shipped examples count as user code: they stand for a user's script.
    """
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_EXAMPLES_DIR):
        return True
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    return not path.startswith(_NOT_USER_PREFIXES)


_plain_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _check_appendable(db: Path) -> None:
    """An existing run may be appended to only if it is a trainguard run this version can write."""
    import sqlite3

    from trainguard._errors import CorruptRun, SchemaTooNew
    from trainguard.store._codec import SCHEMA_VERSION

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise CorruptRun(f"{str(db)!r} is not a readable trainguard run: {exc}") from None
    if row is None or not str(row[0]).isdigit():
        raise CorruptRun(f"{str(db)!r} has no schema version: not a trainguard run, or damaged")
    if int(row[0]) > SCHEMA_VERSION:
        raise SchemaTooNew(f"{str(db)!r} was written with run format {row[0]}; this trainguard writes {SCHEMA_VERSION}")


@dataclass
class ExecBatch:
    """Executions captured on the hot path, handed over as one queue item.

    ``records`` rows: (seq, step, phase_name, op_name, module_id, stack_id, fwd_seq, health,
    inputs, outputs, summary). ``summary`` is a list of per-output float tuples, or None. When the
    summaries were computed on an accelerator, ``deferred`` is (host_tensor, event, rows): the
    writer waits on the event and reads row ``rows[i]`` block of the host tensor for record i.
    """

    records: list[tuple]
    deferred: tuple | None = None


@dataclass
class _State:
    op_ids: dict[str, int] = field(default_factory=dict)
    file_ids: dict[str, int] = field(default_factory=dict)
    frame_ids: dict[tuple, int] = field(default_factory=dict)
    last_commit: float = 0.0
    rows_since_commit: int = 0
    max_seq: int = -1


class RunWriter:
    """Writes one run directory. Create one per run; ``close()`` at the end (also at exit)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        mode: str = "full_health",
        buffer: int = -1,
        overwrite: bool = False,
        append: bool = False,
        queue_items: int = 512,
        flush_interval: float = 1.0,
        meta: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.mode = mode
        self.fields = MODE_FIELDS[mode]
        self.buffer = buffer
        self.flush_interval = flush_interval
        self.dropped = 0  # executions dropped under back-pressure
        self.dropped_items = 0  # other items dropped
        self.failed: str | None = None
        self._closed = False
        self._q: queue.Queue = queue.Queue(maxsize=queue_items)
        self._state = _State()

        db = self.run_dir / DB_NAME
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise TrainguardError(f"logdir {str(self.run_dir)!r} exists and is not a directory")
        # The writer that created the run owns its status; an appending writer adds to it.
        self.owner = True
        if db.exists():
            if append and not overwrite:
                self.owner = False
                _check_appendable(db)
            elif not overwrite:
                raise TrainguardError(
                    f"logdir {str(self.run_dir)!r} already holds a run; choose a new logdir or pass overwrite=True"
                )
            else:
                for suffix in ("", "-wal", "-shm"):
                    Path(str(db) + suffix).unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._con = connect(db, create=True)
        base = {
            "created": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "argv": list(sys.argv),
            "python": sys.version.split()[0],
            "mode": mode,
            "buffer": buffer,
            "status": "running",
        }
        try:
            import torch

            base["torch"] = torch.__version__
        except Exception:  # pragma: no cover - torch is a dependency
            pass
        from trainguard import __version__

        base["trainguard"] = __version__
        base.update(meta or {})
        self._write_meta(base if self.owner else dict(meta or {}))
        self._thread = threading.Thread(target=self._loop, name="trainguard-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def _put(self, item: tuple, *, must_keep: bool = False, n_exec: int = 0) -> None:
        if self._closed:
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            if must_keep:
                # Evidence of a non-finite value is never dropped: wait for room.
                self._q.put(item)
            elif n_exec:
                self.dropped += n_exec
            else:
                self.dropped_items += 1

    def put_executions(self, batch: ExecBatch, *, must_keep: bool = False) -> None:
        self._put(("exec", batch), must_keep=must_keep, n_exec=len(batch.records))

    def put_stack(self, stack_id: int, frames: list[tuple[str, int, str]]) -> None:
        """Register an interned stack: frames (filename, lineno, function), outermost first."""
        self._put(("stack", stack_id, frames), must_keep=True)

    def put_module(self, module_id: int, path: str, type_name: str) -> None:
        self._put(("module", module_id, path, type_name), must_keep=True)

    def set_meta(self, **values: Any) -> None:
        self._put(("meta", values), must_keep=True)

    def add_scalars(self, step: int, values: dict[str, float], wall: float | None = None) -> None:
        self._put(("scalars", step, values, wall or time.time()))

    def add_layer_stats(self, rows: list[tuple[int, str, str, str, float]]) -> None:
        """Rows of (step, layer, kind, stat, value)."""
        self._put(("layer_stats", rows))

    def add_histogram(self, step: int, layer: str, kind: str, edges: list[float], counts: list[float]) -> None:
        self._put(("hist", step, layer, kind, edges, counts))

    def add_findings(self, source: str, findings: list[dict], *, replace: bool = False) -> None:
        """Findings as dicts with at least kind, severity, title; the rest is stored as data.

        ``replace=True`` first removes the findings stored earlier by the same ``source``.
        """
        self._put(("findings", source, findings, replace), must_keep=True)

    def put_artifact(self, name: str, media_type: str, data: bytes) -> None:
        self._put(("artifact", name, media_type, bytes(data)), must_keep=True)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until everything queued before this call is committed."""
        if self._closed or not self._thread.is_alive():
            return False
        done = threading.Event()
        self._q.put(("flush", done))
        return done.wait(timeout)

    def close(self, **final_meta: Any) -> None:
        """Flush, trim the circular buffer to exactly ``buffer``, mark the run finished."""
        if self._closed:
            return
        meta = {"status": "finished", "ended": time.time()} if self.owner else {}
        meta.update(final_meta)
        self._q.put(("meta", meta))
        done = threading.Event()
        self._q.put(("close", done))
        self._closed = True
        done.wait(120)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ writer thread
    def _loop(self) -> None:
        con = self._con
        con.execute("BEGIN")
        st = self._state
        st.last_commit = time.monotonic()
        while True:
            timeout = max(0.0, st.last_commit + self.flush_interval - time.monotonic())
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    kind = item[0]
                    if kind == "close":
                        self._commit(final=True)
                        con.close()
                        item[1].set()
                        return
                    if kind == "flush":
                        self._commit()
                        item[1].set()
                        continue
                    getattr(self, "_do_" + kind)(*item[1:])
                if time.monotonic() - st.last_commit >= self.flush_interval or st.rows_since_commit > 50_000:
                    self._commit()
            except Exception as exc:  # observing training never kills training
                if self.failed is None:
                    log.exception("trainguard writer failed; recording continues without this item")
                self.failed = f"{type(exc).__name__}: {exc}"
                try:
                    con.execute("ROLLBACK")
                except Exception:
                    pass
                try:
                    con.execute("BEGIN")
                except Exception:
                    pass

    def _commit(self, final: bool = False) -> None:
        con = self._con
        st = self._state
        if self.buffer > 0 and st.max_seq >= 0:
            self._evict(self.buffer if final else self.buffer + EVICTION_SLACK)
        meta = {"last_flush": time.time(), "dropped": self.dropped + self.dropped_items}
        if self.failed:
            meta["writer_error"] = self.failed
        self._write_meta(meta)
        con.execute("COMMIT")
        st.last_commit = time.monotonic()
        st.rows_since_commit = 0
        if not final:
            con.execute("BEGIN")

    def _evict(self, keep: int) -> None:
        con = self._con
        row = con.execute(
            "SELECT seq FROM executions ORDER BY seq DESC LIMIT 1 OFFSET ?", (keep - 1,)
        ).fetchone()
        if row is None:
            return
        cutoff = row[0]
        for (path,) in con.execute(
            "SELECT p.path FROM payloads p JOIN executions e ON e.seq = p.seq WHERE e.seq < ? AND e.pinned = 0",
            (cutoff,),
        ).fetchall():
            try:
                (self.run_dir / path).unlink()
            except OSError:
                pass
        con.execute(
            "DELETE FROM payloads WHERE seq IN (SELECT seq FROM executions WHERE seq < ? AND pinned = 0)",
            (cutoff,),
        )
        con.execute(
            "DELETE FROM edges WHERE consumer IN (SELECT seq FROM executions WHERE seq < ? AND pinned = 0)",
            (cutoff,),
        )
        con.execute("DELETE FROM executions WHERE seq < ? AND pinned = 0", (cutoff,))

    def _write_meta(self, values: dict[str, Any]) -> None:
        self._con.executemany(
            "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
            [(k, dumps(v)) for k, v in values.items()],
        )

    def _do_meta(self, values: dict[str, Any]) -> None:
        self._write_meta(values)

    def _op_id(self, name: str) -> int:
        st = self._state
        op_id = st.op_ids.get(name)
        if op_id is None:
            op_id = st.op_ids[name] = len(st.op_ids) + 1
            self._con.execute("INSERT OR IGNORE INTO op_types(id, name) VALUES (?, ?)", (op_id, name))
        return op_id

    def _file_id(self, filename: str) -> int:
        st = self._state
        fid = st.file_ids.get(filename)
        if fid is None:
            text = None
            try:
                if not filename.startswith("<") and os.path.getsize(filename) <= MAX_SOURCE_BYTES:
                    with open(filename, encoding="utf-8", errors="replace") as fh:
                        text = fh.read()
            except OSError:
                text = None
            cur = self._con.execute(
                "INSERT INTO source_files(path, text, user) VALUES (?, ?, ?)",
                (filename, text, int(is_user_file(filename))),
            )
            fid = st.file_ids[filename] = cur.lastrowid
        return fid

    def _do_stack(self, stack_id: int, frames: list[tuple[str, int, str]]) -> None:
        st = self._state
        ids = []
        for frame in frames:
            fid = st.frame_ids.get(frame)
            if fid is None:
                filename, lineno, name = frame
                cur = self._con.execute(
                    "INSERT INTO frames(file_id, filename, lineno, name, user) VALUES (?, ?, ?, ?, ?)",
                    (self._file_id(filename), filename, lineno, name, int(is_user_file(filename))),
                )
                fid = st.frame_ids[frame] = cur.lastrowid
            ids.append(fid)
        self._con.execute("INSERT OR REPLACE INTO stacks(id, frames) VALUES (?, ?)", (stack_id, dumps(ids)))

    def _do_module(self, module_id: int, path: str, type_name: str) -> None:
        self._con.execute(
            "INSERT OR REPLACE INTO modules(id, path, type) VALUES (?, ?, ?)", (module_id, path, type_name)
        )

    def _do_exec(self, batch: ExecBatch) -> None:
        fields = self.fields
        pack = struct.Struct(f"={len(fields)}d").pack
        hosts: dict = {}
        for dev, host_tensor, event in batch.deferred or ():
            if event is not None:
                event.synchronize()  # waits on the writer thread, never on the training thread
            hosts[dev] = host_tensor.tolist()
        rows = []
        edges = []
        pins = []
        st = self._state
        for rec in batch.records:
            seq, step, phase, op, module_id, stack_id, fwd_seq, health, inputs, outputs, summary = rec
            blob = None
            if summary and fields:
                if health is not None:  # immediate summaries: health already known
                    blob = b"".join([pack(*values) for values in summary])
                else:
                    flat = array("d")
                    health = 0
                    for values in summary:
                        if isinstance(values[0], str):  # ("d", device, row): deferred
                            values = hosts[values[1]][values[2]]
                        flat.extend(values)
                        health |= health_of(fields, values)
                    blob = flat.tobytes()
            if health is None:
                health = 0
            for slot, (kind, ref) in enumerate(inputs):
                if kind == "op":
                    edges.append((ref, seq, slot))
            if health:
                pins.append(seq)
                pins.extend(ref for kind, ref in inputs if kind == "op")
            rows.append(
                (
                    seq,
                    step,
                    PHASE_ID[phase],
                    self._op_id(op),
                    module_id,
                    stack_id,
                    fwd_seq,
                    health,
                    _plain_dumps(inputs),  # ints, strings and None only: no NaN to encode
                    _plain_dumps(outputs),
                    blob,
                    1 if health else 0,
                )
            )
            if seq > st.max_seq:
                st.max_seq = seq
        con = self._con
        con.executemany("INSERT OR REPLACE INTO executions VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        if edges:
            con.executemany("INSERT INTO edges(producer, consumer, slot) VALUES (?, ?, ?)", edges)
        if pins:
            con.executemany("UPDATE executions SET pinned = 1 WHERE seq = ?", [(s,) for s in pins])
        st.rows_since_commit += len(rows)

    def put_payload_tensor(self, seq: int, slot: int, tensor: Any) -> None:
        """A full tensor (mode full_tensor), already copied to the host; saved by the writer thread."""
        self._put(("payload_tensor", seq, slot, tensor), must_keep=True)

    def _do_payload_tensor(self, seq: int, slot: int, tensor: Any) -> None:
        import torch

        rel = f"tensors/{seq}-{slot}.pt"
        path = self.run_dir / rel
        path.parent.mkdir(exist_ok=True)
        torch.save(tensor, path)
        self._do_payload(seq, slot, rel)

    def _do_payload(self, seq: int, slot: int, relpath: str) -> None:
        self._con.execute("INSERT OR REPLACE INTO payloads(seq, slot, path) VALUES (?, ?, ?)", (seq, slot, relpath))

    def put_payload(self, seq: int, slot: int, relpath: str) -> None:
        self._put(("payload", seq, slot, relpath), must_keep=True)

    def _do_scalars(self, step: int, values: dict[str, float], wall: float) -> None:
        rows = []
        for name, value in values.items():
            v, flag = encode_float(value)
            rows.append((step, name, v, flag, wall))
        self._con.executemany("INSERT INTO scalars(step, name, value, flag, wall) VALUES (?,?,?,?,?)", rows)
        self._state.rows_since_commit += len(rows)

    def _do_layer_stats(self, rows: list[tuple]) -> None:
        out = []
        for step, layer, kind, stat, value in rows:
            v, flag = encode_float(value)
            out.append((step, layer, kind, stat, v, flag))
        self._con.executemany(
            "INSERT INTO layer_stats(step, layer, kind, stat, value, flag) VALUES (?,?,?,?,?,?)", out
        )
        self._state.rows_since_commit += len(out)

    def _do_hist(self, step: int, layer: str, kind: str, edges: list, counts: list) -> None:
        self._con.execute(
            "INSERT INTO histograms(step, layer, kind, edges, counts) VALUES (?,?,?,?,?)",
            (step, layer, kind, dumps(list(edges)), dumps(list(counts))),
        )

    def _do_findings(self, source: str, findings: list[dict], replace: bool) -> None:
        if replace:
            self._con.execute("DELETE FROM findings WHERE source = ?", (source,))
        now = time.time()
        rows = []
        for f in findings:
            data = {k: v for k, v in f.items() if k not in ("kind", "severity", "title")}
            rows.append((source, f["kind"], f["severity"], f.get("title", f["kind"]), dumps(data), now))
        self._con.executemany(
            "INSERT INTO findings(source, kind, severity, title, data, created) VALUES (?,?,?,?,?,?)", rows
        )

    def _do_artifact(self, name: str, media_type: str, data: bytes) -> None:
        self._con.execute(
            "INSERT OR REPLACE INTO artifacts(name, media_type, data, created) VALUES (?,?,?,?)",
            (name, media_type, data, time.time()),
        )


# ---------------------------------------------------------------------- one writer per run per process
_shared: dict[Path, list] = {}
_shared_lock = threading.Lock()


def acquire_writer(run_dir: str | os.PathLike, *, mode: str | None = None, buffer: int | None = None,
                   overwrite: bool = False, append: bool = False, meta: dict[str, Any] | None = None) -> RunWriter:
    """The writer of ``run_dir`` shared by everything in this process that writes to it.

    The recorder and the monitor may write to the same run: the first to arrive creates the
    writer, later ones join it. ``mode``/``buffer`` given by a later caller reconfigure the writer
    (the recorder passes them; the monitor does not). ``append=True`` adds to a run another
    process left in ``run_dir`` (the doctor's results) instead of refusing it. Pair with
    :func:`release_writer`.
    """
    key = Path(run_dir).resolve()
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or entry[0]._closed:
            writer = RunWriter(run_dir, mode=mode or "no_tensor", buffer=-1 if buffer is None else buffer,
                               overwrite=overwrite, append=append, meta=meta)
            _shared[key] = [writer, 1]
            return writer
        writer = entry[0]
        entry[1] += 1
        if mode is not None and mode != writer.mode:
            writer.mode = mode
            writer.fields = MODE_FIELDS[mode]
            writer.set_meta(mode=mode)
        if buffer is not None and buffer != writer.buffer:
            writer.buffer = buffer
            writer.set_meta(buffer=buffer)
        if meta:
            writer.set_meta(**meta)
        return writer


def release_writer(writer: RunWriter, **final_meta: Any) -> None:
    """Drop one reference; the last one closes the writer (flush, trim, mark finished)."""
    key = writer.run_dir.resolve()
    with _shared_lock:
        entry = _shared.get(key)
        if entry is not None and entry[0] is writer:
            entry[1] -= 1
            if entry[1] > 0:
                if final_meta:
                    writer.set_meta(**final_meta)
                writer.flush()
                return
            del _shared[key]
    writer.close(**final_meta)
