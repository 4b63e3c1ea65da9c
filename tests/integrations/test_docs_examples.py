"""The complete examples of docs/integrations.md run as written (tiny models, nothing downloaded) and
give the results the page claims."""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

import pytest

import trainguard

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
EXAMPLES = dict(re.findall(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)```", DOC.read_text(), re.S))
RUNS = {"lightning": ("lightning", "runs/lightning-mlp", 60), "transformers-gpt2": ("transformers", "runs/gpt2", 40),
        "transformers-bert": ("transformers", "runs/bert", 40)}


def test_every_example_is_tested():
    assert sorted(EXAMPLES) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs_and_is_judged_healthy(tmp_path, monkeypatch, name):
    package, logdir, steps = RUNS[name]
    pytest.importorskip(package)
    script = tmp_path / f"{name}.py"
    script.write_text(EXAMPLES[name])
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    run = trainguard.open(tmp_path / logdir)
    assert [s for s, _ in run.scalars("loss")["loss"]] == list(range(steps))
    kinds = [f["kind"] for f in run.findings()]
    assert kinds == ["healthy"], run.findings()
    if name == "lightning":
        assert run.count() > 0  # record=True: the ops are there for `trainguard report`
