"""The native recorder core: what only it does, and how the Python backend stands in for it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.capture import _native
from trainguard.store import open_run


@pytest.mark.parametrize("backend", ["native", "python"])
def test_autograd_op_sequence_under_each_backend(tmp_path, backend):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        h = torch.tanh(x)
        (model(h).sum() + h.pow(2).sum()).backward()  # h's gradient is the sum of two
    run = open_run(tmp_path / "r")
    bwd = [e["op"] for e in run.executions(phase="backward")]
    if backend == "native":
        # The native core leaves autograd alone: the engine sums the gradients in place.
        assert bwd.count("aten.add_.Tensor") == 1 and "aten.add.Tensor" not in bwd
        assert run.count(op="aten.detach", phase="backward") == 3  # AccumulateGrad's, one per leaf
    else:
        # With any dispatch mode every tensor is subclass-like: out of place, and more detaches.
        assert bwd.count("aten.add.Tensor") == 1 and "aten.add_.Tensor" not in bwd
        assert run.count(op="aten.detach", phase="backward") == 4


def test_native_is_the_default_and_the_run_says_so(tmp_path, capsys):
    with tg.record(tmp_path / "r") as rec:
        torch.exp(torch.ones(3))
    assert rec.backend == "native"
    assert open_run(tmp_path / "r").meta["backend"] == "native"
    from trainguard.cli import main

    assert main(["report", str(tmp_path / "r")]) == 0
    assert "by the native core" in " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    assert '"backend": "native"' in capsys.readouterr().out


def test_check_numerics_runs_on_the_python_backend():
    with pytest.raises(tg.NonFiniteError, match="aten.log"):
        with tg.check_numerics() as rec:
            torch.log(-torch.ones(2))  # NaN: harmful where made (an unread -inf would pass)
    assert rec.backend == "python"
    with pytest.raises(ValueError, match="check_numerics"):
        from trainguard.capture import Recorder

        Recorder(None, check_numerics=True, backend="native")


def test_install_and_remove_fifty_times_in_one_process(tmp_path):
    x = torch.randn(8, 8)
    for i in range(50):
        with tg.record(tmp_path / f"r{i}", buffer=-1, backend="native") as rec:
            torch.relu(x @ x).sum()
        assert rec.recorded == 3, i
    # The callbacks are gone: ops outside a recording reach no core (a new one numbers from 0).
    torch.relu(x)
    with tg.record(tmp_path / "last", buffer=-1, backend="native"):
        torch.exp(x)
    (e,) = open_run(tmp_path / "last").executions()
    assert e["seq"] == 0 and e["op"] == "aten.exp"


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_second_thread_records_only_what_it_records_itself(tmp_path, backend):
    # A recording belongs to the thread that starts it (and the autograd work it launches), as a
    # dispatch mode does: another thread's ops are not in it, and that thread can record its own.
    barrier = threading.Barrier(2)
    errors = []

    def other():
        try:
            barrier.wait()
            for _ in range(20):
                torch.sigmoid(torch.ones(3))  # not recorded: this thread is not recording
            with tg.record(tmp_path / "other", buffer=-1, backend=backend):
                lin = nn.Linear(3, 3)
                lin(torch.ones(2, 3)).sum().backward()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=other)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    with tg.record(tmp_path / "main", buffer=-1, backend=backend):
        t.start()
        barrier.wait()
        for _ in range(20):
            model(torch.ones(2, 3)).sum().backward()
        t.join()
    assert not errors
    main, other_run = open_run(tmp_path / "main"), open_run(tmp_path / "other")
    assert main.count(op="aten.sigmoid") == 0 and other_run.count(op="aten.sigmoid") == 0
    assert main.count(op="aten.tanh") == 20 and other_run.count(op="aten.tanh") == 0
    assert other_run.count(op="aten.addmm") == 1 and main.count(op="aten.addmm") == 20
    assert {e["module"] for e in main.executions(op="aten.tanh")} == {"1"}
    assert other_run.count(phase="backward") > 0


def test_tensor_subclasses_are_left_to_the_python_backend(tmp_path, caplog):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with caplog.at_level(logging.WARNING, logger="trainguard.capture"):
        with tg.record(tmp_path / "r", buffer=-1, backend="native"):
            (nt * 2).values().sum()
            torch.exp(torch.ones(2))
    run = open_run(tmp_path / "r")
    assert run.meta["native_unsure"] > 0
    assert run.count(op="aten.exp") == 1
    assert any("backend='python'" in m for m in caplog.messages)


def test_pausing_keeps_trainguards_own_work_out(tmp_path):
    from trainguard.capture._native._backend import paused

    with tg.record(tmp_path / "r", buffer=-1, backend="native"):
        with paused():
            torch.exp(torch.ones(2))
        torch.log(torch.ones(2))
    assert [e["op"] for e in open_run(tmp_path / "r").executions()] == ["aten.ones", "aten.log"]


FALLBACK = textwrap.dedent(
    """
    import sys, torch, trainguard as tg
    with tg.record(sys.argv[1], buffer=-1) as rec:
        torch.exp(torch.ones(2))
    with tg.record(sys.argv[1] + "-2", buffer=-1) as rec2:
        torch.exp(torch.ones(2))
    print(rec.backend, rec2.backend)
    try:
        tg.record(sys.argv[1] + "-3", backend="native").start()
    except tg.TrainguardError as exc:
        print("native:", exc)
    """
)


def test_without_the_native_core_one_warning_and_the_python_backend(tmp_path):
    import os

    env = dict(os.environ, TRAINGUARD_NO_NATIVE="1")
    env.pop("TRAINGUARD_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", FALLBACK, str(tmp_path / "r")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "python python"
    assert lines[1].startswith("native: the native recorder core is not available: TRAINGUARD_NO_NATIVE")
    assert out.stderr.count("install a C++ compiler (g++) and ninja") == 1
    assert open_run(tmp_path / "r").meta["backend"] == "python"


def test_the_build_is_cached_per_torch_python_and_platform():
    key = _native.build_key()
    assert torch.__version__.replace("+", "_") in key and f"cp{sys.version_info[0]}{sys.version_info[1]}" in key
    assert (_native.build_dir() / "built").exists()
    assert _native.load().__file__.startswith(str(_native.build_dir()))


def test_the_build_compiles_a_snapshot_of_the_sources_its_key_names(tmp_path, monkeypatch):
    # The key is the sources' digest, and a cached build is trusted for ever: the compiler must
    # read exactly the bytes the key was made from. Compiled in place, a source edited during the
    # build (a patch applied or reverted while ninja ran) made a build whose recorder.cpp and
    # module.cpp saw two layouts of the core's tables (issue 16: ``live`` read the wrong fields).
    from torch.utils import cpp_extension

    monkeypatch.setenv("TRAINGUARD_NATIVE_CACHE", str(tmp_path / "cache"))
    seen = {}

    def fake_load(name, sources, extra_include_paths, build_directory, **kw):
        seen["sources"] = sources
        seen["includes"] = extra_include_paths
        seen["dir"] = build_directory
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert _native.build() == "module"
    key_dir = _native.build_dir()
    assert seen["dir"] == str(key_dir)
    for src in seen["sources"]:
        path = Path(src)
        assert path.is_relative_to(key_dir), src  # a copy in the build's own folder
        assert path.read_bytes() == (_native._DIR / path.name).read_bytes()
    assert str(_native._DIR) not in seen["includes"]  # its headers are the copies too
    snap = Path(seen["sources"][0]).parent
    assert all((snap / h).read_bytes() == (_native._DIR / h).read_bytes() for h in _native.HEADERS)
    assert _native.build_key(snap) == key_dir.name  # the copies are what the key names


def _load_as_torch_does(name, sources, extra_include_paths, build_directory, **kw):
    """torch.utils.cpp_extension.load's hold on a build folder (``_jit_compile``): a file
    ``lock`` made with O_EXCL, removed when the build ends; a process that finds it there waits
    until it goes."""
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(os.path.join(build_directory, "lock"))
    if baton.try_acquire():
        baton.release()
    else:
        baton.wait()
    return "module"


def test_a_build_killed_midway_does_not_make_every_later_start_wait_for_ever(tmp_path, monkeypatch):
    # A process killed during the first build (SIGKILL, the OOM killer, a preempted job, a test's
    # timeout) leaves torch's ``lock`` file behind, and torch waits for it to go with no end and no
    # word: every later `trainguard run` and recording hung at its start (found when a killed test
    # suite left one: the next suite's native tests waited 300 s each).
    from torch.utils import cpp_extension

    monkeypatch.setenv("TRAINGUARD_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "load", _load_as_torch_does)
    key_dir = _native.build_dir()
    key_dir.mkdir(parents=True)
    (key_dir / "lock").touch()  # what the killed build left
    result = []
    worker = threading.Thread(target=lambda: result.append(_native.build()), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert result == ["module"], "the build waited on a lock no process holds"


def test_bad_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        tg.record("unused", backend="cuda")


@pytest.mark.parametrize("backend", ["python", "native"])
def test_numbering_goes_on_from_an_earlier_runs_executions(tmp_path, backend):
    # A framework run resumed into its run directory sets the recorder's seq before it starts
    # (integrations/_session.py): the earlier run's executions keep their numbers.
    from trainguard.capture._recorder import Recorder
    from trainguard.store import open_run

    rec = Recorder(tmp_path / "r", buffer=-1, backend=backend)
    rec.seq = 100
    with rec:
        torch.ones(3).neg().exp()
        assert rec.executions == 103  # ones, neg, exp
    with open_run(tmp_path / "r") as run:
        assert [e["seq"] for e in run.executions()] == [100, 101, 102]


def test_the_tables_pool_hands_out_a_block_of_its_own_for_zero_bytes():
    # The pool's size classes are multiples of 64 bytes; a request for 0 bytes (which an
    # allocator may be asked for) must get a block no other request shares, and go back to the
    # list it came from.
    mod = _native.load()
    sizes = [0, 0, 64, 1, 0]
    blocks = mod._pool_blocks(sizes)
    spans = sorted((a, a + max(n, 1)) for a, n in zip(blocks, sizes))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), (blocks, sizes)
    (zero,) = mod._pool_blocks([0])
    assert mod._pool_blocks([1]) == [zero]  # freed into the smallest class, handed out again


FORK = textwrap.dedent(
    """
    import os, sys, threading, time, torch, trainguard as tg
    from trainguard.store import open_run

    out = sys.argv[1]
    stop, recording = threading.Event(), threading.Event()

    def busy():  # another thread recording: its callbacks take the pool's lock all the time
        with tg.record(out + "/busy", buffer=-1, backend="native"):
            x = torch.randn(16, requires_grad=True)
            recording.set()
            while not stop.is_set():
                (x * 2).exp().sum().backward()

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worker = threading.Thread(target=busy)
    worker.start()
    recording.wait()  # its start is over (the run store's own lock is not taken around a fork)
    with tg.record(out + "/parent", buffer=-1, backend="native") as rec:
        y = model(torch.ones(2, 4))
        y.sum().backward()
        opt.step()
        for _ in range(3):
            torch.randn(3).exp()  # dead outputs: the child's sweep would free their entries
        codes = []
        for i in range(4):
            if i == 0:
                rec._native.core._hold_locks(1.0)  # as a thread inside a callback when the fork comes
            pid = os.fork()
            if pid == 0:  # a child (a DataLoader worker): it inherits the parent's cores
                y.tolist()  # a read: asks the recorder who made y
                model(torch.ones(2, 4)).sum().backward()
                opt.step()  # a step: the recorder's per-step sweep
                with tg.record(out + f"/child{i}", buffer=-1, backend="native") as child:
                    torch.ones(3).exp()
                os._exit(0 if child.backend == "native" else 3)
            deadline = time.monotonic() + 20
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes.append(os.waitstatus_to_exitcode(status))
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    codes.append("hung")
                    break
                time.sleep(0.02)
    stop.set()
    worker.join()
    print(codes)
    print([open_run(out + f"/child{i}").count(op="aten.exp") if os.path.isdir(out + f"/child{i}") else None
           for i in range(4)])
    print(open_run(out + "/parent").count(op="aten.exp"))
    """
)


def test_a_child_forked_while_other_threads_hold_the_cores_locks_goes_on(tmp_path):
    # A fork copies a lock as it is: held by a thread that does not exist in the child, it stays
    # held there for ever. DataLoader workers are forked while the training thread's core, its
    # drain thread and other recording threads hold the core's, the operators' and the pool's
    # locks: a child must never wait for one of them, and a recording it starts must work.
    out = subprocess.run([sys.executable, "-c", FORK, str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    codes, child_exps, parent_exps = out.stdout.splitlines()[-3:]
    assert codes == "[0, 0, 0, 0]"  # "hung": a child waited for a lock no thread of its own held
    assert child_exps == "[1, 1, 1, 1]"  # each child records its own run
    assert parent_exps == "3"  # the children's ops are not in the parent's run


def test_the_summary_kernel_reads_no_memory_a_fake_or_functional_tensor_does_not_have():
    # A compiler's fake tensors (and functional wrappers of them) have no data: the kernel read
    # address 0 (a segmentation fault) when the Python recorder's mode was handed one.
    code = textwrap.dedent("""
        import math, warnings
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
        from trainguard.capture import _native
        warnings.simplefilter("ignore")
        core = _native.load()
        fake = FakeTensorMode().from_tensor(torch.ones(400))
        with FunctionalTensorMode():
            functional = FunctionalTensor.to_functional(torch.ones(400))
        for t in (fake, functional, fake[::2]):
            for mode in (1, 2, 3, 6):
                s = core.summarize(t, mode, False)
                assert all(math.isnan(v) for v in s[1:]), (type(t), mode, s)
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout, p.stderr[-2000:])


