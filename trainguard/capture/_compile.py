"""Recording inside ``torch.compile``: the backend, and how a recording switches it on.

``compile_backend(inner="inductor")`` is a ``torch.compile`` backend. For Inductor it is
Inductor's own ``compile_fx`` (its decompositions, partitioner and passes) with an inner
compiler that instruments each forward, backward and inference graph AOT autograd hands it
(``_compile_graph``) before Inductor compiles it; for any other inner compiler it is
``aot_autograd(fw_compiler=..., bw_compiler=...)`` around it. The compiled function returned
is a ``RecordedGraph`` (``_compile_run``).

While a recording is active, models compiled by the default backend are instrumented without
any change to the user's script: ``torch.compile``'s Inductor wrapper and ``compile_fx`` are
patched for the recording's duration. Graphs Inductor compiled before the recording started
cannot be seen inside; their calls are recorded as one execution each ("graph granularity").

Dynamo must never trace trainguard: the dispatch mode declares ``ignore_compile_internals``
(so compilation proceeds while it is active, with the mode off), module and optimizer hooks
only emit a side-effect op under ``torch.compiler.is_compiling()`` (``_compile_monitor``,
``_steps.step_tap``), and :func:`keep_dynamo_out` marks trainguard's entry points so that the
eval-frame callback skips them and everything they call at run time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainguard.capture import _compile_opaque, _compile_run
from trainguard.capture._compile_graph import GraphPlan, input_names, instrument
from trainguard.capture._compile_run import Pair, RecordedGraph
from trainguard.capture._compile_summary import SUMMARY_NODE

log = logging.getLogger("trainguard.capture")

_lock = threading.Lock()
_users: list = []  # active recorders, oldest first
_saved: dict[str, Any] = {}  # original torch attributes while patched


# ---------------------------------------------------------------------- keeping Dynamo out
def keep_dynamo_out(*functions: Callable) -> None:
    """Make Dynamo's frame callback skip these functions and every frame they call.

    Without it, a trainguard hook or the dispatch mode's ``__torch_dispatch__`` run between two
    compiled graphs (after a graph break) is itself compiled by Dynamo: extra graphs, recompiles
    per tensor id and, worst, the hook's ``is_compiling()`` branch baked into its code. The
    strategy lives on the code object and costs nothing per call.
    """
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    for fn in functions:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            set_code_exec_strategy(code, skip)


# ---------------------------------------------------------------------- the backend
def compile_backend(inner: str | Callable = "inductor", *, mode: str | None = None, **options: Any):
    """A ``torch.compile`` backend that records every aten op of the compiled graphs.

    ``torch.compile(model, backend=trainguard.compile_backend())`` compiles with Inductor and
    adds, inside the compiled code, the summaries of each op's outputs; while a recording
    (``trainguard.record``, ``check_numerics``) is active, each call of a graph writes one
    execution per op (forward and backward) with its module, source line, producers and summary.
    Without a recording the graphs run with their summaries computed and dropped.

    ``inner``: ``"inductor"`` (``options`` are Inductor config patches, as
    ``torch.compile(options=...)``), ``"aot_eager"``, or a compiler ``fn(gm, example_inputs)``
    used for the forward and backward graphs. ``mode`` fixes the summary mode; by default it is
    the active recording's (``full_health`` when none is active).
    """
    from trainguard.store import MODES

    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not (inner in ("inductor", "aot_eager") or callable(inner)):
        raise ValueError(f"inner must be 'inductor', 'aot_eager' or a compiler function, got {inner!r}")
    return _Backend(inner, mode, options)


class _Backend:
    def __init__(self, inner, mode, options):
        self.inner, self.mode, self.options = inner, mode, options

    def __repr__(self) -> str:
        return f"trainguard.compile_backend(inner={self.inner!r})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        pair = Pair(_compile_label(), input_names(gm))
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx_inner

            compile_fx = _saved.get("compile_fx") or _inductor_compile_fx()
            with _no_autograd_cache():
                return compile_fx(gm, example_inputs, inner_compile=_instrumenting(compile_fx_inner, pair, self.mode),
                                  config_patches=self.options or None)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        base = self.inner if callable(self.inner) else (lambda g, _: make_boxed_func(g.forward))

        def fw(g, ex):
            return _instrumented(base, g, ex, pair, self.mode, "forward")

        def bw(g, ex):
            return _instrumented(base, g, ex, pair, self.mode, "backward")

        def inference(g, ex):
            return _instrumented(base, g, ex, pair, self.mode, "inference")

        with _no_autograd_cache():
            return aot_autograd(fw_compiler=fw, bw_compiler=bw, inference_compiler=inference)(gm, example_inputs)


def _compile_label() -> str:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return str(cid) if cid is not None else "?"


def _inductor_compile_fx():
    from torch._inductor import compile_fx

    return compile_fx.compile_fx


@contextlib.contextmanager
def _no_autograd_cache():
    # A hit in AOT autograd's cache would return a graph compiled without (or with other)
    # summaries and skip the inner compiler. Inductor's own FX graph cache, keyed by the
    # instrumented graph, still saves recompiling it.
    from torch._functorch import config

    with config.patch(enable_autograd_cache=False):
        yield


def _summary_mode(forced: str | None) -> tuple[str, Any, Any]:
    r = _compile_run.active
    mode = forced or (r.mode if r is not None else "full_health")
    if r is not None and r.check and mode == "curt_health":
        mode = "full_health"  # check_numerics names NaN, +inf and -inf apart, and its inputs' zeros
    return mode, (r.ops_pattern if r is not None else None), (r.dtypes if r is not None else None)


# The plan of each graph module instrumented, beside it rather than on it: Inductor's FX graph
# cache hashes a graph module with its attributes, and a plan holds autograd sequence numbers,
# which count up in a process (every compile after the first would miss the cache).
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_of(gm) -> GraphPlan | None:
    """The plan a graph module was instrumented with, None if it was not."""
    return _plans.get(gm)


def _instrumented(base, gm, example_inputs, pair: Pair, forced: str | None, kind: str):
    if plan_of(gm) is not None:  # already instrumented by an outer wrapper
        return base(gm, example_inputs)
    with _compiling():
        mode, ops, dtypes = _summary_mode(forced)
        plan = instrument(gm, kind, mode, ops, dtypes, pair.names, pair.fw if kind == "backward" else None)
        _plans[gm] = plan
        if kind != "backward":
            pair.fw = plan
        compiled = base(gm, example_inputs)
    return RecordedGraph(compiled, plan, pair)


@contextlib.contextmanager
def _compiling():
    """AOT autograd compiles a backward graph lazily, at its first call, inside the autograd
    engine, where the recording's dispatch mode is active: let the compiler's ops pass."""
    r = _compile_run.active
    if r is None:
        yield
        return
    r.in_graph += 1
    try:
        if r._native is not None:  # the native core: its records of the compiler's own ops
            from trainguard.capture._native._backend import paused

            with paused():
                yield
        else:
            yield
    finally:
        r.in_graph -= 1


def _instrumenting(inner_compile, pair: Pair, forced: str | None):
    """Inductor's inner compiler with each graph instrumented first."""

    def inner(gm, example_inputs, **kwargs):
        if plan_of(gm) is not None:
            return inner_compile(gm, example_inputs, **kwargs)
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        with _compiling():
            mode, ops, dtypes = _summary_mode(forced)
            plan = instrument(gm, kind, mode, ops, dtypes, pair.names, pair.fw if kind == "backward" else None)
            _plans[gm] = plan
            if kind != "backward":
                pair.fw = plan
            with _as_plain():
                compiled = inner_compile(gm, example_inputs, **kwargs)
        # Inductor reported the strides of every output, the summaries' too; AOT autograd slices
        # that list from its end (saved tensors, symbolic sizes): it must hold the real outputs only.
        ctx = torch._guards.TracingContext.try_get()
        if plan.extra and ctx is not None and ctx.output_strides:
            del ctx.output_strides[plan.n_outputs:]
        with contextlib.suppress(AttributeError):
            compiled._trainguard = True
        return RecordedGraph(compiled, plan, pair)

    inner._trainguard = True
    return inner


