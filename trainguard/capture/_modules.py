"""Which ``nn.Module`` is running: global forward hooks keep a stack of interned module ids.

Paths are relative to the outermost module that was called (``encoder.layers.2.attn``); the
outermost module itself has the path "" and is shown by its type, unless it sits in a container
with no ``forward`` that the program calls into (cleanrl's ``Agent``: ``actor``, ``actor.0``). Modules, parameters and
buffers are held through weak references only.
"""

from __future__ import annotations

import gc
import sys
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from trainguard.resilience._wrappers import unwrapped, wrapped

from ._identity import IdentityWeakKeyDict

_is_compiling = torch.compiler.is_compiling


def _is_wrapper(module: nn.Module) -> bool:
    return wrapped(module) is not None


def _is_compiled(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and _is_wrapper(module)


def _type_name(module: nn.Module) -> str:
    return type(unwrapped(module)).__name__


def container_path(module: nn.Module) -> str:
    """Where ``module`` sits inside the modules that hold it and whose children the program calls
    directly: containers with no ``forward`` (cleanrl's ``Agent`` holding ``actor`` and
    ``critic``, an ``nn.ModuleList`` of an ensemble) and holders with a forward the loop does not
    call (SB3's ``SACPolicy``: SAC calls ``policy.critic`` and ``policy.actor``'s members).
    ``"actor"``, ``"heads.0"``, ``"actor.latent_pi"``: the names of the outermost holder's
    ``state_dict``; ``""`` where nothing holds it, or more than one module does. One scan of the
    live objects (a root is found once); a holder called later becomes the root and keeps these
    names."""
    if not _maybe_held(module):
        return ""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    # type(o), not isinstance: isinstance reads o.__class__, which a deprecation proxy warns on
    for m in (o for o in gc.get_objects() if issubclass(type(o), nn.Module)):
        for name, child in m._modules.items():
            if child is not None and child is not m:
                owners.setdefault(id(child), []).append((m, name))
    path: list[str] = []
    seen = {id(module)}
    while len(held := owners.get(id(module), ())) == 1:
        parent, name = held[0]
        if id(parent) in seen:
            break
        seen.add(id(parent))
        path.append(name)
        module = parent
    return ".".join(reversed(path))


def owner_attribute(module: nn.Module) -> str:
    """The attribute under which an object that is not a module holds ``module``: trl's
    DPOTrainer keeps the frozen reference beside the policy as ``self.ref_model``, a DQN agent its
    target network as ``self.target_net``. ``""`` where no such object holds it, or objects hold it
    under several names (``model`` and ``model_wrapped``). Walks only the dicts that hold it."""
    names: set[str] = set()
    for held in gc.get_referrers(module):
        if type(held) is dict:
            # an instance's materialised __dict__ (a module's globals, or any other dict, is no owner)
            owners = [] if "__builtins__" in held else [o for o in gc.get_referrers(held)
                                                       if getattr(o, "__dict__", None) is held]
        else:
            owners = [held]  # an instance that keeps its attributes inline (Python 3.11+) refers to them itself
        for o in owners:
            if isinstance(o, (nn.Module, dict, type)) or not isinstance(d := getattr(o, "__dict__", None), dict):
                continue
            names.update(k for k, v in d.items() if v is module and isinstance(k, str) and k.isidentifier())
    return names.pop() if len(names) == 1 else ""


def caller_variable(module: nn.Module) -> str:
    """The name under which the program's innermost frame on the stack (outside torch and
    trainguard) holds ``module``: cleanrl's dqn.py calls ``target_network(...)``, a global of the
    script beside ``q_network`` of the same type. ``""`` where that frame holds it under no name or
    several. Read once, when a model is found."""
    from trainguard.capture._stacks import _TG_DIR, _TORCH_DIR

    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith((_TORCH_DIR, _TG_DIR)):
        f = f.f_back
    if f is None:
        return ""
    names = {k for k, v in f.f_locals.items() if v is module and isinstance(k, str) and k.isidentifier()}
    names.discard("self")
    return names.pop() if len(names) == 1 else ""


def _maybe_held(module: nn.Module) -> bool:
    """Whether a dict other than a module's globals holds ``module``: a module's children live in
    its ``_modules`` dict. One walk of the live objects in C (``gc.get_referrers``) instead of a
    Python loop over all of them; a model held by locals or a script's globals needs no more."""
    return any(isinstance(r, dict) and "__builtins__" not in r and any(v is module for v in r.values())
               for r in gc.get_referrers(module))


def probing_owner(module: nn.Module) -> nn.Module | None:
    """The module whose ``__init__`` is running and holds ``module`` (or is it), outermost first:
    ``module`` runs in a probe of the model being built, not as a model of its own. ultralytics'
    DetectionModel works out its strides with ``self.forward(torch.zeros(...))`` in its
    ``__init__``, which calls each layer with no module call around it; a CNN that sizes its
    classifier with a dummy forward does the same. Only frames of ``__init__`` methods are read,
    and only for a module called with no module around it that is not named yet."""
    owner = None
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_name == "__init__" and code.co_argcount and code.co_varnames[0] == "self":
            m = f.f_locals.get("self")
            if isinstance(m, nn.Module) and (m is module or any(c is module for c in m.modules())):
                owner = m
        f = f.f_back
    return owner


def path_in(owner: nn.Module, module: nn.Module) -> str:
    """``module``'s name in ``owner`` (``""`` for ``owner`` itself)."""
    return next((name for name, m in owner.named_modules(remove_duplicate=False) if m is module), "")


# Scans of the live objects for containers per tracker: a program that builds a new model at
# every step pays for a few only.
_CONTAINER_SCANS = 16


# ---------------------------------------------------------------------- the global hooks
class GlobalHook:
    """One global module forward pre-hook (or forward hook, always called) for the whole process,
    under the same id in torch's global hook dict each time it is there, calling its users' hooks.

    Dynamo inlines a submodule's ``_call_impl``, which reads the global hook dicts, so a compiled
    frame's guards name the hooks' ids and functions. Hooks registered anew by each recording
    (and each ``Monitor(None)``) failed them: the model recompiled once per recording and after
    8, torch's ``recompile_limit``, ran eagerly (a frame compiled without hooks matches anyway,
    which hid it for a model also run outside recordings). The hook is in the dict only while
    it has a user, so that frames compiled outside recordings keep their entries.
    """

    def __init__(self, post: bool):
        self.post = post
        self.users: tuple[Callable, ...] = ()
        self._handle = None
        self._lock = threading.Lock()
        owner = self
        if post:
            def hook(module: nn.Module, args, output) -> None:
                if _is_compiling():
                    return
                for fn in owner.users:
                    fn(module, args, output)
        else:
            def hook(module: nn.Module, args) -> None:  # type: ignore[misc]
                if _is_compiling():
                    return
                for fn in owner.users:
                    fn(module, args)
        self.hook = hook

    def add(self, fn: Callable) -> None:
        from torch.nn.modules import module as mod

        with self._lock:
            if fn in self.users:  # bound methods compare equal by their object and function
                return
            self.users = (*self.users, fn)
            if len(self.users) > 1:
                return
            _hide_hook_warning()
            if self._handle is None:
                self._handle = (mod.register_module_forward_hook(self.hook, always_call=True) if self.post
                                else mod.register_module_forward_pre_hook(self.hook))
            elif self.post:  # what registering does, under the first id
                mod._global_forward_hooks[self._handle.id] = self.hook
                mod._global_forward_hooks_always_called[self._handle.id] = True
            else:
                mod._global_forward_pre_hooks[self._handle.id] = self.hook

    def discard(self, fn: Callable) -> None:
        with self._lock:
            if fn not in self.users:
                return
            self.users = tuple(f for f in self.users if f != fn)
            if not self.users:
                self._handle.remove()


_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def _hide_hook_warning() -> None:
    """torch warns at each call of a ``torch.compile(module)`` while global hooks exist that they
    fire an extra time for the ``OptimizedModule``: these are trainguard's, which account for that.
    The filter goes in once (a user's ``catch_warnings`` may take it out): changing the filters
    makes Python forget which warnings it has shown, and each "once per line" warning of the
    program would come back after every recording."""
    if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == _HOOK_WARNING for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_HOOK_WARNING)


