"""The on-disk checkpoint format: names, the manifest, verification and listing.

A checkpoint directory holds ``step-<N>/`` folders (N zero-padded to at least 8 digits). Each
is written as ``.tmp-step-<N>-<token>/`` beside it and renamed into place once complete, so a
reader never takes a half-written save for a checkpoint. Inside: the tensor engine's data files
and ``manifest.json``, written last, which lists every file with its size and SHA-256, holds the
non-tensor state as JSON, and ends with a digest of its own content. A run directory may keep
its checkpoints in a ``checkpoints/`` subfolder; :func:`list_checkpoints` looks there too.

This module is light on purpose (no torch import): the CLI and the UI list checkpoints with it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from trainguard._errors import CheckpointError
from trainguard.resilience._manifest import (
    MANIFEST,
    Invalid,
    directory_problem,
    entry_problem,
    open_regular,
    validate,
)

FORMAT = "trainguard-checkpoint"
FORMAT_VERSION = 1
RUN_SUBDIR = "checkpoints"
LOCK_FILE = ".trainguard-ckpt.lock"
_COMMITTED = re.compile(r"^step-(\d{8,})$")
_TEMPORARY = re.compile(r"^\.tmp-step-(\d{8,})-[0-9a-f]+$")
# A checkpoint moved aside while a save of the same step replaces it (file systems without an
# atomic exchange only): put back if the replacement never arrived, else deleted.
_REPLACED = re.compile(r"^\.trash-(step-\d{8,})-[0-9a-f]+$")
_CHUNK = 8 << 20


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def temporary_name(step: int, token: str) -> str:
    return f".tmp-{checkpoint_name(step)}-{token}"


def is_temporary(name: str) -> bool:
    return _TEMPORARY.match(name) is not None


def open_for_write(path: Path) -> BinaryIO:
    """Every checkpoint file is created through here (tests inject write failures at this seam)."""
    return open(path, "wb")


def _libc_renameat2() -> Any:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28, or not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_renameat2 = _libc_renameat2()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    False where the system or the file system does not offer it; other failures raise OSError.
    """
    if _renameat2 is None:
        return False
    import ctypes

    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_directory(new: Path, final: Path, token: str) -> None:
    """Put the finished directory ``new`` at ``final``; an existing ``final`` is replaced atomically.

    A reader sees the old checkpoint or the new one, never neither: the two are exchanged in one
    step and the old one, now at ``new``, is deleted. Where no atomic exchange exists, the old
    one is moved aside first; if the process dies before the new one is in place,
    :func:`recover_replaced` puts the old one back.
    """
    if not os.path.lexists(final):
        new.rename(final)
        return
    if exchange(new, final):
        fsync_dir(final.parent)
        remove_entry(new)
        return
    aside = final.parent / f".trash-{final.name}-{token}"
    final.rename(aside)
    new.rename(final)
    fsync_dir(final.parent)
    remove_entry(aside)


def recover_replaced(directory: Path) -> None:
    """Undo a replacement cut short (see :func:`replace_directory`); call while owning the directory."""
    for p in directory.iterdir():
        m = _REPLACED.match(p.name)
        if m is None:
            continue
        final = directory / m.group(1)
        if os.path.lexists(final):
            remove_entry(p)
        else:
            p.rename(final)
            fsync_dir(directory)


