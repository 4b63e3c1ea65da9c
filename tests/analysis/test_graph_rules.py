"""Loss misuse read off the op graph: from a recording (the recorded producer chain, with
``file:line`` of both ends) and from the monitor alone (the loss's autograd graph)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from trainguard.analysis import diagnose
from trainguard.cli import main
from trainguard.store import open_run

MISUSE = (
    "softmax_before_cross_entropy",
    "sigmoid_before_bce_with_logits",
    "nll_loss_on_probabilities",
    "nll_loss_on_logits",
    "cross_entropy_targets_not_probabilities",
    "cross_entropy_one_class",
)
C = 5


def _softmax_ce(logits, y):
    probs = torch.softmax(logits, dim=1)
    return F.cross_entropy(probs, y)


def _sigmoid_bce(logits, y):
    return F.binary_cross_entropy_with_logits(torch.sigmoid(logits), F.one_hot(y, C).float())


def _nll_probs(logits, y):
    return F.nll_loss(F.softmax(logits, dim=1), y)


def _nll_logits(logits, y):
    return nn.NLLLoss()(logits, y)


def _ce_scaled_onehot(logits, y):
    return F.cross_entropy(logits, 2.0 * F.one_hot(y, C).float())


def _ce_bad_smoothing(logits, y):
    # label smoothing by hand, forgetting to take the mass off the true class: rows sum to 1.5
    return nn.CrossEntropyLoss()(logits, F.one_hot(y, C).float() + 0.1)


def _ce_one_output(logits, y):
    # pytorch/examples' distributed/ddp-tutorial-series: a Linear(20, 1) model, float targets of
    # shape [B, 1] and F.cross_entropy: log_softmax over one score is 0, the loss 0, every gradient
    # 0. trainguard said the targets were not probabilities, whose fix trains nothing either.
    return F.cross_entropy(logits[:, :1], torch.rand(len(y), 1))


def _ce_one_output_labels(logits, y):
    return F.cross_entropy(logits[:, :1], torch.zeros_like(y))


def _healthy_log_softmax_nll(logits, y):
    return F.nll_loss(F.log_softmax(logits, dim=1), y)


def _healthy_smoothed_probs(logits, y):
    eps = 0.1
    target = F.one_hot(y, C).float() * (1 - eps) + eps / C
    return F.cross_entropy(logits, target)


def _healthy_label_smoothing(logits, y):
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def _healthy_onehot_probs(logits, y):
    return F.cross_entropy(logits, F.one_hot(y, C).float())


def _healthy_bce_logits(logits, y):
    return F.binary_cross_entropy_with_logits(logits, F.one_hot(y, C).float())


def _healthy_bce_sigmoid(logits, y):
    return F.binary_cross_entropy(torch.sigmoid(logits), F.one_hot(y, C).float())


def _healthy_distillation(logits, y):
    teacher = torch.softmax(torch.randn_like(logits) * 2, dim=1)
    return F.cross_entropy(logits, teacher) + F.cross_entropy(logits, y)


def _healthy_kd_kl_div(logits, y):
    # knowledge distillation as PyTorch's QAT/KD tutorials write it: KL at temperature 4 to a frozen
    # teacher's softmax; F.kl_div is xlogy(t, t) - t * log_softmax, whose target sits under a sub, not a neg
    teacher = torch.randn_like(logits) * 2
    t = 4.0
    kl = F.kl_div(F.log_softmax(logits / t, 1), F.softmax(teacher / t, 1), reduction="batchmean") * t * t
    return 0.5 * F.cross_entropy(logits, y) + 0.5 * kl


BROKEN = {
    "softmax_before_cross_entropy": _softmax_ce,
    "sigmoid_before_bce_with_logits": _sigmoid_bce,
    "nll_loss_on_probabilities": _nll_probs,
    "nll_loss_on_logits": _nll_logits,
    "cross_entropy_targets_not_probabilities": _ce_scaled_onehot,
    "cross_entropy_one_class": _ce_one_output,
}
HEALTHY = [_healthy_log_softmax_nll, _healthy_smoothed_probs, _healthy_label_smoothing, _healthy_onehot_probs,
           _healthy_bce_logits, _healthy_bce_sigmoid, _healthy_distillation, _healthy_kd_kl_div]


def _train(loss_fn, steps=6, metric_ops=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, C))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(32, 8)
        y = torch.randint(0, C, (32,))
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        total = torch.zeros(())
        for _ in range(metric_ops):  # bookkeeping after the step (metrics, logging)
            total = total + 1


def _monitored(tmp_path, loss_fn):
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _train(loss_fn)
    return mon.findings


def _recorded(tmp_path, loss_fn, **kw):
    with tg.record(tmp_path / "rec", **kw):
        _train(loss_fn)
    with open_run(tmp_path / "rec") as run:
        return diagnose(run), run.meta


def _only(findings, kind):
    got = [f for f in findings if f.kind in MISUSE and f.is_problem]
    assert [f.kind for f in got] == [kind], [(f.kind, f.title) for f in findings]
    return got[0]


@pytest.mark.parametrize("kind", MISUSE)
def test_monitor_alone_names_the_misuse_from_the_autograd_graph(tmp_path, kind):
    f = _only(_monitored(tmp_path, BROKEN[kind]), kind)
    assert f.severity == "warning"
    assert f.suggestion and f.evidence["chain"]
    assert f.evidence["source"] == "autograd graph"
    # where the loss was backpropagated from: this file
    assert f.evidence["backward_at"]["file"].endswith("test_graph_rules.py")


@pytest.mark.parametrize("kind", MISUSE)
def test_a_recording_names_the_misuse_with_file_and_line_of_both_ends(tmp_path, kind):
    findings, _ = _recorded(tmp_path, BROKEN[kind])
    f = _only(findings, kind)
    assert f.evidence["source"] == "recorded op graph"
    chain = f.evidence["chain"]
    assert len(chain) >= 2
    for end in (chain[0], chain[-1]):
        assert end["file"].endswith("test_graph_rules.py") and end["line"] > 0, chain
    assert " -> " in f.evidence["chain_text"]


def test_the_evidence_reads_softmax_log_softmax_nll_loss(tmp_path):
    findings, _ = _recorded(tmp_path, _softmax_ce)
    f = _only(findings, "softmax_before_cross_entropy")
    ops = [link["op"] for link in f.evidence["chain"]]
    assert ops == ["softmax", "log_softmax", "nll_loss"]
    assert "remove the softmax" in f.suggestion.lower()
    import inspect

    src, start = inspect.getsourcelines(_softmax_ce)
    softmax_line = start + next(i for i, s in enumerate(src) if "torch.softmax" in s)
    assert f.evidence["chain"][0]["line"] == softmax_line


def test_recording_with_a_small_buffer_keeps_the_first_loss_chain(tmp_path):
    # Each step ends with 100 bookkeeping ops: every loss falls out of a 50-execution buffer but
    # the loss chains of the first backward passes, which the recorder pins.
    with tg.record(tmp_path / "rec", buffer=50):
        _train(_nll_probs, steps=20, metric_ops=100)
    with open_run(tmp_path / "rec") as run:
        f = _only(diagnose(run), "nll_loss_on_probabilities")
    assert f.evidence["source"] == "recorded op graph"


def test_scaled_and_badly_smoothed_targets_are_both_not_probabilities(tmp_path):
    f = _only(_monitored(tmp_path, _ce_bad_smoothing), "cross_entropy_targets_not_probabilities")
    assert f.evidence["row_sum_max"] == pytest.approx(1.5, rel=1e-3)


@pytest.mark.parametrize("loss_fn", HEALTHY, ids=lambda f: f.__name__)
def test_healthy_losses_raise_nothing(tmp_path, loss_fn):
    got = [f.kind for f in _monitored(tmp_path, loss_fn) if f.kind in MISUSE]
    assert got == []
    findings, meta = _recorded(tmp_path, loss_fn)
    assert [f.kind for f in findings if f.kind in MISUSE] == []
    assert meta.get("loss_graph"), "the loss graph was inspected"


def test_no_recording_and_no_monitor_data_raise_nothing(tmp_path):
    findings, _ = _recorded(tmp_path, _healthy_log_softmax_nll, mode="no_tensor")
    assert [f.kind for f in findings if f.kind in MISUSE] == []


GALLERY = Path(__file__).resolve().parents[2] / "examples" / "broken"


@pytest.mark.parametrize("kind", MISUSE)
def test_trainguard_run_then_report_names_the_misuse(tmp_path, capsys, kind):
    """``trainguard run`` records (no monitor, no stored findings); the report still says it."""
    run = str(tmp_path / "run")
    assert main(["run", "--logdir", run, str(GALLERY / f"{kind}.py"), "--quiet", "--steps", "8"]) == 0
    capsys.readouterr()
    assert main(["report", "--json", run]) == 0
    report = json.loads(capsys.readouterr().out)
    got = [f for f in report["findings"] if f["kind"] == kind]
    assert got and got[0]["evidence"]["source"] == "recorded op graph"
    assert str(GALLERY / f"{kind}.py") in got[0]["evidence"]["chain_text"]
    assert [f["kind"] for f in report["findings"] if f["kind"] in MISUSE] == [kind]


def _hf_train(steps: int = 3) -> None:
    """A tiny random-init GPT-2 of transformers (its own loss: upcast logits, cross_entropy)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()


