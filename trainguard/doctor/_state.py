"""Leaving the caller's state as it was, and the batch plumbing every check shares.

Every doctor check trains, perturbs or converts the caller's model. :func:`preserved` takes a
snapshot of everything a check may touch (parameter and buffer values, dtypes, devices and
storages, gradients, ``requires_grad``, train/eval flags, an optimizer's state, every RNG, a data
loader's generator, grad mode) and puts it back on exit, also when the check raises.
Parameters are restored in place, so an optimizer that holds them keeps working.
"""

from __future__ import annotations

import copy
import inspect
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from trainguard._errors import TrainguardError


class DoctorInputError(TrainguardError, ValueError):
    """A doctor check was given something it cannot use (empty data, wrong type, bad shape)."""


# ---------------------------------------------------------------------- state snapshot
class _Snapshot:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, data: Any) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.params = []
        # unique parameters, shared ones once; all of them, whatever the model's own parameters()
        # returns (MAML-Pytorch's Learner lists its vars, not the running statistics of vars_bn)
        for p in nn.Module.parameters(model):
            grad = p.grad
            self.params.append(
                (p, p.data, p.detach().clone(), p.requires_grad, grad, None if grad is None else grad.detach().clone())
            )
        self.buffers = Buffers(model)
        self.optimizer = optimizer
        self.opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.rng = _rng_state()
        self.grad_enabled = torch.is_grad_enabled()
        self.generators = [g for g in _data_generators(data)]
        self.gen_states = [g.get_state() for g in self.generators]

    def restore(self) -> None:
        torch.set_grad_enabled(self.grad_enabled)
        with torch.no_grad():
            for p, data, saved, requires_grad, grad, saved_grad in self.params:
                if p.data.data_ptr() != data.data_ptr() or p.dtype != data.dtype or p.shape != data.shape:
                    p.data = data  # a check converted it (dtype, device): put the original storage back
                p.copy_(saved)
                p.requires_grad_(requires_grad)
                if grad is None:
                    p.grad = None
                else:
                    grad.copy_(saved_grad)
                    p.grad = grad
            self.buffers.restore()
        for m, training in self.modes:
            m.training = training
        if self.optimizer is not None and self.opt_state is not None:
            self.optimizer.load_state_dict(self.opt_state)
        for g, state in zip(self.generators, self.gen_states):
            g.set_state(state)
        _set_rng_state(self.rng)


class Buffers:
    """Every module's buffers, the objects and their values: ``restore()`` puts both back (a
    forward that updates a buffer in place, an EMA codebook, or registers a new one)."""

    def __init__(self, *models: nn.Module) -> None:
        self.saved = [
            (m, dict(m._buffers), {k: (None if b is None else b.detach().clone()) for k, b in m._buffers.items()})
            for model in models for m in model.modules()
        ]

    def restore(self) -> None:
        with torch.no_grad():
            for m, objects, values in self.saved:
                m._buffers.clear()
                m._buffers.update(objects)
                for k, b in objects.items():
                    if b is not None:
                        if b.shape != values[k].shape:  # resized in place (a per-channel observer's min_val)
                            b.resize_(values[k].shape)
                        b.copy_(values[k])


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.random.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_host_generators(seed: int) -> None:
    """Seed Python's and NumPy's global generators: a model may draw from them in its forward
    (bentrevett/pytorch-seq2seq decides teacher forcing with ``random.random()``), and evaluations
    meant to draw alike must seed them as they seed torch's. The checks' ``preserved`` puts them back."""
    random.seed(seed)
    np.random.seed(seed)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Every global generator seeded with ``seed`` (torch's, NumPy's, Python's), and put back after."""
    saved = _rng_state()
    try:
        torch.manual_seed(seed)
        seed_host_generators(seed)
        yield
    finally:
        _set_rng_state(saved)


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _data_generators(data: Any) -> Iterator[torch.Generator]:
    """The torch generators a data loader draws its shuffling from, if it owns any."""
    seen: set[int] = set()
    for owner in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None),
                  getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and id(g) not in seen:
            seen.add(id(g))
            yield g


