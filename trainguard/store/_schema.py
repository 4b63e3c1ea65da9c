"""The run database schema (SQLite, WAL). Bump SCHEMA_VERSION on any incompatible change."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from trainguard.store._codec import SCHEMA_VERSION

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS source_files (
    id INTEGER PRIMARY KEY, path TEXT UNIQUE NOT NULL, text TEXT, user INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS frames (
    id INTEGER PRIMARY KEY, file_id INTEGER, filename TEXT NOT NULL, lineno INTEGER NOT NULL,
    name TEXT NOT NULL, user INTEGER NOT NULL DEFAULT 0);
-- A stack is stored once; ``frames`` is a JSON list of frame ids, outermost first.
CREATE TABLE IF NOT EXISTS stacks (id INTEGER PRIMARY KEY, frames TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS op_types (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS modules (id INTEGER PRIMARY KEY, path TEXT NOT NULL, type TEXT);
CREATE TABLE IF NOT EXISTS executions (
    seq INTEGER PRIMARY KEY,      -- global order of execution
    step INTEGER NOT NULL,
    phase INTEGER NOT NULL,       -- 0 forward, 1 backward, 2 optimizer, 3 other
    op_id INTEGER NOT NULL,
    module_id INTEGER,
    stack_id INTEGER,
    fwd_seq INTEGER,              -- backward ops: the forward execution that made their autograd node
    health INTEGER NOT NULL,      -- bit flags over outputs: 1 NaN, 2 +Inf, 4 -Inf
    inputs TEXT,                  -- JSON [[kind, ref], ...]; kind: op, param, buffer, input
    outputs TEXT,                 -- JSON [[dtype, shape, device], ...]
    summary BLOB,                 -- float64, n_outputs x len(MODE_FIELDS[mode])
    pinned INTEGER NOT NULL DEFAULT 0,
    taint INTEGER NOT NULL DEFAULT 0,  -- 0 finite, 1 unknown, 2 pending (+-inf, not harmful yet), 3 harmful
    origin INTEGER                -- pending/harmful: the seq of the op that made the value
);
CREATE INDEX IF NOT EXISTS executions_step ON executions(step);
-- Non-finite executions in order: alerts, the first NaN, filtered pages over millions of rows.
CREATE INDEX IF NOT EXISTS executions_bad_seq ON executions(seq) WHERE health != 0;
-- Harmful executions counted per step and op type, all of them (the run stores only the first
-- harmful chain, the first of each op type and step, and the circular buffer's window).
CREATE TABLE IF NOT EXISTS harmful (step INTEGER NOT NULL, op TEXT NOT NULL, count INTEGER NOT NULL,
    first_seq INTEGER NOT NULL, PRIMARY KEY (step, op));
CREATE TABLE IF NOT EXISTS edges (producer INTEGER NOT NULL, consumer INTEGER NOT NULL, slot INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS edges_producer ON edges(producer);
-- A full tensor (mode full_tensor): nbytes raw bytes at byte_offset in the segment file ``path``,
-- or, when byte_offset is NULL, a file of its own read with torch.load(weights_only=True).
CREATE TABLE IF NOT EXISTS payloads (seq INTEGER NOT NULL, slot INTEGER NOT NULL, path TEXT NOT NULL,
    byte_offset INTEGER, nbytes INTEGER, dtype TEXT, shape TEXT, PRIMARY KEY (seq, slot));
CREATE INDEX IF NOT EXISTS payloads_path ON payloads(path);
-- Per-step scalars (loss, lr/0, grad_norm, ...): value is NULL unless flag = 0 (finite).
CREATE TABLE IF NOT EXISTS scalars (step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
    flag INTEGER NOT NULL, wall REAL);
CREATE INDEX IF NOT EXISTS scalars_name ON scalars(name, step);
-- Per-layer statistics, long format: kind is activation, gradient, weight or update.
CREATE TABLE IF NOT EXISTS layer_stats (step INTEGER NOT NULL, layer TEXT NOT NULL, kind TEXT NOT NULL,
    stat TEXT NOT NULL, value REAL, flag INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS layer_stats_layer ON layer_stats(layer, kind, stat, step);
CREATE TABLE IF NOT EXISTS histograms (step INTEGER NOT NULL, layer TEXT NOT NULL, kind TEXT NOT NULL,
    edges TEXT NOT NULL, counts TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS findings (id INTEGER PRIMARY KEY, source TEXT NOT NULL, kind TEXT NOT NULL,
    severity TEXT NOT NULL, title TEXT NOT NULL, data TEXT NOT NULL, created REAL);
-- Small named results: doctor reports (JSON), plots (PNG), ...
CREATE TABLE IF NOT EXISTS artifacts (name TEXT PRIMARY KEY, media_type TEXT NOT NULL, data BLOB NOT NULL,
    created REAL);
"""


def connect(path: Path, *, create: bool) -> sqlite3.Connection:
    """Open the run database for writing, creating the schema when asked."""
    con = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
    con.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode: a commit survives a process kill; only an OS crash may lose the last one.
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute("PRAGMA busy_timeout=30000")
    if create:
        con.executescript(SCHEMA)
        _upgrade(con)
        # After the upgrade: an older run's table has no taint column before it.
        con.execute("CREATE INDEX IF NOT EXISTS executions_harmful ON executions(seq) WHERE taint = 3")
        con.execute(
            "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
    return con


# Columns added since format 1, for appending to a run an older trainguard wrote.
_ADDED_COLUMNS = {
    "payloads": (("byte_offset", "INTEGER"), ("nbytes", "INTEGER"), ("dtype", "TEXT"), ("shape", "TEXT")),
    "executions": (("taint", "INTEGER NOT NULL DEFAULT 0"), ("origin", "INTEGER")),
}
# What an added column holds for the rows written before it existed: before format 3 every
# non-finite execution counted as harmful.
_BACKFILL = {("executions", "taint"): "UPDATE executions SET taint = 3, origin = seq WHERE health != 0"}


def _upgrade(con: sqlite3.Connection) -> None:
    """Bring an older run's tables to this format (new nullable columns), then its version."""
    added = []
    for table, columns in _ADDED_COLUMNS.items():
        have = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
        for name, decl in columns:
            if name not in have:
                con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
                added.append((table, name))
    for key in added:  # once every new column exists
        if key in _BACKFILL:
            con.execute(_BACKFILL[key])
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version' AND CAST(value AS INTEGER) < ?",
                (str(SCHEMA_VERSION), SCHEMA_VERSION))