def remove_entry(path: Path) -> None:
    """Delete a checkpoint entry; a symbolic link is removed itself, never what it points to."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    """SHA-256 of a regular file (Invalid for a symlink, FIFO or device: they may never end)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_manifest(directory: Path, body: dict[str, Any]) -> None:
    """Write ``manifest.json`` with a digest over its body, and fsync it."""
    doc = dict(body)
    doc["digest"] = "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()
    data = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode()
    with open_for_write(directory / MANIFEST) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest body, or :class:`Invalid` saying what is wrong with it."""
    path = directory / MANIFEST
    problem = directory_problem(directory) or entry_problem(path)
    if problem is not None:
        raise Invalid(problem)
    try:
        with open_regular(path) as f:
            raw = f.read()
    except FileNotFoundError:
        raise Invalid(f"{MANIFEST} is missing") from None
    except OSError as exc:
        raise Invalid(f"{MANIFEST} cannot be read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise Invalid(f"{MANIFEST} is not valid JSON (damaged or cut short)") from None
    if not isinstance(doc, dict):
        raise Invalid(f"{MANIFEST} is not a JSON object")
    digest = doc.pop("digest", None)
    if digest != "sha256:" + hashlib.sha256(_canonical(doc)).hexdigest():
        raise Invalid(f"{MANIFEST} fails its own checksum (it was modified or damaged)")
    if doc.get("format") != FORMAT:
        raise Invalid(f"{MANIFEST} is not a trainguard checkpoint manifest")
    if doc.get("format_version") != FORMAT_VERSION:
        raise Invalid(f"checkpoint format version {doc.get('format_version')!r} is not supported "
                      f"(this trainguard reads version {FORMAT_VERSION})")
    validate(doc)
    return doc


def check(directory: Path, *, full: bool) -> dict[str, Any]:
    """The manifest of a whole, undamaged checkpoint, or :class:`Invalid`.

    The quick check (``full=False``) reads only the manifest and the files' sizes; the full check
    also recomputes every file's SHA-256.
    """
    manifest = read_manifest(directory)
    m = _COMMITTED.match(directory.name)
    if m is None or int(m.group(1)) != manifest.get("step"):
        raise Invalid(f"the manifest says step {manifest.get('step')!r}, the directory is {directory.name}")
    files = manifest["files"]
    for name, meta in sorted(files.items()):
        path = directory / name
        problem = entry_problem(path)
        if problem is not None:
            raise Invalid(problem)
        size = path.lstat().st_size
        if size != meta.get("size"):
            raise Invalid(f"{name} has {size} bytes, the manifest says {meta.get('size')} (truncated or replaced)")
    if full:
        for name, meta in sorted(files.items()):
            try:
                digest = file_digest(directory / name)
            except OSError as exc:
                raise Invalid(f"{name} cannot be read: {exc.strerror or exc}") from None
            if digest != meta.get("sha256"):
                raise Invalid(f"{name} fails its SHA-256 checksum (its content was damaged)")
    return manifest


def signature(directory: Path) -> tuple | None:
    """What identifies the exact content of a checkpoint's files without reading them.

    Inode, size, modification and change time of the manifest and of every other entry: any
    write, truncation, replacement or rename changes one of them (the change time cannot be set
    back), so a checkpoint whose signature is unchanged since its full check is the one checked.
    None when the directory cannot be listed.
    """
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        out = []
        for e in entries:
            st = e.stat(follow_symlinks=False)
            out.append((e.name, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)
    except OSError:
        return None


@dataclass(frozen=True)
class CheckpointInfo:
    """One entry of a checkpoint directory, as :func:`list_checkpoints` sees it.

    ``valid`` is False with a ``reason`` for a damaged checkpoint and for ``complete=False``
    entries: temporary directories that an interrupted save left behind, which no reader uses.
    """

    path: Path
    step: int
    time: float | None
    size: int
    valid: bool
    reason: str | None = None
    complete: bool = True
    pinned: bool = False
    epoch: int | None = None
    world_size: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the UI)."""
        d = asdict(self)
        d["path"] = str(self.path)
        d["name"] = self.name
        return d


def _dir_size(path: Path) -> int:
    total = 0
    if path.is_symlink():  # never look into what a link points at
        return 0
    try:
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def info_for(path: Path, *, full: bool) -> CheckpointInfo:
    """Inspect one committed ``step-N`` or temporary ``.tmp-step-N-*`` directory."""
    size = _dir_size(path)
    m = _TEMPORARY.match(path.name)
    if m is not None:
        return CheckpointInfo(path=path, step=int(m.group(1)), time=None, size=size, valid=False, complete=False,
                              reason="incomplete: a temporary directory left by an interrupted save (ignored)")
    m = _COMMITTED.match(path.name)
    if m is None:
        raise ValueError(f"not a checkpoint directory name: {path.name}")
    step = int(m.group(1))
    try:
        manifest = check(path, full=full)
    except Invalid as exc:
        return CheckpointInfo(path=path, step=step, time=None, size=size, valid=False, reason=str(exc))
    return CheckpointInfo(
        path=path, step=step, time=manifest.get("time"), size=size, valid=True,
        pinned=bool(manifest.get("pinned")), epoch=manifest.get("epoch"),
        world_size=len(manifest.get("ranks", [])) or None, metadata=dict(manifest.get("metadata") or {}),
    )


def resolve_directory(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint directory for ``directory``, which may also be a run directory holding ``checkpoints/``.

    Raises :class:`CheckpointError` when it does not exist or is not a directory.
    """
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    sub = path / RUN_SUBDIR
    if sub.is_dir() and not any(_is_entry(p.name) for p in path.iterdir()):
        return sub
    return path


def _is_entry(name: str) -> bool:
    return _COMMITTED.match(name) is not None or _TEMPORARY.match(name) is not None


def list_checkpoints(directory: str | os.PathLike[str], *, verify: bool = False) -> list[CheckpointInfo]:
    """Every checkpoint (and leftover temporary directory) in ``directory``, oldest step first.

    Light by default: it reads each manifest and compares file sizes. ``verify=True`` also
    recomputes every file's SHA-256, which reads all the data. Raises :class:`CheckpointError`
    when ``directory`` does not exist; an existing directory without checkpoints gives ``[]``.
    """
    root = resolve_directory(directory)
    entries = [p for p in root.iterdir() if _is_entry(p.name) and p.is_dir()]
    infos = [info_for(p, full=verify) for p in entries]
    # Among equal steps, a leftover temporary directory sorts before the committed checkpoint.
    return sorted(infos, key=lambda i: (i.step, i.complete, i.name))
