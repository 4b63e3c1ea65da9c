"""ResumableLoader: the plain DataLoader's batches and seeds, resumable mid-epoch."""

from __future__ import annotations

import faulthandler
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainguard.resilience import ResumableLoader
from trainguard.resilience._rng import capture_global, restore_global


class Noisy(Dataset):
    """Each item carries its index and draws from torch, Python and NumPy (augmentation-like)."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(13):
            yield torch.tensor([float(i), torch.rand(()).item()])


def seed_all(s: int) -> None:
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def consume(loader, epochs: int, *, first=None) -> list[torch.Tensor]:
    """Iterate like a training loop: a training-side draw after each batch."""
    out = []
    for e in range(epochs):
        it = first if (e == 0 and first is not None) else iter(loader)
        for batch in it:
            out.append(batch)
            torch.rand(1)
    return out


def dump_stacks_on_crash(worker_id: int) -> None:
    """A worker's fatal signal also prints its Python stacks (and DataLoader's own message after).

    CI once saw both workers of the Stream case die with "Unexpected segmentation fault encountered
    in worker", not reproduced since: if it comes back, the captured stderr says where."""
    faulthandler.enable(all_threads=True)


def plain(num_workers: int, dataset=None) -> DataLoader:
    ds = dataset if dataset is not None else Noisy()
    shuffle = not isinstance(ds, IterableDataset)
    return DataLoader(ds, batch_size=4, shuffle=shuffle, num_workers=num_workers,
                      worker_init_fn=dump_stacks_on_crash if num_workers else None)


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_and_same_random_streams_as_the_plain_loader(num_workers):
    seed_all(3)
    expected = consume(plain(num_workers), 2)
    after_plain = capture_global()
    seed_all(3)
    got = consume(ResumableLoader(plain(num_workers)), 2)
    assert equal(expected, got)
    assert capture_global()["torch"] == after_plain["torch"]


@pytest.mark.parametrize(("num_workers", "fast_forward", "dataset"), [
    (0, "skip", None), (2, "skip", None), (2, "replay", None), (0, "skip", Stream()), (2, "skip", Stream()),
])
def test_resume_mid_epoch_continues_with_the_next_batch(num_workers, fast_forward, dataset):
    seed_all(7)
    expected = consume(plain(num_workers, dataset), 3)
    rng_after = capture_global()

    seed_all(7)
    loader = ResumableLoader(plain(num_workers, dataset), fast_forward=fast_forward)
    head = consume(loader, 1)  # epoch 1
    it = iter(loader)
    for _ in range(2):  # two batches into epoch 2, then "crash"
        head.append(next(it))
        torch.rand(1)
    saved, rng = loader.state_dict(), capture_global()
    del it

    seed_all(99)  # a new process: different RNG until the restore
    again = ResumableLoader(plain(num_workers, dataset), fast_forward=fast_forward)
    again.load_state_dict(saved)
    restore_global(rng)
    tail = consume(again, 2)  # the rest of epoch 2, then epoch 3
    got = head + tail
    assert len(got) == len(expected)
    if num_workers == 2 and fast_forward == "skip" and dataset is None:
        # Skipping does not replay worker-side draws: indices (column 0) match, the noise may not.
        assert all(torch.equal(x[:, 0], y[:, 0]) for x, y in zip(expected, got, strict=True))
    else:
        assert equal(expected, got)
    assert capture_global()["torch"] == rng_after["torch"]


def test_state_between_epochs_starts_the_next_epoch():
    seed_all(1)
    expected = consume(plain(0), 2)
    seed_all(1)
    loader = ResumableLoader(plain(0))
    head = consume(loader, 1)
    saved, rng = loader.state_dict(), capture_global()
    assert saved["in_epoch"] is False and saved["epoch"] == 1
    again = ResumableLoader(plain(0))
    again.load_state_dict(saved)
    restore_global(rng)
    assert equal(expected, head + consume(again, 1))


def test_a_loader_generator_is_followed_and_saved():
    def make():
        return DataLoader(Noisy(), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(11))

    expected = consume(make(), 2)
    loader = ResumableLoader(make())
    it = iter(loader)
    head = [next(it)]
    saved, rng = loader.state_dict(), capture_global()
    again = ResumableLoader(make())
    again.load_state_dict(saved)
    restore_global(rng)
    got = head + consume(again, 2)
    assert [b[:, 0].tolist() for b in got] == [b[:, 0].tolist() for b in expected]


