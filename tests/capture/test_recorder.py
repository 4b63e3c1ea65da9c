"""The recorder: what each execution carries, modes, buffer, filters, validation."""

from __future__ import annotations

import re
import sys
import time

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import CorruptRun
from trainguard.store import MODE_FIELDS, open_run


def test_records_forward_backward_optimizer_in_order(tmp_path, net, train):
    with tg.record(tmp_path / "r", buffer=-1) as rec:
        train(net, steps=2)
    run = open_run(tmp_path / "r")
    rows = run.executions()
    assert len(rows) == run.count() == rec.recorded > 50
    seqs = [r["seq"] for r in rows]
    assert seqs == sorted(seqs)
    phases = [r["phase"] for r in rows if r["step"] == 0]
    # forward first, then backward, then the optimizer; the step advances with optimizer.step()
    first = {p: phases.index(p) for p in ("forward", "backward", "optimizer")}
    assert first["forward"] < first["backward"] < first["optimizer"]
    assert {r["step"] for r in rows} == {0, 1}
    assert run.meta["status"] == "finished"


def test_module_paths_forward_and_backward(tmp_path, net, train):
    with tg.record(tmp_path / "r", buffer=-1):
        train(net, steps=1)
    run = open_run(tmp_path / "r")
    fwd = {r["module"] for r in run.executions(phase="forward") if r["module"] is not None}
    assert {"encoder.0.proj", "encoder.1.act", "head"} <= fwd
    bwd = run.executions(phase="backward", op="tanh_backward")
    assert {r["module"] for r in bwd} == {"encoder.0.act", "encoder.1.act"}
    assert all(r["fwd_seq"] is not None for r in bwd)
    # a backward op inherits the stack of its forward op
    for r in bwd:
        assert r["stack_id"] == run.execution(r["fwd_seq"])["stack_id"]


class _Agent(nn.Module):
    """cleanrl ppo.py's Agent (vwxyzjn/cleanrl): no forward; the loop calls its actor and critic."""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _linear_names(run) -> tuple[set, set]:
    """The modules the forward ``addmm`` ops (the Linear layers) ran in, and the names of their parameters."""
    ops = run.executions(phase="forward", op="addmm")
    params = {i["name"] for e in ops for i in run.execution(e["seq"])["inputs"] if i["kind"] == "param"}
    return {r["module"] for r in ops}, params


class _Policy(nn.Module):
    """Stable-Baselines3's SACPolicy: a forward of its own, while SAC.train calls its critic and
    the actor's members directly."""

    def __init__(self):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, obs):
        return self.actor(obs)


@pytest.mark.parametrize("holder", [_Agent, _Policy])
@pytest.mark.parametrize("backend", ["native", "python"])
def test_module_paths_of_models_called_inside_a_container(tmp_path, backend, holder):
    # Recorded, cleanrl's PPO named the actor and the critic both "" and their layers both "0".."4":
    # an op of the critic's first layer could not be told from one of the actor's. SB3's SAC, whose
    # policy has a forward of its own, named its critic's first layer "0", like the actor's.
    agent = holder()
    x = torch.randn(3, 4)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        (agent.actor(x).sum() + agent.critic(x).sum()).backward()
    modules, params = _linear_names(open_run(tmp_path / "r"))
    assert modules == {"actor.0", "actor.2", "critic.0", "critic.2"}
    assert params == {"actor.0.bias", "actor.2.bias", "critic.0.bias", "critic.2.bias"}


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_target_network_of_the_policys_type_is_named_by_the_scripts_variable(tmp_path, backend):
    # cleanrl's dqn.py (vwxyzjn/cleanrl @fe8d8a0) under `trainguard run --monitor`: q_network and
    # target_network are both QNetwork, called at the top of the script; the recorder named both
    # one's layers "network.0".."network.4" (a NaN in the target's forward could not be told from
    # one in the trained network's), while the monitor names the target's "target_network.network.0".
    q_network = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    target_network = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    target_network.load_state_dict(q_network.state_dict())
    x = torch.randn(3, 4)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        with torch.no_grad():
            q_network(x[:1]).argmax(1)  # the rollout's greedy action
            target = target_network(x).max(1).values
        (q_network(x).max(1).values - target).pow(2).mean().backward()
    modules, params = _linear_names(open_run(tmp_path / "r"))
    assert modules == {"0", "2", "target_network.0", "target_network.2"}, modules
    assert params == {"0.bias", "2.bias", "target_network.0.bias", "target_network.2.bias"}, params


