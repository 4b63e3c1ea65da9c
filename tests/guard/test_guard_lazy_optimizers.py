"""Optimizers the train state does not hold: pyro's, created lazily inside the step."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

from .conftest import BS, PolyNet, assert_bitwise, finite, line_of, make_data, params


class LazyPerParamAdam:
    """pyro.optim.Adam as pyro-ppl/pyro's pyro/optim/optim.py (PyroOptim.__call__) builds it: one
    torch Adam per parameter, made the first time ``svi.step()`` hands the parameter over, inside
    the step; it has no ``state_dict()``, so a user's TrainState holds the model and the loader only."""

    def __init__(self, lr: float):
        self.lr = lr
        self.optim_objs: dict[torch.Tensor, torch.optim.Adam] = {}

    def __call__(self, params) -> None:
        for p in params:
            if p not in self.optim_objs:
                self.optim_objs[p] = torch.optim.Adam([p], lr=self.lr)
            self.optim_objs[p].step()


def _run(data: TensorDataset, steps: int, guard: tg.Guard | None = None) -> tuple[tg.TrainState, list]:
    torch.manual_seed(0)
    model = PolyNet()
    optim = LazyPerParamAdam(lr=1e-2)
    state = tg.TrainState(model=model, loader=DataLoader(data, batch_size=BS))
    batches = guard.batches(state, total_steps=steps) if guard is not None else enumerate(state.loader)
    losses = []
    for step, (x, y) in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)  # svi.step(): loss, backward, optim, zero_grad
        loss.backward()
        optim(list(model.parameters()))
        for p in model.parameters():
            p.grad = None
        losses.append((step, loss.item()))
    return state, losses


def test_optimizers_made_inside_the_step_after_the_snapshot_are_rewound_too(tmp_path):
    """pyro's VAE (examples/vae/vae.py) under the guard with a NaN sample in batch 4: the snapshot
    at step 0 came before pyro made its Adams, so the rewind put the weights back and left the
    moments NaN; the replay of step 0 made every weight NaN, the guard blamed step 1's `t` of a
    NaN weight and stopped with Diverged ('the fault follows the code')."""
    data = make_data(13, poison_batch=4)
    guard = tg.Guard(tmp_path / "run", snapshot_every=50)
    state, _ = _run(data, 12, guard)
    assert finite(state) and state.step == 12
    [event] = guard.events
    assert event["action"] == "skip" and event["step"] == 4 and event["rewound_to"] == 0, event
    assert event["replay"]["bitwise_equal"] is True, event["replay"]
    link = event["origin"]["origin"]
    assert link["op"].startswith("aten.pow") and link["line"] == line_of("POW_LINE"), link
    # the same as a run that never saw batch 4
    keep = [i for i in range(13 * BS) if not 4 * BS <= i < 5 * BS]
    clean, _ = _run(TensorDataset(*data[keep]), 12)
    assert_bitwise(params(state), params(clean))
