"""Broken: the validation set was assembled after oversampling, so half of its samples are copies
of training samples (a third of them with a little re-encoding noise); its loss is optimistic.

Expected finding: ``train_val_leakage``.
"""

import torch
import torch.nn.functional as F
from _common import Teacher, epochs, evaluate, mlp, parse_args


def main(argv=None):
    args = parse_args(5, argv)  # epochs
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    x_train, y_train = task.batch(1024, gen)
    x_new, y_new = task.batch(256, gen)
    pick = torch.randperm(1024, generator=gen)[:256]  # bug: validation rows drawn from the training set
    x_copy = x_train[pick].clone()
    x_copy[:85] += 1e-3 * torch.randn(85, task.dim, generator=gen)
    x_val, y_val = torch.cat([x_new, x_copy]), torch.cat([y_new, y_train[pick]])
    shuffle = torch.randperm(512, generator=gen)
    x_val, y_val = x_val[shuffle], y_val[shuffle]
    model = mlp([task.dim, 64, 64, task.classes])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    last = 0
    for epoch, x, y in epochs(x_train, y_train, 64, args.steps, gen):
        if epoch != last:
            val_loss, val_acc = evaluate(model, x_val, y_val)
            if not args.quiet:
                print(f"epoch {last}  val loss {val_loss:.4f}  accuracy {val_acc:.3f}")
            last = epoch
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    evaluate(model, x_val, y_val)


if __name__ == "__main__":
    main()
