"""Parameter rules on real monitored loops: which parameters a finding is about, and its fix."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import trainguard as tg


class TinyGPTBlock(nn.Module):
    # Derived from karpathy/llm.c train_gpt2.py (GPT: embedding, LayerNorm, MLP, tied lm_head).
    def __init__(self, vocab: int = 23, n_embd: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.ln = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx)
        x = x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _monitored_run(path, *, zero_grad: bool) -> list:
    torch.manual_seed(0)
    model = TinyGPTBlock()
    # llm.c's configure_optimizers with its second group (biases and LayerNorm weights, dim < 2)
    # left out: those parameters get gradients that optimizer.zero_grad() never clears.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}], lr=3e-3, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    with tg.Monitor(model, path, every=5) as mon:
        for _ in range(30):
            if zero_grad:
                opt.zero_grad(set_to_none=True)
            idx = torch.randint(0, 23, (4, 8), generator=g)
            model(idx, idx.roll(-1, dims=1)).backward()
            opt.step()
    return [f for f in mon.findings if f.is_problem]


def test_gradients_of_params_in_no_optimizer_are_not_called_a_missing_zero_grad(tmp_path):
    findings = {f.kind: f for f in _monitored_run(tmp_path / "r", zero_grad=True)}
    # The loop calls optimizer.zero_grad(): the stale gradients are those of the parameters the
    # optimizer does not hold, which param_not_in_optimizer names with the right fix.
    assert "gradients_accumulating" not in findings
    assert set(findings["param_not_in_optimizer"].evidence["params"]) == {
        "ln.weight", "ln.bias", "c_fc.bias", "c_proj.bias", "ln_f.weight", "ln_f.bias"}


def test_a_missing_zero_grad_is_still_found_beside_params_in_no_optimizer(tmp_path):
    kinds = {f.kind for f in _monitored_run(tmp_path / "r", zero_grad=False)}
    assert {"gradients_accumulating", "param_not_in_optimizer"} <= kinds
