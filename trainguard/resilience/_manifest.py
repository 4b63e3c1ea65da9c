"""What a checkpoint may contain, checked before anything in it is trusted (no torch import).

A manifest's digest is a checksum, not a signature: whoever can write the directory can write a
manifest that matches its own digest. So its shape is checked field by field, and a file is read
only when it is a regular file inside the checkpoint, reached without a symbolic link, and listed
with its size and SHA-256. Anything else is :class:`Invalid` with a one-line reason.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST = "manifest.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: a symlink is refused.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class Invalid(Exception):
    """Why a checkpoint cannot be used; the message is the reason shown to the user."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def entry_problem(path: Path) -> str | None:
    """Why ``path`` may not be read as checkpoint data (None: a regular file), without following links."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return f"{path.name} is missing"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return f"{path.name} is a symbolic link (only files inside the checkpoint are read)"
    return f"{path.name} is {_kind(mode)}, not a regular file"


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (no symlink, FIFO or device); else Invalid."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Invalid(f"{path.name} is a symbolic link (only files inside the checkpoint are read)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Invalid(f"{path.name} is {_kind(mode)}, not a regular file")
    return os.fdopen(fd, "rb")


def directory_problem(directory: Path) -> str | None:
    """Why a ``step-N`` entry may not be read: it must be a directory itself, not a link to one."""
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return f"{directory.name} is missing"
    if stat.S_ISLNK(mode):
        return f"{directory.name} is a symbolic link (only directories inside the checkpoint directory are read)"
    if not stat.S_ISDIR(mode):
        return f"{directory.name} is {_kind(mode)}, not a directory"
    return None


def _what(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _field(doc: dict, name: str, ok, want: str, *, required: bool = True) -> Any:
    if name not in doc:
        if required:
            raise Invalid(f"{MANIFEST} lacks {name!r}")
        return None
    value = doc[name]
    if not ok(value):
        raise Invalid(f"{MANIFEST}: {name!r} must be {want}, got {_what(value)}")
    return value


def validate(doc: dict[str, Any]) -> None:
    """Check a manifest body's shape: every field the readers use, with its type."""
    _field(doc, "step", _count, "an integer >= 0")
    _field(doc, "epoch", _count, "an integer >= 0")
    _field(doc, "time", lambda v: type(v) in (int, float) and math.isfinite(v), "a number")
    _field(doc, "pinned", lambda v: type(v) is bool, "true or false", required=False)
    world = _field(doc, "world_size", lambda v: type(v) is int and v >= 1, "an integer >= 1", required=False)
    _field(doc, "metadata", lambda v: isinstance(v, dict), "an object")
    files = _field(doc, "files", lambda v: isinstance(v, dict) and v, "an object naming the data files")
    for name, meta in sorted(files.items()):
        if Path(name).name != name or name.startswith(".") or name == MANIFEST or "\x00" in name:
            raise Invalid(f"{MANIFEST} names an unsafe file {name!r}")
        if not (isinstance(meta, dict) and _count(meta.get("size")) and isinstance(meta.get("sha256"), str)
                and _SHA256.match(meta["sha256"])):
            raise Invalid(f"{MANIFEST}: the entry of {name!r} needs a size and a SHA-256")
    state = _field(doc, "state", lambda v: isinstance(v, dict), "an object")
    del state
    ranks = _field(doc, "ranks", lambda v: isinstance(v, list) and v, "a list with one entry per rank")
    if not all(isinstance(r, dict) and isinstance(r.get("state"), dict) for r in ranks):
        raise Invalid(f"{MANIFEST}: each entry of 'ranks' must hold a 'state' object")
    if world is not None and world != len(ranks):
        raise Invalid(f"{MANIFEST} says {world} ranks and holds the state of {len(ranks)}")
    _validate_engine(_field(doc, "engine", lambda v: isinstance(v, dict), "an object"), files)


def _validate_engine(engine: dict[str, Any], files: dict[str, Any]) -> None:
    tensors, storage = engine.get("tensors"), engine.get("storage")
    if not isinstance(tensors, dict) or not isinstance(storage, list):
        raise Invalid(f"{MANIFEST}: 'engine' must hold 'tensors' (an object) and 'storage' (a list)")
    for fqn, t in tensors.items():
        if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and _ints(t.get("shape"))
                and isinstance(t.get("chunks"), list)
                and all(isinstance(c, list) and len(c) == 2 and _ints(c[0]) and _ints(c[1]) for c in t["chunks"])):
            raise Invalid(f"{MANIFEST}: the engine entry of tensor {fqn!r} is malformed")
    for s in storage:
        if not (isinstance(s, dict) and isinstance(s.get("fqn"), str) and isinstance(s.get("file"), str)
                and _count(s.get("start")) and _count(s.get("length"))
                and (s.get("offset") is None or _ints(s["offset"]))
                and (s.get("index") is None or _count(s["index"]))
                and (s.get("transforms") is None
                     or (isinstance(s["transforms"], list) and all(isinstance(x, str) for x in s["transforms"])))):
            raise Invalid(f"{MANIFEST}: an engine storage entry is malformed")
        if s["file"] not in files:
            raise Invalid(f"{MANIFEST} points the engine at {s['file']!r}, which its checksummed list lacks")
        if s["start"] + s["length"] > files[s["file"]]["size"]:
            raise Invalid(f"{MANIFEST} points the engine past the end of {s['file']!r}")


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_count(x) for x in v)
