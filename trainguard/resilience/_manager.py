"""CheckpointManager: atomic, verified, retained checkpoints of a TrainState."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import CheckpointException

from trainguard._errors import CheckpointError
from trainguard.resilience import _clock, _dist, _engine, _format
from trainguard.resilience._codec import Encoder
from trainguard.resilience._format import CheckpointInfo, Invalid
from trainguard.resilience._grads import optimizer_params
from trainguard.resilience._lock import DirectoryLock
from trainguard.resilience._restore import Unreadable, choose, load_into, no_space, root_cause
from trainguard.resilience._retention import Retention
from trainguard.resilience._state import TrainState

if TYPE_CHECKING:
    from trainguard.resilience._loop import ResumeLoop

log = logging.getLogger("trainguard.resilience")

_now = time.time  # one clock for save times, intervals and keep_every_hours (tests move it)


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """When to save and what to keep; validated on creation."""

    keep: int = 3
    every_steps: int | None = None
    every_seconds: float | None = None
    keep_every_hours: float | None = None
    async_save: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {self.keep!r}")
        if self.every_steps is not None and (
            isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int) or self.every_steps < 1
        ):
            raise ValueError(f"every_steps must be an int >= 1 or None, got {self.every_steps!r}")
        for name in ("every_seconds", "keep_every_hours"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            ):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")


@dataclass
class _Job:
    step: int
    epoch: int
    shared: dict[str, Any]
    local: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    time: float
    clock_step: int | None = None  # trainguard's own step count when it counts (see _restore)


class _OutOfSpace(Exception):
    """A save ran out of room on some rank (see :func:`no_space`); reported once cleaned up."""


def _no_space_message(final: Path, job: _Job) -> str:
    needed = sum(t.numel() * t.element_size() for t in job.tensors.values())
    needed += len(json.dumps([job.shared, job.local]))  # the manifest
    try:
        free = _mb(shutil.disk_usage(final.parent).free)
    except OSError:
        free = "?"
    return (f"no space left on device writing {final} (needed about {_mb(needed)} MB, free {free} MB); "
            "earlier checkpoints are untouched")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}" if n >= 1e6 else f"{n / 1e6:.2f}"


def _remove_leftovers(directory: Path) -> None:
    """Temporary directories of saves that died, replacements cut short; only called while holding the lock."""
    _format.recover_replaced(directory)
    for p in directory.iterdir():
        if _format.is_temporary(p.name):
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)


def _json_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise TypeError(f"metadata must be a dict with string keys, got {metadata!r}")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be plain JSON (no NaN): {exc}") from None


def _rank0_problem(problem: BaseException | None, rank: int, group: Any, *,
                   plain: bool = False) -> tuple[str | None, bool]:
    """What went wrong on rank 0 (the only rank that touches the directory itself), said on
    every rank: (one line or None, out of space). One collective, on every rank alike; the
    other ranks then raise the owner's words (who holds the directory), not a bare 'rank 0 failed'."""
    data = None
    if rank == 0:
        why = None if problem is None else str(problem) if plain else root_cause(problem)
        data = json.dumps({"why": why, "full": no_space(problem)}).encode()
    said = json.loads(_dist.broadcast_bytes(data, group))
    return said["why"], bool(said["full"])


