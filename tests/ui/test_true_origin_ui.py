"""The web debugger on real recordings: intended -inf masks are a quiet count, the alert of a
fully masked row leads to its softmax, an exp overflow to the exp (models: tests/true_models.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import true_models as M

import trainguard as tg
from trainguard.store import open_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("true-origin") / "logs"
    with tg.record(root / "masked"):
        M.train_gpt(3)
    with tg.record(root / "empty"):
        M.train_gpt(4, padded=True, empty_at=2)
    with tg.record(root / "exp"):
        M.train_exp()
    with tg.record(root / "overflow"):  # mamba.py's RMSNorm on values whose square overflows: rsqrt(inf) = 0
        x = torch.full((2, 4), 1e20, requires_grad=True)
        (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).sum().backward()
    # Inductor decomposes the softmax: its NaN shows at div, whose inputs have no summary.
    torch._dynamo.reset()
    x = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[False, True, False, True], [True, True, True, True]])  # row 1: all masked
    with tg.record(root / "compiled"):
        torch.compile(masked_sum)(x, mask).backward()
    torch._dynamo.reset()
    return root


def masked_sum(att, mask):
    return torch.softmax(att.masked_fill(mask, float("-inf")), -1).sum()


@pytest.fixture(scope="module")
def client(runs):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    with TestClient(create_app(runs), raise_server_exceptions=True) as c:
        yield c


def get(client, url):
    r = client.get(url)
    assert r.status_code == 200, r.text
    return r.json()


def test_api_healthy_masked_model(client):
    listed = {r["id"]: r for r in get(client, "/api/runs")["runs"]}
    assert listed["masked"]["nonfinite"] == 0 and listed["empty"]["nonfinite"] > 0
    a = get(client, "/api/runs/masked/alerts")
    assert a["total"] == 0 and a["first_seq"] is None and a["by_op"] == []
    assert [(g["made_by"], g["absorbed_by"], g["values"]) for g in a["intended"]] == [
        ("aten.masked_fill.Scalar", "aten._softmax.default", 1344)]
    o = get(client, "/api/runs/masked/origin")
    assert o["available"] is False and "harmful" in o["reason"]
    assert sum(s[4] for s in get(client, "/api/runs/masked/timeline")["steps"]) == 0


def test_api_fully_masked_row(client, runs):
    a = get(client, "/api/runs/empty/alerts")
    with open_run(runs / "empty") as run:
        softmax = run.execution(a["first_seq"])
    assert softmax["op"] == "aten._softmax" and softmax["step"] == 2 and softmax["taint"] == "harmful"
    o = get(client, "/api/runs/empty/origin")
    link = o["result"]["origin"]
    assert (link["op"], link["line"], link["step"], link["phase"]) == (
        "aten._softmax", M.line_of("SOFTMAX LINE"), 2, "forward")
    assert "fully masked row" in link["explanation"] and "finfo" in o["result"]["suggestion"]


def test_api_exp_overflow_into_the_loss(client, runs):
    a = get(client, "/api/runs/exp/alerts")
    with open_run(runs / "exp") as run:
        assert run.execution(a["first_seq"])["op"] == "aten.exp"
        assert run.execution(a["harm_seq"])["op"] == "aten.mean"
    o = get(client, "/api/runs/exp/origin")
    assert o["seq"] == a["harm_seq"] and o["result"]["reason"] == "loss"
    assert [c["op"] for c in o["result"]["chain"]][::3] == ["aten.mean", "aten.exp"]
    assert o["result"]["origin"]["line"] == M.line_of("EXP LINE")


def test_browser_alerts_pane(page, live_server, runs):
    with live_server(runs) as srv:
        page.goto(f"{srv.url}/#/run/masked/debugger")
        page.wait_for_selector("body[data-ready=debugger]")
        pane = page.inner_text(".p-alerts")
        assert "No harmful NaN or Inf." in pane
        assert "1,344 intended -inf from _softmax" not in pane
        assert "1,344 intended -inf from masked_fill.Scalar, absorbed by _softmax" in pane
        assert page.locator("#alert-nonfinite").count() == 0

        # an overflow that arithmetic absorbed is no mask: not called intended (as in the report)
        page.goto(f"{srv.url}/#/run/overflow/debugger")
        page.wait_for_selector("body[data-ready=debugger]")
        [line] = page.locator(".p-alerts .intended").all_inner_texts()
        assert "+inf from pow.Tensor_Scalar, absorbed by rsqrt" in line and "intended" not in line, line

        page.goto(f"{srv.url}/#/run/empty/debugger")
        page.wait_for_selector("body[data-ready=debugger]")
        page.click("#alert-nonfinite")
        with open_run(runs / "empty") as run:
            seq = run.alerts()["first_seq"]
        page.wait_for_selector(f"body[data-selected='{seq}']")
        assert f"#{seq} _softmax" in page.inner_text("#origin-link")
        assert "fully masked row" in page.inner_text("#origin-link")
        hl = page.locator("#source .line.hl")
        hl.wait_for()
        assert hl.get_attribute("data-line") == str(M.line_of("SOFTMAX LINE"))

        # an inf that became harmful later: the origin box says where and how
        page.goto(f"{srv.url}/#/run/exp/debugger")
        page.wait_for_selector("body[data-ready=debugger]")
        page.wait_for_selector("#origin-link .harm")
        assert "exp" in page.inner_text("#origin-link .link")
        harm = page.inner_text("#origin-link .harm")
        assert harm.startswith("Then it reached the loss") and f"true_models.py:{M.line_of('LOSS LINE')}" in harm
        # leave the app before its server stops (a request in flight would fail the page)
        page.goto("about:blank")


def test_browser_origin_inside_a_compiled_softmax_names_what_it_was_computed_from(page, live_server, runs):
    with live_server(runs) as srv:
        page.goto(f"{srv.url}/#/run/compiled/debugger")
        page.wait_for_selector("body[data-ready=debugger]")
        page.click("#alert-nonfinite")
        page.wait_for_selector("#origin-link")
        assert "div" in page.inner_text("#origin-link") and "fully masked row" in page.inner_text("#origin-link")
        src = page.locator(".source-of").first
        src.wait_for()
        text = src.inner_text()
        assert text.startswith("computed (through amax, sub, exp, sum) from #") and "6 -inf" in text, text
