"""The recorder benchmark still runs and reports what its table claims (not a timing test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_recorder  # noqa: E402


def test_paired_ratios_per_round(monkeypatch):
    monkeypatch.setattr(bench_recorder, "WARMUP_SECONDS", 0.0)
    configs = ["plain", bench_recorder.FLOOR, "native:no_tensor", "python:no_tensor"]
    medians, ratios = bench_recorder.time_model("mlp", configs, rounds=3, steps=2)
    assert set(medians) == set(configs)
    assert all(len(v) == 3 for v in ratios.values())
    assert ratios["plain"] == [1.0, 1.0, 1.0]  # each round is paired with its own plain
    assert all(r > 0 for r in ratios["native:no_tensor"] + ratios["python:no_tensor"])


@pytest.mark.parametrize("name", ["nanogpt", "vae"])
def test_real_programs_train(name):
    import torch

    torch.manual_seed(0)
    model, opt, loss_fn = bench_recorder.MODELS[name]()
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(map(lambda v: v == v and v < 1e9, losses))


def test_bare_mode_changes_nothing():
    import torch

    model, opt, loss_fn = bench_recorder.make_mlp()
    torch.manual_seed(0)
    with bench_recorder.context(bench_recorder.FLOOR, "unused"):
        loss = loss_fn()
    assert torch.equal(loss, loss_fn())


@pytest.mark.timeout(240)
def test_main_prints_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_recorder, "WARMUP_SECONDS", 0.0)
    out = bench_recorder.main(["--models", "mlp", "--modes", "no_tensor", "--rounds", "2", "--steps", "1",
                               "--memory-steps", "1", "--json", str(tmp_path / "r.json")])
    mlp = out["models"]["mlp"]
    assert set(mlp["ratio"]) == {"plain", bench_recorder.FLOOR, "native:no_tensor", "python:no_tensor",
                                 "detect_anomaly"}
    lo, hi = mlp["ratio_range"]["native:no_tensor"]
    assert lo <= mlp["ratio"]["native:no_tensor"] <= hi
    assert mlp["peak_mib"]["plain"] > 0 and mlp["peak_mib"]["native"] > 0 and mlp["peak_mib"]["python"] > 0
    printed = capsys.readouterr().out
    assert "dispatch_floor" in printed and "[range]" in printed
    assert (tmp_path / "r.json").exists()


@pytest.mark.timeout(240)
def test_origin_benchmark_prints_its_pairs(tmp_path, capsys):
    import bench_origin

    out = bench_origin.main(["--pairs", "storm-mlp,mask", "--rounds", "1", "--warm", "1", "--steps", "1",
                             "--json", str(tmp_path / "o.json")])
    storm = out["pairs"]["storm-mlp"]
    assert (storm["a"], storm["b"]) == ("nan storm", "healthy")
    assert storm["time_ratio"] > 0 and storm["cpu_ratio"] > 0 and storm["size_ratio"] > 0
    assert set(out["pairs"]["mask"]["step_ms"]) == {"-inf", "finfo.min"}
    assert "nan storm / healthy" in capsys.readouterr().out and (tmp_path / "o.json").exists()