class CheckpointManager:
    """Save, keep and restore checkpoints of a :class:`TrainState` in one directory.

    Mirrors ``tf.train.CheckpointManager``: ``save()`` writes ``step-<N>/`` atomically (temporary
    directory, fsynced files, a manifest with a SHA-256 per file written last, rename, fsync of
    the parent), then prunes to the ``keep`` newest valid checkpoints plus one every
    ``keep_every_hours``. ``restore()`` loads the newest checkpoint that verifies, warning about
    each newer one it skips and why. ``resume()`` is the loop form (Keras ``BackupAndRestore``).

    ``every_steps`` / ``every_seconds`` drive the saves that :meth:`resume` makes. With
    ``async_save=True`` ``save()`` returns once the state is copied to host memory and writes in
    a background thread; a failure there is raised by the next ``save()``, ``wait()`` or
    ``close()``.

    The manager owns its directory from its first restore, save or ``delete_all()`` until
    ``close()``: a second manager on the same directory gets :class:`CheckpointError` naming the
    owner's pid and host.

    Under ``torch.distributed`` every rank calls the same methods in the same order.

    Example::

        ckpt = tg.CheckpointManager("runs/exp1/checkpoints", keep=3, every_steps=500)
        state = tg.TrainState(model=model, optimizer=opt, loader=loader)
        for step in ckpt.resume(state, total_steps=10_000):
            ...
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, every_steps: int | None = None,
                 every_seconds: float | None = None, keep_every_hours: float | None = None,
                 async_save: bool = False):
        self.directory = Path(directory)
        self.policy = CheckpointPolicy(keep=keep, every_steps=every_steps, every_seconds=every_seconds,
                                       keep_every_hours=keep_every_hours, async_save=async_save)
        self._groups = _dist.Groups()
        self._stager = _engine.Stager()
        # Taken by rank 0 on the first restore, save or delete_all; held until close().
        self._lock = DirectoryLock(self.directory)
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self._last: CheckpointInfo | None = None
        self._retention = Retention()
        self._created = _now()
        self.last_save_time = self._created
        self.last_saved_step: int | None = None

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, {self.policy})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------

    def list(self, *, verify: bool = False) -> list[CheckpointInfo]:
        """All checkpoints, oldest first (see :func:`list_checkpoints`); ``[]`` before the first save."""
        if not self.directory.exists():
            return []
        return _format.list_checkpoints(self.directory, verify=verify)

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint that passes the quick check (manifest and sizes), or None."""
        valid = [i for i in self.list() if i.valid]
        return valid[-1] if valid else None

    def due(self, step: int) -> bool:
        """Whether the interval policy asks for a save after ``step`` completed steps."""
        if self.last_saved_step == step:
            return False
        if self.policy.every_steps is not None and step % self.policy.every_steps == 0:
            return True
        return self.policy.every_seconds is not None and _now() - self.last_save_time >= self.policy.every_seconds

    # -- saving ------------------------------------------------------------------------------

    @_dist.unobserved
    def save(self, state: TrainState, step: int | None = None, *, metadata: dict[str, Any] | None = None,
             blocking: bool | None = None) -> CheckpointInfo | None:
        """Checkpoint ``state`` as ``step`` (default ``state.step``; ``state.step`` is set to it).

        Returns the committed checkpoint's info, or None when the save went to the background
        (``blocking=False``, or ``async_save=True`` and ``blocking`` left unset). The state is
        snapshotted before this returns either way: later updates never reach the checkpoint.
        ``metadata`` is a small JSON dict stored in the manifest (shown by ``ckpt list``).
        Raises :class:`CheckpointError` when the save fails; earlier checkpoints stay intact.
        """
        self._join()
        step = state.step if step is None else step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        meta = _json_metadata(metadata)
        _clock.saving(step)
        state.step = step
        rank, _ = _dist.rank_world()
        self._groups.io()  # made here, not in the background thread: creating a group is a collective
        captured = state.capture()
        enc = Encoder()
        shared = {name: enc.encode(v, name) for name, v in captured.shared.items()}
        local = {name: enc.encode(v, f"rank{rank}/{name}") for name, v in captured.local.items()}
        background = self.policy.async_save if blocking is None else not blocking
        tensors = self._stager.stage(enc.tensors) if background else dict(enc.tensors)
        job = _Job(step=step, epoch=captured.epoch, shared=shared, local=local, tensors=tensors,
                   metadata=meta, time=_now(), clock_step=_clock.counted())
        self.last_save_time = job.time
        self.last_saved_step = step
        if not background:
            self._last = self._commit(job)
            return self._last
        self._thread = threading.Thread(target=self._background, args=(job,), name="trainguard-checkpoint")
        self._thread.start()
        return None

    def wait(self) -> CheckpointInfo | None:
        """Wait for a background save; return the last committed checkpoint, raise if it failed."""
        self._join()
        return self._last

    def close(self) -> None:
        """Finish a background save (raising its failure), free the staging buffers, give up the directory."""
        try:
            self._join()
        finally:
            self._stager.release()
            self._lock.release()

    def _background(self, job: _Job) -> None:
        try:
            self._last = self._commit(job)
        except BaseException as exc:  # kept for the caller's next save()/wait(); training goes on
            self._failure = (job.step, exc)
            log.error("background checkpoint save of step %d failed: %s", job.step, exc)

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            step, exc = failure
            raise CheckpointError(f"the background save of step {step} failed: {exc}") from exc

    def _commit(self, job: _Job) -> CheckpointInfo:
        group = self._groups.io()
        rank, world = _dist.rank_world()
        name = _format.checkpoint_name(job.step)
        token = _dist.broadcast_bytes(uuid.uuid4().hex[:12].encode() if rank == 0 else None, group).decode()
        tmp = self.directory / _format.temporary_name(job.step, token)
        try:
            problem = None
            if rank == 0:
                try:
                    self._lock.acquire()
                    _remove_leftovers(self.directory)
                    tmp.mkdir()
                except (OSError, CheckpointError) as exc:
                    problem = exc
            why, full = _rank0_problem(problem, rank, group)
            if full:
                raise _OutOfSpace
            if why is not None:
                raise CheckpointError(f"cannot save {name} into {self.directory}: {why}")
            try:
                engine_meta, written = _engine.save_tensors(job.tensors, tmp, group)
                files = {p.name: {"size": p.stat().st_size, "sha256": _format.file_digest(p)} for p in written}
                payload: dict[str, Any] = {"state": job.local, "files": files, "error": None}
            except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
                engine_meta, payload = None, {"error": root_cause(exc), "no_space": no_space(exc)}
            ranks = [json.loads(b) for b in _dist.all_gather_bytes(json.dumps(payload).encode(), group)]
            if any(p.get("no_space") for p in ranks):
                raise _OutOfSpace
            errors = [f"rank {r}: {p['error']}" if world > 1 else p["error"]
                      for r, p in enumerate(ranks) if p["error"]]
            if errors:
                raise CheckpointError(f"saving {name} into {self.directory} failed: {'; '.join(errors)}; "
                                      "earlier checkpoints are untouched")
            info, problem = None, None
            if rank == 0:
                try:
                    info = self._publish(job, tmp, token, engine_meta, ranks, world)
                except Exception as exc:
                    problem = exc
            why, full = _rank0_problem(problem, rank, group)
            if full:
                raise _OutOfSpace
            if why is not None:
                raise CheckpointError(f"saving {name} into {self.directory} failed: {why}; "
                                      "earlier checkpoints are untouched")
        except BaseException as exc:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, _OutOfSpace):  # said after the clean-up, so that "free" is what is left
                raise CheckpointError(_no_space_message(self.directory / name, job)) from None
            raise
        if rank == 0:
            self._prune()
        return info if info is not None else _format.info_for(self.directory / name, full=False)

    def _publish(self, job: _Job, tmp: Path, token: str, engine_meta: dict | None,
                 ranks: list[dict[str, Any]], world: int) -> CheckpointInfo:
        """Rank 0: write the manifest last, then rename the finished directory into place."""
        from trainguard import __version__

        files: dict[str, Any] = {}
        for r in ranks:
            files.update(r["files"])
        body = {
            "format": _format.FORMAT,
            "format_version": _format.FORMAT_VERSION,
            "step": job.step,
            "epoch": job.epoch,
            "time": job.time,
            "pinned": self._pin(job.time),
            "world_size": world,
            "trainguard_version": __version__,
            "torch_version": torch.__version__,
            "metadata": job.metadata,
            "files": files,
            "engine": engine_meta,
            "state": job.shared,
            "ranks": [{"state": r["state"]} for r in ranks],
        }
        if job.clock_step is not None:
            body["clock_step"] = job.clock_step
        _format.write_manifest(tmp, body)
        _format.fsync_dir(tmp)
        final = self.directory / _format.checkpoint_name(job.step)
        # The same step again (after falling back past a damaged one): replaced atomically.
        _format.replace_directory(tmp, final, token)
        _format.fsync_dir(self.directory)
        # Every file's SHA-256 was computed from what was written: the new checkpoint is verified.
        self._retention.remember(final)
        return _format.info_for(final, full=False)

    def _pin(self, now: float) -> bool:
        hours = self.policy.keep_every_hours
        if hours is None:
            return False
        pinned = [i.time for i in self.list() if i.valid and i.pinned and i.time is not None]
        return now - max(pinned, default=self._created) >= hours * 3600

    def _prune(self) -> None:
        try:
            self._retention.prune(self.list(), self.policy.keep)
        except OSError as exc:  # a failed cleanup must not fail a committed save
            log.warning("pruning %s failed: %s", self.directory, exc)

    @_dist.unobserved
    def delete_all(self) -> None:
        """Remove every checkpoint of this directory (rank 0; collective under torch.distributed)."""
        self._join()
        rank, _ = _dist.rank_world()
        problem = None
        if rank == 0 and self.directory.exists():
            try:
                self._lock.acquire()  # never delete another run's checkpoints
                for info in self.list():
                    shutil.rmtree(info.path, ignore_errors=True)
                (self.directory / _format.LOCK_FILE).unlink(missing_ok=True)
                self._lock.release()
                try:
                    self.directory.rmdir()
                except OSError:
                    pass  # other files live there
            except CheckpointError as exc:
                problem = exc
        why, _ = _rank0_problem(problem, rank, self._groups.io(), plain=True)
        if why is not None:
            raise problem if problem is not None else CheckpointError(why)

    # -- restoring ---------------------------------------------------------------------------

    @_dist.unobserved
    def restore(self, state: TrainState, *, strict: bool = True, _stacklevel: int = 2,
                _replay: bool = False) -> int | None:
        """Load the newest valid checkpoint into ``state``; return its step, or None if there is none.

        Each checkpoint is fully verified (every file's SHA-256) before it is used; a newer one
        that fails, or whose tensor data cannot be loaded, is skipped with a warning naming it and
        the reason. Raises
        :class:`CheckpointError` when checkpoints exist but none is valid, or when the state
        does not fit (naming missing, unexpected and mis-shaped keys). ``strict=False`` lets the
        state and the checkpoint hold different objects, or different world sizes (then only
        the shared state is restored); mismatched keys inside an object always raise.

        While trainguard counts the steps, the run then drops what it stored of the steps from
        the checkpoint's on (they run again); ``_replay`` (the guard's rewind) keeps them beside
        the replay's.
        """
        self._join()
        owned = self._lock.held
        try:
            return self._restore(state, strict=strict, stacklevel=_stacklevel + 1, replay=_replay)
        except BaseException:
            if not owned:  # a manager that could not restore does not keep the directory
                self._lock.release()
            raise

    def _restore(self, state: TrainState, *, strict: bool, stacklevel: int, replay: bool = False) -> int | None:
        group = self._groups.io()
        rank, world = _dist.rank_world()
        failed: dict[str, str] = {}  # verified, but the engine refused their data
        warned: set[str] = set()
        while True:
            decision = None
            if rank == 0:
                try:
                    self._lock.acquire(to_write=False)
                    if self._lock.held:  # put back what a cut-short replacement moved aside
                        _format.recover_replaced(self.directory)
                    picked = choose(self.directory, self.list(), failed)
                except CheckpointError as exc:  # every rank raises it, none waits for the others
                    picked = {"name": None, "skipped": [], "error": str(exc)}
                decision = json.dumps(picked).encode()
            choice = json.loads(_dist.broadcast_bytes(decision, group))
            if rank == 0:
                for name, reason in choice["skipped"]:
                    if name not in warned:
                        warned.add(name)
                        warnings.warn(f"skipping checkpoint {name} in {self.directory}: {reason}",
                                      CheckpointFallbackWarning, stacklevel=stacklevel)
            if choice["error"]:
                raise CheckpointError(choice["error"])
            if choice["name"] is None:
                return None
            path = self.directory / choice["name"]
            try:
                manifest = _format.read_manifest(path)
                if rank == 0:
                    self._retention.remember(path)  # choose() has just fully verified it
                load_into(state, path, manifest, strict=strict, group=group, rank=rank, world=world)
                problem = None
            except (Invalid, Unreadable) as exc:  # changed since choose() verified it, or data refused
                problem = str(exc)
            if not _dist.all_max([problem is not None], group)[0]:
                break
            # Fall back: the next checkpoint loads every tensor again, over whatever this one wrote.
            failed[choice["name"]] = problem or "another rank could not read it"
        for p in optimizer_params(state):  # as in a new process: no gradients left from before (a NaN)
            p.grad = None
        self.last_save_time = _now()
        self.last_saved_step = int(manifest["step"])
        clock = manifest.get("clock_step")
        if isinstance(clock, int) and not isinstance(clock, bool) and clock >= 0 and _clock.counted() is not None:
            # A monitor, recorder or guard counts the steps here, as one did when this was saved:
            # the steps that follow are numbered as the saving process numbered them, and what a
            # process killed after the save stored of later steps is dropped (they run again).
            (_clock.align if replay else _clock.restored)(clock)
        return self.last_saved_step

    # -- the loop ----------------------------------------------------------------------------

    def resume(self, state: TrainState, *, total_steps: int | None = None, epochs: int | None = None,
               delete_on_success: bool = False, handle_signals: bool = True, guard: Any = None,
               strict: bool = True) -> ResumeLoop:
        """Restore now, then loop over the remaining steps or epochs; see :class:`ResumeLoop`.

        ``guard`` (a :class:`trainguard.Guard`, step form and :meth:`ResumeLoop.batches` only)
        rewinds and replays a step whose loss or gradients go non-finite or spike. ``strict``: as
        for :meth:`restore` (False restores the objects both the state and the checkpoint hold).
        """
        from trainguard.resilience._loop import ResumeLoop
        from trainguard.resilience._unheld import warn_unheld

        still = warn_unheld(state, sys._getframe(1).f_locals, stacklevel=2)
        loop = ResumeLoop(self, state, total_steps=total_steps, epochs=epochs,
                          delete_on_success=delete_on_success, handle_signals=handle_signals, guard=guard,
                          strict=strict)
        loop._still = still  # checked at each save: a module left out that moves is named then
        return loop


class CheckpointFallbackWarning(UserWarning):
    """A newer checkpoint was skipped on restore because it is damaged or incomplete."""
