"""Fixtures shared across the test packages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class TwoRanks:
    root: Path  # the logdir: root/rank-0, root/rank-1
    log_file: str  # where rank 1 made its -inf
    log_line: int


def _rank0(tg, torch, dist) -> None:
    w = torch.ones(4)
    for _ in range(3):  # steps 0, 1, 2; from step 1 on the reduced buffer holds a NaN "from rank 1"
        buf = (w * 0.5).clone()
        dist.all_reduce(buf)
        if tg.capture.current_step() >= 1:
            buf.numpy()[2] = float("nan")  # arrived through the all-reduce: no op of this rank made it
        (buf * 2).sum()
        tg.step()


def _rank1(tg, torch, dist) -> None:
    w = torch.ones(4)
    for _ in range(3):
        x = w - float(tg.capture.current_step() >= 1)  # zeros from step 1
        torch.log(x).sum()  # -inf from step 1 on: made here
        buf = (w * 0.5).clone()
        dist.all_reduce(buf)
        tg.step()


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> TwoRanks:
    """A run of two ranks in which rank 1 makes a -inf (log of 0) in step 1 and rank 0 only
    receives a NaN through an all-reduce in the same step.

    The ranks are recorded here, one after the other, in one process: the environment says which
    rank is recording (as torchrun's does), a one-rank gloo group runs the real collective, and
    rank 0's reduced buffer is written behind the recorder's back, as another rank's contribution
    is. The end-to-end version under torchrun is in tests/distributed.
    """
    import torch
    import torch.distributed as dist

    import trainguard as tg

    root = tmp_path_factory.mktemp("ranks") / "job"
    mp = pytest.MonkeyPatch()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for rank, body in ((0, _rank0), (1, _rank1)):
            mp.setenv("RANK", str(rank))
            mp.setenv("WORLD_SIZE", "2")
            mp.setattr(dist, "is_initialized", lambda: False)  # the rank comes from the environment
            with tg.record(root, buffer=-1):
                tg.step(0)
                body(tg, torch, dist)
            mp.undo()
    finally:
        mp.undo()
        dist.destroy_process_group()
    line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "torch.log(x).sum()" in t)
    return TwoRanks(root, __file__, line)
