"""The JSON API through an in-process client, against runs written with the store's writer."""

from __future__ import annotations

import math

import pytest

from trainguard.store import ExecBatch, RunWriter


def get(client, url, status=200, **params):
    r = client.get(url, params=params)
    assert r.status_code == status, (url, r.status_code, r.text)
    return r.json()


def test_health_and_index(client):
    assert get(client, "/api/health")["ok"] is True
    r = client.get("/")
    assert r.status_code == 200 and 'src="/static/js/app.js"' in r.text
    assert client.get("/static/js/app.js").headers["content-type"].startswith("text/javascript")


def test_runs_lists_every_run_and_says_which_is_damaged(client, logdir):
    runs = {r["id"]: r for r in get(client, "/api/runs")["runs"]}
    assert set(runs) == {"ref", "train", "group:nested", "damaged"}
    assert runs["ref"]["ok"] and runs["ref"]["executions"] == logdir.ref.total
    assert runs["ref"]["nonfinite"] == len(logdir.ref.bad_seqs)
    assert runs["group:nested"]["path"] == "group/nested"
    assert runs["damaged"]["ok"] is False and "not a readable trainguard run" in runs["damaged"]["error"]


def test_damaged_and_missing_runs_answer_json_errors_and_the_others_keep_working(client):
    err = get(client, "/api/runs/damaged", 422)["error"]
    assert err["type"] == "CorruptRun" and err["status"] == 422
    assert get(client, "/api/runs/damaged/executions", 422)["error"]["type"] == "CorruptRun"
    assert get(client, "/api/runs/nope", 404)["error"]["type"] == "RunNotFound"
    assert get(client, "/api/no/such/route", 404)["error"]["status"] == 404
    assert get(client, "/api/runs/ref")["executions"] > 0


def test_summary(client, logdir):
    s = get(client, "/api/runs/ref")
    ref = logdir.ref
    assert (s["executions"], s["steps"], s["nonfinite"]) == (ref.total, ref.steps, len(ref.bad_seqs))
    assert (s["first_seq"], s["last_seq"], s["status"], s["mode"]) == (0, ref.total - 1, "finished", "full_health")
    assert s["has"]["sources"] and s["has"]["scalars"] and not s["has"]["checkpoints"]
    assert s["revision"].startswith("finished@")


def test_alerts_point_at_the_first_log(client, logdir):
    a = get(client, "/api/runs/ref/alerts")
    assert a["total"] == len(logdir.ref.bad_seqs)
    assert a["first_seq"] == logdir.ref.first_bad_seq
    assert a["by_op"][0] == {"op": "aten.log", "count": 2, "first_seq": logdir.ref.first_bad_seq}


def test_origin_comes_from_the_analysis(client, logdir):
    o = get(client, "/api/runs/ref/origin")
    assert o["available"] is True and o["seq"] == logdir.ref.first_bad_seq
    assert o["result"]["origin"]["op"] == "aten.log"
    clean = get(client, "/api/runs/group:nested/origin")
    assert clean["available"] is False and "no execution" in clean["reason"]


def test_timeline_has_one_row_per_step(client, logdir):
    t = get(client, "/api/runs/ref/timeline")
    assert t["total"] == logdir.ref.total
    per_step = logdir.ref.total // logdir.ref.steps
    assert [row[0] for row in t["steps"]] == list(range(logdir.ref.steps))
    assert all(row[3] == per_step for row in t["steps"])
    assert [row[4] for row in t["steps"]] == [0, 0, per_step - 4, per_step - 4]


def test_executions_are_paged_with_begin_end(client, logdir):
    page = get(client, "/api/runs/ref/executions", begin=5, end=12)
    assert (page["begin"], page["end"], page["total"]) == (5, 12, logdir.ref.total)
    assert [d["seq"] for d in page["items"]] == list(range(5, 12))
    tail = get(client, "/api/runs/ref/executions", begin=logdir.ref.total - 3, end=logdir.ref.total + 50)
    assert len(tail["items"]) == 3 and tail["end"] == logdir.ref.total
    assert get(client, "/api/runs/ref/executions", begin=10_000, end=10_010)["items"] == []


