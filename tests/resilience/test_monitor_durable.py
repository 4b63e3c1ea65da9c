"""What a checkpoint holds, the monitor's run holds too: a process killed with SIGKILL after a save
leaves the loss curve of the steps that save covers, so a resumed run's curve has no gap."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from trainguard.store import open_run

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch, trainguard as tg
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4, shuffle=True)
    state = tg.TrainState(model=model, optimizer=opt, loader=loader)
    ckpt = tg.CheckpointManager(sys.argv[2], keep=2, every_steps=5)
    kill_at = int(sys.argv[3])
    with tg.Monitor(model, sys.argv[1], every=1000, append=True):
        for step, (x, y) in ckpt.resume(state, total_steps=12).batches():
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_run_killed_after_a_checkpoint_keeps_the_loss_curve_the_checkpoint_covers(tmp_path):
    # A VQ-VAE (zalandoresearch/pytorch-vq-vae) under `trainguard run --monitor --resume`, saved every
    # 5 steps and killed with SIGKILL at step 17, resumed from the checkpoint of step 15: the run's
    # loss curve had steps 0-9 and 15-29, never 10-14, which the checkpoint had trained. The monitor
    # ships its buffered steps every 2 seconds; a checkpoint did not make them durable.
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    killed = subprocess.run([sys.executable, "-c", SCRIPT, str(run), str(ckpt), "7"], timeout=120)
    assert killed.returncode == -9
    with open_run(run) as r:
        steps = [s for s, _ in r.scalars("loss").get("loss", [])]
    assert set(range(5)) <= set(steps), steps  # the checkpoint of step 5 holds steps 0-4
    subprocess.run([sys.executable, "-c", SCRIPT, str(run), str(ckpt), "-1"], timeout=120, check=True)
    with open_run(run) as r:
        steps = [s for s, _ in r.scalars("loss").get("loss", [])]
    assert steps == list(range(12)), steps
