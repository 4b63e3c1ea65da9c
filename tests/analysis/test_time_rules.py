"""``gradient_explodes_through_time`` on synthetic runs, and what it explains."""

from __future__ import annotations

import numpy as np

from trainguard.analysis import diagnose
from trainguard.store import acquire_writer, open_run, release_writer

PARAMS = {
    "cell.weight": {"layer": "cell", "module_type": "Linear", "shape": [32, 32], "requires_grad": True},
    "head.weight": {"layer": "head", "module_type": "Linear", "shape": [1, 32], "requires_grad": True},
}


def write_run(path, growth: float, calls: int = 40):
    w = acquire_writer(path)
    rng = np.random.default_rng(0)
    for s in range(100):
        w.add_scalars(s, {"loss": 1.0 * np.exp(-s / 40) + 0.1 + 0.01 * rng.standard_normal(), "lr/0": 1e-3})
    rows = []
    for s in range(0, 100, 10):
        last = 0.01
        rows += [(s, "cell", "through_time", "calls", calls), (s, "cell", "through_time", "grad_last", last),
                 (s, "cell", "through_time", "grad_first", last * growth ** (calls - 1)),
                 (s, "cell", "through_time", "growth_per_call", growth)]
    w.add_layer_stats(rows)
    w.set_meta(monitor={"every": 10, "layers": [{"name": "cell", "type": "Linear"}, {"name": "head", "type": "Linear"}],
                        "params": PARAMS, "order": ["cell", "head"]})
    release_writer(w)
    return open_run(path)


def test_gradients_growing_through_the_loop(tmp_path):
    fs = diagnose(write_run(tmp_path / "r", growth=1.3))
    f = next(f for f in fs if f.kind == "gradient_explodes_through_time")
    assert f.severity == "error" and f.layers == ["cell"]
    assert f.evidence["calls_per_forward"] == 40 and f.evidence["growth_per_call"] == 1.3
    assert f.evidence["grad_first_over_last"] > 1e4
    assert "clip_grad_norm_" in f.suggestion and "orthogonal_" in f.suggestion


def test_a_stable_or_fading_loop_is_not_exploding(tmp_path):
    for growth in (1.0, 0.8, 1.05):
        fs = diagnose(write_run(tmp_path / f"r{growth}", growth=growth))
        assert "gradient_explodes_through_time" not in [f.kind for f in fs]
