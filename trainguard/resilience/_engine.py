"""Tensors in and out of a checkpoint directory through ``torch.distributed.checkpoint`` (DCP).

DCP handles one process and many ranks alike (replicated DDP tensors are written once, DTensor
shards by their owners). Two things are changed around it:

* DCP's own metadata file is a pickle. The writer here does not write it; its content (tensor
  shapes, dtypes, chunks and where each chunk lives) goes into the manifest as JSON, and the
  reader rebuilds it from there. Tensor data itself is read with ``torch.load(weights_only=True)``.
* Only tensors are handed to DCP, so its planner never has a non-tensor object to unpickle.
"""

from __future__ import annotations

import errno
import io
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainguard._errors import CheckpointError
from trainguard.resilience import _format
from trainguard.resilience._codec import _dtype_name, dtype_from_name

try:  # the same entry points without the "no process group" warning that dcp.save/load give
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
except ImportError:  # pragma: no cover - a torch that moved them: use the public calls
    _save_state_dict = _load_state_dict = None


class _NoteNoSpace:
    """A written stream that notes a failure for lack of room before passing it on.

    torch's zip writer turns an exception from ``write`` into "unexpected pos ..." and the errno
    is lost; this keeps it for :func:`save_tensors` to report.
    """

    def __init__(self, stream: Any, fs: _FileSystem, path: Path):
        self._stream, self._fs, self._path = stream, fs, path

    def _noting(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._fs.no_space is None:
                self._fs.no_space = OSError(exc.errno, exc.strerror, str(self._path))
            raise

    def write(self, data: Any) -> Any:
        return self._noting(self._stream.write, data)

    def flush(self) -> None:
        self._noting(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _FileSystem(FileSystem):
    """DCP's file system, creating files through :func:`_format.open_for_write` and noting them."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[Path] = []
        self.no_space: OSError | None = None

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Generator[io.IOBase, None, None]:
        path = Path(path)
        if "w" not in mode:
            # Only regular files, never through a symlink (checked again here, not only when verified).
            with _format.open_regular(path) as stream:
                yield stream  # type: ignore[misc]
            return
        self.written.append(path)
        with _format.open_for_write(path) as stream:
            yield _NoteNoSpace(stream, self, path)  # type: ignore[misc]


class _Writer(dcp.FileSystemWriter):
    """Writes DCP's data files (fsynced) and keeps its metadata instead of pickling it."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.fs = _FileSystem()
        self.metadata: Metadata | None = None

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for per_rank in results:
            storage.update({r.index: r.storage_data for r in per_rank})
        metadata.storage_data = storage
        metadata.version = CURRENT_DCP_VERSION
        self.metadata = metadata


class _Reader(dcp.FileSystemReader):
    """Reads DCP's data files with metadata rebuilt from the manifest, never from a pickle."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("trainguard checkpoints have no per-rank DCP metadata")
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if not isinstance(smd, TensorStorageMetadata):
            raise CheckpointError(f"non-tensor entry {fqn!r} reached the tensor engine")
        tensors[fqn] = {
            "dtype": _dtype_name(smd.properties.dtype),
            "shape": list(smd.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in smd.chunks],
        }
    storage = []
    for idx, info in (md.storage_data or {}).items():
        storage.append({
            "fqn": idx.fqn,
            "offset": list(idx.offset) if idx.offset is not None else None,
            "index": idx.index,
            "file": info.relative_path,
            "start": info.offset,
            "length": info.length,
            "transforms": list(info.transform_descriptors) if info.transform_descriptors else None,
        })
    storage.sort(key=lambda s: (s["fqn"], s["offset"] or []))
    return {"version": md.version, "tensors": tensors, "storage": storage}


def metadata_from_json(doc: dict[str, Any]) -> Metadata:
    try:
        sdm: dict[str, Any] = {}
        for fqn, t in doc["tensors"].items():
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(t["dtype"])),
                size=torch.Size(t["shape"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in t["chunks"]],
            )
        storage = {}
        for s in doc["storage"]:
            name = s["file"]
            if Path(name).name != name or name.startswith("."):
                raise CheckpointError(f"the manifest points the engine at an unsafe file {name!r}")
            idx = MetadataIndex(s["fqn"], s["offset"], s["index"])
            storage[idx] = _StorageInfo(name, int(s["start"]), int(s["length"]),
                                        transform_descriptors=s["transforms"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed tensor metadata in the manifest: {exc}") from None
    return Metadata(
        state_dict_metadata=sdm,
        planner_data={fqn: (fqn,) for fqn in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=doc.get("version"),
    )


def _no_dist(group: Any) -> bool:
    return group is None


@contextmanager
def _quiet_single_process(group: Any) -> Generator[None, None, None]:
    if group is not None:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        yield


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, group: Any) -> tuple[dict | None, list[Path]]:
    """Write ``tensors`` into ``directory``; collective when ``group`` is given.

    Returns the engine metadata as JSON (on the coordinating rank, else ``None``) and the files
    this rank wrote.
    """
    writer = _Writer(directory)
    try:
        if group is None and _save_state_dict is not None:
            # One process is a supported case, not a degraded one: DCP's warning about it is noise.
            _save_state_dict(state_dict=dict(tensors), storage_writer=writer, no_dist=True)
        else:
            with _quiet_single_process(group):
                dcp.save(dict(tensors), storage_writer=writer, process_group=group, no_dist=_no_dist(group))
    except (Exception, CheckpointException) as exc:
        if writer.fs.no_space is not None:
            raise writer.fs.no_space from exc
        raise
    meta = metadata_to_json(writer.metadata) if writer.metadata is not None else None
    return meta, list(writer.fs.written)


def load_tensors(targets: dict[str, torch.Tensor], directory: Path, meta: dict[str, Any], group: Any) -> None:
    """Fill ``targets`` in place from ``directory``; collective when ``group`` is given."""
    reader = _Reader(directory, metadata_from_json(meta))
    if group is None and _load_state_dict is not None:
        _load_state_dict(state_dict=targets, storage_reader=reader, no_dist=True)
    else:
        with _quiet_single_process(group):
            dcp.load(targets, storage_reader=reader, process_group=group, no_dist=_no_dist(group))


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and hasattr(t, "to_local") and hasattr(t, "placements")


class Stager:
    """Copies tensors into reusable host buffers so that an asynchronous save owns a snapshot.

    The buffers are kept between saves (allocating and faulting in fresh memory costs more than
    the copy) and released by :meth:`release`.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._event: Any = None

    def stage(self, tensors: dict[str, torch.Tensor], *, wait: bool = True) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the host buffers; with ``wait=False`` the device-to-host copies may
        still be in flight when this returns (the guard's snapshots): call :meth:`wait` before
        reading the buffers. Later device work on the same stream cannot overtake the copies."""
        self.wait()
        out: dict[str, torch.Tensor] = {}
        device_copies = False
        for key, t in tensors.items():
            t = t.detach()
            if _is_dtensor(t):
                out[key] = t.clone()  # a DTensor keeps its placement; clone copies the local shard
                continue
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.device.type == "cuda"
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._buffers[key] = buf
            buf.copy_(t, non_blocking=t.device.type == "cuda")
            device_copies = device_copies or t.device.type == "cuda"
            out[key] = buf
        if device_copies and wait:
            torch.cuda.synchronize()  # the snapshot must be complete before save() returns
        elif device_copies:
            self._event = torch.cuda.Event()
            self._event.record()
        for key in set(self._buffers) - set(tensors):
            del self._buffers[key]
        return out

    def wait(self) -> None:
        """Block until the copies of a ``stage(wait=False)`` have landed in host memory."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()

    def release(self) -> None:
        self.wait()
        self._buffers.clear()
