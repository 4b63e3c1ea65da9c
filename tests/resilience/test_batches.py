"""loop.batches(): the step form with the data in it, epochs rolled over, exact after a resume;
MemorySnapshot; the loader's sample indices."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from trainguard.resilience import CheckpointManager, MemorySnapshot, Preempted, ResumableLoader, TrainState

from .conftest import assert_same_training_state, make_state, train_steps


def body(state, x, y):
    loss = torch.nn.functional.mse_loss(state.model(x), y)
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    return loss.item()


def test_batches_equal_the_hand_written_loop_and_roll_epochs_over(tmp_path):
    ref = make_state()
    expected = train_steps(ref, 13)  # 5 batches per epoch: epochs 0, 1 and part of 2
    state = make_state()
    loop = CheckpointManager(tmp_path / "ckpt").resume(state, total_steps=13)
    got, steps = [], []
    for step, (x, y) in loop.batches():
        steps.append(step)
        got.append(body(state, x, y))
    assert steps == list(range(13)) and got == expected
    assert state.epoch == 2 and state.step == 13
    assert_same_training_state(ref, state)


def test_batches_resume_mid_epoch_exactly(tmp_path):
    ref = make_state()
    expected = train_steps(ref, 12)
    state = make_state()
    with pytest.raises(Preempted):
        for step, (x, y) in CheckpointManager(tmp_path / "ckpt", every_steps=100).resume(state, total_steps=12).batches():
            body(state, x, y)
            if step == 6:
                import os
                import signal

                os.kill(os.getpid(), signal.SIGTERM)
    resumed = make_state()
    loop = CheckpointManager(tmp_path / "ckpt").resume(resumed, total_steps=12)
    assert loop.restored_step == 7 and resumed.epoch == 1
    tail = [body(resumed, x, y) for _, (x, y) in loop.batches()]
    assert tail == expected[7:]
    assert_same_training_state(ref, resumed)


def test_batches_needs_the_step_form_and_a_loader(tmp_path):
    state = make_state()
    with pytest.raises(RuntimeError, match="step form"):
        CheckpointManager(tmp_path / "a").resume(state, epochs=1).batches()
    bare = TrainState(model=torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="state.loader"):
        CheckpointManager(tmp_path / "b").resume(bare, total_steps=1).batches()
    empty = TrainState(loader=DataLoader(TensorDataset(torch.zeros(0, 1)), batch_size=2))
    with pytest.raises(RuntimeError, match="yields no batches"):
        list(CheckpointManager(tmp_path / "c").resume(empty, total_steps=1).batches())


def test_batches_tell_a_distributed_sampler_the_epoch(tmp_path):
    data = TensorDataset(torch.arange(8.0))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    state = TrainState(loader=DataLoader(data, batch_size=4, sampler=sampler))
    seen = [b[0].tolist() for _, b in CheckpointManager(tmp_path / "c").resume(state, total_steps=4).batches()]
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = list(sampler)
        orders += [[float(i) for i in order[:4]], [float(i) for i in order[4:]]]
    assert seen == orders and orders[:2] != orders[2:]


def test_memory_snapshot_restores_bitwise_and_keeps_no_alias(tmp_path):
    state = make_state()
    train_steps(state, 5)  # one epoch: each train_steps() call below starts the next one
    snap = MemorySnapshot()
    snap.take(state)
    assert snap.step == 5 and snap.nbytes > 0
    expected = train_steps(state, 4)
    after = make_state()
    train_steps(after, 5)
    train_steps(after, 4)
    assert_same_training_state(after, state)
    snap.restore(state)
    assert state.step == 5
    assert train_steps(state, 4) == expected  # same batches, dropout masks, optimizer moments
    assert_same_training_state(after, state)
    snap.restore(state)  # again: training after the first restore never wrote into the snapshot
    assert train_steps(state, 4) == expected
    snap.release()
    assert not snap.taken and snap.nbytes == 0
    with pytest.raises(RuntimeError, match="no snapshot"):
        snap.restore(state)


def test_loader_tells_the_sample_indices_of_the_last_batch():
    data = TensorDataset(torch.arange(12.0))
    loader = ResumableLoader(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert loader.last_indices is None
    for batch in loader:
        assert [float(i) for i in loader.last_indices] == batch[0].tolist()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    second = next(it)
    resumed = ResumableLoader(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    resumed.load_state_dict(state)
    batch = next(iter(resumed))
    assert batch[0].tolist() == second[0].tolist() and [float(i) for i in resumed.last_indices] == batch[0].tolist()


@pytest.mark.timeout(120)
def test_loader_indices_with_workers_prefetching():
    data = TensorDataset(torch.arange(40.0))
    loader = ResumableLoader(DataLoader(data, batch_size=4, shuffle=True, num_workers=2))
    for batch in loader:
        assert [float(i) for i in loader.last_indices] == batch[0].tolist()


def _evaluate(state, batches=2):
    # rasbt/LLMs-from-scratch ch05/ch06 evaluate_model: calc_loss_loader(train_loader, ...,
    # num_batches=eval_iter) runs the first batches of the training loader in the middle of an
    # epoch and breaks; with state.loader as that loader it is a second iter() of it.
    with torch.no_grad():
        for i, (x, y) in enumerate(state.loader):
            if i >= batches:
                break
            torch.nn.functional.mse_loss(state.model(x), y)


def _train_evaluating(state, loop, stop_at=None):
    losses = []
    for step, (x, y) in loop.batches():
        losses.append(body(state, x, y))
        if step % 3 == 0:
            _evaluate(state)
        if step == stop_at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
    return losses


def test_an_evaluation_pass_over_state_loader_does_not_move_the_data_position(tmp_path):
    # The book's loop ported to loop.batches() with state.loader passed to evaluate_model: the
    # evaluation's iter() started a new epoch in the loader, so the checkpoint saved epoch 2 at
    # batch 2 instead of epoch 1 at batch 2 of the loop's; the resumed run (tiny GPT, LoRA, 30
    # steps, killed at 12) trained on other batches from step 10 on (0.7596 vs 0.8333) and ended at epoch 1, not 2.
    ref = make_state()
    expected = _train_evaluating(ref, CheckpointManager(tmp_path / "ref").resume(ref, total_steps=12))
    assert ref.epoch == 2
    state = make_state()
    with pytest.raises(Preempted):
        _train_evaluating(state, CheckpointManager(tmp_path / "ckpt", every_steps=100).resume(state, total_steps=12),
                          stop_at=6)
    resumed = make_state()
    loop = CheckpointManager(tmp_path / "ckpt").resume(resumed, total_steps=12)
    assert loop.restored_step == 7 and resumed.epoch == 1
    assert _train_evaluating(resumed, loop) == expected[7:]
    assert resumed.epoch == 2
    assert_same_training_state(ref, resumed)
