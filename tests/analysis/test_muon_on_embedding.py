"""``muon_on_embedding``: Muon's orthogonalised steps given to a token embedding or the output layer.

karpathy/nanochat@92d63d4 nanochat/gpt.py ``setup_optimizer`` puts ``transformer.wte``,
``value_embeds`` and ``lm_head`` in AdamW groups and only the blocks' matrices in Muon groups, as its
nanochat/optim.py ``MuonAdamW`` docstring says ("The Muon optimizer should not be used for the
embedding layer, the final fully connected layer"). Moving ``wte`` and ``lm_head`` into Muon groups
(2 layers, width 64, vocab 256, 100 steps of a repeated pattern) trained 15x worse at step 50 (loss
0.39 against 0.025) and the monitor said "Training looks healthy"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor

V, D = 32, 16


class MuonAdamW(torch.optim.Optimizer):
    """Shaped as nanochat's MuonAdamW (groups with ``kind="adamw"`` or ``kind="muon"``); its update
    here is plain SGD: the monitor reads only the class and the groups."""

    def __init__(self, groups):
        super().__init__(groups, defaults={})

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-g["lr"])


def train(tmp_path, muon_embed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, V))
    outer = [model[0].weight, model[3].weight, model[3].bias, model[1].bias]
    muon = [model[1].weight] + (outer[:2] if muon_embed else [])
    adamw = [p for p in outer if all(p is not q for q in muon)]
    opt = MuonAdamW([dict(kind="adamw", params=adamw, lr=0.05), dict(kind="muon", params=muon, lr=0.05)])
    g = torch.Generator().manual_seed(1)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(25):
            x = torch.randint(0, V, (16,), generator=g)
            F.cross_entropy(model(x), (x * 3) % V).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {f.kind: f for f in mon.findings}


def test_muon_given_the_embedding_and_the_output_layer_is_found(tmp_path):
    found = train(tmp_path, muon_embed=True)
    f = found.get("muon_on_embedding")
    assert f is not None and f.severity == "warning", list(found)
    assert f.evidence["params"] == ["0.weight", "3.weight"], f.evidence
    assert "MuonAdamW" in f.title and "AdamW" in f.suggestion, (f.title, f.suggestion)
    assert "healthy" not in found


def test_muon_on_the_hidden_matrices_only_is_not_found(tmp_path):
    assert "muon_on_embedding" not in train(tmp_path, muon_embed=False)
