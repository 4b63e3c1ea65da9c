"""The SQLite side of the run writer: turns messages into rows and commits them.

A sink runs either inside the writer thread or, for a recording, in a child process
(``python -m trainguard.store._sink RUN_DIR``) fed through a pipe: turning a record into a
row costs about as much Python as capturing it, and in another process that work does not
compete with training for the GIL. Messages are tuples of plain values (marshal-able):

    ("exec", records[, pins])    executions, summaries already resolved to floats; ``pins``: the
                                 seqs the circular buffer must keep (None: judge by health)
    ("stack", id, frames)        an interned stack; source files are read here, once
    ("module", id, path, type)   a module the recorder named
    ("sql", statement, rows)     any other rows, built by the writer thread
    ("payload", seq, slot, path, byte_offset, nbytes, dtype, shape)
                                 a full tensor the writer thread stored (see RunWriter._save_tensor)
    ("meta", {key: json})        metadata, values already JSON-encoded
    ("config", mode, buffer)     the recorder's mode and circular buffer
    ("commit",)                  commit now
    ("flush",) / ("close",)      commit now (and, for close, trim the buffer); answered with b"A"

The child ignores SIGINT and SIGTERM and exits when its input ends: a training process killed
with SIGKILL closes the pipe, and the child commits what it received before exiting.
"""

from __future__ import annotations

import itertools
import json
import logging
import marshal
import os
import select
import signal
import sqlite3
import struct
import sys
import time
from pathlib import Path

from trainguard.store._codec import (
    DB_NAME,
    EVICTION_SLACK,
    MODE_FIELDS,
    PHASE_ID,
    T_FINITE,
    T_HARMFUL,
    WRITER_STATUS_PREFIX,
    health_of,
)
from trainguard.store._schema import connect

log = logging.getLogger("trainguard.store")

# A recorded stack usually has few distinct files; cap what one source file may add to a run.
MAX_SOURCE_BYTES = 2_000_000

_plain_dumps = json.JSONEncoder(separators=(",", ":")).encode
# Texts of the inputs and outputs that repeat (an output's dtype, shape and device; a parameter
# input) keyed by their marshal bytes, which tell True from 1 and 1.0 where a dict key would not.
_TEXT_CACHE_MAX = 65_536
_HEADER = struct.Struct("<I")
# Size of the status file a sink reserves beside the database (see WRITER_STATUS_PREFIX).
_STATUS_BYTES = 4096


