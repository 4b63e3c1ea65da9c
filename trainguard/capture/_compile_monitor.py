"""The monitor's module hooks inside compiled code.

Dynamo traces a module's hooks into the compiled graph, once: a hook that reads Python state
or calls the monitor would break the graph or be frozen at its first trace. Under
``torch.compiler.is_compiling()`` the monitor's hooks therefore only emit
``trainguard::tap(tensors, token, grad)``, an op with no outputs marked as having a side
effect (so no pass removes it), which the compiled code calls with the real tensors at every
step; its kernel hands them to the monitors watching that module (``token``), which do at run
time what their eager hooks do (statistics only at recording steps). ``grad`` is whether grad
mode was on where the hook ran, as the compiled forward runs with it off.

Dynamo does not recompile when hooks are added or removed later, so the monitor's per-layer
hooks, which exist only at its recording steps in eager code, are installed for the duration of
every Dynamo compilation (see :func:`watch`).
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from ._identity import IdentityWeakKeyDict

log = logging.getLogger("trainguard.monitor")

_lib = torch.library.Library("trainguard", "FRAGMENT")
_lib.define("tap(Tensor[] tensors, int token, bool grad) -> ()")

_lock = threading.Lock()
_tokens: IdentityWeakKeyDict = IdentityWeakKeyDict()  # module -> token
_counter = itertools.count(1)
_listeners: dict[int, list[Callable]] = {}  # token -> callbacks(tensors, grad)


def _tap(tensors, token, grad) -> None:
    for fn in _listeners.get(token, ()):
        try:
            fn(tensors, grad)
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: a compiled hook failed")


def _tap_meta(tensors, token, grad) -> None:
    return None


_lib.impl("tap", _tap, "CompositeExplicitAutograd")
_lib.impl("tap", _tap_meta, "Meta")
tap = torch.ops.trainguard.tap.default
torch.fx.node.has_side_effect(tap)


def token(module: torch.nn.Module) -> int:
    """The module's token (the same for every monitor, so a graph traced under one monitor
    serves the next)."""
    with _lock:
        t = _tokens.get(module)
        if t is None:
            t = _tokens[module] = next(_counter)
        return t


def listen(tok: int, fn: Callable) -> None:
    with _lock:
        _listeners.setdefault(tok, []).append(fn)


def unlisten(tok: int, fn: Callable) -> None:
    with _lock:
        fns = _listeners.get(tok)
        if fns and fn in fns:
            fns.remove(fn)
            if not fns:
                del _listeners[tok]


# ---------------------------------------------------------------------- hooks present at compile time
_monitors: weakref.WeakSet = weakref.WeakSet()


def watch(monitor) -> bool:
    """Around every Dynamo compilation, ``monitor.compiling(True/False)`` (installs its layer
    hooks so that they are traced). Registered once Dynamo is imported (a program that never
    compiles never imports it), and again after ``torch._dynamo.reset()``, which clears it.
    Returns whether Dynamo is imported: then the monitor keeps its hooks (a model compiled in
    this step would otherwise be traced with hooks that the next step removes)."""
    _monitors.add(monitor)
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.callback import callback_handler

    with _lock:
        if _on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_start)
            callback_handler.register_end_callback(_on_end)
    return True


def _on_start(args) -> None:
    _each(True)


def _on_end(args) -> None:
    _each(False)


def unwatch(monitor) -> None:
    _monitors.discard(monitor)


def _each(on: bool) -> None:
    for m in list(_monitors):
        try:
            m.compiling(on)
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: preparing hooks for compilation failed")