def _nanogpt_train() -> None:
    from true_models import train_gpt  # derived from karpathy/nanoGPT's model.py

    train_gpt(steps=4)


@pytest.mark.parametrize("train", [_nanogpt_train, _hf_train], ids=["nanogpt", "hf_gpt2"])
def test_real_language_models_raise_nothing(tmp_path, train):
    """Attention's softmax is not before the loss; the LM head's logits go to cross_entropy."""
    with tg.record(tmp_path / "rec"), tg.Monitor(None, tmp_path / "rec", every=2) as mon:
        train()
    assert [f.kind for f in mon.findings if f.kind in MISUSE] == []
    with open_run(tmp_path / "rec") as run:
        assert [f.kind for f in diagnose(run) if f.kind in MISUSE] == []
        heads = [h for rec in run.meta["loss_graph"] for h in rec["heads"]]
    assert heads and all(h["loss"] == "nll_loss" and h["chain"][0] == "log_softmax" for h in heads), heads


def test_class_index_targets_over_one_output_are_one_class_too(tmp_path):
    f = _only(_monitored(tmp_path, _ce_one_output_labels), "cross_entropy_one_class")
    assert "mse_loss" in f.suggestion and "binary_cross_entropy_with_logits" in f.suggestion
    findings, _ = _recorded(tmp_path, _ce_one_output_labels)
    assert _only(findings, "cross_entropy_one_class").evidence["classes"] == 1


