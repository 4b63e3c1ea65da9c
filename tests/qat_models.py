"""Eager quantization-aware training as pytorch/tutorials' QAT tutorial sets it up, shared by the
tests of models under ``prepare_qat``."""

from __future__ import annotations

import warnings

import torch.ao.quantization as tq
from torch import nn


def prepared(model: nn.Module, fuse: list[list[str]]) -> nn.Module:
    """``model`` (in train mode) fused (``fuse``: groups of child names) and prepared for QAT with
    the x86 qconfig, in place."""
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.fuse_modules_qat(model, fuse, inplace=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's eager quantization is deprecated in favour of torchao
        tq.prepare_qat(model, inplace=True)
    return model
