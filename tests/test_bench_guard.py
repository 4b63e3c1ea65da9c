"""The guard benchmark still runs and reports paired ratios (not a timing test)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_guard  # noqa: E402


@pytest.mark.timeout(240)
def test_bench_guard_prints_paired_ratios(tmp_path, capsys):
    out = bench_guard.main(["--models", "mlp", "--rounds", "2", "--steps", "4", "--fault-at", "2",
                            "--json", str(tmp_path / "g.json")])
    assert logging.getLogger("trainguard").level == logging.NOTSET  # left alone for the tests after it
    mlp = out["models"]["mlp"]["cpu"]
    assert set(mlp["ratio"]) == set(bench_guard.CONFIGS) and mlp["ratio"]["plain"] == 1.0
    for c in bench_guard.CONFIGS:
        lo, hi = mlp["range"][c]
        assert lo <= mlp["ratio"][c] <= hi and lo > 0
    assert mlp["guard_vs_ckpt_range"][0] <= mlp["guard_vs_ckpt"] <= mlp["guard_vs_ckpt_range"][1]
    # the poisoned block rewound once (block() asserts it) and replayed the steps before the fault
    assert out["models"]["mlp"]["replayed_steps"] == 2
    lo, hi = mlp["rewind_range_ms"]
    assert lo <= mlp["rewind_ms"] <= hi
    hooks = out["models"]["mlp"]["hooks"]
    assert hooks["sentry"] > 0 and hooks["boundary"] > 0 and 0 < hooks["share_of_plain_step"] < 1
    printed = capsys.readouterr().out
    assert "ckpt+guard / ckpt" in printed and "one rewind + replay" in printed and "[range]" in printed and (tmp_path / "g.json").exists()
