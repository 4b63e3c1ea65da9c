"""Uninitialised memory (``empty``, ``empty_like``, ``module.to_empty()``) is never evidence, on
either backend, also when it sits inside a DTensor, and stops being unknown once it is written.

Uninitialised memory holds whatever the allocator hands back, NaN bit patterns included, so a
test that relies on it is flaky. ``torch.utils.deterministic.fill_uninitialized_memory`` (with
deterministic algorithms on) makes every ``empty*`` fill its floats with NaN: the tests below
see NaN there on every run, which is the worst case a real allocator can produce.

The FSDP2 recipe (build on the meta device, ``fully_shard``, ``to_empty``, ``reset_parameters``)
is derived from pytorch/examples distributed/FSDP2 (example.py, model.py), shrunk to two linear
layers on a one-rank gloo group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import trainguard as tg


@pytest.fixture
def one_rank():
    """A one-rank gloo group: FSDP2 and DTensor need a default process group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_model(fsdp: bool) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model


def _train(model: nn.Module, init: bool = True, steps: int = 2) -> float:
    # The example's order: to_empty, then reset_parameters, then the optimizer and the steps.
    model.to_empty(device="cpu")
    if init:
        for m in model:
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


@pytest.mark.usefixtures("nan_empty", "one_rank")
def test_fsdp2_to_empty_then_init_passes_check_numerics():
    # The bug: FSDP2 re-reads the DTensor's local shard (``_local_tensor.view(-1)``) after
    # ``to_empty``; the shard came from the DTensor's own empty_like, which the dispatch mode does
    # not see, so its NaN bytes were judged harmful and a healthy job stopped with exit 3.
    torch.manual_seed(0)
    with tg.check_numerics():
        loss = _train(_meta_model(fsdp=True))
    assert loss == loss


@pytest.mark.usefixtures("nan_empty", "one_rank")
def test_fsdp2_to_empty_recorded_without_harm(tmp_path):
    torch.manual_seed(0)
    with tg.record(tmp_path / "run", backend="python", buffer=-1):
        _train(_meta_model(fsdp=True))
    with tg.open(tmp_path / "run") as run:
        assert run.alerts()["total"] == 0
        assert run.meta.get("first_harm") is None


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("fsdp", [False, True])
def test_fsdp2_to_empty_without_init_is_caught(fsdp, request):
    # What must still fail: a model used straight after to_empty computes on garbage.
    if fsdp:
        request.getfixturevalue("one_rank")
    torch.manual_seed(0)
    with pytest.raises(tg.NonFiniteError) as err:
        with tg.check_numerics():
            _train(_meta_model(fsdp=fsdp), init=False, steps=1)
    # Not at a view or a copy of the uninitialised memory: at the first op that computes with it.
    op = err.value.execution["op"]
    assert not any(w in op for w in ("view", "copy", "clone", "detach", "as_strided", "empty")), op
    assert err.value.execution["phase"] == "forward"


@pytest.mark.usefixtures("nan_empty")
def test_plain_to_empty_then_init_passes_check_numerics():
    torch.manual_seed(0)
    with tg.check_numerics():
        _train(_meta_model(fsdp=False))


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("backend", ["python", "native"])
def test_written_behind_a_view_is_no_longer_unknown(tmp_path, backend):
    # FSDP2 keeps a flat view of each uninitialised shard, and reset_parameters writes the shard
    # itself: the view's values are real from then on (its version counter moved), and what is
    # copied from it (FSDP's all-gather copy-in, every step) must be summarised, not unknown.
    with tg.record(tmp_path / "run", backend=backend, buffer=-1, mode="full_health"):
        buf = torch.empty(4, 4)
        flat = buf.view(-1)
        buf.uniform_()
        copied = flat.clone()
        torch.empty(3).view(-1).clone()  # never written: unknown
    assert torch.isfinite(copied).all()
    with tg.open(tmp_path / "run") as run:
        assert run.meta.get("backend") == backend
        clones = [e for e in run.executions() if e["op"] == "aten.clone"]
        assert len(clones) == 2
        written, unwritten = (c["outputs"][0]["summary"] for c in clones)
        assert written["pos"] == 16 and written["nan"] == 0, written
        assert clones[0]["taint"] == "finite"
        assert clones[1]["taint"] == "unknown" and unwritten["nan"] != unwritten["nan"]  # no count: NaN
        assert run.alerts()["total"] == 0


@pytest.mark.usefixtures("nan_empty", "one_rank")
@pytest.mark.parametrize("backend", ["python", "native"])
def test_fsdp2_parameters_are_summarised_after_init(tmp_path, backend):
    # After reset_parameters the all-gathered parameters hold real values in every step's forward.
    torch.manual_seed(0)
    with tg.record(tmp_path / "run", backend=backend, buffer=-1):
        _train(_meta_model(fsdp=True))
    with tg.open(tmp_path / "run") as run:
        assert run.alerts()["total"] == 0
        fwd = [e for e in run.executions(phase="forward", step=1) if e["op"] == "aten.copy_"]
        assert fwd, "no all-gather copy-in recorded"
        for e in fwd:
            assert e["taint"] == "finite", e
            s = e["outputs"][0]["summary"]
            assert s["nan"] == 0 and s["pos"] + s["neg"] + s["zero"] == e["outputs"][0]["shape"][0], e


