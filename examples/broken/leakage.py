"""Broken: the validation set was assembled after oversampling, so half of its samples are copies
of training samples (a third of them with a little re-encoding noise); its loss is optimistic.

Expected finding: ``train_val_leakage``.
"""

import torch
from _common import Teacher, fit_with_validation, mlp, parse_args


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
    fit_with_validation(model, opt, (x_train, y_train), (x_val, y_val), args, gen)


if __name__ == "__main__":
    main()
