"""Three real training programs for the recorder benchmark, derived from code users run.

``nanogpt``: a tiny GPT after karpathy/nanoGPT's model.py (CausalSelfAttention, MLP, Block, GPT
with tied embeddings) trained with AdamW on character data, with train.py's ``get_batch`` as the
data preparation loop (a ``from_numpy`` and a ``stack`` per sample: many tiny ops). The text is
synthetic (no download): random characters from a 65-symbol alphabet, as prepare.py's
shakespeare_char vocabulary. ``vae``: pytorch/examples' vae/main.py (VAE, loss_function, the
train loop) on synthetic 28x28 images in [0, 1] instead of MNIST. ``ppo``: vwxyzjn/cleanrl's
ppo.py (its Agent, rollout, advantage estimation and clipped update) on a synthetic CartPole-sized
vector env: reinforcement learning's tiny batches, where the recorder's per-op cost is the cost.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class _MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = _MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([_Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def make_nanogpt():
    """One step: nanoGPT's get_batch (the data preparation loop), forward, backward, AdamW."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 65, size=200_000).astype(np.uint16)  # as train.bin: uint16 char ids
    block_size, batch_size = 64, 16
    model = GPT(block_size=block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def get_batch():
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x, y

    def loss_fn():
        x, y = get_batch()
        return model(x, y)
    return model, opt, loss_fn


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def make_vae():
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.rand(128, 1, 28, 28)

    def loss_fn():
        recon, mu, logvar = model(data)
        bce = F.binary_cross_entropy(recon, data.view(-1, 784), reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return bce + kld
    return model, opt, loss_fn


class PPOAgent(nn.Module):
    """cleanrl's PPO agent (vwxyzjn/cleanrl cleanrl/ppo.py, Agent): a critic and an actor, two
    hidden layers of 64 with tanh each, a Categorical policy over the actor's logits."""

    def __init__(self, n_obs: int = 4, n_actions: int = 2):
        super().__init__()

        def layer(i, o, std=math.sqrt(2)):
            lin = nn.Linear(i, o)
            torch.nn.init.orthogonal_(lin.weight, std)
            torch.nn.init.constant_(lin.bias, 0.0)
            return lin

        self.critic = nn.Sequential(layer(n_obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, std=1.0))
        self.actor = nn.Sequential(layer(n_obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(),
                                   layer(64, n_actions, std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class _ClipThenStep:
    """The optimizer as the loop uses it: ppo.py clips the gradients' norm before each step."""

    def __init__(self, params, opt, max_norm: float):
        self.params, self.opt, self.max_norm = params, opt, max_norm

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()


def make_ppo():
    """cleanrl's ppo.py on a CartPole-sized synthetic vector env (4 envs, NumPy observations):
    one step is 8 rollout steps (action sampling under no_grad, the NumPy round trips) and one
    clipped-objective minibatch update, the ratio of ppo.py's 128-step rollout to its 16 updates.
    Thousands of tiny ops per second: the recorder's per-op cost, not arithmetic, sets its time."""
    num_envs, rollout, minibatch = 4, 8, 128
    rng = np.random.default_rng(0)
    agent = PPOAgent()
    params = list(agent.parameters())
    opt = _ClipThenStep(params, torch.optim.Adam(params, lr=2.5e-4, eps=1e-5), 0.5)
    size = 512  # ppo.py's batch: 4 envs x 128 steps
    b_obs, b_actions = torch.randn(size, 4), torch.randint(0, 2, (size,)).float()
    b_logprobs, b_advantages = torch.full((size,), -0.69), torch.randn(size)
    b_returns, b_values = torch.randn(size), torch.randn(size)
    obs, logprobs, values = torch.zeros(rollout, num_envs, 4), torch.zeros(rollout, num_envs), torch.zeros(rollout, num_envs)
    rewards, dones = torch.zeros(rollout, num_envs), torch.zeros(rollout, num_envs)
    state = {"obs": torch.Tensor(rng.standard_normal((num_envs, 4)).astype(np.float32)), "done": torch.zeros(num_envs)}

    def loss_fn():
        for step in range(rollout):  # the rollout
            obs[step], dones[step] = state["obs"], state["done"]
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(state["obs"])
                values[step] = value.flatten()
            logprobs[step] = logprob
            action.cpu().numpy()  # envs.step(...)
            next_obs = rng.standard_normal((num_envs, 4)).astype(np.float32)
            rewards[step] = torch.tensor(np.ones(num_envs, dtype=np.float32)).view(-1)
            state["obs"], state["done"] = torch.Tensor(next_obs), torch.Tensor(rng.random(num_envs) < 0.05)
        with torch.no_grad():  # generalised advantage estimation, ppo.py's loop
            advantages, lastgaelam = torch.zeros_like(rewards), 0
            for t in reversed(range(rollout)):
                nextnonterminal = 1.0 - (state["done"] if t == rollout - 1 else dones[t + 1])
                nextvalues = agent.get_value(state["obs"]).reshape(-1) if t == rollout - 1 else values[t + 1]
                delta = rewards[t] + 0.99 * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + 0.99 * 0.95 * nextnonterminal * lastgaelam
        mb = torch.from_numpy(rng.permutation(size)[:minibatch])  # one minibatch update
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions.long()[mb])
        logratio = newlogprob - b_logprobs[mb]
        ratio = logratio.exp()
        with torch.no_grad():
            ((ratio - 1.0).abs() > 0.2).float().mean().item()  # clipfracs
        mb_adv = b_advantages[mb]
        mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
        pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 0.8, 1.2)).mean()
        newvalue = newvalue.view(-1)
        v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -0.2, 0.2)
        v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
        return pg_loss - 0.01 * entropy.mean() + v_loss * 0.5
    return agent, opt, loss_fn
