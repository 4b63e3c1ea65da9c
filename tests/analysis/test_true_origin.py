"""The true origin on real models: intended infinities are counted, faults are found where made.

Models are in ``tests/true_models.py`` (a tiny nanoGPT derivative and friends) and the tiny
random-init GPT-2 and BERT of ``transformers``. Each healthy model records with no alert, no
origin, no warning-level finding, and runs under ``check_numerics`` to the end; each faulty
one names the right op, line, step and phase in the origin, the report, ``--json``, the
monitor's finding and ``check_numerics``.
"""

from __future__ import annotations

import json

import pytest
import torch
import true_models as M

import trainguard as tg
from trainguard.analysis import build_report, origin
from trainguard.analysis._origin import op_base
from trainguard.capture._loss_watch import INSPECTIONS
from trainguard.capture._recorder import LOSS_PIN_WINDOW
from trainguard.cli import main
from trainguard.store import open_run

WARN = ("warning", "error", "critical")


def report_text(*args: str) -> str:
    """``trainguard report`` output as one line of words (rich wraps lines inside its panels)."""
    import contextlib
    import io
    import re

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", *args]) == 0
    return " ".join(re.sub(r"[│╭╮╰╯─━┃┏┓┗┛┡┩╇┳┻]", " ", buf.getvalue()).split())


