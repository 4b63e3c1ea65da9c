"""A script that raises or exits non-zero is never reported as finished or healthy: the run keeps
its exit code, the exception's type and message, and the step it died in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from trainguard.cli import main
from trainguard.store import open_run


def linear_regression(steps: int, in_step: str = "", after: str = "") -> str:
    """A script that trains a linear regression for ``steps`` steps (SGD), running ``in_step`` (code
    indented by 4) at the end of each step and ``after`` (at the top level) after the loop."""
    return textwrap.dedent(f"""
        import os, signal, sys, torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(64, 4), torch.randn(64, 1)
        first = len(sys.argv) < 2 or not os.path.exists(sys.argv[1])
        for step in range({steps}):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    """) + textwrap.indent(textwrap.dedent(in_step), "    ") + textwrap.dedent(after)


TRAIN_THEN_RAISE = linear_regression(40, after='raise ValueError("the data loader ran dry")\n')

@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash")
    script = d / "train.py"
    script.write_text(TRAIN_THEN_RAISE)
    assert main(["run", "--monitor", "--every", "5", "--logdir", str(d / "run"), str(script)]) == 1
    return d / "run"


def test_the_run_keeps_the_exit_code_the_exception_and_the_step(crashed):
    with open_run(crashed) as run:
        assert run.status == "crashed"
        assert run.meta["exit_code"] == 1
        assert run.meta["error"] == "ValueError: the data loader ran dry"
        assert run.meta["crash_step"] == 40


def test_the_report_says_so_in_its_first_lines_and_never_healthy(crashed, capsys):
    capsys.readouterr()
    assert main(["report", str(crashed)]) == 0
    out = capsys.readouterr().out
    head = "\n".join(out.splitlines()[:3])
    assert "the script crashed at step 40: ValueError: the data loader ran dry" in head, out
    assert "healthy" not in out.lower()
    assert main(["report", str(crashed), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "crashed" and rep["crash"] == {
        "step": 40, "exit_code": 1, "error": "ValueError: the data loader ran dry",
        "text": "the script crashed at step 40: ValueError: the data loader ran dry"}
    assert "healthy" not in {f["kind"] for f in rep["findings"]}


def test_diagnose_and_the_ui_never_call_it_healthy(crashed, capsys):
    capsys.readouterr()
    assert main(["diagnose", str(crashed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] != "healthy"
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    with TestClient(create_app(crashed.parent)) as client:
        runs = client.get("/api/runs").json()["runs"]
        (rid,) = [r["id"] for r in runs]
        verdict = client.get(f"/api/runs/{rid}/findings").json()["verdict"]
    assert verdict["state"] != "healthy" and "crashed" in verdict["text"]


def test_a_non_zero_exit_is_kept(tmp_path, capsys):
    script = tmp_path / "exits.py"
    script.write_text("import sys, torch\ntorch.ones(2).exp()\nsys.exit(7)\n")
    assert main(["run", "--logdir", str(tmp_path / "run"), str(script)]) == 7
    with open_run(tmp_path / "run") as run:
        assert run.meta["exit_code"] == 7 and run.status == "exited"
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 0
    assert "the script exited with code 7" in "\n".join(capsys.readouterr().out.splitlines()[:3])


def test_a_sigterm_while_the_run_closes_waits_until_it_is_closed(tmp_path, monkeypatch):
    # torchrun's agent SIGTERMs every other rank once one failed: a rank whose script has just
    # ended is then closing its run, which must not be cut short (its exit code and crash would
    # be lost, and with them which rank ended first).
    import os
    import signal

    from trainguard.capture._recorder import Recorder

    stop = Recorder.stop

    def stop_under_sigterm(self, **meta):
        if self.active:
            os.kill(os.getpid(), signal.SIGTERM)
        return stop(self, **meta)

    monkeypatch.setattr(Recorder, "stop", stop_under_sigterm)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(3)\n")
    assert main(["run", "--logdir", str(tmp_path / "run"), str(script)]) == 3
    with open_run(tmp_path / "run") as run:
        assert (run.meta["exit_code"], run.meta["status"], run.meta["recording"]) == (3, "exited", False)
    script.write_text("pass\n")
    assert main(["run", "--overwrite", "--logdir", str(tmp_path / "run"), str(script)]) == 128 + signal.SIGTERM
    with open_run(tmp_path / "run") as run:
        assert run.meta["recording"] is False


# yandex-research/rtdl rtdl/modules.py's CategoricalFeatureTokenizer: one embedding table for all
# categorical features, each feature's indices shifted by an offset. A category equal to its
# feature's cardinality in the last feature runs off the table: torch says only "index out of
# range in self", from inside torch/nn/functional.py.
CATEGORY_OUT_OF_RANGE = textwrap.dedent("""
    import torch
    from torch import nn

    class CategoricalFeatureTokenizer(nn.Module):
        def __init__(self, cardinalities, d_token):
            super().__init__()
            self.register_buffer("category_offsets", torch.tensor([0] + cardinalities[:-1]).cumsum(0))
            self.embeddings = nn.Embedding(sum(cardinalities), d_token)

        def forward(self, x):
            return self.embeddings(x + self.category_offsets[None])

    torch.manual_seed(0)
    model = nn.Sequential(CategoricalFeatureTokenizer([3, 5], 4), nn.Flatten(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x_cat = torch.stack([torch.randint(0, 3, (32,)), torch.randint(0, 5, (32,))], 1)
    y = torch.randint(0, 2, (32,))
    for step in range(3):
        if step == 2:
            x_cat[7, 1] = 5  # a category the table has no row for
        loss = nn.functional.cross_entropy(model(x_cat), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def test_a_crash_inside_torch_says_where_and_in_which_module(tmp_path, capsys, monkeypatch):
    script = tmp_path / "tab.py"
    script.write_text(CATEGORY_OUT_OF_RANGE)
    assert main(["run", "--logdir", str(tmp_path / "run"), str(script)]) == 1
    with open_run(tmp_path / "run") as run:
        assert run.meta["error"] == "IndexError: index out of range in self"
        at = run.meta["crash_at"]
    # the innermost line of the user's code, not torch's F.embedding
    assert at["file"].endswith("tab.py") and at["line"] == 12, at
    assert "self.embeddings(" in at["code"], at
    assert at["module"] == "Embedding(8, 4)", at
    assert at["detail"] == "index 8 is out of range for an embedding with 8 rows (0 to 7)", at
    capsys.readouterr()
    from trainguard.cli import _render

    monkeypatch.setattr(_render.console, "width", 400)  # a long tmp path wraps at 80 columns, inside "tab.py"
    assert main(["report", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tab.py:12" in out and "Embedding(8, 4)" in out and "index 8 is out of range" in out, out


# cleanrl's ppo.py (vwxyzjn/cleanrl, cleanrl/ppo.py) with a minibatch of one sample: the advantage
# normalisation's std() is NaN, Adam writes it into the actor, and the next step's
# Categorical(logits=...) rejects the NaN logits with a ValueError of its own.
NAN_THEN_RAISE = textwrap.dedent("""
    import torch
    from torch.distributions.categorical import Categorical
    torch.distributions.Distribution.set_default_validate_args(True)  # torch's default; torch.compile turns it off
    torch.manual_seed(0)
    actor = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(actor.parameters(), lr=2.5e-4, eps=1e-5)
    obs, advantages = torch.randn(8, 4), torch.randn(8)
    for start in range(8):
        mb = slice(start, start + 1)
        probs = Categorical(logits=actor(obs[mb]))
        newlogprob = probs.log_prob(torch.zeros(1, dtype=torch.long))
        mb_advantages = advantages[mb]
        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
        loss = -(mb_advantages * newlogprob).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def test_a_crash_after_a_harmful_nan_points_at_its_origin(tmp_path, capsys):
    script = tmp_path / "ppo.py"
    script.write_text(NAN_THEN_RAISE)
    assert main(["run", "--logdir", str(tmp_path / "run"), str(script)]) == 1
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["crash"]["step"] == 1 and "ValueError: Expected parameter logits" in rep["crash"]["error"]
    (crash,) = [f for f in rep["findings"] if f["kind"] == "script_crashed"]
    # the ValueError is what the NaN made in step 0 did next: fixing "the error it raised" fixes nothing
    assert "first harmful NaN/Inf, in step 0" in crash["suggestion"], crash["suggestion"]
    assert "names the op and line that made it" in crash["suggestion"], crash["suggestion"]


# cleanrl's ppo_continuous_action.py (vwxyzjn/cleanrl) with its log-std driven far negative: exp
# underflows to 0 and Normal's argument check (on by default) raises before any NaN is made.
STD_COLLAPSED = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.distributions.normal import Normal
    torch.distributions.Distribution.set_default_validate_args(True)  # torch's default; torch.compile turns it off

    class Agent(nn.Module):
        def __init__(self):
            super().__init__()
            self.actor_mean = nn.Linear(3, 1)
            self.actor_logstd = nn.Parameter(torch.zeros(1, 1))

        def get_action(self, x):
            action_mean = self.actor_mean(x)
            action_std = torch.exp(self.actor_logstd.expand_as(action_mean))
            probs = Normal(action_mean, action_std)
            return probs.sample()

    agent = Agent()
    obs = torch.randn(4, 3)
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                agent.actor_logstd.fill_(-120.0)  # what a runaway entropy term does over many updates
        loss = agent.get_action(obs).sum() + agent.actor_logstd.sum()
        loss.backward()
""")


def test_a_distribution_argument_check_says_which_values_broke_it_and_why(tmp_path):
    script = tmp_path / "ppo_continuous_action.py"
    script.write_text(STD_COLLAPSED)
    assert main(["run", "--logdir", str(tmp_path / "run"), str(script)]) == 1
    with open_run(tmp_path / "run") as run:
        assert run.meta["error"].startswith("ValueError: Expected parameter scale")
        at = run.meta["crash_at"]
    assert at["line"] == 16 and "Normal(action_mean, action_std)" in at["code"], at
    # torch prints the values; which of them broke the constraint, and what makes a scale 0, it does not say
    assert "Normal's scale holds 4 zeros (of 4 values)" in at["detail"], at
    assert "log_std.clamp(" in at["detail"], at


SIGTERM_MID_TRAINING = linear_regression(1000, in_step="""
    if step == 40:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts the job
""")

@pytest.mark.parametrize("command", [["monitor"], ["run", "--monitor"]])
def test_a_preempted_monitored_script_keeps_its_diagnosis_and_says_how_it_ended(tmp_path, command):
    # pytorch/examples reinforcement_learning/reinforce.py under `trainguard monitor`, stopped by
    # `timeout` (SIGTERM): the monitor's process died at once, its findings were never written and
    # the run said "running" forever.
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SIGTERM_MID_TRAINING)
    out = subprocess.run([sys.executable, "-m", "trainguard", *command, "--every", "5", "--logdir",
                          str(tmp_path / "run"), str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    with open_run(tmp_path / "run") as run:
        assert run.status == "interrupted" and run.meta["exit_code"] == 128 + signal.SIGTERM
        assert run.meta["signal"] == "SIGTERM" and run.meta["stopped_step"] == 41
        findings = {f["kind"]: f for f in run.findings(source="monitor")}
        # a preemption is no crash: the steps before it are judged, and the stop is said
        assert "script_crashed" not in findings and "healthy" in findings, findings
        stopped = findings["script_interrupted"]
        assert stopped["severity"] == "info" and "SIGTERM" in stopped["title"] and "step 41" in stopped["title"]
    if command == ["monitor"]:  # `run --monitor` points at `trainguard report` instead
        assert "stopped by SIGTERM" in out.stdout, out.stdout


def test_a_script_that_exits_143_itself_is_not_called_preempted():
    from trainguard.capture._ending import ending

    assert ending(SystemExit(143)) == {"status": "exited", "exit_code": 143}
    assert ending(KeyboardInterrupt())["status"] == "interrupted"


def test_colour_codes_in_an_error_are_not_stored():
    # Lightning Fabric prints its errors in colour (found by the fabric trial): the run stored
    # "RuntimeError: \x1b[1;31mboom\x1b[0m", which report and the UI showed as escape garbage.
    from trainguard.capture._ending import ending

    assert ending(RuntimeError("\x1b[1;31mboom\x1b[0m at \x1b]8;;file:///x.py\x1b\\x.py\x1b]8;;\x1b\\"), step=3) == {
        "status": "crashed", "error": "RuntimeError: boom at x.py", "crash_step": 3}
    assert ending("ValueError: \x1b[33mbad\x1b[0m", step=0)["error"] == "ValueError: bad"


PREEMPTED_ONCE = linear_regression(30, in_step="""
    if first and step == 19:
        open(sys.argv[1], "w").close()
        os.kill(os.getpid(), signal.SIGTERM)  # preempted; the scheduler runs the command again
""")

@pytest.mark.parametrize("command", [["run", "--monitor"], ["monitor"]])
def test_the_same_command_run_again_with_resume_continues_the_run(tmp_path, command):
    # A requeued job runs its command line again: without --resume the second process was refused
    # ("logdir already holds a run") and the job failed at its restart.
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(PREEMPTED_ONCE)
    cmd = [sys.executable, "-m", "trainguard", *command, "--every", "5", "--resume", "--logdir", str(tmp_path / "run"),
           str(script), str(tmp_path / "preempted")]
    env = {**os.environ, "COLUMNS": "200"}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stderr
    with open_run(tmp_path / "run") as run:
        assert run.status == "finished"
        steps = [s for s, _ in run.scalars("loss")["loss"]]
        assert steps == list(range(20 + 30)), steps  # the second process's steps go after the first's
        if command[0] == "run":
            assert run.count() > 0 and len({e["seq"] for e in run.executions(0, run.count())}) == run.count()
            # both processes' ops are counted, those that ran and those that matched (no filter here):
            # the header said "66,902 ran, 18,556 matched" on a resumed word_language_model run
            assert run.meta["recorded"] == run.meta["executions"], run.meta
    bad = subprocess.run([*cmd[:3 + len(command)], "--overwrite", *cmd[3 + len(command):]], capture_output=True,
                         text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "choose one of --resume and --overwrite" in bad.stderr, bad.stderr


GLOO_PEER_CLOSED = linear_regression(3, after='raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/'
                                             'transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7604")\n')


def test_an_error_that_reads_like_rich_markup_is_shown_as_is(tmp_path, capsys):
    # pytorch/examples' ddp-tutorial-series/multigpu_torchrun.py on two gloo ranks, one rank killed:
    # the other's all-reduce raises gloo's "[/__w/.../pair.cc:553] Connection closed by peer", and
    # `trainguard report` died in rich's markup parser ("closing tag ... doesn't match any open tag").
    script = tmp_path / "train.py"
    script.write_text(GLOO_PEER_CLOSED)
    assert main(["run", "--logdir", str(tmp_path / "run"), str(script)]) == 1
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert out.count("pair.cc:553] Connection closed by peer [127.0.0.1]:7604") >= 2, out  # first line, status


CHECKPOINTED = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    import trainguard as tg
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(80, 4), torch.randn(80, 1))
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_size=4))
    loop = tg.CheckpointManager(sys.argv[1], every_steps=4).resume(state, total_steps=20)
    for step, (x, y) in loop.batches():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 14 and not os.path.exists(sys.argv[2]):
            open(sys.argv[2], "w").close()
            time.sleep(1.5)  # the writer commits what the monitor shipped (steps 0-9, at step 10)
            os.kill(os.getpid(), signal.SIGKILL)
''')


def _checkpointed(tmp_path, *command: str) -> list[str]:
    """The command line that runs CHECKPOINTED under ``trainguard COMMAND --resume``: the first
    run kills itself after step 14, the same command again finishes from its checkpoint."""
    script = tmp_path / "train.py"
    script.write_text(CHECKPOINTED)
    return [sys.executable, "-m", "trainguard", *command, "--resume", "--logdir", str(tmp_path / "run"),
            str(script), str(tmp_path / "ckpt"), str(tmp_path / "killed")]


def _exits(cmd: list[str], code: int) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == code, done.stderr


def test_a_run_resumed_from_trainguards_checkpoint_numbers_its_steps_as_the_checkpoint_does(tmp_path):
    # open_clip killed with kill -9 mid-epoch and run again under `trainguard run --monitor --resume`:
    # the first process had stored steps 0-9, its checkpoint held step 15, and the second process
    # numbered the steps it ran from 15 on 10, 11, ...: every later finding's step was off by 5.
    cmd = _checkpointed(tmp_path, "monitor", "--every", "5")
    _exits(cmd, -9)
    _exits(cmd, 0)
    with open_run(tmp_path / "run") as run:
        steps = [s for s, _ in run.scalars("loss")["loss"]]
    # the checkpoint of step 12 (saved every 4) is where the second process went on from
    assert steps[-8:] == list(range(12, 20)), steps
    assert steps[:-8] == list(range(len(steps) - 8)) and len(steps) - 8 >= 10, steps


def test_a_fake_quant_observer_holding_nan_says_so_and_not_to_turn_off_distribution_checks():
    # Eager-mode QAT as PyTorch's QAT tutorial writes it (fuse_modules_qat, get_default_qat_qconfig("x86"),
    # prepare_qat) on 28x28 samples, one holding a NaN, under `trainguard run --guard`: the NaN made the
    # weights NaN in step 3 and the weight observer took them into its min_val/max_val, and step 4's forward raised "`zero_point` must
    # be between `quant_min` and `quant_max`" before the guard read step 3. The fix said to build "a
    # torch.distributions policy with `validate_args=False`", which this script has none of.
    import torch
    import torch.ao.quantization as tq

    from trainguard.analysis._outcome import outcome_finding
    from trainguard.capture._ending import crash_site

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.conv, self.dequant = tq.QuantStub(), torch.nn.Conv2d(1, 2, 3), tq.DeQuantStub()

        def forward(self, x):
            return self.dequant(self.conv(self.quant(x)))

    model = Net().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(model, inplace=True)
    x = torch.randn(2, 1, 28, 28)
    x[1, 0, 3, 4] = float("nan")
    model(x).sum().backward()
    with torch.no_grad():  # an SGD step on the NaN gradients: the weight observer takes the NaN next
        for p in model.parameters():
            p -= 0.1 * p.grad
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 1, 28, 28))
    at = crash_site(info.value)
    assert at is not None and "observer" in at["detail"] and "nan" in at["detail"], at
    meta = {"status": "crashed", "error": "RuntimeError: `zero_point` must be between `quant_min` and `quant_max`.",
            "crash_step": 4, "crash_at": at, "exit_code": 1,
            "guard": {"fault_before_crash": {"step": 3, "kinds": ["nonfinite_loss"], "loss": "nan"}}}
    f = outcome_finding(meta)
    assert "step 3 ended with loss nan" in f.suggestion and "validate_args" not in f.suggestion, f.suggestion


def test_steps_a_killed_process_stored_after_its_checkpoint_are_replaced_not_stored_twice(tmp_path):
    # The checkpointed script above, monitored at every step: the killed process had stored steps
    # 0-13 when it died, its newest checkpoint held step 12, and the resumed process ran 12-19
    # again, so steps 12 and 13 had two loss rows and two rows of every layer statistic (the
    # curves doubled back). A restore now drops what the run holds from the restored step on, as
    # TensorBoard's purge_step does, and the resumed process's rows replace them.
    from collections import Counter

    cmd = _checkpointed(tmp_path, "monitor", "--every", "1")
    _exits(cmd, -9)
    with open_run(tmp_path / "run") as run:
        stored = [s for s, _ in run.scalars("loss")["loss"]]
    assert stored[-2:] == [12, 13], stored  # the first process had written past its checkpoint
    _exits(cmd, 0)
    with open_run(tmp_path / "run") as run:
        steps = [s for s, _ in run.scalars("loss")["loss"]]
        rows = Counter((r["step"], r["layer"], r["kind"], r["stat"]) for r in run.layer_stats())
    assert steps == list(range(20)), steps
    twice = [k for k, n in rows.items() if n > 1]
    assert not twice, twice[:5]
    assert {k[0] for k in rows} >= {12, 13, 19}


SLOW_KILLED = textwrap.dedent('''
    import os, signal, time
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(20):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.6)  # a slow step (a big model's)
        if step == 7:
            os.kill(os.getpid(), signal.SIGKILL)
''')


def test_a_killed_monitors_losses_between_recording_steps_are_in_the_run(tmp_path):
    # PyG's GraphSAGE under `trainguard run --monitor --resume`, every=10, killed at step 9: the run
    # held no loss at all (the monitor shipped its per-step scalars at recording steps only), and
    # the resumed process restarted from its step-8 checkpoint, so steps 0-7 were never stored.
    # Buffered steps now go out every few seconds too: a kill loses seconds of them, not steps.
    script = tmp_path / "train.py"
    script.write_text(SLOW_KILLED)
    _exits([sys.executable, "-m", "trainguard", "monitor", "--every", "10", "--logdir", str(tmp_path / "run"),
            str(script)], -9)
    with open_run(tmp_path / "run") as run:
        steps = [s for s, _ in run.scalars("loss").get("loss", [])]
    assert steps[:3] == [0, 1, 2] and steps == list(range(len(steps))), steps


def test_a_resumed_recording_counts_the_killed_processs_ops_as_recorded(tmp_path):
    # PyG's GraphSAGE under `trainguard run --resume` after kill -9: the report read "ops seen 3,995
    # ran, 2,627 matched the filters" with no filter set: the next number counted both processes'
    # ops, the recorded count only the second's (the killed one never wrote its own).
    cmd = _checkpointed(tmp_path, "run")
    _exits(cmd, -9)
    _exits(cmd, 0)
    with open_run(tmp_path / "run") as run:
        meta = run.meta
        stored = run.count()
    assert meta["recorded"] == meta["executions"] == stored, (meta["recorded"], meta["executions"], stored)


def test_a_crash_inside_one_of_several_alike_tables_names_the_table_by_its_path():
    # facebookresearch/dlrm dlrm_s_pytorch.py's apply_emb: a ModuleList of nn.EmbeddingBag(mode="sum",
    # sparse=True) tables of the same shape (26 in the Criteo set), each looked up by its own feature;
    # a hashed index past the end of the second. torch names neither the table nor the feature, and
    # the repr EmbeddingBag(10, 4, mode='sum') fits every table alike: the path does not.
    import torch
    from torch import nn

    from trainguard.analysis._outcome import outcome_finding
    from trainguard.capture._ending import crash_site

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb_l = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum", sparse=True) for _ in range(3))
            self.top_l = nn.Linear(12, 1)

        def apply_emb(self, lS_o, lS_i):
            return [e(i, o) for e, i, o in zip(self.emb_l, lS_i, lS_o)]

        def forward(self, lS_o, lS_i):
            return self.top_l(torch.cat(self.apply_emb(lS_o, lS_i), dim=1))

    model = DLRM()
    offsets = [torch.arange(0, 8, 2)] * 3
    indices = [torch.randint(0, 10, (8,)) for _ in range(3)]
    indices[1][5] = 17  # a hashed index past the table's 10 rows
    with pytest.raises(RuntimeError) as info:
        model(offsets, indices)
    at = crash_site(info.value)
    assert at is not None and at["module_path"] == "emb_l.1", at
    meta = {"status": "crashed", "error": f"RuntimeError: {info.value}", "crash_step": 0, "crash_at": at,
            "exit_code": 1}
    f = outcome_finding(meta)
    assert "inside emb_l.1 (EmbeddingBag(10, 4, mode='sum'))" in f.title, f.title
    assert f.evidence["module_path"] == "emb_l.1", f.evidence


@pytest.mark.parametrize("classes, target_value, loss, monitored",
                         [(3, 255, "ce", False), (2, 255, "nll", False), (2, 255, "ce", True)])
def test_a_class_target_out_of_range_names_the_values_and_the_mask_fix(tmp_path, classes, target_value, loss,
                                                                       monitored):
    # milesial/Pytorch-UNet train.py (@21d7850) on masks stored as 0/255 PNGs: criterion(masks_pred,
    # true_masks) raises "Target 255 is out of bounds." and the finding said only "fix the error it raised"
    import torch

    from trainguard.analysis._outcome import outcome_finding
    from trainguard.capture._ending import crash_site

    criterion = torch.nn.CrossEntropyLoss() if loss == "ce" else torch.nn.NLLLoss()
    masks_pred = torch.randn(2, classes, 8, 8)
    true_masks = torch.zeros(2, 8, 8, dtype=torch.long)
    true_masks[:, 2:5, 2:5] = target_value
    import contextlib

    import trainguard as tg

    # under `trainguard run --monitor` the monitor wraps F.cross_entropy while it watches
    with tg.Monitor(None, tmp_path / "mon") if monitored else contextlib.nullcontext():
        with pytest.raises(IndexError) as info:
            criterion(masks_pred, true_masks)
        at = crash_site(info.value)
    assert at is not None and "detail" in at, at
    assert f"{target_value}" in at["detail"] and f"{classes} classes" in at["detail"], at
    assert "/ 255" in at["detail"], at
    f = outcome_finding({"status": "crashed", "error": str(info.value), "crash_step": 0, "crash_at": at,
                         "exit_code": 1})
    assert at["detail"] in f.suggestion


def test_a_bare_assert_in_the_users_code_says_its_line_and_module(tmp_path):
    # facebookresearch/detr @ 29901c5 util/box_ops.py's generalized_box_iou, called by the matcher
    # (models/matcher.py) inside SetCriterion (models/detr.py), on a target box whose x1 < x0 (a
    # crop gone wrong): `assert (boxes2[:, 2:] >= boxes2[:, :2]).all()` raises an AssertionError
    # with no message. The user's own line raised it, so crash_site kept nothing, and the report and
    # the UI said only "The script crashed at step 60: AssertionError", naming no line.
    import importlib.util

    import torch
    from torch import nn

    from trainguard.analysis._outcome import outcome_finding
    from trainguard.capture._ending import crash_site

    # a module of its own: pytest rewrites the asserts of test files and gives them a message
    (tmp_path / "box_ops.py").write_text(textwrap.dedent('''
        def generalized_box_iou(boxes1, boxes2):
            assert (boxes1[:, 2:] >= boxes1[:, :2]).all()
            assert (boxes2[:, 2:] >= boxes2[:, :2]).all()
            return boxes1.new_zeros(len(boxes1), len(boxes2))
    '''))
    spec = importlib.util.spec_from_file_location("box_ops", tmp_path / "box_ops.py")
    box_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(box_ops)

    class HungarianMatcher(nn.Module):
        def forward(self, out_bbox, tgt_bbox):
            return -box_ops.generalized_box_iou(out_bbox, tgt_bbox)

    class SetCriterion(nn.Module):
        def __init__(self):
            super().__init__()
            self.matcher = HungarianMatcher()

        def forward(self, out_bbox, tgt_bbox):
            return self.matcher(out_bbox, tgt_bbox).sum()

    with pytest.raises(AssertionError) as info:
        SetCriterion()(torch.tensor([[0.1, 0.1, 0.5, 0.5]]), torch.tensor([[0.4, 0.2, 0.3, 0.6]]))
    at = crash_site(info.value)
    assert at is not None and at["line"] == 4 and at["module_path"] == "matcher", at
    meta = {"status": "crashed", "error": "AssertionError", "crash_step": 60, "crash_at": at, "exit_code": 1}
    f = outcome_finding(meta)
    assert "box_ops.py:4)" in f.title and "inside matcher" in f.title, f.title
    assert "called from" not in f.title, f.title
    assert f.evidence["at"].endswith(":4: assert (boxes2[:, 2:] >= boxes2[:, :2]).all()"), f.evidence
