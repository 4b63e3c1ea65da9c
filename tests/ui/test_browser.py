"""End to end in Debian's chromium (headless, driven by Playwright): the reference NaN scenario,
recorded for real by the CLI, opened in the web debugger.

Expected values come from the public reader, never from pinned numbers, so the test follows the
reference scenario if its model or data change.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from trainguard.store import ExecBatch, RunWriter, open_run


def wait_ready(page, view: str) -> None:
    page.wait_for_selector(f"body[data-ready={view}]")


def selected(page, seq: int) -> None:
    page.wait_for_selector(f"body[data-selected='{seq}']")


def wait_first_seq(page, selector: str, condition: str) -> None:
    """Wait until the first element matching ``selector`` has a ``data-seq`` for which the
    JavaScript expression ``condition`` (over ``seq``) holds."""
    find = f"const e = document.querySelector({json.dumps(selector)}); if (!e) return false;"
    page.wait_for_function(f"() => {{ {find} const seq = Number(e.dataset.seq); return {condition}; }}")


@pytest.fixture(scope="module")
def reference(browser_runs):
    """What the reader says about the reference run: the debugger must show the same."""
    with open_run(browser_runs.reference) as run:
        first = run.first_nonfinite()
        (producer,) = [i for i in first["inputs"] if i["kind"] == "op"]
        return {
            "total": run.count(),
            "first": first,
            "producer": producer,
            "user_frame": run.user_frame(first["stack_id"]),
            "user_frames": [f for f in first["stack"] if f["user"]],
        }


def test_the_nan_alert_leads_to_the_log_its_softmax_and_the_users_line(strict_page, ui_server, reference, screenshot_dir):
    page = strict_page
    first, producer, uf = reference["first"], reference["producer"], reference["user_frame"]
    assert first["op"] == "aten.log" and "-inf" in first["health"]  # the scenario itself
    page.goto(f"{ui_server.url}/#/run/reference/debugger")
    wait_ready(page, "debugger")
    assert page.inner_text(".p-list h2 .count") == f"{reference['total']:,}"

    page.click("#alert-nonfinite")
    selected(page, first["seq"])
    # the execution list selects the first non-finite log
    row = page.locator(".vl-row.sel")
    assert row.get_attribute("data-seq") == str(first["seq"])
    assert row.locator(".op").inner_text() == "log"
    assert page.inner_text("#graph-selected .op") == "log"
    # the graph shows its softmax producer above it
    node = page.locator(f".graph-inputs .node[data-seq='{producer['producer']}']")
    assert node.locator(".op").inner_text() == "_softmax"
    assert "0×" in node.inner_text()  # the zeros that the log turns into -inf
    # the source pane shows the stored file with the log line highlighted
    hl = page.locator("#source .line.hl")
    hl.wait_for()
    assert hl.get_attribute("data-line") == str(uf["lineno"])
    assert "torch.log(" in hl.inner_text()
    assert Path(uf["filename"]).name in page.inner_text(".p-source h2")
    # the stack pane emphasises the user's frame, and library frames are shown dimmed
    frame = page.locator(".frame.sel")
    assert "user" in frame.get_attribute("class")
    assert frame.get_attribute("data-line") == str(uf["lineno"]) and uf["name"] in frame.inner_text()
    assert page.locator(".frame.user").count() == len(reference["user_frames"])
    assert page.locator(".frame.lib").count() == len(first["stack"]) - len(reference["user_frames"])
    # the timeline window holds the selection, coloured as -inf
    cell = page.locator("#timeline-cells .cell.sel")
    assert cell.get_attribute("data-seq") == str(first["seq"]) and "inf" in cell.get_attribute("class")
    # the origin, from the analysis, names the same execution
    assert f"#{first['seq']} log" in page.inner_text("#origin-link")
    page.wait_for_timeout(200)
    page.screenshot(path=str(screenshot_dir / "ui-debugger.png"))

    # clicking a stack frame opens its line
    outer = reference["user_frames"][0]
    page.click(f".frame[data-frame='{outer['frame_id']}']")
    page.wait_for_selector(f"#source .line.hl[data-line='{outer['lineno']}']")
    # clicking the producer moves the whole view to the softmax
    node.click()
    selected(page, producer["producer"])
    assert page.inner_text("#graph-selected .op") == "_softmax"
    assert "softmax(" in page.locator("#source .line.hl").inner_text()
    assert page.locator(".vl-row.sel").get_attribute("data-seq") == str(producer["producer"])
    # and its consumers below include the log, one click away
    page.click(f".graph-consumers .node[data-seq='{first['seq']}']")
    selected(page, first["seq"])
    # the selection is in the URL: a reload comes back to it
    assert page.url.endswith(f"/debugger/{first['seq']}")
    page.reload()
    wait_ready(page, "debugger")
    selected(page, first["seq"])
    assert page.locator("#source .line.hl").get_attribute("data-line") == str(uf["lineno"])


def test_training_view_draws_the_loss_curve_and_the_verdict(page, ui_server, browser_runs, screenshot_dir):
    with open_run(browser_runs.monitored) as run:
        loss = run.scalars("loss")["loss"]
        others = [n for n in run.scalar_names() if n != "loss"]
    finite = [v for _, v in loss if math.isfinite(v)]
    assert finite and len(finite) < len(loss), "the reference scenario's loss turns NaN"
    api = page.request.get(f"{ui_server.url}/api/runs/reference-monitored/findings").json()

    page.goto(f"{ui_server.url}/#/run/reference-monitored/training")
    wait_ready(page, "training")
    d = page.locator("#loss-chart path.series").get_attribute("d")
    assert len(re.findall(r"[ML]", d)) == len(finite)
    assert page.locator("#loss-chart path.nonfinite").count() == len(loss) - len(finite)
    first_bad = next(s for s, v in loss if not math.isfinite(v))
    assert page.locator("#loss-chart text.note").text_content() == f"NaN from step {first_bad}"
    verdict = page.inner_text("#verdict")
    assert api["verdict"]["text"] in verdict and api["verdict"]["state"] in ("critical", "error")
    for name in others:
        page.wait_for_selector(f".small-multiple[data-scalar='{name}'] path.series", state="attached")
    assert page.locator("#layer-heatmap canvas").count() == 1
    assert "gradient · mean_abs" in page.locator(".c-layers select").inner_text()
    assert page.locator(".finding").count() == len(api["findings"])
    assert "No learning-rate range test" in page.inner_text(".c-lr")
    assert "No checkpoints" in page.inner_text(".c-ckpt")
    # the view scrolls inside the page: grow the window to show every card at once
    height = page.evaluate("document.querySelector('.topbar').offsetHeight + document.getElementById('view').scrollHeight")
    page.set_viewport_size({"width": 1600, "height": min(max(height, 1000), 2400)})
    page.wait_for_timeout(300)
    page.screenshot(path=str(screenshot_dir / "ui-training.png"))


def test_training_view_shows_doctor_results_and_checkpoints(page, ui_server):
    page.goto(f"{ui_server.url}/#/run/synthetic/training")
    wait_ready(page, "training")
    assert page.locator("#lr-range-chart path.series").count() == 2
    assert "Suggested learning rate: 0.03" in page.inner_text(".c-lr")
    png = page.request.get(ui_server.url + page.locator("#lr-plot-link").get_attribute("href"))
    assert png.headers["content-type"] == "image/png" and png.body().startswith(b"\x89PNG")
    rows = page.locator("#checkpoints tr")
    assert rows.count() == 4 and "valid" in rows.nth(3).inner_text() and rows.nth(1).locator("td").first.inner_text() == "10"
    labels = page.locator(".heat-labels").inner_text().split()
    assert labels == ["fc1", "fc2", "fc3"]
    page.select_option(".c-layers select", "activation/mean")
    page.wait_for_function("document.querySelector('.heat-legend').innerText.includes('linear')")
    assert page.locator(".finding[data-kind='vanishing_gradient'] .fix").inner_text().startswith("Suggested fix")
    symptom = page.locator(".finding[data-kind='vanishing_gradient'] .symptom[data-kind='loss_not_decreasing']")
    assert "Loss is not decreasing" in symptom.inner_text()
    assert page.locator(".finding[data-kind='loss_not_decreasing']").count() == 0


def test_navigating_a_run_of_120k_executions(page, ui_server, browser_runs):
    n = browser_runs.big_total
    page.goto(f"{ui_server.url}/#/run/big/debugger")
    wait_ready(page, "debugger")
    assert page.inner_text(".p-list h2 .count") == f"{n:,}"
    assert f"{len(browser_runs.big_bad):,} events" in page.inner_text("#alert-nonfinite")
    # a click near the end of the overview strip moves the timeline and the list there
    box = page.locator("canvas.tl-overview").bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.95, box["y"] + box["height"] / 2)
    wait_first_seq(page, "#timeline-cells .cell[data-seq]", "seq > 100000")
    wait_first_seq(page, ".vl-row[data-seq]", "seq > 100000")
    # scrolling the list to its middle shows rows from the middle of the run
    page.eval_on_selector(".vl-scroll", "el => { el.scrollTop = (el.scrollHeight - el.clientHeight) / 2; }")
    wait_first_seq(page, ".vl-row[data-seq]", f"Math.abs(seq - {n // 2}) < {n // 100}")
    # "go to" selects an execution anywhere
    page.fill(".tl-bar input", str(n - 1))
    page.press(".tl-bar input", "Enter")
    selected(page, n - 1)
    assert page.locator(".vl-row.sel").get_attribute("data-seq") == str(n - 1)
    # the health filter leaves the non-finite ones, and the selection follows into it
    page.select_option(".filters select >> nth=0", "nonfinite")
    page.wait_for_function(f"document.querySelector('.p-list h2 .count').innerText === '{len(browser_runs.big_bad)}'")
    bad = browser_runs.big_bad[len(browser_runs.big_bad) // 2]
    page.click(".alert-op")  # the only op type with NaN here
    selected(page, browser_runs.big_bad[0])
    page.fill(".tl-bar input", str(bad))
    page.press(".tl-bar input", "Enter")
    selected(page, bad)
    assert page.locator(".vl-row.sel").get_attribute("data-seq") == str(bad)


def test_run_picker_and_a_damaged_run(page, ui_server):
    page.goto(f"{ui_server.url}/#/")
    wait_ready(page, "runs")
    ids = [r.get_attribute("data-run") for r in page.locator("#runs tr[data-run]").all()]
    assert ids == ["big", "damaged", "reference", "reference-monitored", "synthetic"]
    assert "damaged" in page.locator("#runs tr[data-run='damaged']").inner_text()
    page.click("#runs tr[data-run='damaged'] a")
    wait_ready(page, "error")
    err = page.locator("#run-error")
    assert err.get_attribute("data-status") == "422" and "is damaged" in err.inner_text()
    page.select_option("#run-picker", "reference")
    wait_ready(page, "debugger")
    page.click("#tab-training")
    wait_ready(page, "training")
    page.goto(f"{ui_server.url}/#/run/no-such-run/debugger")
    wait_ready(page, "error")
    assert page.locator("#run-error").get_attribute("data-status") == "404"


def test_a_run_still_being_written_updates_without_a_reload(page, live_server, tmp_path):
    w = RunWriter(tmp_path / "live", mode="curt_health", flush_interval=0.05)
    state = {"seq": 0}

    def add(n: int, step: int, bad: bool = False) -> None:
        recs = []
        for _ in range(n):
            s = state["seq"]
            recs.append((s, step, "forward", "aten.exp.default" if bad else "aten.relu.default", None, None, None,
                         None, [], [["torch.float32", [4], "cpu"]], [(1.0 if bad else 0.0,)]))
            state["seq"] += 1
        w.put_executions(ExecBatch(recs), must_keep=True)
        w.add_scalars(step, {"loss": 2.0 / (1 + step)})
        assert w.flush()

    add(10, 0)
    try:
        with live_server(tmp_path) as srv:
            page.goto(f"{srv.url}/#/run/live/debugger")
            wait_ready(page, "debugger")
            assert page.inner_text(".p-list h2 .count") == "10"
            assert "live" in page.inner_text("#run-status")
            page.evaluate("window.__same_page = true")
            add(29, 1)
            add(1, 1, bad=True)
            page.wait_for_function("document.querySelector('.p-list h2 .count').innerText === '40'", timeout=10_000)
            page.wait_for_selector("#alert-nonfinite", timeout=10_000)
            assert page.evaluate("window.__same_page") is True  # updated in place, not reloaded
            page.click("#tab-training")
            wait_ready(page, "training")
            before = len(re.findall(r"[ML]", page.locator("#loss-chart path.series").get_attribute("d")))
            add(5, 2)
            add(5, 3)
            page.wait_for_function(
                f"(document.querySelector('#loss-chart path.series').getAttribute('d').match(/[ML]/g) || []).length > {before}",
                timeout=10_000,
            )
            w.close()
            page.wait_for_function("document.querySelector('#run-status').innerText.startsWith('finished')", timeout=10_000)
    finally:
        w.close()


def test_a_zero_passed_as_text_renders(page, ui_server, browser_runs):
    """The element helper once took a numeric 0 for "no attributes" and dropped it: every op of
    step 0 showed a blank step, execution #0 a blank number."""
    with open_run(browser_runs.reference) as run:
        first = run.executions(0, 1)[0]
    assert (first["seq"], first["step"]) == (0, 0)
    page.goto(f"{ui_server.url}/#/run/reference/debugger")
    wait_ready(page, "debugger")
    row = page.locator(".vl-row[data-seq='0']")
    row.wait_for()
    cells = row.locator(":scope > span")
    assert cells.nth(0).inner_text() == "0"  # the sequence number
    assert cells.nth(1).inner_text() == "0"  # the step
    texts = page.evaluate("""async () => {
        const { h } = await import('/static/js/util.js');
        return [h('td', 0), h('td', NaN), h('td', 0, 1), h('td', { title: 'x' }, 0), h('td', '')]
            .map((n) => [n.textContent, n.getAttribute('title')]);
    }""")
    assert texts == [["0", None], ["NaN", None], ["01", None], ["0", "x"], ["", None]]


