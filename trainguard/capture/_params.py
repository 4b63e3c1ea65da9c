"""Parameters made from a tensor: ``nn.Parameter(t)`` is an alias of ``t`` no dispatch mode sees.

``Parameter.__new__`` calls ``Tensor._make_subclass``, which detaches ``t`` into a new tensor
below the Python dispatch key: the dispatch mode never learns that the Parameter holds the
values of the op that made ``t``. For ``Parameter(torch.empty(out, in))`` that op is an
allocation, whose memory is unknown until written, so a read of the Parameter before its
initialiser writes it (torch_geometric's ``glorot``: ``value.data.uniform_(...)``, where
``.data`` is an ``aten.detach`` of the Parameter) looked like a user input holding NaN, and
``check_numerics`` stopped healthy PyG models in their ``__init__``. While a dispatch-mode
recording is active, ``Parameter.__new__`` is wrapped so that the Parameter takes the producer
of the tensor it was made from. (The native core sees ``_make_subclass``'s ``detach`` at
``RecordFunction`` and links the two itself.) Installed once for all active recorders and
restored when the last one stops, as :mod:`trainguard.capture._reads` does.
"""

from __future__ import annotations

import threading

import torch

_active: list = []  # recorders, each with an ``on_alias(source, alias)`` method
_saved: list = []  # the original ``Parameter.__dict__["__new__"]`` while wrapped
_lock = threading.Lock()


def _wrap(original):
    def __new__(cls, data=None, requires_grad=True):
        p = original(cls, data, requires_grad)
        if isinstance(data, torch.Tensor):
            for rec in _active:
                rec.on_alias(data, p)
        return p

    __new__.__wrapped__ = original
    return staticmethod(__new__)


def install(recorder) -> None:
    with _lock:
        if not _active:
            raw = torch.nn.Parameter.__dict__["__new__"]
            _saved.append(raw)
            torch.nn.Parameter.__new__ = _wrap(raw.__func__ if isinstance(raw, staticmethod) else raw)
        _active.append(recorder)


def remove(recorder) -> None:
    with _lock:
        if recorder in _active:
            _active.remove(recorder)
        if not _active and _saved:
            torch.nn.Parameter.__new__ = _saved.pop()