@contextlib.contextmanager
def _as_plain():
    """Compile an instrumented graph's own nodes as Inductor compiles its plain twin.

    Inductor decides from a node's users whether to store its value (rounded to its dtype) or to
    recompute it inside each user, and the order its users come in: the summaries' reads, counted,
    stored bf16 values that the plain graph keeps in float32 (nanochat's Muon step in bf16: every
    updated weight differed, and the losses from the next step on). So while an instrumented
    graph compiles, a node's summary nodes are left out of its users when it is lowered and when
    a post-grad pattern counts a node's users, and the locality reordering of an inference graph
    is that of the graph without its summaries, each summary node then placed right after its
    inputs. (A change here raises _compile_summary.AS_PLAIN_VERSION.)"""
    from torch._inductor import pattern_matcher
    from torch._inductor.fx_passes import post_grad
    from torch._inductor.graph import GraphLowering

    run_node, reorder = getattr(GraphLowering, "run_node", None), getattr(post_grad, "reorder_for_locality", None)
    target = getattr(pattern_matcher, "_TargetExpr", None)
    match_users = getattr(target, "_match_users", None)
    if run_node is None or reorder is None or match_users is None:  # another torch's Inductor: compile as it does
        yield
        return

    def match_users_as_plain(self, node, ctx):
        # A pattern that needs a node to have exactly N users counts the program's own: a summary's
        # read must not stop a rewrite the plain graph gets (modded-nanogpt's Newton-Schulz step in
        # bf16, ``c * A @ B``). A node it then no longer needs stays for its summary (the matcher
        # erases only nodes without users).
        if not isinstance(node, torch.fx.Node) or not any(u.meta.get(SUMMARY_NODE) for u in node.users):
            return match_users(self, node, ctx)
        own = sum(1 for u in node.users if not u.meta.get(SUMMARY_NODE))
        return self in ctx.outputs or self.users is pattern_matcher.MULTIPLE or own == self.users

    def lower(self, n):
        users = n.users
        if not any(u.meta.get(SUMMARY_NODE) for u in users):
            return run_node(self, n)
        saved = dict(users)
        users.clear()
        users.update((u, v) for u, v in saved.items() if not u.meta.get(SUMMARY_NODE))
        try:
            return run_node(self, n)
        finally:
            users.clear()
            users.update(saved)

    def reorder_as_plain(graph: torch.fx.Graph) -> None:
        if not any(n.meta.get(SUMMARY_NODE) for n in graph.nodes):
            return reorder(graph)
        reorder_without_summaries(graph, reorder)

    GraphLowering.run_node, post_grad.reorder_for_locality = lower, reorder_as_plain
    target._match_users = match_users_as_plain
    try:
        yield
    finally:
        GraphLowering.run_node, post_grad.reorder_for_locality = run_node, reorder
        target._match_users = match_users


