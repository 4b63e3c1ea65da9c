"""``trainguard doctor module:function``: verdict table, run directory, exit codes, bad targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.cli import main
from trainguard.store import loads, open_run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "doctor"


def test_healthy_example_passes_and_writes_the_run(tmp_path, capsys):
    logdir = tmp_path / "run"
    code = main(["doctor", f"{EXAMPLES / 'blobs_mlp.py'}:setup", "--logdir", str(logdir)])
    out = capsys.readouterr().out
    assert code == 0, out
    for check in ("validate_data", "init_checks", "overfit_one_batch", "gradient_check", "lr_range_test"):
        assert check in out
    assert "FAIL" not in out and "all checks passed" in out and str(logdir) in out
    with open_run(logdir) as run:
        assert {a["name"] for a in run.artifacts()} >= {"doctor/report.json", "doctor/lr_range_test.png",
                                                       "doctor/lr_range_test.csv"}
        assert all(f["source"] == "doctor" for f in run.findings())
        report = loads(run.artifact("doctor/report.json")[1])
        assert report["passed"] is True and 1e-4 < report["lr_range_test"]["suggestion"] < 1e-1


def test_broken_example_fails_with_the_reasons(tmp_path, capsys):
    code = main(["doctor", f"{EXAMPLES / 'broken_mlp.py'}:setup", "--logdir", str(tmp_path / "run"), "--json",
                 "--skip", "lr"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdicts"] == {"validate_data": "fail", "init_checks": "warn", "overfit_one_batch": "fail",
                                  "gradient_check": "fail"}
    by_check = {r["check"]: r for r in report["results"]}
    assert by_check["overfit_one_batch"]["reason"] == "flat"
    assert "head.weight" in by_check["gradient_check"]["bad_params"]
    kinds = {f["kind"] for f in by_check["validate_data"]["findings"]}
    assert {"leaked_duplicates", "label_imbalance", "inputs_not_normalised"} <= kinds


def test_dotted_module_target_and_no_save(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny_setup.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))\n"
        "    return nn.Linear(4, 2), [(x[:32], y[:32]), (x[32:], y[32:])], nn.CrossEntropyLoss()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["doctor", "tiny_setup:make", "--checks", "init,gradcheck", "--no-save"])
    out = capsys.readouterr().out
    assert code == 0 and "gradient_check" in out and "overfit_one_batch" not in out
    assert not (tmp_path / "runs").exists()


BAD_TARGETS = {
    "no_colon": ("examples.doctor.blobs_mlp", "module:function"),
    "no_module": ("surely_not_a_module_xyz:setup", "cannot import module 'surely_not_a_module_xyz'"),
    "no_file": ("missing/file.py:setup", "no such file"),
    "no_function": ("{dir}/good.py:nothing", "has no function 'nothing'"),
    "not_callable": ("{dir}/good.py:VALUE", "is not callable"),
    "import_raises": ("{dir}/raises.py:setup", "importing '{dir}/raises.py' failed: ZeroDivisionError"),
    "syntax_error": ("{dir}/syntax.py:setup", "failed: SyntaxError"),
    "setup_raises": ("{dir}/good.py:explode", "raised KeyError"),
    "wrong_return": ("{dir}/good.py:wrong", "returned int; expected a dict"),
    "wrong_model": ("{dir}/good.py:wrong_model", "model must be a torch.nn.Module"),
}


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
def test_bad_targets_give_one_line_and_exit_2(case, tmp_path, capsys):
    (tmp_path / "good.py").write_text(
        "VALUE = 3\n"
        "def explode():\n    raise KeyError('missing')\n"
        "def wrong():\n    return 42\n"
        "def wrong_model():\n    return {'model': 'resnet', 'data': [], 'loss_fn': len}\n"
    )
    (tmp_path / "raises.py").write_text("1 / 0\n")
    (tmp_path / "syntax.py").write_text("def setup(:\n")
    target, message = BAD_TARGETS[case]
    code = main(["doctor", target.format(dir=tmp_path), "--no-save"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert err.startswith("trainguard: error: ") and err.count("\n") == 1
    assert message.format(dir=tmp_path) in err


def test_bad_options_exit_2(capsys):
    assert main(["doctor", f"{EXAMPLES / 'blobs_mlp.py'}:setup", "--checks", "data,nope", "--no-save"]) == 2
    assert "unknown checks ['nope']" in capsys.readouterr().err
    assert main(["doctor", f"{EXAMPLES / 'blobs_mlp.py'}:setup", "--lr-steps", "2", "--no-save"]) == 2


def test_existing_run_gets_the_results_added(tmp_path, capsys):
    args = ["doctor", f"{EXAMPLES / 'blobs_mlp.py'}:setup", "--checks", "init", "--logdir", str(tmp_path / "r")]
    assert main(args) == 0
    assert main(args) == 0
    assert main(args + ["--overwrite"]) == 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.sqlite").write_bytes(b"garbage" * 100)
    assert main(args[:-1] + [str(tmp_path / "bad")]) == 2
    assert "not a readable trainguard run" in capsys.readouterr().err
