"""The fix for a mean cross entropy over no counted target names the masked-LM collator that masks
nothing: transformers' examples/pytorch/language-modeling/run_mlm.py (3034a13b) run with
``--mlm_probability 0`` labels every token -100 (DataCollatorForLanguageModeling), and the loss of
every step is 0/0. The fix spoke only of prompts and padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


def test_a_loss_over_labels_all_masked_names_mlm_probability(tmp_path):
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
    ids = torch.randint(0, 16, (4, 6))
    labels = torch.full_like(ids, -100)  # a masked-LM batch with no token masked
    with tg.record(tmp_path / "r"):
        loss = F.cross_entropy(head(emb(ids)).view(-1, 16), labels.view(-1))
        loss.backward()
    assert torch.isnan(loss)
    o = origin(open_run(tmp_path / "r"))
    assert "no target" in o.origin.explanation, o.origin.explanation
    assert "mlm_probability" in o.suggestion and "-100" in o.suggestion, o.suggestion
