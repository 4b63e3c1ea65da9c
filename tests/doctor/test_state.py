"""Every check leaves the caller's model, optimizer and RNG state exactly as it found them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainguard import doctor


def _checks(batch, batches):
    loss = nn.CrossEntropyLoss()
    return {
        "overfit": lambda m, o: doctor.overfit_one_batch(m, batch, loss, steps=20),
        "overfit_given_optimizer": lambda m, o: doctor.overfit_one_batch(m, batch, loss, steps=20, optimizer_factory=o),
        "lr_range": lambda m, o: doctor.lr_range_test(m, batches, loss, steps=20),
        "lr_range_given_optimizer": lambda m, o: doctor.lr_range_test(m, batches, loss, o, steps=20),
        "gradient_check": lambda m, o: doctor.gradient_check(m, batch, loss, samples_per_param=3),
        "init": lambda m, o: doctor.init_checks(m, batch, loss),
        "checklist": lambda m, o: doctor.run_checklist(m, batches, loss, overfit_steps=10, lr_steps=10),
    }


@pytest.mark.parametrize("name", ["overfit", "overfit_given_optimizer", "lr_range", "lr_range_given_optimizer",
                                  "gradient_check", "init", "checklist"])
def test_check_leaves_state_as_found(name, busy, batch, batches, state_of, same_state):
    model, opt = busy
    before = state_of(model, opt)
    result = _checks(batch, batches)[name](model, opt)
    assert result is not None
    same_state(before, state_of(model, opt))
    # The RNG streams continue exactly where they were.
    assert torch.equal(torch.rand(3), (torch.manual_seed(123), torch.rand(3))[1])


def test_rng_draws_continue_unchanged(busy, batch):
    model, _ = busy
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = (torch.rand(4), np.random.rand(4), random.random())
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    doctor.overfit_one_batch(model, batch, nn.CrossEntropyLoss(), steps=10)
    got = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]


def test_state_restored_when_the_check_raises(busy, batch, state_of, same_state):
    model, opt = busy
    before = state_of(model, opt)
    calls = {"n": 0}

    def flaky_loss(out, y):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(out, y)

    with pytest.raises(RuntimeError, match="boom"):
        doctor.overfit_one_batch(model, batch, flaky_loss, steps=20)
    same_state(before, state_of(model, opt))


def test_optimizer_still_steps_the_same_parameters_afterwards(busy, batch):
    """Parameters are restored in place: the caller's optimizer keeps updating the model."""
    model, opt = busy
    doctor.gradient_check(model, batch, nn.CrossEntropyLoss(), samples_per_param=2)
    before = model.fc1.weight.detach().clone()
    opt.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    opt.step()
    assert not torch.equal(before, model.fc1.weight)


def test_loader_generator_state_restored(busy, blobs):
    model, _ = busy
    x, y = blobs
    gen = torch.Generator().manual_seed(5)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=gen)
    state = gen.get_state().clone()
    doctor.lr_range_test(model, loader, nn.CrossEntropyLoss(), steps=10)
    assert torch.equal(gen.get_state(), state)


def test_gradient_check_restores_dtype_and_values(batch, new_mlp):
    model = new_mlp()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    doctor.gradient_check(model, batch, nn.CrossEntropyLoss(), samples_per_param=2)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, values[n])
    assert torch.get_default_dtype() == torch.float32


def test_half_precision_model_comes_back_half(batch, new_mlp):
    model = new_mlp().to(torch.bfloat16)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    r = doctor.gradient_check(model, (batch[0].to(torch.bfloat16), batch[1]), nn.CrossEntropyLoss(),
                              samples_per_param=2)
    assert r.passed  # checked in float64 whatever the model's own dtype
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, values[n]) for n, p in model.named_parameters())


def test_a_qat_model_whose_observers_resize_their_buffers_comes_back_as_it_was(qat_model):
    # Eager-mode QAT as PyTorch's QAT tutorial prepares it (get_default_qat_qconfig("x86"), prepare_qat):
    # the per-channel weight observer's min_val/max_val start empty and are resized in place on the first
    # forward, so restoring them with copy_ raised "The size of tensor a (8) must match the size of
    # tensor b (0)" and init_checks "could not run".
    torch.manual_seed(0)
    model = qat_model(channels=8, side=28, classes=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    result = doctor.init_checks(model, (x, y), nn.CrossEntropyLoss())
    assert result.verdict != "error", result.summary
    after = model.state_dict()
    assert all(after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())
