"""What the monitor attaches to a user's model, and how that stays invisible to the model's pickle.

A module keeps its hooks in ``OrderedDict``s that ``torch.save(model)``, ``pickle`` and
``copy.deepcopy`` copy with it. A closure there makes pickling fail ("Can't pickle local object")
and a reference to trainguard would make the file need trainguard to load (``torch.load`` with
``weights_only`` refuses unknown globals). So trainguard's module hooks are :class:`ModuleHook`
objects, and while a monitor is open ``copyreg`` reduces an ``OrderedDict`` holding one to a plain
``OrderedDict`` without it: the saved or copied model is exactly what it would be unwatched.
(Tensor hooks are never serialised by torch; global module hooks live outside the model.)

:class:`HookMixin` is the part of :class:`~trainguard.capture._monitor.Monitor` that attaches:
roots (a forward pre-hook each: train/eval mode, the model's input, the end of a step in a loop
without an optimizer), layers (forward hooks at recording steps only) and discovery (a global
forward pre-hook while no model is known, ``Monitor(None)``). Inside code that ``torch.compile``
traces, the hooks only emit ``trainguard::tap`` and the compiled code calls the monitor back at
run time (see ``_compile_monitor``).
"""

from __future__ import annotations

import copyreg
import gc
import logging
import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList as _ParametrizationList

from trainguard.capture import _compile_monitor, _modules, _monitor_tap, _skips
from trainguard.capture._compile import keep_dynamo_out
from trainguard.capture._layer_stats import (
    activation_stats,
    count_codes,
    first_tensor,
    histogram,
    input_stats,
    layer_output,
    row_hashes,
)
from trainguard.capture._modules import (
    caller_variable,
    container_path,
    forward_pre_hook,
    owner_attribute,
    probing_owner,
)
from trainguard.capture._monitor_model import Layer, Root, build_root, entries, stand_ins, structure
from trainguard.resilience import _state as _resilience_state
from trainguard.resilience._wrappers import unwrapped, wrapped

log = logging.getLogger("trainguard.monitor")
_tracing_state = torch._C._get_tracing_state
# Whether a torch.func transform (vmap, grad, jvp, ...) is running: a module called there (by
# functional_call) holds and returns the transform's wrapped tensors, which must not leave it.
_in_functorch = torch._C._are_functorch_transforms_active
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__  # the module imported above


