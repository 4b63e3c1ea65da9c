"""Where each rank writes (LOGDIR/rank-K), and what a rank finds in its way."""

from __future__ import annotations

import pytest

import trainguard as tg
from trainguard.store import RunWriter, default_name, process_rank, rank_dir


@pytest.fixture
def rank_of(monkeypatch):
    def set_rank(rank: int, world: int, restart: int | None = None) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        if restart is not None:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return set_rank


def test_rank_dir_follows_torchruns_environment(tmp_path, rank_of, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert process_rank() == (0, 1) and rank_dir(tmp_path / "r") == tmp_path / "r"
    rank_of(3, 4)
    assert process_rank() == (3, 4) and rank_dir(tmp_path / "r") == tmp_path / "r" / "rank-3"
    rank_of(0, 1)
    assert rank_dir(tmp_path / "r") == tmp_path / "r"  # one rank: the plain layout
    rank_of(1, 2, restart=2)  # torchrun restarted the workers: the failed attempt's run stays
    assert rank_dir(tmp_path / "r") == tmp_path / "r-restart2" / "rank-1"
    rank_of(5, 2)  # nonsense: not distributed
    assert process_rank() == (0, 1)


def test_default_names_agree_across_ranks_of_one_job(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # under torchrun: the agent's start time, shared by its workers
    assert default_name("run") == default_name("run")
    assert default_name("monitor").startswith("monitor-")


def test_a_rank_refuses_a_single_process_run_in_the_logdir_unless_overwriting(tmp_path, rank_of):
    RunWriter(tmp_path / "job").close()  # a single-process run at the top
    rank_of(1, 2)
    with pytest.raises(tg.TrainguardError, match="already holds a run"):
        RunWriter(rank_dir(tmp_path / "job"))
    rank_of(0, 2)
    RunWriter(rank_dir(tmp_path / "job"), overwrite=True).close()  # rank 0 replaces it
    assert not (tmp_path / "job" / "run.sqlite").exists()


def test_rank_0_overwriting_removes_the_ranks_of_a_larger_job(tmp_path, rank_of):
    for rank in range(4):
        rank_of(rank, 4)
        RunWriter(rank_dir(tmp_path / "job")).close()
    rank_of(0, 2)
    RunWriter(rank_dir(tmp_path / "job"), overwrite=True).close()
    rank_of(1, 2)
    RunWriter(rank_dir(tmp_path / "job"), overwrite=True).close()
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["rank-0", "rank-1"]
    with tg.open(tmp_path / "job") as run:
        assert run.ranks == [0, 1]
        assert run.meta["world_size"] == 2
