"""Python stack capture and interning for the hot path.

A stack is keyed by the (code object id, last instruction) pairs of its frames: a walk of
``f_back`` pointers costs a few microseconds for 30 frames and needs no symbolisation (ids,
because hashing a code object hashes its bytecode). The interner keeps every code object of a
known stack alive, so an id in a known key can never be reused by another code object. Only a
stack never seen before is symbolised (file, line, function) and handed to the writer once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

import trainguard

MAX_DEPTH = 64
_TG_DIR = os.path.dirname(os.path.abspath(trainguard.__file__)) + os.sep
# Frames of these modules are trainguard's own machinery, cut from the top of every stack.
_OWN_PREFIX = ("trainguard.capture", "trainguard.store")


class StackInterner:
    def __init__(self, on_new_stack: Callable[[int, list[tuple[str, int, str]]], None] | None = None):
        self._ids: dict[tuple, int] = {}
        self._frames: dict[int, list[tuple[str, int, str]]] = {}
        self._codes: list = []  # keeps the code objects of known keys alive (see module doc)
        self._prefixes: dict[tuple, int] = {}
        self._last_parent = None
        self._last_lasti = -1
        self._last_prefix = 0
        self._on_new = on_new_stack
        # The first id - 1: under the native core, whose own stack table numbers from 1, the
        # stacks interned here (compiled graphs' records) take ids of their own.
        self.id_base = 0
        self._symbolic: dict[tuple, int] = {}  # frames -> id, for stacks known only as text
        self.hints: dict[int, tuple[int, int]] = {}  # id -> frame_hint, of stacks whose ops no module claimed

    def capture(self, skip: int = 1) -> int | None:
        """Intern the caller's stack (minus ``skip`` frames) and return its id.

        Consecutive ops usually come from one Python function (``F.linear`` runs ``t`` then
        ``addmm``; an optimizer runs ten ops per parameter), so the stack above the innermost
        frame is cached per parent activation: while a frame object is held here it cannot be
        replaced by another one at the same address, and an activation's callers never change
        while it waits in one call (the cache holds the caller's instruction too: the same caller
        calling again from another line is another stack).
        """
        try:
            f = sys._getframe(skip)
        except ValueError:  # no Python caller: an op run by the autograd engine's device thread
            return None
        parent = f.f_back
        if parent is self._last_parent and parent is not None and parent.f_lasti == self._last_lasti:
            prefix = self._last_prefix
        else:
            prefix = self._prefix_id(parent)
            self._last_parent = parent
            self._last_lasti = parent.f_lasti if parent is not None else -1
            self._last_prefix = prefix
        k = (prefix, id(f.f_code), f.f_lasti)
        sid = self._ids.get(k)
        if sid is None:
            sid = self._new(k, skip + 1)
        return sid

    def _prefix_id(self, f) -> int:
        first = f
        key = []
        append = key.append
        depth = 0
        while f is not None and depth < MAX_DEPTH:
            append(id(f.f_code))
            append(f.f_lasti)
            f = f.f_back
            depth += 1
        k = tuple(key)
        pid = self._prefixes.get(k)
        if pid is None:
            pid = self._prefixes[k] = len(self._prefixes) + 1
            g = first
            while g is not None and depth > 0:
                self._codes.append(g.f_code)
                g = g.f_back
                depth -= 1
        return pid

    def release_frames(self) -> None:
        """Drop the cached parent frame (at the end of a recording)."""
        self._last_parent = None

    def intern(self, frames: tuple[tuple[str, int, str], ...]) -> int:
        """The id of a stack given as frames (file, line, function), outermost first: the stacks
        of compiled graph nodes, parsed from their ``stack_trace``."""
        sid = self._symbolic.get(frames)
        if sid is None:
            sid = self._symbolic[frames] = self.id_base + len(self._ids) + len(self._symbolic) + 1
            self._frames[sid] = list(frames)
            if self._on_new is not None:
                self._on_new(sid, list(frames))
        return sid

    def _new(self, key: tuple, skip: int) -> int:
        f = sys._getframe(skip)
        frames = []
        depth = 0
        while f is not None and depth < MAX_DEPTH:
            self._codes.append(f.f_code)
            frames.append((f.f_code.co_filename, f.f_lineno or 0, f.f_code.co_name))
            f = f.f_back
            depth += 1
        frames.reverse()  # outermost first
        sid = self.id_base + len(self._ids) + len(self._symbolic) + 1
        self._ids[key] = sid
        self._frames[sid] = frames
        if self._on_new is not None:
            self._on_new(sid, frames)
        return sid

    def frames(self, sid: int | None) -> list[tuple[str, int, str]]:
        return self._frames.get(sid, []) if sid is not None else []


# Methods of torch's own modules (Module.to, _apply, load_state_dict, built-in layers called
# through .forward) are machinery, not a model's code: never an op's module.
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
NO_HINT = (-1, -1)


def frame_hint(f) -> tuple[int, int]:
    """What the frames of a stack say when no module hook says which module runs its op: the
    depths (0: ``f``, the innermost) of the innermost frame running a method of an ``nn.Module``
    (``self`` first; normflows' ``AffineCoupling.inverse``, ``vae.encode``; not torch's own
    methods, not while a module's ``__init__`` builds it), and of the innermost ``forward(ctx,
    ...)`` of a custom ``autograd.Function`` (gpytorch's ``RBFCovariance``); -1 where none.
    A property of the stack (its code objects): read once per new stack, then per op only the
    local at that depth is (see :func:`local0`)."""
    from torch import nn
    from torch.autograd.function import FunctionCtx

    owner = fn = -1
    depth = 0
    while f is not None and depth < MAX_DEPTH:
        code = f.f_code
        if code.co_argcount:
            first = f.f_locals.get(code.co_varnames[0])
            if isinstance(first, nn.Module):
                if code.co_name == "__init__":
                    return -1, fn  # a model being built (probes run there): nobody's method yet
                if owner < 0 and not code.co_filename.startswith((_TORCH_DIR, _TG_DIR)) and (
                        code.co_varnames[0] == "self" or _method_of(first, code)):
                    owner = depth
            elif fn < 0 and code.co_name == "forward" and isinstance(first, FunctionCtx):
                fn = depth
        f = f.f_back
        depth += 1
    return owner, fn


def _method_of(obj, code) -> bool:
    """Whether ``code`` is a method of ``obj``'s class whose first argument is not called ``self``
    (not a function that takes a module first: ``def loss_fn(model, x)``)."""
    for klass in type(obj).__mro__:
        fn = klass.__dict__.get(code.co_name)
        if fn is not None:
            fn = getattr(fn, "__func__", fn)
            while getattr(fn, "__code__", None) is not code and hasattr(fn, "__wrapped__"):
                fn = fn.__wrapped__
            return getattr(fn, "__code__", None) is code
    return False


def local0(f, depth: int):
    """The first argument of the frame ``depth`` frames out from ``f`` (``self``, ``ctx``)."""
    for _ in range(depth):
        f = f.f_back
    return f.f_locals.get(f.f_code.co_varnames[0])


def is_own_frame(frame) -> bool:
    """True when the frame that called into torch is trainguard's capture or store code."""
    name = frame.f_globals.get("__name__", "")
    return name.startswith(_OWN_PREFIX)


def user_frame(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame outside torch, trainguard and the standard library."""
    from trainguard.store import is_user_file

    for fr in reversed(frames):
        if is_user_file(fr[0]):
            return fr
    return None
