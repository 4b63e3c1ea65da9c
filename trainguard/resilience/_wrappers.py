"""Wrappers that are no level of the model: the table both the checkpoint (which saves the model,
not the wrapper) and the capture layer (which names layers as the model's ``state_dict`` does)
read."""

from __future__ import annotations

from typing import Any

from torch import nn

# By the name of their type or of a base type: the attribute holding the model. torch.compile(model)
# returns an OptimizedModule (``_orig_mod``), Lightning Fabric's fabric.setup(model) a _FabricModule
# (``_forward_module``, the model or a DDP around it), DistributedDataParallel and DataParallel hold
# it as ``module``, and opacus' make_private a GradSampleModule (of any grad_sample_mode, all
# AbstractGradSampleModules) as ``_module``, which its DPDDP holds as ``module``. torch's
# checkpoint_wrapper and offload_wrapper (ActivationWrapper: torchtune's
# set_activation_checkpointing wraps each transformer layer) hold it as
# ``_checkpoint_wrapped_module``, which their state_dict hooks strip. torchdiffeq's odeint wraps
# the dynamics the user passes (an ODEFunc, an ODEBlock's ``odefunc``) in a new module at every
# call, as ``base_func``: _PerturbFunc always, _TupleFunc around it for a tuple state,
# _ReverseFunc to integrate backwards in time. Names, not classes: importing this never imports a
# framework.
WRAPPERS = {"OptimizedModule": "_orig_mod", "_FabricModule": "_forward_module",
            "DistributedDataParallel": "module", "DataParallel": "module",
            "AbstractGradSampleModule": "_module", "DifferentiallyPrivateDistributedDataParallel": "module",
            "ActivationWrapper": "_checkpoint_wrapped_module",
            "_PerturbFunc": "base_func", "_TupleFunc": "base_func", "_TupleInputOnlyFunc": "base_func",
            "_ReverseFunc": "base_func"}


def wrapper_attr(cls: type) -> str | None:
    """The attribute a wrapper type of ``WRAPPERS`` (or a subclass) holds the model in, else None."""
    for base in cls.__mro__:
        attr = WRAPPERS.get(base.__name__)
        if attr is not None:
            return attr
    return None


def wrapped(module: Any) -> nn.Module | None:
    """The module a wrapper of ``WRAPPERS`` holds, None for any other object."""
    attr = wrapper_attr(type(module))
    inner = getattr(module, attr, None) if attr is not None else None
    return inner if isinstance(inner, nn.Module) else None


def unwrapped(module: Any) -> Any:
    """The model inside its wrappers (a compiled model that fabric.setup wrapped: both); any other
    object as it is."""
    for _ in range(16):  # a wrapper that holds itself ends here too
        inner = wrapped(module)
        if inner is None:
            break
        module = inner
    return module
