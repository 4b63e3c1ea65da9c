"""Harmful, intended, unknown inside compiled graphs (issue 11's classification, issue 17's graphs).

The model is ``tests/true_models.TinyGPT``, derived from karpathy/nanoGPT's ``model.py`` (its
hand-written causal mask ``att.masked_fill(mask == 0, float('-inf'))`` before ``F.softmax``, plus a
key-padding mask), compiled whole with ``torch.compile`` after the recording starts, as
``trainguard run`` on nanoGPT's ``compile=True`` does. Its -inf masks are made and absorbed inside
the compiled graph: intended, never an alert or an origin. A fully masked row (a batch with a
sequence of length 0) makes a NaN inside the graph: harmful, named at its op and line.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import true_models as M

import trainguard as tg
from trainguard.analysis import build_report, origin
from trainguard.store import open_run


def train_compiled(steps: int, empty_at: int | None = None, backend=None) -> list[float]:
    torch.manual_seed(0)
    model = M.TinyGPT(layers=1)  # one block: half the graph for Inductor to compile (the suite's slowest fixture)
    compiled = torch.compile(model, **({"backend": backend} if backend is not None else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for idx, targets, pad in M.token_batches(steps, empty_at):
        loss = compiled(idx, targets, pad)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory):
    """TinyGPT compiled by Inductor inside the recording (the automatic path), 3 steps."""
    torch._dynamo.reset()
    d = tmp_path_factory.mktemp("compiled_mask") / "r"
    with tg.record(d, buffer=-1):
        train_compiled(3)
    torch._dynamo.reset()
    return d


@pytest.mark.timeout(900)
def test_a_compiled_causal_mask_raises_no_alert_and_no_origin(masked_run):
    run = open_run(masked_run)
    assert run.meta.get("compiled_graphs"), "the graphs were recorded op by op"
    # the masks' -inf exist inside the graph's records...
    masked = [e for e in run.executions(0, None, phase="forward") if "-inf" in (e.get("health") or [])]
    assert masked, "the recording saw the -inf the masks made"
    # ...and are intended: no alert, no harmful value, no origin
    alerts = run.alerts()
    assert alerts["total"] == 0 and alerts["first_seq"] is None
    assert run.first_harm() is None and origin(run) is None
    rep = build_report(run)
    assert rep["origin"] is None and rep["counts"]["nonfinite"] == 0
    # Inductor decomposed masked_fill into full(-inf) + where and softmax into amax, sub, exp, sum,
    # div: named by the ops they came from, the count is eager recording's (test_true_origin, two
    # layers there): 1 layer x 3 steps, each a 4 x 2 x 8 x 8 score tensor with 28 future
    # positions per head masked
    (g,) = run.intended()
    assert (g["kind"], g["made_by"], g["absorbed_by"]) == ("-inf", "aten.masked_fill.Scalar", "aten._softmax.default")
    assert g["executions"] == 3 and g["values"] == 3 * 4 * 2 * 28
    assert rep["intended"] == ["672 intended -inf from masked_fill, absorbed by softmax"]


def masked_sum(att, mask):
    att = att.masked_fill(mask, float("-inf"))
    return torch.softmax(att, -1).sum()


@pytest.mark.timeout(600)
def test_a_mask_the_backward_graph_recomputes_is_still_intended(tmp_path):
    """Inductor's partitioner recomputes the masked softmax in the backward graph instead of
    saving it: those ops run in the backward pass yet compute forward values, not gradients."""
    torch._dynamo.reset()
    x = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[False, True, False, True]] * 2)
    with tg.record(tmp_path / "r", buffer=-1):
        torch.compile(masked_sum)(x, mask).backward()
    torch._dynamo.reset()
    run = open_run(tmp_path / "r")
    backward_inf = [e for e in run.executions(0, None, phase="backward") if "-inf" in (e.get("health") or [])]
    assert backward_inf, "the backward graph recomputes the mask"
    assert run.alerts()["total"] == 0 and origin(run) is None
    assert {g["made_by"] for g in run.intended()} == {"aten.masked_fill.Scalar"}


@pytest.mark.timeout(900)
def test_a_compiled_causal_mask_passes_check_numerics_and_strict_stops_at_it():
    torch._dynamo.reset()
    with tg.check_numerics():
        losses = train_compiled(2, backend=tg.compile_backend(inner="aot_eager"))
    assert all(x == x for x in losses)
    torch._dynamo.reset()
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(strict=True):
            train_compiled(1, backend=tg.compile_backend(inner="aot_eager"))
    assert "produced -inf" in str(info.value) and "inside the compiled graph" in str(info.value)
    assert f"true_models.py:{M.line_of('CAUSAL MASK')}" in str(info.value)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def empty_row_run(tmp_path_factory):
    """A fully masked attention row at step 2 of a compiled TinyGPT: NaN made inside the graph."""
    torch._dynamo.reset()
    d = tmp_path_factory.mktemp("compiled_empty_row") / "r"
    with tg.record(d):
        train_compiled(3, empty_at=2, backend=tg.compile_backend(inner="aot_eager"))
    torch._dynamo.reset()
    return d


@pytest.mark.timeout(900)
def test_a_nan_made_inside_a_compiled_graph_is_its_origin_at_its_line(empty_row_run):
    run = open_run(empty_row_run)
    link = origin(run).origin
    assert (link.step, link.phase) == (2, "forward")
    assert "softmax" in link.op, link.op  # the op as the graph holds it (aot_eager keeps _softmax)
    assert (link.file, link.line) == (M.__file__, M.line_of("SOFTMAX LINE"))
    assert run.alerts()["first_seq"] == link.seq
    # the masks of steps 0 and 1 stay intended
    assert run.intended() and run.intended()[0]["kind"] == "-inf"


@pytest.mark.timeout(900)
def test_check_numerics_stops_at_the_nan_a_compiled_graph_makes():
    torch._dynamo.reset()
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            train_compiled(3, empty_at=2, backend=tg.compile_backend(inner="aot_eager"))
    msg = str(info.value)
    assert "produced nan in step 2, forward pass, inside the compiled graph" in msg, msg
    assert f"true_models.py:{M.line_of('SOFTMAX LINE')}" in msg
    assert "softmax" in info.value.execution["op"]
    assert info.value.execution["file"] == M.__file__ and info.value.execution["line"] == M.line_of("SOFTMAX LINE")
    torch._dynamo.reset()


@pytest.mark.timeout(600)
def test_a_fully_masked_row_in_inductors_decomposed_softmax_is_explained_as_one(tmp_path):
    """Inductor decomposes softmax into amax, sub, exp, sum and div and summarises only div, the
    value the eager op returns (the others are internal to it): a fully masked row's NaN appears
    at div, whose inputs have no summary. The explanation reads through them to the masked
    scores. Found on pytorch/examples gat/main.py compiled, with its -9e16 mask made -inf and the
    self-loops removed: the report said "division made nan: the quotient overflowed"."""
    torch._dynamo.reset()
    x = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[False, True, False, True], [True, True, True, True]])  # row 1: all masked
    with tg.record(tmp_path / "r", buffer=-1):
        torch.compile(masked_sum)(x, mask).backward()
    torch._dynamo.reset()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op == "aten.div.Tensor", o.origin.op  # the op Inductor's graph holds
    assert "fully masked row" in o.origin.explanation, o.origin.explanation
    assert "torch.finfo(scores.dtype).min" in o.suggestion
    assert "quotient overflowed" not in o.summary
    assert o.origin.through[0] == "amax" and "exp" in o.origin.through  # in the order the graph ran them
    assert o.origin.sources[0]["summary"]["neg_inf"] == 2 + 4  # the masked scores, behind them
