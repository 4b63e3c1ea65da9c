"""A run written by several ranks (``logdir/rank-K``), read as one.

Under ``torch.distributed`` every rank writes its own database (:func:`rank_dir`), so nothing
on the training path waits for another rank. The reader merges them: a :class:`RankedRun` is
the run of one rank (rank 0 unless asked for another), so that everything written against a
single-process :class:`Run` keeps working, plus the other ranks and views over all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard._errors import RunNotFound
from trainguard.store._ranks import RANK_PREFIX
from trainguard.store._reader import Run

_COUNT_BY_STEP = (
    "SELECT e.step, count(*) FROM executions e JOIN op_types o ON o.id = e.op_id "
    "LEFT JOIN modules m ON m.id = e.module_id"
)


class RankedRun(Run):
    """The run of one rank of a multi-rank job, which also reads the others.

    ``ranks`` lists every rank, ``rank`` is the one this object reads as a :class:`Run`;
    :meth:`rank_run` opens another rank's run, :meth:`timeline` merges the executions of all
    of them by step, then rank, and :meth:`alerts_by_rank` gives each rank's alerts.

    Example::

        with trainguard.open("runs/ddp") as run:        # logdir/rank-0, logdir/rank-1, ...
            print(run.ranks)                            # [0, 1]
            for e in run.timeline(0, 50):               # step 0 of rank 0, of rank 1, step 1 ...
                print(e["step"], e["rank"], e["op"])
    """

    def __init__(self, root: Path, ranks: list[int], rank: int):
        super().__init__(root / f"{RANK_PREFIX}{rank}", ranks=ranks)
        self.root = root
        self.rank = rank
        self._runs: dict[int, Run] = {rank: self}

    @property
    def name(self) -> str:
        return self.root.name

    def rank_run(self, rank: int) -> Run:
        """The run of ``rank`` (opened once, closed with this one)."""
        if rank not in self.ranks:
            raise RunNotFound(f"run {str(self.root)!r} has no rank {rank}; ranks: {self.ranks}")
        run = self._runs.get(rank)
        if run is None:
            run = self._runs[rank] = Run(self.root / f"{RANK_PREFIX}{rank}", ranks=self.ranks)
        return run

    def rank_runs(self) -> dict[int, Run]:
        """Every rank's run, by rank."""
        return {k: self.rank_run(k) for k in self.ranks}

    def close(self) -> None:
        for run in self._runs.values():
            if run is not self:
                run.close()
        self._runs = {self.rank: self}
        super().close()

    def refresh(self) -> None:
        for run in self._runs.values():
            Run.refresh(run)

    # ------------------------------------------------------------------ merged views
    def _blocks(self, filters: dict[str, Any]) -> list[tuple[int, int, int]]:
        """``(step, rank, count)`` of matching executions, in timeline order."""
        blocks = []
        for k, run in self.rank_runs().items():
            where, params = run._where(filters.get("step"), filters.get("op"), filters.get("module"),
                                       filters.get("phase"), filters.get("health"))
            for step, n in run._q(_COUNT_BY_STEP + where + " GROUP BY e.step", params):
                blocks.append((step, k, n))
        blocks.sort()
        return blocks

    def timeline_count(self, **filters: Any) -> int:
        """How many executions :meth:`timeline` holds with these filters."""
        return sum(n for _, _, n in self._blocks(filters))

    def timeline(self, begin: int = 0, end: int | None = None, **filters: Any) -> list[dict]:
        """Digests of every rank's executions ``begin:end``, ordered by step, then rank, then
        sequence number, each with its ``rank``. Filters are those of :meth:`Run.executions`."""
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"need 0 <= begin <= end, got begin={begin}, end={end}")
        out: list[dict] = []
        offset = 0
        for step, k, n in self._blocks(filters):
            if end is not None and offset >= end:
                break
            lo, hi = max(begin - offset, 0), n if end is None else min(end - offset, n)
            if lo < hi:
                rows = self.rank_run(k).executions(lo, hi, **dict(filters, step=step))
                out += [dict(r, rank=k) for r in rows]
            offset += n
        return out

    def scalars(self, name: str | None = None) -> dict[str, list[tuple[int, float]]]:
        """:meth:`Run.scalars` of this rank, with the job's gradient norm where gradients are
        sharded (FSDP2): each rank's monitor sees its own shards only and keeps their squares
        (``grad_sq_sharded``, divided by how many ranks hold each); the job's squared norm is this
        rank's plain gradients (``grad_sq_plain``, the same on every rank) plus every rank's
        sharded part, per step that every rank wrote."""
        out = super().scalars(name)
        if "grad_norm" not in out:
            return out
        plain = dict(Run.scalars(self, "grad_sq_plain").get("grad_sq_plain", []))
        if not plain:
            return out
        parts = [dict(run.scalars("grad_sq_sharded").get("grad_sq_sharded", [])) for run in self.rank_runs().values()]
        merged = []
        for step, norm in out["grad_norm"]:
            if step in plain and all(step in p for p in parts):
                norm = (plain[step] + sum(p[step] for p in parts)) ** 0.5
            merged.append((step, norm))
        out["grad_norm"] = merged
        return out

    def alerts_by_rank(self) -> dict[int, dict]:
        """Each rank's :meth:`Run.alerts`."""
        return {k: run.alerts() for k, run in self.rank_runs().items()}
