"""The validation-pass rules (overfitting, labels unrelated to inputs, leakage) and causes over
symptoms, on small synthetic runs written through the store's writer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainguard.analysis import diagnose
from trainguard.analysis._causes import EXPLAINS, IN_TRAINING, explain, fold
from trainguard.store import Finding, acquire_writer, open_run, release_writer

PARAMS = {"0.weight": {"layer": "0", "module_type": "Linear", "shape": [5, 20], "requires_grad": True}}


def write_run(path, loss, val=(), acc=(), validation=None):
    w = acquire_writer(path)
    for s, v in enumerate(loss):
        w.add_scalars(s, {"loss": v, "lr/0": 1e-3})
    for s, v in val:
        w.add_scalars(s, {"val_loss": v})
    for s, v in acc:
        w.add_scalars(s, {"val_accuracy": v})
    w.set_meta(monitor={"every": 5, "layers": [{"name": "0", "type": "Linear"}], "params": PARAMS, "order": ["0"],
                        "validation": validation or {"classes": 5}})
    release_writer(w)
    return open_run(path)


def train_curve(n=200, end=0.05, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return list(end + (1.6 - end) * np.exp(-t / 40) + 0.01 * rng.standard_normal(n))


def problems(fs):
    return [f.kind for f in fs if f.is_problem]


def test_overfitting_when_the_gap_grows_while_training_loss_falls(tmp_path):
    val = [(s, 1.2 * math.exp(-s / 40) + 0.5 + (0.006 * (s - 60) if s > 60 else 0)) for s in range(20, 200, 20)]
    fs = diagnose(write_run(tmp_path / "r", train_curve(), val=val))
    assert problems(fs) == ["overfitting"]
    f = fs[0]
    assert f.evidence["best_val_step"] == 60 and f.evidence["gap_end"] > f.evidence["gap_at_best"]
    assert "step 60" in f.suggestion and "weight decay" in f.suggestion


@pytest.mark.parametrize("seed", range(5))
def test_no_overfitting_while_validation_follows_training(tmp_path, seed):
    rng = np.random.default_rng(seed)
    val = [(s, 1.4 * math.exp(-s / 40) + 0.15 + 0.02 * rng.standard_normal()) for s in range(20, 200, 20)]
    fs = diagnose(write_run(tmp_path / "r", train_curve(seed=seed), val=val))
    assert problems(fs) == []


def test_no_overfitting_when_validation_rises_but_training_does_not_fall(tmp_path):
    flat = [0.3 + 0.01 * math.sin(s) for s in range(200)]
    val = [(s, 0.5 + 0.003 * s) for s in range(20, 200, 20)]
    assert "overfitting" not in problems(diagnose(write_run(tmp_path / "r", flat, val=val)))


def test_labels_unrelated_explains_the_overfitting(tmp_path):
    chance = math.log(5)
    val = [(s, chance + 0.004 * s) for s in range(20, 200, 20)]
    acc = [(s, 0.2 + 0.005 * (-1) ** (s // 20)) for s in range(20, 200, 20)]
    fs = diagnose(write_run(tmp_path / "r", train_curve(), val=val, acc=acc))
    assert problems(fs) == ["labels_unrelated"]
    f = fs[0]
    assert f.evidence["classes"] == 5 and f.evidence["explains"] == ["overfitting"]
    over = next(g for g in fs if g.kind == "overfitting")
    assert over.severity == "info" and over.evidence["explained_by"] == ["labels_unrelated"]


def test_chance_is_the_entropy_of_imbalanced_labels(tmp_path):
    """Half the validation labels are class 0: guessing the priors scores loss 1.39 (not ln 5 =
    1.61) and accuracy 0.5 (not 0.2); a validation pass stuck there learned nothing."""
    counts = [500, 125, 125, 125, 125]
    p = np.array(counts) / sum(counts)
    entropy = float(-(p * np.log(p)).sum())
    val = [(s, entropy + 0.002 * s) for s in range(20, 200, 20)]
    acc = [(s, 0.5) for s in range(20, 200, 20)]
    fs = diagnose(write_run(tmp_path / "r", train_curve(), val=val, acc=acc,
                            validation={"classes": 5, "label_counts": counts}))
    f = next(f for f in fs if f.kind == "labels_unrelated")
    assert f.evidence["chance_accuracy"] == 0.5 and f.evidence["chance_loss"].endswith(f"{entropy:.4f}")
    # without the counts, ln(5) and 1/5 make the same run look as if it learned something
    fs = diagnose(write_run(tmp_path / "r2", train_curve(), val=val, acc=acc, validation={"classes": 5}))
    assert "labels_unrelated" not in problems(fs)


def test_no_labels_unrelated_when_validation_learned_something(tmp_path):
    val = [(s, math.log(5) * (0.8 if s == 40 else 1.05)) for s in range(20, 200, 20)]
    assert "labels_unrelated" not in problems(diagnose(write_run(tmp_path / "r", train_curve(), val=val)))


def test_no_labels_unrelated_without_a_class_count(tmp_path):
    val = [(s, math.log(5) + 0.004 * s) for s in range(20, 200, 20)]
    run = write_run(tmp_path / "r", train_curve(), val=val, validation={"classes": None})
    assert "labels_unrelated" not in problems(diagnose(run))


def leak(batches, train_rows=2048):
    return {"classes": 5, "leak": {"train_rows": train_rows, "eval_rows": sum(b["rows"] for b in batches),
                                   "batches": batches}}


def test_leakage_from_copied_rows(tmp_path):
    batches = [{"pass": 1, "step": 50, "rows": 128, "close": [0.0] * 20 + [0.01] * 5 + [0.15] * 3}] * 4
    run = write_run(tmp_path / "r", train_curve(), validation=leak(batches))
    fs = diagnose(run)
    assert problems(fs) == ["train_val_leakage"]
    ev = fs[0].evidence
    assert (ev["copies_of_training_rows"], ev["exact_copies"], ev["near_copies"], ev["eval_rows_sampled"]) == (100, 80, 20, 512)


def test_a_pass_over_the_training_data_is_not_leakage(tmp_path):
    train_pass = [{"pass": 1, "step": 50, "rows": 128, "close": [0.0] * 128}] * 4
    val_pass = [{"pass": 1, "step": 50, "rows": 128, "close": [0.17]}] * 2
    run = write_run(tmp_path / "r", train_curve(), validation=leak(train_pass + val_pass))
    assert problems(diagnose(run)) == []


def test_a_coincidence_is_not_leakage(tmp_path):
    batches = [{"pass": 1, "step": 50, "rows": 128, "close": [0.0] * 2}] + [{"pass": 1, "step": 50, "rows": 128,
                                                                               "close": []}] * 3
    assert problems(diagnose(write_run(tmp_path / "r", train_curve(), validation=leak(batches)))) == []


def finding(kind, severity="warning"):
    return Finding(kind=kind, severity=severity, title=kind, source="monitor")


def test_explain_folds_a_chain_under_its_root_cause_and_puts_it_first():
    fs = [finding("lr_too_high", "error"), finding("loss_oscillating"), finding("vanishing_gradient"),
          finding("gradient_explodes_through_time"), finding("dead_units")]
    explain(fs)
    sev = {f.kind: f.severity for f in fs}
    assert sev == {"lr_too_high": "info", "loss_oscillating": "info", "vanishing_gradient": "info",
                   "gradient_explodes_through_time": "error", "dead_units": "warning"}
    root = fs[3]
    assert sorted(root.evidence["explains"]) == ["loss_oscillating", "lr_too_high", "vanishing_gradient"]
    assert fs[1].evidence["explained_by"] == ["gradient_explodes_through_time", "lr_too_high"]
    folded = fold([f.to_dict() for f in sorted(fs, key=lambda f: -f.rank)])
    assert [f["kind"] for f in folded] == ["gradient_explodes_through_time", "dead_units"]
    assert [s["kind"] for s in folded[0]["symptoms"]] == ["lr_too_high", "loss_oscillating", "vanishing_gradient"]


def test_explain_leaves_unrelated_findings_alone():
    fs = [finding("dead_units"), finding("overfitting")]
    explain(fs)
    assert [f.severity for f in fs] == ["warning", "warning"] and all("explains" not in f.evidence for f in fs)
    assert fold([f.to_dict() for f in fs]) == [f.to_dict() for f in fs]


def test_the_explanation_table_has_no_cycle():
    # an in-training relation that reverses one of EXPLAINS replaces it where it holds (a loop's
    # gradients exploding after the rate diverged): never both at once
    def reach(kind, seen):
        in_training = [k for k in IN_TRAINING.get(kind, ()) if kind not in EXPLAINS.get(k, ())]
        for k in (*EXPLAINS.get(kind, ()), *in_training):
            assert k not in seen, (kind, k)
            reach(k, seen | {k})

    for cause in EXPLAINS:
        reach(cause, {cause})


def test_a_nan_validation_loss_is_a_finding_not_a_healthy_verdict(tmp_path):
    # skorch's README example (NeuralNetClassifier: a softmax module, NLLLoss on log(p + eps),
    # a validation pass under no_grad in eval mode after each epoch) with one sample of the
    # validation split holding +inf: training was fine, every validation loss NaN, and the
    # verdict said "Training looks healthy".
    import torch
    from torch import nn

    import trainguard as tg

    torch.manual_seed(0)
    x = torch.randn(320, 20)
    y = (x[:, :10].sum(1) > 0).long()
    x[300, 3] = math.inf  # the corrupt sample, in the validation split
    train, valid = (x[:256], y[:256]), (x[256:], y[256:])
    model = nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 2), nn.Softmax(dim=-1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eps = torch.finfo(torch.float32).eps
    with tg.Monitor(model, tmp_path / "r", every=5) as mon:
        for _epoch in range(4):
            model.train()
            for i in range(0, 256, 32):
                loss = nn.functional.nll_loss(torch.log(model(train[0][i:i + 32]) + eps), train[1][i:i + 32])
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                for i in range(0, 64, 32):
                    nn.functional.nll_loss(torch.log(model(valid[0][i:i + 32]) + eps), valid[1][i:i + 32])
    fs = mon.findings
    assert "healthy" not in [f.kind for f in fs], [(f.kind, f.title) for f in fs]
    f = next((f for f in fs if f.kind == "nonfinite_val_loss"), None)
    assert f is not None and f.is_problem, [(f.kind, f.title) for f in fs]
    assert f.evidence["first_step"] == 8 and f.evidence["nonfinite_evaluations"] == f.evidence["evaluations"] == 4


def test_validation_labels_all_of_one_class_are_a_finding_not_a_healthy_verdict(tmp_path):
    # lucidrains/vit-pytorch's ViT (vit_pytorch/vit.py @ 69d24fe; image 32, patch 8, dim 32, depth 2,
    # 4 classes, Adam at 2e-3, 80 steps) on labels that are all 0: the loss fell from 0.111 to 0.0045,
    # validation accuracy 100%, and the verdict was "Training looks healthy". The monitor had counted
    # the validation labels: [512, 0, 0, 0].
    loss = train_curve(80, end=0.004)
    val = [(s, 0.02 / (1 + s / 20)) for s in range(20, 100, 20)]
    acc = [(s, 1.0) for s in range(20, 100, 20)]
    one = {"loss_fn": "cross_entropy", "classes": 4, "batches": 4, "passes": 4, "label_counts": [512, 0, 0, 0]}
    fs = diagnose(write_run(tmp_path / "r", loss, val=val, acc=acc, validation=one))
    assert problems(fs) == ["labels_one_class"], [(f.kind, f.title) for f in fs]
    f = fs[0]
    assert f.severity == "warning" and "class 0" in f.title and "512" in f.title, f.title
    assert "healthy" not in [f.kind for f in fs]
    # labels of every class, however imbalanced, and too few labels to say: no finding
    some = one | {"label_counts": [500, 4, 4, 4]}
    assert "labels_one_class" not in problems(diagnose(write_run(tmp_path / "s", loss, val=val, acc=acc,
                                                                 validation=some)))
    few = one | {"label_counts": [8, 0, 0, 0]}
    assert "labels_one_class" not in problems(diagnose(write_run(tmp_path / "f", loss, val=val, acc=acc,
                                                                 validation=few)))


def _regression(var=1.0, n=3000, mean=0.2):
    """What the monitor stores for an MSE validation pass: the count, sum and sum of squares of
    its targets (``target_moments``), whose variance is the MSE of always predicting their mean."""
    return {"loss_fn": "mse_loss", "classes": None, "target_moments": [n, n * mean, n * (var + mean**2)]}


def test_an_mse_validation_loss_that_never_beats_the_targets_mean_is_labels_unrelated(tmp_path):
    """thuml/Time-Series-Library's forecasting loop with the validation split's time steps shuffled
    before windowing: each window's horizon is unrelated to its inputs. DLinear's training MSE fell
    1.19 -> 0.675 while the validation MSE rose 1.33 -> 1.74, above 0.99, the MSE of predicting the
    validation targets' mean; the run got ``overfitting`` and its advice to regularise."""
    val = [(s, 1.33 + 0.002 * s) for s in range(28, 200, 28)]
    curve = [0.67 + 0.55 * math.exp(-s / 40) for s in range(200)]
    fs = diagnose(write_run(tmp_path / "r", curve, val=val, validation=_regression(0.99)))
    f = next(f for f in fs if f.kind == "labels_unrelated")
    assert f.is_problem and f.evidence["classes"] is None and f.evidence["chance_loss"].endswith("0.9900")
    assert "mean" in f.title and "time" in f.suggestion
    # a forecaster that beats the mean on its validation split is no such thing
    good = [(s, 0.72 - 0.0003 * s) for s in range(28, 200, 28)]
    fs = diagnose(write_run(tmp_path / "r2", curve, val=good, validation=_regression(0.99)))
    assert "labels_unrelated" not in problems(fs)
