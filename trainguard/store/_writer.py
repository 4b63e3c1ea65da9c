"""The run writer: a background thread behind a bounded queue feeds the run's sink.

The training thread only calls ``put_*`` methods, which enqueue and return. The writer thread
turns queue items into sink messages (see ``_sink.py``); the sink commits at least every
``flush_interval`` seconds, so a process killed with SIGKILL leaves a run that opens and shows
everything up to the last commit. For a recording the sink is a child process, so that building
rows does not compete with training for the GIL; other writers keep it in the thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._errors import TrainguardError
from trainguard.store._codec import DB_NAME, MODE_FIELDS, dumps, encode_float
from trainguard.store._ranks import process_rank, rank_of_dir, remove_stale_ranks, spawned
from trainguard.store._schema import connect
from trainguard.store._segments import SegmentFiles
from trainguard.store._window import SEND_INTERVAL, BufferWindow

log = logging.getLogger("trainguard.store")

# What to do about a logdir that holds a run, for the Python API and the command line alike.
_CHOOSE = ("choose a new logdir, or replace it: overwrite=True (--overwrite on the command line), "
           "or continue it: --resume (trainguard run and monitor)")


def _check_appendable(db: Path) -> None:
    """An existing run may be appended to only if it is a trainguard run this version can write."""
    from trainguard._errors import CorruptRun, SchemaTooNew
    from trainguard.store._codec import SCHEMA_VERSION
    from trainguard.store._sqlite import uri

    try:
        con = sqlite3.connect(uri(db, mode="ro"), uri=True)
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
    inputs, outputs, summary, taint, origin). ``summary`` is a list of per-output float tuples,
    or None; an entry ``("d", key, row)`` refers to row ``row`` of a summary matrix computed on
    a device, and ``deferred`` lists (key, host_tensor, event) whose copy the writer thread
    waits for. The key is the device for the eager recorder's stacked summaries,
    ``("graph", seq)`` for the matrix of one compiled graph call. ``taint`` (see
    ``store._codec``) is None when the writer's ``judge`` decides it (accelerator summaries,
    whose health the hot path does not know); records of 11 fields (no taint) are judged as
    format 2 did (every non-finite execution harmful).

    An entry of ``records`` that is not a tuple stands for all the records of one compiled graph
    call (``capture._compile_records.GraphCall``): its ``expand(hosts)`` makes them here, on the
    writer's thread, with their summaries from the call's matrix in ``deferred``.

    ``pins`` are the seqs the circular buffer must keep (None: judged by health in the sink);
    ``resend`` holds older records sent again because they became harmful (their taint is
    harmful now) or because the chain of a harmful value needs them.
    """

    records: list[tuple]
    deferred: list | None = None
    pins: list[int] | None = None
    resend: list[tuple] | None = None

    def count(self) -> int:
        """How many executions it holds (counted only when it is dropped)."""
        return sum(1 if type(r) is tuple else r.n for r in self.records)


