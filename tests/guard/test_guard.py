"""The guard end to end on a tiny model: a poisoned batch, a bug in the code, a loss spike, the
policies, exactness of the replay and of a run without faults."""

from __future__ import annotations

import logging
import math
import re
import statistics
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainguard as tg
from trainguard.store import open_run

from .conftest import BS, PolyNet, assert_bitwise, finite, line_of, make_data, make_state, params, train

THIS = Path(__file__).with_name("conftest.py").resolve()


def test_a_poisoned_batch_is_replayed_named_and_skipped(tmp_path, caplog):
    state = make_state(make_data(120, poison_batch=60))
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        seen = train(guard.batches(state, total_steps=120), state)
    assert state.step == 120 and finite(state)
    # on CPU step 60 is read when it ends (on an accelerator one step late, step 61 running first):
    # rewound to 50; steps 50-59 replayed, 60 recorded, then step 60 again with the next batch
    assert seen == list(range(61)) + list(range(50, 61)) + list(range(60, 120))
    [event] = guard.events
    assert event["action"] == "skip" and event["trigger"] == "nonfinite_loss" and event["step"] == 60
    assert event["skipped"] == [{"epoch": 0, "index": 60, "batch": 60, "samples": list(range(60 * BS, 61 * BS))}]
    assert event["rewound_to"] == 50 and event["replay"]["steps"] == 10
    assert event["replay"]["bitwise_equal"] is True and event["replay"]["compared"] == 10
    link = event["origin"]["origin"]
    assert link["op"].startswith("aten.pow") and Path(link["file"]).resolve() == THIS
    assert link["line"] == line_of("POW_LINE") and link["step"] == 60 and link["phase"] == "forward"
    # the one line a user sees
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith("trainguard: step 60: loss is nan; rewound to step 50; replayed 10 steps")
    assert f"origin: {link['op']} at " in line and f":{line_of('POW_LINE')} — " in line
    assert line.endswith("skipped batch 60")
    # the run: the event with its origin, and the replayed step recorded in full
    with open_run(tmp_path / "run") as run:
        [stored] = run.findings(source="guard")
        assert stored["kind"] == "guard_rewind" and stored["severity"] == "warning"
        assert stored["event"]["skipped"][0]["samples"] == list(range(240, 244))
        assert run.meta["guard"]["status"] == "finished" and run.meta["guard"]["rewinds"] == 1
        assert run.meta["guard"]["snapshot_bytes"] > 0
    with open_run(tmp_path / "run" / "replays" / "step-60") as replay:
        assert replay.meta["mode"] == "full_health"
        assert {s["step"] for s in replay.steps()} == {60}
        assert replay.count(phase="forward") and replay.count(phase="backward") and replay.count(phase="optimizer")


def test_the_same_run_unguarded_goes_nan():
    from trainguard.resilience import ResumeLoop

    state = make_state(make_data(120, poison_batch=60))

    train(ResumeLoop(None, state, total_steps=120, epochs=None, delete_on_success=False,
                     handle_signals=False).batches(), state)
    assert state.step == 120 and not finite(state)


def skip_reference(data, total_steps: int, bad, **kw):
    """The unguarded loop that leaves out the batches ``bad(x)`` picks, by hand."""
    state = make_state(data, **kw)
    it, done = None, 0
    while done < total_steps:
        if it is None:
            it = iter(state.loader)
        try:
            x, y = next(it)
        except StopIteration:
            state.epoch += 1
            it = iter(state.loader)
            x, y = next(it)
        if bad(x):
            continue
        loss = nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        done += 1
    return state


@pytest.mark.timeout(240)
def test_replay_is_exact_with_dropout_and_a_shuffled_two_worker_loader(tmp_path):
    data = make_data(44, poison_sample=77)
    kw = {"dropout": 0.3, "shuffle": True, "num_workers": 2}
    state = make_state(data, **kw)
    guard = tg.Guard(tmp_path / "run", snapshot_every=8)
    train(guard.batches(state, total_steps=40), state)
    [event] = guard.events
    assert event["replay"]["bitwise_equal"] is True and event["replay"]["compared"] >= 1
    assert 77 in event["skipped"][0]["samples"]
    # the guarded run equals, bitwise, the plain run that never trained on that batch
    ref = skip_reference(data, 40, lambda x: bool((x.abs() > 1e19).any()), **kw)
    assert_bitwise(params(ref), params(state))


