"""A plain ``DataLoader`` made resumable in the middle of an epoch.

A ``DataLoader`` decides an epoch when its iterator is created: it draws the workers' base seed
from its generator (the global torch generator when it has none) and its sampler draws the
shuffle order. :class:`ResumableLoader` does the same draws in the same order, so an
uninterrupted run sees the batches and random streams the plain loader would give, and it
remembers the generators' states at the start of the epoch. After a restore, the first
``iter()`` replays those draws from the remembered states to rebuild the same order and the same
worker seeds, skips the batches already handed out, and puts the generators back where the
checkpoint left them; the next ``iter()`` starts the following epoch.

A loader a framework made around a ``DataLoader`` (accelerate's ``accelerator.prepare``, Fabric's
``setup_dataloaders``) is iterated through its own ``__iter__``, which moves batches to the
device, sets its sampler's epoch and tells accelerate's gradient accumulation where the epoch
ends; a resumed epoch replays its batches already handed out through that iterator.
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainguard._errors import CheckpointError
from trainguard.resilience import _rng
from trainguard.resilience._epochs import has_epoch

_FAST_FORWARD = ("skip", "replay")
_STATE_VERSION = 1
_END = object()
# Attributes in which a framework's loader counts the epochs it started, and sets its sampler's
# epoch from: accelerate's DataLoaderShard.iteration, Fabric's _FabricDataLoader._num_iter_calls.
_EPOCH_COUNTERS = ("iteration", "_num_iter_calls")


def framework_inner(loader: Any) -> DataLoader | None:
    """The ``DataLoader`` inside a loader a framework made, which iterates its own way; None otherwise.

    accelerate's prepared loaders (``DataLoaderShard``, ``DataLoaderDispatcher``) pass for
    ``DataLoader`` instances and hold one in ``base_dataloader``; their ``state_dict()`` works only
    when made with ``use_stateful_dataloader=True`` (then it is used as it is, not here). Fabric's
    ``_FabricDataLoader`` holds one in ``_dataloader``."""
    inner = vars(loader).get("base_dataloader") if hasattr(loader, "__dict__") else None
    if isinstance(inner, DataLoader) and inner is not loader:
        return None if vars(loader).get("use_stateful_dataloader") else inner
    inner = vars(loader).get("_dataloader") if hasattr(loader, "__dict__") else None
    if isinstance(inner, DataLoader) and callable(getattr(type(loader), "__iter__", None)):
        return inner
    return None


class _OneShotSampler:
    """Hands the underlying loader an index stream that was already started (and maybe advanced)."""

    def __init__(self, indices: Iterator[Any], length: int | None):
        self._indices = indices
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        return self._indices

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("length unknown")
        return self._length


class ResumableLoader:
    """Wrap a ``torch.utils.data.DataLoader`` so that a checkpoint can resume mid-epoch.

    Iterating gives the same batches in the same order, with the same worker seeding, as the
    wrapped loader. ``state_dict()`` records the epoch, how many batches this epoch has handed
    out, and the generator states the epoch was drawn from; after ``load_state_dict()`` the next
    ``iter()`` continues the interrupted epoch with exactly the next batch.

    ``fast_forward`` says how the batches already seen are passed over on resume:

    * ``"skip"`` (default) skips their indices without loading them: cheap, and exact for the
      order and the worker seeds. Random numbers a dataset draws *inside* worker processes
      restart from the workers' seeds rather than from where the interrupted run left them.
    * ``"replay"`` loads them through the workers and drops them, so worker-side randomness
      (random augmentation) continues exactly too, at the cost of reading those batches again.

    With ``num_workers=0`` the dataset draws from the process-wide generators, which the
    checkpoint restores, so skipping is exact and is always used. An ``IterableDataset`` has no
    indices to skip and is always replayed (in-process replays leave the generators untouched). Workers are started per
    epoch (``persistent_workers`` is not kept), because an exact resume needs fresh seeds per epoch.

    TrainState wraps a plain ``DataLoader`` in this class itself; ``state.loader`` returns it.
    """

    def __init__(self, loader: DataLoader, *, fast_forward: str = "skip"):
        inner = framework_inner(loader)
        if inner is None and not isinstance(loader, DataLoader):
            raise TypeError(f"ResumableLoader wraps a torch.utils.data.DataLoader, got {type(loader).__name__}")
        if fast_forward not in _FAST_FORWARD:
            raise ValueError(f"fast_forward must be one of {_FAST_FORWARD}, got {fast_forward!r}")
        base = inner if inner is not None else loader
        gen = base.generator
        if gen is not None and gen.device.type != "cpu":
            raise ValueError(f"the loader's generator must be a CPU generator, got one on {gen.device}")
        if base.persistent_workers and inner is None:
            warnings.warn(
                "ResumableLoader starts workers once per epoch; persistent_workers=True is not kept",
                stacklevel=2,
            )
        self.loader = loader
        self._base: DataLoader = base  # whose sampler and generators draw the order
        self._own_iter = inner is not None  # a framework's loader: iterated through its own __iter__
        self._counters_start: dict[str, int] = {}  # its epoch counters when the current epoch started
        for s in self._all_samplers():
            if getattr(s, "generator", False) is None and isinstance(getattr(s, "initial_seed", None), int):
                # accelerate's SeedableRandomSampler makes this generator at its first __iter__ and
                # seeds it from initial_seed + epoch at each: made now as it would, so that a
                # checkpoint finds the same generators before and after the first epoch.
                s.generator = torch.Generator(device=torch.get_default_device())
                s.generator.manual_seed(s.initial_seed)
        self.fast_forward = fast_forward
        self._epoch = 0
        self._yielded = 0
        self._in_epoch = False
        self._epoch_start: dict[str, Any] | None = None
        self._sampler_epochs: list[int] = []  # the epochs set_epoch() gave the samplers when this epoch was drawn
        self._pending: dict[str, Any] | None = None
        self._token: object = object()
        self._last_indices: list[Any] | None = None
        self._driven: object | None = None  # the token of the epoch loop.batches() is iterating

    # -- the loader's face -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet: avoid recursing during unpickling or a failed __init__
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def epoch(self) -> int:
        """Epochs started so far (the current one included)."""
        return self._epoch

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch is under way: started, and its iterator not run to the end yet."""
        return self._in_epoch

    @property
    def batches_yielded(self) -> int:
        """Batches handed out in the current epoch."""
        return self._yielded

    @property
    def last_indices(self) -> list[Any] | None:
        """The dataset indices of the samples in the batch handed out last (what the guard reports
        for a skipped batch); None for an ``IterableDataset`` or an ``in_order=False`` loader."""
        return self._last_indices

    def __iter__(self) -> Iterator[Any]:
        if self._driven is self._token and self._in_epoch and self._pending is None:
            # ``loop.batches()`` is in the middle of this epoch and will go on with it: this pass
            # is another one over the same data (an evaluation of the training split, as
            # LLMs-from-scratch's evaluate_model runs), which leaves the position alone and draws
            # what the wrapped loader's own pass draws.
            return iter(self.loader)
        pending, self._pending = self._pending, None
        return self._start_epoch(pending)

    def _loop_iter(self) -> Iterator[Any]:
        """The epoch ``loop.batches()`` iterates: other passes during it do not move the position."""
        self._driven = None
        it = iter(self)
        self._driven = self._token
        return it

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "in_epoch": self._in_epoch,
            "yielded": self._yielded,
            "epoch_start": self._epoch_start,
            "generators": [_rng.capture_generator(g) for g in self._generators()],
            "sampler_epochs": self._sampler_epochs,
            "counters": self._counters(),
            "counters_start": self._counters_start,
            "sampler_seeds": [s.initial_seed for s in self._seeded()],
            "shape": self._shape(),
        }

    def _shape(self) -> dict[str, int | None]:
        """What a position in batches means: samples a batch, samples in the dataset."""
        base = self._base
        try:
            size = len(base.dataset)  # type: ignore[arg-type]
        except TypeError:
            size = None
        batch = base.batch_size  # None with a batch_sampler: accelerate's BatchSamplerShard has one
        if batch is None and isinstance(getattr(base.batch_sampler, "batch_size", None), int):
            batch = base.batch_sampler.batch_size
        return {"batch_size": batch, "dataset": size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            if state["version"] != _STATE_VERSION:
                raise CheckpointError(f"unsupported ResumableLoader state version {state['version']!r}")
            gens = self._generators()
            if len(state["generators"]) != len(gens):
                raise CheckpointError(
                    f"the loader had {len(state['generators'])} generator(s) when saved, now {len(gens)}"
                )
            for gen, s in zip(gens, state["generators"], strict=True):
                _rng.restore_generator(gen, s)
            self._epoch = int(state["epoch"])
            self._yielded = int(state["yielded"])
            self._in_epoch = bool(state["in_epoch"])
            self._epoch_start = state["epoch_start"]
            # Absent from states saved before samplers' epochs were kept: then set_epoch() decides.
            self._sampler_epochs = [int(e) for e in state.get("sampler_epochs") or []]
            self._counters_start = {k: int(v) for k, v in (state.get("counters_start") or {}).items()}
            self._set_counters(state.get("counters") or {})
            for s, seed in zip(self._seeded(), state.get("sampler_seeds") or []):
                s.initial_seed = int(seed)  # drawn from torch.initial_seed() when it was made
        except KeyError as exc:
            raise CheckpointError(f"loader state lacks {exc}") from None
        self._check_shape(state.get("shape"))
        self._token = object()  # iterators made before the restore no longer count
        self._pending = dict(state) if self._in_epoch else None
        if self._in_epoch and self._epoch_start is None:
            raise CheckpointError("loader state is mid-epoch but lacks the epoch's generator states")

    def _check_shape(self, saved: dict[str, Any] | None) -> None:
        """Mid-epoch, the position is a number of batches: with another batch size or dataset it
        points at other samples, and the resumed epoch would repeat or skip some."""
        if not saved or not self._in_epoch:
            return
        now = self._shape()
        was = f"{saved.get('batch_size')} samples a batch, {self._yielded} batches into its epoch"
        for key, what in (("batch_size", "batch size"), ("dataset", "dataset size")):
            if saved.get(key) is not None and now[key] is not None and saved[key] != now[key]:
                raise CheckpointError(
                    f"the loader was saved mid-epoch ({was}, of a dataset of {saved.get('dataset')} "
                    f"samples) and now has a {what} of {now[key]}: resuming there would repeat or skip "
                    f"samples; resume with the same loader, or from a checkpoint saved at an epoch's end"
                )

    # -- epochs ------------------------------------------------------------------------------

    def _all_samplers(self) -> list[Any]:
        """The sampler, the batch sampler and its sampler, also inside accelerate's per-rank batch
        sampler. A batch sampler may draw the batches itself (opacus' Poisson sampling, with a
        generator of its own for ``secure_mode``)."""
        loader = self._base
        out = [loader.sampler]
        batch = loader.batch_sampler
        for _ in range(3):  # accelerate's BatchSamplerShard holds the loader's BatchSampler
            if batch is None:
                break
            out.append(batch)
            out.append(getattr(batch, "sampler", None))
            batch = getattr(batch, "batch_sampler", None)
        return out

    def _generators(self) -> list[torch.Generator]:
        """Generators the loader and its samplers own, which the epoch's order is drawn from."""
        found: list[torch.Generator] = []
        candidates = [self._base.generator, vars(self.loader).get("synchronized_generator")]
        candidates += [getattr(s, "generator", None) for s in self._all_samplers()]
        for gen in candidates:
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def _samplers(self) -> list[Any]:
        """Samplers whose order follows ``set_epoch()`` (``DistributedSampler``)."""
        found: list[Any] = []
        for s in self._all_samplers():
            if has_epoch(s) and all(s is not f for f in found):
                found.append(s)
        return found

    def _seeded(self) -> list[Any]:
        """Samplers that seed their order from ``initial_seed`` + epoch (accelerate's SeedableRandomSampler)."""
        found: list[Any] = []
        for s in self._all_samplers():
            if isinstance(getattr(s, "initial_seed", None), int) and all(s is not f for f in found):
                found.append(s)
        return found

    def _counters(self) -> dict[str, int]:
        if not self._own_iter:
            return {}
        own = vars(self.loader)
        return {k: own[k] for k in _EPOCH_COUNTERS if isinstance(own.get(k), int)}

    def _set_counters(self, counters: dict[str, Any]) -> None:
        if self._own_iter:
            for k, v in counters.items():
                if k in _EPOCH_COUNTERS:
                    setattr(self.loader, k, int(v))

    def _start_own_epoch(self, resume: dict[str, Any] | None) -> Iterator[Any]:
        """An epoch of a framework's loader, through its own iterator; resumed, its batches
        already handed out are drawn again from the epoch's generator states and dropped."""
        gens = self._generators()
        samplers = self._samplers()
        if resume is not None:
            for sampler, epoch in zip(samplers, self._sampler_epochs):
                sampler.set_epoch(epoch)
            now = _rng.capture_all(gens)
            _rng.restore_all(self._epoch_start or {}, gens)
            self._set_counters(self._counters_start)
        else:
            self._epoch += 1
            self._yielded = 0
            self._epoch_start = _rng.capture_all(gens)
            self._sampler_epochs = [int(s.epoch) for s in samplers]
            self._counters_start = self._counters()
        self._in_epoch = True
        self._token = token = object()
        self._last_indices = None
        it = iter(self.loader)
        if resume is not None and self._yielded:
            for _ in range(self._yielded):
                if next(it, _END) is _END:
                    break
            # What the replay drew (the order, the workers' seed, in-process loading) the
            # checkpoint's generator states already account for.
            _rng.restore_all(now, gens)
        return self._run(it, token, 0, protect_rng=False, drawn=None)

    def _start_epoch(self, resume: dict[str, Any] | None) -> Iterator[Any]:
        if self._own_iter:
            return self._start_own_epoch(resume)
        loader = self.loader
        gens = self._generators()
        samplers = self._samplers()
        iterable = isinstance(loader.dataset, IterableDataset)
        if resume is not None:
            # The interrupted epoch's order was drawn at the epoch the samplers had then, whether
            # or not the program calls set_epoch() again before continuing it.
            for sampler, epoch in zip(samplers, self._sampler_epochs):
                sampler.set_epoch(epoch)
            now = _rng.capture_all(gens)
            _rng.restore_all(self._epoch_start or {}, gens)
            skip = self._yielded
        else:
            skip = 0
        start = _rng.capture_all(gens)
        # The state the base seed is drawn from; the underlying loader draws it again from a
        # private copy, so that its workers get the same seeds without touching the caller's RNG.
        source = loader.generator
        seed_gen = torch.Generator()
        seed_gen.set_state(source.get_state() if source is not None else torch.get_rng_state())
        torch.empty((), dtype=torch.int64).random_(generator=source)
        if iterable:
            indices: Iterator[Any] | None = None
            length = None
        else:
            index_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
            try:
                length = len(index_sampler)
            except TypeError:
                length = None
            it = iter(index_sampler)
            first = next(it, _END)  # samplers draw their order lazily: make them draw now
            indices = it if first is _END else itertools.chain([first], it)
        if resume is not None:
            _rng.restore_all(now, gens)
        discard = skip
        # Without workers the dataset draws from the process-wide generators, whose restored state
        # already accounts for the batches handed out: skipping their indices is the exact way.
        in_process = loader.num_workers == 0
        if indices is not None and (self.fast_forward == "skip" or in_process) and skip:
            consumed = sum(1 for _ in itertools.islice(indices, skip))
            discard = 0
            if length is not None:
                length = max(length - consumed, 0)
            if resume is not None:
                # A batch sampler that draws each batch when it is asked (opacus' Poisson
                # sampling) drew the skipped ones again just now; the checkpoint's generator
                # states already hold those draws, interleaved with the training's.
                _rng.restore_all(now, gens)
        # The index lists in the order the sampler hands them out; batch k comes from the k-th
        # (in-order loaders), however far the workers prefetch.
        drawn: deque | None = None
        if indices is not None and getattr(loader, "in_order", True):
            drawn = deque()
            indices = _noting(indices, drawn)
        underlying = self._underlying(indices, length, seed_gen)
        if resume is None:
            self._epoch += 1
            self._yielded = 0
            self._epoch_start = start
            self._sampler_epochs = [int(s.epoch) for s in samplers]
        self._in_epoch = True
        self._token = token = object()
        self._last_indices = None
        return self._run(iter(underlying), token, discard, protect_rng=in_process, drawn=drawn)

    def _underlying(self, indices: Iterator[Any] | None, length: int | None,
                    seed_gen: torch.Generator) -> DataLoader:
        loader = self.loader
        kwargs: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": seed_gen,
            "pin_memory_device": loader.pin_memory_device,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        if hasattr(loader, "in_order"):
            kwargs["in_order"] = loader.in_order
        if indices is None:  # IterableDataset: batching is the loader's own
            return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
        sampler = _OneShotSampler(indices, length)
        if loader.batch_sampler is not None:
            return DataLoader(loader.dataset, batch_sampler=sampler, **kwargs)  # type: ignore[arg-type]
        return DataLoader(loader.dataset, batch_size=None, sampler=sampler, **kwargs)  # type: ignore[arg-type]

    def _run(self, it: Iterator[Any], token: object, discard: int, *, protect_rng: bool,
             drawn: deque | None) -> Iterator[Any]:
        if discard:
            # Replaying in this process would draw again what the restored RNG state already drew.
            saved = _rng.capture_global() if protect_rng else None
            for _ in range(discard):
                if next(it, _END) is _END:
                    break
                if drawn:
                    drawn.popleft()
            if saved is not None:
                _rng.restore_global(saved)
        for batch in it:
            if token is self._token:
                self._yielded += 1
                if drawn:
                    idx = drawn.popleft()
                    self._last_indices = list(idx) if isinstance(idx, (list, tuple)) else [idx]
            yield batch
        if token is self._token:
            self._in_epoch = False


def _noting(indices: Iterator[Any], drawn: deque) -> Iterator[Any]:
    for idx in indices:
        drawn.append(idx)
        yield idx