# The recorders' module trackers and the monitors' discovery share these.
forward_pre_hook = GlobalHook(post=False)
forward_hook = GlobalHook(post=True)


# Modules named after a model they hold (``Monitor.name_after``: sentence-transformers' loss
# module, which holds the trained model and the Trainer calls): holder -> (the model's path in
# it, the prefix of the holder's other modules). The recorders' trackers name the same way.
_named_after: IdentityWeakKeyDict[nn.Module, tuple[str, str]] = IdentityWeakKeyDict()
_trackers: weakref.WeakSet = weakref.WeakSet()


def renamed(raw: str, rule: tuple[str, str]) -> str:
    """A module's path in a holder named after the model it holds: the model's own ``state_dict``
    names (the model itself is the root, ``""``), the holder's other modules under ``outer``
    (``loss.classifier``), the holder itself ``outer`` without its dot (``loss``)."""
    model_path, outer = rule
    if raw == "":
        return outer.rstrip(".")
    if raw == model_path:
        return ""
    if raw.startswith(model_path + "."):
        return raw[len(model_path) + 1:]
    return outer + raw


def name_after(holder: nn.Module, model_path: str, outer: str) -> None:
    """Name ``holder``'s modules after the model at ``model_path`` in it (see :func:`renamed`),
    in every recording now and later; modules named already take the new names from now on."""
    _named_after[holder] = (model_path, outer)
    for tracker in list(_trackers):
        tracker.rename(holder)