def _timm_soft_target_ce(logits, y, target=None):
    # timm/loss/cross_entropy.py SoftTargetCrossEntropy, the loss timm's train.py uses with mixup:
    # its log_softmax takes dim=-1, which autograd saves as 2**64 - 1
    if target is None:
        target = F.one_hot(y, C).float() * 0.7 + F.one_hot(y.roll(1), C).float() * 0.3  # mixup, lam 0.7
    loss = torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1)
    return loss.mean()


def _timm_mixup_targets_summed(logits, y):
    # mixup's targets added instead of weighted by lam: rows sum to 2
    return _timm_soft_target_ce(logits, y, F.one_hot(y, C).float() + F.one_hot(y.roll(1), C).float())


def test_soft_targets_over_the_last_dim_are_read(tmp_path, caplog):
    f = _only(_monitored(tmp_path / "bad", _timm_mixup_targets_summed), "cross_entropy_targets_not_probabilities")
    assert f.evidence["row_sum_max"] == pytest.approx(2.0) and f.evidence["classes"] == C
    findings = _monitored(tmp_path / "good", _timm_soft_target_ce)
    assert [f.kind for f in findings if f.kind in MISUSE] == []
    with open_run(tmp_path / "good" / "mon") as run:
        heads = [h for rec in run.meta["loss_graph"] for h in rec["heads"]]
    assert heads and all(h["loss"] == "soft_cross_entropy" and h["classes"] == C for h in heads), heads
    assert heads[0]["facts"]["row_sum_max"] == pytest.approx(1.0)
    assert "reading the loss graph failed" not in caplog.text


