"""check_numerics: raise at the first harmful value (a NaN, or an inf that reaches a sink),
naming where it was made; strict=True raises at any non-finite output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.store import open_run

HERE = __file__.rsplit("/", 1)[-1]


def line_of(marker: str) -> int:
    return next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if marker in t and "line_of" not in t)


def test_forward_log_of_zero_read_by_the_program():
    probs = torch.softmax(torch.tensor([[0.0, 200.0]]), dim=1)
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            logp = torch.log(probs)  # MARK-LOG
            logp.sum().item()  # MARK-ITEM
    msg = str(info.value)
    assert msg.startswith("aten.log produced -inf in step 0, forward pass (2 values, 1 -inf, 1 zero")
    assert "which was read by the program in aten._local_scalar_dense (.item()" in msg
    assert f"{HERE}:{line_of('MARK-ITEM')}" in msg.splitlines()[0]
    assert f"{HERE}:{line_of('MARK-LOG')} in test_" in msg  # the line that made the inf
    assert "module: outside any nn.Module" in msg
    assert "input 0 = user input: 2 values, 1 zero, 1 positive" in msg  # the log's input
    assert info.value.execution["op"] == "aten._local_scalar_dense.default"
    # the line the message names first (the log that made the inf), as fields for programs
    where = info.value.execution
    assert (where["file"], where["line"], where["function"]) == (__file__, line_of("MARK-LOG"),
                                                                 "test_forward_log_of_zero_read_by_the_program")


def test_an_unused_inf_is_not_harmful_but_strict_raises():
    probs = torch.softmax(torch.tensor([[0.0, 200.0]]), dim=1)
    with tg.check_numerics():
        torch.log(probs)
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(strict=True):
            torch.log(probs)  # MARK-STRICT
    msg = str(info.value)
    assert msg.startswith("aten.log produced -inf")
    assert f"{HERE}:{line_of('MARK-STRICT')}" in msg
    assert "input 0 = user input: 2 values, 1 zero, 1 positive" in msg
    assert info.value.execution["op"] == "aten.log.default"
    assert (info.value.execution["file"], info.value.execution["line"]) == (__file__, line_of("MARK-STRICT"))


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x) * 0
        return torch.linalg.vector_norm(h, dim=1)  # MARK-NORM


def test_backward_nan_traced_to_forward_line():
    net = NormNet()
    out = None
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            out = net(torch.randn(3, 4))
            out.sum().backward()
    msg = str(info.value)
    assert out is not None and torch.isfinite(out).all()  # the forward pass was clean
    assert "backward pass" in msg and "in the backward of" in msg
    assert "created by the forward op at" in msg and f"{HERE}:{line_of('MARK-NORM')}" in msg
    assert "module: (root) (NormNet)" in msg
    assert (info.value.execution["file"], info.value.execution["line"]) == (__file__, line_of("MARK-NORM"))


def test_producer_named_in_input_summary():
    x = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(strict=True):
            d = x - x  # MARK-SUB
            x / d
    msg = str(info.value)
    assert msg.startswith("aten.div.Tensor produced +inf")
    assert "input 1 = sub output from " in msg
    assert f"{HERE}:{line_of('MARK-SUB')}: 3 values, 3 zeros" in msg


def test_clean_code_does_not_raise_and_records_when_asked(tmp_path):
    with tg.check_numerics(tmp_path / "r"):
        y = torch.log(torch.tensor([1.0, 2.0]))
    assert torch.isfinite(y).all()
    assert open_run(tmp_path / "r").count(op="log") == 1


def test_uninitialised_memory_is_not_evidence():
    with tg.check_numerics():
        e = torch.empty(1000)
        e.fill_(1.0)
    assert (e == 1).all()


def test_a_tensor_made_from_python_values_is_not_its_own_producer(tmp_path):
    # huggingface/trl trl/trainer/reward_trainer.py's collator, `torch.tensor([example["margin"] ...])`,
    # with one margin inf, into the loss -logsigmoid(r_chosen - r_rejected - margin): the message
    # named the lift_fresh as the maker of its own input ("input 0 = lift_fresh output from ...").
    rewards = nn.Linear(3, 1)
    margins = [0.5, float("inf"), 0.5, 0.5]
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(tmp_path / "r"):
            r = rewards(torch.randn(8, 3)).squeeze(-1)
            margin = torch.tensor(margins, dtype=torch.float)
            loss = -nn.functional.logsigmoid(r[:4] - r[4:] - margin).mean()
            loss.backward()
    msg = str(info.value)
    assert msg.startswith("aten.lift_fresh produced +inf"), msg
    assert "input 0 = user input: 4 values, 1 +inf" in msg and "lift_fresh output" not in msg, msg
