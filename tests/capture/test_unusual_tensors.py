"""Programs that make unusual tensors are recorded, and nothing the recorder trips on stops training."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import trainguard as tg
from trainguard.capture import _recorder_mode
from trainguard.capture._summary import summarize_immediate
from trainguard.store import open_run

from .test_summary import MODES, check


def _dense_reference(t: torch.Tensor):
    return t.to_dense().numpy()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["coo", "coo_uncoalesced", "csr"])
def test_sparse_summaries_count_the_zeros_they_do_not_store(mode, layout):
    dense = torch.tensor([[0.0, -2.0, 0.0, 3.5], [0.0, 0.0, float("nan"), 1.0], [0.0] * 4])
    if layout == "csr":
        t = dense.to_sparse_csr()
    elif layout == "coo":
        t = dense.to_sparse()
    else:  # the same entry twice: coalescing sums them
        t = torch.sparse_coo_tensor([[0, 0, 1], [1, 1, 3]], [-1.0, -1.0, 1.0], (3, 4))
        dense = t.to_dense()
    values = summarize_immediate(t, mode)
    check(dense, dense.numpy(), mode, values)


@pytest.mark.parametrize("mode", MODES)
def test_finite_sparse_statistics_match_the_dense_tensor(mode):
    dense = torch.zeros(50, 40)
    dense[::7, ::3] = torch.randn(8, 14)
    check(dense, dense.numpy(), mode, summarize_immediate(dense.to_sparse(), mode))


def test_conjugate_and_negative_views():
    c = torch.tensor([1 + 2j, -3j, 0j], dtype=torch.complex64)
    for view in (c.conj(), torch._neg_view(torch.tensor([1.0, -2.0, 0.0]))):
        resolved = view.resolve_conj().resolve_neg()
        assert summarize_immediate(view, "full_health") == summarize_immediate(resolved, "full_health")


@pytest.mark.parametrize("mode", MODES)
def test_quantized_and_float8_summaries_are_those_of_their_values(mode):
    x = torch.tensor([-1.5, 0.0, 0.25, 2.0, -0.0])
    q = torch.quantize_per_tensor(x, 0.25, 0, torch.qint8)
    f8 = x.to(torch.float8_e4m3fn)
    assert summarize_immediate(q, mode) == summarize_immediate(q.dequantize(), mode)
    assert summarize_immediate(f8, mode) == summarize_immediate(f8.float(), mode)
    check(x, x.numpy(), mode, summarize_immediate(f8, mode))


def test_meta_tensors_have_an_unknown_summary():
    s = summarize_immediate(torch.empty(3, 4, device="meta"), "full_health")
    assert s[0] == 12 and all(math.isnan(v) for v in s[1:])


@pytest.mark.parametrize("strategy", ["auto", "deferred"])
def test_recording_inference_mode_complex_sparse_and_meta(tmp_path, strategy):
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with tg.record(tmp_path / "r", buffer=-1, strategy=strategy):
        with torch.inference_mode():  # inference tensors have no version counter
            y = model(x).relu()
            y.view(-1).sum()
        c = torch.randn(4, dtype=torch.complex64, requires_grad=True)
        (c * c.conj()).real.sum().backward()
        s = torch.sparse_coo_tensor([[0, 2]], [1.0, -2.0], (5,))
        (s + s).to_dense()
        torch.empty(2, device="meta") + 1
        torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8).int_repr()
        torch.randn(4).to(torch.float8_e5m2).float()
    run = open_run(tmp_path / "r")
    assert run.meta.get("record_errors") is None
    sparse_add = [e for e in run.executions(op="aten.add.Tensor") if e["outputs"][0]["shape"] == [5]]
    assert sparse_add[0]["outputs"][0]["summary"] == {
        "size": 5, "neg": 1, "zero": 3, "pos": 1, "neg_inf": 0, "pos_inf": 0, "nan": 0}
    (relu,) = run.executions(op="aten.relu")
    assert relu["outputs"][0]["summary"]["size"] == 6
    meta_add = [e for e in run.executions(op="aten.add.Tensor") if e["outputs"][0]["device"] == "meta"]
    assert meta_add and math.isnan(meta_add[0]["outputs"][0]["summary"]["zero"])


def test_an_output_the_recorder_cannot_handle_costs_its_record_not_the_training(tmp_path, monkeypatch, caplog,
                                                                                 capsys):
    real = _recorder_mode.summarize_immediate

    def picky(t, mode, *rest):
        if t.shape == (7,) and bool((t == 2).all()):
            raise RuntimeError("cannot summarise this one")
        return real(t, mode, *rest)

    monkeypatch.setattr(_recorder_mode, "summarize_immediate", picky)
    with caplog.at_level(logging.WARNING, logger="trainguard.capture"):
        # The dispatch mode's summaries are the ones patched here (the native core's: test_native).
        with tg.record(tmp_path / "r", buffer=-1, backend="python"):
            a = torch.ones(7) * 2  # its record fails
            b = a + 1  # training goes on, and is recorded
            c = b * 0 + 2  # mul is fine here, add fails
            d = c * 1  # mul fails again: warned once per op type
    assert torch.equal(d, torch.full((7,), 2.0))
    run = open_run(tmp_path / "r")
    assert run.meta["record_errors"] == 3
    warned = [m for m in caplog.messages if "could not record" in m]
    assert len(warned) == 2 and "aten.mul.Tensor" in warned[0] and "aten.add.Tensor" in warned[1]
    (first_add,) = run.executions(op="aten.add.Tensor")[:1]
    assert first_add["outputs"][0]["summary"]["pos"] == 7  # b = a + 1 was recorded
    from trainguard.cli import main

    assert main(["report", str(tmp_path / "r")]) == 0
    assert "3 op outputs could not be recorded" in " ".join(capsys.readouterr().out.split())


def _checkpointed(reentrant: bool):
    from torch.utils.checkpoint import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8, requires_grad=True)
    return lambda: checkpoint(model, x, use_reentrant=reentrant).sum().backward()


def _double_backward():
    z = torch.randn(3, requires_grad=True)

    def run():
        (g,) = torch.autograd.grad((z ** 3).sum(), z, create_graph=True)
        g.sum().backward()
    return run


def _autocast():
    model = torch.nn.Linear(8, 2)
    x = torch.randn(4, 8)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
    return run


def _compiled():
    model = torch.nn.Linear(8, 2)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    return lambda: compiled(x).sum().backward()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("program", ["checkpoint", "checkpoint_reentrant", "double_backward", "autocast", "compile"])
def test_training_features_record_forward_and_backward(tmp_path, program):
    fn = {"checkpoint": lambda: _checkpointed(False), "checkpoint_reentrant": lambda: _checkpointed(True),
          "double_backward": _double_backward, "autocast": _autocast, "compile": _compiled}[program]()
    with tg.record(tmp_path / "r", buffer=-1):
        fn()
    run = open_run(tmp_path / "r")
    assert run.meta.get("record_errors") is None
    assert run.count(phase="forward") > 0 and run.count(phase="backward") > 0
    assert run.first_nonfinite() is None