def hf_train(kind: str, steps: int = 2) -> None:
    """A tiny random-init GPT-2 or BERT from transformers, trained on a padded batch."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=1, eos_token_id=2)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=16)
        model = transformers.BertForMaskedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0  # padding: masked keys
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(steps):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()


HEALTHY = {
    "nanogpt_masked": lambda: M.train_gpt(3),
    "nanogpt_sdpa_causal": lambda: M.train_gpt(3, flash=True),
    "nanogpt_padded": lambda: M.train_gpt(3, padded=True),
    "hf_gpt2_padded": lambda: hf_train("gpt2"),
    "hf_bert_padded": lambda: hf_train("bert"),
    "gcn_reciprocal_inf_to_zero": lambda: M.train_gcn(3),
}


@pytest.fixture(scope="module")
def healthy_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("healthy")
    for name, fn in HEALTHY.items():
        with tg.record(base / name):
            fn()
    return base


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_model_has_no_alert_and_no_origin(healthy_runs, name):
    run = open_run(healthy_runs / name)
    alerts = run.alerts()
    assert alerts["total"] == 0 and alerts["first_seq"] is None
    assert run.first_harm() is None and origin(run) is None
    rep = build_report(run)
    assert rep["origin"] is None and rep["counts"]["nonfinite"] == 0
    # intended infinities are not pinned one by one: the run holds exactly the buffer and, before
    # it, only the loss chains of the first backward passes (pinned for the loss-misuse rules: at
    # most INSPECTIONS windows of LOSS_PIN_WINDOW + 1 executions each)
    if run.meta["executions"] >= 1000:
        older = [r["seq"] for r in run.executions()[:-1000]]
        windows = [[]]
        for a, b in zip([None, *older], older):
            if a is not None and b - a > 2:
                windows.append([])
            windows[-1].append(b)
        assert len(windows) <= INSPECTIONS and all(len(w) <= LOSS_PIN_WINDOW + 1 for w in windows), windows


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_model_runs_under_check_numerics_to_the_end(name):
    with tg.check_numerics():
        HEALTHY[name]()


def test_intended_infinities_are_one_quiet_count(healthy_runs):
    run = open_run(healthy_runs / "nanogpt_masked")
    (g,) = run.intended()
    assert (g["kind"], g["made_by"], g["absorbed_by"]) == ("-inf", "aten.masked_fill.Scalar", "aten._softmax.default")
    # 2 layers x 3 steps, each a 4 x 2 x 8 x 8 score tensor with the 28 future positions of each head masked
    assert g["executions"] == 6 and g["values"] == 6 * 4 * 2 * 28
    out = report_text(str(healthy_runs / "nanogpt_masked"))
    assert "No harmful NaN or Inf." in out
    assert "1,344 intended -inf from masked_fill, absorbed by softmax" in out
    assert "origin" not in out and "First harmful" not in out
    gcn = open_run(healthy_runs / "gcn_reciprocal_inf_to_zero").intended()
    assert [(g["kind"], g["made_by"], g["absorbed_by"], g["values"]) for g in gcn] == [
        ("+inf", "aten.reciprocal.default", "aten.index_put_.default", 2)]  # nodes of degree 0: 3 and one by the seed


def test_healthy_monitored_models_have_no_warning(tmp_path):
    for name, fn in (("gpt", lambda: M.train_gpt(6, padded=True)), ("gcn", lambda: M.train_gcn(6))):
        with tg.record(tmp_path / name), tg.Monitor(None, tmp_path / name, every=1) as mon:
            fn()
        assert not [f for f in mon.findings if f.severity in WARN], (name, mon.findings)


# ---------------------------------------------------------------------- faults
@pytest.fixture(scope="module")
def empty_row_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("empty") / "r"
    with tg.record(d), tg.Monitor(None, d, every=1) as mon:
        M.train_gpt(4, padded=True, empty_at=2)
    return d, mon.findings


def test_fully_masked_row_origin_is_the_softmax_in_that_step(empty_row_run, capsys):
    d, findings = empty_row_run
    run = open_run(d)
    o = origin(run)
    link = o.origin
    assert (link.op, link.step, link.phase) == ("aten._softmax", 2, "forward")
    assert (link.file, link.line) == (M.__file__, M.line_of("SOFTMAX LINE"))
    assert link.explanation.startswith("softmax over a row whose inputs are all -inf (a fully masked row) -> NaN")
    assert "finfo" in o.suggestion and "unmasked position" in o.suggestion
    assert run.alerts()["first_seq"] == link.seq
    # the masks stay intended; once the parameters hold NaN (step 3) every op passes it on
    assert run.intended()[0]["made_by"] == "aten.masked_fill.Scalar"
    assert all(a["first_seq"] >= link.seq for a in run.alerts()["by_op"])

    out = report_text(str(d))
    assert f"First harmful value: aten._softmax at tests/true_models.py:{link.line} in step 2 (forward" in out
    assert main(["report", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    j = rep["origin"]["origin"]
    assert (j["op"], j["line"], j["step"], j["phase"]) == ("aten._softmax", link.line, 2, "forward")

    nonfinite = [f for f in findings if f.kind.startswith("nonfinite")]
    assert nonfinite and all(f.evidence["origin"]["op"] == "aten._softmax" for f in nonfinite)
    assert all(f.evidence["origin"]["line"] == link.line for f in nonfinite)
    assert all("unmasked position" in f.suggestion for f in nonfinite)


def test_fully_masked_row_under_check_numerics():
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            M.train_gpt(4, padded=True, empty_at=2)
    msg = str(info.value)
    assert msg.startswith("aten._softmax produced nan in step 2, forward pass")
    assert f"true_models.py:{M.line_of('SOFTMAX LINE')}" in msg
    assert "input 0 = masked_fill output from" in msg


def test_backward_nan_keeps_its_forward_op_with_the_default_buffer(tmp_path):
    with tg.record(tmp_path / "r"):  # buffer=1000
        M.train_rmsnorm()
    run = open_run(tmp_path / "r")
    o = origin(run)
    link = o.origin
    assert (link.op, link.phase, link.step) == ("aten.div.Tensor", "backward", 0)
    assert link.forward_op["op"] == "aten.sqrt" and link.forward_op["line"] == M.line_of("SQRT LINE")
    assert link.explanation.startswith("the gradient of sqrt is nan here")
    assert "sqrt(x + 1e-12)" in o.suggestion and "1e-8" not in o.suggestion
    newest = run.executions(run.count() - 1)[0]["seq"]
    assert link.forward_op["seq"] < newest - 1000  # long evicted, but pinned with its backward op


def test_backward_nan_under_check_numerics():
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            M.train_rmsnorm()
    msg = str(info.value)
    assert msg.startswith("aten.div.Tensor (in the backward of sqrt) produced nan in step 0, backward pass")
    assert f"true_models.py:{M.line_of('SQRT LINE')}" in msg


def test_exp_overflow_that_reaches_the_loss(tmp_path):
    with tg.record(tmp_path / "r"):
        M.train_exp()
    run = open_run(tmp_path / "r")
    o = origin(run)
    assert o.reason == "loss"
    assert [c.op for c in o.chain] == ["aten.mean", "aten.pow.Tensor_Scalar", "aten.sub.Tensor", "aten.exp"]
    link = o.origin
    assert (link.op, link.step, link.phase, link.line) == ("aten.exp", 2, "forward", M.line_of("EXP LINE"))
    assert o.chain[0].line == M.line_of("LOSS LINE")
    assert "reached the loss" in o.harm and "clamp" in o.suggestion
    out = report_text(str(tmp_path / "r"))
    assert f"First harmful value: aten.exp at tests/true_models.py:{link.line} in step 2" in out
    assert "then: it reached the loss: backward() was called on the output of aten.mean at" in out


def test_exp_overflow_under_check_numerics(tmp_path):
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(tmp_path / "r"):
            M.train_exp()
    msg = str(info.value)
    assert msg.startswith("aten.exp produced +inf in step 2, forward pass")
    assert "which reached the loss: backward() was called on the output of aten.mean" in msg
    assert f"true_models.py:{M.line_of('EXP LINE')} in forward" in msg
    out = report_text(str(tmp_path / "r"))
    assert "First harmful value: aten.exp" in out and "check_numerics stopped the run" in out


def test_log_of_a_zero_probability_names_the_log_and_its_fix(tmp_path):
    with tg.record(tmp_path / "r"):
        M.train_log_zero()
    o = origin(open_run(tmp_path / "r"))
    assert o.reason == "loss" and o.origin.op == "aten.log"
    assert o.chain[0].line == M.line_of("NLL LINE")
    assert "log_softmax" in o.suggestion
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            M.train_log_zero()
    msg = str(info.value)
    assert msg.startswith("aten.log produced -inf in step 2, forward pass")
    assert f"true_models.py:{M.line_of('LOG LINE')} in forward" in msg


# ---------------------------------------------------------------------- every fault, every surface
FAULTY = {
    # name: (train, (origin op, marker of its line, step, phase))
    "fully_masked_row": (lambda: M.train_gpt(4, padded=True, empty_at=2), ("aten._softmax", "SOFTMAX LINE", 2, "forward")),
    "rmsnorm_backward": (M.train_rmsnorm, ("aten.div.Tensor", "SQRT LINE", 0, "backward")),
    "exp_into_loss": (M.train_exp, ("aten.exp", "EXP LINE", 2, "forward")),
    "log_of_zero_probability": (M.train_log_zero, ("aten.log", "LOG LINE", 2, "forward")),
}


@pytest.fixture(scope="module")
def faulty_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("faulty")
    for name, (fn, _) in FAULTY.items():
        with tg.record(base / name):
            fn()
    return base


@pytest.mark.parametrize("name", list(FAULTY))
def test_fault_in_report_json_and_ui(faulty_runs, name, capsys):
    op, marker, step, phase = FAULTY[name][1]
    line = M.line_of(marker)
    out = report_text(str(faulty_runs / name))
    assert f"First harmful value: {op} at tests/true_models.py:{line} in step {step} ({phase} pass" in out
    assert main(["report", str(faulty_runs / name), "--json"]) == 0
    link = json.loads(capsys.readouterr().out)["origin"]["origin"]
    assert (link["op"], link["line"], link["step"], link["phase"]) == (op, line, step, phase)

    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    with TestClient(create_app(faulty_runs)) as client:
        o = client.get(f"/api/runs/{name}/origin").json()["result"]["origin"]
        a = client.get(f"/api/runs/{name}/alerts").json()
    assert (o["op"], o["line"], o["step"], o["phase"]) == (op, line, step, phase)
    assert a["first_seq"] == o["seq"]


class _LogDiceLoss(torch.nn.Module):
    """segmentation_models_pytorch's ``DiceLoss(MULTICLASS_MODE, log_loss=True, eps=0.0)``
    (losses/dice.py, soft_tversky_score in losses/_functional.py), cut to what runs: the score of a
    class absent from the batch is 0, clamped at eps = 0, and its -inf is masked by a multiply."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, y_pred, y_true):
        bs, num_classes = y_pred.shape[:2]
        y_pred = y_pred.log_softmax(dim=1).exp().reshape(bs, num_classes, -1)
        y_true = torch.nn.functional.one_hot(y_true.reshape(bs, -1), num_classes).permute(0, 2, 1).type_as(y_pred)
        dims = (0, 2)
        output_sum, target_sum = y_pred.sum(dims), y_true.sum(dims)
        difference = torch.linalg.vector_norm(y_pred - y_true, ord=1, dim=dims)
        intersection = (output_sum + target_sum - difference) / 2
        fp, fn = output_sum - intersection, target_sum - intersection
        scores = intersection / (intersection + 0.5 * fp + 0.5 * fn).clamp_min(self.eps)
        loss = -torch.log(scores.clamp_min(self.eps))  # LOG DICE LINE
        loss *= (y_true.sum(dims) > 0).to(loss.dtype)  # an absent class adds nothing: 0 * -inf
        return loss.mean()


