"""TrainguardCallback for Lightning, and the same script unmodified under ``trainguard run --monitor``:
the framework's steps (also resumed), gradients at the right step, phases, the loss it logs, ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import trainguard  # noqa: E402
from trainguard.cli import main as cli  # noqa: E402

SCRIPT = Path(__file__).with_name("lit_mlp.py")
LOG_LINE = next(i for i, t in enumerate(SCRIPT.read_text().splitlines(), 1) if "# LOG LINE" in t)


def script_module():
    spec = importlib.util.spec_from_file_location("lit_mlp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def with_callback(logdir, *args):
    return script_module().main(["--callback", str(logdir), *args])


def unmodified(logdir, *args):
    assert cli(["run", "--monitor", "--every", "5", "--logdir", str(logdir), str(SCRIPT), *args]) == 0


def framework_logs(path) -> tuple[dict[int, float], dict[int, float]]:
    data = json.loads(Path(path).read_text())
    norms = {int(k): v for k, v in data["norms"].items()}
    losses = {int(k): sum(v) / len(v) for k, v in data["losses"].items()}  # Lightning averages micro-batches
    return norms, losses


@pytest.mark.parametrize("how", ["callback", "unmodified"])
def test_planted_log_zero_is_found_at_its_line_step_and_phase(tmp_path, how):
    logdir, logs = tmp_path / "run", tmp_path / "logs.json"
    args = ["--steps", "30", "--plant", "20", "--norms", str(logs)]
    if how == "callback":
        with_callback(logdir, "--record", *args)
    else:
        unmodified(logdir, *args)
    run = trainguard.open(logdir)
    first = run.first_nonfinite()
    assert first["op"] == "aten.log" and first["step"] == 20 and first["phase"] == "forward"
    assert run.user_frame(first["stack_id"])["lineno"] == LOG_LINE
    finding = next(f for f in run.findings() if f["kind"] == "nonfinite_loss")
    assert finding["evidence"]["first_step"] == 20
    assert finding["evidence"]["origin"]["line"] == LOG_LINE
    # The gradient norm per step is Lightning's own grad_norm, at the same step (not one late).
    norms, losses = framework_logs(logs)
    got = dict(run.scalars("grad_norm")["grad_norm"])
    assert sorted(got) == list(range(30))
    assert [got[s] for s in range(20)] == pytest.approx([norms[s] for s in range(20)], rel=1e-5)
    loss = dict(run.scalars("loss")["loss"])
    assert [loss[s] for s in range(20)] == pytest.approx([losses[s] for s in range(20)], rel=1e-6)
    # training_step runs inside optimizer.step(closure): its ops are forward and backward (the
    # circular buffer holds the last steps).
    last = run.executions(0, run.count(), step=29)
    assert {e["phase"] for e in last if e["op"] in ("aten.log", "aten._softmax", "aten.addmm")} == {"forward"}
    assert {e["op"] for e in last if e["phase"] == "optimizer"} == {"aten.add_.Tensor"}  # SGD's update


@pytest.mark.parametrize("how", ["callback", "unmodified"])
def test_accumulated_batches_make_one_step_with_lightnings_loss_and_norm(tmp_path, how):
    logdir, logs = tmp_path / "run", tmp_path / "logs.json"
    args = ["--steps", "8", "--accumulate", "2", "--norms", str(logs)]
    (with_callback if how == "callback" else unmodified)(logdir, *args)
    run = trainguard.open(logdir)
    norms, losses = framework_logs(logs)
    got = dict(run.scalars("grad_norm")["grad_norm"])
    assert sorted(got) == list(range(8))
    assert [got[s] for s in range(8)] == pytest.approx([norms[s] for s in range(8)], rel=1e-5)
    loss = dict(run.scalars("loss")["loss"])
    assert [loss[s] for s in range(8)] == pytest.approx([losses[s] for s in range(8)], rel=1e-6)


def test_resumed_from_its_own_checkpoint_the_steps_continue(tmp_path):
    logdir, ckpt = tmp_path / "run", tmp_path / "half.ckpt"
    with_callback(logdir, "--steps", "12", "--ckpt-out", str(ckpt))
    trainer = with_callback(logdir, "--steps", "24", "--ckpt-in", str(ckpt))
    assert trainer.global_step == 24
    run = trainguard.open(logdir)
    steps = [s for s, _ in run.scalars("loss")["loss"]]
    assert steps == list(range(24))  # one run, steps 0..23, none twice
    assert sorted({r["step"] for r in run.layer_stats()}) == [0, 5, 10, 15, 20]
    assert run.meta["monitor"]["weights_initial"] is True  # learnt at step 0 and kept on resume
    assert run.meta["monitor"]["status"] == "finished"


def test_resumed_unmodified_script_counts_from_the_checkpoint(tmp_path):
    ckpt = tmp_path / "half.ckpt"
    unmodified(tmp_path / "first", "--steps", "12", "--ckpt-out", str(ckpt))
    # --touch: the script calls its model before fit, so the monitor attaches outside the Trainer
    # and finds it at the first optimizer step instead.
    unmodified(tmp_path / "second", "--steps", "24", "--ckpt-in", str(ckpt), "--touch")
    run = trainguard.open(tmp_path / "second")
    assert [s for s, _ in run.scalars("loss")["loss"]] == list(range(12, 24))
    execs = run.executions(0, run.count())
    # The model call before fit ran before any step (step 0); the recorder keeps it now because it
    # pins the ops before the first losses (issue 15's loss chains). No op of training is counted from 0.
    first_trained = min(e["seq"] for e in execs if e["step"] >= 12)
    assert {e["step"] for e in execs if e["seq"] >= first_trained} <= set(range(12, 25))
    assert all(e["step"] == 0 for e in execs if e["seq"] < first_trained)
    assert run.meta["monitor"]["weights_initial"] is False  # step 12 is not initialisation


def test_bf16_mixed_precision(tmp_path):
    logs = tmp_path / "logs.json"
    with_callback(tmp_path / "run", "--steps", "6", "--precision", "bf16-mixed", "--norms", str(logs))
    _, losses = framework_logs(logs)
    loss = dict(trainguard.open(tmp_path / "run").scalars("loss")["loss"])
    assert [loss[s] for s in range(6)] == pytest.approx([losses[s] for s in range(6)], rel=1e-6)


def test_ddp_ranks_write_their_own_directories(tmp_path):
    # Lightning's ddp strategy starts rank 1 by running the script again; each rank's callback
    # writes logdir/rank-K with Lightning's global_rank.
    logdir = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--callback", str(logdir), "--steps", "6", "--devices", "2"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in logdir.iterdir() if p.is_dir()) == ["rank-0", "rank-1"]
    for k in (0, 1):
        run = trainguard.open(logdir / f"rank-{k}")
        assert [s for s, _ in run.scalars("loss")["loss"]] == list(range(6))


def test_options_are_checked(tmp_path):
    from trainguard import TrainguardError
    from trainguard.integrations.lightning import TrainguardCallback

    with pytest.raises(TrainguardError, match="every must be an int >= 1, got 0"):
        TrainguardCallback(tmp_path, every=0)
    with pytest.raises(TrainguardError, match="mode must be one of"):
        TrainguardCallback(tmp_path, mode="everything")
    with pytest.raises(TrainguardError, match="guard= is not supported inside a framework's own training loop"):
        TrainguardCallback(tmp_path, guard=object())


def test_check_numerics_stops_at_the_log_and_marks_the_run_crashed(tmp_path):
    from trainguard import NonFiniteError
    from trainguard.integrations.lightning import TrainguardCallback

    mod = script_module()
    import lightning as L

    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[TrainguardCallback(tmp_path / "run", check_numerics=True, every=5)])
    with pytest.raises(NonFiniteError, match=rf"aten.log produced -inf in step 3, forward pass(?s:.*)lit_mlp.py:{LOG_LINE}"):
        trainer.fit(mod.MLP(plant_at=3), mod.loader())
    run = trainguard.open(tmp_path / "run")
    assert (run.status, run.meta["crash_step"]) == ("crashed", 3)
    assert run.meta["error"].startswith("NonFiniteError: aten.log produced -inf in step 3")
    assert [f["kind"] for f in run.findings()][0] == "script_crashed"