def test_a_run_without_faults_is_bitwise_equal_to_the_unguarded_run(tmp_path):
    from trainguard.resilience import ResumeLoop

    data = make_data(30)
    plain = make_state(data, dropout=0.3, shuffle=True)
    log_plain: list = []
    train(ResumeLoop(None, plain, total_steps=70, epochs=None, delete_on_success=False,
                     handle_signals=False).batches(), plain, log=log_plain)
    rng_plain = torch.get_rng_state()
    guarded = make_state(data, dropout=0.3, shuffle=True)
    log_guarded: list = []
    guard = tg.Guard(tmp_path / "run", snapshot_every=7, spike_factor=50)
    train(guard.batches(guarded, total_steps=70), guarded, log=log_guarded)
    assert guard.events == [] and guard.snapshot_bytes == 0  # released at the end
    assert log_plain == log_guarded
    assert_bitwise(params(plain), params(guarded))
    assert plain.optimizer.state_dict()["state"][0]["exp_avg"].equal(guarded.optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.get_rng_state().equal(rng_plain)  # the guard drew no random numbers


def masked_probs_bug(out, y, step):
    """A classifier loss with a bug from step 30 on: a mask meant for the logits is applied to the
    probabilities, so one class's probability is an exact 0 and its log -inf, on every batch."""
    probs = torch.softmax(torch.cat([out, -out], dim=1), dim=1)
    if step >= 30:
        probs = probs * torch.tensor([1.0, 0.0])
    onehot = nn.functional.one_hot((y[:, 0] > 0).long(), 2).float()
    return -(onehot * torch.log(probs)).sum(dim=1).mean()  # LOG_LINE


def test_a_bug_in_the_code_stops_with_diverged_naming_the_log_line(tmp_path):
    state = make_state(make_data(120))
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    with pytest.raises(tg.Diverged) as info:
        train(guard.batches(state, total_steps=120), state, loss_fn=masked_probs_bug)
    err = info.value
    assert guard.rewinds <= 2 and err.step == 30
    assert err.origin.origin.op.startswith("aten.log")
    assert err.origin.origin.line == line_of("LOG_LINE", masked_probs_bug)
    assert "follows the code, not the data" in str(err)
    assert [e["action"] for e in guard.events] == ["skip", "code_bug"]
    assert state.step == 30 and finite(state)  # left at the verified snapshot before the failing step
    with open_run(tmp_path / "run") as run:
        assert [f["kind"] for f in run.findings(source="guard")] == ["guard_rewind", "guard_stop"]
        assert run.meta["guard"]["status"] == "diverged"


class RMSNet(nn.Module):
    """RMS normalisation without epsilon after a linear layer without bias: a zero input row is
    finite forward (0 / 1e-8), but the gradient of sqrt at 0 is inf, and 0 * inf is NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8, bias=False)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.fc(x)
        rms = torch.sqrt(h.pow(2).mean(-1, keepdim=True))  # SQRT_LINE
        return self.out(h / (rms + 1e-8))


def train_with_closure(batches, state, log):
    """optimizer.step(closure): the forward and backward pass run inside the optimizer's step."""
    for step, (x, y) in batches:
        def closure(x=x, y=y):
            state.optimizer.zero_grad()
            loss = nn.functional.mse_loss(state.model(x), y)
            loss.backward()
            return loss

        log.append((step, state.optimizer.step(closure).item()))
        state.scheduler.step()


@pytest.mark.parametrize("closure", [False, True], ids=["loop", "closure"])
def test_a_gradient_that_goes_nan_under_a_finite_loss_is_caught(tmp_path, caplog, closure):
    data = make_data(40)
    data.tensors[0][30 * BS] = 0.0  # one zero row in batch 30
    state = make_state(data, model=RMSNet())
    losses = []
    guard = tg.Guard(tmp_path / "run", snapshot_every=20)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        if closure:  # the gradients exist only once the closure has run: they are read then
            train_with_closure(guard.batches(state, total_steps=40), state, losses)
        else:
            train(guard.batches(state, total_steps=40), state, log=losses)
    assert state.step == 40 and finite(state)
    # the loss of step 30 was finite: only the gradients showed it (step 31, which ran before the
    # one-step-late verdict, trained on the NaN parameters and was undone)
    assert math.isfinite(next(v for s, v in losses if s == 30))
    assert all(math.isfinite(v) for _, v in losses[-9:])
    [event] = guard.events
    assert event["trigger"] == "nonfinite_grad" and event["step"] == 30 and event["action"] == "skip"
    assert [b["batch"] for b in event["skipped"]] == [30]
    link = event["origin"]["origin"]
    assert link["phase"] == "backward" and link["line"] == line_of("SQRT_LINE", RMSNet)
    assert "gradient norm is nan" in caplog.records[-1].getMessage()


class SparseEmbNet(nn.Module):
    """facebookresearch/dlrm dlrm_s_pytorch.py in small: an ``nn.EmbeddingBag(mode="sum",
    sparse=True)`` table (sparse COO gradients, stepped by SGD) beside a dense MLP. A gradient hook
    on the pooled rows of a bag holding id 31 overflows: only the embedding's gradient goes inf."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(32, 4, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(4 + 4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, ids):
        pooled = self.emb(ids)
        if pooled.requires_grad:
            bad = (ids == 31).any(dim=1, keepdim=True)
            pooled.register_hook(lambda g: torch.where(bad, g * 1e39, g))
        return self.mlp(torch.cat([x, pooled], dim=1))


def test_an_inf_in_a_sparse_embedding_gradient_is_caught_at_its_step(tmp_path):
    g = torch.Generator().manual_seed(0)
    n = 30 * BS
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    ids = torch.randint(0, 31, (n, 3), generator=g)
    ids[12 * BS, 0] = 31  # batch 12
    torch.manual_seed(0)
    model = SparseEmbNet()
    state = tg.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                          loader=torch.utils.data.DataLoader(TensorDataset(x, ids, y), batch_size=BS))
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    for _, (xb, ib, yb) in guard.batches(state, total_steps=30):
        loss = nn.functional.mse_loss(state.model(xb, ib), yb)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
    assert state.step == 30 and finite(state)
    [event] = guard.events
    assert event["trigger"] == "nonfinite_grad" and event["step"] == 12 and event["action"] == "skip"
    assert [b["batch"] for b in event["skipped"]] == [12]
    link = event["origin"]["origin"]
    assert link["phase"] == "backward" and link["op"].startswith("aten.mul")  # the hook's g * 1e39



def test_a_rewind_restores_sparse_momentum_buffers(tmp_path):
    # The same model under SGD with momentum: its buffers for the table are sparse COO tensors,
    # which the guard's snapshot could not copy (copy_() between dense and sparse Tensors), so the
    # rewind itself crashed the run.
    g = torch.Generator().manual_seed(0)
    n = 20 * BS
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    ids = torch.randint(0, 31, (n, 3), generator=g)
    ids[12 * BS, 0] = 31  # batch 12
    torch.manual_seed(0)
    model = SparseEmbNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = tg.TrainState(model=model, optimizer=opt,
                          loader=torch.utils.data.DataLoader(TensorDataset(x, ids, y), batch_size=BS))
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    for _, (xb, ib, yb) in guard.batches(state, total_steps=20):
        loss = nn.functional.mse_loss(state.model(xb, ib), yb)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
    assert state.step == 20 and finite(state)
    assert opt.state[model.emb.weight]["momentum_buffer"].is_sparse
    [event] = guard.events
    assert event["step"] == 12 and event["action"] == "skip" and [b["batch"] for b in event["skipped"]] == [12]

def lbfgs_state(data, **kw):
    state = make_state(data)
    return tg.TrainState(model=state.model, optimizer=torch.optim.LBFGS(state.model.parameters(), **kw),
                         loader=torch.utils.data.DataLoader(data, batch_size=BS))


def train_lbfgs(batches, state, evals):
    """LBFGS: ``evals[step]``: the losses of every call of the step's closure when it first ran (the first is the step's)."""
    for step, (x, y) in batches:
        calls = []

        def closure(x=x, y=y, calls=calls):
            state.optimizer.zero_grad()
            loss = nn.functional.mse_loss(state.model(x), y)
            loss.backward()
            calls.append(loss.item())
            return loss

        state.optimizer.step(closure)
        evals.setdefault(step, calls)  # the first time the step ran (not its replay or retry)


def test_an_lbfgs_line_search_trying_far_points_is_no_spike(tmp_path):
    # pytorch/examples' time_sequence_prediction with line_search_fn="strong_wolfe" and
    # --spike-factor 3: "loss 0.1571 is a spike" where the step's loss (what optimizer.step returns,
    # the closure's first call) was 0.0024. The sentry averaged every call of the closure, the
    # line search's trial points included, and rewound a healthy run five times until Diverged.
    state = lbfgs_state(make_data(60), lr=0.2, max_iter=5, line_search_fn="strong_wolfe")
    guard = tg.Guard(tmp_path / "run", snapshot_every=20, spike_factor=20)
    evals = {}
    train_lbfgs(guard.batches(state, total_steps=60), state, evals)
    first = [calls[0] for calls in evals.values()]
    assert max(first) < 20 * statistics.median(first)  # the steps' own losses never spike
    assert max(max(calls) for calls in evals.values()) > 20 * max(first)  # the trial points do
    assert guard.events == []


def test_an_lbfgs_step_whose_later_evaluation_goes_nonfinite_is_caught_there(tmp_path):
    # Without a line search LBFGS moves the weights before each further call of the closure: a
    # non-finite loss there is the step's fault (its update made the weights non-finite), caught at
    # that step though its first evaluation was finite.
    state = lbfgs_state(make_data(30), lr=2, max_iter=5)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10, max_rewinds=1)
    evals = {}
    with pytest.raises(tg.Diverged):
        train_lbfgs(guard.batches(state, total_steps=30), state, evals)
    bad = min(s for s, calls in evals.items() if not all(map(math.isfinite, calls)))
    assert math.isfinite(evals[bad][0])
    event = guard.events[0]
    assert event["step"] == bad and event["trigger"] == "nonfinite_loss"


def test_a_loss_spike_is_rewound_and_skipped(tmp_path):
    state = make_state(make_data(90, spike_batch=60))
    guard = tg.Guard(tmp_path / "run", snapshot_every=25, spike_factor=20, skip_batches=2)
    train(guard.batches(state, total_steps=90), state)
    [event] = guard.events
    assert event["trigger"] == "spike" and event["step"] == 60 and event["origin"] is None
    assert "is a spike" in event["reason"]
    assert [s["batch"] for s in event["skipped"]] == [60, 61] and event["skip_count"] == 2
    assert event["replay"]["reproduced"] is True and event["replay"]["bitwise_equal"] is True
    assert state.step == 90 and finite(state)


def test_a_spike_is_reported_against_the_median_it_was_judged_by(tmp_path):
    # pytorch/examples' time_sequence_prediction under --guard --spike-factor 3: "loss 0.001722 is a
    # spike (1.64x the median 0.00105 of the last steps, above spike_factor 3)". The median was
    # taken after the rewind had dropped the steps since the snapshot from the window.
    state = make_state(make_data(90, spike_batch=60))
    guard = tg.Guard(tmp_path / "run", snapshot_every=25, spike_factor=20)
    log = []
    train(guard.batches(state, total_steps=90), state, log=log)
    [event] = guard.events
    before = [loss for step, loss in dict(reversed(log)).items() if step < 60]  # the first run of each step
    assert len(before) == 60
    assert f"the median {statistics.median(before):.4g} of" in event["reason"]
    ratio = float(re.search(r"\(([0-9.e+]+)x the median", event["reason"]).group(1))
    assert ratio > 20


def test_under_a_grad_scaler_the_guard_sees_the_unscaled_loss(tmp_path):
    state = make_state(make_data(90, spike_batch=60))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = tg.Guard(tmp_path / "run", snapshot_every=25, spike_factor=20)
    losses = {}
    for step, (x, y) in guard.batches(state, total_steps=90):
        loss = nn.functional.mse_loss(state.model(x), y)
        losses.setdefault(step, loss.item())
        state.optimizer.zero_grad()
        scaler.scale(loss).backward()  # backward() runs on the loss times 65,536
        scaler.step(state.optimizer)
        scaler.update()
    [event] = guard.events
    assert event["trigger"] == "spike" and event["step"] == 60
    assert event["loss"] == pytest.approx(losses[60], rel=1e-6)  # not 65,536 times it
    assert state.step == 90 and finite(state)


def test_without_spike_factor_a_spike_passes(tmp_path):
    state = make_state(make_data(90, spike_batch=60))
    guard = tg.Guard(tmp_path / "run", snapshot_every=25)
    train(guard.batches(state, total_steps=90), state)
    assert guard.events == []


def test_lower_lr_halves_every_learning_rate_and_keeps_the_batch(tmp_path):
    state = make_state(make_data(60, poison_batch=20))
    guard = tg.Guard(tmp_path / "run", snapshot_every=10, policy="lower_lr", max_rewinds=2)
    with pytest.raises(tg.Diverged) as info:  # a poisoned batch stays poisoned at any learning rate
        train(guard.batches(state, total_steps=60), state)
    assert [e["action"] for e in guard.events] == ["lower_lr", "lower_lr", "max_rewinds"]
    assert guard.events[0]["lr"] == [pytest.approx(5e-3)] and guard.events[1]["lr"] == [pytest.approx(2.5e-3)]
    assert state.scheduler.base_lrs == [pytest.approx(2.5e-3)]
    assert info.value.step == 20 and info.value.origin is not None and finite(state)


def test_stop_raises_diverged_with_the_origin_and_leaves_the_state_before_the_step(tmp_path):
    state = make_state(make_data(60, poison_batch=20))
    guard = tg.Guard(tmp_path / "run", snapshot_every=10, policy="stop")
    with pytest.raises(tg.Diverged) as info:
        train(guard.batches(state, total_steps=60), state)
    assert info.value.origin.origin.line == line_of("POW_LINE")
    assert info.value.event["action"] == "stop" and state.step == 20 and finite(state)
    assert isinstance(info.value, tg.TrainguardError) and info.value.exit_code == 3


def test_max_rewinds_zero_stops_at_the_first_fault(tmp_path):
    state = make_state(make_data(40, poison_batch=12))
    guard = tg.Guard(tmp_path / "run", snapshot_every=10, max_rewinds=0)
    with pytest.raises(tg.Diverged, match="max_rewinds=0 spent"):
        train(guard.batches(state, total_steps=40), state)
    assert state.step == 10 and finite(state)


def test_a_fault_right_after_a_snapshot_and_one_in_the_last_step(tmp_path):
    state = make_state(make_data(30, poison_batch=10))
    data = state.loader.dataset
    data.tensors[0][29 * BS:] = 1e20  # the last batch too: found by the final check
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    seen = train(guard.batches(state, total_steps=29), state)
    assert [e["step"] for e in guard.events] == [10, 28]
    assert guard.events[0]["replay"]["steps"] == 0  # the snapshot was at the failing step itself
    assert state.step == 29 and finite(state) and seen[-1] == 28


def test_loop_report_gives_the_loss(tmp_path):
    """A loss given with loop.report() is checked (here backward runs on a finite surrogate)."""
    data = make_data(30)
    data.tensors[0][15 * BS] = 7777.0  # a marked sample: its real loss is infinite, say
    state = make_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    loop = tg.CheckpointManager(tmp_path / "ckpt").resume(state, total_steps=30, guard=guard)
    for _step, (x, y) in loop.batches():
        loss = nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        loop.report(float("inf") if bool((x == 7777.0).any()) else loss)
    assert [(e["step"], e["trigger"], e["replay"]["reproduced"]) for e in guard.events] == [
        (15, "nonfinite_loss", True)]


def test_for_step_in_loop_with_a_guard_is_refused(tmp_path):
    state = make_state(make_data(10))
    with tg.CheckpointManager(tmp_path / "ckpt") as ckpt:
        loop = ckpt.resume(state, total_steps=5, guard=tg.Guard(tmp_path / "run"))
        with pytest.raises(RuntimeError, match="loop.batches"):
            iter(loop)
        with pytest.raises(ValueError, match="step form"):
            ckpt.resume(state, epochs=2, guard=tg.Guard(tmp_path / "run"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "retry"}, "policy must be one of"), ({"snapshot_every": 0}, "snapshot_every must be"),
    ({"spike_factor": 0.5}, "spike_factor must be"), ({"skip_batches": 0}, "skip_batches must be"),
    ({"max_rewinds": -1}, "max_rewinds must be"),
])
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tg.Guard(**kwargs)


def test_one_snapshot_at_a_time_and_its_size_is_reported(tmp_path):
    state = make_state(make_data(20, poison_batch=12))
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    taken = []
    orig = guard._take_snapshot

    def take():
        orig()
        taken.append((state.step, guard.snapshot.step, guard.snapshot.nbytes))

    guard._take_snapshot = take
    train(guard.batches(state, total_steps=20), state)
    assert [s for s, _, _ in taken] == [0, 5, 10, 12, 15]  # 12: moved before the failing step
    assert all(s == snap for s, snap, _ in taken)
    n = sum(p.numel() for p in state.model.parameters())
    assert taken[0][2] == n * 4  # step 0: the weights; Adam has no moments yet
    assert n * 12 <= taken[-1][2] <= n * 12 + 64  # weights, exp_avg, exp_avg_sq and Adam's step counters
    with open_run(tmp_path / "run") as run:
        assert run.meta["guard"]["snapshot_bytes"] == taken[-1][2]
        assert run.meta["guard"]["snapshot_step"] == 15


class HiddenNoise(nn.Module):
    """Draws noise from a generator of its own that the TrainState does not hold: a replay cannot
    reproduce it, and the guard must say so rather than claim the replay was exact."""

    def __init__(self):
        super().__init__()
        self.net = PolyNet()
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        return self.net(x + 0.01 * torch.randn(x.shape, generator=self.gen))


def test_the_replay_check_reports_a_replay_that_differs(tmp_path):
    state = make_state(make_data(30, poison_batch=15), model=HiddenNoise())
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    train(guard.batches(state, total_steps=30), state)
    [event] = guard.events
    rp = event["replay"]
    assert rp["bitwise_equal"] is False and rp["compared"] == 5 and rp["mismatch"]["step"] == 10
    assert rp["mismatch"]["original"]["loss"] != rp["mismatch"]["replayed"]["loss"]
    assert "losses differ from step 10" in event["message"] and event["action"] == "skip"


def test_an_installed_guard_watches_resume_without_guard_and_leaves_for_step_in_loop_alone(tmp_path, caplog):
    guard = tg.Guard(tmp_path / "run", snapshot_every=10).install()
    try:
        state = make_state(make_data(30, poison_batch=12))
        train(tg.CheckpointManager(tmp_path / "a").resume(state, total_steps=30).batches(), state)
        assert [e["step"] for e in guard.events] == [12] and finite(state)
        plain = make_state(make_data(30))
        with caplog.at_level(logging.WARNING):
            steps = list(tg.CheckpointManager(tmp_path / "b").resume(plain, total_steps=3))
        assert steps == [0, 1, 2] and "runs unguarded" in caplog.text
    finally:
        guard.uninstall()
    state = make_state(make_data(30, poison_batch=12))
    train(tg.CheckpointManager(tmp_path / "c").resume(state, total_steps=30).batches(), state)
    assert len(guard.events) == 1 and not finite(state)  # uninstalled: nobody watched


def _clip_torch_keyword(model, opt):
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, error_if_nonfinite=True)


def _clip_torch_positional(model, opt):
    nn.utils.clip_grad_norm_(model.parameters(), 1.0, 2.0, True)


@pytest.mark.parametrize("clip", [_clip_torch_keyword, _clip_torch_positional, "fabric"],
                         ids=["keyword", "positional", "fabric"])
def test_a_clip_that_raises_on_a_nonfinite_norm_does_not_end_a_guarded_loop(tmp_path, clip):
    # Fabric's clip_gradients(model, optimizer, max_norm=...) defaults to error_if_nonfinite=True
    # (lightning examples/fabric/reinforcement_learning/train_fabric.py, litgpt/pretrain.py): the
    # poisoned batch's NaN gradient raised RuntimeError in the same step, before the guard, which
    # reads a step one step late, could rewind. The guard takes that step as any other NaN.
    state = make_state(make_data(40, poison_batch=20))
    model, opt = state.model, state.optimizer
    if clip == "fabric":
        lightning = pytest.importorskip("lightning")
        fabric = lightning.Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        state = tg.TrainState(model=model, optimizer=opt, scheduler=state.scheduler, loader=state.loader)

        def clip(model, opt):
            fabric.clip_gradients(model, opt, max_norm=1.0)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    for _, (x, y) in guard.batches(state, total_steps=40):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        clip(model, opt)
        opt.step()
    [event] = guard.events
    assert event["action"] == "skip" and event["step"] == 20 and event["skipped"][0]["index"] == 20
    assert state.step == 40 and finite(state)
    # no guard watching: the error the script asked for is raised again
    first = next(model.parameters())
    first.grad = torch.full_like(first, float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        clip(model, opt)


GUARDED_THEN_KILLED = """
import os, signal, torch, trainguard as tg
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
x, y = torch.randn(400, 4), torch.randn(400, 1)
x[10 * 8 + 3, 1] = float("nan")  # one corrupt sample in batch 10
x[25 * 8 + 1, 0] = float("nan")  # and one in batch 25
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=8))
loop = tg.CheckpointManager("ck", every_steps=5).resume(state, total_steps=40)
for step, (xb, yb) in loop.batches():
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 12 and not os.environ.get("RERUN"):
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9, the OOM killer, a node lost
"""


def test_an_event_survives_a_kill_right_after_it(tmp_path):
    # Found with pytorch/examples' ddp-tutorial-series under `trainguard run --guard --nproc-per-node 2`,
    # rank 1 killed with SIGKILL during a checkpoint 22 steps after the guard skipped its corrupt
    # batch: the event was not committed yet (the writer commits every second), and rank 1's run
    # said the guard had never rewound. An event is rare and is the evidence: it is committed at once.
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(GUARDED_THEN_KILLED)
    out = subprocess.run([sys.executable, "-m", "trainguard", "run", "--guard", "--logdir", "runs/g", "train.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    with open_run(tmp_path / "runs" / "g") as run:
        assert [f["event"]["step"] for f in run.findings(source="guard")] == [10]
        assert run.meta["guard"]["rewinds"] == 1 and run.meta["guard"]["events"] == 1


def test_a_rerun_after_a_kill_numbers_its_events_after_the_earlier_ones(tmp_path):
    # The same run, the same command run again: it resumes from the checkpoint of step 10, meets the
    # corrupt batch 10 again (skipped unread: its sample is known from the stored event) and then
    # batch 25's. The run keeps both events; the second was numbered 1 again and the run's guard
    # metadata counted one event and one rewind.
    import os
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(GUARDED_THEN_KILLED)
    command = [sys.executable, "-m", "trainguard", "run", "--guard", "--logdir", "runs/g", "train.py"]
    assert subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=120).returncode == -9
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RERUN": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    with open_run(tmp_path / "runs" / "g") as run:
        assert [(f["event"]["n"], f["event"]["step"]) for f in run.findings(source="guard")] == [(1, 10), (2, 24)]
        assert run.meta["guard"]["rewinds"] == 2 and run.meta["guard"]["events"] == 2
        assert run.meta["guard"]["skipped_known"] == 1 and run.meta["guard"]["last_skipped_known"]["step"] == 10


class _EMA:
    """diffusers' ``training_utils.EMAModel`` in small: shadow parameters moved after each step."""

    def __init__(self, model: nn.Module):
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def step(self, model: nn.Module) -> None:
        for s, p in zip(self.shadow, model.parameters()):
            s.lerp_(p, 0.1)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = [t.clone() for t in state["shadow"]]


