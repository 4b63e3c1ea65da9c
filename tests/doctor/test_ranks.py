"""Under torchrun every rank's doctor writes its own LOGDIR/rank-K, and a reader merges them."""

from __future__ import annotations

from torch import nn

import trainguard as tg
from trainguard import doctor


def test_each_rank_saves_its_doctor_results_into_its_own_rank_dir(mlp, batches, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = doctor.run_checklist(mlp, batches, nn.CrossEntropyLoss(), checks=["init"])
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        assert r.save(tmp_path / "run") == str(tmp_path / "run" / f"rank-{rank}")
    with tg.open(tmp_path / "run") as run:
        assert run.ranks == [0, 1]
        for rr in run.rank_runs().values():
            assert rr.meta["doctor_passed"] is True and rr.findings(source="doctor")