def _one_run(path: Path, executions: int) -> None:
    w = RunWriter(path, mode="curt_health")
    recs = [(s, 0, "forward", "aten.relu.default", None, None, None, None, [], [["torch.float32", [4], "cpu"]],
             [(0.0,)]) for s in range(executions)]
    if recs:
        w.put_executions(ExecBatch(recs), must_keep=True)
    for step in range(3):
        w.add_scalars(step, {"loss": 1.0 / (1 + step)})
    w.close()


@pytest.mark.parametrize("executions, view", [(5, "debugger"), (0, "training")])
def test_a_logdir_of_one_run_opens_that_run(page, live_server, tmp_path, executions, view):
    # `trainguard ui runs/exp1` opened a list of one run, a click away from what the user asked to see;
    # a monitor-only run (no executions) opens on its training view.
    _one_run(tmp_path / "exp1", executions)
    with live_server(tmp_path / "exp1") as srv:
        page.goto(f"{srv.url}/")
        wait_ready(page, view)
        assert re.search(rf"#/run/[^/]+/{view}$", page.url), page.url
        page.go_back()  # the list it skipped is not in the history: back leaves the app
        assert page.url == "about:blank", page.url
        page.goto(f"{srv.url}/#/")  # asked for by name, the list of runs stays
        wait_ready(page, "runs")


def test_a_folder_of_two_runs_opens_the_list(page, live_server, tmp_path):
    _one_run(tmp_path / "runs" / "a", 5)
    _one_run(tmp_path / "runs" / "b", 5)
    with live_server(tmp_path / "runs") as srv:
        page.goto(f"{srv.url}/")
        wait_ready(page, "runs")
        assert "#/run/" not in page.url
