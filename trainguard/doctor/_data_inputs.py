"""Reading a split for validate_data: tensors, arrays, pairs, batch lists, Datasets, DataLoaders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainguard.doctor._state import DoctorInputError, first_tensor, is_graph

# A DataLoader without a length (over a stream) is read for at most this many batches.
UNSIZED_BATCHES = 1000
# Targets with more distinct integer values than this are treated as regression.
MAX_CLASSES = 10_000


_GRAPHS = ("graphs (PyTorch Geometric Data or Batch) are not read by validate_data: pass the node features "
           "and labels as arrays, (data.x, data.y), or per-graph features and labels")


@dataclass
class Split:
    """One split as arrays: ``x`` the samples, ``y`` the targets (None when unlabelled)."""

    name: str
    x: np.ndarray  # (N, ...) samples
    y: np.ndarray | None  # (N, ...) targets
    # the type of targets that are no array and were not read (nn.CTCLoss's (targets, lengths))
    unread_targets: str | None = None

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def flat(self) -> np.ndarray:
        return self.x.reshape(self.n, -1)


def to_numpy(obj: Any, what: str) -> np.ndarray:
    if is_graph(obj):
        raise DoctorInputError(f"{what}: {_GRAPHS}")
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.numpy()
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, (int, float, bool, np.generic)):
        return np.asarray(obj)
    raise DoctorInputError(f"{what} must be a tensor or a NumPy array, got {type(obj).__name__}")


def _stack(items: list[Any], what: str) -> np.ndarray:
    arrays = [to_numpy(i, what) for i in items]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise DoctorInputError(f"{what} have different shapes across samples: {sorted(shapes)[:4]}")
    return np.stack(arrays)


def is_array(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray))


def main_input(inputs: Any) -> Any:
    """The tensor the data checks judge of a batch's inputs: the inputs, or of a tuple or dict of
    several (a forecaster's series beside its time features, a tokenizer's input_ids beside its
    mask) the first tensor, the one the doctor counts samples on (``_state.first_tensor``). A list
    stays what it is: one tensor per sample (torchvision's detection images) is refused where it
    is read. NumPy arrays count as tensors here (Time-Series-Library's datasets hand out arrays)."""
    if not isinstance(inputs, (tuple, dict)):
        return inputs
    t = first_tensor(inputs)
    if t is None:
        t = next((v for v in (inputs.values() if isinstance(inputs, dict) else inputs) if isinstance(v, np.ndarray)), None)
    return inputs if t is None else t


def _tuple_inputs(dataset: Any) -> bool:
    """Whether a map-style dataset's samples are ``(inputs, target)`` with several inputs (diffusers'
    ``((noisy, timestep), noise)``): torch's default collate makes a list of those inputs, one
    tensor of the batch each, which is then no list of one tensor per sample."""
    try:
        sample = dataset[0] if len(dataset) else None
    except Exception:  # noqa: BLE001 - an IterableDataset, or one whose items need a key of its own
        return False
    return isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], (tuple, list, dict))


def _structured(target: Any) -> bool:
    """Targets of several tensors (nn.CTCLoss's padded labels and their lengths): no label array."""
    return isinstance(target, (tuple, list, dict)) and not is_array(target)


def _read_batches(obj: Any, name: str, *, sized: bool,
                  collated: bool = False) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    xs, ys = [], []
    unread = None
    for i, batch in enumerate(obj):
        if not sized and i >= UNSIZED_BATCHES:
            break  # a stream may never end: judge its beginning
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs = batch[0]
            if collated and isinstance(inputs, list):
                inputs = tuple(inputs)
            xs.append(to_numpy(main_input(inputs), f"{name} inputs"))
            if _structured(batch[1]):
                unread = type(batch[1]).__name__
            else:
                ys.append(to_numpy(batch[1], f"{name} targets"))
        else:
            xs.append(to_numpy(main_input(batch), f"{name} inputs"))
    if not xs:
        raise DoctorInputError(f"{name} data is empty (the loader yielded no batches)")
    if unread is not None:
        ys = []
    return np.concatenate(xs), (np.concatenate(ys) if ys else None), unread


