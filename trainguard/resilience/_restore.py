"""Restoring: choosing the checkpoint to trust, checking the state fits it, loading it."""

from __future__ import annotations

import copy
import errno
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from trainguard._errors import CheckpointError
from trainguard.resilience import _dist, _engine, _format
from trainguard.resilience._codec import (
    SPARSE_PART,
    Encoder,
    decode,
    dtype_from_name,
    empty_in_order,
    tensor_refs,
)
from trainguard.resilience._format import CheckpointInfo, Invalid
from trainguard.resilience._sharded import sharded_target
from trainguard.resilience._state import RNG, TrainState, state_holder


def root_cause(exc: BaseException) -> str:
    """One line for an exception, unwrapping DCP's per-rank wrapper."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items(), key=lambda kv: kv[0])[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        text = str(inner).splitlines()[0] if str(inner) else ""
        return f"{type(inner).__name__}: {text}" + (f" (rank {rank})" if _dist.is_distributed() else "")
    return f"{type(exc).__name__}: {exc}"


# errno values of a file system that has run out of room: no space left, or over a quota.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: BaseException | None) -> bool:
    """Whether a failure was the file system running out of room, wherever DCP wrapped it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return True
        failures = getattr(exc, "failures", None)  # DCP's per-rank wrapper
        if isinstance(failures, dict):
            for wrapped in failures.values():
                if no_space(wrapped[0] if isinstance(wrapped, tuple) else wrapped):
                    return True
        exc = exc.__cause__ or exc.__context__
    return False


class Unreadable(CheckpointError):
    """A checkpoint that verified but whose tensor data the engine refused (a planted pickle...)."""


def choose(directory: Path, entries: list[CheckpointInfo], failed: dict[str, str] | None = None) -> dict[str, Any]:
    """Rank 0: the newest checkpoint that passes the full check, and what was skipped on the way.

    ``failed`` names checkpoints that verified but could not be loaded, with why.
    """
    failed = failed or {}
    skipped = [[i.name, i.reason] for i in entries if not i.complete]
    committed = sorted((i for i in entries if i.complete), key=lambda i: i.step, reverse=True)
    for info in committed:
        if info.name in failed:
            skipped.append([info.name, failed[info.name]])
            continue
        reason = info.reason
        if info.valid:
            try:
                _format.check(info.path, full=True)
                return {"name": info.name, "skipped": skipped, "error": None}
            except Invalid as exc:
                reason = str(exc)
        skipped.append([info.name, reason])
    error = None
    if committed:
        error = f"no valid checkpoint in {directory}: " + "; ".join(f"{n}: {r}" for n, r in skipped)
    return {"name": None, "skipped": skipped, "error": error}


