"""What recording inside compiled graphs costs: the summaries it leaves out of the compiled code
(values no eager op returns) and the hand-overs it spares, with the records still those of
eager recording where eager recording has them."""

from __future__ import annotations

import math

import torch
import torch._dynamo

import trainguard as tg
from trainguard.store import open_run


def _softmax_step(x, w):
    return (torch.softmax(x, dim=-1) * w).sum()


def _record(tmp_path, name, fn, x0, w):
    torch._dynamo.reset()
    x = x0.clone().requires_grad_()
    with tg.record(tmp_path / name, buffer=-1):
        fn(x, w).backward()
    return open_run(tmp_path / name)


def _unknown(summary: dict) -> bool:
    return all(math.isnan(summary[f]) for f in ("neg", "zero", "pos", "nan"))


def test_values_inside_a_decomposition_get_no_pass_and_its_results_keep_eager_summaries(tmp_path):
    # Inductor's graphs hold softmax as amax, sub, exp, sum, div: the first four are values
    # only the softmax itself reads (no eager op returns them), recorded without a summary pass;
    # div returns what eager's softmax returns and is summarised like it.
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(8, 16, generator=g) * 6 - 3
    w = torch.randn(8, 16, generator=g)
    compiled = torch.compile(_softmax_step, backend=tg.compile_backend())
    with _record(tmp_path, "eager", _softmax_step, x0, w) as e, _record(tmp_path, "compiled", compiled, x0, w) as c:
        eager = e.executions(0, None, op="aten._softmax", phase="forward")
        fwd = c.executions(0, None, phase="forward")
        bwd = c.executions(0, None, phase="backward")
    by_op = {d["op"]: d for d in fwd}
    assert {"aten.amax", "aten.sub.Tensor", "aten.exp", "aten.div.Tensor"} <= set(by_op), sorted(by_op)
    for op in ("aten.amax", "aten.sub.Tensor", "aten.exp"):
        assert _unknown(by_op[op]["outputs"][0]["summary"]), (op, by_op[op]["outputs"][0]["summary"])
    # Still recorded, with their shapes: the record set does not change, only their summary.
    assert by_op["aten.exp"]["outputs"][0]["shape"] == [8, 16]
    assert len(eager) == 1
    assert by_op["aten.div.Tensor"]["outputs"][0]["summary"] == eager[0]["outputs"][0]["summary"]
    # The op after the softmax and the backward graph's results keep theirs.
    assert not _unknown(by_op["aten.mul.Tensor"]["outputs"][0]["summary"])
    summarised = [d for d in bwd if not _unknown(d["outputs"][0]["summary"])]
    assert summarised and any(d["outputs"][0]["shape"] == [8, 16] for d in summarised)
