"""Healthy: an MLP trained for epochs on a fixed training set, evaluated after every epoch on a
held-out set (and on the training set) in eval mode under ``no_grad``.

Expected: no warning-level finding (verdict ``healthy``).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, epochs, evaluate, mlp, parse_args


def main(argv=None):
    args = parse_args(6, argv)  # epochs
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    x_train, y_train = task.batch(2048, gen)
    x_val, y_val = task.batch(512, gen)
    model = mlp([task.dim, 64, 64, task.classes], dropout=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    last = -1
    for epoch, x, y in epochs(x_train, y_train, 64, args.steps, gen):
        if epoch != last and epoch > 0:
            report(args, epoch - 1, model, x_train, y_train, x_val, y_val)
        last = epoch
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    report(args, last, model, x_train, y_train, x_val, y_val)


def report(args, epoch, model, x_train, y_train, x_val, y_val):
    train_loss, train_acc = evaluate(model, x_train, y_train)
    val_loss, val_acc = evaluate(model, x_val, y_val)
    if not args.quiet:
        print(f"epoch {epoch}  train {train_loss:.4f} ({train_acc:.3f})  val {val_loss:.4f} ({val_acc:.3f})")


if __name__ == "__main__":
    main()