@pytest.mark.parametrize("held", [False, True])
def test_an_ema_left_out_of_the_state_is_named_and_one_in_it_is_rewound(tmp_path, held):
    # diffusers' train_unconditional.py --use_ema under the guard with the EMAModel outside the
    # TrainState: the rewind put the model back and left the EMA holding the NaN weights of the
    # failed step (the pipeline it saves was all NaN), and nothing said so
    state = make_state(make_data(20, poison_batch=12))
    ema = _EMA(state.model)
    if held:
        state.ema = ema
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = guard.batches(state, total_steps=20)
    named = [str(w.message) for w in caught if "not in the TrainState" in str(w.message)]
    for _step, (x, y) in batches:
        loss = nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.ema.step(state.model) if held else ema.step(state.model)
    assert len(guard.events) == 1 and finite(state)
    if held:
        assert named == [] and all(bool(s.isfinite().all()) for s in state.ema.shadow)
    else:
        [message] = named
        assert message.startswith("ema (_EMA) has state_dict()") and "TrainState(..., ema=ema)" in message
        assert caught[0].filename == __file__


def test_a_teacher_left_out_of_the_state_is_named_when_the_rewind_leaves_it_nan(tmp_path):
    # main_dino.py's teacher (facebookresearch/dino @ 7c446df5: requires_grad=False, the EMA of the
    # student under no_grad) outside the TrainState, under the guard: the rewind put the student back
    # and left the teacher with the NaN of the failed step, every later step was NaN, and the guard
    # stopped with "overflow in convolution" at the teacher's first layer; nothing named the teacher
    state = make_state(make_data(20, poison_batch=12))
    teacher = PolyNet()
    teacher.load_state_dict(state.model.state_dict())
    teacher.requires_grad_(False)
    guard = tg.Guard(tmp_path / "run", snapshot_every=5, max_rewinds=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(tg.Diverged):
            for _step, (x, y) in guard.batches(state, total_steps=20):
                loss = nn.functional.mse_loss(state.model(x), teacher(x).detach() + y)
                state.optimizer.zero_grad()
                loss.backward()
                state.optimizer.step()
                with torch.no_grad():
                    for ps, pt in zip(state.model.parameters(), teacher.parameters()):
                        pt.data.mul_(0.9).add_(0.1 * ps.detach().data)
    [message] = [str(w.message) for w in caught if "TrainState" in str(w.message)]
    assert message.startswith("teacher (PolyNet)") and "TrainState(..., teacher=teacher)" in message, message
    assert "rewind" in message and "holds NaN/Inf now" in message, message
    assert [w.filename for w in caught if "TrainState" in str(w.message)] == [__file__]


class CholeskyGP(nn.Module):
    """cornellius-gp/gpytorch's SVGP (examples/04_Variational_and_Approximate_GPs), reduced: every
    forward factors a covariance built from the parameters, and linear_operator's
    ``psd_safe_cholesky`` raises ``NanError`` when that matrix holds a NaN. A NaN target in one
    minibatch makes that step's loss and gradients NaN, Adam writes NaN into the parameters, and
    the next step's forward raises before it ends: read one step late, the guard never saw the
    NaN step, and the SVGP example crashed at step 3 with ``NanError`` under the guard."""

    def __init__(self):
        super().__init__()
        self.raw = nn.Parameter(torch.eye(4) * 0.5)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        k = self.raw @ self.raw.T + torch.eye(4)
        if torch.isnan(k).any():
            raise ValueError(f"cholesky_cpu: {int(torch.isnan(k).sum())} of 16 elements are NaN.")
        return self.out(x @ torch.linalg.cholesky(k))


def test_a_nan_step_is_caught_before_the_next_forward_raises_on_its_nan_weights(tmp_path):
    data = make_data(30)
    data.tensors[1][7 * BS + 2] = float("nan")  # one NaN target in batch 7
    state = make_state(data, model=CholeskyGP())
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    seen = train(guard.batches(state, total_steps=30), state)
    assert state.step == 30 and finite(state)
    # on CPU reading a step costs nothing: step 7 is read when it ends, before step 8 runs
    assert seen == list(range(8)) + [5, 6, 7] + list(range(7, 30))
    [event] = guard.events
    assert event["action"] == "skip" and event["step"] == 7 and event["rewound_to"] == 5
    assert event["skipped"][0]["batch"] == 7
