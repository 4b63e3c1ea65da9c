"""Full tensors (mode full_tensor): raw bytes in segment files, evicted with the buffer, read safely."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import trainguard as tg
from trainguard import CorruptRun
from trainguard.store import SCHEMA_VERSION, _writer, open_run
from trainguard.store._writer import RunWriter

CASES = {
    "float32": torch.randn(5, 7),
    "float16": torch.randn(4).half(),
    "bfloat16": torch.randn(3, 2).bfloat16(),
    "float64 nonfinite": torch.tensor([1.0, float("nan"), -float("inf")], dtype=torch.float64),
    "int8": torch.tensor([-3, 0, 127], dtype=torch.int8),
    "int64": torch.arange(6).reshape(2, 3),
    "bool": torch.tensor([True, False, True]),
    "complex64": torch.randn(3, dtype=torch.complex64),
    "conjugate view": torch.randn(3, dtype=torch.complex64).conj(),
    "scalar": torch.tensor(2.5),
    "empty": torch.empty(0, 3),
    "transposed": torch.randn(3, 4).t(),
    "expanded": torch.randn(1, 3).expand(4, 3),
    "sparse": torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)),
}


def test_every_kind_of_tensor_comes_back_equal(tmp_path):
    w = RunWriter(tmp_path / "r", mode="full_tensor")
    for seq, t in enumerate(CASES.values()):
        w.put_payload_tensor(seq, 0, t.clone() if not t.is_sparse else t)
    w.close()
    with open_run(tmp_path / "r") as run:
        for seq, (name, t) in enumerate(CASES.items()):
            got = run.tensor(seq)
            want = t.to_dense() if t.is_sparse else t.resolve_conj()
            got = got.to_dense() if got.is_sparse else got
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want) or torch.allclose(got, want, equal_nan=True), name
    files = sorted(p.name for p in (tmp_path / "r" / "tensors").iterdir())
    assert len([f for f in files if f.startswith("seg-")]) == 1  # one segment for all strided ones
    assert [f for f in files if f.endswith(".pt")] == [f"{len(CASES) - 1}-0.pt"]  # sparse: its own file


def test_buffer_deletes_segments_it_no_longer_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(_writer, "SEGMENT_BYTES", 4096)
    x = torch.zeros(256)  # 1 KiB per output: a segment every 4 outputs
    with tg.record(tmp_path / "r", mode="full_tensor", buffer=8):
        bad = torch.log(x)  # -inf: harmful once read, then pinned with its payload
        bad.sum().item()
        for _ in range(200):
            x = x + 1
    with open_run(tmp_path / "r") as run:
        (first,) = [e for e in run.executions(op="log")]
        assert torch.equal(run.tensor(first["seq"]), bad)
        rows = run._q("SELECT seq, path FROM payloads")
        assert len(rows) <= 8 + 2  # the window and the pinned log and sum
        for seq, _ in rows:
            assert run.tensor(seq).shape == ((256,) if seq != 1 else ())  # 1: the sum
        used = {path.split("/")[-1] for _, path in rows}
    on_disk = {p.name for p in (tmp_path / "r" / "tensors").iterdir()}
    assert on_disk == used  # 200 outputs went through about 50 segments; only those in use remain


def test_a_format_1_run_is_read_and_upgraded_when_appended(tmp_path):
    run_dir = tmp_path / "r"
    w = RunWriter(run_dir, mode="full_tensor")
    w.close()
    (run_dir / "tensors").mkdir()
    torch.save(torch.arange(3), run_dir / "tensors" / "0-0.pt")
    con = sqlite3.connect(run_dir / "run.sqlite")
    with con:  # the payloads table as format 1 wrote it
        con.execute("DROP TABLE payloads")
        con.execute("CREATE TABLE payloads (seq INTEGER NOT NULL, slot INTEGER NOT NULL, path TEXT NOT NULL, "
                    "PRIMARY KEY (seq, slot))")
        con.execute("INSERT INTO payloads VALUES (0, 0, 'tensors/0-0.pt')")
        con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.close()
    with open_run(run_dir) as run:
        assert torch.equal(run.tensor(0), torch.arange(3))
    w = RunWriter(run_dir, mode="full_tensor", append=True)
    w.put_payload_tensor(1, 0, torch.ones(2))
    w.close()
    with open_run(run_dir) as run:
        assert run.meta["schema_version"] == SCHEMA_VERSION
        assert torch.equal(run.tensor(0), torch.arange(3)) and torch.equal(run.tensor(1), torch.ones(2))


def test_a_damaged_tensor_record_is_a_clear_error(tmp_path):
    w = RunWriter(tmp_path / "r", mode="full_tensor")
    w.put_payload_tensor(0, 0, torch.ones(4))
    w.close()
    con = sqlite3.connect(tmp_path / "r" / "run.sqlite")
    with con:
        con.execute("UPDATE payloads SET dtype = 'load'")  # not a dtype: never looked up as code
    con.close()
    with open_run(tmp_path / "r") as run:
        with pytest.raises(CorruptRun, match="damaged tensor record"):
            run.tensor(0)
        with pytest.raises(KeyError):
            run.tensor(0, slot=1)


def test_the_segment_being_appended_to_is_kept_until_the_run_closes(tmp_path):
    from trainguard.store._sink import Sink

    sink = Sink(tmp_path, "full_tensor", buffer=1)
    (tmp_path / "tensors").mkdir()
    for name in ("seg-a-000001.bin", "seg-a-000002.bin"):
        (tmp_path / "tensors" / name).write_bytes(b"\0" * 8)
    sink.handle(("payload", 0, 0, "tensors/seg-a-000001.bin", 0, 4, "float32", "[1]"))
    sink.handle(("payload", 1, 0, "tensors/seg-a-000002.bin", 0, 4, "float32", "[1]"))
    sink.con.execute("DELETE FROM payloads")  # every tensor evicted
    sink._drop_unused_segments(final=False)
    assert sorted(p.name for p in (tmp_path / "tensors").iterdir()) == ["seg-a-000002.bin"]  # still open
    sink._drop_unused_segments(final=True)
    assert list((tmp_path / "tensors").iterdir()) == []
    sink.commit(final=True)


def test_a_failed_write_starts_a_new_segment(tmp_path):
    """Bytes a failed write left behind must not shift the offsets of later tensors."""
    w = RunWriter(tmp_path / "r", mode="full_tensor")
    w.put_payload_tensor(0, 0, torch.arange(4.0))
    w.flush()
    real, calls = w._seg.write, []

    def half_then_fail(view):
        calls.append(1)
        if len(calls) == 1:
            return real(view[: len(view) // 2])
        raise OSError(28, "No space left on device")

    w._seg.write = half_then_fail
    w.put_payload_tensor(1, 0, torch.arange(8.0))  # lost: the writer logs it and goes on
    w.put_payload_tensor(2, 0, torch.arange(3.0))
    w.close()
    with open_run(tmp_path / "r") as run:
        assert torch.equal(run.tensor(0), torch.arange(4.0))
        assert torch.equal(run.tensor(2), torch.arange(3.0))
        with pytest.raises(KeyError):
            run.tensor(1)
        assert "No space left" in run.meta.get("writer_error", "")


def test_a_transposed_output_is_copied_once_and_reads_back(tmp_path, monkeypatch):
    """The recorder hands the writer a contiguous copy, which the writer appends as it is."""
    seen = []
    real = _writer._raw_bytes

    def spy(tensor):
        seen.append(tensor.is_contiguous())
        return real(tensor)

    monkeypatch.setattr(_writer, "_raw_bytes", spy)
    x = torch.randn(3, 5)
    with tg.record(tmp_path / "r", mode="full_tensor", buffer=-1):
        y = x.t()
    assert seen == [True]
    with open_run(tmp_path / "r") as run:
        (e,) = run.executions(op="aten.t")
        assert torch.equal(run.tensor(e["seq"]), y)