def test_dead_producers_are_swept_every_step(tmp_path):
    # Sweeping only once the table had grown by half (tried for cleanrl's PPO, whose rollout grows
    # it) kept dead entries, and memory with them, across steps: the transformer block's peak RSS
    # under full_health went from 1.05x plain to 1.37x. After a step, the table holds the tensors
    # still alive, not the steps' dead ones.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = []
    with tg.record(tmp_path / "r", mode="full_health", backend="native") as rec:
        for _ in range(30):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            sizes.append(rec._native.core.counts()["producers"])
    assert max(sizes[5:]) < 200 and max(sizes[5:]) <= 2 * min(sizes[5:]), sizes


QUANTIZED_SWEEP = """
import sys, warnings, weakref
import torch
import trainguard as tg
warnings.simplefilter("ignore")  # quantized tensors are deprecated in favour of torchao
w = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([w], lr=0.1)
calls = []
with tg.record(sys.argv[1], buffer=-1, backend="native") as rec:
    core = rec._native.core
    for step in range(3):
        q = torch.quantize_per_channel(torch.randn(4, 3), torch.rand(4, dtype=torch.double) + 0.1,
                                       torch.zeros(4, dtype=torch.long), 0, torch.qint8)
        scales = q.q_per_channel_scales()  # now a tensor with a Python object, held by q's quantizer
        weakref.finalize(scales, lambda: calls.append(core.pending()))  # Python that takes the lock
        del q, scales  # the core's weak reference is the last: the QTensorImpl is not destroyed yet
        (w * 2).sum().backward()
        opt.step()  # the per-step sweep drops that reference: ~QTensorImpl frees the scales
print(rec.backend, len(calls))
"""


def test_a_quantized_tensor_the_sweep_destroys_runs_python_outside_the_cores_lock(tmp_path):
    # pytorch/tutorials' static quantization tutorial (QAT, section 5) converts its model to a
    # quantized copy every epoch: per-channel quantized weights whose quantizers hold their scales,
    # tensors with a Python object once Python has read them. The core's weak reference outlived
    # the tensor, so the per-step sweep ran ~QTensorImpl, and with it the scales' Python
    # deallocation, while it held the core's lock: torch lets the GIL go inside that, the writer
    # thread took the GIL and waited for the lock in its drain, the training thread waited for
    # the GIL, and `trainguard run --monitor` of the tutorial hung for good in its first epoch.
    # A weakref callback on the scales runs Python at that moment every time; it takes the lock.
    try:
        p = subprocess.run([sys.executable, "-c", QUANTIZED_SWEEP, str(tmp_path / "r")], capture_output=True,
                           text=True, timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("the recording hung at the first step's sweep (the core's lock held while ~QTensorImpl ran Python)")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["native", "3"]  # each step's scales freed, with the lock free to take