def test_bad_arguments():
    with pytest.raises(ValueError, match="fast_forward must be one of"):
        ResumableLoader(plain(0), fast_forward="jump")
    with pytest.raises(TypeError, match="wraps a torch.utils.data.DataLoader"):
        ResumableLoader([1, 2, 3])  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="persistent_workers"):
        ResumableLoader(DataLoader(Noisy(), num_workers=1, persistent_workers=True))


@pytest.mark.parametrize("change", ["batch_size", "dataset"])
def test_resuming_mid_epoch_with_another_batch_size_or_dataset_is_a_clear_error(tmp_path, change):
    # run_clm_no_trainer.py resumed from trainguard's checkpoint with --per_device_train_batch_size 4
    # instead of 8 continued at "batch 20" of the epoch, 80 samples in instead of 160: samples
    # 80-159 were trained on twice that epoch, without a word.
    from trainguard import CheckpointError
    from trainguard.resilience import CheckpointManager, TrainState

    data = torch.arange(64.0).unsqueeze(1)
    state = TrainState(loader=DataLoader(data, batch_size=8, shuffle=True))
    it = iter(state.loader)
    for _ in range(3):
        next(it)
    CheckpointManager(tmp_path).save(state)
    other = DataLoader(data[:40], batch_size=8, shuffle=True) if change == "dataset" else \
        DataLoader(data, batch_size=4, shuffle=True)
    with pytest.raises(CheckpointError, match="8 samples a batch, 3 batches into its epoch" if change == "batch_size"
                       else "64 samples"):
        CheckpointManager(tmp_path).restore(TrainState(loader=other))
    same = TrainState(loader=DataLoader(data, batch_size=8, shuffle=True))
    assert CheckpointManager(tmp_path).restore(same) == 0  # the same loader resumes


def test_resuming_an_accelerate_loader_mid_epoch_with_another_batch_size_is_a_clear_error(tmp_path):
    # the same with the loader accelerator.prepare() returned, as run_clm_no_trainer.py has it:
    # its DataLoader is made with a batch sampler (BatchSamplerShard) and no batch_size
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from trainguard import CheckpointError
    from trainguard.resilience import CheckpointManager, TrainState

    data = torch.arange(64.0).unsqueeze(1)
    try:
        accelerator = Accelerator(cpu=True)
        state = TrainState(loader=accelerator.prepare(DataLoader(data, batch_size=8, shuffle=True)))
        it = iter(state.loader)
        for _ in range(3):
            next(it)
        CheckpointManager(tmp_path).save(state)
        other = TrainState(loader=accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True)))
        with pytest.raises(CheckpointError, match="8 samples a batch, 3 batches into its epoch"):
            CheckpointManager(tmp_path).restore(other)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # process-wide: leave none to later tests
        GradientState._reset_state()


class PoissonBatches(torch.utils.data.Sampler):
    """Poisson sampling as opacus' UniformWithReplacementSampler does it (DPDataLoader's batch
    sampler, which make_private puts in the loader): each batch is drawn lazily, when the loader
    asks for it, from the global generator (or its own), so its draws interleave with training's
    (opacus' noise); batches vary in size and may be empty."""

    def __init__(self, n: int, rate: float, generator: torch.Generator | None = None):
        self.n, self.rate, self.generator = n, rate, generator

    def __len__(self) -> int:
        return int(1 / self.rate)

    def __iter__(self):
        for _ in range(len(self)):
            mask = torch.rand(self.n, generator=self.generator) < self.rate
            yield mask.nonzero().reshape(-1).tolist()


@pytest.mark.parametrize("own_generator", [False, True])
def test_resume_mid_epoch_of_a_lazy_batch_sampler_draws_the_next_batch_where_it_left_off(own_generator):
    def loader() -> DataLoader:
        gen = torch.Generator().manual_seed(5) if own_generator else None
        return DataLoader(Noisy(), batch_sampler=PoissonBatches(23, 0.2, gen))

    seed_all(7)
    expected = consume(loader(), 3)
    rng_after = capture_global()

    seed_all(7)
    first = ResumableLoader(loader())
    head = consume(first, 1)
    it = iter(first)
    for _ in range(3):  # three batches into epoch 2, then "crash"
        head.append(next(it))
        torch.rand(1)
    saved, rng = first.state_dict(), capture_global()
    del it

    seed_all(99)
    again = ResumableLoader(loader())
    again.load_state_dict(saved)
    restore_global(rng)
    got = head + consume(again, 2)
    # The resumed batches are the uninterrupted run's: the sampler's own generator is saved, and
    # skipping the three batches handed out does not draw again what the checkpoint's states drew.
    assert [b[:, 0].tolist() for b in got] == [b[:, 0].tolist() for b in expected]
    assert equal(expected, got)
    assert capture_global()["torch"] == rng_after["torch"]
