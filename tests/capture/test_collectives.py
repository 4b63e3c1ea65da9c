"""Recording leaves no trace on the program's tensors and issues no collective of its own.

Under ``torch.distributed`` every rank must run the same collectives in the same order: a
recorder that changes how a tensor behaves (here: whether its storage can grow) makes one rank
fail inside a collective while the others wait for it forever.
"""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard.capture._summary import summarize_immediate, summarize_numpy


def _grow(t: torch.Tensor) -> None:
    t.resize_(t.numel() * 4 + 16)  # needs a new, larger allocation


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.uint8, torch.int64])
@pytest.mark.parametrize("mode", ["curt_health", "full_health", "stats"])
def test_a_summarised_tensor_can_still_grow(dtype, mode, kernel, monkeypatch):
    t = torch.ones(5, dtype=dtype)
    (summarize_immediate if kernel else summarize_numpy)(t, mode)  # the native kernel, or NumPy
    _grow(t)
    assert t.numel() == 36


def test_recorded_outputs_can_still_grow(tmp_path):
    # torch.distributed.gather_object grows the byte tensor of a pickled object this way: a
    # recorder that pins it makes the collective fail on one rank only (DCP's save hung).
    with tg.record(tmp_path / "r", mode="full_health"):
        storage = torch.ByteStorage._from_buffer(b"abc")
        bytes_ = torch.ByteTensor(storage)
        _grow(bytes_)
        floats = torch.randn(3, 4).t()
        _grow(floats)
    assert bytes_.numel() == 28 and floats.numel() == 64


@pytest.mark.parametrize("backend", ["python", "native"])
def test_what_a_collective_writes_is_never_read_and_becomes_its_output(tmp_path, one_rank, backend):
    dist = one_rank
    inp = torch.arange(4.0)
    gathered = torch.empty(4)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        reduced = torch.ones(3)
        dist.all_reduce(reduced, async_op=True).wait()
        # The values of an asynchronous collective arrive while another thread writes them:
        # a summary taken when the op returns would be a race.
        dist.all_gather_into_tensor(gathered, inp, async_op=True).wait()
        (reduced * 2).sum()
    run = tg.open(tmp_path / "r")
    by_op = {e["op"]: e for e in run.executions()}
    for op, shape in (("c10d.allreduce_", [3]), ("c10d._allgather_base_", [4])):
        e = by_op[op]
        out = e["outputs"][0]
        assert out["shape"] == shape and e["health"] == []
        assert out["summary"]["size"] == shape[0] and out["summary"]["pos"] != out["summary"]["pos"]  # unknown: NaN
    consumer = run.execution(by_op["aten.mul.Tensor"]["seq"])
    assert consumer["inputs"][0]["kind"] == "op"
    assert consumer["inputs"][0]["producer"] == by_op["c10d.allreduce_"]["seq"]


@pytest.mark.parametrize("backend", ["python", "native"])
def test_dtensor_outputs_are_summarised_from_this_ranks_shard(tmp_path, one_rank, backend):
    # The dispatch mode records DTensor's calls, summarised from this rank's shard; the native
    # core the calls DTensor makes on that shard, which are the same ops here; not the calls on
    # fake tensors by which DTensor propagates shardings.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    shape = [3, 2] if backend == "python" else [2, 3]  # (DTensor caches the shardings it propagated)
    dt = distribute_tensor(torch.arange(6.0).reshape(shape), mesh, [Shard(0)])
    with tg.record(tmp_path / "r", buffer=-1, backend=backend) as rec:
        (dt * 2 - 4).relu()
    assert rec.failures == 0
    run = tg.open(tmp_path / "r")
    assert [e["op"] for e in run.executions()] == ["aten.mul.Tensor", "aten.sub.Tensor", "aten.relu"]
    relu = run.executions(op="relu")[0]["outputs"][0]
    assert relu["shape"] == shape
    assert (relu["summary"]["zero"], relu["summary"]["pos"]) == (3, 3)  # 2x - 4 for x in 0..5


