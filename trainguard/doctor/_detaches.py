"""Where the forward of a gradient check cuts the graph with ``.detach()``.

A parameter whose gradient disagrees with finite differences because a ``.detach()`` lies on one
of its paths to the loss (nerf-pytorch's ``z_samples.detach()``: the coarse network places the
fine network's samples, which carry no gradient; a straight-through estimator) is wrong by
design or by mistake; only the line tells which, so the finding names it. The check also measures
the finite differences again with each detached value held at what the first forward detached
(``HeldDetaches``): where they then agree, autograd's gradient is exact for the graph the code
builds, and the cut is the whole difference.
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Graph nodes walked back from one detached tensor (a deep model's forward has thousands).
MAX_NODES = 20_000
# Detach sites kept per forward: a loop detaching per step repeats one line.
MAX_SITES = 32
# Detached values kept from the first forward to hold in later ones (more: none is held).
MAX_HELD = 256

_SKIP = (os.sep + "torch" + os.sep, os.sep + "trainguard" + os.sep)


def _user_frame() -> tuple[str, int, str] | None:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIP):
            return name, f.f_lineno, linecache.getline(name, f.f_lineno).strip()
        f = f.f_back
    return None


def _leaves(t: torch.Tensor, ids: dict[int, str]) -> set[str]:
    """The names of the parameters among ``ids`` whose values ``t`` was computed from."""
    if id(t) in ids:
        return {ids[id(t)]}
    out: set[str] = set()
    todo, seen = [t.grad_fn], set()
    while todo and len(seen) < MAX_NODES:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad
        if var is not None and id(var) in ids:
            out.add(ids[id(var)])
        todo += [n for n, _ in node.next_functions]
    return out


class DetachWatch(TorchFunctionMode):
    """Records each ``.detach()`` (``torch.detach``) of a tensor computed from the parameters
    ``named`` (name -> parameter): ``sites`` is a list of {file, line, code, params}."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.ids = {id(p): n for n, p in named.items()}
        self.sites: list[dict[str, Any]] = []
        # every detach's output in call order (None where its input needed no gradient), for HeldDetaches
        self.outputs: list[torch.Tensor | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not ((func is torch.Tensor.detach or func is torch.detach) and args and isinstance(args[0], torch.Tensor)):
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if len(self.outputs) <= MAX_HELD:
            self.outputs.append(out.clone() if args[0].requires_grad else None)
        if args[0].requires_grad and len(self.sites) < MAX_SITES:
            params = _leaves(args[0], self.ids)
            where = _user_frame() if params else None
            if where is not None:
                site = next((s for s in self.sites if (s["file"], s["line"]) == where[:2]), None)
                if site is None:
                    self.sites.append({"file": where[0], "line": where[1], "code": where[2], "params": sorted(params)})
                else:
                    site["params"] = sorted(set(site["params"]) | params)
        return out


class HeldDetaches(TorchFunctionMode):
    """Replays a forward with each ``.detach()`` returning what the same call (by order) returned in
    the forward ``DetachWatch`` watched, so that finite differences see the detached values as the
    constants autograd takes them for. ``failed`` is set when the forward's detaches no longer line
    up with the watched ones (another count, another shape): nothing is held then."""

    def __init__(self, outputs: list[torch.Tensor | None]) -> None:
        super().__init__()
        self.outputs = outputs
        self.calls = 0
        self.failed = len(outputs) > MAX_HELD

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not ((func is torch.Tensor.detach or func is torch.detach) and args and isinstance(args[0], torch.Tensor)):
            return func(*args, **kwargs)
        i, self.calls = self.calls, self.calls + 1
        held = self.outputs[i] if i < len(self.outputs) else None
        if i >= len(self.outputs) or (held is not None and held.shape != args[0].shape):
            self.failed = True
        if held is None or self.failed:
            return func(*args, **kwargs)
        return held.clone()


def site_text(site: dict[str, Any]) -> str:
    """``file.py:LINE (`code`)``."""
    where = f"{os.path.basename(site['file'])}:{site['line']}"
    return f"{where} (`{site['code']}`)" if site["code"] else where


def detach_note(sites: list[dict[str, Any]], name: str) -> tuple[str, list[dict[str, Any]]]:
    """The sentence for a wrong gradient of ``name`` naming the detaches on its paths, and those sites."""
    mine = [s for s in sites if name in s["params"]]
    if not mine:
        return "", []
    at = "; ".join(site_text(s) for s in mine[:3])
    return (f"The loss also depends on it through a .detach() at {at}: finite differences follow that path, "
            "autograd does not. If the cut is intended (the samples of NeRF's fine pass, a straight-through "
            "estimator, a target network), this gradient is what the code means; if not, remove the .detach(). "), mine
