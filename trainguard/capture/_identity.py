"""A weak-keyed dictionary that compares keys by identity.

``weakref.WeakKeyDictionary`` finds a key through ``==`` of the live referents, which is not
identity for every module: tensordict's ``TensorDictParams`` (the parameters TorchRL's loss
modules hold) is an ``nn.Module`` and a ``TensorDict`` whose ``==`` is elementwise and whose truth
value raises, so a second lookup of one raised out of the training step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IdentityWeakKeyDict(Generic[K, V]):
    """``WeakKeyDictionary`` semantics (an entry goes when its key dies), keys compared by ``is``.

    ``data`` maps ``id(key)`` to the value: a hot path may look a key up as
    ``d.data.get(id(key))`` (an entry is dropped when its key dies, before the id can be reused).
    """

    __slots__ = ("data", "_refs", "__weakref__")

    def __init__(self) -> None:
        self.data: dict[int, V] = {}
        self._refs: dict[int, weakref.ref] = {}

    def _drop_on_death(self, key: K) -> None:
        i = id(key)
        if i in self._refs:
            return
        self_ref = weakref.ref(self)

        def drop(r: weakref.ref) -> None:
            d = self_ref()
            if d is not None and d._refs.get(i) is r:
                del d._refs[i]
                d.data.pop(i, None)

        self._refs[i] = weakref.ref(key, drop)

    def get(self, key: K, default: Any = None) -> Any:
        return self.data.get(id(key), default)

    def __getitem__(self, key: K) -> V:
        try:
            return self.data[id(key)]
        except KeyError:
            raise KeyError(key) from None

    def __setitem__(self, key: K, value: V) -> None:
        self._drop_on_death(key)
        self.data[id(key)] = value

    def __contains__(self, key: object) -> bool:
        return id(key) in self.data

    def pop(self, key: K, *default: Any) -> Any:
        self._refs.pop(id(key), None)
        if default:
            return self.data.pop(id(key), default[0])
        try:
            return self.data.pop(id(key))
        except KeyError:
            raise KeyError(key) from None

    def __delitem__(self, key: K) -> None:
        self.pop(key)

    def setdefault(self, key: K, default: V) -> V:
        if id(key) not in self.data:
            self[key] = default
        return self.data[id(key)]

    def __len__(self) -> int:
        return len(self.data)

    def keys(self) -> Iterator[K]:
        for i in list(self.data):
            k = self._refs[i]()
            if k is not None:
                yield k

    __iter__ = keys

    def items(self) -> Iterator[tuple[K, V]]:
        for k in self.keys():
            yield k, self.data[id(k)]

    def values(self) -> Iterator[V]:
        return iter(list(self.data.values()))