class Sink:
    """Owns the run database connection. Not thread-safe: one thread (or process) feeds it."""

    def __init__(self, run_dir: str | os.PathLike, mode: str = "no_tensor", buffer: int = -1,
                 flush_interval: float = 1.0):
        from trainguard.store._userfiles import is_user_file

        self._is_user_file = is_user_file
        self.run_dir = Path(run_dir)
        self.configure(mode, buffer)
        self.flush_interval = flush_interval
        self.failed: str | None = None
        # Set once the database cannot be written (a full disk): nothing more is stored, and
        # ``lost`` counts the executions received since the last commit that made it.
        self.stopped: str | None = None
        self.lost = 0
        self._received = 0
        self.op_ids: dict[str, int] = {}
        self.file_ids: dict[str, int] = {}
        self.frame_ids: dict[tuple, int] = {}
        self.max_seq = -1
        self.rows_since_commit = 0
        self.ring: dict[int, tuple] = {}  # seq -> execution, the recent window (see _m_exec)
        self.in_db: set[int] = set()  # seqs of the window that are rows
        self.pinned: set[int] = set()
        self._texts: dict[bytes, str] = {}
        self.pin_updates: list[tuple[int]] = []
        self.taint_updates: list[tuple[int, int | None, int]] = []  # rows that became harmful after writing
        # Segment files of full tensors this sink's writer made, and the one it appends to.
        self.segments: set[str] = set()
        self.open_segment: str | None = None
        self._status = _reserve_status(self.run_dir)
        self.con = connect(self.run_dir / DB_NAME, create=True)
        self._continue_tables()
        self.con.execute("BEGIN")
        self.last_commit = time.monotonic()

    def _continue_tables(self) -> None:
        """Join the tables of a run that already holds a recording (a resumed training appends to
        it): op types, source files and frames are looked up there before one is added, and this
        recorder's stack and module ids, which it numbers from 1 as every recorder does, go after
        those already stored, so that the earlier executions keep their own."""
        con = self.con
        self.op_ids = {name: i for i, name in con.execute("SELECT id, name FROM op_types")}
        self.file_ids = {path: i for i, path in con.execute("SELECT id, path FROM source_files")}
        self.frame_ids = {(f, line, name): i for i, f, line, name in
                          con.execute("SELECT id, filename, lineno, name FROM frames")}
        self.stack_base = con.execute("SELECT COALESCE(MAX(id), 0) FROM stacks").fetchone()[0]
        self.module_base = con.execute("SELECT COALESCE(MAX(id), 0) FROM modules").fetchone()[0]

    def configure(self, mode: str, buffer: int) -> None:
        self.fields = MODE_FIELDS[mode]
        self.pack = struct.Struct(f"={len(self.fields)}d").pack
        self.buffer = buffer

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: tuple) -> None:
        """Apply one message; a failure is recorded in the run and never stops the sink."""
        if self.stopped is not None:
            if msg[0] == "exec":
                self.lost += len(msg[1])
            return
        try:
            getattr(self, "_m_" + msg[0])(*msg[1:])
        except Exception as exc:  # observing training never kills training
            if self.failed is None:
                log.exception("trainguard writer failed on a %r message; recording continues", msg[0])
            self.failed = f"{type(exc).__name__}: {exc}"

    def due(self) -> bool:
        return time.monotonic() - self.last_commit >= self.flush_interval or self.rows_since_commit > 50_000

    def commit(self, final: bool = False) -> None:
        """Commit what arrived; a database that cannot be written stops the sink, never training."""
        con = self.con
        self.last_commit = time.monotonic()
        if self.stopped is None:
            try:
                self._write_window(final)
                meta = {"last_flush": json.dumps(time.time())}
                if self.failed:
                    meta["writer_error"] = json.dumps(self.failed)
                self._m_meta(meta)
                con.execute("COMMIT")
                self._received = 0
            except (sqlite3.Error, OSError) as exc:
                self._stop(exc)
        elif final:
            self._record_stop()  # the final count of what was not stored
        self.rows_since_commit = 0
        if final:
            con.close()
            self.release()
        elif self.stopped is None:
            con.execute("BEGIN")

    def _stop(self, exc: BaseException) -> None:
        self.stopped = f"the run database could not be written: {exc}"
        self.lost += self._received
        self._received = 0
        log.error("the run database could not be written (%s); training goes on, the run keeps what was "
                  "committed before", exc)
        self._record_stop()

    def _record_stop(self) -> None:
        """Say why and how much in the run: its metadata if SQLite can still commit, and the status file."""
        con = self.con
        try:
            if con.in_transaction:
                con.execute("ROLLBACK")
            con.execute("BEGIN")
            self._m_meta({"writer_error": json.dumps(self.stopped), "lost": json.dumps(self.lost)})
            con.execute("COMMIT")
        except (sqlite3.Error, OSError):
            try:
                if con.in_transaction:
                    con.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if self._status is not None:
            doc = json.dumps({"writer_error": self.stopped, "lost": self.lost, "time": time.time()})
            data = doc.encode()[:_STATUS_BYTES].ljust(_STATUS_BYTES)
            try:  # in place: the reserved blocks need no new room
                os.pwrite(self._status[0], data, 0)
            except OSError as exc:
                log.error("cannot record the failure beside the run either: %s", exc)

    def release(self) -> None:
        """Give up the status file: removed unless it says the sink stopped."""
        if self._status is None:
            return
        fd, path = self._status
        self._status = None
        os.close(fd)
        if self.stopped is None:
            try:
                os.unlink(path)
            except OSError:
                pass

    # ------------------------------------------------------------------ messages
    def _m_config(self, mode: str, buffer: int) -> None:
        self.configure(mode, buffer)

    def _m_meta(self, values: dict[str, str]) -> None:
        self.con.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", list(values.items()))

    def _m_sql(self, statement: str, rows: list) -> None:
        self.con.executemany(statement, rows)
        self.rows_since_commit += len(rows)

    def _m_payload(self, seq: int, slot: int, path: str, byte_offset: int | None, nbytes: int | None,
                   dtype: str, shape: str) -> None:
        self.con.execute("INSERT OR REPLACE INTO payloads(seq, slot, path, byte_offset, nbytes, dtype, shape) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (seq, slot, path, byte_offset, nbytes, dtype, shape))
        self.rows_since_commit += 1
        if byte_offset is not None:
            self.segments.add(path)
            self.open_segment = path  # the writer appends to one segment at a time, in order

    def _m_flush(self) -> None:
        self.commit()

    def _m_commit(self) -> None:  # a commit nobody waits for
        self.commit()

    def _op_id(self, name: str) -> int:
        op_id = self.op_ids.get(name)
        if op_id is None:
            op_id = self.op_ids[name] = max(self.op_ids.values(), default=0) + 1
            self.con.execute("INSERT OR IGNORE INTO op_types(id, name) VALUES (?, ?)", (op_id, name))
        return op_id

    def _file_id(self, filename: str) -> int:
        fid = self.file_ids.get(filename)
        if fid is None:
            text = None
            try:
                if not filename.startswith("<") and os.path.getsize(filename) <= MAX_SOURCE_BYTES:
                    with open(filename, encoding="utf-8", errors="replace") as fh:
                        text = fh.read()
            except OSError:
                text = None
            cur = self.con.execute(
                "INSERT INTO source_files(path, text, user) VALUES (?, ?, ?)",
                (filename, text, int(self._is_user_file(filename))),
            )
            fid = self.file_ids[filename] = cur.lastrowid
        return fid

    def _m_stack(self, stack_id: int, frames: list) -> None:
        ids = []
        for frame in frames:
            frame = tuple(frame)
            fid = self.frame_ids.get(frame)
            if fid is None:
                filename, lineno, name = frame
                cur = self.con.execute(
                    "INSERT INTO frames(file_id, filename, lineno, name, user) VALUES (?, ?, ?, ?, ?)",
                    (self._file_id(filename), filename, lineno, name, int(self._is_user_file(filename))),
                )
                fid = self.frame_ids[frame] = cur.lastrowid
            ids.append(fid)
        self.con.execute("INSERT OR REPLACE INTO stacks(id, frames) VALUES (?, ?)",
                         (stack_id + self.stack_base, _plain_dumps(ids)))

    def _m_module(self, module_id: int, path: str, type_name: str) -> None:
        self.con.execute("INSERT OR REPLACE INTO modules(id, path, type) VALUES (?, ?, ?)",
                         (module_id + self.module_base, path, type_name))

    def _m_exec(self, records: list, pins: list | None = None) -> None:
        """Keep executions in memory; :meth:`commit` writes those the circular buffer keeps.

        With ``buffer=N`` most executions fall out of the window before the next commit: they
        never become rows, which makes a recording's writer several times cheaper than writing
        and deleting every op. ``pins`` name the executions the buffer must keep (the recorder
        decides: the first harmful chain, the first harmful execution of each op type and step,
        see docs/recorder.md). A record sent again with a harmful taint (a value that became
        harmful after it was sent) updates the one kept; a taint never goes back down.

        Records without a taint (11 fields, written by other tools) and batches without
        ``pins`` are judged here as format 2 did: a non-finite execution is harmful and pins
        itself and its producers.
        """
        fields = self.fields
        ring, in_db = self.ring, self.in_db
        self._received += len(records)
        for rec in records:
            health = rec[7]
            summary = rec[10]
            if health is None:  # deferred summaries: judged here
                health = 0
                if summary and fields:
                    for values in summary:
                        health |= health_of(fields, values)
                rec = rec[:7] + (health,) + rec[8:]
            seq = rec[0]
            if len(rec) < 13:  # no taint: every non-finite execution is harmful
                rec = rec[:11] + ((T_HARMFUL, seq) if health else (T_FINITE, None))
                if health and pins is None:
                    self._pin(seq)
                    for kind, ref in rec[8]:
                        if kind == "op":
                            self._pin(ref)
            old = ring.get(seq)
            if seq in in_db or old is not None:
                if rec[11] == T_HARMFUL and (old is None or old[11] != T_HARMFUL):
                    if seq in in_db:
                        self.taint_updates.append((T_HARMFUL, rec[12], seq))
                    ring[seq] = rec
                elif old is not None and seq not in in_db and old[11] != T_HARMFUL:
                    ring[seq] = rec
                continue
            ring[seq] = rec
        for seq in pins or ():
            self._pin(seq)
        self.rows_since_commit += len(records)

    def _pin(self, seq: int) -> None:
        if seq in self.pinned:
            return
        self.pinned.add(seq)
        if seq in self.in_db or seq not in self.ring:
            self.pin_updates.append((seq,))  # already a row (or gone): mark it there

    def _write_window(self, final: bool) -> None:
        """Write the executions the buffer keeps, evict the rest, trim the memory window."""
        ring, in_db, pinned = self.ring, self.in_db, self.pinned
        keep = self.buffer
        cutoff = -1
        if keep > 0 and len(ring) > keep:
            cutoff = sorted(ring)[-keep]
        fields, pack = self.fields, self.pack
        rows, edges = [], []
        op_id = self._op_id
        stack_base, module_base = self.stack_base, self.module_base
        text, inputs_text = self._text, self._inputs_text
        if len(self._texts) > _TEXT_CACHE_MAX:
            self._texts.clear()
        # Keep-all forgets which seqs are rows at each commit (a set of every seq would grow with
        # the run): one at or below the newest written may be a row already, sent again with the
        # taint it took later; it updates that row, else its edges would be inserted twice.
        written = self.max_seq if keep <= 0 else -1
        for seq, rec in ring.items():
            if seq in in_db or (seq < cutoff and seq not in pinned):
                continue
            if seq <= written and self._update_row(rec, seq in pinned):
                continue
            _, step, phase, op, module_id, stack_id, fwd_seq, health, inputs, outputs, summary, taint, origin = rec
            blob = None
            if summary and fields:
                try:
                    blob = b"".join([pack(*values) for values in summary])
                except (struct.error, TypeError) as exc:  # one malformed summary loses only itself
                    if self.failed is None:
                        log.error("trainguard writer: bad summary in execution %d: %s", seq, exc)
                    self.failed = f"bad summary in execution {seq}: {exc}"
            for slot, (kind, ref) in enumerate(inputs):
                if kind == "op":
                    edges.append((ref, seq, slot))
            if stack_base and stack_id is not None:
                stack_id += stack_base
            if module_base and module_id is not None:
                module_id += module_base
            rows.append((seq, step, PHASE_ID[phase], op_id(op), module_id, stack_id, fwd_seq, health,
                         inputs_text(inputs), text(outputs), blob, 1 if seq in pinned else 0, taint, origin))
            in_db.add(seq)
            if seq > self.max_seq:
                self.max_seq = seq
        con = self.con
        if rows:
            con.executemany("INSERT OR REPLACE INTO executions(seq, step, phase, op_id, module_id, stack_id, fwd_seq, "
                            "health, inputs, outputs, summary, pinned, taint, origin) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        if edges:
            con.executemany("INSERT INTO edges(producer, consumer, slot) VALUES (?, ?, ?)", edges)
        if self.pin_updates:
            con.executemany("UPDATE executions SET pinned = 1 WHERE seq = ?", self.pin_updates)
            self.pin_updates = []
        if self.taint_updates:
            con.executemany("UPDATE executions SET taint = ?, origin = ? WHERE seq = ?", self.taint_updates)
            self.taint_updates = []
        if keep <= 0:  # keep all: everything is a row now
            ring.clear()
            in_db.clear()
            return
        # Executions older than the window stay in memory a while longer, so that a late
        # non-finite consumer can still pin (and write) its producer.
        excess = len(ring) - (keep if final else keep + EVICTION_SLACK)
        if excess > 0:
            for seq in list(itertools.islice(ring, excess)):
                del ring[seq]
        if self.max_seq >= 0:
            cut = self._evict(keep, None if final or not ring else next(iter(ring)), final)
            if cut is not None:
                self.in_db = {s for s in in_db if s >= cut or s in pinned}

    def _update_row(self, rec: tuple, pinned: bool) -> bool:
        """Apply a record sent again to its row if there is one (True): a harmful taint and a pin
        are added, never taken back."""
        row = self.con.execute("SELECT taint FROM executions WHERE seq = ?", (rec[0],)).fetchone()
        if row is None:
            return False
        if rec[11] == T_HARMFUL and row[0] != T_HARMFUL:
            self.taint_updates.append((T_HARMFUL, rec[12], rec[0]))
        if pinned:
            self.pin_updates.append((rec[0],))
        return True

    def _text(self, value, dumps=marshal.dumps) -> str:
        """``value`` as compact JSON, from the cache when it repeats (an output's dtype, shape and
        device: most ops make the same ones every step). Encoding each one cost about as much as
        the rest of a row (8 of ~15 us of the sink's CPU per execution with ``buffer=-1``)."""
        try:
            key = dumps(value)
        except ValueError:  # not marshal-able: encode it as it is
            return _plain_dumps(value)
        got = self._texts.get(key)
        if got is None:
            got = self._texts[key] = _plain_dumps(value)
        return got

    def _inputs_text(self, inputs) -> str:
        """The inputs as compact JSON, as ``_plain_dumps`` writes them: a producer ``["op",SEQ]``
        is formatted directly (its seq never repeats), the others come from the cache."""
        text = self._text
        if type(inputs) is not tuple and type(inputs) is not list:
            return text(inputs)
        parts = []
        for item in inputs:
            if type(item) is tuple and len(item) == 2 and item[0] == "op" and type(item[1]) is int:
                parts.append(f'["op",{item[1]}]')
            else:
                parts.append(text(item))
        return "[" + ",".join(parts) + "]"

    def _evict(self, keep: int, oldest_in_memory: int | None, final: bool = False) -> int | None:
        """Delete the rows older than the newest ``keep`` that are not pinned; returns the cutoff.

        Saved tensors (full_tensor) of executions still in memory are kept with them, so that a
        late pin finds its payload.
        """
        con = self.con
        row = con.execute("SELECT seq FROM executions ORDER BY seq DESC LIMIT 1 OFFSET ?", (keep - 1,)).fetchone()
        if row is None:
            return None
        cutoff = row[0]
        gone = cutoff if oldest_in_memory is None else min(cutoff, oldest_in_memory)
        kept = "SELECT seq FROM executions WHERE pinned = 1"
        for (path,) in con.execute(
            f"SELECT path FROM payloads WHERE seq < ? AND seq NOT IN ({kept}) AND byte_offset IS NULL", (gone,)
        ).fetchall():
            try:
                (self.run_dir / path).unlink()
            except OSError:
                pass
        con.execute(f"DELETE FROM payloads WHERE seq < ? AND seq NOT IN ({kept})", (gone,))
        self._drop_unused_segments(final)
        stale = "SELECT seq FROM executions WHERE seq < ? AND pinned = 0"
        con.execute(f"DELETE FROM edges WHERE consumer IN ({stale})", (cutoff,))
        con.execute("DELETE FROM executions WHERE seq < ? AND pinned = 0", (cutoff,))
        return cutoff

    def _drop_unused_segments(self, final: bool) -> None:
        """Delete this writer's segment files that no payload row points into any more.

        Not the segment being appended to, unless the run is closing: its next tensors would go
        to a deleted file.
        """
        for path in list(self.segments):
            if path == self.open_segment and not final:
                continue
            if self.con.execute("SELECT 1 FROM payloads WHERE path = ? LIMIT 1", (path,)).fetchone() is None:
                try:
                    (self.run_dir / path).unlink()
                except OSError:
                    pass
                self.segments.discard(path)


def _reserve_status(run_dir: Path) -> tuple[int, Path] | None:
    """Create this sink's status file at full size now, while there is room (None if that fails)."""
    path = run_dir / f"{WRITER_STATUS_PREFIX}{os.getpid()}-{os.urandom(3).hex()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return None
    try:
        os.write(fd, b" " * _STATUS_BYTES)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return None
    return fd, path


# ---------------------------------------------------------------------- the child process
def write_frame(fd: int, msg: tuple) -> None:
    data = marshal.dumps(msg)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _answer(fd: int, sink: Sink) -> None:
    """Acknowledge a flush or close: b"A", or b"S" and why the sink stopped (the disk may be too full to say it)."""
    if sink.stopped is None:
        os.write(fd, b"A")
        return
    body = json.dumps({"error": sink.stopped, "lost": sink.lost}).encode()
    os.write(fd, b"S" + _HEADER.pack(len(body)) + body)


def read_answer(stream) -> tuple[str, int] | None:
    """The parent's side of :func:`_answer`: None when all is well, else (why, executions not stored)."""
    tag = stream.read(1)
    if tag != b"S":
        return None
    header = stream.read(_HEADER.size)
    doc = json.loads(stream.read(_HEADER.unpack(header)[0]))
    return str(doc["error"]), int(doc["lost"])


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def serve(run_dir: str, fd_in: int = 0, fd_out: int = 1) -> None:
    """The child's loop: apply framed messages, commit on time, answer flush and close."""
    sink = Sink(run_dir)
    while True:
        timeout = max(0.0, sink.last_commit + sink.flush_interval - time.monotonic())
        ready, _, _ = select.select([fd_in], [], [], timeout)
        if not ready:
            sink.commit()
            continue
        header = _read_exactly(fd_in, _HEADER.size)
        body = _read_exactly(fd_in, _HEADER.unpack(header)[0]) if header is not None else None
        if body is None:  # the training process is gone: keep what it sent
            sink.commit(final=False)
            sink.con.close()
            sink.release()
            return
        msg = marshal.loads(body)
        if msg[0] == "close":
            sink.commit(final=True)
            _answer(fd_out, sink)
            return
        if msg[0] == "flush":
            sink.commit()
            _answer(fd_out, sink)
            continue
        sink.handle(msg)
        if sink.due():
            sink.commit()


if __name__ == "__main__":
    # Interrupts go to the training process, which closes the run; this process ends with its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="trainguard writer: %(message)s")
    serve(sys.argv[1])
