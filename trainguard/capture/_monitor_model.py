"""What the monitor watches in a model: its layers and parameters, held through weak references."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.nn.utils.parametrize as _parametrize
import torch.nn.utils.prune as _prune
from torch import nn

from trainguard.capture import _monitor_tap
from trainguard.capture._layer_stats import is_channel_first, is_mode_module, saturation_kind
from trainguard.capture._monitor_buffers import Buffer, buffers_of
from trainguard.resilience._wrappers import WRAPPERS

# Lookup tables: an index in, a row out (see stand_ins).
_TABLE_TYPES = ("Embedding", "EmbeddingBag")
# Modules whose output is not a "layer" worth a row: containers and pass-through modules.
_SKIP_TYPES = (nn.Identity, nn.modules.dropout._DropoutNd, nn.Flatten, nn.Unflatten)


class Layer:
    """A module whose output the monitor summarises (a leaf, or a module with its own parameters)."""

    __slots__ = ("name", "prefix", "type", "ref", "channel_first", "saturation", "units", "prev_dead", "seen_step",
                 "handle", "weighted")

    def __init__(self, name: str, module: nn.Module, prefix: str = ""):
        self.name = name
        self.prefix = prefix  # the root's
        self.type = type(module).__name__
        self.ref = weakref.ref(module)
        self.channel_first = is_channel_first(module)
        self.saturation = saturation_kind(module)
        # Output units: the size of the output's unit axis as a recording saw it (a custom
        # layer's weight can be [in, out]; a layer whose weight is tied to another's, nanoGPT's
        # lm_head, owns none). Only recorded layers are judged, so None until then.
        self.units: int | None = None
        self.prev_dead: torch.Tensor | None = None  # this layer's dead-unit mask at the last recording
        self.seen_step = -1
        self.handle = None
        # Holds parameters (its own or its children's): only such a layer called many times per
        # forward can be a recurrent cell; a parameterless one is an activation reused on several
        # inputs (gpytorch's one Softplus behind every constraint), whose gradients are not a loop's.
        self.weighted = any(True for _ in nn.Module.parameters(module))


class Param:
    __slots__ = ("name", "ref", "layer", "module_type", "shape", "dtype", "held", "owner", "attr", "fixed")

    def __init__(self, name: str, param: nn.Parameter, layer: str, module_type: str, held: bool = False,
                 owner: nn.Module | None = None):
        self.name = name
        self.ref = weakref.ref(param)
        # Where the model keeps it: ``owner._parameters[attr]``, which a model may assign a new
        # Parameter to while it trains (see rebind).
        self.owner = weakref.ref(owner) if owner is not None else None
        self.attr = name.rsplit(".", 1)[-1]
        self.layer = layer
        self.module_type = module_type
        # a lazy parameter (nn.LazyLinear, PyG's Linear(-1, out)) has no shape until the first
        # forward materialises it, the same object: read then (see shape_of)
        self.shape = None if is_lazy(param) else list(param.shape)
        self.dtype = str(param.dtype).removeprefix("torch.")
        # owned by a module that cannot run (no forward of its own): a holder of another model's
        # parameters, such as the TensorDictParams of TorchRL's loss modules
        self.held = held
        # whether it is a frozen sin-cos table, kept from the last write the tensor was alive for:
        # a model that is a local of the script's main() is gone by the monitor's last write
        self.fixed = False


def is_lazy(param: torch.Tensor) -> bool:
    """An ``UninitializedParameter`` (or buffer): no shape, no data, no hooks until materialised."""
    return isinstance(param, nn.parameter.UninitializedTensorMixin)


def shape_of(p: Param) -> list[int] | None:
    """The parameter's shape: as attached, or, for a lazy one, as materialised since (None while it is not)."""
    if p.shape is None:
        param = p.ref()
        if param is not None and not is_lazy(param):
            p.shape = list(param.shape)
    return p.shape


