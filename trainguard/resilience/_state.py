"""TrainState: everything a resumed run needs to continue exactly where the old one stopped."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from trainguard._errors import CheckpointError
from trainguard.resilience import _rng
from trainguard.resilience._epochs import SamplerEpoch, has_epoch
from trainguard.resilience._grads import AcceleratorCount, is_accelerator
from trainguard.resilience._loader import ResumableLoader, framework_inner
from trainguard.resilience._plain import PlainAttrs, plain_attrs
from trainguard.resilience._wrappers import unwrapped

RNG = "rng"  # the per-rank entry holding the process-wide generators
_RESERVED = frozenset({"step", "epoch", RNG})


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def state_holder(obj: Any) -> Any:
    """The object whose state a checkpoint keeps: a model, not the wrapper around it that names
    every key under a prefix (torch.compile's ``_orig_mod.``, DataParallel's and DDP's
    ``module.``, opacus' GradSampleModule's ``_module.``), so that a checkpoint fits the model
    compiled or not, wrapped or not."""
    return unwrapped(obj)


def _torch_state_inside(name: str, obj: Any) -> str | None:
    """What to hold instead of an object that has no state_dict() but keeps modules, optimizers or
    trained tensors as attributes (a stable-baselines3 algorithm: ``model.policy``,
    ``model.policy.optimizer``, SAC's ``log_ent_coef``), and what else it keeps that no
    checkpoint would save (a replay buffer's NumPy arrays); None when it keeps no torch state."""
    try:
        attrs = [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
    except TypeError:
        return None
    seen: set[int] = set()
    held, tensors, other = [], [], []
    for attr, value in attrs:
        if isinstance(value, torch.nn.Module):
            if id(value) in seen:
                continue  # an alias of a part of a module already held (SB3's model.critic)
            held.append((attr, f"{name}.{attr}"))
            for path, sub in value.named_modules():
                seen.add(id(sub))
                for k, v in vars(sub).items():
                    if isinstance(v, torch.optim.Optimizer) and id(v) not in seen:
                        seen.add(id(v))
                        full = ".".join(x for x in (attr, path, k) if x)
                        held.append((full.replace(".", "_"), f"{name}.{full}"))
        elif isinstance(value, torch.optim.Optimizer) and id(value) not in seen:
            seen.add(id(value))
            held.append((attr, f"{name}.{attr}"))
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            tensors.append((attr, f"torch.nn.ParameterList([{name}.{attr}])"))
        elif any(len(getattr(v, "shape", ())) >= 2 and type(v).__module__ == "numpy"
                 for v in getattr(value, "__dict__", {}).values()):  # a buffer of transitions, not a space's bounds
            other.append(f"{attr} ({type(value).__name__})")
    if not held:
        return None
    args = ", ".join(f"{k}={v}" for k, v in held + tensors)
    text = f"which keeps its torch state in attributes: hold those, TrainState({args})"
    if other:
        text += (f"; {', '.join(other)}, of NumPy arrays, and its counters and environments have no state_dict() "
                 "and are not saved unless an object of yours holds them (docs/checkpointing.md, reinforcement "
                 "learning)")
    return text


def _is_stateful_dataloader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and _stateful(obj)


@dataclass
class Captured:
    """A state's content at one moment: ``shared`` is the same on every rank (model, optimizer,
    scheduler...), ``local`` differs per rank (RNG, data position)."""

    shared: dict[str, Any]
    local: dict[str, Any]
    step: int
    epoch: int


# TrainState.apply is loading state now (a checkpoint's restore, the guard's rewind): the model's
# load_state_dict then is trainguard's own, which the step clock announces (_steps.restored).
_applying = 0


def applying() -> bool:
    """Whether a :class:`TrainState` is loading restored state into its objects now."""
    return _applying > 0


class TrainState:
    """The whole training state, saved and restored by :class:`CheckpointManager`.

    Pass every object with ``state_dict()`` / ``load_state_dict()`` by name: model, optimizer,
    LR scheduler, ``GradScaler``, data loaders and samplers, your own objects (one without
    ``state_dict()`` whose attributes are all plain numbers, strings and bools, such as an early
    stopping's counter and best score, is saved by those attributes); also any
    ``torch.Generator`` you draw from, and samplers whose order follows ``set_epoch()``
    (``DistributedSampler``; their epoch is saved and set again on restore). trainguard adds its
    own ``step`` and ``epoch`` counters and every process-wide RNG: Python ``random``, NumPy's
    global generator, torch's CPU generator and each initialised CUDA device's.

    A plain ``DataLoader`` is wrapped in a :class:`ResumableLoader`; iterate ``state.<name>``
    (not the original loader) so that a restore can continue mid-epoch. torchdata's
    ``StatefulDataLoader`` is used as it is. Loaders, samplers and generators are saved per rank;
    everything else once (replicated or sharded tensors go through the engine, which dedups).

    Example::

        state = tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)
        for x, y in state.loader:
            ...
    """

    def __init__(self, **stateful: Any):
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "_local", frozenset())
        for name, obj in stateful.items():
            self._hold(name, obj)
        self.step = 0
        self.epoch = 0

    def _hold(self, name: str, obj: Any) -> None:
        if name.startswith("_") or name in _RESERVED or hasattr(TrainState, name):
            raise ValueError(f"{name!r} is reserved in TrainState, choose another name")
        if (isinstance(obj, DataLoader) and not _stateful(obj)) or framework_inner(obj) is not None:
            obj = ResumableLoader(obj)
        elif not _stateful(obj) and has_epoch(obj):
            obj = SamplerEpoch(obj)
        elif is_accelerator(obj):
            obj = AcceleratorCount(obj)
        elif plain_attrs(obj) is not None:
            obj = PlainAttrs(obj)  # Time-Series-Library's EarlyStopping: counters, no state_dict()
        if not (_stateful(obj) or isinstance(obj, torch.Generator)):
            got = type(obj).__name__
            if isinstance(obj, (list, tuple)) and obj and all(_stateful(o) for o in obj):
                # two optimizers (Muon beside AdamW), a model's parts: each is saved under a name
                names = ", ".join(f"{name}{i}=..." for i in range(len(obj)))
                got = (f"{got} of {len(obj)} {', '.join(type(o).__name__ for o in obj)}: pass each under a name "
                       f"of its own, TrainState({names})")
            elif callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None)):
                # pyro.optim's PyroOptim keeps its state by parameter name behind these two
                got = (f"{got}, which has get_state()/set_state(): pass an object whose state_dict() returns "
                       f"{name}.get_state() and whose load_state_dict(s) calls {name}.set_state(s) (pyro: see "
                       "docs/integrations.md#pyro)")
            elif (inside := _torch_state_inside(name, obj)) is not None:
                got = f"{got}, {inside}"
            elif type(obj).__module__.startswith("keras.") and callable(getattr(obj, "apply", None)):
                got = (f"{got}, a Keras optimizer: its state is Keras Variables, with no state_dict(); "
                       "to checkpoint model.fit use Keras' keras.callbacks.BackupAndRestore, or train the "
                       "model (a torch Module on KERAS_BACKEND=torch) in a torch loop with a torch.optim "
                       "optimizer over model.parameters() and hold that (docs/integrations.md#keras-3-torch-backend)")
            raise TypeError(
                f"TrainState({name}=...) needs an object with state_dict() and load_state_dict(), "
                f"a sampler with set_epoch() and an epoch, or an object whose attributes are all plain "
                f"numbers, strings and bools, got {got}"
            )
        local = isinstance(obj, (DataLoader, ResumableLoader, Sampler, SamplerEpoch, torch.Generator,
                                 AcceleratorCount))
        self._objects[name] = obj
        object.__setattr__(self, "_local", (self._local | {name}) if local else (self._local - {name}))

    def __setattr__(self, name: str, value: Any) -> None:
        # An object assigned later (a new rollout's loader each iteration of an RL loop) is held as
        # one passed to the constructor: saved, restored and handed out by batches().
        if name in ("step", "epoch"):
            object.__setattr__(self, name, value)
        else:
            self._hold(name, value)

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            obj = objects[name]
            if isinstance(obj, AcceleratorCount):
                return obj.accelerator
            if isinstance(obj, PlainAttrs):
                return obj.obj
            return obj.sampler if isinstance(obj, SamplerEpoch) else obj
        raise AttributeError(f"TrainState has no {name!r}; it holds {', '.join(objects) or 'nothing'}")

    def __repr__(self) -> str:
        return f"TrainState(step={self.step}, epoch={self.epoch}, objects={list(self._objects)})"

    def names(self) -> list[str]:
        """The names of the objects held, in the order given."""
        return list(self._objects)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self._objects.items())

    def is_rank_local(self, name: str) -> bool:
        """True for objects whose state differs per rank (loaders, samplers, generators)."""
        return name in self._local

    # -- used by CheckpointManager -----------------------------------------------------------

    def capture(self) -> Captured:
        shared: dict[str, Any] = {}
        local: dict[str, Any] = {}
        for name, obj in self._objects.items():
            try:
                value = _rng.capture_generator(obj) if isinstance(obj, torch.Generator) else state_holder(obj).state_dict()
            except Exception as exc:
                raise CheckpointError(f"{name}.state_dict() failed: {type(exc).__name__}: {exc}") from exc
            (local if name in self._local else shared)[name] = value
        local[RNG] = _rng.capture_global()
        return Captured(shared=shared, local=local, step=int(self.step), epoch=int(self.epoch))

    def apply(self, shared: dict[str, Any], local: dict[str, Any] | None, *, step: int, epoch: int) -> None:
        """Load restored state into the objects; the RNG is restored last, after anything that draws."""
        global _applying
        _applying += 1
        try:
            self._apply(shared, local, step=step, epoch=epoch)
        finally:
            _applying -= 1

    def _apply(self, shared: dict[str, Any], local: dict[str, Any] | None, *, step: int, epoch: int) -> None:
        for name, value in shared.items():
            self._load(name, value)
        for name, value in (local or {}).items():
            if name != RNG:
                self._load(name, value)
        for name in local or {}:
            obj = self._objects.get(name)
            if _is_stateful_dataloader(obj):
                # A StatefulDataLoader draws a base seed from the global generator when it makes
                # the resumed iterator, which an uninterrupted run did not do at this point. Make
                # that iterator now (state_dict() does, and iter() then reuses it) so that the RNG
                # restore below erases the extra draw.
                obj.state_dict()
        self.step = int(step)
        self.epoch = int(epoch)
        if local is not None and RNG in local:
            _rng.restore_global(local[RNG])

    def _load(self, name: str, value: Any) -> None:
        obj = self._objects[name]
        try:
            if isinstance(obj, torch.Generator):
                _rng.restore_generator(obj, value)
            elif isinstance(holder := state_holder(obj), torch.nn.Module):
                _load_module(holder, value)
            else:
                holder.load_state_dict(value)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot restore {name!r}: {exc}") from exc
        except Exception as exc:
            raise CheckpointError(f"cannot restore {name!r}: {type(exc).__name__}: {exc}") from exc


def _load_module(module: torch.nn.Module, value: dict) -> None:
    """``load_state_dict`` of a module whose keys the restore already checked against its own
    ``state_dict()``: a key missing now is one that ``state_dict()`` never writes (torch.ao.pruning's
    ``FakeSparsity`` leaves its mask to the sparsifier's state), which a strict load would demand.
    A module with a ``load_state_dict`` of its own may return None (open_clip's TrainingTask): it
    loaded what its own ``state_dict()`` wrote, with nothing to report."""
    result = module.load_state_dict(value, strict=False)
    if result is not None and (result.unexpected_keys or result.missing_keys):
        written = set(module.state_dict())
        missing = [k for k in result.missing_keys if k in written]
        if result.unexpected_keys or missing:
            raise CheckpointError(f"missing keys {missing}, unexpected keys {result.unexpected_keys}")
