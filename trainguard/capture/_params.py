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
restored when the last one stops (:mod:`trainguard.capture._patch`).
"""

from __future__ import annotations

import torch

from trainguard.capture._patch import ClassPatch


def _wrap(original):  # Parameter.__new__, as the class resolves it (a plain function)
    def __new__(cls, data=None, requires_grad=True):
        p = original(cls, data, requires_grad)
        if isinstance(data, torch.Tensor):
            for rec in _PATCH.active:  # recorders, each with an ``on_alias(source, alias)`` method
                rec.on_alias(data, p)
        return p

    __new__.__wrapped__ = original
    return staticmethod(__new__)


_PATCH = ClassPatch(torch.nn.Parameter, {"__new__": _wrap})
install, remove = _PATCH.install, _PATCH.remove