def _leaf_ids(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) the loss's autograd graph accumulates into."""
    out: set[int] = set()
    todo, seen = [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad
        if var is not None:
            out.add(id(var))
        todo.extend(f for f, _ in fn.next_functions)
    return out


def _symbolic(args: tuple) -> bool:
    """Whether a module is called with a symbolic tensor first: a shape and a dtype, no values
    (Keras' ``KerasTensor``, with which a Keras model builds its layers)."""
    head = args[0] if args else None
    if isinstance(head, (tuple, list)) and head:
        head = head[0]
    return type(head).__name__ == "KerasTensor"


def _live_modules() -> list[nn.Module]:
    # type(o), not isinstance: isinstance reads o.__class__, which a deprecation proxy warns on
    return [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]


def _adapted_copy(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters computed from others (learn2learn's clone of a model,
    adapted by MAML's inner loop), not leaves of its own."""
    params = nn.Module.parameters(module)
    first = next(params, None)  # asked at each root-hook call of a module that is no root: no list
    return first is not None and first.grad_fn is not None and all(p.grad_fn is not None for p in params)


def _leaf_of(t: torch.Tensor, depth: int = 16) -> torch.Tensor | None:
    """The leaf tensor a non-leaf ``t`` was first computed from (``p.clone()``, then ``+ update``s),
    following each node's first input; None when there is none within ``depth`` nodes."""
    node = t.grad_fn
    for _ in range(depth):
        if node is None:
            return None
        if hasattr(node, "variable"):  # AccumulateGrad
            return node.variable
        nxt = [n for n, _ in node.next_functions if n is not None]
        node = nxt[0] if nxt else None
    return None


def _inside_checkpoint() -> bool:
    """Whether torch.utils.checkpoint is on the calling thread's stack (asked once per layer)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        f = f.f_back
    return False


class ModuleHook:
    """A hook trainguard put on a module: ``fn(arg, *hook_args)``; left out when the module is pickled.

    ``token`` (see ``_compile_monitor``): while Dynamo traces the hook, it emits a tap of the
    module's tensors instead, through which the compiled code calls the monitor back."""

    __slots__ = ("fn", "arg", "token")

    def __init__(self, fn: Callable, arg=None, token: int | None = None):
        self.fn = fn
        self.arg = arg
        self.token = token

    def __call__(self, *args):
        if torch.compiler.is_compiling():  # traced into a graph: run there as a tap, never as Python
            if self.token is not None:
                _trace_tap(self.token, *args)
            return None
        if _tracing_state() is not None:  # torch.jit.trace: the traced graph is the model's alone
            return None
        if _in_functorch():  # inside vmap / grad: the transform's wrapped tensors stay there
            return None
        if len(args) > 1:
            x = first_tensor(args[1])
            if x is not None and x.is_meta:
                # A shape pass on the "meta" device (Keras' compute_output_spec builds every
                # model and loss that way): no values, no step, not an evaluation
                return None
        return self.fn(self.arg, *args)


def _trace_tap(token: int, module, args, *output) -> None:
    # A root's pre-hook (no output): the model's first tensor input; a layer's forward hook: its
    # output, then its first input. ``grad``: the compiled forward itself runs with grad off.
    if not output:
        x = next((t for t in map(first_tensor, args) if t is not None), None)
        _compile_monitor.tap([] if x is None else [x], token, torch.is_grad_enabled())
        return
    x, inp = layer_output(output[0]), first_tensor(args)
    if x is not None:
        _compile_monitor.tap([x] if inp is None else [x, inp], token, torch.is_grad_enabled())


_lock = threading.Lock()
_users = 0
_previous_reducer = None


def _reduce_ordered_dict(d: OrderedDict):
    if any(type(v) is ModuleHook for v in d.values()):
        kept = [(k, v) for k, v in d.items() if type(v) is not ModuleHook]
        return (OrderedDict, (), None, None, iter(kept))
    if _previous_reducer is not None:
        return _previous_reducer(d)
    return d.__reduce__()


def hide_hooks_from_pickle() -> None:
    """While held (reference counted), pickles and deep copies of modules leave trainguard's hooks out."""
    global _users, _previous_reducer
    with _lock:
        _users += 1
        if _users == 1:
            _previous_reducer = copyreg.dispatch_table.get(OrderedDict)
            copyreg.dispatch_table[OrderedDict] = _reduce_ordered_dict


def release_pickle_hiding() -> None:
    global _users, _previous_reducer
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and copyreg.dispatch_table.get(OrderedDict) is _reduce_ordered_dict:
            if _previous_reducer is None:
                del copyreg.dispatch_table[OrderedDict]
            else:
                copyreg.dispatch_table[OrderedDict] = _previous_reducer
            _previous_reducer = None


class HookMixin:
    """Attaching to models and the hooks that run in their forward pass (state lives on the Monitor)."""

    # ------------------------------------------------------------------ attaching
    def _attach(self, module: nn.Module, prefix: str, label: str | None = None) -> Root:
        while (held := wrapped(module)) is not None:  # torch.compile(model), fabric.setup(model): the model
            self._known.add(module)
            module = held
        # A module that contains roots attached earlier (called on its own first) replaces them.
        inner = [r for r in self._roots if r.ref() is not None and any(r.ref() is m for m in module.modules())]
        for r in inner:
            self._detach_root(r)
        root = build_root(module, prefix, label)
        root.first_step = self._cur
        # open_clip evaluates task(batch) after training task.trainable_module: the task found then
        # has trained already (its evaluation forwards are evaluations, see _root_pre_quiet)
        root.trained = any(r.trained for r in inner)
        self._watch_once(root)
        for m in module.modules():
            self._known.add(m)
        root.handle = module.register_forward_pre_hook(ModuleHook(self._root_pre, root, _compile_monitor.token(module)))
        root.load_handle = module.register_load_state_dict_post_hook(ModuleHook(self._weights_loaded, root))
        # model(**batch), as the HF Trainer calls it: the keyword inputs' padding, for the loss watch
        root.kwargs_handle = module.register_forward_pre_hook(ModuleHook(self._root_kwargs, root), with_kwargs=True)
        held_by = entries(module)  # the modules a loop may call in its place (open_clip's trainable_module)
        for m in [module, *held_by] if held_by else []:
            root.entry_handles += [m.register_forward_pre_hook(ModuleHook(self._entry_pre, root)),
                                   m.register_forward_hook(ModuleHook(self._entry_post, root), always_call=True)]
        self._listen(module, lambda ts, grad: self._root_pre(root, root.ref(), (ts[0],) if ts else (), grad))
        for la in root.layers:
            if la.ref() is not None:
                self._listen(la.ref(), lambda ts, grad, la=la: self._on_layer(la, la.ref(), ts[1:], ts[0], grad))
        self._roots.append(root)
        self._params = [p for r in self._roots for p in r.params]
        if self._layer_hooks_on:
            for la in root.layers:
                self._hook_layer(la)
        if self._recording:
            self._grads.hook_params(root.params, lambda: self._cur)
        self._grads.forget_optimizers()
        # Trainable: requires grad now, or later at an update (see structure); known here too for
        # the case where the model is gone when the monitor closes (a script's main() returned).
        self._grads.trainable.update(id(p) for p in root.params if (t := p.ref()) is not None and t.requires_grad)
        self._write_meta(**structure(self._roots, self._grads.trainable, self._grads.updaters))
        for fn in list(self._attach_listeners):
            try:
                fn(self, module)
            except Exception:  # observing training never kills training
                log.exception("trainguard monitor: attach listener failed")
        return root

    def _entry_pre(self, root: Root, module, args) -> None:
        # An entry of the root (see entries) called on its own, not from the root's forward, runs
        # the root's forward: the training forward of open_clip's --accum-freq calls
        # task.trainable_module, its evaluation calls task (which calls it in turn).
        if root.depth == 0 and module is not root.ref():
            self._root_pre(root, root.ref(), args)
        root.depth += 1

    def _entry_post(self, root: Root, module, args, output) -> None:
        root.depth = max(0, root.depth - 1)

    def _weights_loaded(self, root: Root, module: nn.Module, incompatible=None) -> None:
        """``load_state_dict`` on a watched model after it trained: the steps before were undone (an LR
        range test, fastai's ``lr_find``, loads the weights it saved back before the real fit). Kept as
        the first step trained from the loaded weights: ``meta["weights_loaded"]``."""
        if self._closed or not root.trained or _resilience_state.applying():  # a checkpoint's restore, a rewind
            return
        # Past a backward whose update ran (a step without an optimizer ends at the next forward)
        # the loaded weights start the next step.
        step = self._cur + (1 if self._pending_end is not None or self._backward_step == self._cur else 0)
        loads = list(self._meta.get("weights_loaded") or [])
        loads.append({"step": step, "model": root.prefix or root.type})
        self._write_meta(weights_loaded=loads)

    def name_after(self, module: nn.Module, model: nn.Module, outer: str) -> bool:
        """Name the layers and parameters of the attached root ``module`` after ``model``, the
        model it holds: ``model``'s own ``state_dict`` names, and ``outer`` before the rest
        (sentence-transformers' loss modules hold the trained model and, like SoftmaxLoss, a
        classifier of their own: ``0.model.encoder.layer.0...`` and ``loss.classifier.weight``, not
        ``model.0.model.encoder.layer.0...``). Only right after attaching, before any step used
        the names; False (nothing renamed) unless ``module`` is a root named from "" and
        ``model`` is inside it."""
        from trainguard.capture._monitor_model import _plain

        root = next((r for r in self._roots if r.ref() is module), None)
        path = next((_plain(n) for n, m in module.named_modules() if m is model and n), None)
        if root is None or root.prefix != "" or not path:
            return False
        own, holder = type(model).__name__.lower(), type(module).__name__.lower()

        def rename(name: str) -> str:
            if name == path:  # the model is a layer itself (a bare nn.Linear): its label, as if attached alone
                return own
            if name == holder:  # parameters of the holder itself (a loss's logit_scale)
                return outer.rstrip(".")
            return name[len(path) + 1:] if name.startswith(path + ".") else outer + name

        for la in root.layers:
            la.name = rename(la.name)
        for p in root.params:
            p.name, p.layer = rename(p.name), rename(p.layer)
        # The holder's own parameters: a framework checkpoint of the model alone misses them.
        held = [p.name for p in root.params if p.name.startswith(outer)]
        self._write_meta(**structure(self._roots, self._grads.trainable, self._grads.updaters), loss_params=held)
        # The recorders name the holder's modules the same way (the model's `1`, not `model.1`):
        # a non-finite finding's layer is one the monitor shows.
        raw = next((n for n, m in module.named_modules() if m is model and n), None)
        if raw is not None:
            _modules.name_after(module, raw, outer)
        return True

    def _watch_once(self, root: Root) -> None:
        """Layers and parameters another model holds too are watched once. TorchRL's loss modules
        hold the policy's own Parameters (in a TensorDictParams) and run its modules through
        sequences of their own (PPO's ``get_dist``), and the collector runs the policy first: counted
        twice, they made the gradient norm sqrt(2)x the true one. A layer keeps the name it got
        first; so does a parameter, unless only a holder that cannot run had it (the loss found
        before the critic it runs): then it takes the name of the model whose layer runs it."""
        layers = {id(m) for r in self._roots for la in r.layers if (m := la.ref()) is not None}
        root.layers = [la for la in root.layers if id(la.ref()) not in layers]
        params = {id(t): (r, p) for r in self._roots for p in r.params if (t := p.ref()) is not None}
        keep = []
        for p in root.params:
            earlier = params.get(id(p.ref()))
            if earlier is None:
                keep.append(p)
            elif earlier[1].held and not p.held:
                earlier[0].params.remove(earlier[1])
                keep.append(p)
        root.params = keep

    def _listen(self, module: nn.Module, fn: Callable) -> None:
        # What the compiled code's taps of this module call (see _compile_monitor).
        tok = _compile_monitor.token(module)
        _compile_monitor.listen(tok, fn)
        self._compiled_taps.append((tok, fn, id(module)))

    def _detach_root(self, root: Root) -> None:
        mods = {id(m) for m in (root.ref(), *(la.ref() for la in root.layers)) if m is not None}
        for tap in [t for t in self._compiled_taps if t[2] in mods]:
            _compile_monitor.unlisten(tap[0], tap[1])
            self._compiled_taps.remove(tap)
        if root.handle is not None:
            root.handle.remove()
        if root.load_handle is not None:
            root.load_handle.remove()
            root.load_handle = None
        if root.kwargs_handle is not None:
            root.kwargs_handle.remove()
            root.kwargs_handle = None
        for h in root.entry_handles:
            h.remove()
        root.entry_handles = []
        for la in root.layers:
            if la.handle is not None:
                la.handle.remove()
                la.handle = None
        self._roots.remove(root)
        self._params = [p for r in self._roots for p in r.params]

    def _detach_all(self) -> None:
        for r in list(self._roots):
            self._detach_root(r)
        self._grads.unhook_params()
        self._set_discovery(False)

    def _discover(self, module: nn.Module, args) -> None:
        # A global forward pre-hook (model=None): the outermost module with parameters is a root.
        if (torch.compiler.is_compiling() or module in self._known or module in self._no_params
                or _tracing_state() is not None):
            return
        if (inner := unwrapped(module)) is not module and inner in self._known:
            # A new wrapper around a watched model: torchdiffeq's odeint wraps the dynamics anew at
            # each call, not a model trained after the one it holds.
            return
        x = next((x for x in map(first_tensor, args) if x is not None), None)
        if x is not None and x.is_meta or x is None and _symbolic(args):
            return  # a shape pass (Keras builds its layers that way): not a model being trained
        if any(True for _ in nn.Module.parameters(module)) and all(p.is_meta for p in nn.Module.parameters(module)):
            return  # shapes without values (a copy built to count flops, or not yet materialised): not trained
        if not any(True for _ in nn.Module.parameters(module)) or isinstance(module, _ParametrizationList):
            # A ParametrizationList runs when a parametrized tensor is read (``layer.weight``, and once
            # at registration): part of the layer that owns it, never a model of its own.
            self._no_params.add(module)
            return
        if _in_functorch():
            # functional_call under vmap / grad: the module holds the transform's wrapped tensors
            # for this call only; the trained ones are the caller's plain tensors
            self._torch_func_model = self._torch_func_model or type(module).__name__
            return
        if (self._roots and all(isinstance(c, (nn.ParameterDict, nn.ParameterList)) for c in module.children())
                and {id(p) for p in nn.Module.parameters(module)} <= {id(t) for p in self._params if (t := p.ref()) is not None}):
            # No layers, and every parameter it holds is a found model's: a layer of that model that
            # torch does not list as a child (Keras keeps a layer's weights in the model's
            # ParameterDict too), not a model. (A critic whose weights a TorchRL loss holds has
            # layers of its own: a root, so that they are watched.)
            self._known.add(module)
            return
        original = self._copied_from(module)
        if original is not None:
            # A shallow copy of a model (learn2learn's MAML.clone(): its __dict__ copied, so the hook
            # dicts are the model's own, its parameters clone()s of the model's, then adapted): the
            # model's layer hooks already run on the copy's layers, under the model's names. The
            # model is watched (found through the copy when only copies run), never a copy: one per
            # task and step was a new model, maml2 ... maml124 in 40 steps.
            for m in module.modules():
                self._known.add(m)
            if original is not module and original not in self._known:
                self._attach(original, *self._naming(original))
            return
        if probing_owner(module) is not None:
            # A probe of a model being built (its strides, the size of its classifier), not a model
            # being trained; not known either: the model is found when it is called once built.
            return
        # Every model found before is gone, after training: this one follows it (a sweep's next
        # trial, cross-validation's next fold), with names of its own and a trend of its own.
        earlier = [r for r in self._roots if r.trained]
        successor = bool(earlier) and all(r.ref() is None for r in self._roots)
        root = self._attach(module, *self._naming(module))
        if not root.prefix:
            root.variable = caller_variable(module) or None  # DINO's `teacher`, called before the student
        if successor:
            starts = self._meta.get("models_in_sequence") or [{"prefix": earlier[0].prefix,
                                                               "first_step": earlier[0].first_step}]
            self._write_meta(models_in_sequence=[*starts, {"prefix": root.prefix, "first_step": root.first_step}])
        # This call's pre-hooks were collected before the root hook existed: run it now.
        self._root_pre(root, module, args)
        if root.entry_handles:
            root.depth += 1  # left by this call's forward hook (read after the forward)

    def _copied_from(self, module: nn.Module) -> nn.Module | None:
        """The module that ``module``, or its outermost part that is one, is a shallow copy of: a
        module whose forward hooks are the copy's own dict (its ``__dict__`` copied). A watched one
        first; else, only for a copy whose parameters are no leaves (cloned from the original's, as
        learn2learn's clone_module does; its ``MAML.clone()`` wraps the copy in a new ``MAML``), the
        live module holding the leaves they came from. None for a module of its own."""
        subs = list(module.modules())
        mine = {id(d): s for s in subs if (d := s.__dict__.get("_forward_hooks")) is not None}
        ids = {id(s) for s in subs}
        for r in self._roots:
            rm = r.ref()
            for m in rm.modules() if rm is not None else ():
                if id(m._forward_hooks) in mine and id(m) not in ids:
                    return m
        if not _adapted_copy(module):
            return None  # leaves of its own: a model (a copy.copy sharing the parameters is that model)
        leaf = _leaf_of(next(nn.Module.parameters(module)))
        if leaf is None:
            return None
        others = {id(d): m for m in _live_modules() if id(m) not in ids
                  and (d := m.__dict__.get("_forward_hooks")) is not None}
        for s in subs:  # outermost first
            original = others.get(id(s.__dict__.get("_forward_hooks")))
            if original is not None:
                return original if any(p is leaf for p in nn.Module.parameters(original)) else None
        return None

    def _naming(self, module: nn.Module) -> tuple[str, str | None]:
        """The prefix of a model found at run time, and the name of the model itself: its path in
        the containers that hold it (``actor.``), else none for the first model; for the next ones the
        attribute an object holds it under (``ref_model.``), or beside a live model the variable of
        the frame that calls it (``target_network.``), else its type's name (``sequential.``,
        ``sequential2.``)."""
        taken = {r.prefix for r in self._roots}
        path = container_path(module)
        if path and path + "." not in taken:
            return path + ".", path
        outside = [r for r in self._roots if r.ref() is not None and all(r.ref() is not m for m in module.modules())]
        if not outside and "" not in {r.prefix for r in self._roots if r.ref() is None}:
            return "", None  # the first model, or one that wraps it (the model it replaces goes)
        attr = owner_attribute(module)  # trl's DPOTrainer.ref_model: "ref_model.", not its type's name
        if attr and attr + "." not in taken:
            return attr + ".", attr
        # beside a live model, the script's own variable (cleanrl dqn.py's target_network, a QNetwork as
        # its q_network is): its type's name would read as the other one
        var = caller_variable(module) if outside else ""
        if var and var + "." not in taken:
            return var + ".", var
        base = type(unwrapped(module)).__name__.lower()  # the model's type, not DDP's or compile's
        prefix, k = base + ".", 1
        while prefix in taken:
            k += 1
            prefix = f"{base}{k}."
        return prefix, None

    def _adopt_from_loss(self, loss: torch.Tensor) -> None:
        # A module class whose own __call__ runs self.forward(...) never reaches nn.Module.__call__,
        # so no hook of any kind runs for it (gpytorch's Module: every GP model, kernel, likelihood
        # and mll): discovery never sees it. Its loss still reaches its parameters; the outermost
        # such modules holding them become roots. Once per monitor, on the first backward: with a
        # model found already (deep kernel learning: the GP runs an nn.Sequential feature
        # extractor, which discovery saw) only when the loss trains tensors that model lacks (the
        # GP's raw_lengthscale and the likelihood's raw_noise); the scan of live objects runs then,
        # and a script without modules is left as it was.
        # A plain module run through its methods is never seen either (normflows' flow.inverse(z)
        # and q0.log_prob(z), vae.encode(x), model.loss(x)): once a model was found (the layers
        # those methods call as module(x)), the outermost module of any class holding the tensors
        # it lacks becomes the root, and the roots inside it keep their names (container_path
        # named them after it). With no model found, only a module that overrides __call__ is
        # taken: a script that calls .forward(x) itself is told so (no_model_called).
        self._adopt_tried = True
        try:
            leaves = _leaf_ids(loss)
            if self._roots:
                leaves -= {id(t) for p in self._params if (t := p.ref()) is not None}
            if not leaves:
                return
            modules = _live_modules()
            found = [m for m in modules
                     if (self._roots or type(m).__call__ is not nn.Module.__call__) and m not in self._known
                     and any(id(p) in leaves for p in nn.Module.parameters(m))]
            if not self._roots and not found and not any(id(p) in leaves for m in modules for p in nn.Module.parameters(m)):
                # no module holds what the loss trains: pyro.param sites, tensors made with requires_grad
                self._params_outside = len(leaves)
            inner = {id(c) for m in found for c in m.modules() if c is not m}
            for m in [m for m in found if id(m) not in inner]:
                self._attach(m, *self._naming(m))
        except Exception:  # observing training never kills training
            log.exception("trainguard monitor: looking for the loss's model failed")

    def _set_discovery(self, on: bool) -> None:
        # The process's one global pre-hook, under the same id for every monitor: Dynamo guards on it.
        if on and self._discover_handle is None:
            self._discover_handle = self._discover
            forward_pre_hook.add(self._discover)
        elif not on and self._discover_handle is not None:
            forward_pre_hook.discard(self._discover_handle)
            self._discover_handle = None

    # ------------------------------------------------------------------ root hook
    def _root_pre(self, root: Root, module, args, grad: bool | None = None) -> None:
        # ``grad``: whether grad mode was on where a compiled model's hook was traced (see _trace_tap).
        if module is None or root.ref() is not module and not _adapted_copy(module):
            return  # a shallow copy shares the hook dict; one with adapted parameters runs the model (MAML)
        with _monitor_tap.quiet():
            try:
                self._root_pre_quiet(root, module, args, grad)
            except Exception:  # observing training never kills training
                log.exception("trainguard monitor: root hook failed")

    def _root_kwargs(self, root: Root, module, args, kwargs) -> None:
        """A forward's keyword tensors (``model(input_ids=..., labels=...)``): their padding, as
        :meth:`_root_pre_quiet` reads the positional ones."""
        watch = getattr(self, "_loss_watch", None)
        if (watch is None or not kwargs or not watch.wants_inputs or module is None or root.ref() is not module
                or not module.training or not torch.is_grad_enabled()):
            return  # past the watch's first losses: no dict built per forward
        with _monitor_tap.quiet():
            watch.see_inputs({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})

    def _root_pre_quiet(self, root: Root, module, args, grad: bool | None = None) -> None:
        grad_on = torch.is_grad_enabled() if grad is None else grad
        self._root_grad = grad_on
        # No-grad forwards in train mode before the step's first backward may cache features for it
        # (see EventsMixin._finish_step)
        cache = not grad_on and module.training and self._backward_step != self._cur
        if grad_on:
            self._fwd_grad += 1
        elif cache:
            self._fwd_cached += 1
        if grad_on:
            # A training forward after a checked non-finite loss and no backward(): the loop skipped
            # that iteration (capture/_skips; it may end the step, before this forward's own work).
            _skips.watch.forward(module.training)
            self._maybe_end_manual_step()  # a training forward starts the next step
            root.trained = self._trained_any = True
            watch = getattr(self, "_loss_watch", None)
            if watch is not None:
                watch.see_inputs(args)
        if self._eval is not None:
            # A no-grad forward evaluates only a model that is being trained: a target, teacher
            # or EMA network run under no_grad is part of the training step. Before the first
            # training forward there is no training step yet: a no-grad forward then evaluates
            # the initial model (nanoGPT and llm.c measure the loss at iteration 0).
            if root.trained or not self._trained_any:
                self._eval.on_forward(grad_on, module.training)
                inputs = [x for x in map(first_tensor, args) if x is not None]
                x = inputs[0] if inputs else None
                if grad_on and isinstance(x, torch.Tensor) and x.grad_fn is not None:
                    # fed another model's output (PyG's link_pred: encode runs conv1, then conv2)
                    self._leak.forget(id(root))
                self._leak.on_forward(x, not grad_on, self._cur, id(root), inputs[1:])
        if root.mode_modules:
            mods = [m() for m in root.mode_modules]
            n_train = sum(1 for m in mods if m is not None and m.training)
            if grad_on:
                # A whole model put in eval mode, not single layers frozen on purpose (frozen BN).
                self._last_train_fwd = (n_train, len(mods), module.training)
            else:
                self.modes["eval_forwards"] += 1
                self._cached_modes[0] += cache
                if n_train:
                    self._cached_modes[1] += cache
                    self.modes["eval_forwards_in_train"] += 1
                    if self.modes["first_eval_forward_in_train"] is None:
                        self.modes["first_eval_forward_in_train"] = self._cur
        if self._recording and grad_on:
            self._time.on_root_forward()
            name = root.prefix + "<input>"
            if name not in self._inputs_seen:
                x = None
                for v in args:
                    x = first_tensor(v)
                    if x is not None:
                        break
                if x is None:
                    # Called with keywords only (pre-hooks see no kwargs without keeping their id in
                    # the module): the first layer that runs takes its input as the model's.
                    self._input_wanted[root.prefix] = name
                else:
                    self._take_input(name, x)

    def _take_input(self, name: str, x: torch.Tensor) -> None:
        self._inputs_seen.add(name)
        if x.is_floating_point():
            out = input_stats(x)
            if out is not None:
                self._out.stats.append((("l", name, "input", tuple(out[1]), self._cur), out[0]))

    # ------------------------------------------------------------------ layer hooks
    def _hook_layer(self, layer: Layer) -> None:
        m = layer.ref()
        if m is None or layer.handle is not None:
            return
        layer.handle = m.register_forward_hook(ModuleHook(self._on_layer, layer, _compile_monitor.token(m)))

    def _set_layer_hooks(self, on: bool) -> None:
        if on == self._layer_hooks_on:
            return
        self._layer_hooks_on = on
        for r in self._roots:
            for la in r.layers:
                if on:
                    self._hook_layer(la)
                elif la.handle is not None:
                    la.handle.remove()
                    la.handle = None

    def _add_stand_ins(self) -> None:
        """After a root's first recorded training step, watch the modules that run in place of
        layers that never did (see ``stand_ins``); not once Dynamo compiled, whose graphs were traced
        with the hooks there were (a hook added later would recompile them)."""
        for root in self._roots:
            if root.stand_ins_done or not root.trained:
                continue
            root.stand_ins_done = True
            new = [] if self._compiled else stand_ins(root)
            for i, la in reversed(new):
                root.layers.insert(i, la)
                if self._layer_hooks_on:
                    self._hook_layer(la)
            if new:
                self._write_meta(**structure(self._roots, self._grads.trainable, self._grads.updaters))

    def _wants_hist(self, name: str) -> bool:
        h = self.histograms
        return bool(h) and (h is True or name in h)

    def compiling(self, on: bool) -> None:
        """Dynamo starts (True) or ends a compilation. The layer hooks must be there to be traced,
        and stay from then on: Dynamo guards on the number of hooks, so toggling them per step
        (as in eager code) would recompile at every step."""
        if on:
            self._hooks_pinned = self._compiled = True
            self._set_layer_hooks(True)
            self._set_discovery(self._auto)

    def _on_layer(self, layer: Layer, module, args, output, grad: bool | None = None) -> None:
        if not self._recording:
            return
        if not (torch.is_grad_enabled() if grad is None else grad):
            if self._root_grad and layer.name not in self.no_grad_layers:
                # Gradients off inside a training forward: what stops them reaching this layer.
                self.no_grad_layers[layer.name] = "checkpoint" if _inside_checkpoint() else "no_grad"
            return
        with _monitor_tap.quiet():
            # Every call of a layer called in a loop is followed (gradients through time); its
            # statistics come from one call (see TimeWatch.on_call).
            if not self._time.on_call(layer.name, output, layer.weighted) or layer.seen_step == self._cur:
                return
            if self._input_wanted:
                name = self._input_wanted.pop(layer.prefix, None)
                x = first_tensor(args) if name else None
                if x is not None:
                    self._take_input(name, x)
            self._layer_stats(layer, args, output)

    def _place(self, name: str) -> None:
        """Put a layer seen for the first time into the forward order. Layers of the first recording
        step follow one another as they ran; one first seen in a later step (an expert of a mixture
        that no token was routed to before, a branch taken late) goes after the layer registered just
        before it, not after the layers that ran after it (the head): "first" and "last" layer mean
        depth to the rules."""
        if self._order_step is None:
            self._order_step = self._cur
        if self._cur == self._order_step:
            self._order.append(name)
            return
        rank = {n: i for i, n in enumerate(la.name for r in self._roots for la in r.layers)}
        mine = rank.get(name)
        if mine is None:
            self._order.append(name)
            return
        before = [(rank[n], i) for i, n in enumerate(self._order) if rank.get(n, mine) < mine]
        self._order.insert(max(before)[1] + 1 if before else 0, name)

    def _layer_stats(self, layer: Layer, args, output) -> None:
        try:
            x = layer_output(output)
            if x is None or not x.is_floating_point() or x.numel() == 0:
                return
            layer.seen_step = self._cur
            if layer.name not in self._order:
                self._place(layer.name)
            if layer.channel_first:
                unit_dim = 1
                self._chan_out[id(x)] = tuple(x.shape)
            else:
                inp = first_tensor(args)
                inherit = inp is not None and self._chan_out.get(id(inp)) == tuple(inp.shape)
                unit_dim = 1 if inherit and x.dim() >= 3 else -1
                if inherit:
                    self._chan_out[id(x)] = tuple(x.shape)
            if x.dim() >= 2:
                layer.units = int(x.shape[unit_dim])  # what it makes, whatever its weights' layout
            raw, names, dead, finish = activation_stats(x, unit_dim, layer.prev_dead, layer.saturation)
            if self._wants_hist(layer.name):
                self._out.stats.append((("h", layer.name, "activation", self._cur), histogram(x, self.bins)))
            layer.prev_dead = dead
            desc = ("l", layer.name, "activation", tuple(names), self._cur, finish, raw.numel())
            self._out.stats.append((desc, raw))
            self._codes(layer, x, unit_dim, first_tensor(args))
        except Exception:
            log.exception("trainguard monitor: layer hook failed on %s", layer.name)


    def _codes(self, layer: Layer, x: torch.Tensor, unit_dim: int, inp: torch.Tensor | None) -> None:
        """Hash up to ``CODE_ROWS`` rows of the output and of its input (``row_hashes``); counted
        for all layers at once at the step's end (``_ship_codes``): a layer that maps inputs that
        differ onto one or two outputs (a collapsed codebook) shows there."""
        out = row_hashes(x, unit_dim)
        if out is None:
            return
        self._codes_out[id(x)] = (tuple(x.shape), out)
        got = None
        if inp is not None and inp.is_floating_point():
            seen = self._codes_out.get(id(inp))  # mostly the layer before's output, hashed already
            got = seen[1] if seen is not None and seen[0] == tuple(inp.shape) else row_hashes(
                inp, unit_dim if inp.dim() == x.dim() else -1)
        self._code_rows.append((layer.name, out, got))

    def _ship_codes(self, step: int) -> None:
        rows, self._code_rows, self._codes_out = self._code_rows, [], {}
        by_dev: dict[torch.device, list] = {}
        for r in rows:
            by_dev.setdefault(r[1].device, []).append(r)
        names = ("codes", "code_rows", "code_sample", "in_codes", "in_code_rows", "in_code_sample")
        for group in by_dev.values():
            hashes = [r[1] for r in group] + [r[2] for r in group if r[2] is not None]
            counted = count_codes(hashes)
            k, at, slots = len(group), len(group), []
            for r in group:
                slots.append(at if r[2] is not None else None)
                at += r[2] is not None
            nan = torch.full((1, 2), math.nan, device=counted.device)
            matrix = torch.cat([torch.cat([counted[i:i + 1], counted[j:j + 1] if j is not None else nan], 1)
                                for i, j in zip(range(k), slots)])
            for r, row in zip(group, matrix):
                def finish(v: list[float], n: int = r[1].shape[0], n_in: float = (
                        r[2].shape[0] if r[2] is not None else math.nan)) -> list[float]:
                    return [v[0], v[1], float(n), v[2], v[3], float(n_in)]

                self._out.stats.append((("l", r[0], "activation", names, step, finish, 4), row))

# Called between compiled graphs (after a graph break), Dynamo would compile these frames themselves.
keep_dynamo_out(ModuleHook.__call__, HookMixin._discover, HookMixin._root_pre, HookMixin._on_layer)