class ModuleTracker:
    """Maintains the innermost running module id per thread, and parameter names by tensor id."""

    def __init__(self, on_new_module: Callable[[int, str, str], None] | None = None):
        self._on_new = on_new_module
        # module -> (interned id, path in the outermost module, the naming rule of that module or None)
        self._ids: IdentityWeakKeyDict[nn.Module, tuple] = IdentityWeakKeyDict()
        # Named through owner() while no module held them: until a module call names them (_enter)
        self._provisional: IdentityWeakKeyDict[nn.Module, tuple] = IdentityWeakKeyDict()
        self._interned: dict[tuple[str, str], int] = {}
        self._container_scans = 0
        self._outer: list[weakref.ref] = []  # modules named at the top (no module around them)
        self._outer_thread: dict[int, int] = {}  # id(module) in _outer -> the thread that named it
        self._local = threading.local()
        # id(tensor) -> (weakref, name, kind); kind is "param" or "buffer".
        self.named_tensors: dict[int, tuple[weakref.ref, str, str]] = {}
        self.lock = threading.Lock()
        # The native recorder's hooks: the innermost module id of this thread (0 outside any),
        # and each parameter or buffer named (tensor, name, kind).
        self.on_change: Callable[[int], None] | None = None
        self.on_named: Callable[[torch.Tensor, str, str], None] | None = None
        # Called with the module at each outermost module call (no module running on this thread).
        self.on_outermost: Callable[[nn.Module], None] | None = None

    # -------------------------------------------------------------- hooks
    def install(self) -> None:
        forward_pre_hook.add(self._pre)
        forward_hook.add(self._post)
        _trackers.add(self)

    def remove(self) -> None:
        forward_pre_hook.discard(self._pre)
        forward_hook.discard(self._post)
        _trackers.discard(self)

    def _stack(self) -> list:
        try:
            return self._local.stack
        except AttributeError:
            s = self._local.stack = []
            return s

    # _pre and _post run twice per module call (cleanrl's PPO: about 1,700 calls of 4-64-wide
    # layers per iteration, each a few microseconds of work): they are called only through the
    # GlobalHooks above, which return at once under Dynamo (compiled graphs carry nn_module_stack
    # instead), and look the module up in the IdentityWeakKeyDict's own dict by id (its get() is
    # one Python call more per lookup).
    def _pre(self, module: nn.Module, args) -> None:
        try:
            stack = self._local.stack
        except AttributeError:
            stack = self._stack()
        entry = self._ids.data.get(id(module))
        if entry is None:
            if isinstance(module, torch.fx.GraphModule):
                # A compiled graph run as a module (the eager and aot_eager backends): its ops
                # belong to the module that called it.
                stack.append((stack[-1][0] if stack else None, module))
                return
            entry = self._name(module, stack[-1][1] if stack else None)
        if not stack and self.on_outermost is not None:
            self.on_outermost(module)
        stack.append((entry[0], module))
        on_change = self.on_change
        if on_change is not None:
            on_change(entry[0])

    def _post(self, module: nn.Module, args, output) -> None:
        try:
            stack = self._local.stack
        except AttributeError:
            stack = self._stack()
        # Pop back to this module: a forward that raised may have left children on the stack.
        while stack:
            if stack.pop()[1] is module:
                break
        on_change = self.on_change
        if on_change is not None:
            # A compiled graph's entry carries its caller's id, None outside any module.
            on_change((stack[-1][0] if stack else None) or 0)

    def current(self) -> int | None:
        """Interned id of the innermost module running on this thread (None outside modules)."""
        s = getattr(self._local, "stack", None)
        return s[-1][0] if s else None

    def owner(self, module: nn.Module) -> int:
        """Interned id of ``module``, whose method runs ops with no module call around them
        (normflows' ``flow.inverse(z)``, ``vae.encode(x)``): named as a module called there would
        be, by its path in a module named before that holds it (the flow, whose
        ``forward_kld`` ran first) or else in the containers that hold it."""
        entry = self._ids.data.get(id(module)) or self._provisional.data.get(id(module))
        if entry is not None:
            return entry[0]
        path = None
        for ref in self._outer:
            holder = ref()
            if holder is None or holder is module:
                continue
            sub = next((n for n, m in holder.named_modules(remove_duplicate=False) if m is module and n), None)
            if sub is not None:
                hp = self._ids.data.get(id(holder))
                if hp is not None:
                    path, rule = (f"{hp[1]}.{sub}" if hp[1] else sub), hp[2]
                    break
        if path is None:
            # Held by no module named yet: named at the top level for now. A module that calls it
            # later names it again, by its path there (open_clip's CLIP re-initialised by its
            # init_parameters() before CLIPTask runs it as trainable_module).
            entry = self._name(module, None)
            with self.lock:
                self._ids.pop(module, None)
                self._provisional[module] = entry
            return entry[0]
        return self._enter(module, path, rule)[0]

    def _enter(self, module: nn.Module, path: str, rule, type_name: str | None = None) -> tuple:
        """Name ``module`` at ``path`` (in its outermost module, whose naming ``rule`` applies)."""
        shown = renamed(path, rule) if rule is not None else path
        entry = (self.intern(shown, type_name or _type_name(module)), path, rule)
        with self.lock:
            self._ids[module] = entry
            was = self._provisional.pop(module, None)
        if was is not None and was[0] != entry[0]:  # its own tensors take the new names too
            for t in (*nn.Module.parameters(module, recurse=False), *nn.Module.buffers(module, recurse=False)):
                self.named_tensors.pop(id(t), None)
        self._name_tensors(module, shown)
        return entry

    def rename(self, holder: nn.Module) -> None:
        """``holder`` is named after a model it holds now (:func:`name_after`): it and the modules
        in it named already take their new names, also the ones running on this thread (a monitor
        names the holder in its first call's pre-hook). Tensors named already keep their names."""
        rule = _named_after.get(holder)
        if rule is None or holder not in self._ids:
            return
        new = {}
        for name, m in holder.named_modules(remove_duplicate=False):
            old = self._ids.data.get(id(m))
            if old is not None and id(m) not in new:
                shown = renamed(name, rule)
                entry = (self.intern(shown, _type_name(m)), name, rule)
                with self.lock:
                    self._ids[m] = entry
                new[id(m)] = entry[0]
        stack = getattr(self._local, "stack", None)
        if stack:
            stack[:] = [(new.get(id(m), mid), m) for mid, m in stack]
            if self.on_change is not None:
                self.on_change(stack[-1][0] or 0)

    # -------------------------------------------------------------- naming
    def _name(self, module: nn.Module, parent: nn.Module | None) -> tuple:
        path = ""
        rule = None
        if parent is not None and parent not in self._ids:
            parent = None  # called from inside a compiled graph run as a module
        if parent is None and (rule := _named_after.get(module)) is not None:
            pass  # a holder named after the model it holds: its own paths, renamed
        elif parent is None and (owner := probing_owner(module)) is not None:
            # run by a model being built (a probe in its __init__): named by its path there, as
            # that model's state_dict names it, without a scan
            path = path_in(owner, module)
        elif parent is None and self._container_scans < _CONTAINER_SCANS and any(True for _ in nn.Module.parameters(module)):
            # a model called at the top level may sit in a container the program calls into
            # (cleanrl's Agent.actor): named by its path there, as the monitor names it
            self._container_scans += 1
            path = container_path(module)
        if parent is None and not path and rule is None and self._beside_a_model(module):
            # a second model at the top (cleanrl dqn.py's target_network beside its q_network, both
            # QNetwork): the calling line's variable, as the monitor names it, or both were "network.0"
            path = caller_variable(module)
        if parent is not None:
            parent_path, rule = self._ids[parent][1], self._ids[parent][2]
            child = None
            for name, sub in parent.named_modules(remove_duplicate=False):
                if sub is module and name:
                    child = name
                    break
            if child is None and _is_wrapper(module):
                # A wrapper the parent does not hold, around a module it does: odenet_mnist's
                # ODEBlock calls odeint(self.odefunc, ...), which wraps odefunc anew at each call.
                inner = unwrapped(module)
                child = next((name for name, sub in parent.named_modules(remove_duplicate=False)
                              if sub is inner and name), None)
            if child is not None and _is_wrapper(parent):
                # A wrapper is not a level of the model: its _orig_mod (_forward_module) is
                # the model itself (the same path), _orig_mod.x is x.
                child = child.split(".", 1)[1] if "." in child else None
                if child is None:
                    return self._enter(module, parent_path, rule, _type_name(module))
            if child is None:
                # Called from inside a parent that does not own it: name it by its type.
                path = f"{parent_path}.<{type(module).__name__}>" if parent_path else f"<{type(module).__name__}>"
            else:
                path = f"{parent_path}.{child}" if parent_path else child
        if parent is None:  # a model at the top: the modules its methods run are named inside it
            if len(self._outer) > 64:
                self._outer = [r for r in self._outer if r() is not None]
                live = {id(m) for r in self._outer if (m := r()) is not None}
                self._outer_thread = {k: v for k, v in self._outer_thread.items() if k in live}
            self._outer.append(weakref.ref(module))
            self._outer_thread[id(module)] = threading.get_ident()
        return self._enter(module, path, rule)

    def _beside_a_model(self, module: nn.Module) -> bool:
        """Whether another live model with parameters, neither holding nor held by ``module``, was
        named at the top with no prefix on this thread (the hooks see every thread's modules; another
        thread's recording is no model of this one)."""
        if next(nn.Module.parameters(module), None) is None:
            return False
        me = threading.get_ident()
        for ref in self._outer:
            other = ref()
            if (other is None or other is module or self._outer_thread.get(id(other)) != me
                    or next(nn.Module.parameters(other), None) is None):
                continue
            entry = self._ids.data.get(id(other))
            if (entry is not None and entry[1] == "" and entry[2] is None
                    and all(m is not module for m in other.modules())
                    and all(m is not other for m in module.modules())):
                return True
        return False

    def intern(self, path: str, type_name: str) -> int:
        """The id of module ``path`` of type ``type_name`` (announced once to the writer)."""
        key = (path, type_name)
        mid = self._interned.get(key)
        if mid is None:
            mid = self._interned[key] = len(self._interned) + 1
            if self._on_new is not None:
                self._on_new(mid, path, type_name)
        return mid

    def _name_tensors(self, module: nn.Module, path: str) -> None:
        prefix = f"{path}." if path else ""
        # A compiled model's modules never run eagerly: name all its tensors through the wrapper.
        recurse = _is_compiled(module)
        if recurse:
            module = module._orig_mod
        for kind, items in (("param", module.named_parameters(recurse=recurse)),
                            ("buffer", module.named_buffers(recurse=recurse))):
            for name, t in items:
                if t is not None and id(t) not in self.named_tensors:
                    self.named_tensors[id(t)] = (weakref.ref(t), prefix + name, kind)
                    if self.on_named is not None:
                        self.on_named(t, prefix + name, kind)

    def release(self, t: torch.Tensor):
        """Drop the weak reference to a named tensor torch is about to swap; return how to take it
        back (a swapped parameter keeps its identity and its name). See capture/_swap."""
        entry = self.named_tensors.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        _, name, kind = self.named_tensors.pop(id(t))  # keep nothing that holds the old weak reference
        del entry

        def restore() -> None:
            self.named_tensors[id(t)] = (weakref.ref(t), name, kind)

        return restore

    def name_of(self, t: torch.Tensor) -> tuple[str, str] | None:
        """(name, kind) of a parameter or buffer of a module that has run, else None."""
        entry = self.named_tensors.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1], entry[2]
        return None

    def module_of_id(self) -> dict[int, tuple[str, str]]:
        return {mid: key for key, mid in self._interned.items()}


def _keep_dynamo_out() -> None:
    from trainguard.capture._compile import keep_dynamo_out

    keep_dynamo_out(ModuleTracker._pre, ModuleTracker._post, forward_pre_hook.hook, forward_hook.hook)


_keep_dynamo_out()