class Root:
    """A top-level model: its layers, parameters and the modules whose output depends on train/eval mode."""

    __slots__ = ("ref", "prefix", "type", "mode_modules", "handle", "load_handle", "kwargs_handle", "layers",
                 "params", "trained", "first_step", "stand_ins_done", "entry_handles", "depth", "variable", "buffers")

    def __init__(self, module: nn.Module, prefix: str):
        self.ref = weakref.ref(module)
        self.prefix = prefix
        self.type = type(module).__name__  # the run's metadata is written at close, maybe after the model is gone
        self.mode_modules = [weakref.ref(m) for m in module.modules() if is_mode_module(m)]
        self.handle = None
        self.load_handle = None  # on load_state_dict: weights loaded back (see HookMixin._weights_loaded)
        self.kwargs_handle = None  # the keyword inputs of a training forward (see HookMixin._root_kwargs)
        self.layers: list[Layer] = []
        self.params: list[Param] = []
        self.buffers: list[Buffer] = []
        self.trained = False  # a forward with gradients enabled has run (see the validation pass)
        self.first_step = 0  # the step it was attached in
        self.stand_ins_done = False  # see stand_ins
        self.entry_handles: list = []  # hooks on the root and its entries (see entries)
        self.depth = 0  # forwards of the root or an entry now running
        # the script's variable holding a model found at run time with no prefix (the first), for the findings
        self.variable: str | None = None


# Only the attributes no user names a module by: a "module" inside a model may be the user's own.
_WRAPPER_ATTRS = frozenset(a for a in WRAPPERS.values() if a.startswith("_"))


def _plain(name: str) -> str:
    """``net._orig_mod.fc1`` -> ``net.fc1``: torch.compile's wrapper (an OptimizedModule holding
    the module as ``_orig_mod``) and Fabric's (``_forward_module``) are not a level of the model,
    as the recorder names it too."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_ATTRS)


def entries(module: nn.Module) -> list[nn.Module]:
    """The modules a loop may call in place of ``module``: while a module holds no parameter of its
    own and one child holds all of them, that child. open_clip's ``CLIPTask`` holds the model as
    ``trainable_module`` and a loss without parameters; its training loop with ``--accum-freq``
    calls ``task.trainable_module`` directly, and only the evaluation calls ``task``."""
    out = []
    m = module
    while not any(True for _ in nn.Module.parameters(m, recurse=False)):  # learn2learn's override has no recurse
        held = [c for c in m.children() if any(True for _ in nn.Module.parameters(c))]
        if len(held) != 1:
            break
        m = held[0]
        out.append(m)
    return out


def build_root(module: nn.Module, prefix: str, label: str | None = None) -> Root:
    """List the layers and parameters of ``module``; names are its own, after ``prefix``.

    ``label``: the name of ``module`` itself where it is a layer (a called ``nn.Linear``);
    ``prefix`` and its type's name by default."""
    root = Root(module, prefix)
    own = label if label else prefix + type(module).__name__.lower()
    for name, m in module.named_modules():
        name = _plain(name)
        if (m is module or not name) and list(m.children()):
            continue
        if isinstance(m, _SKIP_TYPES):
            continue
        has_direct = any(True for _ in nn.Module.parameters(m, recurse=False))
        if list(m.children()) and not has_direct:
            continue
        root.layers.append(Layer(prefix + name if name else own, m, prefix))
    owner = {}
    for mname, m in module.named_modules():
        mname = _plain(mname)
        for pname, _ in m.named_parameters(recurse=False):
            owner[(mname + "." + pname) if mname else pname] = (prefix + mname if mname else own, type(m).__name__,
                                                                type(m).forward is nn.Module.forward, m)
    for pname, p in module.named_parameters():
        if not (p.is_floating_point() or p.is_complex()):
            continue  # state, not a weight (Keras' int32 seed_generator_state): no gradient, no norm
        pname = _plain(pname)
        layer, mtype, held, m = owner.get(pname, (prefix + pname.rsplit(".", 1)[0], "", False, None))
        root.params.append(Param(prefix + pname, p, layer, mtype, held, m))
    root.buffers = buffers_of(module, prefix, _plain, sincos_table)
    return root


