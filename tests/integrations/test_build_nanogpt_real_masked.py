"""build-nanogpt's model (tests/build_nanogpt.py) compiled by Inductor under bf16 autocast: values
that become NaN later inside one graph (a -inf turned NaN, a fully masked attention row). Apart
from test_build_nanogpt_real.py so that the two slow files run on two test workers.
"""

from __future__ import annotations

import math

import pytest
import torch._dynamo
from build_nanogpt import line_of, train

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


@pytest.mark.timeout(900)
def test_a_compiled_inf_that_turns_harmful_later_keeps_its_summary(tmp_path):
    """softmax underflows to 0 (huge logits), log makes -inf (pending: it could still be masked
    away), then ``probs * log(probs)`` is 0 * -inf = NaN, inside the same compiled graph. The log's
    record, judged pending and sent again as harmful, went to the writer with its summary still a
    reference into the graph call's summary matrix: "writer error: bad summary in execution N:
    pack expected 7 items for packing (got 3)", the origin shown with "no summary recorded" and
    the NaN explained as "mul turned finite inputs into nan" instead of 0 * inf."""
    torch._dynamo.reset()
    with tg.record(tmp_path / "r"):
        losses = train(zeros_at=None, entropy=True)
    torch._dynamo.reset()
    assert math.isnan(losses[2]) and not any(math.isnan(x) for x in losses[:2])
    run = open_run(tmp_path / "r")
    assert run.meta.get("writer_error") is None, run.meta.get("writer_error")
    o = origin(run)
    assert (o.origin.op, o.origin.line) == ("aten.log", line_of("ENTROPY LINE"))
    assert o.origin.outputs[0]["summary"] is not None and o.origin.outputs[0]["summary"]["neg_inf"] > 0
    assert "0 * inf" in o.chain[0].explanation, [link.explanation for link in o.chain]


@pytest.mark.timeout(900)
def test_a_compiled_fully_masked_row_under_bf16_autocast_is_explained_with_the_default_buffer(tmp_path):
    """The batch of zeros masks every key of its rows. Under bf16 autocast Inductor's softmax is
    convert_element_type, amax, sub, exp, sum, div, convert_element_type: the NaN shows at the
    last cast, behind values without a summary of their own. check_numerics explains it as a
    fully masked row; the recorded run, with a circular buffer (``trainguard run``'s default is
    1,000; 50 here for a short run), had evicted those values' producers and said
    "convert_element_type made nan from values the compiled graph computed without a summary of
    their own (div)", with the fix "values are overflowing: lower the learning rate"."""
    torch._dynamo.reset()
    with tg.record(tmp_path / "r", buffer=50):
        losses = train(mask_padding=True)
    torch._dynamo.reset()
    assert math.isnan(losses[2]) and not any(math.isnan(x) for x in losses[:2])
    o = origin(open_run(tmp_path / "r"))
    assert (o.origin.step, o.origin.line) == (2, line_of("SOFTMAX LINE"))
    assert "fully masked row" in o.origin.explanation, o.origin.explanation
    assert "torch.finfo(scores.dtype).min" in o.suggestion, o.suggestion