def _ce_negated_onehot(logits, y):
    return F.cross_entropy(logits, -F.one_hot(y, C).float())


def test_timm_soft_target_cross_entropy_is_healthy_in_a_recording_and_negated_targets_are_not(tmp_path):
    # sum(-target * log_softmax) multiplies in the negated targets; F.cross_entropy negates after the sum
    findings, meta = _recorded(tmp_path / "good", _timm_soft_target_ce)
    assert [f.kind for f in findings if f.kind in MISUSE] == []
    assert meta.get("loss_graph")
    findings, _ = _recorded(tmp_path / "bad", _ce_negated_onehot)
    _only(findings, "cross_entropy_targets_not_probabilities")
    _only(_monitored(tmp_path / "bad2", _ce_negated_onehot), "cross_entropy_targets_not_probabilities")


# A regression head of one output against targets of shape [N] (the classic silent bug; torch only
# warns "Using a target size ... different to the input size"): the loss compares every prediction
# with every target, and the model learns the targets' batch mean. trainguard said only "Loss is
# not decreasing" with a generic fix (shuffle targets with inputs, check nothing detaches).
BROADCAST_LOSSES = {
    "mse_loss": lambda p, t: F.mse_loss(p, t),
    "l1_loss": lambda p, t: nn.L1Loss()(p, t),
    "smooth_l1_loss": lambda p, t: F.smooth_l1_loss(p, t),
    "huber_loss": lambda p, t: nn.HuberLoss()(p, t),
}