@pytest.mark.parametrize("backend", ["native", "python"])
def test_module_paths_inside_a_ddp_wrapper(tmp_path, one_rank, backend):
    # DistributedDataParallel calls the model it wraps as ``self.module``: its ops were named
    # "module.0", "module.2", while the model's own state_dict (and trainguard's checkpoint, which
    # strips DDP's prefix) says "0.weight". DDP is a wrapper, as torch.compile's is.
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        ddp(torch.randn(3, 4)).sum().backward()
    modules, params = _linear_names(open_run(tmp_path / "r"))
    assert modules == {"0", "2"}
    assert params == {"0.bias", "2.bias"}


@pytest.mark.parametrize("backend", ["native", "python"])
def test_module_paths_inside_an_activation_checkpoint_wrapper(tmp_path, backend):
    # torchtune's training.set_activation_checkpointing wraps each transformer layer in torch's
    # CheckpointWrapper (``_checkpoint_wrapped_module``): its ops were named
    # "1._checkpoint_wrapped_module.0", the recomputed forward's too, where the model's state_dict
    # says "1.0.weight".
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    model[1] = checkpoint_wrapper(model[1])
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model(torch.randn(3, 4)).sum().backward()
    modules, params = _linear_names(open_run(tmp_path / "r"))
    assert modules == {"0", "1.0", "2"}
    assert params == {"0.bias", "1.0.bias", "2.bias"}


def test_ops_inside_a_non_reentrant_checkpoint_run_under_the_native_core(tmp_path):
    # torchtune's set_activation_checkpointing (torch's checkpoint_wrapper, use_reentrant=False),
    # recorded by the native core: the backward's recompute stops early by raising
    # _StopRecomputationError from its pack hook inside the last op it needs (tanh, relu, mul
    # alike); that op's end callback, symbolising a stack not seen before, called Python and
    # cleared the pending error, and backward() raised "SystemError: <built-in method tanh ...>
    # returned NULL without setting an exception". The Python backend recorded it.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    with tg.record(tmp_path / "r", buffer=-1, backend="native"):
        checkpoint(lambda t: torch.tanh(lin(t)), x, use_reentrant=False).sum().backward()
    run = open_run(tmp_path / "r")
    assert run.count(op="aten.tanh") == 2  # the forward and its recompute


@pytest.mark.parametrize("backend", ["native", "python"])
def test_module_paths_inside_an_opacus_grad_sample_module(tmp_path, backend):
    # opacus' examples/mnist.py recorded: make_private's GradSampleModule calls the model as
    # ``self._module``, and its ops were named "_module.conv1", "_module.fc2", where the model's
    # own state_dict says "conv1.weight".
    import dp_models

    model = dp_models.GradSampleModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model(torch.randn(3, 4)).sum().backward()
    modules, params = _linear_names(open_run(tmp_path / "r"))
    assert modules == {"0", "2"}
    assert params == {"0.bias", "2.bias"}


def test_stack_points_at_user_line_and_source_is_stored_once(tmp_path):
    x = torch.ones(3)
    with tg.record(tmp_path / "r", buffer=-1):
        for _ in range(3):
            y = torch.exp(x)  # the line to find
    line = next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if "the line to find" in t)
    run = open_run(tmp_path / "r")
    exps = run.executions(op="exp")
    assert len(exps) == 3 and len({e["stack_id"] for e in exps}) == 1
    frame = run.user_frame(exps[0]["stack_id"])
    assert frame["filename"] == __file__ and frame["lineno"] == line
    paths = [f["path"] for f in run.source_files()]
    assert paths.count(__file__) == 1
    assert "the line to find" in run.source(__file__)
    assert y.sum() > 0


def test_producers_params_and_inputs(tmp_path):
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with tg.record(tmp_path / "r", buffer=-1):
        h = lin(x)
        z = torch.relu(h)
    run = open_run(tmp_path / "r")
    relu = run.executions(op="relu")[0]
    full = run.execution(relu["seq"])
    (inp,) = full["inputs"]
    assert inp["kind"] == "op" and inp["producer_digest"]["op"] == "aten.addmm"
    addmm = run.execution(inp["producer"])
    kinds = [(i["kind"], i.get("name")) for i in addmm["inputs"]]
    assert ("param", "bias") in kinds and ("input", None) in kinds
    assert [c["seq"] for c in run.consumers(addmm["seq"])] == [relu["seq"]]
    assert [p["seq"] for p in run.producers(relu["seq"])] == [addmm["seq"]]
    assert z.shape == (4, 2)


class ScaledSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class UsesFunction(nn.Module):
    def forward(self, x):
        return ScaledSquare.apply(x)