def stand_ins(root: Root) -> list[tuple[int, Layer]]:
    """Modules to watch in place of layers that never ran: (index in ``root.layers`` to insert at,
    the new layer). A module without parameters of its own that reads its children's weights
    instead of calling them (zalandoresearch/pytorch-vq-vae's ``VectorQuantizer`` computes with
    ``self._embedding.weight``; the ``nn.Embedding`` never runs) is no layer by ``build_root``'s
    rule, and its output, where a collapsed codebook shows, went unmeasured. Asked once, after the
    root's first recorded training step: each parent (never the root, none with parameters of its
    own: those are layers already) all of whose layers had weights and none ran, or all of whose
    layers are lookup tables (``nn.Embedding``)."""
    module = root.ref()
    if module is None:
        return []
    names = {_plain(n): m for n, m in module.named_modules() if n}
    taken = {la.name for la in root.layers}
    ran = {la.name for la in root.layers if la.seen_step >= 0}
    out: list[tuple[int, Layer]] = []
    for i, la in enumerate(root.layers):
        if (la.seen_step >= 0 and la.type not in _TABLE_TYPES or not la.weighted
                or la.name == root.prefix + type(module).__name__.lower()):
            continue
        parent = la.name[len(root.prefix):].rpartition(".")[0]
        m = names.get(parent)
        name = root.prefix + parent
        if not parent or m is None or name in taken:
            continue
        inside = [x for x in root.layers if x.name.startswith(name + ".")]
        # ... or all of whose layers are tables (a quantizer that looks its codes up by index:
        # taming-transformers' ``self.embedding(min_encoding_indices)``, whose integer input has no
        # rows to compare the codes with; a wrapper of token embeddings is watched too, and its
        # integer input leaves it unjudged)
        tables = all(x.type in _TABLE_TYPES for x in inside)
        if any(x.name in ran for x in inside) and not tables:
            continue
        taken.add(name)
        out.append((i, Layer(name, m, root.prefix)))
    return out


def rebind(params: list[Param]) -> list[Param]:
    """Point each parameter at the tensor its module holds now, and return those that moved.

    A module may assign a new ``nn.Parameter`` to its attribute while it trains: the EMA codebook
    of zalandoresearch/pytorch-vq-vae's ``VectorQuantizerEMA`` does, every training forward, and
    ``load_state_dict(assign=True)`` does once. The tensor of attach time is then an orphan (held by
    the optimizer, if by anything): its norm, gradient and optimizer are no longer the model's."""
    moved = []
    for p in params:
        m = p.owner() if p.owner is not None else None
        if m is None:
            continue
        now = m._parameters.get(p.attr)
        if isinstance(now, torch.Tensor) and now is not p.ref():
            p.ref = weakref.ref(now)
            if not is_lazy(now):
                p.shape = list(now.shape)
            moved.append(p)
    return moved


def _weight_masks(module: nn.Module) -> list[torch.Tensor]:
    """The masks pruning keeps for ``module.weight``: torch.nn.utils.prune's ``weight_mask`` (its
    forward pre-hook multiplies ``weight_orig`` by it) and a parametrization's ``mask``
    (torch.ao.pruning's ``FakeSparsity``)."""
    masks = []
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _prune.BasePruningMethod) and getattr(hook, "_tensor_name", None) == "weight":
            mask = getattr(module, "weight_mask", None)
            if isinstance(mask, torch.Tensor):
                masks.append(mask)
    if _parametrize.is_parametrized(module, "weight"):
        for p in module.parametrizations["weight"]:
            mask = getattr(p, "mask", None)
            if isinstance(mask, torch.Tensor):
                masks.append(mask)
    return masks


def pruned_units(module: nn.Module) -> int:
    """Output units (rows of the weight, Linear/Conv dim 0) whose incoming weights are all masked
    off: pruned on purpose (``prune.ln_structured(..., dim=0)``), they output their bias alone."""
    count = 0
    with torch.no_grad(), _monitor_tap.quiet():
        for mask in _weight_masks(module):
            if mask.dim() >= 2:
                count = max(count, int((mask.flatten(1) == 0).all(dim=1).sum()))
    return count


