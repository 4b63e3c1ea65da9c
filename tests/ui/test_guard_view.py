"""The guard's events in the UI: the JSON API and the training view, on a real guarded run whose
poisoned batch was replayed, recorded and skipped."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg


class Poly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(torch.cat([x, x.pow(2)], dim=-1))  # POW


def guarded_run(root):
    torch.manual_seed(0)
    x, y = torch.randn(80, 4), torch.randn(80, 1)
    x[50] = 1e20  # batch 12, its row 2
    model = Poly()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=4))
    guard = tg.Guard(root / "g", snapshot_every=10)
    for _, (xb, yb) in guard.batches(state, total_steps=20):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard


@pytest.fixture(scope="module")
def guard_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("guarded")
    guarded_run(root)
    tg.Monitor(None, root / "plain", diagnose=False).close()  # a run no guard watched
    return root


def test_guard_api_lists_events_with_the_replay_run(guard_root):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    with TestClient(create_app(guard_root)) as c:
        runs = {r["id"] for r in c.get("/api/runs").json()["runs"]}
        assert {"g", "g:replays:step-12", "plain"} <= runs
        d = c.get("/api/runs/g/guard").json()
        assert d["available"] is True and d["meta"]["policy"] == "skip" and d["meta"]["status"] == "finished"
        [e] = d["events"]
        assert e["step"] == 12 and e["action"] == "skip" and e["replay_run_id"] == "g:replays:step-12"
        assert e["skipped"][0]["samples"] == [48, 49, 50, 51]
        assert e["origin"]["origin"]["op"].startswith("aten.pow")
        # the replay's own run, opened by that id, shows the same origin in the debugger's API
        o = c.get("/api/runs/g:replays:step-12/origin").json()
        assert o["available"] and o["result"]["origin"]["op"].startswith("aten.pow")
        assert o["result"]["origin"]["step"] == 12
        # the findings list leaves the guard's events to their card; the verdict still counts them
        f = c.get("/api/runs/g/findings").json()
        assert all(x.get("source") != "guard" for x in f["findings"]) and f["verdict"]["state"] == "warning"
        assert c.get("/api/runs/plain/guard").json() == {"available": False, "meta": None, "events": []}


def test_training_view_shows_the_rewind_and_links_the_replayed_step(page, live_server, guard_root):
    with live_server(guard_root) as srv:
        page.goto(f"{srv.url}/#/run/g/training")
        page.wait_for_selector("body[data-ready=training]")
        page.wait_for_selector(".guard-event")
        card = page.inner_text(".c-guard")
        assert "step 12: loss is nan" in card and "losses bitwise equal" in card
        assert "origin:" in card and "aten.pow" in card and "skipped batch 12" in card
        assert page.inner_text(".guard-event table.skipped").count("48, 49, 50, 51") == 1
        # the sample whose row holds the first inf stands out among the batch's samples, once
        assert page.inner_text(".guard-event table.skipped .culprit") == "50"
        assert page.get_attribute(".guard-event table.skipped .culprit", "title") == "the first inf is in this sample's row (2 of 4)"
        assert page.inner_text(".c-guard").count("the first inf is in") == 1
        page.click(".replay-link")
        page.wait_for_selector("body[data-ready=debugger]")
        assert unquote(page.url).endswith("#/run/g:replays:step-12/debugger")
        page.wait_for_function("() => document.body.innerText.includes('pow.Tensor_Scalar')")  # its alert, the origin
        page.goto(f"{srv.url}/#/run/plain/training")
        page.wait_for_selector("body[data-ready=training]")
        page.wait_for_function("() => document.querySelector('.c-guard').innerText.includes('No guard watched')")


def poisoned_epochs_run(path, loop_checks):
    """Two epochs of 10 batches whose batch 7 holds a sample with an inf (the loss is nan there). With
    ``loop_checks`` the loop skips its own non-finite loss (normflows' notebook does
    ``if ~(torch.isnan(loss) | torch.isinf(loss)): backward; step``) and the guard rewinds nothing;
    without, the guard rewinds step 7 and skips that sample's batch unread in the second epoch."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randn(40, 1)
    x[29, 0] = float("inf")
    model = Poly()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=4))
    guard = tg.Guard(path, snapshot_every=5)
    for _, (xb, yb) in guard.batches(state, total_steps=20):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        if not loop_checks or ~(torch.isnan(loss) | torch.isinf(loss)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard


def test_training_view_says_what_the_guard_handled_without_a_rewind(page, live_server, tmp_path):
    # The card said "The guard saw no NaN, Inf or spike: nothing was rewound." while the run's
    # guard had logged and stored that the loop itself skipped a non-finite loss at step 7, and
    # it never showed the later batches skipped unread for holding a sample known corrupt.
    looped = poisoned_epochs_run(tmp_path / "s", loop_checks=True)
    assert looped.loop_skipped["count"] == 2 and not looped.events
    guarded = poisoned_epochs_run(tmp_path / "k", loop_checks=False)
    assert [e["step"] for e in guarded.events] == [7] and len(guarded.skipped_known) == 1
    with live_server(tmp_path) as srv:
        page.goto(f"{srv.url}/#/run/s/training")
        page.wait_for_selector("body[data-ready=training]")
        page.wait_for_function("() => document.querySelector('.c-guard .loop-skipped')")
        assert "saw no NaN" not in page.inner_text(".c-guard")
        text = page.inner_text(".c-guard .loop-skipped")
        assert "the loop skipped 2 steps itself, the first at step 7: its loss was inf" in text
        assert "ui/test_guard_view.py:" in text and "--check-numerics" in text
        page.goto(f"{srv.url}/#/run/k/training")
        page.wait_for_selector("body[data-ready=training]")
        page.wait_for_selector(".guard-event")
        text = page.inner_text(".c-guard .skipped-known")
        assert text.startswith("1 later batch held a sample an event found corrupt in the batch itself, and was skipped unread")
        assert "the last at step 16 (epoch 1)" in text


def eval_fault_run(path):
    """pytorch/examples mnist/main.py's pattern (its test() called inside the training loop), reduced:
    every 5 steps an evaluation under torch.no_grad() over a validation set one of whose labels
    (sample 6) is out of range. The guard logs it as an eval fault and rewinds nothing."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    vx, vy = torch.randn(8, 4), torch.randint(0, 3, (8,))
    vy[6] = 3
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    val_loader = DataLoader(TensorDataset(vx, vy), batch_size=4)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=4))
    guard = tg.Guard(path, snapshot_every=5)
    for step, (xb, yb) in guard.batches(state, total_steps=10):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 4:
            with torch.no_grad():
                for vxb, vyb in val_loader:
                    torch.nn.functional.cross_entropy(model(vxb), vyb)
    return guard


def test_training_view_shows_the_faults_of_an_evaluation_inside_the_guarded_loop(page, live_server, tmp_path):
    # The guard logged and stored `eval_faults` (an op that raised under no_grad: no rewind, training
    # went on), yet the card said "The guard saw no NaN, Inf or spike: nothing was rewound."
    guard = eval_fault_run(tmp_path / "e")
    assert guard.eval_faults["count"] == 2 and not guard.events, guard.eval_faults
    with live_server(tmp_path) as srv:
        page.goto(f"{srv.url}/#/run/e/training")
        page.wait_for_selector("body[data-ready=training]")
        page.wait_for_function("() => document.querySelector('.c-guard .eval-faults')")
        assert "saw no NaN" not in page.inner_text(".c-guard")
        text = page.inner_text(".c-guard .eval-faults")
        assert text.startswith("2 evaluation faults (no rewind), the first: step 4:"), text
        assert "under torch.no_grad()" in text and "ui/test_guard_view.py:" in text and "val_loader" in text, text
        assert "the last at step 9" in text, text