def test_custom_autograd_function(tmp_path):
    x = torch.randn(5, requires_grad=True)
    with tg.record(tmp_path / "r", buffer=-1):
        UsesFunction()(x).sum().backward()
    run = open_run(tmp_path / "r")
    fwd_mul = run.executions(op="mul.Tensor", phase="forward")
    bwd_mul = run.executions(op="mul.Tensor", phase="backward")
    assert fwd_mul and len(bwd_mul) >= 2
    # no forward op made the Function's node (its apply did): its backward's ops are at the
    # backward's own line, in the module that applied it (tests/capture/test_function_backward.py)
    assert all(r["fwd_seq"] is None and r["module"] == "" for r in bwd_mul)
    line = ScaledSquare.backward.__code__.co_firstlineno + 3
    assert {run.user_frame(r["stack_id"])["lineno"] for r in bwd_mul} == {line}
    assert torch.allclose(x.grad, 2 * x.detach())


@pytest.mark.parametrize("mode", list(MODE_FIELDS))
def test_every_mode_records_its_fields(tmp_path, mode):
    x = torch.tensor([[0.0, -1.0, 2.0]])
    with tg.record(tmp_path / "r", mode=mode, buffer=-1):
        y = x * 2
    run = open_run(tmp_path / "r")
    (e,) = run.executions(op="mul.Tensor")
    out = e["outputs"][0]
    assert out["dtype"] == "float32" and out["shape"] == [1, 3] and out["device"] == "cpu"
    fields = MODE_FIELDS[mode]
    if fields:
        assert set(out["summary"]) == set(fields)
    else:
        assert out["summary"] is None
    if "zero" in fields:
        assert (out["summary"]["neg"], out["summary"]["zero"], out["summary"]["pos"]) == (1, 1, 1)
    if mode == "stats":
        assert out["summary"]["min"] == -2.0 and out["summary"]["max"] == 4.0
    if mode == "full_tensor":
        assert torch.equal(run.tensor(e["seq"]), y)
    else:
        with pytest.raises(KeyError, match="no stored tensor"):
            run.tensor(e["seq"])


def test_stored_tensor_damaged_or_missing(tmp_path):
    with tg.record(tmp_path / "r", mode="full_tensor", buffer=-1):
        torch.ones(3) * 2
    run = open_run(tmp_path / "r")
    (e,) = run.executions(op="mul")
    path = run.payload_path(e["seq"], 0)
    assert path.parent == (tmp_path / "r" / "tensors").resolve()
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptRun, match="cut short"):
        run.tensor(e["seq"])
    path.unlink()
    with pytest.raises(CorruptRun, match="missing"):
        run.tensor(e["seq"])


def test_circular_buffer_keeps_last_n_plus_pinned_chain(tmp_path):
    x = torch.ones(4)
    zero = torch.zeros(4)
    with tg.record(tmp_path / "r", buffer=10):
        a = torch.softmax(x, 0) * 0  # producer of the zeros, long before the end
        bad = torch.log(a)  # the first -inf: pending until the program reads it
        for _ in range(50):
            x = x + 1  # finite ops that push everything else out of the buffer
        total = bad.sum()
        for _ in range(50):
            x = x + 1
        total.item()  # the read makes the -inf harmful
        _ = zero + 1
    run = open_run(tmp_path / "r")
    rows = run.executions()
    pinned = [r for r in rows if r["taint"] == "harmful"]
    assert [r["op"] for r in pinned] == ["aten.log", "aten.sum", "aten._local_scalar_dense"]
    assert all(r["origin"] == pinned[0]["seq"] for r in pinned)
    # the producer of the pinned log is kept, then exactly the last 10 executions
    log = run.execution(pinned[0]["seq"])
    assert log["inputs"][0]["producer_digest"]["op"] == "aten.mul.Tensor"
    last = rows[-10:]  # the window, which holds the read itself
    assert [r["seq"] for r in last] == list(range(last[0]["seq"], last[0]["seq"] + 10))
    assert [r["op"] for r in rows[:-10] if r["taint"] == "finite"] == ["aten.mul.Tensor"]
    assert run.first_harm()["seq"] == pinned[-1]["seq"] and run.first_harm()["reason"] == "read"
    assert bad.isinf().all()


def test_an_inf_nobody_uses_is_not_pinned(tmp_path):
    x = torch.ones(4)
    with tg.record(tmp_path / "r", buffer=10):
        torch.log(x * 0)  # -inf, never reaching a sink
        for _ in range(50):
            x = x + 1
    run = open_run(tmp_path / "r")
    assert run.count() == 10 and run.first_harm() is None and run.alerts()["total"] == 0
    assert run.intended() == [{"kind": "-inf", "made_by": "aten.log.default", "absorbed_by": None,
                               "values": 4, "executions": 1}]