def _regress(loss_fn, target=lambda y: y, steps=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(32, 8)
        y = target(x.sum(1))  # [32]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("name", list(BROADCAST_LOSSES))
def test_a_regression_loss_broadcast_against_its_targets_is_an_error(tmp_path, name):
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _regress(BROADCAST_LOSSES[name])
    [f] = [f for f in mon.findings if f.kind == "loss_broadcast"]
    assert f.severity == "error"
    assert f.evidence["loss"] == name
    assert f.evidence["prediction_shape"] == [32, 1] and f.evidence["broadcast_shape"] == [32, 32]
    assert f.evidence["backward_at"]["file"].endswith("test_graph_rules.py")
    assert "[32, 1]" in f.title and "[32, 32]" in f.title
    assert "squeeze" in f.suggestion
    with tg.record(tmp_path / "rec"):  # trainguard run without --monitor: the report still says it
        _regress(BROADCAST_LOSSES[name])
    with open_run(tmp_path / "rec") as run:
        assert [f.kind for f in diagnose(run) if f.kind == "loss_broadcast"] == ["loss_broadcast"]


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("target", [lambda y: y.unsqueeze(1), lambda y: y[:1], lambda y: y.mean()],
                         ids=["same shape", "one target", "scalar target"])
def test_a_regression_loss_with_matching_or_constant_targets_is_no_broadcast(tmp_path, target):
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _regress(BROADCAST_LOSSES["mse_loss"], target)
    assert [f.kind for f in mon.findings if f.kind == "loss_broadcast"] == []


def _label_smoothed_nll(lprobs, target, epsilon=0.1, dim=1):
    # segmentation_models_pytorch's SoftCrossEntropyLoss (losses/_functional.py:label_smoothed_nll_loss,
    # from fairseq): the NLL as -lprobs.gather(...), no nll_loss op
    target = target.unsqueeze(dim)
    nll = -lprobs.gather(dim=dim, index=target).squeeze(dim).mean()
    smooth = -lprobs.sum(dim=dim, keepdim=True).squeeze(dim).mean()
    return (1.0 - epsilon) * nll + epsilon / lprobs.size(dim) * smooth


def test_a_softmax_before_a_gathered_nll_is_named(tmp_path):
    # smp's Unet(activation="softmax2d") trained with SoftCrossEntropyLoss (log_softmax of the
    # softmax) under `trainguard monitor`: "Training looks healthy", the loss graph had no head
    f = _only(_monitored(tmp_path, lambda z, y: _label_smoothed_nll(F.log_softmax(F.softmax(z, 1), 1), y)),
              "softmax_before_cross_entropy")
    assert f.evidence["source"] == "autograd graph"
    healthy = _monitored(tmp_path / "h", lambda z, y: _label_smoothed_nll(F.log_softmax(z, 1), y))
    assert not [f for f in healthy if f.kind in MISUSE and f.is_problem]


def _flow_nll(out, y):
    # normflows' forward_kld on an affine flow: -log N(z; 0, 1) - log|det|, no targets compared
    shift, log_scale = out[:, :2], out[:, 2:4]
    z = (out[:, 4:].detach() - shift) * torch.exp(-log_scale)
    return (0.5 * z.pow(2).sum(1) + log_scale.sum(1)).mean()


@pytest.mark.parametrize("loss_fn, functions", [(_flow_nll, []), (_healthy_log_softmax_nll, ["nll_loss"]),
                                                (lambda out, y: F.mse_loss(out, torch.randn_like(out)), ["mse_loss"]),
                                                (_healthy_bce_logits, ["binary_cross_entropy_with_logits"]),
                                                # facebookresearch/DiT gaussian_diffusion.py @ ed81ce2:
                                                # mean_flat((target - model_output) ** 2), an MSE by hand
                                                (lambda out, y: ((torch.randn_like(out) - out) ** 2).mean(),
                                                 ["squared_error"])],
                         ids=["flow", "nll", "mse", "bce", "mse_by_hand"])
def test_the_loss_watch_stores_which_loss_functions_the_loss_holds(tmp_path, loss_fn, functions):
    # loss_not_decreasing tells a loss that compares targets to check them, and a likelihood of the
    # data (a flow, a GP's -mll) to check its sign: the loss watch says which one it is.
    _monitored(tmp_path, loss_fn)
    with open_run(tmp_path / "mon") as run:
        recs = run.meta["loss_graph"]
    assert recs and all(r["loss_functions"] == functions for r in recs), recs


def _bce_mask_255(logits, y):
    # milesial/Pytorch-UNet train.py (@21d7850) with n_classes=1 on masks stored as 0/255 PNGs:
    # criterion(masks_pred.squeeze(1), true_masks.float()) with true_masks in {0, 255}
    return F.binary_cross_entropy_with_logits(logits, F.one_hot(y, C).float() * 255)


def _healthy_bce_soft_labels(logits, y):
    return F.binary_cross_entropy_with_logits(logits, F.one_hot(y, C).float() * 0.8 + 0.1)


def test_bce_targets_outside_0_1_are_named_by_the_monitor_and_the_recording(tmp_path):
    # The loss went 4.9 -> -267 on the UNet and the verdict was "healthy": BCE has no minimum there.
    f = next(f for f in _monitored(tmp_path, _bce_mask_255) if f.kind == "bce_targets_not_probabilities")
    assert f.severity == "warning" and f.evidence["target_max"] == 255
    assert "255" in f.title and "/ 255" in f.suggestion
    assert "healthy" not in [g.kind for g in _monitored(tmp_path / "again", _bce_mask_255)]
    findings, _ = _recorded(tmp_path, _bce_mask_255)
    f = next(f for f in findings if f.kind == "bce_targets_not_probabilities")
    assert f.evidence["source"] == "recorded op graph"
    assert f.evidence["chain"][-1]["file"].endswith("test_graph_rules.py")
    for healthy in (_healthy_bce_logits, _healthy_bce_sigmoid, _healthy_bce_soft_labels):
        assert "bce_targets_not_probabilities" not in [g.kind for g in _monitored(tmp_path / healthy.__name__, healthy)]
