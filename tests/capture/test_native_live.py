"""The native core's ``live`` set, by which the taint tracker forgets the states of dead tensors.

At a drain that prunes (capture/_native/_backend.py), ``Tracker.prune(live)`` keeps only the
states of the seqs in ``live``, the producers of the tensors and saved outputs the core's tables
hold at that moment. That is right only if every seq a later record can still name as its input
is in it: a producer or saved-output entry a later record names must be in ``live`` at every
drain between the producer's record and that later one (a state dropped too early makes the
later op its own origin, as issue 16's pool patch showed on rmsnorm_backward, timing dependent).

Here drains are forced at chosen points (after every torch call of the forward and the
optimizer, before every autograd node of the backward, optionally with a full garbage collection
there), every drain takes ``live``, and the invariant is checked against the records; then the
taint and origin of each execution are compared with the dispatch mode's with a prune at every
drain, forced at every module boundary and before every autograd node.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import true_models as M
from tests_capture_crosscheck import capture, crosscheck  # noqa: I001 - see conftest (path of this folder)
from torch import nn
from torch.overrides import TorchFunctionMode

from trainguard.capture import _recorder_mode
from trainguard.capture._native import _backend


class _CoreSpy:
    """The core with every drain taking ``live`` (logged with the highest seq drained so far);
    it is handed on to the backend when asked for, or at every drain with ``prune_always``."""

    def __init__(self, core, drains: list, prune_always: bool) -> None:
        self._core = core
        self._drains = drains
        self._prune_always = prune_always
        self._max = -1

    def __getattr__(self, name):
        return getattr(self._core, name)

    def drain(self, live=False, live_if_bad=False):
        out = self._core.drain(True)
        for r in out[0]:
            self._max = max(self._max, r[0])
        self._drains.append((self._max, frozenset(out[6])))
        live = live or (live_if_bad and out[3])  # the core's rule: a batch holding a non-finite value
        return out[:6] + ((out[6] if live or self._prune_always else None),) + out[7:]


class _Spy:
    """Installs the core spy on every native recording started while active, and drains the
    current one on request (from the training thread, at the program's chosen points)."""

    def __init__(self, monkeypatch, prune_always: bool, collect: bool) -> None:
        self.drains: list = []
        self.rec = None
        self.collect = collect
        self._busy = threading.local()
        spy = self
        orig_start = _backend.NativeBackend.start

        def start(backend):
            backend.core = _CoreSpy(backend.core, spy.drains, prune_always)
            spy.rec = backend.rec
            orig_start(backend)

        monkeypatch.setattr(_backend.NativeBackend, "start", start)

    def drain_here(self, *_args) -> None:
        rec = self.rec
        if rec is None or not rec.active or getattr(self._busy, "on", False):
            return
        self._busy.on = True  # the flush runs torch calls of its own (under the function mode too)
        try:
            if self.collect:
                # the young generations only: cycles made since the last drain are freed here, at a
                # moment of our choosing (a full collection per torch call took 90 s for this test)
                gc.collect(1)
            rec.flush()
        finally:
            self._busy.on = False


class _DrainEveryCall(TorchFunctionMode):
    """A drain after every torch call of the forward and the optimizer, and before every autograd
    node of the backward (a pre-hook on each node an output carries)."""

    def __init__(self, spy: _Spy) -> None:
        super().__init__()
        self.spy = spy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.spy.drain_here()
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(self.spy.drain_here)
        return out


def _violations(records: list, drains: list) -> list[str]:
    """Seqs a record names as its input that a drain before it left out of ``live`` although
    that producer's record was drained already."""
    out = []
    for r in records:
        for kind, ref in r[8]:
            if kind != "op":
                continue
            for i, (upto, live) in enumerate(drains):
                if ref <= upto < r[0] and ref not in live:
                    out.append(f"record {r[0]} ({r[3]}, {r[2]}, step {r[1]}) names {ref}, which drain #{i} "
                               f"(up to seq {upto}) left out of live")
                    break
    return out


def _rmsnorm():
    return lambda: M.train_rmsnorm(steps=3, width=8, depth=2)


def _gpt_padded():
    return lambda: M.train_gpt(2, padded=True)


def _transformer():
    block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0, norm_first=True)
    opt = torch.optim.AdamW(block.parameters(), foreach=True)
    x = torch.randn(2, 5, 16)

    def program():
        for _ in range(2):
            opt.zero_grad()
            block(x).pow(2).mean().backward()
            opt.step()
    return program


def _checkpointed():
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def program():
        for _ in range(2):
            opt.zero_grad()
            checkpoint(model, x, use_reentrant=False).sqrt().sum().backward()
            opt.step()
    return program


# name: a function that builds the program (after the seed is set) and returns it
LIVE_PROGRAMS = {"rmsnorm_backward": _rmsnorm, "masked_gpt": _gpt_padded, "transformer": _transformer,
                 "checkpoint": _checkpointed}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name, collect", [(name, False) for name in LIVE_PROGRAMS] + [("rmsnorm_backward", True)],
                         ids=[*LIVE_PROGRAMS, "rmsnorm_backward-gc"])
def test_live_holds_every_producer_a_later_record_names(tmp_path, monkeypatch, name, collect):
    spy = _Spy(monkeypatch, prune_always=False, collect=collect)
    make = LIVE_PROGRAMS[name]

    def forced():
        program = make()

        def run():
            with _DrainEveryCall(spy):
                program()
        return run

    got, _ = capture(forced, tmp_path, "native", "full_health")
    assert len(spy.drains) > 50, len(spy.drains)  # the drains were forced (not only the drain thread's)
    named = sum(1 for r in got["records"] for kind, _ in r[8] if kind == "op")
    assert named > 20
    bad = _violations(got["records"], spy.drains)
    assert bad == [], "\n".join(bad[:20])


class _DrainAtBoundaries:
    """Drains after every module's forward and before every autograd node of its output (neither
    adds an op, so both backends run the same ops)."""

    def __init__(self, spy: _Spy) -> None:
        self.spy = spy

    def __enter__(self):
        def after(module, args, output):
            self.spy.drain_here()
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.grad_fn.register_prehook(self.spy.drain_here)

        self.handles = [nn.modules.module.register_module_forward_pre_hook(lambda m, a: self.spy.drain_here()),
                        nn.modules.module.register_module_forward_hook(after)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


TAINT_PROGRAMS = {"rmsnorm_backward": _rmsnorm, "masked_gpt": _gpt_padded,
                  "fully_masked_row": lambda: lambda: M.train_gpt(3, padded=True, empty_at=1),
                  "exp_into_loss": lambda: lambda: M.train_exp(4)}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(TAINT_PROGRAMS))
def test_same_taint_with_a_prune_at_every_drain(tmp_path, monkeypatch, name):
    # The drain thread drains as often as it can too (timing decides where; any point must do).
    monkeypatch.setattr(_recorder_mode, "FLUSH_SECONDS", 0.001)
    spy = _Spy(monkeypatch, prune_always=True, collect=False)
    make = TAINT_PROGRAMS[name]

    def forced():
        program = make()

        def run():
            with _DrainAtBoundaries(spy):
                program()
        return run

    problems, _, py, nat = crosscheck(forced, tmp_path, "full_health")
    assert len(spy.drains) > 20
    assert problems == [], "\n".join(problems[:20])
    bad = _violations(nat["records"], spy.drains)
    assert bad == [], "\n".join(bad[:20])
