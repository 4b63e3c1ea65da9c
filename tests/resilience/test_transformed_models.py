"""Checkpoints of models that torch's model-transforming utilities changed: quantization-aware
training (torch.ao.quantization), pruning (torch.nn.utils.prune) and parametrizations.

The QAT model is derived from pytorch/tutorials' static quantization tutorial (QAT part): a
QuantStub, fused Conv-BN-ReLU (``fuse_modules_qat``), ``prepare_qat`` with the default x86 QAT
qconfig. Its per-channel weight observers start with empty ``min_val``/``max_val`` and one-element
``scale``/``zero_point``, which the first forward resizes; torch's ``load_state_dict`` resizes them
back when loading, so a fresh prepared model takes a trained model's state.
"""

from __future__ import annotations

import pytest
import torch
import torch.ao.quantization as tq
from qat_models import prepared
from torch import nn

from trainguard import CheckpointError
from trainguard.resilience import CheckpointManager, TrainState


class QatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(1, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 3)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(x.mean((2, 3))))


def qat_state() -> TrainState:
    torch.manual_seed(0)
    model = QatNet().train()
    prepared(model, [["conv", "bn", "relu"]])
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def train(state: TrainState, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = nn.functional.cross_entropy(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_qat_model_resumes_into_a_freshly_prepared_one(tmp_path):
    state = qat_state()
    train(state, range(3))
    CheckpointManager(tmp_path / "ck").save(state, step=3)
    expected = train(state, range(3, 6))

    fresh = qat_state()  # its observers have not seen data: per-channel buffers still unsized
    assert CheckpointManager(tmp_path / "ck").restore(fresh) == 3
    assert train(fresh, range(3, 6)) == expected  # bitwise
    for (k, a), b in zip(state.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_module_that_cannot_take_the_saved_shape_is_still_refused_before_anything_loads(tmp_path):
    wide = TrainState(model=nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)))
    CheckpointManager(tmp_path / "ck").save(wide, step=1)
    narrow = TrainState(model=nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(4)))
    before = {k: v.clone() for k, v in narrow.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"mis-shaped in 'model': 1\.weight \(checkpoint \[8\], here \[4\]\)"):
        CheckpointManager(tmp_path / "ck").restore(narrow)
    assert all(torch.equal(before[k], v) for k, v in narrow.model.state_dict().items())


def sparse_state() -> TrainState:
    """torch.ao.pruning's WeightNormSparsifier: masks as FakeSparsity parametrizations, whose
    ``state_dict()`` leaves the mask out (the sparsifier's own state holds it), while a strict
    ``load_state_dict`` asks for it."""
    from torch.ao.pruning import WeightNormSparsifier

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=4)
    sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    return TrainState(model=model, sparsifier=sparsifier, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))


def train_sparse(state: TrainState, steps: range) -> list[float]:
    losses = []
    for step in steps:
        if step % 3 == 0:
            state.sparsifier.step()  # new masks from the current weights
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = nn.functional.cross_entropy(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_model_sparsified_by_torch_ao_pruning_resumes_with_its_masks(tmp_path):
    state = sparse_state()
    train_sparse(state, range(5))
    CheckpointManager(tmp_path / "ck").save(state, step=5)
    expected = train_sparse(state, range(5, 10))

    fresh = sparse_state()
    assert CheckpointManager(tmp_path / "ck").restore(fresh) == 5
    assert train_sparse(fresh, range(5, 10)) == expected  # bitwise, with the masks the run had
    assert torch.equal(fresh.model[0].weight, state.model[0].weight)


def lenet_like() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def test_a_checkpoint_of_a_pruned_model_tells_to_prune_before_restoring(tmp_path):
    """pytorch/tutorials pruning_tutorial.py: pruning renames ``weight`` to ``weight_orig`` plus a
    ``weight_mask`` buffer; a run pruned mid-way and resumed into a model built unpruned."""
    import torch.nn.utils.prune as prune

    pruned = lenet_like()
    prune.l1_unstructured(pruned[0], name="weight", amount=0.3)
    prune.l1_unstructured(pruned[3], name="weight", amount=0.3)
    CheckpointManager(tmp_path / "ck").save(TrainState(model=pruned), step=1)
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "ck").restore(TrainState(model=lenet_like()))
    text = str(info.value)
    assert "(unexpected): 0.weight_orig, 0.weight_mask" in text  # the keys are still named
    assert "torch.nn.utils.prune" in text and "0.weight, 3.weight" in text and "before restoring" in text

    prune.remove(pruned[0], "weight")  # the other way round: written after prune.remove, restored pruned
    prune.remove(pruned[3], "weight")
    CheckpointManager(tmp_path / "ck2").save(TrainState(model=pruned), step=1)
    again = lenet_like()
    prune.l1_unstructured(again[0], name="weight", amount=0.3)
    with pytest.raises(CheckpointError, match=r"pruned here but not in the checkpoint.*prune\.remove"):
        CheckpointManager(tmp_path / "ck2").restore(TrainState(model=again))


def test_a_checkpoint_of_a_parametrized_model_tells_to_register_the_parametrization_first(tmp_path):
    from torch.nn.utils import parametrizations as P

    model = lenet_like()
    P.orthogonal(model[3])
    CheckpointManager(tmp_path / "ck").save(TrainState(model=model), step=1)
    with pytest.raises(CheckpointError, match=r"parametrized in the checkpoint \(torch\.nn\.utils\.parametrize\): "
                                              r"3\.weight; register the same parametrizations before restoring"):
        CheckpointManager(tmp_path / "ck").restore(TrainState(model=lenet_like()))
