"""pytorch/examples distributed/FSDP2, shrunk (``_fsdp2_example.py``), on two gloo ranks under
``trainguard run --check-numerics``: the uninitialised memory FSDP2 allocates (``to_empty``'s
shards, the other rank's half of each all-gather buffer) stops no healthy job, and a model whose
blocks were never initialised after ``to_empty`` (the example's own ``reset_parameters``) is
stopped, in its first forward. A NaN one rank makes reaches the other through the gradient
reduce-scatter, and the report and the guard name the rank that made it; the job's gradient norm,
read from every rank's shards, is the one ``clip_grad_norm_`` returns (FSDP2 and tensor parallel)."""

from __future__ import annotations

import json
import os

import pytest

import trainguard as tg
from trainguard.cli import main

from .conftest import HERE, run, torchrun, trainguard

SCRIPT = HERE / "_fsdp2_example.py"


def _job(tmp_path, init: str, *options: str) -> tuple[int, str]:
    os.environ["NAN_EMPTY"] = "1"
    os.environ["INIT"] = init
    try:
        return run(trainguard("run", "--check-numerics", *options, "--nproc-per-node", "2", "--logdir",
                              tmp_path / "run", SCRIPT), tmp_path / "log")
    finally:
        del os.environ["NAN_EMPTY"], os.environ["INIT"]


def test_healthy_fsdp2_job_passes_check_numerics_and_its_merged_gradient_norm_is_clip_grad_norms(tmp_path):
    # one job of two ranks (~15 s of the suite each) for both: --check-numerics with --monitor
    code, out = _job(tmp_path, "all", "--monitor")
    assert code == 0, out[-4000:]
    assert out.count("loss ") == 3 and "nan" not in out.split("loss ", 1)[1].lower(), out[-2000:]
    with tg.open(tmp_path / "run") as job:
        assert job.ranks == [0, 1]
        for rank, r in job.rank_runs().items():
            assert r.alerts()["total"] == 0, (rank, r.alerts())
            ops = {e["op"] for e in r.executions()}
            assert {"fsdp.all_gather_copy_in", "c10d._allgather_base_"} <= ops
        # Found on pytorch/examples distributed/FSDP2: each rank's monitor summed the squares of its own
        # gradient shards, so the job's grad_norm was the norm of half the gradient (0.37 where
        # clip_grad_norm_ returned 0.53 on two ranks), and a clip norm read off it would be sqrt(ranks) too small.
        printed = [float(line.split()[3]) for line in out.splitlines() if line.startswith("loss ")]
        merged = [v for _, v in job.scalars()["grad_norm"]]
        assert merged == [v for _, v in job.scalars("grad_norm")["grad_norm"]]
        assert merged == pytest.approx(printed, rel=1e-5)
        own = [v for _, v in job.rank_run(1).scalars()["grad_norm"]]  # a rank's own run: its shards
        assert all(o < m for o, m in zip(own, merged))


def test_fsdp2_blocks_never_initialised_are_stopped(tmp_path):
    code, out = _job(tmp_path, "example")
    assert code == 3, out[-4000:]
    assert "NonFiniteError" in out and "forward pass" in out, out[-4000:]


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_nan_made_on_one_rank_is_received_by_the_other_through_fsdps_reduce_scatter(tmp_path, capsys, backend,
                                                                                    monkeypatch):
    # Found on pytorch/examples distributed/FSDP2 with one rank's loss divided by a zero count: gloo's
    # reduce-scatter reduces a copy of its input that it makes inside the collective and scatters it when
    # the program waits for it (a split and a copy_ on the training thread), so rank 0's first NaN was that
    # split, "made" out of a tensor no op had produced, and the report named rank 0 as the rank that made it.
    monkeypatch.setenv("NAN_RANK", "1")
    monkeypatch.setenv("TRAINGUARD_BACKEND", backend)
    code, out = run(trainguard("run", "--nproc-per-node", "2", "--buffer", "-1", "--logdir", tmp_path / "run",
                               SCRIPT), tmp_path / "log")
    assert code == 0, out[-4000:]
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert (ranks["first_rank"], ranks["made"], ranks["received"]) == (1, [1], [0]), ranks["headline"]
    made = ranks["per_rank"][1]["first"]
    assert (made["op"], made["step"], made["phase"]) == ("aten.div.Tensor", 1, "forward"), made
    via = ranks["per_rank"][0]["first"]["received_via"]
    assert (via["op"], via["phase"], via["step"]) == ("c10d._reduce_scatter_base_", "backward", 1), via


def test_the_merged_gradient_norm_of_a_tensor_parallel_model_counts_a_replicated_bias_once(tmp_path):
    # pytorch/examples distributed/tensor_parallelism (_tp_example.py): the weights are sharded, out_proj's
    # bias is replicated on both ranks; the job's norm must count the bias once, as clip_grad_norm_ does.
    code, out = run(trainguard("run", "--monitor", "--nproc-per-node", "2", "--logdir", tmp_path / "run",
                               HERE / "_tp_example.py"), tmp_path / "log")
    assert code == 0, out[-4000:]
    printed = [float(line.split()[3]) for line in out.splitlines() if line.startswith("loss ")]
    assert len(printed) == 3
    with tg.open(tmp_path / "run") as job:
        assert [v for _, v in job.scalars()["grad_norm"]] == pytest.approx(printed, rel=1e-5)


def test_the_guard_rewinds_an_fsdp2_job_and_names_the_rank_that_made_the_nan(tmp_path):
    # Rank 1's batch at step 6 (sample 49 of the unshuffled DistributedSampler: rank 1 takes the odd samples,
    # four a batch) makes its loss NaN. The guard's replay records from step 6 on; FSDP2 views its unsharded
    # parameters' stale storage (NaN from step 7's forward before the rewind) before the all-gather fills it:
    # that view was the origin on both ranks ("came from outside the recording").
    script = HERE / "_fsdp2_guard.py"
    code, out = run(torchrun(script, tmp_path / "ckpt", tmp_path / "run", 49), tmp_path / "log")
    assert code == 0, out[-4000:]
    line = next(i for i, t in enumerate(script.read_text().splitlines(), 1) if "LOSS_LINE" in t)
    for rank in (0, 1):
        with tg.open(tmp_path / "run", rank=rank) as r:
            (finding,) = r.rank_run(rank).findings(source="guard")
            event = finding["event"]
            assert (event["step"], event["action"], event["origin_rank"]) == (6, "skip", 1), event
            link = event["origin"]["origin"]
            assert link["op"].startswith("aten.div") and link["line"] == line, link