@contextmanager
def preserved(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
              data: Any = None) -> Iterator[None]:
    """Run a block, then put the model, optimizer, RNGs and loader generators back as they were."""
    snap = _Snapshot(model, optimizer, data)
    try:
        yield
    finally:
        snap.restore()


class _Touches(torch.overrides.TorchFunctionMode):
    """Whether any torch call inside the block is given one of ``tensors`` (or a view made of them)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.ids = {id(t) for t in tensors}
        self.hit = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.hit:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            self.hit = any(id(a) in self.ids for a in leaves)
        return func(*args, **(kwargs or {}))


def loss_reads_targets(model: nn.Module, batch: Any, loss_fn: Callable) -> bool:
    """Whether ``loss_fn(model(inputs), targets)`` touches the targets at all: a self-supervised
    loss (MAE's: ``for samples, _ in loader``) never does. True when it cannot be told (the forward
    or the loss raises, targets that hold no tensor): the targets are then judged as labels."""
    inputs, targets = split_batch(batch)
    leaves = [t for t in torch.utils._pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    if not leaves:
        return True
    device = model_device(model)
    try:
        with preserved(model), torch.no_grad():
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            outputs = model(inputs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
            with _Touches(leaves) as probe:
                loss_fn(outputs, targets)
    except Exception:
        return True
    return probe.hit


# ---------------------------------------------------------------------- argument checks
def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise DoctorInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def check_loss_fn(loss_fn: Any) -> Callable:
    if not callable(loss_fn):
        raise DoctorInputError(f"loss_fn must be callable as loss_fn(outputs, targets), got {type(loss_fn).__name__}")
    return loss_fn


def check_positive(name: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise DoctorInputError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")


# ---------------------------------------------------------------------- batches
def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` from a batch, with a clear error for anything else."""
    if isinstance(batch, dict) or not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise DoctorInputError(
            f"a batch must be a pair (inputs, targets), got {_describe(batch)}"
        )
    inputs, targets = batch
    n_in, n_t = batch_size(inputs), batch_size(targets)
    if n_in is None:
        raise DoctorInputError(f"batch inputs hold no tensor, got {_describe(inputs)}")
    if n_in == 0:
        raise DoctorInputError("the batch is empty (0 samples)")
    if n_t is not None and n_t != n_in:
        raise DoctorInputError(
            f"batch inputs have {n_in} samples but targets have {n_t} (dim 0 of the first tensor of each: "
            f"{_describe(first_tensor(inputs))}, {_describe(first_tensor(targets))}; a list of one tensor per "
            "sample, as torchvision's detection models take, is not a batch the doctor can split)"
        )
    return inputs, targets


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {list(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return type(obj).__name__


# ---------------------------------------------------------------------- graphs
# PyTorch Geometric's batches, duck-typed (trainguard imports no PyG): a ``Data`` is one graph
# whose samples are its nodes (full-batch node classification, examples/gcn.py: a label per node);
# a ``Batch`` is graphs collated by its DataLoader (examples/mutag_gin.py: a label per graph).
def is_graph(obj: Any) -> bool:
    """A PyG ``Data``: tensors in attributes, ``apply(fn)`` over them, ``subgraph(nodes)``."""
    return (not isinstance(obj, (torch.Tensor, tuple, list, dict)) and callable(getattr(obj, "apply", None))
            and callable(getattr(obj, "subgraph", None)) and isinstance(getattr(obj, "num_nodes", None), int))


def is_graph_batch(obj: Any) -> bool:
    """A PyG ``Batch`` of several graphs: ``num_graphs``, ``to_data_list()``, ``from_data_list``."""
    return (is_graph(obj) and isinstance(getattr(obj, "num_graphs", None), int)
            and callable(getattr(obj, "to_data_list", None)) and callable(getattr(type(obj), "from_data_list", None)))


def _take_graphs(obj: Any, n: int) -> Any:
    """The first ``n`` graphs of a batch, or the subgraph of the first ``n`` nodes of one graph."""
    if is_graph_batch(obj):
        return type(obj).from_data_list(obj.to_data_list()[:n]) if n < obj.num_graphs else obj
    return obj.subgraph(torch.arange(n)) if n < obj.num_nodes else obj


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if is_graph(obj):
        return copy.copy(obj).apply(fn)  # a copy of its attributes: the caller's graph keeps its tensors
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if is_graph(obj):
        return obj.x if isinstance(getattr(obj, "x", None), torch.Tensor) else None  # the node features
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = list(obj.values())
    else:
        return None
    for o in items:
        t = first_tensor(o)
        if t is not None:
            return t
    return None


def batch_size(obj: Any) -> int | None:
    if is_graph(obj):
        return obj.num_graphs if is_graph_batch(obj) else obj.num_nodes
    t = first_tensor(obj)
    if t is None:
        return None
    return int(t.shape[0]) if t.dim() > 0 else 1


def take(obj: Any, n: int) -> Any:
    """The first ``n`` samples of a batch (tensors sliced along dim 0)."""
    if is_graph(obj):
        return _take_graphs(obj, n)
    if isinstance(obj, (tuple, list, dict)) and any(is_graph(o) for o in (obj.values() if isinstance(obj, dict) else obj)):
        raise DoctorInputError("a graph among several inputs cannot be cut to fewer samples: pass the graph alone "
                               "as the inputs, or max_samples=None")
    size = batch_size(obj)
    return map_tensors(obj, lambda t: t[:n] if t.dim() > 0 and t.shape[0] == size else t)


def model_device(model: nn.Module) -> torch.device:
    for t in nn.Module.parameters(model):
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def sparse_embeddings(model: nn.Module) -> list[str]:
    """Names of the trainable ``sparse=True`` embeddings of ``model`` (sparse COO gradients)."""
    return [name or "(root)" for name, m in model.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]


def make_optimizer(spec: Any, params: list[nn.Parameter], default: Callable,
                   model: nn.Module | None = None) -> tuple[torch.optim.Optimizer, bool]:
    """``(optimizer, given)``: the caller's optimizer instance (``given``), or one built by a
    factory (``params -> Optimizer``) or the default factory (Adam), which cannot step the sparse
    gradients of ``model``'s ``sparse=True`` embeddings: then the error names a factory that can."""
    if isinstance(spec, torch.optim.Optimizer):
        return spec, True
    if spec is None and model is not None:
        sparse = sparse_embeddings(model)
        if sparse:
            raise DoctorInputError(
                f"{', '.join(sparse[:3])}{' ...' if len(sparse) > 3 else ''}: sparse=True embeddings have sparse "
                "gradients, which the doctor's default Adam cannot step (nor SparseAdam the dense ones): pass "
                "optimizer_factory, e.g. lambda params: torch.optim.Adagrad(params, lr=0.01) (Adagrad and SGD "
                "step sparse and dense gradients alike)"
            )
    factory = spec if spec is not None else default
    if not callable(factory):
        raise DoctorInputError(
            f"optimizer_factory must be callable as factory(params) or an optimizer, got {type(factory).__name__}"
        )
    opt = factory(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise DoctorInputError(f"optimizer_factory returned {type(opt).__name__}, expected a torch.optim.Optimizer")
    return opt, False


def as_float(loss: Any) -> torch.Tensor:
    """The loss as a scalar tensor, with a clear error when loss_fn returns something else."""
    if not isinstance(loss, torch.Tensor):
        raise DoctorInputError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise DoctorInputError(
            f"loss_fn must return a scalar, got a tensor of shape {list(loss.shape)} (reduction='none'?)"
        )
    return loss.reshape(())


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, evaluate: Callable[[], torch.Tensor]) -> None:
    """``opt.step()`` after ``loss.backward()``; an optimizer whose ``step`` requires a closure
    (LBFGS) gets one: its first call returns ``loss``, whose gradients are in place, and later calls
    (the moved weights, line-search trial points) run ``evaluate()`` and its backward again."""
    param = inspect.signature(opt.step).parameters.get("closure")
    if param is None or param.default is not inspect.Parameter.empty:
        opt.step()
        return
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1:
            return loss
        opt.zero_grad(set_to_none=True)
        again = as_float(evaluate())
        again.backward()
        return again

    opt.step(closure)
