"""Recording the failing step in full, and reading its origin back.

The replayed failing step runs under ``trainguard.record`` (``full_health``, every execution
kept: stacks, modules, producers) into a run of its own inside the guard's run,
``<logdir>/replays/step-<N>``, so that each replay's origin is found by the analysis layer's own
rules (:func:`trainguard.analysis.origin`) on that run alone. Compiled code runs eagerly during
that step (``torch.compiler.set_stance("force_eager")``) so the recorder sees every op with its
source line; training goes back to the compiled code right after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainguard.analysis import Link, Origin, origin
from trainguard.capture import Recorder
from trainguard.guard import _collective
from trainguard.resilience import _rng
from trainguard.store import REPLAYS_DIR, open_run

log = logging.getLogger("trainguard.guard")


def _torchrun_rank() -> int | None:
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return int(rank) if rank is not None and world is not None and int(world) > 1 else None


def rank_dir(path: Path) -> Path:
    """Where one rank writes under ``path`` (``rank-K`` when several ranks run), as the recorder does."""
    rank = _torchrun_rank()
    if rank is not None:
        return path / f"rank-{rank}"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return path / f"rank-{dist.get_rank()}"
    return path


def _eager():
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class StepRecording:
    """One replayed step under full recording: :meth:`start` before its body, :meth:`stop` after."""

    def __init__(self, logdir: Path, step: int):
        base = logdir / REPLAYS_DIR
        name, n = f"step-{step}", 2
        while rank_dir(base / name).exists():  # the same step replayed again (e.g. after lower_lr)
            name, n = f"step-{step}-{n}", n + 1
        self.step = step
        self.relative = f"{REPLAYS_DIR}/{name}"
        self.top = base / name  # the replay's run (rank runs below it under torch.distributed)
        self.path = rank_dir(self.top)
        self._recorder: Recorder | None = None
        self._stance: Any = None
        self.done = False

    def start(self) -> None:
        # The recorder adds rank-K itself when torchrun's variables say so; otherwise say it here.
        logdir = self.top if _torchrun_rank() is not None else self.path
        # One process: the Python backend, summaries at each op, notes which rows of an output hold
        # each new non-finite value (the samples the guard names); one step, so its cost is no
        # matter. Under torch.distributed the default backend (chosen when the Python backend's
        # replay of an FSDP2 job died of SIGSEGV: unrecorded() turned off DTensor's dispatch, so the
        # sentry's _foreach_norm ran on the storage-less wrappers; fixed in capture/_monitor_tap).
        alone = _collective.rank_world()[1] == 1
        self._recorder = Recorder(logdir, mode="full_health", buffer=-1,
                                  **({"backend": "python", "strategy": "immediate"} if alone else {}))
        if alone:
            self._recorder.nonfinite_rows = {}
        self._stance = contextlib.ExitStack()
        self._stance.enter_context(_eager())
        # torch warns that a compiled module called while the recorder's global module hooks are
        # installed fires them twice: true, harmless here, and only for this one step.
        self._stance.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
        try:
            self._recorder.start()
        except BaseException:
            self._stance.close()
            raise

    def stop(self) -> None:
        if self._recorder is None or self.done:
            return
        self.done = True
        try:
            self._recorder.stop(guard_replay={"step": self.step})
        finally:
            self._stance.close()

    def origin(self) -> Origin | None:
        """The origin of the step's first harmful value, or None (a spike, or not reproduced)."""
        try:
            with open_run(self.path) as run:
                return origin(run)
        except Exception as exc:  # the guard goes on without an origin rather than die here
            log.warning("trainguard: could not read the origin from %s: %s", self.path, exc)
            return None

    def culprits(self, origin: dict | None, batch: dict | None) -> dict | None:
        """The samples of the replayed batch whose rows of the origin's output hold its first
        non-finite values: ``{"size", "rows", "samples"}``, or None when the origin's first
        dimension is not the batch's (or the loader does not say which samples it drew)."""
        rows = self._recorder.nonfinite_rows if self._recorder is not None else None
        samples = (batch or {}).get("samples")
        if not origin or not rows or not samples:
            return None
        found = rows.get(origin["origin"]["seq"])
        # Every row bad says nothing of the samples (a first dimension that is the batch's size
        # by chance, e.g. features x batch, holds a bad sample's column in every row).
        if found is None or found[0] != len(samples) or len(found[1]) == found[0]:
            return None
        size, which = found
        return {"size": size, "rows": which, "samples": [samples[r] for r in which]}


