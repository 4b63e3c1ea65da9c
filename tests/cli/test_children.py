"""A script whose training runs in processes it starts: trainguard says it watched none of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from trainguard.cli._children import ChildWatch

# The pattern of pytorch/examples mnist_hogwild/main.py: the parent builds the model, children
# train it (forked here: spawn's processes are followed, see test_spawned.py; forked ones are not).
SCRIPT = textwrap.dedent("""
    import torch
    import torch.multiprocessing as mp

    def train(rank, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()

    if __name__ == "__main__":
        model = torch.nn.Linear(3, 1)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), num_workers=1)
        for (x,) in loader:  # a DataLoader worker is a child process too, and trains nothing
            model(x)
        mp.start_processes(train, args=(model,), nprocs=2, start_method="fork")
""")


def _trainguard(tmp_path, command):
    script = tmp_path / "hogwild.py"
    script.write_text(SCRIPT)
    args = {"run": ["run", "--monitor"], "monitor": ["monitor"]}[command]
    return subprocess.run([sys.executable, "-m", "trainguard", *args, "--logdir", str(tmp_path / "r"),
                           str(script)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", ["run", "monitor"])
def test_training_only_in_child_processes_is_said_to_be_unwatched(tmp_path, command):
    proc = _trainguard(tmp_path, command)
    assert proc.returncode == 0, proc.stderr
    note = [line for line in proc.stderr.splitlines() if "child process" in line]
    assert len(note) == 1 and "2 child processes" in note[0], proc.stderr
    assert "--nproc-per-node" in note[0] and "inside the function" in note[0]


@pytest.mark.parametrize("command", ["run", "monitor"])
def test_the_report_says_later_that_the_training_ran_in_child_processes(tmp_path, command):
    """pytorch/examples mnist_hogwild under ``trainguard run --monitor``: the note is printed once,
    at the end; ``trainguard report`` later said only "Not enough data ... train under
    trainguard.Monitor (or trainguard monitor script.py)", which is what the user had done."""
    assert _trainguard(tmp_path, command).returncode == 0
    from trainguard.store import open_run

    with open_run(tmp_path / "r") as run:
        assert run.meta["untraced_children"] == 2
        (f,) = run.findings()
    assert f["kind"] == "trained_in_child_processes" and f["severity"] == "info", f
    assert "2 child processes" in f["title"] and "inside the function" in f["suggestion"], f
    report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(tmp_path / "r")], capture_output=True,
                            text=True, timeout=120)
    text = " ".join(report.stdout.split())
    assert "2 child processes" in text and "not watched" in text, report.stdout  # the finding, the header


def test_no_note_when_the_script_trains_itself():
    # In this process: the script's own loop trains (and a DataLoader worker is no trainer).
    namespace = {"__name__": "not_main"}
    exec(SCRIPT, namespace)
    model = torch.nn.Linear(3, 1)
    with ChildWatch() as watch:
        list(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), num_workers=1))
        namespace["train"](0, model)
    assert watch.started == 0 and watch.backwards == 3 and watch.note() is None


# PyTorch Lightning's DDP launcher on a script (``Trainer(strategy="ddp", devices=2)``,
# ``_SubprocessScriptLauncher``) starts each further rank as ``python script.py ARGS`` with
# LOCAL_RANK set, and trains rank 0 in the script's own process: under ``trainguard run`` rank 1
# trained unrecorded, and nothing said so.
RELAUNCH = textwrap.dedent("""
    import os, subprocess, sys
    import torch

    if "LOCAL_RANK" not in os.environ:
        env = dict(os.environ, LOCAL_RANK="1", WORLD_SIZE="2")
        child = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0])] + sys.argv[1:], env=env)
    else:
        child = None
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
    if child is not None:
        assert child.wait() == 0
""")


def test_ranks_a_script_relaunches_itself_as_are_said_to_be_unrecorded(tmp_path):
    script = tmp_path / "lit_like.py"
    script.write_text(RELAUNCH)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--monitor", "--every", "5", "--logdir",
                           str(tmp_path / "r"), str(script), "--epochs", "3"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    note = [line for line in proc.stderr.splitlines() if "more rank" in line]
    assert len(note) == 1 and "started 1 more rank" in note[0] and "rank 0" in note[0], proc.stderr
    # the command to run instead is the user's own, options and script arguments kept (it said
    # `trainguard run --nproc-per-node 2 lit_like.py`, without --monitor and the script's arguments)
    want = f"`trainguard run --nproc-per-node 2 --monitor --every 5 --logdir {tmp_path / 'r'} {script} --epochs 3`"
    assert want in note[0], note[0]
    assert "recorded" in proc.stderr.splitlines()[-1]  # this process's own run is there as always