def load_into(state: TrainState, path: Path, manifest: dict[str, Any], *, strict: bool, group: Any,
              rank: int, world: int) -> None:
    """Check that ``state`` fits the checkpoint at ``path``, read its tensors, load everything."""
    saved_shared: dict[str, Any] = manifest["state"]
    saved_ranks: list[dict[str, Any]] = manifest["ranks"]
    saved_local: dict[str, Any] | None = None
    if len(saved_ranks) == world:
        saved_local = saved_ranks[rank]["state"]
    elif strict:
        raise CheckpointError(
            f"{path.name} was written by {len(saved_ranks)} rank(s), this run has {world}: per-rank state "
            "(RNG, data position) cannot be mapped; restore(strict=False) or resume(..., strict=False) "
            "restores the shared state only")
    current = state.capture()
    problems = _name_problems(current.shared, saved_shared, current.local, saved_local)
    if problems and strict:
        raise CheckpointError(f"{path.name} does not fit this TrainState: {'; '.join(problems)} "
                              "(restore(strict=False) or resume(..., strict=False) restores the objects both have)")
    if problems:
        warnings.warn(f"restoring {path.name} partially: {'; '.join(problems)}", stacklevel=3)
    shared_names = [n for n in current.shared if n in saved_shared]
    local_names = [n for n in current.local if saved_local is not None and n in saved_local]
    enc = Encoder()
    current_trees = {n: enc.encode(current.shared[n], n) for n in shared_names}
    current_trees.update({f"rank{rank}/{n}": enc.encode(current.local[n], f"rank{rank}/{n}")
                          for n in local_names})
    saved_trees = {n: saved_shared[n] for n in shared_names}
    saved_trees.update({f"rank{rank}/{n}": saved_local[n] for n in local_names})  # type: ignore[index]
    mismatch = []
    for key, tree in saved_trees.items():
        mismatch += _fit_problems(key, state, tree, current_trees[key], enc.tensors)
    if mismatch:
        raise CheckpointError(f"{path.name} does not fit: {'; '.join(mismatch)}")
    engine_tensors = (manifest.get("engine") or {}).get("tensors", {})
    targets: dict[str, torch.Tensor] = {}
    for tree in saved_trees.values():
        for ref in tensor_refs(tree):
            key = ref["key"]
            if key not in engine_tensors:
                raise CheckpointError(f"{path.name}: tensor {key!r} is in the manifest but not in the data")
            cur = enc.tensors.get(key)
            saved_dtype = dtype_from_name(ref["dtype"])
            if cur is not None and _engine._is_dtensor(cur):
                targets[key] = torch.empty_like(cur.detach())
            elif cur is not None and list(cur.shape) == ref["shape"] and cur.dtype == saved_dtype:
                # Straight into the live tensor (a parameter, a moment buffer): no second copy of
                # the model in memory. Checksums were verified above, so a failure here is I/O.
                targets[key] = cur.detach()
            else:  # e.g. optimizer moments that a fresh optimizer has not created yet
                sharded = sharded_target(dict(state.items()), key, ref["shape"], saved_dtype) if cur is None else None
                targets[key] = sharded if sharded is not None else empty_in_order(
                    ref["shape"], cur.dtype if cur is not None else saved_dtype, ref.get("order"))
    try:
        _engine.load_tensors(targets, path, manifest["engine"], group)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise Unreadable(f"its tensor data cannot be read: {root_cause(exc)}") from exc
    shared = {n: decode(saved_shared[n], targets) for n in shared_names}
    local = None
    if saved_local is not None:
        local = {n: decode(saved_local[n], targets) for n in local_names}
    state.apply(shared, local, step=int(manifest["step"]), epoch=int(manifest.get("epoch", 0)))


def _name_problems(cur_shared: dict, saved_shared: dict, cur_local: dict, saved_local: dict | None) -> list[str]:
    problems = []
    cur = set(cur_shared) | ({n for n in cur_local if n != RNG} if saved_local is not None else set())
    saved = set(saved_shared) | ({n for n in saved_local if n != RNG} if saved_local is not None else set())
    if cur - saved:
        problems.append(f"no state saved for {', '.join(sorted(cur - saved))}")
    if saved - cur:
        problems.append(f"saved state for {', '.join(sorted(saved - cur))} has no object here")
    return problems


def _entries(tree: Any) -> dict[Any, Any] | None:
    """The top-level entries of an encoded mapping, or None if it is not one."""
    if isinstance(tree, dict) and tree.get("__tg__") in ("odict", "dict"):
        return {_key(k): v for k, v in tree["v"]}
    if isinstance(tree, dict) and "__tg__" not in tree:
        return dict(tree)
    return None


def _key(k: Any) -> Any:
    return json.dumps(k, sort_keys=True) if isinstance(k, (dict, list)) else k


