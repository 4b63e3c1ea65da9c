"""Whether each buffer of a watched model changed between recordings.

A buffer is state the model keeps beside its weights: BatchNorm's running statistics, MoCo's queue of
negatives and its pointer, DINO's center. No gradient or optimizer says whether a buffer moves, so a
queue that is never enqueued trains on as if nothing were wrong. At each recording the monitor notes,
per buffer of a module in training mode, whether it changed since the previous recording: the
tensor's version counter (bumped by every in-place write) or the tensor itself (an assignment of a
new one, ``self.queue = ...``). Nothing is read from the device: the fact costs a few attribute
reads per buffer.
"""

from __future__ import annotations

import weakref

from torch import nn


class Buffer:
    """One buffer: where its module keeps it (``owner._buffers[attr]``) and what it was at the last
    recording (the tensor, weakly, and its version)."""

    __slots__ = ("name", "owner", "attr", "module", "module_type", "torch_module", "dtype", "shape", "fixed", "last")

    def __init__(self, name: str, module_name: str, owner: nn.Module, attr: str, fixed: bool = False):
        self.name = name
        self.owner = weakref.ref(owner)
        self.attr = attr
        self.module = module_name
        self.module_type = type(owner).__name__
        # torch's own modules (BatchNorm's running statistics, a fake-quantizer's flags) keep buffers
        # whose use torch defines; a module of the user's own keeps what its code says
        self.torch_module = type(owner).__module__.split(".")[0] == "torch"
        t = owner._buffers.get(attr)
        self.dtype = str(t.dtype).removeprefix("torch.") if t is not None else None
        self.shape = list(t.shape) if t is not None else None
        self.fixed = fixed  # a sin-cos position table: constant by design
        self.last: tuple | None = None

    def info(self) -> dict:
        return {"module": self.module, "module_type": self.module_type, "torch_module": self.torch_module,
                "dtype": self.dtype, "shape": self.shape} | ({"fixed": "sin-cos"} if self.fixed else {})


# Written inside the batch-norm kernel, which does not bump their version: left out, rather than
# read as never changing.
_KERNEL_WRITTEN = frozenset({"running_mean", "running_var"})


def buffers_of(module: nn.Module, prefix: str, plain, fixed) -> list[Buffer]:
    """The buffers of ``module`` and its children, named as the parameters are (``prefix`` +
    path); ``plain`` drops wrapper levels from a path, ``fixed(t)`` tells a sin-cos table."""
    out = []
    for mname, m in module.named_modules():
        mname = plain(mname)
        norm = isinstance(m, nn.modules.batchnorm._NormBase)
        for attr, t in m._buffers.items():
            if t is not None and not (norm and attr in _KERNEL_WRITTEN):
                out.append(Buffer(prefix + (f"{mname}.{attr}" if mname else attr), prefix + mname, m, attr, fixed(t)))
    return out


def read(buffers: list[Buffer], step: int, consts: list[tuple]) -> None:
    """Append ``(step, buffer, "buffer", "changed", 0.0 or 1.0)`` for each buffer whose module is in
    training mode and was seen at an earlier recording (in training mode too)."""
    for b in buffers:
        m = b.owner()
        t = m._buffers.get(b.attr) if m is not None else None
        if t is None or not m.training:
            b.last = None
            continue
        try:
            version = t._version
        except RuntimeError:  # an inference tensor keeps no version
            b.last = None
            continue
        last, b.last = b.last, (weakref.ref(t), version)
        if last is not None:
            same = last[0]() is t and last[1] == version
            consts.append((step, b.name, "buffer", "changed", 0.0 if same else 1.0))
