"""Values the program reads that no aten op shows: ``.tolist()``, ``.numpy()``, printing.

``.item()`` and ``float(t)`` dispatch ``aten._local_scalar_dense`` and are seen by the recorder
like any op; ``tolist``, ``numpy`` and ``repr`` read the memory directly (a dispatch mode never
sees them). While a recording is active these methods of ``torch.Tensor`` are wrapped so that
reading a pending inf makes it harmful (docs/recorder.md, "Harmful, intended, unknown").
Installed once for all active recorders and restored when the last one stops.
"""

from __future__ import annotations

import torch

from trainguard.capture._patch import ClassPatch

_METHODS = ("tolist", "numpy", "__repr__", "__format__", "__array__")


def _wrap(name: str, original):
    # torch prints a tensor with every dispatch mode disabled (torch._tensor_str): the ops that
    # printing runs are not the program's, and the native core does not record them either; nor
    # the detach numpy() runs on the tensor it converts (the dispatch mode does not see it: a
    # `loss.data.numpy()` was a detach of an unknown tensor, an inf "made" there).
    quiet = name in ("__repr__", "numpy", "__array__")

    def read(self, *args, **kwargs):
        for rec in _PATCH.active:  # recorders, each with an ``on_read(tensor)`` method
            rec.on_read(self)
        if quiet:
            from trainguard.capture._native._backend import paused

            with paused():
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    read.__name__ = name
    read.__qualname__ = f"Tensor.{name}"
    read.__doc__ = getattr(original, "__doc__", None)
    read.__wrapped__ = original
    return read


_PATCH = ClassPatch(torch.Tensor, {name: lambda original, name=name: _wrap(name, original) for name in _METHODS})
install, remove = _PATCH.install, _PATCH.remove
