"""Broken: the training labels were shuffled apart from their inputs (``y = y[randperm]`` alone);
the validation set is labelled correctly. The model memorises the 256 training pairs, and the
validation loss never gets below chance, ln(5).

Expected finding: ``labels_unrelated``, explaining ``overfitting``.
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
    y_train = y_train[torch.randperm(256, generator=gen)]  # bug: labels shuffled without their inputs
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
