"""CTC loss: its infinities are part of normal training, on either backend.

``aten._ctc_loss`` returns the per-sample loss and ``log_alpha``, the forward variables its
backward reuses. On CPU ``log_alpha`` is ``empty`` memory filled only for each sample's input
frames (and -inf, log 0, for the positions a path cannot reach): the frames past a shorter
input hold whatever the allocator handed back, NaN bit patterns included. A healthy run was
reported harmful there (and stopped by ``check_numerics``) at a random step. The loss itself is
+inf for a sample whose target cannot be aligned with its input (more labels, plus a blank
between each repeated pair, than output frames): harmful with ``zero_infinity=False``, absorbed
(``where``) with ``zero_infinity=True``.

The model is a shrunk torchaudio-style acoustic model (strided conv front-end, BiLSTM, linear
to the vocabulary, ``log_softmax``, ``nn.CTCLoss``), as in pytorch/audio's examples and
transformers' ``Wav2Vec2ForCTC`` (examples/pytorch/speech-recognition/run_speech_recognition_ctc.py).
``fill_uninitialized_memory`` makes every ``empty`` hold NaN: the worst case, on every run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


class Acoustic(nn.Module):
    def __init__(self, vocab: int = 6):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, kernel_size=3, stride=2, padding=1)
        self.out = nn.Linear(8, vocab)

    def forward(self, x):  # B, 4, T -> B, T // 2, vocab
        return self.out(torch.relu(self.conv(x)).transpose(1, 2))


def _train(steps: int = 3, zero_infinity: bool = False, too_long: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = Acoustic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctc = nn.CTCLoss(blank=0, zero_infinity=zero_infinity)
    losses = []
    for _ in range(steps):
        x = torch.randn(3, 4, 16)
        frames = torch.tensor([8, 5, 3])  # shorter inputs: frames of log_alpha left unwritten
        targets = torch.tensor([[1, 2, 3], [2, 2, 0], [4, 0, 0]])
        lengths = torch.tensor([3, 2, 1])
        if too_long:  # 3 repeats need 5 frames (a blank between each pair): sample 1 has 5, sample 2 has 3
            targets[2] = 5
            lengths[2] = 3
        log_probs = model(x).log_softmax(-1).transpose(0, 1)
        loss = ctc(log_probs, targets, frames, lengths)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_healthy_ctc_run_has_no_harmful_value(tmp_path, backend):
    plain = _train()
    with tg.record(tmp_path / "r", backend=backend):
        recorded = _train()
    assert recorded == plain
    run = open_run(tmp_path / "r")
    assert run.first_harm() is None, run.first_harm()
    assert not any(g["made_by"].startswith("aten._ctc_loss") for g in run.intended()), run.intended()


@pytest.mark.usefixtures("nan_empty")
def test_check_numerics_lets_a_healthy_ctc_run_finish():
    plain = _train()
    with tg.check_numerics():
        assert _train() == plain


@pytest.mark.parametrize("backend", ["native", "python"])
def test_zero_infinity_makes_the_inf_of_a_target_too_long_intended(tmp_path, backend):
    with tg.record(tmp_path / "r", backend=backend):
        losses = _train(zero_infinity=True, too_long=True)
    assert all(v == v and v != float("inf") for v in losses)
    run = open_run(tmp_path / "r")
    assert run.first_harm() is None, run.first_harm()
    assert any(g["kind"] == "+inf" and g["made_by"].startswith("aten._ctc_loss") and g["absorbed_by"] == "aten.where.self"
               for g in run.intended()), run.intended()
    with tg.check_numerics():
        _train(zero_infinity=True, too_long=True)


def test_a_target_too_long_for_its_input_is_named_with_zero_infinity_as_the_fix(tmp_path):
    with tg.record(tmp_path / "r", buffer=-1):
        losses = _train(too_long=True)
    assert losses[0] == float("inf")
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op.startswith("aten._ctc_loss") and o.origin.step == 0
    assert "1 of 3" in o.origin.explanation and "target" in o.origin.explanation, o.origin.explanation
    assert "zero_infinity=True" in o.suggestion and "overflow" not in o.suggestion, o.suggestion
    with pytest.raises(tg.NonFiniteError, match="_ctc_loss"):
        with tg.check_numerics():
            _train(too_long=True)