@pytest.mark.parametrize("backend", ["python", "native"])
def test_recorded_and_monitored_parameters_can_still_be_swapped(tmp_path, backend):
    # torch.utils.swap_tensors refuses a tensor with any weak reference; module.to_empty() and to()
    # swap DTensor parameters (FSDP2's meta-device recipe), and every parameter under
    # torch.__future__.set_swap_module_params_on_conversion(True). The recorder and the monitor
    # hold tensors weakly: they must let go for the swap, and keep watching the same parameter.
    # The native core's weak references are C++ ones, which swap_tensors refuses as well.
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with tg.record(tmp_path / "r", buffer=-1, backend=backend), tg.Monitor(None, tmp_path / "r", every=1) as mon:
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
            model.to_empty(device="cpu")  # a swap of every parameter
            for m in model:
                m.reset_parameters()
            weight = model[0].weight
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(torch.randn(5, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
            model.to(torch.float64)  # another swap, after the monitor attached
            assert model[0].weight is weight  # swapping keeps the parameter object
            model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
            opt.step()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert torch.utils.swap_tensors.__module__ == "torch.utils"  # put back when recording ended
    assert mon.findings is not None
    with tg.open(tmp_path / "r") as run:
        assert run.meta.get("record_errors") is None
        norms = run.layer_stats(layer="0.weight", kind="gradient", stat="norm")
        assert [r["step"] for r in norms] == [0, 1, 2]  # the swapped parameter is still watched
        addmm = run.execution(run.executions(op="addmm")[-1]["seq"])
        assert [i["kind"] for i in addmm["inputs"]][:1] == ["param"]  # and still named


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_collective_passes_on_the_harm_it_sends_and_its_reader_judges_what_it_wrote(tmp_path, one_rank, backend):
    # A collective's outputs hold what the other ranks send, after it returns: what this rank
    # sent harmful taints them (one origin, not a new one at the next reader); memory that was
    # unknown before it (a DDP bucket, allocated, written through views) is not garbage after it.
    dist = one_rank
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        nan = torch.zeros(4) / torch.zeros(4)  # 0/0: the origin
        dist.all_reduce(nan)
        nan + 1
        bucket = torch.empty(4)
        bucket.narrow(0, 0, 4).copy_(torch.zeros(4))  # written through a view, as DDP fills its buckets
        dist.all_reduce(bucket)
        bucket.numpy()[1] = float("nan")  # "from another rank": no op of this one wrote it
        bucket.clone()
    run = tg.open(tmp_path / "r")
    ops = [(e["op"], e["seq"]) for e in run.executions()]
    (div,), (reduce1, reduce2), (add,), (clone,) = ([s for op, s in ops if op == name] for name in (
        "aten.div.Tensor", "c10d.allreduce_", "aten.add.Tensor", "aten.clone"))
    assert run.execution(reduce1)["taint"] == "harmful"
    assert run.execution(add)["origin"] == div  # passed on: still the div's
    assert run.execution(reduce2)["taint"] == "finite"
    got = run.execution(clone)
    assert got["taint"] == "harmful" and got["outputs"][0]["summary"]["nan"] == 1  # read for real, not unknown
    assert got["origin"] == clone and got["inputs"][0]["producer"] == reduce2  # received: what the all-reduce wrote


def _ddp_program():
    # DistributedDataParallel's reducer all-reduces gradient buckets from autograd hooks, in
    # backward; the other collectives are the ones users call: a list all-gather (a list of
    # lists out), a broadcast, and an all-reduce that hands back a Work to wait for.
    import torch.distributed as dist
    from tests_capture_crosscheck import sgd_program
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    train = sgd_program(DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))))

    def program():
        train()
        flag = torch.ones(2)
        dist.broadcast(flag, 0)
        parts = [torch.empty(2)]
        dist.all_gather(parts, flag * 3)
        dist.all_reduce(parts[0], async_op=True).wait()
        parts[0].sum()
    return program


def test_a_distributed_job_records_with_the_native_core(tmp_path, one_rank):
    with tg.record(tmp_path / "r", buffer=-1):
        t = torch.ones(3)
        one_rank.all_reduce(t)
    with tg.open(tmp_path / "r") as run:
        assert run.meta["backend"] == "native"
        assert run.count(op="c10d.allreduce_") == 1


def test_both_backends_record_ddp_and_collectives_alike(tmp_path, one_rank):
    from tests_capture_crosscheck import crosscheck

    problems, _, py, nat = crosscheck(_ddp_program, tmp_path, "full_health")
    assert not problems, "\n".join(problems[:20])
    ops = [r[3] for r in nat["records"]]  # (seq, step, phase, op, ...)
    for op in ("c10d.allreduce_.default", "c10d.broadcast_.default", "c10d.allgather_.default"):
        assert op in ops
    allreduce = next(r for r in nat["records"] if r[3] == "c10d.allreduce_.default")
    assert allreduce[2] == "backward"  # DDP's bucket, reduced from a gradient hook
