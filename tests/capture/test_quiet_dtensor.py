"""trainguard's own tensor ops run under ``unrecorded()`` (the guard's sentry, the monitor's
statistics): with the Python recorder's dispatch mode on the stack, that context must hide the
mode only, never the ``__torch_dispatch__`` of tensor subclasses. FSDP2's gradients are DTensors,
wrappers with no storage of their own: an aten kernel run on the wrapper itself reads memory that
is not there. Found replaying an FSDP2 job under the guard (tests/distributed/_fsdp2_guard.py):
the sentry's ``torch._foreach_norm`` over the DTensor gradients killed both ranks with SIGSEGV
under ``TRAINGUARD_BACKEND=python``, and a world-size-1 job always (its replay is recorded by the
Python backend).

Each case runs in a child process: the bug is a segmentation fault.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.fsdp")

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``script`` in a child process that imports this checkout's trainguard."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import trainguard as tg
    from trainguard.capture import unrecorded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 2))
    fully_shard(model)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    grads = [p.grad for p in model.parameters()]
    want = [torch.linalg.vector_norm(g._local_tensor) for g in grads]
    with tg.record(sys.argv[1] + "/run", backend="python"):
        with torch.no_grad(), unrecorded():
            norms = torch._foreach_norm(grads)  # the guard's sentry, before optimizer.step()
            total = sum(float(n.full_tensor()) ** 2 for n in norms) ** 0.5
    print("norms", [round(float(n.full_tensor()), 6) for n in norms], [round(float(w), 6) for w in want])
    assert all(torch.equal(n.full_tensor(), w) for n, w in zip(norms, want)), (norms, want)
    assert abs(total - float(torch.linalg.vector_norm(torch.stack(want)))) < 1e-5
    dist.destroy_process_group()
    print("ok")
""")


def test_unrecorded_ops_on_fsdp2_dtensor_gradients_under_the_python_recorder(tmp_path):
    proc = _run(SCRIPT, tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("ok")


# The guard's replay in one process (guard/_replay.StepRecording): the Python recorder notes the rows
# of each new non-finite output. Adam's update of a NaN gradient writes NaN into FSDP2's DTensor
# moments: rows were asked of the DTensor itself (aten.nonzero, which DTensor cannot shard), and the
# op's record was lost with a warning.
ROWS = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainguard.capture._recorder import Recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")  # sample 1 of the batch
    rec = Recorder(sys.argv[1] + "/run", mode="full_health", buffer=-1, backend="python", strategy="immediate")
    rec.nonfinite_rows = {}
    rec.start()
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    rec.stop()
    print("rows", sorted(rec.nonfinite_rows.values())[:3])
    assert rec.failures == 0, rec.failures
    assert (3, [1]) in rec.nonfinite_rows.values(), rec.nonfinite_rows
    dist.destroy_process_group()
    print("ok")
""")


def test_the_replays_rows_of_fsdp2_dtensor_outputs_are_read_from_the_shard(tmp_path):
    proc = _run(ROWS, tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "could not record" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