def reorder_without_summaries(graph: torch.fx.Graph, reorder) -> None:
    """Order ``graph``'s own nodes as ``reorder`` orders the graph without its summary nodes, and
    put each summary node right after its last input (in their former order where they tie)."""
    import heapq

    copy, env = torch.fx.Graph(), {}
    outputs = copy.graph_copy(graph, env)
    keep = tuple(a for a in outputs if not (isinstance(a, torch.fx.Node) and a.meta.get(SUMMARY_NODE))) \
        if isinstance(outputs, (tuple, list)) else outputs
    copy.output(keep)
    back = {c: n for n, c in env.items()}
    for c in reversed(list(copy.nodes)):
        if c.op != "output" and back[c].meta.get(SUMMARY_NODE):
            copy.erase_node(c)
    reorder(copy)
    position = {n: i for i, n in enumerate(graph.nodes)}
    waiting = {n: len(n.all_input_nodes) for n in graph.nodes if n.meta.get(SUMMARY_NODE)}
    ready: list[tuple[int, int]] = []
    order: list[torch.fx.Node] = []

    def place(n: torch.fx.Node) -> None:
        order.append(n)
        for u in n.users:
            if u in waiting:
                waiting[u] -= 1
                if not waiting[u]:
                    heapq.heappush(ready, (position[u], id(u)))
    by_id = {id(n): n for n in waiting}
    for n, k in waiting.items():
        if not k:
            heapq.heappush(ready, (position[n], id(n)))
    for c in copy.nodes:
        if c.op == "output":
            continue
        place(back[c])
        while ready:
            place(by_id[heapq.heappop(ready)[1]])
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in order:
        out.prepend(n)