def _train_log_dice(eps: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 3, 1)
    loss_fn = _LogDiceLoss(eps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 2, (2, 8, 8))  # class 2 absent
    for _ in range(2):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _line(marker: str) -> int:
    with open(__file__) as fh:
        return next(i for i, t in enumerate(fh.read().splitlines(), 1) if t.endswith(f"# {marker}"))


def test_a_log_whose_input_is_clamped_at_zero_is_told_to_clamp_above_zero(tmp_path):
    # smp's log-dice with eps=0 (multiclass, a class absent from the batch) was told "clamp the input
    # before the log, e.g. torch.log(p.clamp(min=1e-6))": it is clamped, at 0, the bound that lets the 0 through
    with tg.record(tmp_path / "r"):
        _train_log_dice(eps=0.0)
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op == "aten.log" and o.origin.line == _line("LOG DICE LINE")
    assert "already clamped" in o.suggestion and "aten.clamp_min" in o.suggestion
    assert f"test_true_origin.py:{_line('LOG DICE LINE')}" in o.suggestion
    _train_log_dice(eps=1e-7)  # smp's default: finite


def test_the_origin_names_the_type_of_the_module_it_ran_in(tmp_path, capsys):
    # smp's losses are nn.Modules called beside the model: the log inside DiceLoss.forward was
    # "module (root)" in the report, as an op of the model's own root would be
    with tg.record(tmp_path / "r"):
        _train_log_dice(eps=0.0)
    assert "module (root) (_LogDiceLoss)" in report_text(str(tmp_path / "r"))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    link = json.loads(capsys.readouterr().out)["origin"]["origin"]
    assert (link["module"], link["module_type"]) == ("", "_LogDiceLoss")


