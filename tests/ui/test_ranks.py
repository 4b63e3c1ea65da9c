"""A run of several ranks in the UI: the ranks endpoint, per-rank queries, and the debugger's
first line and per-rank alerts (the run: tests/conftest.py, rank 1 makes it, rank 0 receives it)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from trainguard.ui import create_app


@pytest.fixture(scope="module")
def ranked_client(two_ranks):
    with TestClient(create_app(two_ranks.root.parent), raise_server_exceptions=True) as c:
        yield c


def test_the_ranks_endpoint_puts_every_rank_side_by_side(ranked_client):
    runs = ranked_client.get("/api/runs").json()["runs"]
    (job,) = [r for r in runs if r["id"] == "job"]
    assert job["ranks"] == [0, 1]
    ans = ranked_client.get("/api/runs/job/ranks").json()
    assert ans["available"] is True
    report = ans["result"]
    assert report["first_rank"] == 1 and report["received"] == [0]
    assert [p["rank"] for p in report["per_rank"]] == [0, 1]
    assert report["per_rank"][0]["first"]["received_via"]["op"] == "c10d.allreduce_"
    assert report["headline"].startswith("rank 1 first made a -inf in step 1: aten.log")
    # Every other endpoint reads the rank it is asked for.
    alerts = {k: ranked_client.get(f"/api/runs/job/alerts?rank={k}").json() for k in (0, 1)}
    assert alerts[0]["by_op"][0]["op"] == "aten.mul.Tensor" and alerts[1]["by_op"][0]["op"] == "aten.log"
    assert ranked_client.get("/api/runs/job?rank=1").json()["rank"] == 1
    assert ranked_client.get("/api/runs/job/alerts?rank=7").status_code == 404


def test_a_single_process_run_has_no_ranks(client):
    ans = client.get("/api/runs/ref/ranks").json()
    assert ans["available"] is False and "one process" in ans["reason"]


def test_the_debugger_leads_with_the_first_rank_and_switches_ranks(two_ranks, live_server, browser, screenshot_dir):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})  # under the app's own CSP
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(15_000)
    with live_server(two_ranks.root.parent) as srv:
        page.goto(f"{srv.url}/#/run/job/debugger")
        # Opened without a rank, the page goes to the rank that made the first non-finite value.
        page.wait_for_url("**rank=1")
        page.wait_for_selector("body[data-ready=debugger] #rank-headline")
        headline = page.inner_text("#rank-headline")
        assert headline.startswith("rank 1 first made a -inf in step 1: aten.log at conftest.py:")
        assert "rank 0 only received it" in headline
        rows = page.locator(".rank-row")
        assert rows.count() == 2
        assert page.inner_text(".rank-row.active .r") == "rank 1"
        assert "received" in page.inner_text(".rank-row[data-rank='0'] .how")
        assert "made · first" in page.inner_text(".rank-row[data-rank='1'] .how")
        assert page.inner_text(".p-alerts .alert-op").startswith("log")
        page.screenshot(path=str(screenshot_dir / "ui-ranks.png"))
        page.click(".rank-row[data-rank='0']")
        page.wait_for_url("**rank=0")
        page.wait_for_selector("body[data-ready=debugger] .rank-row.active[data-rank='0']")
        assert "mul" in page.inner_text(".p-alerts .alert-op")  # rank 0's own alerts, the first line stays
        assert page.inner_text("#rank-headline") == headline
        # leave the app before its server stops (a poll in flight would fail the page)
        page.goto("about:blank")
    context.close()
    assert errors == []
