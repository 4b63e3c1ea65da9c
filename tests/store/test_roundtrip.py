"""The writer and reader agree on every value, NaN and Inf included."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.store import ExecBatch, Finding, RunWriter, dumps, loads, open_run

values = st.floats(allow_nan=True, allow_infinity=True)


# No deadline and no too_slow check: on a loaded 2-core machine one example can take over 200 ms.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.one_of(values, st.integers(), st.text(max_size=5), st.none()),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                    max_leaves=10))
def test_json_codec_roundtrip(obj):
    back = loads(dumps(obj))

    def same(a, b):
        if isinstance(a, float) and math.isnan(a):
            return isinstance(b, float) and math.isnan(b)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    assert same(obj, back)


@settings(max_examples=25, deadline=None)
@given(st.lists(values, min_size=1, max_size=20))
def test_scalars_and_layer_stats_roundtrip(tmp_path_factory, xs):
    d = tmp_path_factory.mktemp("run") / "r"
    w = RunWriter(d)
    for i, x in enumerate(xs):
        w.add_scalars(i, {"loss": x})
    w.add_layer_stats([(i, "fc1", "gradient", "norm", x) for i, x in enumerate(xs)])
    w.close()
    run = open_run(d)
    got = [v for _, v in run.scalars("loss")["loss"]]
    got2 = [r["value"] for r in run.layer_stats(layer="fc1")]
    for a, b, c in zip(xs, got, got2):
        assert (math.isnan(a) and math.isnan(b) and math.isnan(c)) or a == b == c


def test_executions_findings_artifacts(tmp_path):
    w = RunWriter(tmp_path / "r", mode="full_health")
    w.put_stack(1, [(__file__, 3, "f")])
    w.put_module(1, "fc", "Linear")
    recs = [(i, 0, "forward", "aten.exp.default", 1, 1, None, None, [("input", None)],
             [("float32", [2], "cpu")], [(2.0, 0.0, 0.0, 1.0, 0.0, float(i == 3), 0.0)]) for i in range(5)]
    w.put_executions(ExecBatch(recs))
    f = Finding(kind="loss_spike", severity="warning", title="spike", evidence={"ratio": math.inf}, steps=(3, 4))
    w.add_findings("monitor", [f.to_dict()])
    w.add_findings("monitor", [f.to_dict()], replace=True)
    w.put_artifact("doctor/x.png", "image/png", b"\x89PNG")
    w.close()
    run = open_run(tmp_path / "r")
    assert run.count() == 5 and run.count(health="inf") == 1
    assert run.first_nonfinite()["seq"] == 3
    assert run.executions(1, 3)[0]["seq"] == 1 and len(run.executions(1, 3)) == 2
    (got,) = run.findings()
    assert got["evidence"]["ratio"] == math.inf and got["steps"] == [3, 4]
    assert run.artifact("doctor/x.png") == ("image/png", b"\x89PNG")
    assert run.index_of(3) == 3 and run.index_of(3, health="nonfinite") == 0


def test_per_step_scalars_are_kept_under_back_pressure(tmp_path, monkeypatch):
    # A NaN storm recorded with the monitor on (facebookresearch/dlrm with an inf embedding
    # gradient) filled the queue: the loss of ten steps was dropped, the curve had a hole and
    # the findings counted 30 steps of 40.
    import queue

    w = RunWriter(tmp_path / "run")
    real = w._q.put_nowait

    def full(item):
        raise queue.Full

    monkeypatch.setattr(w._q, "put_nowait", full)
    w.add_scalars(7, {"loss": 0.5, "grad_norm": float("nan")})
    monkeypatch.setattr(w._q, "put_nowait", real)
    w.close()
    with open_run(tmp_path / "run") as run:
        assert run.scalars("loss")["loss"] == [(7, 0.5)]
        assert math.isnan(run.scalars("grad_norm")["grad_norm"][0][1])
