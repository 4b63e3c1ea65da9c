"""End to end through the command line: run, report, demo, and every bad input."""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch

import trainguard as tg
from trainguard.cli import main
from trainguard.examples import nan_digits

EXAMPLE = nan_digits.__file__


def line_in(text: str) -> int:
    return next(i for i, t in enumerate(open(EXAMPLE).read().splitlines(), 1) if text in t)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "digits"
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--logdir", str(d), "--buffer", "-1",
                           EXAMPLE, "--steps", "6"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "loss        nan" in proc.stdout  # the script's own output is untouched
    assert "trainguard: recorded" in proc.stderr
    return d


def test_report_names_the_log_and_its_softmax_input(digits_run, capsys):
    assert main(["report", str(digits_run)]) == 0
    out = capsys.readouterr().out
    assert "First harmful value: aten.log" in out
    assert f"nan_digits.py:{line_in('torch.log(probs)')}" in out
    assert "aten._softmax output" in out and "zeros" in out
    assert "torch.log(probs)" in out  # the source line itself is shown


def test_report_json(digits_run, capsys):
    assert main(["report", str(digits_run), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    link = rep["origin"]["origin"]
    assert link["op"] == "aten.log" and link["line"] == line_in("torch.log(probs)") and link["health"] == ["-inf"]
    assert link["step"] == 2
    assert link["inputs"][0]["producer_op"] == "aten._softmax"
    assert link["inputs"][0]["line"] == line_in("torch.softmax(logits")
    assert link["inputs"][0]["summary"]["zero"] > 0
    assert rep["alerts"]["total"] > 0 and rep["alerts"]["by_op"][0]["op"] == "aten.log"


def test_fixed_script_gives_a_clean_report(tmp_path, capsys):
    d = tmp_path / "fixed"
    assert main(["run", "--logdir", str(d), EXAMPLE, "--fixed", "--steps", "6"]) == 0
    capsys.readouterr()
    assert main(["report", str(d)]) == 0
    out = capsys.readouterr().out
    assert "No harmful NaN or Inf." in out and "origin" not in out


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def test_script_exception_keeps_traceback_and_exit_code(tmp_path, capsys):
    script = write(tmp_path, "boom.py", """
        import torch
        torch.ones(2).exp()
        raise ValueError("the script's own error")
    """)
    assert main(["run", "--logdir", str(tmp_path / "r"), script]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: the script's own error" in err and "boom.py" in err
    from trainguard.store import open_run

    run = open_run(tmp_path / "r")
    assert run.status == "crashed" and run.count(op="exp") == 1


def test_script_exit_code_and_argv(tmp_path, capsys):
    script = write(tmp_path, "exits.py", """
        import sys
        print("args", sys.argv[1:])
        sys.exit(7)
    """)
    assert main(["run", "--logdir", str(tmp_path / "r"), script, "a", "--b"]) == 7
    assert "args ['a', '--b']" in capsys.readouterr().out



@pytest.mark.parametrize("command", ["run", "monitor"])
def test_a_scripts_option_that_abbreviates_several_of_trainguards_is_the_scripts(tmp_path, capsys, command):
    # A DP-SGD script of opacus' examples/mnist.py kind with its own `--n 512` (samples) or
    # `--max 3`: `trainguard run --logdir D train.py --n 512` stopped with "ambiguous option: --n
    # could match --no-gradcheck, --nproc-per-node, --nnodes, --node-rank", though everything after
    # the script's name is the script's (a prefix of one option only was passed on already).
    script = write(tmp_path, "exits.py", """
        import sys
        print("args", sys.argv[1:])
        sys.exit(7)
    """)
    argv = [script, "--n", "512", "--max", "3", "--no", "--res", "1"]
    assert main([command, "--logdir", str(tmp_path / "r"), *argv]) == 7
    assert "args ['--n', '512', '--max', '3', '--no', '--res', '1']" in capsys.readouterr().out

def test_module_gets_the_options_after_its_name(tmp_path, capsys, monkeypatch):
    # As `python -m`: everything after the module's name is the module's. Found on karpathy/nanochat,
    # whose scripts run as modules: `trainguard run -m scripts.base_train --depth=2` stopped with
    # "unrecognized arguments: --depth=2" (only `-m scripts.base_train -- --depth=2` worked).
    write(tmp_path, "argv_mod.py", """
        import sys
        print("args", sys.argv[1:])
        sys.exit(7)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    logdir = str(tmp_path / "r")
    assert main(["run", "--logdir", logdir, "-m", "argv_mod", "--depth=2", "data", "--lr", "0.1", "-v"]) == 7
    assert "args ['--depth=2', 'data', '--lr', '0.1', '-v']" in capsys.readouterr().out
    # `--` after the module's name still ends trainguard's options, as it did
    assert main(["run", "--overwrite", "--logdir", logdir, "-m", "argv_mod", "--", "--depth=2"]) == 7
    assert "args ['--depth=2']" in capsys.readouterr().out


def test_run_check_numerics(tmp_path, capsys):
    assert main(["run", "--check-numerics", "--logdir", str(tmp_path / "r"), EXAMPLE, "--steps", "6"]) == 3
    err = capsys.readouterr().err
    assert "NonFiniteError: aten.log produced -inf in step 2, forward pass" in err
    assert "which became NaN in aten.mul.Tensor" in err
    assert f"nan_digits.py:{line_in('torch.log(probs)')}" in err
    assert "input 0 = softmax output from" in err
    # why, and the fix, from the run's origin (what the report says), before the user opens it
    assert "  why: log of an input with" in err and "zeros -> -inf" in err
    assert "  fix: clamp the input before the log" in err
    # the op that raised, its inputs and its chain are in the run: the report shows them
    assert main(["report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "No harmful NaN or Inf" not in out
    assert "First harmful value: aten.log" in out and "became NaN in aten.mul.Tensor" in out
    assert "check_numerics stopped the run at #" in out and "aten.mul.Tensor" in out
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["origin"]["origin"]["op"] == "aten.log" and rep["origin"]["chain"][0]["op"] == "aten.mul.Tensor"
    assert rep["origin"]["origin"]["line"] == line_in("torch.log(probs)") and rep["origin"]["origin"]["step"] == 2
    assert rep["meta"]["check_numerics_stop"]["op"] == "aten.mul.Tensor"


def test_run_check_numerics_overwrites_a_run_when_told(tmp_path, capsys):
    script = tmp_path / "ok.py"
    script.write_text("import torch\ntorch.ones(2).log().sum().item()\n")
    logdir = str(tmp_path / "r")
    assert main(["run", "--logdir", logdir, str(script)]) == 0
    assert main(["run", "--check-numerics", "--logdir", logdir, str(script)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["run", "--check-numerics", "--overwrite", "--logdir", logdir, str(script)]) == 0


def test_demo(tmp_path, capsys):
    assert main(["demo", "--logdir", str(tmp_path / "d"), "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "First harmful value: aten.log" in out and "trainguard ui" in out


def test_the_demos_findings_are_what_its_script_gets_wrong(tmp_path, capsys):
    # The README's main job. After the codebook_collapse rule came in, the demo's weights gone NaN
    # read as "Codebook collapse: fc1's outputs take 1 distinct value(s)": a false finding in the
    # first thing a user runs. nan_digits.py takes the log of a softmax that underflows (the NaN),
    # at a learning rate of 0.1, on raw 0-16 pixel values; nothing else is wrong with it.
    assert main(["demo", "--logdir", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    with tg.open(tmp_path / "d") as run:
        kinds = sorted({f["kind"] for f in run.findings()})
    assert kinds == ["inputs_not_normalized", "lr_too_high", "nonfinite_loss"], kinds


def corrupt(path):
    db = path / "run.sqlite"
    db.write_bytes(db.read_bytes()[:2000])


def newer(path):
    con = sqlite3.connect(path / "run.sqlite")
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.commit()
    con.close()


@pytest.mark.parametrize("case", ["missing", "empty", "other", "truncated", "newer"])
def test_report_bad_inputs_exit_2_in_one_line(tmp_path, case):
    target = tmp_path / "x"
    if case != "missing":
        target.mkdir()
    if case == "other":
        (target / "README").write_text("not a run")
    if case in ("truncated", "newer"):
        assert main(["run", "--logdir", str(target), write(tmp_path, "s.py", "import torch\ntorch.ones(3).exp()\n")]) == 0
        (corrupt if case == "truncated" else newer)(target)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "report", str(target)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["run", "nope.py"], "no such script: 'nope.py'"),
    (["run", "--buffer", "-5", "x.py"], "buffer must be -1"),
    (["run", "--ops", "aten.(", "x.py"], "ops must be a valid regular expression"),
    (["run"], "give a script to run"),
])
def test_run_bad_arguments(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("pass\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_version_and_help():
    proc = subprocess.run([sys.executable, "-m", "trainguard", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("trainguard ")
    script = os.path.join(os.path.dirname(sys.executable), "trainguard")  # the console script
    proc = subprocess.run([script, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for cmd in ("run", "report", "demo"):
        assert cmd in proc.stdout


def test_the_scripts_objects_outlive_the_closing_of_its_run(tmp_path, capsys):
    # Found on accelerate's training loop (examples/nlp_example.py's shape, module-level) on two gloo
    # ranks: freeing the script's DDP model frees its gloo process group, whose destructor joins
    # gloo's worker thread with the GIL held; when that thread still had the last all-gather to let
    # go of (it takes the GIL to drop its tensors), the rank hung before its run was closed, 2 runs in 7.
    # Plain python frees them at exit; `trainguard run` dropped them the moment the script returned.
    script = write(tmp_path, "holds.py", """
        import sys
        import torch

        class Group:  # stands for the process group a DDP model holds until it is freed
            def __del__(self):
                print("group freed", file=sys.stderr)

        model = torch.nn.Linear(2, 1)
        model.group = Group()
        model(torch.ones(3, 2)).sum().backward()
    """)
    assert main(["run", "--monitor", "--logdir", str(tmp_path / "r"), script]) == 0
    gc.collect()  # the script's class and its module dict hold each other
    err = capsys.readouterr().err
    assert "group freed" in err
    assert err.index("trainguard: recorded") < err.index("group freed")


def test_report_shows_a_parameter_input_of_the_origin_by_name(tmp_path, capsys):
    # open_clip's logit_scale.exp() overflowing (src/open_clip/model.py): the origin's input is the
    # parameter, shown as "input 0: : param logit_scale".
    import torch

    import trainguard as tg

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logit_scale = torch.nn.Parameter(torch.tensor(100.0))

        def forward(self):
            return self.logit_scale.exp()

    with tg.record(tmp_path / "r", buffer=-1):
        Scale()().item()
    assert main(["report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "input 0: param logit_scale" in out, out


def test_a_logdir_holding_a_run_is_refused_with_the_flag_that_replaces_it(tmp_path, capsys):
    # A huggingface/trl script (trl/scripts/dpo.py) killed and resumed with --resume_from_checkpoint
    # under the same `trainguard run --monitor --logdir D` command: the refusal told the command-line
    # user to "pass overwrite=True", which is the Python API's keyword.
    script = tmp_path / "ok.py"
    script.write_text("import torch\ntorch.ones(2).log().sum().item()\n")
    logdir = str(tmp_path / "r")
    assert main(["run", "--logdir", logdir, str(script)]) == 0
    capsys.readouterr()
    for cmd in (["run"], ["run", "--monitor"], ["monitor"]):
        assert main([*cmd, "--logdir", logdir, str(script)]) == 2
        err = capsys.readouterr().err
        assert "already holds a run" in err and "--overwrite" in err, err
        assert "--resume" in err, err  # the same command after a preemption: continue the run


class _HandUpdated(torch.nn.Module):
    """Keras 3's torch backend, reduced (keras/src/backend/torch/layer.py, trainers/torch trainer.py):
    the variables sit in one ParameterDict and are used functionally (no torch children), and
    `fit`'s train_step runs `loss.backward()` then the Keras optimizer writes the weights under
    no_grad: no torch.optim step() is ever called."""

    def __init__(self):
        super().__init__()
        self._torch_params = torch.nn.ParameterDict({"dense/kernel": torch.nn.Parameter(torch.randn(4, 2) * 0.1)})

    def forward(self, x):
        return x @ self._torch_params["dense/kernel"]


def test_a_recording_of_a_loop_with_no_torch_optimizer_says_its_steps_were_not_counted(tmp_path, capsys):
    torch.manual_seed(0)
    model = _HandUpdated()
    with tg.record(tmp_path / "r"):
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    assert main(["report", str(tmp_path / "r")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "over 1 steps" not in out or "no torch.optim" in out, out
    assert "no torch.optim" in out and "step 0" in out, out


def test_a_monitor_run_does_not_say_it_stored_0_executions_over_0_steps(tmp_path, capsys):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Monitor(model, tmp_path / "m", every=1):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    assert main(["report", str(tmp_path / "m")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 stored over 0 steps" not in out and "not recorded" in out, out