def _tensors(obj: Any, where: str = "", depth: int = 0, graph: Any = None):
    """``(where, tensor, graph)`` for each tensor in a batch (nested tuples, lists and mappings,
    PyTorch Geometric's ``Data``/``Batch``, read through ``to_dict()``: ``graph`` is that object, and
    the attributes of other objects, as detr's ``NestedTensor``)."""
    if isinstance(obj, torch.Tensor):
        yield where, obj, graph
    elif depth < 4 and isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{where}[{k!r}]", depth + 1, graph)
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{where}[{i}]", depth + 1, graph)
    elif depth < 4 and callable(getattr(obj, "to_dict", None)):
        attrs = obj.to_dict()
        for k, v in (attrs.items() if isinstance(attrs, Mapping) else ()):
            yield from _tensors(v, f"{where}.{k}", depth + 1, obj)
    elif depth < 4 and isinstance(getattr(obj, "__dict__", None), dict) and not callable(obj):
        # an object holding the batch's tensors as attributes (detr's NestedTensor: images and mask)
        for k, v in vars(obj).items():
            yield from _tensors(v, f"{where}.{k}", depth + 1, graph)


def _graph_rows(graph: Any, t: torch.Tensor, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(samples, rows) with a graph batch's node and edge rows turned into the rows of their graphs
    (``graph.batch`` says each node's): its samples are its graphs, as its loader counts them."""
    n_graphs, owner = getattr(graph, "num_graphs", None), getattr(graph, "batch", None)
    if not isinstance(n_graphs, int) or not isinstance(owner, torch.Tensor) or owner.dim() != 1:
        return int(t.shape[0]), rows
    edges = getattr(graph, "edge_index", None)
    if int(t.shape[0]) == owner.numel():
        return n_graphs, owner[rows].unique()
    if isinstance(edges, torch.Tensor) and edges.dim() == 2 and int(t.shape[0]) == edges.shape[1]:
        return n_graphs, owner[edges[0, rows]].unique()
    return int(t.shape[0]), rows


_ORDER_PROBE = 8  # samples collated twice to tell whether a collate_fn keeps their order


def rows_in_order(loader: Any, samples: list | None) -> bool:
    """Whether row ``r`` of a batch the loader hands out is its sample ``samples[r]``. A
    ``collate_fn`` that sorts the batch by length, longest first, for ``pack_padded_sequence``
    (as torchtext's ``BucketIterator(sort_within_batch=True)`` did for bentrevett/pytorch-seq2seq)
    does not keep them in order: some of the batch's samples, collated as drawn and reversed, give
    outputs that are not each other's flip along a dimension of the samples' count. Torch's own
    collate, a loader that names no samples, or a probe that fails, keep them in order."""
    collate = getattr(loader, "collate_fn", None)
    dataset = getattr(loader, "dataset", None)
    if (collate is None or dataset is None or not samples or getattr(loader, "batch_size", None) is None
            or collate in (torch.utils.data.default_collate, torch.utils.data.default_convert)):
        return True
    idx = list(dict.fromkeys(samples))[:_ORDER_PROBE]
    if len(idx) < 2:
        return True
    saved = _rng.capture_global()  # a dataset may draw random numbers (augmentation): the replay's are not touched
    try:
        with torch.no_grad():
            items = [dataset[i] for i in idx]
            drawn, reversed_ = collate(items), collate(items[::-1])
    except Exception:  # the probe is a guess; the guard goes on as before without it
        return True
    finally:
        _rng.restore_global(saved)
    return _flipped(drawn, reversed_, len(idx))


def _flipped(a: Any, b: Any, k: int) -> bool:
    """Whether ``b``, the ``k`` samples collated in reverse, is ``a`` flipped along the samples: a
    tensor along a dimension of size ``k``, a sequence of ``k`` per-sample items (detr's list of
    target dicts) in reverse order."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        if len(a) != len(b):
            return False
        if len(a) == k and all(_same(x, y) for x, y in zip(a, reversed(b))):
            return True
        return all(_flipped(x, y, k) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_flipped(a[key], b[key], k) for key in a)
    drawn, reversed_ = list(_tensors(a)), list(_tensors(b))
    if len(drawn) != len(reversed_):
        return False
    for (_, x, _), (_, y, _) in zip(drawn, reversed_):
        dims = [d for d in range(x.dim()) if x.shape[d] == k]
        if dims and (x.shape != y.shape or not any(_equal(x.flip(d), y) for d in dims)):
            return False
    return True


def _same(a: Any, b: Any) -> bool:
    drawn, other = list(_tensors(a)), list(_tensors(b))
    return len(drawn) == len(other) and all(x.shape == y.shape and _equal(x, y) for (_, x, _), (_, y, _) in zip(drawn, other))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` with NaN equal to NaN: the probe collates the failing batch, corrupt samples included."""
    if a.dtype != b.dtype or not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def batch_nonfinite(batch: Any, samples: list | None) -> dict | None:
    """Where the failing step's batch itself holds NaN/Inf, before any op of the step ran:
    ``{"size", "rows", "samples", "kinds", "where"}`` over its floating tensors that do, or None.
    ``rows`` are along the first dimension of the first such tensor, merged with those of the
    others of the same first dimension (an input's and a target's); in a graph batch, the graphs
    whose nodes or edges hold them. ``samples`` the loader's
    indices of those rows when it says them and the first dimension is the batch's. Run once, for
    the replayed step (a sync on an accelerator, as the replay is anyway)."""
    found: dict | None = None
    for where, t, graph in _tensors(batch):
        if not (t.is_floating_point() or t.is_complex()) or t.layout != torch.strided or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t)
        if not bool(bad.any()):
            continue
        kinds = (["nan"] if bool(torch.isnan(t).any()) else []) + (["inf"] if bool(torch.isinf(t).any()) else [])
        if t.dim() == 0:
            if found is None:
                return {"size": None, "rows": [], "samples": [], "kinds": kinds, "where": where}
            continue
        rows = bad.reshape(t.shape[0], -1).any(1).nonzero().flatten()
        size = int(t.shape[0])
        if graph is not None:
            size, rows = _graph_rows(graph, t, rows)
        if found is None:
            found = {"size": size, "rows": set(), "kinds": [], "where": []}
        elif size != found["size"]:
            continue
        found["rows"].update(rows.tolist())
        found["kinds"] += [k for k in kinds if k not in found["kinds"]]
        found["where"].append(where)
    if found is None:
        return None
    size, rows = found["size"], sorted(found["rows"])
    named = samples is not None and len(samples) == size
    return {"size": size, "rows": rows, "samples": [samples[r] for r in rows] if named else [],
            "kinds": sorted(found["kinds"], key=["nan", "inf"].index), "where": " and batch".join(found["where"])}


def index_in_batch(batch: Any, bad: dict, samples: list | None) -> dict | None:
    """Where in the batch an op's index out of range came from (``_raising._out_of_range``: the
    index tensor and the mask of its bad entries): ``{"where", "size", "rows", "samples"}`` of the
    batch's integer tensor it is a view of (``y``, ``y.view(-1)``, ``tokens[:, :-1]``) or an equal
    copy of (``y.long()``), the rows being along that tensor's first dimension; None when it is
    neither (an index the step computed). Cold: only after an op raised on it."""
    t, mask = bad["tensor"], bad["mask"]
    flat = mask.reshape(-1).nonzero().flatten()
    for where, b, _ in _tensors(batch):
        if (b.is_floating_point() or b.is_complex() or b.dtype == torch.bool or b.dim() == 0 or not b.numel()
                or b.device != t.device or b.layout != torch.strided):
            continue
        per = b.numel() // b.shape[0]
        rows = None
        if (b.dtype == t.dtype and b.is_contiguous()
                and b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()):
            at = torch.unravel_index(flat, t.shape) if t.dim() else ()
            offset = sum((a * stride for a, stride in zip(at, t.stride())), torch.zeros_like(flat))
            offset = offset + t.storage_offset() - b.storage_offset()
            if bool(((offset >= 0) & (offset < b.numel())).all()):
                rows = offset // per
        elif b.numel() == t.numel() and torch.equal(b.reshape(-1).to(t.dtype), t.reshape(-1)):
            rows = flat // per
        if rows is not None:
            rows = sorted(set(rows.tolist()))
            named = samples is not None and len(samples) == b.shape[0]
            return {"where": where, "size": int(b.shape[0]), "rows": rows,
                    "samples": [samples[r] for r in rows] if named else []}
    return None


def origin_from_dict(d: dict | None) -> Origin | None:
    """An :class:`Origin` rebuilt from ``Origin.to_dict()`` (as ranks exchange it)."""
    if not d:
        return None
    return Origin(chain=[Link(**link) for link in d["chain"]], summary=d["summary"], suggestion=d["suggestion"])


def short_path(path: str | None) -> str:
    if not path:
        return "?"
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def origin_line(o: dict | None) -> str:
    """``aten.log at model.py:88 — log of an input with 12 zeros``."""
    if not o:
        return "none recorded"
    link = o["origin"]
    where = f" at {short_path(link.get('file'))}:{link.get('line')}" if link.get("file") else ""
    return f"{link['op']}{where} — {link['explanation']}"


def held_before(o: dict | None) -> bool:
    """Whether the origin's NaN came in with a tensor made before the replay, no op of the step
    making it (NaN and no inf, an input no recorded op produced): the data the loop reads with the
    batch, as torchdiffeq's ode_demo.py reads each window from the trajectory it holds by the
    batch's offsets (``true_y[s + i]``). The batch itself holds no NaN, so ``batch_nonfinite`` says
    nothing, and the next batch over the same value fails at the same op and line."""
    if not o:
        return False
    link = o["origin"]
    return (any("nan" in h for h in link.get("health") or ()) and all("inf" not in h for h in link.get("health") or ())
            and any(i.get("kind") not in ("op", "param", "buffer") for i in link.get("inputs") or ()))


def origin_key(o: dict | None) -> tuple | None:
    """What makes two origins the same fault: the op and its source line."""
    if not o:
        return None
    link = o["origin"]
    return (link["op"], link.get("file"), link.get("line"))
