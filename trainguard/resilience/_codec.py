"""Split a state dict into tensors (for the tensor engine) and JSON (for the manifest).

Nothing here pickles. A value is either plain JSON (``None``, ``bool``, ``int``, ``str``, a finite
``float``, a list, a dict with string keys), or a small tagged object ``{"__tg__": kind, ...}``
that says how to rebuild it exactly: tuples stay tuples, integer dict keys stay integers, NaN and
infinities are spelled out, bytes are base64. A tensor becomes a reference to a key in the flat
tensor dict that goes through ``torch.distributed.checkpoint``. Any other object is refused with
its path, so nothing is silently lost and nothing arbitrary is ever loaded back.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from trainguard._errors import CheckpointError

TAG = "__tg__"
# The last key segment of a sparse tensor's indices and values: their number of stored elements is
# the tensor's state, not its shape, so a restore fits them to nothing (see _restore._fit_problems).
SPARSE_PART = "#sparse_"

# Every tagged kind the decoder accepts; anything else in a manifest is a damaged checkpoint.
_KINDS = frozenset(
    {"float", "tuple", "dict", "odict", "bytes", "tensor", "dtype", "device", "size", "ndarray",
     "npscalar", "set", "frozenset", "sparse"}
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint")
    return dtype


def _segment(key: Any) -> str:
    """One path segment of a tensor key; ``/`` and ``%`` are escaped so segments stay apart."""
    text = key if isinstance(key, str) else repr(key)
    return text.replace("%", "%25").replace("/", "%2F")


class Encoder:
    """Turns nested state into JSON, collecting tensors into ``self.tensors`` by key.

    ``prefix`` starts every tensor key (``"model"``, ``"rank1/loader"``); keys are derived from
    the path to the tensor, so the same structure gives the same keys on every rank — which is
    what lets the engine recognise replicated and sharded tensors.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, prefix: str) -> Any:
        return self._enc(value, [prefix])

    def _tensor_key(self, path: list[Any]) -> str:
        key = "/".join(_segment(p) for p in path)
        if key in self.tensors:
            n = 1
            while f"{key}#{n}" in self.tensors:
                n += 1
            key = f"{key}#{n}"
        return key

    def _enc(self, value: Any, path: list[Any]) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if isinstance(value, float) and type(value) is float:
            if math.isfinite(value):
                return value
            return {TAG: "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo:
            # SGD's momentum over nn.EmbeddingBag(sparse=True) gradients: its indices and values as
            # stored (uncoalesced, in their order: the sums that follow add them up in that order)
            return {TAG: "sparse", "shape": list(value.shape), "coalesced": value.is_coalesced(),
                    "indices": self._enc(value._indices(), [*path, SPARSE_PART + "indices"]),
                    "values": self._enc(value._values(), [*path, SPARSE_PART + "values"])}
        if isinstance(value, torch.Tensor):
            key = self._tensor_key(path)
            self.tensors[key] = value
            ref = {TAG: "tensor", "key": key, "dtype": _dtype_name(value.dtype), "shape": list(value.shape)}
            order = dim_order(value)
            if order is not None:
                ref["order"] = order
            return ref
        if isinstance(value, torch.Size):
            return {TAG: "size", "v": list(value)}
        if isinstance(value, tuple) and (type(value) is tuple or hasattr(value, "_fields")):
            # A namedtuple comes back as a plain tuple: its class is code, not state.
            return {TAG: "tuple", "v": [self._enc(v, [*path, i]) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self._enc(v, [*path, i]) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return self._enc_mapping(value, path)
        if isinstance(value, (set, frozenset)):
            kind = "frozenset" if isinstance(value, frozenset) else "set"
            return {TAG: kind, "v": [self._enc(v, [*path, i]) for i, v in enumerate(value)]}
        if isinstance(value, (bytes, bytearray)):
            return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, torch.dtype):
            return {TAG: "dtype", "v": _dtype_name(value)}
        if isinstance(value, torch.device):
            return {TAG: "device", "v": str(value)}
        if isinstance(value, np.ndarray):
            _check_numpy_dtype(value.dtype, path)
            data = np.ascontiguousarray(value)
            return {TAG: "ndarray", "dtype": data.dtype.str, "shape": list(data.shape),
                    "v": base64.b64encode(data.tobytes()).decode("ascii")}
        if isinstance(value, np.generic):
            _check_numpy_dtype(value.dtype, path)
            return {TAG: "npscalar", "dtype": value.dtype.str,
                    "v": base64.b64encode(value.tobytes()).decode("ascii")}
        if isinstance(value, int):  # an int subclass that is not bool, e.g. an IntEnum
            return int(value)
        if isinstance(value, float):
            return self._enc(float(value), path)
        if isinstance(value, Sequence):
            # A list-like of another class (fastcore's L, fastai's Optimizer hypers) comes back as a
            # list, as a namedtuple does as a tuple: its class is code, its items are the state.
            return [self._enc(v, [*path, i]) for i, v in enumerate(value)]
        where = "/".join(str(p) for p in path)
        raise CheckpointError(
            f"cannot checkpoint a {type(value).__module__}.{type(value).__qualname__} at {where}: "
            "trainguard keeps non-tensor state as JSON and never pickles; return tensors, numbers, "
            "strings, lists, tuples or dicts from state_dict()"
        )

    def _enc_mapping(self, value: Mapping, path: list[Any]) -> Any:
        plain = all(type(k) is str for k in value) and TAG not in value
        if isinstance(value, OrderedDict):
            # nn.Module.state_dict() hangs per-module versions on the dict; load_state_dict reads them.
            meta = getattr(value, "_metadata", None)
            items = [[self._enc(k, [*path, "#key"]), self._enc(v, [*path, k])] for k, v in value.items()]
            out: dict[str, Any] = {TAG: "odict", "v": items}
            if meta is not None:
                out["meta"] = self._enc(dict(meta), [*path, "#meta"])
            return out
        if plain:
            return {k: self._enc(v, [*path, k]) for k, v in value.items()}
        return {TAG: "dict", "v": [[self._enc(k, [*path, "#key"]), self._enc(v, [*path, k])]
                                  for k, v in value.items()]}


def _check_numpy_dtype(dtype: np.dtype, path: list[Any]) -> None:
    if dtype.kind in "OVU" or dtype.hasobject:
        where = "/".join(str(p) for p in path)
        raise CheckpointError(f"cannot checkpoint a numpy array of dtype {dtype} at {where}: only numeric arrays")


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild what :class:`Encoder` encoded, taking tensors from ``tensors`` by key."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {k: decode(v, tensors) for k, v in value.items()}
    kind = value[TAG]
    if kind not in _KINDS:
        raise CheckpointError(f"unknown value kind {kind!r} in checkpoint manifest")
    try:
        return _decode_tagged(kind, value, tensors)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed {kind!r} value in checkpoint manifest: {exc}") from None


def _decode_tagged(kind: str, value: dict, tensors: Mapping[str, torch.Tensor]) -> Any:
    if kind == "float":
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[value["v"]]
    if kind == "tensor":
        key = value["key"]
        if key not in tensors:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint data")
        return tensors[key]
    if kind == "sparse":
        indices, values = decode(value["indices"], tensors), decode(value["values"], tensors)
        if not (isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)):
            raise CheckpointError("malformed sparse tensor in checkpoint manifest")
        return torch.sparse_coo_tensor(indices, values, value["shape"], is_coalesced=bool(value["coalesced"]))
    if kind == "tuple":
        return tuple(decode(v, tensors) for v in value["v"])
    if kind == "size":
        return torch.Size(value["v"])
    if kind in ("dict", "odict"):
        pairs = [(_hashable(decode(k, tensors)), decode(v, tensors)) for k, v in value["v"]]
        if kind == "dict":
            return dict(pairs)
        out = OrderedDict(pairs)
        if "meta" in value:
            out._metadata = decode(value["meta"], tensors)  # type: ignore[attr-defined]
        return out
    if kind in ("set", "frozenset"):
        items = [_hashable(decode(v, tensors)) for v in value["v"]]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "bytes":
        return base64.b64decode(value["v"], validate=True)
    if kind == "dtype":
        return dtype_from_name(value["v"])
    if kind == "device":
        return torch.device(value["v"])
    dtype = np.dtype(value["dtype"])
    _check_numpy_dtype(dtype, ["manifest"])
    raw = base64.b64decode(value["v"], validate=True)
    if kind == "ndarray":
        return np.frombuffer(raw, dtype=dtype).reshape(value["shape"]).copy()
    return np.frombuffer(raw, dtype=dtype)[0]


def _hashable(key: Any) -> Any:
    if isinstance(key, list):  # only tuples are valid keys, and they decode as tuples already
        raise CheckpointError("malformed dict key in checkpoint manifest")
    return key


def dim_order(t: torch.Tensor) -> list[int] | None:
    """The dimensions of a dense tensor stored in another order than row-major (a channels_last
    weight's optimizer moments), outermost first; None when it is row-major or not dense."""
    if t.is_contiguous() or t.layout != torch.strided or _is_wrapped(t):
        return None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    expect = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return None  # overlapping or with gaps: saved and restored row-major
        expect *= t.shape[d]
    return order


def _is_wrapped(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def empty_in_order(shape: list[int], dtype: torch.dtype, order: Any) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dimensions are stored in ``order`` (see :func:`dim_order`)."""
    if not (isinstance(order, list) and sorted(order) == list(range(len(shape)))):
        return torch.empty(shape, dtype=dtype)
    return torch.empty([shape[d] for d in order], dtype=dtype).permute(sorted(range(len(order)), key=order.__getitem__))


def tensor_refs(value: Any) -> list[dict]:
    """Every tensor reference in an encoded tree, in order."""
    out: list[dict] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if v.get(TAG) == "tensor":
                out.append(v)
            else:
                for x in v.values():
                    walk(x)

    walk(value)
    return out