def _is_ours(fn) -> bool:
    for _ in range(16):
        if getattr(fn, "_trainguard", False):
            return True
        nxt = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
        if nxt is None:
            return False
        fn = nxt
    return False


# ---------------------------------------------------------------------- switched on by a recording
def _recording_compile_fx(model_, example_inputs_, *args, **kwargs):
    """``compile_fx`` while recording: the same compilation, each graph instrumented."""
    original = _saved["compile_fx"]
    inner = kwargs.pop("inner_compile", None)
    if inner is None and args:
        inner, args = args[0], args[1:]
    if inner is None:
        from torch._inductor.compile_fx import compile_fx_inner as inner
    if _compile_run.active is None or _is_ours(inner):
        return original(model_, example_inputs_, inner, *args, **kwargs)
    with _no_autograd_cache():
        pair = Pair(_compile_label(), input_names(model_) if isinstance(model_, torch.fx.GraphModule) else None)
        return original(model_, example_inputs_, _instrumenting(inner, pair, None), *args, **kwargs)


def _opaque_call(self, inputs):
    """CompiledFxGraph.__call__ while recording: a graph compiled before it is one execution."""
    r = _compile_run.active
    if r is None or self.__dict__.get("_trainguard"):
        return _saved["graph_call"](self, inputs)
    kw = getattr(self, "fx_kwargs", None) or {}
    kind = "backward" if kw.get("is_backward") else ("inference" if kw.get("is_inference") else "forward")
    label = f"{kw.get('graph_id', '?')} {kind}"
    return _compile_opaque.record_opaque(r, label, functools.partial(_saved["graph_call"], self), inputs)


def _wrapper_call(self, model_, inputs_, *args, **kwargs):
    """torch.compile's Inductor wrapper: Inductor is imported by now; patch it before it runs."""
    _patch_inductor()
    return _saved["wrapper_call"](self, model_, inputs_, *args, **kwargs)


def _patch_inductor() -> None:
    with _lock:
        if "compile_fx" in _saved or not _users:
            return
        from torch._inductor import compile_fx as cfx
        from torch._inductor.output_code import CompiledFxGraph

        _saved["compile_fx"] = cfx.compile_fx
        cfx.compile_fx = _recording_compile_fx
        _saved["graph_call"] = CompiledFxGraph.__call__
        CompiledFxGraph.__call__ = _opaque_call