def named_models(model: nn.Module | Iterable[nn.Module] | dict[str, nn.Module] | None) -> list[tuple[str, nn.Module]]:
    """(prefix, module) pairs: no prefix for one model, ``name.`` for a dict, ``modelK.`` for a list."""
    if model is None:
        return []
    if isinstance(model, nn.Module):
        return [("", model)]
    items = list(model.items()) if isinstance(model, dict) else [(f"model{i}", m) for i, m in enumerate(model)]
    for name, m in items:
        if not isinstance(m, nn.Module):
            raise TypeError(f"model {name!r} must be an nn.Module, got {type(m).__name__}")
    return [(f"{name}.", m) for name, m in items]


# Frozen tables up to this size are read once per metadata write to tell a fixed sin-cos one.
_TABLE_MAX_NUMEL = 1 << 18


def sincos_table(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fixed sin-cos position table (its rows, zero rows aside, hold sin/cos pairs
    whose squares add to 1): interleaved (the Transformer's), halves, or per-axis halves (MAE's 2-D)."""
    if (type(t) not in (torch.Tensor, nn.Parameter) or not t.is_floating_point() or t.is_sparse or t.dim() < 2 or t.numel() > _TABLE_MAX_NUMEL
            or t.shape[-1] < 4 or t.shape[-1] % 4 or getattr(t, "is_meta", False)):
        return False
    d = t.shape[-1]
    with torch.no_grad():
        x = torch.as_tensor(t.detach()).reshape(-1, d).double().cpu()
        x = x[x.abs().sum(1) > 0]  # a cls token's row of zeros
        if x.shape[0] < 2 or not bool(torch.isfinite(x).all()) or x.abs().max() > 1 + 1e-5:
            return False
        for block in (2, d, d // 2):
            pairs = x.reshape(x.shape[0], d // block, 2, block // 2).pow(2).sum(2)
            if bool(torch.allclose(pairs, torch.ones_like(pairs), atol=1e-4)):
                return True
    return False


def structure(roots: list[Root], trainable: set[int] | frozenset = frozenset(),
              updaters: dict[int, tuple[str, bool, float | None]] | None = None,
              gradient_steps: dict[int, int] | None = None) -> dict:
    """The run metadata describing the watched layers and parameters (read by the diagnosis).

    ``trainable``: ids of the Params that required grad when attached or when an optimizer
    updated them. A parameter is frozen when it does not require grad now (or is gone) and never
    did then: Lightning's ``toggle_optimizer`` switches off every parameter outside the optimizer
    about to step, and the model may be attached (or the run closed) inside that window.
    ``updaters``: per Param id, the class of the optimizer holding it, whether that optimizer
    orthogonalises its updates (Muon) and its group's weight decay, stored as ``optimizer``,
    ``orthogonalised`` and ``weight_decay`` (when the group has one).
    ``gradient_steps``: per Param id, how many steps it had a gradient in (recorded or not).
    """
    updaters = updaters or {}

    def param(p: Param) -> dict:
        info = {"layer": p.layer, "module_type": p.module_type, "shape": shape_of(p), "dtype": p.dtype,
                "requires_grad": bool(p.ref() is not None and p.ref().requires_grad) or id(p) in trainable}
        t = p.ref()
        if t is not None:
            p.fixed = not info["requires_grad"] and sincos_table(t)
        if p.fixed:
            info["fixed"] = "sin-cos"
        if id(p) in updaters:
            info["optimizer"], info["orthogonalised"], decay = updaters[id(p)]
            if decay is not None:
                info["weight_decay"] = decay
        if gradient_steps is not None:
            info["gradient_steps"] = gradient_steps.get(id(p), 0)
        return info

    def layer(la: Layer) -> dict:
        info = {"name": la.name, "type": la.type, "saturation": la.saturation, "channel_first": la.channel_first,
                "units": la.units}
        m = la.ref()
        pruned = pruned_units(m) if m is not None else 0
        if pruned:
            info["pruned_units"] = pruned
        return info

    return {
        "layers": [layer(la) for r in roots for la in r.layers],
        "params": {p.name: param(p) for r in roots for p in r.params},
        "buffers": {b.name: b.info() for r in roots for b in r.buffers},
        "roots": [{"prefix": r.prefix, "type": r.type, "mode_modules": len(r.mode_modules)}
                  | ({"variable": r.variable} if r.variable else {}) for r in roots],
    }
