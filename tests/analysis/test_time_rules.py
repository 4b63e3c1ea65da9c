"""``gradient_explodes_through_time`` on synthetic runs, and what it explains."""

from __future__ import annotations

import numpy as np

from trainguard.analysis import diagnose
from trainguard.store import acquire_writer, open_run, release_writer

PARAMS = {
    "cell.weight": {"layer": "cell", "module_type": "Linear", "shape": [32, 32], "requires_grad": True},
    "head.weight": {"layer": "head", "module_type": "Linear", "shape": [1, 32], "requires_grad": True},
}


def write_run(path, growth: float, calls: int = 40, rnn: str | None = None):
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
    layers = [{"name": "cell", "type": "Linear"}, {"name": "head", "type": "Linear"}]
    if rnn is not None:
        layers.insert(0, {"name": "decoder.rnn", "type": rnn})
    w.set_meta(monitor={"every": 10, "layers": layers, "params": PARAMS, "order": [d["name"] for d in layers]})
    release_writer(w)
    return open_run(path)


def test_gradients_growing_through_the_loop(tmp_path):
    fs = diagnose(write_run(tmp_path / "r", growth=1.3))
    f = next(f for f in fs if f.kind == "gradient_explodes_through_time")
    assert f.severity == "error" and f.layers == ["cell"]
    assert f.evidence["calls_per_forward"] == 40 and f.evidence["growth_per_call"] == 1.3
    assert f.evidence["grad_first_over_last"] > 1e4
    assert "clip_grad_norm_" in f.suggestion and "orthogonal_" in f.suggestion


def test_a_model_that_uses_a_gru_already_is_not_told_to_use_one(tmp_path):
    # bentrevett/pytorch-seq2seq legacy/4's decoder (nn.GRU, its attention's Linear layers called
    # once per target token) trained with SGD at lr 5 and no clipping: the fix ended "or use nn.GRU
    # / nn.LSTM", the layer its loop already runs
    plain = next(f for f in diagnose(write_run(tmp_path / "plain", growth=1.3)) if f.kind == "gradient_explodes_through_time")
    assert "use nn.GRU / nn.LSTM" in plain.suggestion
    for rnn in ("GRU", "LSTMCell"):
        fs = diagnose(write_run(tmp_path / rnn, growth=1.3, rnn=rnn))
        f = next(f for f in fs if f.kind == "gradient_explodes_through_time")
        assert "use nn.GRU" not in f.suggestion and f"decoder.rnn is an nn.{rnn} already" in f.suggestion, f.suggestion
        assert "weight_hh" in f.suggestion


def test_a_stable_or_fading_loop_is_not_exploding(tmp_path):
    for growth in (1.0, 0.8, 1.05):
        fs = diagnose(write_run(tmp_path / f"r{growth}", growth=growth))
        assert "gradient_explodes_through_time" not in [f.kind for f in fs]


def test_a_loop_whose_gradients_blew_up_after_the_loss_diverged_is_explained_by_the_rate(tmp_path):
    # pytorch-tabnet's TabNetClassifier.fit (n_steps=3, batch 128, virtual batch 32) at lr=10 under
    # `trainguard monitor`: the loss went 0.87 -> 460 by step 1; its shared GLU layers (called once per
    # decision step) and ghost batch norms (once per virtual batch) were 4 calls per forward with a
    # first/last gradient ratio of 1.2-1.4 at steps 0-20 and 4e13 at step 40, when the network had
    # collapsed (gradient norm 2e-5). The report led with "Gradients explode through time" and a
    # recurrent-init / truncated-BPTT / GRU fix, the rate that did it folded under it.
    w = acquire_writer(tmp_path / "r")
    for s in range(50):
        w.add_scalars(s, {"loss": 0.87 if s == 0 else 460.0 / (1 + s / 10), "lr/0": 10.0})
    rows = []
    for s in range(0, 50, 10):
        first, last = (0.6, 0.2) if s < 30 else (3.4e-8, 7.9e-22)
        rows += [(s, "cell", "through_time", "calls", 4), (s, "cell", "through_time", "grad_first", first),
                 (s, "cell", "through_time", "grad_last", last),
                 (s, "cell", "through_time", "growth_per_call", (first / last) ** (1 / 3))]
    w.add_layer_stats(rows)
    w.set_meta(monitor={"every": 10, "layers": [{"name": "cell", "type": "Linear"}, {"name": "head", "type": "Linear"}],
                        "params": PARAMS, "order": ["cell", "head"]})
    release_writer(w)
    fs = {f.kind: f for f in diagnose(open_run(tmp_path / "r"))}
    tt = fs["gradient_explodes_through_time"]
    assert tt.evidence["began"] == 30
    assert "explained_by" not in fs["lr_too_high"].evidence
    assert tt.evidence["explained_by"] == ["lr_too_high"] and tt.severity == "info"


def test_a_loop_exploding_from_the_start_still_explains_the_rate(tmp_path):
    # the gallery's rnn_exploding_through_time.py: the loop's gradients grow from the first step, and
    # the "learning rate too high" read off the blown-up loss is their symptom
    w = acquire_writer(tmp_path / "r")
    for s in range(50):
        w.add_scalars(s, {"loss": 0.87 if s == 0 else 460.0 / (1 + s / 10), "lr/0": 1e-2})
    rows = []
    for s in range(0, 50, 10):
        rows += [(s, "cell", "through_time", "calls", 40), (s, "cell", "through_time", "grad_first", 0.01 * 1.3 ** 39),
                 (s, "cell", "through_time", "grad_last", 0.01), (s, "cell", "through_time", "growth_per_call", 1.3)]
    w.add_layer_stats(rows)
    w.set_meta(monitor={"every": 10, "layers": [{"name": "cell", "type": "Linear"}, {"name": "head", "type": "Linear"}],
                        "params": PARAMS, "order": ["cell", "head"]})
    release_writer(w)
    fs = {f.kind: f for f in diagnose(open_run(tmp_path / "r"))}
    assert fs["gradient_explodes_through_time"].evidence["began"] == 0
    assert "explained_by" not in fs["gradient_explodes_through_time"].evidence
    assert fs["lr_too_high"].evidence["explained_by"] == ["gradient_explodes_through_time"]