def _resized_on_load(model: torch.nn.Module, sd_key: str, shape: list[int], dtype: torch.dtype) -> bool:
    """Whether the submodule holding ``sd_key`` takes a tensor of the saved ``shape`` by resizing its
    own as it loads (torch.ao's observers and fake-quantizers: their per-channel ``min_val``,
    ``scale``, ... start empty or with one element, and both their first forward and their
    ``_load_from_state_dict`` resize them). Tried on a copy of that submodule, so that a module
    that refuses the shape (a BatchNorm of another width) is still named before anything loads."""
    owner_name, _, leaf = sd_key.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return False
    if type(owner)._load_from_state_dict is torch.nn.Module._load_from_state_dict:
        return False  # the default load refuses another shape
    probe = copy.deepcopy(owner)
    entries = probe.state_dict()
    if leaf not in entries:
        return False
    entries[leaf] = torch.zeros(shape, dtype=dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe.load_state_dict(entries, strict=False)
    except Exception:
        return False
    return list(probe.state_dict()[leaf].shape) == shape


def _pruned(have: list[str], lack: list[str]) -> list[str]:
    """Keys of ``lack`` that torch.nn.utils.prune has renamed in ``have`` (``w`` -> ``w_orig``, ``w_mask``)."""
    keys = set(have)
    return [k for k in lack if f"{k}_orig" in keys and f"{k}_mask" in keys]


def _parametrized(have: list[str], lack: list[str]) -> list[str]:
    """Keys of ``lack`` that torch.nn.utils.parametrize has moved in ``have`` (``m.w`` ->
    ``m.parametrizations.w.original``, ``original0``... for weight_norm)."""
    out = []
    for k in lack:
        owner, _, leaf = k.rpartition(".")
        moved = f"{owner}.parametrizations.{leaf}.original" if owner else f"parametrizations.{leaf}.original"
        if any(h.startswith(moved) for h in have):
            out.append(k)
    return out


def _transform_hints(missing: list[str], unexpected: list[str]) -> list[str]:
    """What to do when the keys differ because pruning or a parametrization changed the model on
    one side only (a run pruned mid-way, resumed into the model as first built)."""
    hints = []
    if keys := _pruned(unexpected, missing):
        hints.append(f"pruned in the checkpoint (torch.nn.utils.prune: X_orig and X_mask): {', '.join(keys)}; "
                     "apply the same pruning to this model before restoring (the masks are restored)")
    if keys := _pruned(missing, unexpected):
        hints.append(f"pruned here but not in the checkpoint (written before pruning, or after prune.remove): "
                     f"{', '.join(keys)}; restore before pruning, or build the model as it was when saved")
    if keys := _parametrized(unexpected, missing):
        hints.append(f"parametrized in the checkpoint (torch.nn.utils.parametrize): {', '.join(keys)}; register "
                     "the same parametrizations before restoring")
    if keys := _parametrized(missing, unexpected):
        hints.append(f"parametrized here but not in the checkpoint: {', '.join(keys)}; restore before registering "
                     "the parametrizations, or build the model as it was when saved")
    return hints


def _fit_problems(key: str, state: TrainState, saved: Any, current: Any, current_tensors: dict) -> list[str]:
    """Missing, unexpected and mis-shaped keys of a module; mis-shaped tensors of anything else."""
    name = key.split("/", 1)[-1]
    obj = dict(state.items()).get(name)
    problems: list[str] = []
    if isinstance(obj, torch.nn.Module):
        s, c = _entries(saved) or {}, _entries(current) or {}
        missing = [k for k in c if k not in s]
        unexpected = [k for k in s if k not in c]
        if missing:
            problems.append(f"{name!r} has keys the checkpoint lacks (missing): {', '.join(map(str, missing))}")
        if unexpected:
            problems.append(f"the checkpoint has keys {name!r} lacks (unexpected): {', '.join(map(str, unexpected))}")
        if unexpected and not c:
            problems.append(f"{name!r} has no parameters or buffers yet: a module that makes them on its first call "
                            f"(pyro's AutoNormal and other autoguides) needs that call before "
                            f"the restore, e.g. {name}(x, y) on a batch, then ckpt.resume(state, ...)")
        problems += _transform_hints([str(k) for k in missing], [str(k) for k in unexpected])
    saved_refs = {r["key"]: r for r in tensor_refs(saved)}
    shaped = []
    for ref in tensor_refs(current):
        if ref["key"].rsplit("/", 1)[-1].startswith(SPARSE_PART):
            continue  # a sparse tensor's stored elements, as many as it holds now (see _codec.SPARSE_PART)
        want = saved_refs[ref["key"]]["shape"] if ref["key"] in saved_refs else None
        if want is not None and list(want) != list(ref["shape"]):
            sd_key = ref["key"].split("/", 1)[-1]
            if isinstance(obj, torch.nn.Module) and _resized_on_load(
                    state_holder(obj), sd_key, list(want), dtype_from_name(saved_refs[ref["key"]]["dtype"])):
                continue
            shaped.append(f"{sd_key} (checkpoint {list(want)}, here {list(ref['shape'])})")
    if shaped:
        problems.append(f"mis-shaped in {name!r}: {', '.join(shaped)}")
    return problems
