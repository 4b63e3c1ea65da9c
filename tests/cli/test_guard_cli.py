"""``trainguard run --guard`` on an unmodified script that uses ckpt.resume(); the report lists the
guard's events with their origin and skipped batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import math
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import trainguard as tg

    BUG = "--bug" in sys.argv
    EXIT = "--exit" in sys.argv
    RAISE = "--raise" in sys.argv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.fc(torch.cat([x, x.pow(2)], dim=-1))  # POW

    torch.manual_seed(0)
    x, y = torch.randn(160, 4), torch.randn(160, 1)
    x[120:124] = 1e20  # batch 30
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=4))
    loop = tg.CheckpointManager(sys.argv[1], every_steps=20).resume(state, total_steps=40)
    for step, (xb, yb) in loop.batches():
        if RAISE:  # a policy's distribution, validated: cleanrl's PPO, SB3 (raises on NaN weights)
            torch.distributions.Normal(model.fc.weight.mean(), 1.0)
        out = model(xb)
        loss = torch.nn.functional.mse_loss(out, yb)
        if BUG and step >= 10:
            loss = loss - torch.log(torch.zeros(()))  # LOG
        if EXIT and not math.isfinite(loss.item()):  # facebookresearch/dino main_dino.py (DeiT, MAE alike)
            print("Loss is {}, stopping training".format(loss.item()))
            sys.exit(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("done", state.step, bool(all(torch.isfinite(p).all() for p in model.parameters())))
''')


def trainguard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")  # rich wraps at the terminal's width
    return subprocess.run([sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=240, env=env)


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if marker in text)


@pytest.mark.timeout(300)
def test_run_guard_skips_a_poisoned_batch_of_an_unmodified_script(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    r = trainguard("run", "--guard", "--logdir", "runs/g", "train.py", "ckpt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "done 40 True" in r.stdout and "Traceback" not in r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("trainguard: step 30:")]
    assert "loss is nan; rewound to step 20 (checkpoint); replayed 10 steps (losses bitwise equal)" in line
    assert f"at train.py:{line_of('POW')} — " in line and line.endswith("skipped batch 30")
    assert "the guard rewound 1 time(s)" in r.stderr

    rep = trainguard("report", "runs/g", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert "#1 step 30: loss is nan" in rep.stdout
    assert "skipped batch 30 (epoch 0, index 30, samples 120, 121, 122, 123)" in rep.stdout
    assert "trainguard report runs/g/replays/step-30" in rep.stdout

    data = json.loads(trainguard("report", "runs/g", "--json", cwd=tmp_path).stdout)
    [event] = data["guard"]["events"]
    assert event["origin"]["origin"]["line"] == line_of("POW") and event["skipped"][0]["samples"] == [120, 121, 122, 123]
    assert data["guard"]["meta"]["status"] == "finished" and data["findings"] == []

    replay = json.loads(trainguard("report", "runs/g/replays/step-30", "--json", cwd=tmp_path).stdout)
    assert replay["origin"]["origin"]["op"].startswith("aten.pow") and replay["origin"]["origin"]["step"] == 30


@pytest.mark.timeout(300)
def test_run_guard_stops_a_bug_in_the_code_with_one_line_and_exit_3(tmp_path):
    # with --monitor too: one guarded run (a process importing torch, ~4 s) for what three tests checked
    (tmp_path / "train.py").write_text(SCRIPT)
    r = trainguard("run", "--guard", "--monitor", "--logdir", "runs/b", "train.py", "ckpt", "--bug", cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and "done" not in r.stdout
    assert "trainguard: Diverged at step 10: training stopped" in r.stderr
    assert f"origin: aten.log at train.py:{line_of('LOG')} — " in r.stderr
    assert "follows the code, not the data" in r.stderr
    rep = trainguard("report", "runs/b", cwd=tmp_path)
    assert "#2 step 10" in rep.stdout and "status diverged" in rep.stdout
    # how the script ended is stored in the guard's run
    data = json.loads(trainguard("report", "runs/b", "--json", cwd=tmp_path).stdout)
    assert data["status"] == "crashed" and data["guard"]["meta"]["status"] == "diverged"
    assert data["crash"]["text"].startswith("the script crashed at step 10: Diverged: trainguard: step 10 (batch 11): loss is")
    # pytorch/examples' dcgan under `trainguard run --guard --monitor`: the guard's replay had found
    # the op and line, yet the monitor's nonfinite_loss finding said to record the run to find them.
    fs = json.loads(trainguard("diagnose", "runs/b", "--json", cwd=tmp_path).stdout)["findings"]
    [f] = [f for f in fs if f["kind"] == "nonfinite_loss"]
    assert f["evidence"]["origin"]["op"] == "aten.log" and f["evidence"]["origin"]["line"] == line_of("LOG")
    assert f"train.py:{line_of('LOG')}" in f["suggestion"] and "record the run" not in f["suggestion"]


@pytest.mark.timeout(300)
def test_run_guard_on_a_script_that_exits_on_a_nonfinite_loss_says_to_drop_that_check(tmp_path):
    # facebookresearch/dino's main_dino.py under `trainguard run --guard` with a NaN sample: the script
    # read the loss, printed "Loss is nan, stopping training" and called sys.exit(1) before backward(),
    # where the guard looks; "the guard rewound 0 time(s)", and the report said only "the script
    # stopped itself (sys.exit, no exception: its last printed lines say why), then judge training
    # health on a run that finishes".
    (tmp_path / "train.py").write_text(SCRIPT)
    r = trainguard("run", "--guard", "--logdir", "runs/e", "train.py", "ckpt", "--exit", cwd=tmp_path)
    assert r.returncode == 1 and "Loss is" in r.stdout, r.stderr
    data = json.loads(trainguard("report", "runs/e", "--json", cwd=tmp_path).stdout)
    [f] = [f for f in data["findings"] if f["kind"] == "script_crashed"]
    assert "step 30" in f["suggestion"] and "guard" in f["suggestion"], f["suggestion"]
    assert "math.isfinite(loss.item())" in f["suggestion"] and "sys.exit" in f["suggestion"]
    assert data["guard"]["meta"]["stopped_step"] == 30


@pytest.mark.timeout(300)
def test_run_guard_rewinds_before_a_script_raises_on_the_weights_a_nan_step_left(tmp_path):
    # cleanrl's PPO (and facebookresearch/detr's matcher, gpytorch's psd_safe_cholesky) under
    # `trainguard run --guard`: the sentry read step s when step s + 1 ended, and step s + 1 raised
    # first on the NaN weights step s had left (a validated distribution, scipy's
    # linear_sum_assignment, linear_operator's NanError). On CPU a step is read when it ends: the
    # guard rewinds before the next step runs, and the script finishes. (On an accelerator the
    # report names the NaN step before the crash: tests/cli/test_crashed_script.py.)
    (tmp_path / "train.py").write_text(SCRIPT)
    r = trainguard("run", "--guard", "--logdir", "runs/r", "train.py", "ckpt", "--raise", cwd=tmp_path)
    assert r.returncode == 0 and "ValueError" not in r.stderr, r.stderr
    assert "done 40 True" in r.stdout, r.stdout
    assert "trainguard: step 30: loss is nan; rewound to step 20 (checkpoint)" in r.stderr, r.stderr
    data = json.loads(trainguard("report", "runs/r", "--json", cwd=tmp_path).stdout)
    [event] = data["guard"]["events"]
    assert event["step"] == 30 and event["skipped"][0]["samples"] == [120, 121, 122, 123]
    assert "fault_before_crash" not in data["guard"]["meta"] and data["guard"]["meta"]["status"] == "finished"


def test_guard_options_need_guard_and_exclude_check_numerics(tmp_path, monkeypatch, capsys):
    from trainguard.cli import main

    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    # The refusals are checked in this process (a Python start each was most of this test's
    # time): exit 2, one line, nothing raised; the run that goes through has a process of its own.
    for args, message in ((["--policy", "stop"], "need --guard"),
                          (["--guard", "--check-numerics"], "choose one of --guard and --check-numerics"),
                          (["--guard", "--snapshot-every", "0"], "snapshot_every must be")):
        assert main(["run", *args, "train.py"]) == 2, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    r = trainguard("run", "--guard", "--logdir", "runs/x", "train.py", cwd=tmp_path)
    assert r.returncode == 0 and "nothing was guarded" in r.stderr


# From pytorch/examples' dcgan/main.py run under `trainguard run --guard` (its loop moved onto
# ckpt.resume()): nn.BCELoss raises on an input outside [0, 1], which ends the script inside the
# guarded loop; the guard's run then said "status finished" like a run that had trained to the end.
# The input here is finite (above 1): a guard lets that error through as the bug it is (a NaN input
# it takes as a bad step instead: tests/guard/test_guard_raising.py).
BCE_SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import trainguard as tg

    torch.manual_seed(0)
    netD = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Sigmoid())
    opt = torch.optim.Adam(netD.parameters(), lr=2e-4)
    state = tg.TrainState(netD=netD, optimizerD=opt, loader=DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
    loop = tg.CheckpointManager(sys.argv[1], every_steps=100).resume(state, total_steps=12)
    for step, (x,) in loop.batches():
        p = netD(x).squeeze(1)
        if step == 5 and "--crash" in sys.argv:
            p = p + 1  # finite, above 1
        loss = torch.nn.BCELoss()(p, torch.ones(4))
        opt.zero_grad()
        loss.backward()
        opt.step()
''')


@pytest.mark.timeout(300)
def test_a_guarded_script_that_crashes_is_stored_as_crashed_and_its_rerun_that_finishes_as_finished(tmp_path):
    (tmp_path / "bce.py").write_text(BCE_SCRIPT)
    r = trainguard("run", "--guard", "--logdir", "runs/c", "bce.py", "ckpt", "--crash", cwd=tmp_path)
    assert r.returncode == 1 and "all elements of input should be between 0 and 1" in r.stderr, r.stderr
    data = json.loads(trainguard("report", "runs/c", "--json", cwd=tmp_path).stdout)
    assert data["status"] == "crashed" and data["guard"]["meta"]["status"] == "interrupted"
    assert data["crash"]["text"] == "the script crashed at step 5: RuntimeError: all elements of input should be between 0 and 1"
    # pytorch/examples' dcgan under `trainguard run --guard`, killed with kill -9 and run again: the
    # rerun resumed and finished, yet the guard's run still said "running ... or its process was
    # killed" (an appending writer left the first process's status alone); a crash is the same.
    r = trainguard("run", "--guard", "--logdir", "runs/c", "bce.py", "ckpt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(trainguard("report", "runs/c", "--json", cwd=tmp_path).stdout)
    assert data["status"] == "finished" and data["crash"] is None and data["guard"]["meta"]["status"] == "finished"


def test_a_script_that_trains_outside_any_guarded_loop_is_told_what_watches_it(tmp_path):
    # huggingface/trl's trl/scripts/dpo.py (a Trainer's own loop) under `trainguard run --guard`,
    # with a planted division by a zero std: NaN from step 0 to the end, exit 0, and only "the
    # script iterated no loop.batches() of ckpt.resume(); nothing was guarded" — no word that the
    # script did train, unwatched, nor of what watches a framework's loop.
    (tmp_path / "train.py").write_text(textwrap.dedent('''
        import torch
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):  # the framework's loop: batches the guard never hands out
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    '''))
    r = trainguard("run", "--guard", "--logdir", "runs/x", "train.py", cwd=tmp_path)
    assert r.returncode == 0 and "nothing was guarded" in r.stderr, r.stderr
    assert "trained" in r.stderr and "--check-numerics" in r.stderr and "--monitor" in r.stderr, r.stderr
    # huggingface/diffusers' train_unconditional.py (a hand-written accelerate loop) got the same
    # note, which blamed "a Hugging Face or Lightning Trainer" and said not how to guard a loop of
    # its own
    assert "a loop of its own" in r.stderr and "ckpt.resume(state, total_steps=N).batches()" in r.stderr, r.stderr


@pytest.mark.timeout(300)
def test_run_guard_overwrite_replaces_the_earlier_run_and_its_replays(tmp_path, monkeypatch, capsys):
    # Found guarding karpathy/llm.c's train_gpt2.py (a bad batch planted): a second
    # `run --guard --overwrite` into the same logdir kept the first run's events, so the report
    # listed both runs' events, and the new replay went to replays/step-N-3.
    from trainguard.cli import main

    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--guard", "--logdir", "runs/o", "train.py", "ck1", "--bug"]) == 3
    assert main(["run", "--guard", "--overwrite", "--logdir", "runs/o", "train.py", "ck2"]) == 0
    capsys.readouterr()
    data = json.loads(trainguard("report", "runs/o", "--json", cwd=tmp_path).stdout)
    assert [e["step"] for e in data["guard"]["events"]] == [30]
    assert sorted(p.name for p in (tmp_path / "runs/o/replays").iterdir()) == ["step-30"]


# facebookresearch/detr's main.py adapted to ckpt.resume (engine.train_one_epoch unchanged): the
# loop's batches() is kept in a variable and handed out an epoch at a time through islice, and a
# NaN image makes generalized_box_iou's `assert (boxes1[:, 2:] >= boxes1[:, :2]).all()` fail in the
# matcher, inside the loop body. The epoch wrapper's class keeps the suspended generator alive
# until a garbage collection, at the latest when the interpreter tears down: `trainguard run --guard` then waited 120 s for
# a writer thread that was already gone, and the guard's run said "running"; with a Guard in the
# script itself, the run said "finished" (or stayed "running", with "Exception ignored in:
# <generator object ResumeLoop._batch_form>" printed at exit).
HELD_SCRIPT = textwrap.dedent('''
    import sys
    from itertools import islice
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import trainguard as tg

    def main():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        state = tg.TrainState(model=model, optimizer=opt,
                              loader=DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
        guard = tg.Guard(sys.argv[2]) if len(sys.argv) > 2 else None
        loop = tg.CheckpointManager(sys.argv[1], every_steps=4).resume(state, total_steps=16, guard=guard)
        batches = loop.batches()

        class Epoch:  # sized for MetricLogger.log_every; the class (a cycle) holds `batches` until a collection
            def __len__(self):
                return 8

            def __iter__(self):
                return (b for _, b in islice(batches, 8))

        for epoch in range(2):
            for (x,) in Epoch():
                assert state.step != 5, "degenerate boxes"
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()

    main()
''')


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["cli", "script"])
def test_a_crash_while_the_scripts_batches_generator_is_still_held_ends_the_guards_run_at_once(tmp_path, how):
    (tmp_path / "held.py").write_text(HELD_SCRIPT)
    start = time.monotonic()
    if how == "cli":
        r = trainguard("run", "--guard", "--logdir", "runs/h", "held.py", "ckpt", cwd=tmp_path)
    else:
        r = subprocess.run([sys.executable, "held.py", "ckpt", "runs/h"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=240)
    took = time.monotonic() - start
    assert r.returncode == 1 and "AssertionError: degenerate boxes" in r.stderr, r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr
    assert took < 60, took
    data = json.loads(trainguard("report", "runs/h", "--json", cwd=tmp_path).stdout)
    assert data["status"] == "crashed" and data["guard"]["meta"]["status"] == "interrupted", data["status"]
    assert data["crash"]["text"] == "the script crashed at step 5: AssertionError: degenerate boxes"


@pytest.mark.timeout(300)
def test_a_script_whose_guarded_loop_body_raises_is_stored_as_crashed_not_finished(tmp_path):
    # The same script with its Guard, iterating loop.batches() directly: the generator is closed
    # while the AssertionError unwinds, before Python reports it, and the guard's run said
    # "finished" (its guard status "interrupted") for a script that crashed at step 5.
    direct = HELD_SCRIPT.replace("    batches = loop.batches()\n", "").replace("for (x,) in Epoch():",
                                                                            "for _, (x,) in loop.batches():")
    (tmp_path / "direct.py").write_text(direct)
    r = subprocess.run([sys.executable, "direct.py", "ckpt", "runs/d"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=240)
    assert r.returncode == 1 and "AssertionError: degenerate boxes" in r.stderr, r.stderr
    data = json.loads(trainguard("report", "runs/d", "--json", cwd=tmp_path).stdout)
    assert data["status"] == "crashed" and data["guard"]["meta"]["status"] == "interrupted", data["status"]
    assert data["crash"]["text"] == "the script crashed at step 5: AssertionError: degenerate boxes"


# facebookresearch/detr @ 29901c5 (util/misc.py's NestedTensor and collate_fn, util/box_ops.py's
# generalized_box_iou with its assert, models/matcher.py calling it on the predicted boxes) under
# `trainguard run --guard`, with one corrupt image (sample 17): its NaN made NaN boxes, and the
# assert raised AssertionError inside the step, before any loss, where the guard cannot rewind.
# The report said only "The script crashed at step 4: AssertionError ... fix the error it raised",
# nothing of the NaN the failing batch held.
DETR_SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    import trainguard as tg

    class NestedTensor:
        def __init__(self, tensors, mask):
            self.tensors = tensors
            self.mask = mask

    def collate_fn(batch):
        batch = list(zip(*batch))
        batch[0] = NestedTensor(torch.stack(batch[0]), torch.zeros(len(batch[0]), 4, 4, dtype=torch.bool))
        return tuple(batch)

    def box_cxcywh_to_xyxy(x):
        x_c, y_c, w, h = x.unbind(-1)
        return torch.stack([(x_c - 0.5 * w), (y_c - 0.5 * h), (x_c + 0.5 * w), (y_c + 0.5 * h)], dim=-1)

    def generalized_box_iou(boxes1, boxes2):
        assert (boxes1[:, 2:] >= boxes1[:, :2]).all()
        assert (boxes2[:, 2:] >= boxes2[:, :2]).all()
        lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
        rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
        return (rb - lt).clamp(min=0).prod(-1)

    torch.manual_seed(0)
    data = [(torch.randn(3, 4, 4), {"boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3]])}) for _ in range(40)]
    data[17][0][0, 1, 2] = float("nan")  # a corrupt image
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_size=4, collate_fn=collate_fn))
    loop = tg.CheckpointManager(sys.argv[1], every_steps=100).resume(state, total_steps=8)
    for step, (samples, targets) in loop.batches():
        boxes = model(samples.tensors).sigmoid()
        tgt = torch.cat([t["boxes"] for t in targets])
        giou = generalized_box_iou(box_cxcywh_to_xyxy(boxes), box_cxcywh_to_xyxy(tgt))
        loss = F.l1_loss(boxes, tgt) + (1 - torch.diag(giou)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
''')


@pytest.mark.timeout(300)
def test_run_guard_on_an_assert_raised_by_a_nan_the_batch_held_names_that_sample(tmp_path):
    (tmp_path / "train.py").write_text(DETR_SCRIPT)
    r = trainguard("run", "--guard", "--logdir", "runs/d", "train.py", "ckpt", cwd=tmp_path)
    assert r.returncode == 1 and "AssertionError" in r.stderr, r.stderr
    data = json.loads(trainguard("report", "runs/d", "--json", cwd=tmp_path).stdout)
    [f] = [f for f in data["findings"] if f["kind"] == "script_crashed"]
    assert "step 4" in f["title"], f["title"]
    assert "sample 17 holds nan in the batch itself" in f["suggestion"], f["suggestion"]
    assert "--check-numerics" in f["suggestion"] and "doctor" in f["suggestion"], f["suggestion"]
    assert data["guard"]["meta"]["batch_nonfinite_at_crash"]["samples"] == [17], data["guard"]["meta"]
