"""Attributes of a torch class wrapped while any recording is active: wrapped when the first
recorder starts, restored when the last one stops (``_reads``: Tensor methods that read memory
no aten op shows; ``_params``: ``Parameter.__new__``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

_MISSING = object()


class ClassPatch:
    """``wrappers``: attribute name -> a function of the attribute as the class resolves it now,
    returning what to set in its place. ``active`` holds the recorders the wrappers call."""

    def __init__(self, owner: type, wrappers: dict[str, Callable]):
        self.owner, self.wrappers = owner, wrappers
        self.active: list = []
        self._saved: dict[str, object] = {}  # the class's own attributes (or _MISSING) while wrapped
        self._lock = threading.Lock()

    def install(self, recorder) -> None:
        with self._lock:
            if not self.active:
                for name, wrap in self.wrappers.items():
                    self._saved[name] = self.owner.__dict__.get(name, _MISSING)
                    setattr(self.owner, name, wrap(getattr(self.owner, name)))
            self.active.append(recorder)

    def remove(self, recorder) -> None:
        with self._lock:
            if recorder in self.active:
                self.active.remove(recorder)
            if not self.active and self._saved:
                for name, original in self._saved.items():
                    if original is _MISSING:
                        delattr(self.owner, name)
                    else:
                        setattr(self.owner, name, original)
                self._saved.clear()
