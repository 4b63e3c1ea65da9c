"""Broken: the training labels were shuffled apart from their inputs (``y = y[randperm]`` alone);
the validation set is labelled correctly. The model memorises the 256 training pairs, and the
validation loss never gets below chance, ln(5).

Expected finding: ``labels_unrelated``, explaining ``overfitting``.
"""

import torch
from _common import Teacher, fit_with_validation, mlp, parse_args


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
    fit_with_validation(model, opt, (x_train, y_train), (x_val, y_val), args, gen)


if __name__ == "__main__":
    main()