class RunWriter(BufferWindow, SegmentFiles):
    """Writes one run directory. Create one per run; ``close()`` at the end (also at exit)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        mode: str = "full_health",
        buffer: int = -1,
        overwrite: bool = False,
        append: bool = False,
        resume: bool = False,
        process: bool = False,
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
        self.lost = 0  # executions the sink received but could not store (see Sink.stopped)
        self._closed = False
        self._pid = os.getpid()
        self._q: queue.Queue = queue.Queue(maxsize=queue_items)

        db = self.run_dir / DB_NAME
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise TrainguardError(f"logdir {str(self.run_dir)!r} exists and is not a directory")
        # The writer that created the run owns its status; an appending writer adds to it, unless
        # it resumes the training that run recorded (a framework restored its checkpoint): the
        # process that wrote the run was killed, or ended, and this one continues it, so how the
        # run ends is this one's to say.
        self.owner = True
        resumed = False
        if db.exists():
            if append and not overwrite:
                self.owner = resumed = resume
                _check_appendable(db)
            elif not overwrite:
                raise TrainguardError(
                    f"logdir {str(self.run_dir)!r} already holds a run; {_CHOOSE}"
                )
            else:
                for suffix in ("", "-wal", "-shm"):
                    Path(str(db) + suffix).unlink(missing_ok=True)
        if (rank_of_dir(self.run_dir) is not None and (self.run_dir.parent / DB_NAME).exists() and not overwrite
                and not spawned()):
            # A single-process run there would hide the ranks from every reader.
            raise TrainguardError(f"logdir {str(self.run_dir.parent)!r} already holds a run; {_CHOOSE}")
        if overwrite and rank_of_dir(self.run_dir) == 0:
            remove_stale_ranks(self.run_dir.parent)  # a larger job's rank-K must not join this run
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainguardError(f"cannot create the run directory {str(self.run_dir)!r}: "
                                  f"{exc.strerror or exc}") from None
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
        rank, world = process_rank()
        if world > 1:
            base.update(rank=rank, world_size=world)
        torch = sys.modules.get("torch")
        if torch is not None:
            base["torch"] = torch.__version__
        from trainguard import __version__

        base["trainguard"] = __version__
        if resumed:  # the run keeps its creation; how an earlier process ended it is undone
            base = {k: v for k, v in base.items() if k in ("pid", "host", "argv", "status")}
            base.update(resumed=time.time(), ended=None, error=None, crash_step=None, crash_at=None, exit_code=None)
        base.update(meta or {})
        # The schema and the first metadata are written before anything else can fail later.
        try:
            con = connect(db, create=True)
            with con:
                con.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                                [(k, dumps(v)) for k, v in (base if self.owner else dict(meta or {})).items()])
            con.close()
        except sqlite3.Error as exc:
            raise TrainguardError(f"cannot write the run database {str(db)!r}: {exc}") from None

        self._proc = _start_child(self.run_dir) if process else None
        self.sink = None if self._proc is not None else _local_sink(self.run_dir, flush_interval)
        self._sent_dropped = 0
        # Called by the writer thread when no item arrived for a while (the recorder flushes).
        self.idle_callbacks: list = []
        # What sharers still buffer on their side (the recorder's pending records), handed over at
        # the start of every flush: a reader after flush() sees the whole run so far.
        self.sources: list = []
        # Set by the recorder: judges the taint of records whose health the hot path did not
        # know (accelerator summaries), on this thread; called as judge(records) -> (records,
        # pins, resend, counts, meta).
        self.judge = None
        # The circular buffer's window, held here (see _hold): record lists, newest last.
        self._window: deque[list] = deque()
        self._window_n = 0
        self._window_bad = False
        self._sent_max = -1
        self._sent_all = -1
        self._last_send = time.monotonic()
        # full_tensor payloads: the segment file being appended to (see _save_tensor).
        self._seg = None
        self._seg_rel = ""
        self._seg_bytes = 0
        self._seg_index = 0
        self._seg_token = secrets.token_hex(4)
        self._send(("config", mode, buffer))
        self._thread = threading.Thread(target=self._loop, name="trainguard-writer", daemon=True)
        self._thread.start()

    @property
    def in_process(self) -> bool:
        """False when rows are built by a child process."""
        return self._proc is None

    # ------------------------------------------------------------------ producer side
    def _put(self, item: tuple, *, must_keep: bool = False, n_exec: int | Callable[[], int] = 0) -> None:
        if self._closed or os.getpid() != self._pid:  # a forked child has no writer thread
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            if must_keep:
                # Evidence of a non-finite value is never dropped: wait for room.
                self._q.put(item)
            elif n_exec:
                self.dropped += n_exec() if callable(n_exec) else n_exec
            else:
                self.dropped_items += 1

    def queue_room(self) -> int:
        """Free places in the queue (the writer thread must never block on its own queue)."""
        return self._q.maxsize - self._q.qsize()

    def put_executions(self, batch: ExecBatch, *, must_keep: bool = False) -> None:
        """Hand over executions; ``must_keep`` marks a batch that must not be dropped under
        back-pressure (it holds what the buffer must keep: a harmful value, its chain)."""
        self._put(("exec", batch, must_keep), must_keep=must_keep, n_exec=batch.count)

    def add_harm_counts(self, rows: list[tuple[int, str, int, int]]) -> None:
        """Harmful executions counted by (step, op, count, first seq), added to the run's totals."""
        self._put(("sql", _HARM_UPSERT, rows), must_keep=True)

    def put_stack(self, stack_id: int, frames: list[tuple[str, int, str]]) -> None:
        """Register an interned stack: frames (filename, lineno, function), outermost first."""
        self._put(("stack", stack_id, frames), must_keep=True)

    def put_module(self, module_id: int, path: str, type_name: str) -> None:
        self._put(("module", module_id, path, type_name), must_keep=True)

    def configure(self, *, mode: str | None = None, buffer: int | None = None) -> None:
        """Change the summary mode or the circular buffer (before executions arrive)."""
        if mode is not None:
            self.mode, self.fields = mode, MODE_FIELDS[mode]
        if buffer is not None:
            self.buffer = buffer
        self._put(("config", self.mode, self.buffer), must_keep=True)
        self.set_meta(mode=self.mode, buffer=self.buffer)

    def set_meta(self, **values: Any) -> None:
        self._put(("meta", values), must_keep=True)

    def add_scalars(self, step: int, values: dict[str, float], wall: float | None = None) -> None:
        wall = wall or time.time()
        rows = [(step, name, *encode_float(v), wall) for name, v in values.items()]
        # One small item a step, which the loss curve and every count of steps read: kept under
        # back-pressure (a NaN storm's executions fill the queue), not dropped as they may be.
        self._put(("sql", "INSERT INTO scalars(step, name, value, flag, wall) VALUES (?,?,?,?,?)", rows),
                  must_keep=True)

    def add_layer_stats(self, rows: list[tuple[int, str, str, str, float]]) -> None:
        """Rows of (step, layer, kind, stat, value)."""
        out = [(step, layer, kind, stat, *encode_float(v)) for step, layer, kind, stat, v in rows]
        self._put(("sql", "INSERT INTO layer_stats(step, layer, kind, stat, value, flag) VALUES (?,?,?,?,?,?)", out))

    def add_histogram(self, step: int, layer: str, kind: str, edges: list[float], counts: list[float]) -> None:
        self._put(("sql", "INSERT INTO histograms(step, layer, kind, edges, counts) VALUES (?,?,?,?,?)",
                   [(step, layer, kind, dumps(list(edges)), dumps(list(counts)))]))

    def forget_steps(self, start: int) -> None:
        """Drop the per-step scalars, layer statistics and histograms of steps ``start`` and later.

        A restored checkpoint of step ``start`` undoes those steps: the training that follows
        records them again (as TensorBoard's ``purge_step``). Executions, findings and events stay.
        """
        rows = [(int(start),)]
        for table in ("scalars", "layer_stats", "histograms"):
            self._put(("sql", f"DELETE FROM {table} WHERE step >= ?", rows), must_keep=True)

    def add_findings(self, source: str, findings: list[dict], *, replace: bool = False) -> None:
        """Findings as dicts with at least kind, severity, title; the rest is stored as data.

        ``replace=True`` first removes the findings stored earlier by the same ``source``.
        """
        if replace:
            self._put(("sql", "DELETE FROM findings WHERE source = ?", [(source,)]), must_keep=True)
        now = time.time()
        rows = []
        for f in findings:
            data = {k: v for k, v in f.items() if k not in ("kind", "severity", "title")}
            rows.append((source, f["kind"], f["severity"], f.get("title", f["kind"]), dumps(data), now))
        self._put(("sql", "INSERT INTO findings(source, kind, severity, title, data, created) VALUES (?,?,?,?,?,?)",
                   rows), must_keep=True)

    def put_artifact(self, name: str, media_type: str, data: bytes) -> None:
        self._put(("sql", "INSERT OR REPLACE INTO artifacts(name, media_type, data, created) VALUES (?,?,?,?)",
                   [(name, media_type, bytes(data), time.time())]), must_keep=True)

    def put_payload_tensor(self, seq: int, slot: int, tensor: Any) -> None:
        """A full tensor (mode full_tensor), already copied to the host; saved by the writer thread."""
        self._put(("payload_tensor", seq, slot, tensor), must_keep=True)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until everything queued before this call, or buffered by a source, is committed."""
        if self._closed or not self._thread.is_alive():
            return False
        for source in list(self.sources):
            try:
                source()
            except Exception:  # one sharer's failure must not stop the others' data
                log.exception("trainguard: a writer source failed to hand over its data")
        done = threading.Event()
        self._q.put(("flush", done))
        return done.wait(timeout)

    def close(self, **final_meta: Any) -> None:
        """Flush, trim the circular buffer to exactly ``buffer``, mark the run finished."""
        if self._closed or os.getpid() != self._pid:  # only the process that started the writer
            return
        meta = {"status": "finished", "ended": time.time()} if self.owner else {}
        meta.update(final_meta)
        self._q.put(("meta", meta))
        done = threading.Event()
        self._q.put(("close", done))
        self._closed = True
        done.wait(120)
        self._thread.join(timeout=10)
        if self.failed:
            _failures[self.run_dir.resolve()] = (self.failed, self.lost)

    # ------------------------------------------------------------------ writer thread
    def _send(self, msg: tuple) -> None:
        if self._proc is None:
            self.sink.handle(msg)
            if self.sink.due():
                self.sink.commit()
            return
        if self.failed and self.failed.startswith("writer process"):
            return
        try:
            write_frame(self._proc.stdin.fileno(), msg)
        except (OSError, ValueError) as exc:
            self.failed = f"writer process lost: {exc}"
            log.error("trainguard: the writer process stopped (%s); recording continues without storing", exc)

    def _request(self, kind: str) -> None:
        """Commit (``flush``) or commit and close (``close``), waiting for the sink."""
        if self._proc is None:
            self.sink.commit(final=(kind == "close"))
            if self.sink.stopped is not None:
                self.failed, self.lost = self.sink.stopped, self.sink.lost
            return
        self._send((kind,))
        try:
            stopped = read_answer(self._proc.stdout)
        except (OSError, ValueError, struct.error):
            stopped = None
        if stopped is not None:
            self.failed, self.lost = stopped
        if kind == "close":
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            for pipe in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()

    def _loop(self) -> None:
        while True:
            try:
                timeout = SEND_INTERVAL if self._window_n else self.flush_interval
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                dropped = self.dropped + self.dropped_items
                if dropped != self._sent_dropped:
                    self._sent_dropped = dropped
                    self._send(("meta", {"dropped": dumps(dropped)}))
                if item is None:
                    for callback in list(self.idle_callbacks):
                        callback()
                    self._send_window()
                    if self._proc is None and self.sink.due():
                        self.sink.commit()
                    continue
                kind = item[0]
                if kind in ("flush", "close"):
                    self._send_window()
                    if kind == "close":
                        self._close_segment()
                    self._request(kind)
                    item[1].set()
                    if kind == "close":
                        return
                elif kind == "exec":
                    self._exec(item[1], item[2])
                elif kind == "meta":
                    self._send(("meta", {k: dumps(v) for k, v in item[1].items()}))
                elif kind == "payload_tensor":
                    self._send(("payload", *self._save_tensor(*item[1:])))
                else:
                    self._send(item)
            except Exception as exc:  # observing training never kills training
                first = self.failed is None
                if first:
                    log.exception("trainguard writer failed; recording continues without this item")
                self.failed = f"{type(exc).__name__}: {exc}"
                if first:  # the run says so too (the report shows it)
                    try:
                        self._send(("meta", {"writer_error": dumps(self.failed)}))
                    except Exception:  # pragma: no cover - the sink itself is gone
                        pass
                if item is not None and item[0] in ("flush", "close"):
                    item[1].set()
                    if item[0] == "close":
                        return

    def _exec(self, batch: ExecBatch, must_keep: bool) -> None:
        records = _resolve(batch)
        pins, resend = batch.pins, batch.resend
        if self.judge is not None and records and len(records[0]) > 11 and any(r[11] is None for r in records):
            records, more_pins, more_resend, counts, meta = self.judge(records)
            pins = (pins or []) + more_pins
            resend = (resend or []) + more_resend
            if counts:
                self._send(("sql", _HARM_UPSERT, counts))
            if meta:
                self._send(("meta", {k: dumps(v) for k, v in meta.items()}))
        if self.buffer > 0:
            self._hold(records, must_keep, pins, resend)
        elif pins is None:
            self._send(("exec", records))
        else:
            self._send(("exec", (resend or []) + records, pins))



def _resolve(batch: ExecBatch) -> list:
    """Records with accelerator summaries replaced by their values (waiting for the copies here)."""
    if not batch.deferred:
        return batch.records
    hosts = {}
    for dev, host_tensor, event in batch.deferred:
        if event is not None:
            event.synchronize()  # waits on the writer thread, never on the training thread
        hosts[dev] = host_tensor.tolist()
    out = []
    for rec in batch.records:
        if type(rec) is not tuple:  # a compiled graph call's records, made here (see ExecBatch)
            out.extend(rec.expand(hosts))
            continue
        summary = rec[10]
        if summary:
            summary = tuple(tuple(hosts[v[1]][v[2]]) if isinstance(v[0], str) else v for v in summary)
            rec = rec[:10] + (summary,) + rec[11:]
        out.append(rec)
    return out


_HARM_UPSERT = ("INSERT INTO harmful(step, op, count, first_seq) VALUES (?, ?, ?, ?) ON CONFLICT(step, op) "
                "DO UPDATE SET count = count + excluded.count, first_seq = min(first_seq, excluded.first_seq)")


def _local_sink(run_dir: Path, flush_interval: float):
    from trainguard.store._sink import Sink

    return Sink(run_dir, flush_interval=flush_interval)


def _start_child(run_dir: Path) -> subprocess.Popen | None:
    """Start ``python -m trainguard.store._sink RUN_DIR``; None (rows built in-thread) if that fails."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "trainguard.store._sink", str(run_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        log.warning("trainguard: could not start the writer process (%s); writing from a thread", exc)
        return None


def write_frame(fd: int, msg: tuple) -> None:
    from trainguard.store._sink import write_frame as _write

    _write(fd, msg)


def read_answer(stream):
    from trainguard.store._sink import read_answer as _read

    return _read(stream)


# run directory -> (why its writer failed, executions not stored), for the closing line of
# `trainguard run` when the disk is too full for the run itself to say so
_failures: dict[Path, tuple[str, int]] = {}


def writer_failure(run_dir: str | os.PathLike) -> tuple[str, int] | None:
    """Why the last writer of ``run_dir`` in this process failed, and how much it did not store."""
    return _failures.get(Path(run_dir).resolve())