class _PausingLock:
    """Dynamo's compile lock, held around each compilation with every dispatch mode disabled
    (``with compile_lock, _disable_current_modes()``): the native core is paused there too, so
    neither backend records the compiler's own ops (the fakeified inputs' detaches, traced ops).

    Dynamo's DDP optimizer (a compiled model inside ``DistributedDataParallel``) and Inductor's
    lazy backward compile hold the lock with the modes still active: the Python recorders' mode
    lets ops pass while it is held (``in_graph``), or it would summarise the compiler's fake and
    functional tensors."""

    def __init__(self, lock) -> None:
        self.lock = lock
        self.local = threading.local()

    def __enter__(self):
        from trainguard.capture import _native

        self.lock.__enter__()
        mod = _native._module
        stack = self.local.__dict__.setdefault("old", [])
        users = tuple(_users)
        for r in users:
            r.in_graph += 1
        stack.append((mod.set_paused(True) if mod is not None else None, users))
        return self

    def __exit__(self, *exc):
        from trainguard.capture import _native

        old, users = self.local.old.pop()
        for r in users:
            r.in_graph -= 1
        if old is not None and _native._module is not None:
            _native._module.set_paused(old)
        return self.lock.__exit__(*exc)

    def __getattr__(self, name):  # acquire, release, ...
        return getattr(self.lock, name)


def _patch_dynamo() -> None:
    """Called with _lock held, once Dynamo is imported."""
    if "compile_lock" in _saved or not _users or "torch._dynamo.convert_frame" not in sys.modules:
        return
    from torch._dynamo import convert_frame

    _saved["compile_lock"] = convert_frame.compile_lock
    convert_frame.compile_lock = _PausingLock(convert_frame.compile_lock)


def _recording_compile(*args, **kwargs):
    """``torch.compile`` while recording: it imports Dynamo, whose compile lock is then patched."""
    out = _saved["compile"](*args, **kwargs)
    with _lock:
        _patch_dynamo()
    return out


def install(recorder) -> None:
    """Called when a recording starts: compiled graphs report to it."""
    with _lock:
        _users.append(recorder)
        _compile_run.active = recorder
        if len(_users) > 1:
            return
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is not None:
            _saved["wrapper_call"] = wrapper.__call__
            wrapper.__call__ = _wrapper_call
        _patch_dynamo()
        if "compile_lock" not in _saved:  # Dynamo not imported yet: torch.compile will
            _saved["compile"] = torch.compile
            torch.compile = functools.wraps(torch.compile)(_recording_compile)
    # The module hooks' warning from every torch.compile(module) call: see _modules.GlobalHook.
    if "torch._inductor.output_code" in sys.modules:
        _patch_inductor()  # graphs compiled before now exist: record their calls at graph granularity


def uninstall(recorder) -> None:
    with _lock:
        if recorder in _users:
            _users.remove(recorder)
        _compile_run.active = _users[-1] if _users else None
        if _users:
            return
        if "wrapper_call" in _saved:
            torch._TorchCompileInductorWrapper.__call__ = _saved.pop("wrapper_call")
        if "compile" in _saved:
            if getattr(torch.compile, "__wrapped__", None) is _saved["compile"]:  # unless wrapped after us
                torch.compile = _saved["compile"]
            del _saved["compile"]
        if "compile_lock" in _saved:
            from torch._dynamo import convert_frame

            if isinstance(convert_frame.compile_lock, _PausingLock):
                convert_frame.compile_lock = _saved["compile_lock"]
            del _saved["compile_lock"]
        if "compile_fx" in _saved:
            from torch._inductor import compile_fx as cfx
            from torch._inductor.output_code import CompiledFxGraph

            cfx.compile_fx = _saved.pop("compile_fx")
            CompiledFxGraph.__call__ = _saved.pop("graph_call")


def run_meta(recorder) -> dict:
    """What the run's metadata says about compiled graphs (read by the report)."""
    out: dict = {}
    if recorder.compiled_graphs:
        out["compiled_graphs"] = [{"graph": k, "ops": v[0], "calls": v[1]} for k, v in recorder.compiled_graphs.items()]
        if recorder.mode == "full_tensor":
            out["full_tensor_compiled"] = "graph outputs only"
    if recorder.opaque_graphs:
        out["compiled_opaque"] = [{"graph": k, "op": f"compiled_graph.{k}", "calls": v}
                                  for k, v in recorder.opaque_graphs.items()]
    return out


def reset_after_fork() -> None:
    """A forked child records nothing (see the recorder's fork handler)."""
    _compile_run.active = None
