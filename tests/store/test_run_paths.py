"""Run directories whose paths hold URI characters (``#``, ``?``, ``%``): every reader opens that run,
and only that run, and creates nothing."""

from __future__ import annotations

import json

import pytest
import torch

import trainguard as tg
from trainguard.cli import main
from trainguard.store import RunWriter, open_run


def record(path, n_exp: int) -> None:
    with tg.record(path, buffer=-1):
        for _ in range(n_exp):
            torch.ones(3).exp()


def tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("name", ["trial#1", "what?mode=rwc", "a%41b", "50% done", "x&y=z"])
def test_every_reader_opens_exactly_that_run_and_creates_nothing(tmp_path, name, capsys):
    runs = tmp_path / "runs"
    target = runs / name
    record(target, 1)
    record(runs / "aAb", 2)  # what "a%41b" means once percent-decoded
    record(runs / "what", 2)  # and what "what?..." means with its query cut off
    before = tree(runs)

    with open_run(target) as run:
        assert run.count(op="exp") == 1 and run.path == target
        stored = run.count()

    capsys.readouterr()
    assert main(["report", str(target), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == str(target) and report["counts"]["stored"] == stored

    out = tmp_path / "tb"
    assert main(["export", "tensorboard", str(target), str(out)]) == 0

    from trainguard.ui._registry import Registry, run_id_for

    reg = Registry(runs)
    handle = reg.handle(run_id_for(runs, target))
    assert handle.run.count(op="exp") == 1
    reg.close()

    # the doctor appends its results to an existing run
    RunWriter(target, append=True, meta={"doctor": True}).close()
    with open_run(target) as run:
        assert run.meta.get("doctor") is True and run.count(op="exp") == 1
    assert tree(runs) == before, "a reader left a file behind"
