"""overfit_one_batch on a character language model: karpathy/makemore @ 988aa59 (makemore.py's
CharDataset: x = [0, word...], y = [word..., 0, -1...], cross entropy with ignore_index=-1). Every
word of a batch begins with the start token, so no causal model can predict the first letters:
`trainguard doctor` on makemore's Transformer failed with "the loss is stuck at a floor of 0.503"
when that floor was the batch's own."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from trainguard import doctor

# the first 32 lines of makemore's names.txt
WORDS = ("emma olivia ava isabella sophia charlotte mia amelia harper evelyn abigail emily elizabeth mila ella avery "
         "sofia camila aria scarlett victoria madison luna grace chloe penelope layla riley zoey nora lily eleanor").split()


def _batch():
    chars = sorted(set("".join(WORDS)))
    stoi = {c: i + 1 for i, c in enumerate(chars)}
    T = max(map(len, WORDS)) + 1
    x = torch.zeros(len(WORDS), T, dtype=torch.long)
    y = torch.full((len(WORDS), T), -1, dtype=torch.long)
    for i, w in enumerate(WORDS):
        ix = torch.tensor([stoi[c] for c in w])
        x[i, 1:1 + len(w)] = ix
        y[i, :len(w)] = ix
        y[i, len(w)] = 0
    return x, y, len(chars) + 1


class _GRULM(nn.Module):
    """makemore's RNN(cell_type='gru'), with torch's GRU."""

    def __init__(self, vocab: int, d: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.lm_head(self.rnn(self.wte(x))[0])


def _loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)


def _entropy_given_prefix(x, y) -> float:
    """The mean, over counted targets, of the entropy of the next token among the batch's words that
    share the tokens so far: the least any causal model's cross entropy can be."""
    nexts = defaultdict(Counter)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if y[i, t] >= 0:
                nexts[tuple(x[i, :t + 1].tolist())][int(y[i, t])] += 1
    total = sum(sum(c.values()) for c in nexts.values())
    return sum(-n * math.log(n / sum(c.values())) for c in nexts.values() for n in c.values()) / total


def test_a_language_models_batch_is_overfit_to_the_floor_its_shared_prefixes_leave():
    torch.manual_seed(0)
    x, y, vocab = _batch()
    floor = _entropy_given_prefix(x, y)
    assert floor > 0.3  # the first letters alone
    r = doctor.overfit_one_batch(_GRULM(vocab), (x, y), _loss)
    assert abs(r.loss_floor - floor) < 0.02, (r.loss_floor, floor)
    assert r.passed, (r.reason, r.final_loss, r.loss_floor)
    assert f"the least this loss can be on these targets is {r.loss_floor:.3g}" in r.summary, r.summary


def test_a_model_that_does_not_learn_still_fails_above_that_floor():
    torch.manual_seed(0)
    x, y, vocab = _batch()
    model = _GRULM(vocab)
    r = doctor.overfit_one_batch(model, (x, y), _loss, steps=5)
    assert not r.passed and r.final_loss > r.loss_floor + 0.5
