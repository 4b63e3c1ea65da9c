"""One owner per checkpoint directory, for the manager's life, named when a second one is refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from trainguard import CheckpointError
from trainguard.resilience import CheckpointManager, TrainState, list_checkpoints

from .conftest import make_state, train_steps

HOLDER = textwrap.dedent("""
    import os, sys, time
    import torch
    from trainguard.resilience import CheckpointManager, TrainState
    m = CheckpointManager(sys.argv[1])
    loop = m.resume(TrainState(model=torch.nn.Linear(2, 2)), total_steps=5)
    child = os.fork() if "--fork" in sys.argv else -1  # as a data-loader worker is forked
    if child == 0:  # the fork handlers (closing the lock's descriptor) ran before fork() returned here
        open(sys.argv[3], "w").close()
        time.sleep(120)
        os._exit(0)
    print("holding", child, flush=True)
    time.sleep(120)
""")


def test_a_second_manager_in_this_process_is_refused_until_the_first_closes(ckpt_dir):
    state = make_state()
    first = CheckpointManager(ckpt_dir)
    first.resume(state, total_steps=3)  # restores: the directory is this manager's from now on
    second = CheckpointManager(ckpt_dir)
    holder = rf"pid {os.getpid()} on {socket.gethostname()}"
    with pytest.raises(CheckpointError, match=rf"{ckpt_dir} is in use by another CheckpointManager \({holder}"):
        second.resume(make_state(), total_steps=3)
    with pytest.raises(CheckpointError, match=holder):
        second.save(make_state(), 1)
    assert second.list() == []  # listing needs no ownership
    train_steps(state, 1)
    first.save(state)  # the owner keeps saving
    first.close()
    assert second.restore(make_state()) == 1
    second.close()


def test_a_second_run_on_the_same_directory_is_stopped_naming_the_holder(ckpt_dir):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().split()[0] == "holding"
        m = CheckpointManager(ckpt_dir)
        with pytest.raises(CheckpointError, match=rf"pid {holder.pid} on {socket.gethostname()}"):
            m.resume(make_state(), total_steps=3)
        assert not ckpt_dir.exists() or list_checkpoints(ckpt_dir) == []  # nothing was written
    finally:
        holder.kill()
        holder.wait()
    # a killed holder's lock goes with it
    state = make_state()
    with CheckpointManager(ckpt_dir) as m:
        for _ in m.resume(state, total_steps=2):
            pass
    assert [i.step for i in list_checkpoints(ckpt_dir)] == [2]


def test_a_process_forked_by_the_owner_does_not_keep_the_directory_after_the_owner_dies(ckpt_dir, tmp_path):
    forked = tmp_path / "forked"  # the child makes it once its fork handlers have run
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt_dir), "--fork", str(forked)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        line = holder.stdout.readline().split()
        if not line:  # it died before holding: say why
            holder.wait(timeout=30)
            pytest.fail(f"the holder exited with {holder.returncode}: {holder.stderr.read()[-3000:]}")
        assert line[0] == "holding", line
        worker = int(line[1])
        # Killed before the child's fork handlers had run (a loaded machine may not schedule it for
        # a while), the child would still hold the lock's descriptor: wait for it.
        deadline = time.monotonic() + 60
        while not forked.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert forked.exists(), "the forked child never ran"
        holder.kill()  # SIGKILL: its forked worker lives on for a while, as data-loader workers do
        holder.wait()
        os.kill(worker, 0)  # still alive
        with CheckpointManager(ckpt_dir) as m:
            assert m.restore(make_state()) is None  # owned at once, not refused
    finally:
        holder.kill()
        holder.wait()
        if worker is not None:
            os.kill(worker, signal.SIGKILL)


def test_restoring_from_a_directory_nobody_may_write_needs_no_ownership(ckpt_dir, tmp_path):
    state = make_state()
    train_steps(state, 3)
    with CheckpointManager(ckpt_dir) as m:
        m.save(state)
    ro = tmp_path / "read-only"
    ro.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "--bind", "-o", "ro", str(ckpt_dir), str(ro)],
                                                   capture_output=True).returncode == 0
    if mounted:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True)
        target = ro
    else:  # without mounting, a folder whose mode refuses writes (root would ignore it: mounted above)
        target = ckpt_dir
        ckpt_dir.chmod(0o555)
    try:
        before = sorted(p.name for p in target.iterdir())
        with CheckpointManager(target) as m:
            assert m.restore(make_state(seed=4)) == 3
        assert sorted(p.name for p in target.iterdir()) == before
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        ckpt_dir.chmod(0o755)


def _two_ranks(ckpt_dir, out, phase: str) -> list[dict]:
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(os.path.dirname(__file__), "_lock_script.py")
    # Bounded: a rank waiting for another in a collective would hang for gloo's 30 minutes.
    subprocess.run([sys.executable, script, phase, str(ckpt_dir), str(out), str(port)], check=True, timeout=200)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_two_rank_job_has_one_owner_rank_0_and_is_refused_together_naming_the_holder(ckpt_dir, tmp_path):
    holder = CheckpointManager(ckpt_dir)
    holder.save(make_state(), step=0)  # this process owns the directory
    try:
        ranks = _two_ranks(ckpt_dir, tmp_path / "held", "held")
    finally:
        holder.close()
    me = f"pid {os.getpid()}"
    for r in ranks:  # every call failed on every rank (none waited for the other), each naming the owner
        for call in ("save", "restore", "save2"):
            assert "in use by another CheckpointManager" in r[call] and me in r[call], (call, r)
        assert r["held"] is False
    assert [i.step for i in list_checkpoints(ckpt_dir)] == [0]  # nothing of the refused job

    ranks = _two_ranks(ckpt_dir, tmp_path / "free", "free")
    assert [(r["save"], r["restore"], r["save2"]) for r in ranks] == [("ok", "ok", "ok")] * 2
    assert [r["held"] for r in ranks] == [True, False]  # one owner: rank 0
    last = list_checkpoints(ckpt_dir, verify=True)[-1]
    assert (last.step, last.valid, last.world_size) == (2, True, 2)
    with CheckpointManager(ckpt_dir) as again:  # the job's processes are gone: so is their lock
        assert again.restore(TrainState(model=torch.nn.Linear(3, 2)), strict=False) == 2
