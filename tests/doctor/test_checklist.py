"""run_checklist: every check on one setup, a verdict per check, and the results in a run."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from torch import nn

from trainguard import doctor
from trainguard.store import loads, open_run


def test_healthy_setup_passes_every_check(mlp, batches, blobs, new_blobs):
    test = new_blobs(512, seed=2)
    r = doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), test=test, num_classes=10,
                             optimizer_factory=lambda p: torch.optim.Adam(p, lr=1e-3))
    assert [x.check for x in r.results] == ["validate_data", "init_checks", "overfit_one_batch", "gradient_check",
                                            "lr_range_test"]
    assert r.passed, [(x.check, x.summary) for x in r.results]
    assert all(x.verdict == "pass" for x in r.results)
    assert set(r.seconds) == {x.check for x in r.results}


def test_a_check_that_raises_becomes_an_error_result(mlp, batches):
    calls = {"n": 0}

    def loss(out, y):
        calls["n"] += 1
        if calls["n"] > 1:  # works for init_checks, breaks afterwards
            raise RuntimeError("loss exploded")
        return nn.functional.cross_entropy(out, y)

    r = doctor.run_checklist(mlp, batches, loss, checks=["init", "overfit", "lr"], lr_steps=10)
    assert [x.verdict for x in r.results] == ["pass", "error", "error"]
    assert r.results[1].summary == "could not run: RuntimeError: loss exploded"
    assert not r.passed
    assert any(f.kind == "doctor_check_error" for f in r.findings())


def test_report_is_written_to_a_run_and_read_back(mlp, batches, tmp_path):
    r = doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), checks=["init", "lr"], lr_steps=30)
    r.save(tmp_path / "run")
    with open_run(tmp_path / "run") as run:
        stored = run.findings(source="doctor")
        assert sorted(f["kind"] for f in stored) == sorted(f.kind for f in r.findings())
        assert {a["name"] for a in run.artifacts()} == {
            "doctor/report.json", "doctor/lr_range_test.png", "doctor/lr_range_test.csv"}
        media, png = run.artifact("doctor/lr_range_test.png")
        assert media == "image/png" and png[:8] == b"\x89PNG\r\n\x1a\n"
        media, raw = run.artifact("doctor/report.json")
        report = loads(raw)
        assert media == "application/json"
        assert report["lr_range_test"]["suggestion"] == r.result("lr_range_test").suggestion
        assert report["verdicts"] == {"init_checks": "pass", "lr_range_test": "pass"}
        media, csv_text = run.artifact("doctor/lr_range_test.csv")
        assert media == "text/csv" and csv_text.decode().startswith("step,lr,loss,smoothed_loss\n")
        assert run.meta["doctor_passed"] is True


def test_saving_again_replaces_the_doctor_findings(mlp, batches, tmp_path):
    r = doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), checks=["init"])
    r.save(tmp_path / "run")
    r.save(tmp_path / "run")  # a second save adds to the run and replaces the doctor's findings
    with open_run(tmp_path / "run") as run:
        assert len(run.findings(source="doctor")) == len(r.findings())
    r.save(tmp_path / "run", overwrite=True)
    with open_run(tmp_path / "run") as run:
        assert len(run.findings(source="doctor")) == len(r.findings())


def test_results_join_a_recorded_run(mlp, batches, tmp_path):
    import trainguard as tg

    with tg.record(tmp_path / "run", buffer=-1):
        torch.ones(3).exp()
    r = doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), checks=["init"])
    r.save(tmp_path / "run")
    with open_run(tmp_path / "run") as run:
        assert run.count(op="exp") == 1 and run.status == "finished"
        assert len(run.findings(source="doctor")) == len(r.findings())
        assert run.artifact("doctor/report.json")[0] == "application/json"


def test_renders_a_verdict_table(mlp, batches):
    r = doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), checks=["init", "overfit"], overfit_steps=5)
    buf = io.StringIO()
    Console(file=buf, width=120).print(r)
    text = buf.getvalue()
    assert "trainguard doctor" in text and "init_checks" in text and "overfit_one_batch" in text
    # 5 steps are not enough to memorise the batch (at 20 every sample is right, 2.33 -> 0.206: a pass)
    assert "FAIL" in text


def test_setup_from_a_tuple_or_dict(mlp, batches):
    loss = nn.CrossEntropyLoss()
    s = doctor.DoctorSetup.from_value((mlp, batches, loss))
    assert s.model is mlp and s.optimizer_factory is None
    s = doctor.DoctorSetup.from_value({"model": mlp, "data": batches, "loss_fn": loss, "num_classes": 10})
    assert s.num_classes == 10


@pytest.mark.parametrize("value, match", [
    (3, "returned int"),
    ((1, 2), "returned a 2-tuple"),
    ({"model": None}, "without"),
    ({"model": 1, "data": [], "loss_fn": 1, "extra": 2}, "unknown keys"),
    ((nn.Linear(2, 2), [], "loss"), "loss_fn must be callable"),
    (("model", [], len), "model must be a torch.nn.Module"),
    ((nn.Linear(2, 2), 5, len), "data must be an iterable"),
    ((nn.Linear(2, 2), [], len, 5), "optimizer_factory"),
])
def test_bad_setups_are_value_errors(value, match):
    with pytest.raises(ValueError, match=match):
        doctor.DoctorSetup.from_value(value)


def test_bad_checklist_arguments(mlp, batches):
    with pytest.raises(ValueError, match="unknown checks"):
        doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), checks=["nope"])
    with pytest.raises(ValueError, match="no batches"):
        doctor.run_checklist(mlp, [], nn.CrossEntropyLoss())


class _TinyMAE(nn.Module):
    """A masked autoencoder's shape of call, derived from facebookresearch/mae (models_mae.py,
    main_pretrain.py @ efb2a80): the model returns its own reconstruction loss, the loader is an
    ImageFolder of one folder, so every (img, target) has target 0, and the loop is
    `for samples, _ in loader`: the loss never reads the target."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 4)
        self.dec = nn.Linear(4, 16)

    def forward(self, x):
        keep = torch.ones_like(x).index_fill(1, torch.arange(0, 16, 4), 0.0)
        return ((self.dec(self.enc(x * keep)) - x) ** 2).mean()


def test_placeholder_labels_the_loss_never_reads_do_not_fail_the_data_check():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(64, dtype=torch.long)),
                                       batch_size=16)
    report = doctor.run_checklist(_TinyMAE(), data, lambda out, y: out, checks=("data",))
    data_result = report.result("validate_data")
    assert data_result.verdict == "pass", data_result.summary
    unused = [f for f in data_result.findings() if f.kind == "targets_unused"]
    assert unused and unused[0].severity == "info", [f.kind for f in data_result.findings()]
    # the same labels under a loss that reads them are still one class, an error
    clf = nn.Linear(16, 3)
    report = doctor.run_checklist(clf, data, nn.CrossEntropyLoss(), checks=("data",))
    assert "single_class" in [f.kind for f in report.result("validate_data").findings()]
