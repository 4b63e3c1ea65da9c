"""The guard benchmark still runs and reports paired ratios (not a timing test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_guard  # noqa: E402


@pytest.mark.timeout(240)
def test_bench_guard_prints_paired_ratios(tmp_path, capsys):
    out = bench_guard.main(["--models", "mlp", "--rounds", "2", "--steps", "3", "--json", str(tmp_path / "g.json")])
    mlp = out["models"]["mlp"]["cpu"]
    assert set(mlp["ratio"]) == set(bench_guard.CONFIGS) and mlp["ratio"]["plain"] == 1.0
    for c in bench_guard.CONFIGS:
        lo, hi = mlp["range"][c]
        assert lo <= mlp["ratio"][c] <= hi and lo > 0
    hooks = out["models"]["mlp"]["hooks"]
    assert hooks["sentry"] > 0 and hooks["boundary"] > 0 and 0 < hooks["share_of_plain_step"] < 1
    printed = capsys.readouterr().out
    assert "guard / loop" in printed and "[range]" in printed and (tmp_path / "g.json").exists()
