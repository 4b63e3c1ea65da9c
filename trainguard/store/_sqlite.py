"""Opening a run database for reading: an escaped URI, and read-write only where that is allowed.

A run path may hold any character; in a SQLite URI ``#`` starts a fragment, ``?`` a query and
``%`` an escape, so the path is percent-encoded. A reader opens read-write only a run it may write
(which lets SQLite recover what a killed writer left in the WAL); anything else is opened
read-only, and ``immutable`` where SQLite cannot create the WAL's index beside the database.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote, urlencode

# What SQLite says when a mode cannot be used on this file (the next, more careful, mode may work).
_TRY_NEXT = ("unable to open", "readonly", "read-only", "attempt to write")


def uri(path: str | os.PathLike, **params: str) -> str:
    """``file:`` URI of ``path`` with every special character escaped, and ``params`` as its query."""
    text = "file:" + quote(os.fspath(Path(path).absolute()), safe="/")
    return text + ("?" + urlencode(params) if params else "")


def _writable(db: Path) -> bool:
    return os.access(db, os.W_OK) and os.access(db.parent, os.W_OK)


def connect_for_reading(db: Path, *, probe: str = "SELECT count(*) FROM meta") -> tuple[sqlite3.Connection, str]:
    """A connection that only reads, and how it was opened: ``rw``, ``ro`` or ``immutable``.

    ``probe`` is run on each attempt, since SQLite opens lazily; its other errors
    (``sqlite3.DatabaseError``: not a database, no such table) are raised as they are.
    """
    modes = (["rw"] if _writable(db) else []) + ["ro", "immutable"]
    last: sqlite3.Error | None = None
    for mode in modes:
        params = {"mode": "ro", "immutable": "1"} if mode == "immutable" else {"mode": mode}
        try:
            con = sqlite3.connect(uri(db, **params), uri=True, check_same_thread=False, timeout=10)
        except sqlite3.OperationalError as exc:
            last = exc
            continue
        try:
            con.execute("PRAGMA query_only=1")
            con.execute("PRAGMA busy_timeout=10000")
            con.execute(probe).fetchall()
        except sqlite3.DatabaseError as exc:
            con.close()
            if isinstance(exc, sqlite3.OperationalError) and any(t in str(exc) for t in _TRY_NEXT):
                last = exc
                continue
            raise
        return con, mode
    assert last is not None
    raise last