def _train_focal(gamma: float) -> None:
    # segmentation_models_pytorch's focal_loss_with_logits (losses/_functional.py) with gamma < 1 on
    # a confident head: pt rounds to 1, (1 - pt) ** gamma has an infinite gradient at 0
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 1, 1)
    with torch.no_grad():
        model.bias.fill_(30.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, 3, 8, 8), torch.ones(2, 1, 8, 8)
    for _ in range(2):
        logpt = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y, reduction="none")
        pt = torch.exp(-logpt)
        loss = ((1.0 - pt).pow(gamma) * logpt).mean()  # FOCAL LINE
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_the_infinite_gradient_of_a_fractional_power_at_zero_is_told_to_keep_the_base_off_zero(tmp_path):
    # smp's FocalLoss(gamma=0.5): the origin (pow's backward, +inf where 1 - pt is 0) was explained
    # right and fixed as an overflow, "an input holds values too large to raise to this power ...
    # x.clamp(-1e4, 1e4) ** 2, or compute the power in float64"
    with tg.record(tmp_path / "r"):
        _train_focal(gamma=0.5)
    o = origin(open_run(tmp_path / "r"))
    assert op_base(o.origin.op) == "pow" and o.origin.phase == "backward"
    assert o.origin.line == _line("FOCAL LINE")
    assert "too large" not in o.suggestion and "clamp(min=" in o.suggestion, o.suggestion