def test_filters(tmp_path):
    x = torch.randn(4)
    with tg.record(tmp_path / "a", ops=r"aten\.(exp|log)\.", buffer=-1):
        torch.log(torch.exp(x).abs() + 1)
    assert {r["op"] for r in open_run(tmp_path / "a").executions()} == {"aten.exp", "aten.log"}
    with tg.record(tmp_path / "b", dtypes=["int64"], buffer=-1):
        (x > 0).long().sum()
        x * 2
    ops = {r["op"] for r in open_run(tmp_path / "b").executions()}
    assert "aten._to_copy" in ops and "aten.mul.Tensor" not in ops


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "everything"}, "mode must be one of"),
        ({"buffer": -2}, "buffer must be -1"),
        ({"buffer": 0}, "buffer must be -1"),
        ({"ops": "aten.(log"}, "ops must be a valid regular expression"),
        ({"dtypes": ["float33"]}, "dtypes must name torch dtypes"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        tg.record(tmp_path / "r", **kwargs)
    bad = list(kwargs.values())[0]
    assert repr(bad if not isinstance(bad, list) else bad[0]) in str(info.value)


@pytest.mark.parametrize("open_", [tg.record, tg.check_numerics])  # check_numerics refused overwrite= once
def test_existing_run_is_not_overwritten(tmp_path, open_):
    with open_(tmp_path / "r"):
        torch.ones(2) + 1
    with pytest.raises(tg.TrainguardError, match="already holds a run"):
        open_(tmp_path / "r").start()
    with open_(tmp_path / "r", overwrite=True):
        torch.ones(2) * 3
    assert [r["op"] for r in open_run(tmp_path / "r").executions()][-1] == "aten.mul.Tensor"


def test_enable_disable(tmp_path):
    tg.enable(tmp_path / "r", buffer=-1)
    try:
        torch.ones(3).exp()
        with pytest.raises(RuntimeError, match="already recording"):
            tg.enable(tmp_path / "other")
    finally:
        tg.disable()
    torch.ones(3).sin()  # not recorded: disabled
    ops = [r["op"] for r in open_run(tmp_path / "r").executions()]
    assert "aten.exp" in ops and "aten.sin" not in ops
    tg.disable()  # a second disable is a no-op


def test_manual_step(tmp_path):
    with tg.record(tmp_path / "r", buffer=-1):
        for i in range(3):
            tg.step(i * 10)
            torch.ones(1).exp()
    assert [r["step"] for r in open_run(tmp_path / "r").executions(op="exp")] == [0, 10, 20]
    with pytest.raises(ValueError, match="non-negative int"):
        tg.step(-1)


def test_recording_keeps_no_tensor_alive(tmp_path):
    import gc
    import weakref

    with tg.record(tmp_path / "r", buffer=-1):
        t = torch.randn(100, 100) * 2
        ref = weakref.ref(t)
        del t
        gc.collect()
        assert ref() is None


def test_own_module_frames_not_user(tmp_path):
    with tg.record(tmp_path / "r", buffer=-1):
        torch.ones(2).exp()
    run = open_run(tmp_path / "r")
    frames = run.stack(run.executions(op="exp")[0]["stack_id"])
    assert frames[-1]["user"] and frames[-1]["filename"] == __file__
    assert not any("trainguard/capture" in f["filename"] for f in frames)
    assert sys.modules["trainguard.capture"]


def test_ops_reach_disk_when_the_program_stops_making_ops(tmp_path):
    """The writer's idle poll hands pending records over: nothing waits for the next op or step."""
    with tg.record(tmp_path / "r", buffer=100):
        torch.ones(3).exp()
        deadline = time.time() + 10
        seen = 0
        while time.time() < deadline and not seen:
            time.sleep(0.3)
            with open_run(tmp_path / "r") as run:
                seen = run.count()
        assert seen >= 1


def test_nan_storm_keeps_the_first_nan_and_the_window(tmp_path):
    """Once NaN is everywhere every execution is harmful: the first NaN's chain stays pinned,
    the rest is counted, and the finite window is still exactly the last N."""
    x = torch.ones(4)
    with tg.record(tmp_path / "r", buffer=20):
        for _ in range(40):
            x = x + 1  # finite history the buffer evicts
        bad = torch.log(x * 0) * 0  # the first NaN: 0 * -inf, the -inf from a product of zeros
        for _ in range(300):
            bad = bad * 2  # a storm of harmful executions, many batches of them
        for _ in range(30):
            x = x + 1
    run = open_run(tmp_path / "r")
    harm = run.first_harmful()
    assert harm["op"] == "aten.mul.Tensor" and harm["taint"] == "harmful"
    log = run.execution(harm["origin"])
    assert log["op"] == "aten.log" and log["inputs"][0]["producer_digest"]["op"] == "aten.mul.Tensor"
    rows = run.executions()
    finite = [r for r in rows if r["taint"] == "finite"]
    assert len(finite) == 21  # the last 20 plus the pinned producer of the -inf
    assert [r["op"] for r in rows if r["taint"] == "harmful"] == ["aten.log", "aten.mul.Tensor"]
    alerts = run.alerts()
    assert alerts["total"] == 302 and alerts["first_seq"] == log["seq"] and alerts["harm_seq"] == harm["seq"]
    assert {a["op"]: a["count"] for a in alerts["by_op"]} == {"aten.log": 1, "aten.mul.Tensor": 301}


def test_a_loop_without_optimizer_step_keeps_memory_bounded(tmp_path, monkeypatch):
    """Forward nodes are pruned per step; a hand-written update loop never makes one."""
    from trainguard.capture import _recorder_mode

    monkeypatch.setattr(_recorder_mode, "FWD_NODES_MAX", 50)
    m = nn.Linear(8, 2)
    x = torch.randn(4, 8)
    with tg.record(tmp_path / "r", buffer=-1) as rec:
        for _ in range(200):
            m(x).pow(2).mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
        assert len(rec.fwd_nodes) <= 50
    run = open_run(tmp_path / "r")
    last = [e for e in run.executions(phase="backward")[-8:] if e["op"] != "aten.detach"]  # not AccumulateGrad
    assert last and all(e["fwd_seq"] is not None for e in last)  # the newest forward ops are still known


def _exp_of(t):
    return torch.exp(t)


def _two_calls(x):
    a = _exp_of(x)  # first call
    b = _exp_of(x)  # second call
    return a, b


def test_stack_of_a_helper_called_twice_from_one_frame_names_each_call_line(tmp_path):
    # The stack cache is per calling activation; the caller's line moves between the two calls.
    with tg.record(tmp_path / "r", buffer=-1):
        _two_calls(torch.ones(2))
    src = open(__file__).read().splitlines()
    first = next(i for i, t in enumerate(src, 1) if "# first call" in t)
    run = open_run(tmp_path / "r")
    exps = run.executions(op="exp")
    callers = [run.stack(e["stack_id"])[-2]["lineno"] for e in exps]
    assert callers == [first, first + 1]


@pytest.mark.parametrize("backend", ["python", "native"])
def test_shipping_device_summaries_at_a_step_is_not_recorded(tmp_path, monkeypatch, backend):
    """A flush at a step boundary stacks the device summaries (torch.stack) while the recording
    is active: trainguard's own ops must not be recorded, or they add a row to the batch being
    shipped and the next batch's rows no longer match its records (an IndexError in the writer,
    seen intermittently: the step's flush is due only after FLUSH_SECONDS)."""
    from trainguard.capture import _recorder_mode

    monkeypatch.setattr(_recorder_mode, "FLUSH_SECONDS", 0.0)  # every step flushes
    x = torch.ones(4)
    with tg.record(tmp_path / "r", mode="stats", buffer=-1, strategy="deferred", backend=backend):
        for step in range(4):
            tg.step(step)
            x = x * 2
    run = open_run(tmp_path / "r")
    assert run.meta.get("writer_error") is None
    ops = [e["op"] for e in run.executions(0, 100)]
    assert ops == ["aten.mul.Tensor"] * 4
    assert [e["outputs"][0]["summary"]["max"] for e in run.executions(0, 100)] == [2.0, 4.0, 8.0, 16.0]


def test_a_recorder_left_started_is_stopped_at_exit(tmp_path):
    # `rec = tg.record(d); rec.start()` around a compiled model, never stopped: the process aborted
    # at exit ("terminate called without an active exception", exit 134) and the run stayed "running".
    import subprocess
    import textwrap

    script = tmp_path / "left_open.py"
    script.write_text(textwrap.dedent(f"""
        import torch, trainguard as tg
        rec = tg.record({str(tmp_path / "r")!r}, buffer=-1)
        rec.start()
        m = torch.compile(torch.nn.Linear(4, 4))
        m(torch.randn(2, 4)).sum().backward()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = open_run(tmp_path / "r")
    assert run.status == "finished" and run.count() > 0
