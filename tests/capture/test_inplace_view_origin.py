"""A value written in place through a view of a view reaches the readers of the first view.

Derived from alxndrTL/mamba.py (mambapy/pscan.py): ``PScan.forward`` clones its inputs,
transposes them (``X = X.transpose(2, 1)``), scans in place through views of that transpose
(``Xa = X.view(...)``, ``Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))``) and returns
``X.transpose(2, 1)``. With a recurrence whose factor is above 1 (the sign of A dropped) the scan
overflows to inf inside the in-place writes, but the origin was the return's ``transpose``
("transpose turned finite inputs into +inf/-inf"): the writes moved the producer of the clone
(the views' base), not of the transpose the program reads again.
"""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


def scan(A, X):
    A = A.clone().transpose(2, 1)  # (B, D, L)
    X = X.clone().transpose(2, 1)
    B, D, L = X.shape
    Xa = X.view(B, D, L // 2, 2)
    Aa = A.view(B, D, L // 2, 2)
    Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))  # WRITE-PAIRS
    for t in range(1, L):
        X[:, :, t].add_(A[:, :, t].mul(X[:, :, t - 1]))  # WRITE-SEQ
    return X.transpose(2, 1)  # READ-BACK


def _line(marker: str) -> int:
    text = open(__file__).read().splitlines()
    return next(i for i, s in enumerate(text, 1) if s.rstrip().endswith(marker))


@pytest.mark.parametrize("backend", ["native", "python"])
def test_overflow_written_through_views_is_traced_to_the_write(tmp_path, backend):
    X = torch.ones(2, 32, 3)
    A = torch.full((2, 32, 3), 1e4)  # |factor| > 1: 1e4 ** 32 overflows float32 within the scan

    def program():  # (PScan.forward runs with grad off; the program reads the result)
        scan(A * 1, X * 1).sum().item()

    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        program()
    o = origin(open_run(tmp_path / "r")).origin
    assert o.op != "aten.transpose.int", (o.op, o.line, o.explanation)
    assert o.line == _line("# WRITE-SEQ"), (o.op, o.line, o.explanation)


def test_check_numerics_stops_at_the_write(tmp_path):
    X, A = torch.ones(2, 32, 3), torch.full((2, 32, 3), 1e4)
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(tmp_path / "c"):
            scan(A * 1, X * 1).sum().item()
    assert f"test_inplace_view_origin.py:{_line('# WRITE-SEQ')}" in str(info.value), str(info.value)
    assert "transpose turned finite inputs" not in str(info.value)