@pytest.mark.parametrize(
    "params, expect",
    [
        ({"health": "nonfinite"}, lambda ref: ref.bad_seqs),
        ({"op": "log"}, lambda ref: [ref.seq_of[(s, "aten.log.default")] for s in range(ref.steps)]),
        ({"step": "1"}, lambda ref: list(range(ref.total // ref.steps, 2 * ref.total // ref.steps))),
        ({"step": "2:3", "phase": "optimizer"}, lambda ref: [ref.seq_of[(2, "aten.add_.Tensor")], ref.seq_of[(3, "aten.add_.Tensor")]]),
    ],
)
def test_execution_filters(client, logdir, params, expect):
    page = get(client, "/api/runs/ref/executions", begin=0, end=200, **params)
    want = sorted(expect(logdir.ref))
    assert [d["seq"] for d in page["items"]] == want and page["total"] == len(want)


@pytest.mark.parametrize(
    "params",
    [
        {"begin": -1},
        {"begin": 5, "end": 2},
        {"begin": 0, "end": 5000},
        {"begin": "x"},
        {"step": "two"},
        {"phase": "sideways"},
        {"health": "purple"},
        {"rank": "first"},
        {"step": str(2**63)},
        {"begin": str(2**64)},
    ],
)
def test_bad_query_parameters_are_400_with_a_message(client, params):
    err = get(client, "/api/runs/ref/executions", 400, **params)["error"]
    assert err["status"] == 400 and err["message"]


def test_one_execution_in_full(client, logdir, builders):
    ref = logdir.ref
    d = get(client, f"/api/runs/ref/executions/{ref.first_bad_seq}")
    assert d["op"] == "aten.log" and d["health"] == ["-inf"] and d["index"] == ref.first_bad_seq
    assert d["outputs"][0]["summary"]["neg_inf"] == 7
    (inp,) = d["inputs"]
    assert inp["producer"] == ref.first_bad_softmax_seq
    assert inp["producer_digest"]["op"] == "aten._softmax"
    assert inp["producer_digest"]["outputs"][0]["summary"]["zero"] == 7
    assert [c["op"] for c in d["consumers"]] == ["aten.mul.Tensor"]
    sm = get(client, f"/api/runs/ref/executions/{ref.first_bad_softmax_seq}")
    assert [c["op"] for c in sm["consumers"]] == ["aten.log", "aten.log_backward", "aten._softmax_backward_data"]
    assert d["user_frame"]["lineno"] == builders.line["log"] and d["user_frame"]["user"] is True
    assert [f["user"] for f in d["stack"]] == [True, True, True]
    assert get(client, "/api/runs/ref/executions/999999", 404)["error"]["type"] == "NotFound"
    assert get(client, "/api/runs/ref/executions/abc", 400)["error"]["status"] == 400
    assert "must be between" in get(client, f"/api/runs/ref/executions/{2**63}", 400)["error"]["message"]


def test_backward_execution_links_its_forward_op(client, logdir):
    seq = logdir.ref.seq_of[(2, "aten.log_backward.default")]
    d = get(client, f"/api/runs/ref/executions/{seq}")
    assert d["forward"]["seq"] == logdir.ref.first_bad_seq and d["forward"]["op"] == "aten.log"
    assert [f["user"] for f in d["stack"]] == [True, True, False]


def test_position_in_a_filtered_list(client, logdir):
    ref = logdir.ref
    for i, seq in enumerate(ref.bad_seqs):
        assert get(client, f"/api/runs/ref/executions/{seq}/position", health="nonfinite")["index"] == i
    assert get(client, f"/api/runs/ref/executions/{ref.total - 1}/position")["index"] == ref.total - 1


def test_stack_and_sources_come_from_the_run(client, logdir, builders):
    d = get(client, f"/api/runs/ref/executions/{logdir.ref.first_bad_seq}")
    stack = get(client, f"/api/runs/ref/stacks/{d['stack_id']}")
    assert stack["frames"] == d["stack"]
    get(client, "/api/runs/ref/stacks/9999", 404)
    files = {f["path"]: f for f in get(client, "/api/runs/ref/sources")["files"]}
    script = files[str(logdir.ref.script)]
    assert script["user"] and script["available"]
    src = get(client, f"/api/runs/ref/sources/{script['file_id']}")
    assert src["text"] == builders.script and src["lines"] == len(builders.script.splitlines())
    torch_file = next(f for p, f in files.items() if "site-packages" in p)
    assert not torch_file["available"]
    err = get(client, f"/api/runs/ref/sources/{torch_file['file_id']}", 404)["error"]
    assert "not readable when the run was recorded" in err["message"]
    get(client, "/api/runs/ref/sources/424242", 404)


def test_ops_counts(client, logdir):
    ops = {o["op"]: o["count"] for o in get(client, "/api/runs/ref/ops")["ops"]}
    assert ops["aten.addmm"] == 2 * logdir.ref.steps and sum(ops.values()) == logdir.ref.total


def test_scalars_spell_nan_explicitly(client):
    s = get(client, "/api/runs/ref/scalars")
    assert s["names"] == ["loss", "lr/0"]
    loss = s["series"]["loss"]
    assert loss["points"][:2] == [[0, 2.3], [1, pytest.approx(2.2)]]
    assert [p[1] for p in loss["points"][2:]] == ["NaN", "NaN"] and loss["nonfinite"] == 2


def test_long_scalar_series_are_reduced_but_keep_extremes_and_nonfinite(tmp_path, builders):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    w = RunWriter(tmp_path / "long", mode="no_tensor")
    for step in range(20_000):
        w.add_scalars(step, {"loss": math.inf if step == 12_345 else (100.0 if step == 777 else 1.0 + step % 7)})
        if step % 400 == 0:
            w.flush()  # scalars are dropped, and counted, when the queue is full
    w.close()
    with TestClient(create_app(tmp_path)) as c:
        loss = get(c, "/api/runs/long/scalars", max_points=1000)["series"]["loss"]
    assert loss["count"] == 20_000 and len(loss["points"]) <= 1000 + 1
    assert [12_345, "Infinity"] in loss["points"] and [777, 100.0] in loss["points"]
    assert min(p[1] for p in loss["points"] if isinstance(p[1], float)) == 1.0


def test_layer_stats_matrix(client):
    d = get(client, "/api/runs/train/layer_stats")
    assert (d["kind"], d["stat"]) == ("gradient", "mean_abs")
    assert d["layers"] == ["fc1", "fc2", "fc3"] and d["steps"] == list(range(0, 60, 5))
    assert d["values"][0][0] == pytest.approx(1e-2) and d["values"][2][1] == pytest.approx(1e-6 / 6)
    act = get(client, "/api/runs/train/layer_stats", kind="activation", stat="mean")
    assert act["values"][2][-1] == "Infinity" and act["values"][0][-1] == 0.5
    assert ["activation", "zero_frac"] in act["available"]
    assert get(client, "/api/runs/train/layer_stats", 404, kind="gradient", stat="nope")["error"]
    empty = get(client, "/api/runs/ref/layer_stats")
    assert empty["layers"] == [] and empty["available"] == []


def test_findings_and_verdict(client):
    d = get(client, "/api/runs/train/findings")
    stored = [f for f in d["findings"] if f["origin"] == "stored"]
    assert [f["kind"] for f in stored] == ["vanishing_gradient", "dead_units"]
    # the symptom it explains is folded under the cause, not listed on its own
    assert [f["kind"] for f in stored[0]["symptoms"]] == ["loss_not_decreasing"]
    assert stored[0]["suggestion"] == "use Kaiming initialisation"
    assert stored[0]["evidence"] == {"first_last_ratio": 10000.0, "layer": "fc3"}
    # the analysis' own diagnosis of the stored scalars joins them; most severe first
    assert d["diagnosis"]["available"] is True
    assert any(f["origin"] == "diagnosis" for f in d["findings"])
    rank = {"critical": 0, "error": 1, "warning": 2, "info": 3}
    assert [rank[f["severity"]] for f in d["findings"]] == sorted(rank[f["severity"]] for f in d["findings"])
    problems = [f for f in d["findings"] if rank[f["severity"]] <= 2]
    assert d["verdict"]["state"] == problems[0]["severity"] and d["verdict"]["problems"] == len(problems)
    assert d["verdict"]["text"].startswith(problems[0]["title"])


def test_verdict_rules():
    from trainguard.ui._training import _verdict

    warn = {"kind": "loss_spike", "severity": "warning", "title": "Loss spikes"}
    ok = {"kind": "healthy", "severity": "info", "title": "Training looks healthy"}
    note = {"kind": "insufficient_data", "severity": "info", "title": "Not enough data"}
    assert _verdict([warn, ok], True) == {"state": "warning", "text": "Loss spikes", "problems": 1}
    assert _verdict([ok, note], True)["state"] == "healthy"
    assert _verdict([note], True) == {"state": "unknown", "text": "Not enough data", "problems": 0}
    assert _verdict([], True)["state"] == "unknown" and _verdict([], False)["state"] == "none"


def test_artifacts_from_the_database_and_from_files_inside_the_run(client):
    items = {a["name"]: a for a in get(client, "/api/runs/train/artifacts")["artifacts"]}
    assert items["doctor/report.json"]["stored"] == "database"
    assert items["doctor/lr_range_test.png"]["stored"] == "file"
    assert "doctor/leak.txt" not in items and "doctor/srcdir" not in items  # symlinks are not listed
    r = client.get("/api/runs/train/artifacts/doctor/report.json")
    assert r.status_code == 200 and r.json()["checks"][0]["suggestion"] == 0.03
    png = client.get("/api/runs/train/artifacts/doctor/lr_range_test.png")
    assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    assert client.get("/api/runs/train/artifacts/doctor/notes.txt").text == "doctor notes inside the run\n"
    assert get(client, "/api/runs/train/artifacts/doctor/absent.png", 404)["error"]["type"] == "NotFound"
    assert get(client, "/api/runs/train/artifacts/run.sqlite", 404)["error"]


def test_doctor_results(client):
    d = get(client, "/api/runs/train/doctor")
    assert d["lr_suggestion"] == 0.03 and d["lr_plot"] == "doctor/lr_range_test.png"
    assert d["lr_range"]["columns"] == ["loss", "smoothed_loss"] and len(d["lr_range"]["lr"]) == 40
    assert get(client, "/api/runs/ref/doctor") == {"report": None, "lr_range": None, "lr_suggestion": None, "lr_plot": None}


def test_checkpoints_listed_from_the_run_folder(tmp_path):
    import torch
    from starlette.testclient import TestClient

    import trainguard as tg
    from trainguard.ui import create_app

    run = tmp_path / "withckpt"
    RunWriter(run, mode="no_tensor").close()
    model = torch.nn.Linear(3, 2)
    state = tg.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    mgr = tg.CheckpointManager(run / "checkpoints", keep=3)
    for step in (1, 2):
        mgr.save(state, step)
    with TestClient(create_app(tmp_path)) as c:
        d = get(c, "/api/runs/withckpt/checkpoints")
        assert d["available"] is True
        assert [(x["step"], x["valid"]) for x in d["checkpoints"]] == [(1, True), (2, True)]
        assert all(x["size"] > 0 for x in d["checkpoints"])


def test_checkpoints_absent_is_a_plain_message(client):
    d = get(client, "/api/runs/train/checkpoints")
    assert d == {"available": False, "reason": "this run has no checkpoints/ folder", "checkpoints": []}


def test_a_run_still_being_written_updates_without_restart(tmp_path):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    w = RunWriter(tmp_path / "live", mode="curt_health", flush_interval=0.05)

    def add(first, n, step):
        recs = [(s, step, "forward", "aten.relu.default", None, None, None, None, [], [["torch.float32", [4], "cpu"]],
                 [(0.0,)]) for s in range(first, first + n)]
        w.put_executions(ExecBatch(recs))
        w.add_scalars(step, {"loss": 1.0 / (1 + step)})
        assert w.flush()

    add(0, 10, 0)
    try:
        with TestClient(create_app(tmp_path)) as c:
            s1 = get(c, "/api/runs/live")
            assert s1["status"] == "running" and s1["executions"] == 10
            assert len(get(c, "/api/runs/live/timeline")["steps"]) == 1
            add(10, 15, 1)
            s2 = get(c, "/api/runs/live")
            assert s2["revision"] != s1["revision"] and s2["executions"] == 25
            assert [row[3] for row in get(c, "/api/runs/live/timeline")["steps"]] == [10, 15]
            assert get(c, "/api/runs/live/executions", begin=20, end=30)["total"] == 25
            assert len(get(c, "/api/runs/live/scalars")["series"]["loss"]["points"]) == 2
            w.close()
            assert get(c, "/api/runs/live")["status"] == "finished"
    finally:
        w.close()


def test_new_runs_appear_without_restart(tmp_path, builders):
    from starlette.testclient import TestClient

    from trainguard.ui import _registry, create_app

    builders.reference_like(tmp_path / "a", tmp_path / "src", steps=1)
    with TestClient(create_app(tmp_path)) as c:
        assert [r["id"] for r in get(c, "/api/runs")["runs"]] == ["a"]
        builders.reference_like(tmp_path / "b", tmp_path / "src", steps=1)
        # a direct request for a run not yet seen re-scans at once
        assert get(c, "/api/runs/b")["executions"] == 11
        old = _registry.RESCAN_SECONDS
        try:
            _registry.RESCAN_SECONDS = 0
            assert [r["id"] for r in get(c, "/api/runs")["runs"]] == ["a", "b"]
        finally:
            _registry.RESCAN_SECONDS = old


def test_a_run_directory_itself_as_logdir(logdir):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    with TestClient(create_app(logdir.ref.path)) as c:
        (run,) = get(c, "/api/runs")["runs"]
        assert run["id"] == "ref" and run["path"] == ""
        assert get(c, "/api/runs/ref")["executions"] == logdir.ref.total


def test_missing_logdir_is_refused(tmp_path):
    from trainguard import RunNotFound
    from trainguard.ui import create_app

    with pytest.raises(RunNotFound, match="no such logdir"):
        create_app(tmp_path / "absent")


def test_ranks_of_a_multi_process_run(tmp_path, builders):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    for rank, steps in ((0, 1), (1, 3)):
        builders.reference_like(tmp_path / "ddp" / f"rank-{rank}", tmp_path / f"src{rank}", steps=steps)
    with TestClient(create_app(tmp_path)) as c:
        (run,) = get(c, "/api/runs")["runs"]
        assert run["id"] == "ddp" and run["ranks"] == [0, 1]
        assert get(c, "/api/runs/ddp")["executions"] == 11  # the lowest rank by default
        assert get(c, "/api/runs/ddp", rank=1)["executions"] == 33
        assert get(c, "/api/runs/ddp/executions", begin=0, end=50, rank=1)["total"] == 33
        assert get(c, "/api/runs/ddp", 404, rank=7)["error"]["type"] == "RunNotFound"


def test_rows_found_through_the_step_index_match_the_readers_offsets(tmp_path, builders):
    """The provider pages by step range when steps never go back; else it asks the reader."""
    from starlette.testclient import TestClient

    from trainguard.store import open_run
    from trainguard.ui import create_app

    builders.big(tmp_path / "ordered", 2_500, per_step=7)
    w = RunWriter(tmp_path / "unordered", mode="no_tensor")  # an eval loop that resets the step
    recs = [(s, [0, 1, 0, 2][s // 10], "forward", "aten.relu.default", None, None, None, None, [],
             [["torch.float32", [1], "cpu"]], None) for s in range(40)]
    w.put_executions(ExecBatch(recs))
    w.close()
    with TestClient(create_app(tmp_path)) as c:
        for rid, n in (("ordered", 2_500), ("unordered", 40)):
            with open_run(tmp_path / rid) as run:
                for begin, end in ((0, 1), (0, 200), (3, 11), (n - 9, n), (n // 2, n // 2 + 37), (n - 1, n + 10)):
                    want = [d["seq"] for d in run.executions(begin, min(end, n))]
                    got = [d["seq"] for d in get(c, f"/api/runs/{rid}/executions", begin=begin, end=end)["items"]]
                    assert got == want, (rid, begin, end)
