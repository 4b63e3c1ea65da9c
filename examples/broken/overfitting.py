"""Broken: a wide MLP trained for many epochs on 256 samples, a third of them mislabelled: it
memorises the noise, and the validation loss turns up while the training loss keeps falling.

Expected finding: ``overfitting`` (fix: stop at the best validation step; weight decay, dropout).
"""

import torch
import torch.nn.functional as F
from _common import Teacher, epochs, evaluate, mlp, parse_args


def main(argv=None):
    args = parse_args(40, argv)  # epochs
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    task = Teacher()
    x_train, y_train = task.batch(256, gen)
    noisy = torch.rand(256, generator=gen) < 0.33
    y_train = torch.where(noisy, torch.randint(0, task.classes, (256,), generator=gen), y_train)
    x_val, y_val = task.batch(512, gen)
    model = mlp([task.dim, 256, 256, task.classes])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
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