def read_split(obj: Any, name: str) -> Split:
    """Inputs and targets of one split, whatever form they came in."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset, default_collate

    x: Any
    y: Any = None
    unread: str | None = None
    first = obj[0] if isinstance(obj, (tuple, list)) and obj else None
    if is_graph(obj) or is_graph(first) or (isinstance(first, (tuple, list)) and first and is_graph(first[0])):
        raise DoctorInputError(f"{name} data: {_GRAPHS}")
    if isinstance(obj, (tuple, list)) and len(obj) == 2 and all(is_array(o) for o in obj):
        x, y = obj
    elif (isinstance(obj, (tuple, list)) and obj
          and all(isinstance(b, (tuple, list)) and len(b) == 2 and is_array(main_input(b[0])) for b in obj)):
        # A list of (inputs, targets) batches; inputs may be a tuple or dict, as from any other iterable.
        x, y, unread = _read_batches(obj, name, sized=True)
    elif is_array(obj):
        x = obj
    elif isinstance(obj, TensorDataset):
        x = obj.tensors[0]
        y = obj.tensors[1] if len(obj.tensors) > 1 else None
    elif isinstance(obj, Subset) and isinstance(obj.dataset, TensorDataset):
        idx = torch.as_tensor(list(obj.indices), dtype=torch.long)
        x = obj.dataset.tensors[0][idx]
        y = obj.dataset.tensors[1][idx] if len(obj.dataset.tensors) > 1 else None
    elif isinstance(obj, DataLoader):
        x, y, unread = _read_batches(obj, name, sized=hasattr(obj.dataset, "__len__"),
                             collated=obj.collate_fn is default_collate and _tuple_inputs(obj.dataset))
    elif isinstance(obj, IterableDataset):
        raise DoctorInputError(f"{name} data is an IterableDataset: pass a DataLoader over it, or arrays")
    elif isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
                                       and not isinstance(obj, (str, bytes, dict, tuple, list))):
        n = len(obj)
        if n == 0:
            raise DoctorInputError(f"{name} data is empty (0 samples)")
        items = [obj[i] for i in range(n)]
        if all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            x = _stack([main_input(it[0]) for it in items], f"{name} inputs")
            unread = next((type(it[1]).__name__ for it in items if _structured(it[1])), None)
            y = None if unread else _stack([it[1] for it in items], f"{name} targets")
        else:
            x = _stack(items, f"{name} inputs")
    elif hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes, dict, tuple, list)) and iter(obj) is not obj:
        x, y, unread = _read_batches(obj, name, sized=hasattr(obj, "__len__"))  # batches, as the other checks take them
    else:
        raise DoctorInputError(
            f"{name} data must be a tensor, an array, an (inputs, targets) pair of them, a Dataset, a "
            f"DataLoader or a re-iterable of (inputs, targets) batches; got {type(obj).__name__}"
        )
    x = to_numpy(x, f"{name} inputs")
    y = None if y is None else to_numpy(y, f"{name} targets")
    if x.ndim == 0:
        raise DoctorInputError(f"{name} inputs must have a sample dimension, got a scalar")
    if x.shape[0] == 0:
        raise DoctorInputError(f"{name} data is empty (0 samples)")
    if x.dtype == object or not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DoctorInputError(f"{name} inputs must be numeric, got dtype {x.dtype}")
    if y is not None:
        if y.ndim == 0 or y.shape[0] != x.shape[0]:
            raise DoctorInputError(
                f"{name} inputs have {x.shape[0]} samples but targets have "
                f"{y.shape[0] if y.ndim else 'a scalar'}"
            )
        if y.dtype == object or not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
            raise DoctorInputError(f"{name} targets must be numeric, got dtype {y.dtype}")
    return Split(name, x, y, unread)


def is_classification(splits: list[Split], task: str) -> bool:
    if task != "auto":
        return task == "classification"
    ys = [s.y for s in splits if s.y is not None]
    if not ys or any(y.ndim != 1 for y in ys):
        return False
    if not all(np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_ for y in ys):
        return False
    return len(np.unique(ys[0])) <= MAX_CLASSES
