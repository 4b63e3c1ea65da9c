"""A loss that saturates at its floor in one step: the gradient is gone, the run learns nothing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 24, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.mlp(self.embed(ids)))


def _logps(model, ids):
    logits = model(ids[:, :-1])
    return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(2).sum(1)


def _dpo(logdir, beta: float, lr: float, steps: int = 20):
    """trl's DPOTrainer (sigmoid loss) written out: a policy, a frozen copy as the reference, the
    same 8 preference pairs every step (a prompt, then token 1 for the chosen and token 2 for the
    rejected answer, as trl's tiny "good ..." / "bad ..." pairs), clipped at 1 under AdamW."""
    torch.manual_seed(0)
    policy = _TinyLM()
    ref = copy.deepcopy(policy).requires_grad_(False).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 24, (8, 3), generator=g)
    chosen = torch.cat([prompt, torch.full((8, 1), 1), torch.randint(3, 24, (8, 2), generator=g)], 1)
    rejected = torch.cat([prompt, torch.full((8, 1), 2), chosen[:, 4:]], 1)
    losses = []
    with tg.Monitor(policy, logdir, every=5) as mon:
        for _ in range(steps):
            with torch.no_grad():
                ref_c, ref_r = _logps(ref, chosen), _logps(ref, rejected)
            margin = (_logps(policy, chosen) - ref_c) - (_logps(policy, rejected) - ref_r)
            loss = -F.logsigmoid(beta * margin).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    return losses, {f.kind: f for f in mon.findings}


@pytest.mark.parametrize("lr", [1e-2, 1e-3])
def test_a_dpo_loss_saturated_by_a_huge_beta_is_named_not_called_flat_or_healthy(tmp_path, lr):
    # trl's DPOTrainer at beta=1000 on a 2-layer Llama: the loss went 0.693 -> 0.0 at step 1 and the
    # gradient norm 9836 -> 0.0, exactly, for the 19 steps left; trainguard said "Loss is not
    # decreasing: 0 -> 0 (best 0)" and told to check the sign of a flow's or a GP's likelihood. At
    # lr 1e-3 the loss fell to 7.5e-07 (gradient 0.0032) and on to 1e-29: "Training looks healthy".
    losses, kinds = _dpo(tmp_path / "r", beta=1000.0, lr=lr)
    assert losses[0] == pytest.approx(0.6931, abs=1e-4) and max(losses[1:]) < 1e-5, losses
    assert "loss_not_decreasing" not in kinds, kinds["loss_not_decreasing"].title
    assert "healthy" not in kinds
    sat = kinds["loss_saturated"]
    assert sat.severity == "warning"
    assert sat.evidence["step"] == 1 and sat.evidence["steps_since"] == 19, sat.evidence
    assert "step 1" in sat.title and "0.693" in sat.title, sat.title
    assert "beta" in sat.suggestion and "logsigmoid" in sat.suggestion, sat.suggestion


def test_a_dpo_loss_at_the_usual_beta_is_healthy(tmp_path):
    losses, kinds = _dpo(tmp_path / "r", beta=0.1, lr=1e-2)
    assert losses[-1] < 0.4, losses
    assert set(kinds) == {"healthy"}, [f.title for f in kinds.values()]


def test_a_flat_dpo_loss_is_told_about_its_margin_not_a_flows_likelihood(tmp_path):
    # trl's DPOTrainer at lr 1e-6 (its usual rate) for 20 steps on a 2-layer Llama: 0.69315 ->
    # 0.6928, "not decreasing", fairly; but the fix said its graph "holds no comparison with
    # targets (... a likelihood of the data, as a flow's or a Gaussian process's, or an ELBO), so
    # check its sign (-log_prob(x).mean() falls as the fit improves)".
    losses, kinds = _dpo(tmp_path / "r", beta=0.1, lr=2e-5)
    assert abs(losses[-1] - losses[0]) < 1e-3, losses
    flat = kinds["loss_not_decreasing"]
    assert "flow" not in flat.suggestion and "ELBO" not in flat.suggestion, flat.suggestion
    assert "logsigmoid" in flat.suggestion and "chosen minus rejected" in flat.suggestion, flat.suggestion