def _copy_in(shards, world_size: int = 2, rank: int = 0):
    """FSDP2's copy-in before its all-gather, as rank ``rank`` of ``world_size`` runs it
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the output buffer is an
    ``empty`` for every rank's slice, and this rank copies its shards into its own."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (defines torch.ops.fsdp)

    numel = sum(s.numel() for s in shards)
    out = torch.empty(numel * world_size)
    return torch.ops.fsdp.all_gather_copy_in(shards, out, [s.numel() for s in shards], numel, rank)


@pytest.mark.usefixtures("nan_empty")
def test_fsdp2_copy_in_leaves_the_other_ranks_slices_unknown(tmp_path):
    # On two ranks the other rank's half of the all-gather buffer is uninitialised until the
    # all-gather writes it: a healthy FSDP2 job stopped there (exit 3) in its first forward.
    shards = [torch.randn(8), torch.randn(4)]
    with tg.check_numerics():
        mine, whole = _copy_in(shards)
    assert torch.equal(mine, torch.cat(shards)) and torch.isnan(whole[12:]).all()
    with tg.record(tmp_path / "run", backend="python", buffer=-1):
        _copy_in(shards)
    with tg.open(tmp_path / "run") as run:
        (e,) = [e for e in run.executions() if e["op"] == "fsdp.all_gather_copy_in"]
        assert e["taint"] == "unknown" and run.alerts()["total"] == 0


@pytest.mark.usefixtures("nan_empty")
def test_fsdp2_copy_in_of_a_nan_shard_stays_harmful(tmp_path):
    # What this rank sends keeps its harm through the copy-in, with its origin.
    with tg.record(tmp_path / "run", backend="python", buffer=-1):
        bad = torch.zeros(4) / 0  # 0/0: NaN, harmful where it is made
        _copy_in([torch.randn(8), bad])
    with tg.open(tmp_path / "run") as run:
        (div,) = [e for e in run.executions() if e["op"].startswith("aten.div")]
        (e,) = [e for e in run.executions() if e["op"] == "fsdp.all_gather_copy_in"]
        assert div["taint"] == "harmful" and (e["taint"], e["origin"]) == ("harmful", div["seq"])


def _glorot_through_data(rows: int, cols: int) -> nn.Parameter:
    # torch_geometric.nn.dense.Linear: ``Parameter(torch.empty(out, in))``, then
    # torch_geometric/nn/inits.py ``glorot``: ``value.data.uniform_(-stdv, stdv)``. ``.data`` is
    # an ``aten.detach`` of the Parameter, which torch made from the ``empty`` below any dispatch mode.
    w = nn.Parameter(torch.empty(rows, cols))
    stdv = (6.0 / (rows + cols)) ** 0.5
    w.data.uniform_(-stdv, stdv)
    return w


@pytest.mark.usefixtures("nan_empty")
def test_parameter_of_empty_initialised_through_data_passes_check_numerics():
    # PyG's GAT, GIN and link-prediction examples stopped at aten.detach in their __init__
    # ("came from outside the recording") whenever the allocator handed back a NaN bit pattern.
    with tg.check_numerics():
        w = _glorot_through_data(8, 8)
        loss = (torch.randn(4, 8) @ w).sum()
        loss.backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("backend", ["python", "native"])
def test_parameter_of_empty_is_unknown_until_written(tmp_path, backend):
    with tg.record(tmp_path / "run", backend=backend, buffer=-1, mode="full_health"):
        w = nn.Parameter(torch.empty(8, 8))
        with torch.no_grad():
            never_written = w.clone()  # a copy of uninitialised memory: unknown
        _glorot_through_data(8, 8)
    assert torch.isnan(never_written).all()
    with tg.open(tmp_path / "run") as run:
        assert run.meta.get("backend") == backend
        detaches = [e for e in run.executions() if e["op"] == "aten.detach"]
        # (the dispatch mode sees ``.data`` as a detach, the native core the one ``Parameter()`` runs)
        assert detaches and all(e["taint"] == "unknown" for e in detaches)
        (clone,) = [e for e in run.executions() if e["op"] == "aten.clone"]
        assert clone["taint"] == "unknown"
        assert run.alerts()["total"] == 0 and run.first_harm() is None


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_model_run_on_an_empty_tensor_is_told_as_uninitialised_memory(tmp_path, backend):
    # ultralytics' get_flops (the model summary YOLO().train() prints at its start and end) hands
    # thop a dummy image made with torch.empty. Where that memory held NaN, `trainguard run` said
    # the convolution "made nan from values the compiled graph computed without a summary of their
    # own (empty)" (nothing was compiled) and "values are overflowing ...: check the scale of the
    # initialisation and of the inputs".
    from trainguard.analysis import origin

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.SiLU(), nn.Conv2d(8, 4, 1))
    with tg.record(tmp_path / "run", backend=backend, mode="full_health"):
        p = next(model.parameters())
        im = torch.empty((1, p.shape[1], 16, 16), device=p.device, dtype=p.dtype)
        with torch.no_grad():
            model(im)
    with tg.open(tmp_path / "run") as run:
        o = origin(run)
        assert o.origin.op == "aten.convolution"
        why = o.origin.explanation
        assert "compiled" not in why and "uninitialised memory" in why and "aten.empty" in why, why
        assert "overflowing" not in o.suggestion and "torch.zeros" in o.suggestion, o.suggestion
