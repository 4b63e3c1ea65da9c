"""DDP around a compiled model (nanoGPT's train.py under torchrun): Dynamo's DDP optimizer
compiles without disabling the active dispatch modes, so the Python recorder's mode saw the
compiler's functional and fake tensors and summarised them: a segmentation fault in the first
forward (found running nanoGPT with `trainguard run --nproc-per-node 2`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import trainguard as tg

SCRIPT = Path(__file__).with_name("_ddp_compile_script.py")


def _run(tmp_path, *how: str) -> str:
    p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "r"), *how], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    return p.stdout


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["python", "native"])
def test_ddp_around_a_compiled_model_is_recorded_inside_its_graphs(tmp_path, backend):
    out = _run(tmp_path, "record", backend)
    assert f"backend {backend}" in out, out
    run = tg.open(tmp_path / "r")
    assert run.meta.get("record_errors") is None, run.meta.get("record_errors")
    ops = [(e["op"], e["phase"]) for e in run.executions()]
    assert ops.count(("aten.addmm", "forward")) == 6, ops  # two per step, inside the graph
    assert any(op.startswith("c10d.") for op, _ in ops), ops  # DDP's collectives, recorded


@pytest.mark.timeout(900)
def test_check_numerics_stops_inside_a_compiled_graph_under_ddp(tmp_path):
    # The eager x * inf is the origin; it becomes NaN in the graph's first addmm, where it stops.
    out = _run(tmp_path, "check_numerics")
    assert "NonFiniteError: aten.mul.Tensor produced ±inf in step 2" in out, out
    assert "which became NaN in aten.addmm at tests/capture/_ddp_compile_script.py:" in out, out
    assert "losses [" in out and out.split("losses ")[1].count(",") == 1, out  # steps 0 and 1 only
