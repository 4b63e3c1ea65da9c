"""Broken: a wide MLP trained for many epochs on 256 samples, a third of them mislabelled: it
memorises the noise, and the validation loss turns up while the training loss keeps falling.

Expected finding: ``overfitting`` (fix: stop at the best validation step; weight decay, dropout).
"""

import torch
from _common import Teacher, fit_with_validation, mlp, parse_args


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
    fit_with_validation(model, opt, (x_train, y_train), (x_val, y_val), args, gen)


if __name__ == "__main__":
    main()
