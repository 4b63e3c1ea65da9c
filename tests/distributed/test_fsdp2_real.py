"""pytorch/examples distributed/FSDP2, shrunk (``_fsdp2_example.py``), on two gloo ranks under
``trainguard run --check-numerics``: the uninitialised memory FSDP2 allocates (``to_empty``'s
shards, the other rank's half of each all-gather buffer) stops no healthy job, and a model whose
blocks were never initialised after ``to_empty`` (the example's own ``reset_parameters``) is
stopped, in its first forward."""

from __future__ import annotations

import os

import trainguard as tg

from .conftest import HERE, run, trainguard

SCRIPT = HERE / "_fsdp2_example.py"


def _job(tmp_path, init: str) -> tuple[int, str]:
    os.environ["NAN_EMPTY"] = "1"
    os.environ["INIT"] = init
    try:
        return run(trainguard("run", "--check-numerics", "--nproc-per-node", "2", "--logdir", tmp_path / "run",
                              SCRIPT), tmp_path / "log")
    finally:
        del os.environ["NAN_EMPTY"], os.environ["INIT"]


def test_healthy_fsdp2_job_passes_check_numerics(tmp_path):
    code, out = _job(tmp_path, "all")
    assert code == 0, out[-4000:]
    assert out.count("loss ") == 3 and "nan" not in out.split("loss ", 1)[1].lower(), out[-2000:]
    with tg.open(tmp_path / "run") as job:
        assert job.ranks == [0, 1]
        for rank, r in job.rank_runs().items():
            assert r.alerts()["total"] == 0, (rank, r.alerts())
            ops = {e["op"] for e in r.executions()}
            assert {"fsdp.all_gather_copy_in", "c10d._allgather_base_"} <= ops


def test_fsdp2_blocks_never_initialised_are_stopped(tmp_path):
    code, out = _job(tmp_path, "example")
    assert code == 3, out[-4000:]
    assert "NonFiniteError" in out and "forward pass" in out, out[-4000:]
