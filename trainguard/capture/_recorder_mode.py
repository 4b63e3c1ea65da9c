"""The Python recorder's hot path: a private ``TorchDispatchMode`` (see ``_recorder``).

Every aten op that runs eagerly reaches ``__torch_dispatch__`` — forward ops from user code,
backward ops from the autograd engine, optimizer ops — and is recorded with its sequence
number, step, phase, module, interned stack, input producers and output summaries, into the
recorder's pending list (handed to the writer by ``_recorder_flush``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainguard._errors import NonFiniteError
from trainguard.capture import _compile, _numerics, _steps
from trainguard.capture._local import local as _local
from trainguard.capture._local import with_stats as _with_stats
from trainguard.capture._local import written as _written
from trainguard.capture._local import written_by as _written_by
from trainguard.capture._stacks import NO_HINT, frame_hint, local0
from trainguard.capture._summary import raw_isfinite, summarize_deferred, summarize_immediate, unknown_summary
from trainguard.capture._taint import (
    ALLOC,
    COPY,
    HARMFUL,
    OVERWRITE_OPS,
    PENDING,
    UNKNOWN,
    VIEW,
    classify,
)
from trainguard.capture._taint import writes_model_state as _writes_model_state
from trainguard.store._codec import health_of

if TYPE_CHECKING:
    from trainguard.capture._recorder import Recorder

log = logging.getLogger("trainguard.capture")

_get_seq_nr = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_FunctionBase = torch._C._FunctionBase  # a custom autograd.Function's backward node (its ctx)
_Tensor = torch.Tensor
_FakeTensor = torch._subclasses.fake_tensor.FakeTensor
_strided = torch.strided
_weakref = weakref.ref
_grad_enabled = torch.is_grad_enabled
_monotonic = time.monotonic
_clock = _steps.clock

# Records are handed to the writer in batches: every FLUSH_SECONDS, at FLUSH_RECORDS, soon
# after a non-finite value, and at stop. Each hand-over wakes the writer thread, which then
# competes for the GIL, so a fast loop must not hand over every step.
FLUSH_RECORDS = 4096
FLUSH_SECONDS = 0.25

# Forward ops remembered for the backward ops of their autograd nodes: pruned to the last two
# steps at each step, and when this many accumulate (a loop that never calls optimizer.step()
# or trainguard.step()), so memory stays bounded (see Recorder._prune_fwd_nodes).
FWD_NODES_MAX = 200_000

def _by_frames(r: Recorder, stack_id: int) -> tuple[int | None, bool]:
    """An op no module hook claims: (the module whose method runs it, whether it runs in the
    forward of a custom autograd.Function whose output autograd differentiates), from its frames
    (see _stacks.frame_hint; the native core reads the same locals, recorder.cpp)."""
    f = sys._getframe(2)
    hint = r.stacks.hints.get(stack_id)
    if hint is None:
        hint = r.stacks.hints[stack_id] = frame_hint(f)
    if hint == NO_HINT:
        return None, False
    owner, fn = hint
    if owner >= 0:
        m = local0(f, owner)
        if isinstance(m, torch.nn.Module):
            return r.modules.owner(m), False
    if fn >= 0 and not _grad_enabled():
        ctx = local0(f, fn)
        return None, isinstance(ctx, _FunctionBase) and any(ctx.needs_input_grad)
    return None, False


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dt: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return name


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(dev: torch.device) -> str:
    name = _DEVICE_NAMES.get(dev)
    if name is None:
        name = _DEVICE_NAMES[dev] = str(dev)
    return name


# A producer entry, per live output tensor, keyed by id(tensor) (its taint is kept by seq, in
# the recorder's Tracker):
#   (weakref to the tensor, seq, op name, stack id, immediate summary or None, version counter)
# The weak reference has no callback (a callback per tensor costs more than the op's own
# bookkeeping); an entry whose tensor died is ignored on lookup, overwritten when the id is
# reused, and swept out every step and when the table doubles (see Recorder._sweep).
_OP, _STACK = 2, 3  # positions in an entry, for the cold paths (capture/_numerics.py)


def op_facts(func, name: str) -> tuple[int, bool, bool]:
    """What the taint rule needs of an op overload: (class, overwrites its first input, writes
    in place), from its name and schema (see _taint.classify)."""
    try:
        schema = func._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        inplace = first is not None and first.is_write
        is_view = bool(func.is_view)
    except Exception:  # not an OpOverload with a schema (a HigherOrderOperator, ...)
        inplace = is_view = False
    return classify(name, is_view), name in OVERWRITE_OPS, inplace


def op_facts_by_name(name: str) -> tuple[int, bool, bool]:
    """:func:`op_facts` of the overload named ``aten.add_.Tensor`` (the native core's records
    name their ops; the dispatch mode holds the overload)."""
    ns, _, rest = name.partition(".")
    op, _, overload = rest.rpartition(".")
    try:
        func = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except Exception:  # not a registered overload: classified by name alone
        func = None
    return op_facts(func, name)


def _recomputes(node) -> bool:
    """Whether an op that autograd's engine runs with grad mode on belongs to a forward pass run
    again inside a backward pass: a forward op (its mask's ``-inf`` absorbed by softmax), not a
    gradient, whose own backward is traced back to it. torch.utils.checkpoint recomputes inside
    saved-tensor hooks of its own (``use_reentrant=False``) or in its CheckpointFunction's backward
    (``use_reentrant=True``); a custom ``autograd.Function`` whose backward re-runs a function under
    ``enable_grad`` for its vector-Jacobian product (torchdiffeq's adjoint method) is the same. A
    backward pass that builds a graph (``create_graph=True``) runs with grad mode on in the built-in
    ops' nodes. The native core asks the same (recorder.cpp, ``recomputes``)."""
    return _saved_tensor_hooks(True) is not None or isinstance(node, _FunctionBase)


class _DispatchMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise the base class wraps __torch_dispatch__ in a dynamo-disable shim that costs
        # microseconds per op; keep_dynamo_out (below the class) marks its code instead.
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles while this mode is active (with the mode off) instead of falling
        # back to eager; compiled graphs record their own ops (see _compile).
        return True

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec: Recorder | None = rec
        _live_modes.add(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The hot path: locals instead of attribute lookups, no helper calls for common cases.
        r = self.rec
        if r is None or r.in_graph:  # a forked child (a DataLoader worker), or compiled code running
            return func(*args, **(kwargs or {}))
        info = r.op_info.get(id(func))
        if info is None:
            info = r._info(func)
        if info[10]:
            return info[4](*args, **kwargs) if kwargs else info[4](*args)
        node = _current_node()
        if node is not None and _grad_enabled() and _recomputes(node):
            node = None  # a checkpointed forward run again in the backward pass: recorded as forward
        nr = _get_seq_nr()
        inner = None
        if info[9] and "reduce_scatter" in info[0]:
            out, inner = _inside_collective(func, args, kwargs or {})
        else:
            out = info[4](*args, **kwargs) if kwargs else info[4](*args)
        try:
            outs = out if type(out) in (tuple, list) else (out,)
            if outs and type(outs[0]) is _FakeTensor:  # a compiler tracing (a lazy backward compile)
                return out
            seq = r.seq
            r.seq = seq + 1
            if info[9]:
                outs = _written(info[0], args, out)
            elif info[11]:
                outs = _written_by(info[11], args, kwargs)
            elif info[12]:
                outs = _with_stats(info[12], args, kwargs, out)
            producers = r.producers
            name = info[0]
            if not info[1]:  # filtered out: consumers still learn who made their inputs
                for o in outs:
                    if isinstance(o, _Tensor):
                        _register(r, producers, o, seq, name, None, None)
                for o in inner or ():
                    _register(r, producers, o, seq, name, None, None)
                r.last_nr = _get_seq_nr()
                return out

            # Where and when: phase, module, stack (backward ops inherit them from their forward op).
            fwd_seq = fwd_op = None
            if node is not None:
                phase = "backward"
                fwd = r.fwd_nodes.get(node._sequence_nr())
                if fwd is not None and fwd[0] is not None:
                    fwd_seq, module_id, stack_id, _, fwd_op = fwd
                else:
                    # no recorded op made this node, or a custom autograd.Function did: its Python
                    # backward runs here, at lines of its own (mambapy's reverse scan)
                    module_id = fwd[1] if fwd is not None else None
                    stack_id = r.stacks.capture(2)
                if not r.in_backward:  # the first op of a backward pass: it runs from the loss
                    r.in_backward = True
                    r.backward_starts(fwd_seq)
                if nr != r.last_nr and _grad_enabled() and _on_cpu(outs):
                    # create_graph=True (second-order MAML): this backward op made the autograd node
                    # numbered nr - 1, whose backward (the double backward) inherits the forward op's
                    # module and stack through it. On the CPU only: an accelerator's backward runs on a
                    # device thread, whose sequence numbers are not the forward thread's.
                    r.fwd_nodes[nr - 1] = (seq, module_id, stack_id, _clock.step, name)
                    if len(r.fwd_nodes) > FWD_NODES_MAX:
                        r._prune_fwd_nodes()
            else:
                r.in_backward = False
                module_id = r.modules.current()
                stack_id = r.stacks.capture(2)
                in_function = False
                if module_id is None and stack_id is not None and not _clock.in_optimizer:
                    module_id, in_function = _by_frames(r, stack_id)
                if _clock.in_optimizer:
                    phase = "optimizer"
                elif module_id is not None or _grad_enabled() or in_function:
                    phase = "forward"
                else:
                    phase = "other"
                if nr != r.last_nr:
                    # The autograd node of this op was numbered nr - 1 just before dispatch; with
                    # grad mode off the op made none: the custom autograd.Function whose forward
                    # runs it did, and the Function's backward is not this op's (seq None).
                    fwd_nodes = r.fwd_nodes
                    fwd_nodes[nr - 1] = ((seq, module_id, stack_id, _clock.step, name) if _grad_enabled()
                                         else (None, module_id, None, _clock.step, None))
                    if len(fwd_nodes) > FWD_NODES_MAX:
                        r._prune_fwd_nodes()
            if r.dtypes is not None and not any(isinstance(o, _Tensor) and o.dtype in r.dtypes for o in outs):
                for o in outs:
                    if isinstance(o, _Tensor):
                        _register(r, producers, o, seq, name, stack_id, None)
                r.last_nr = _get_seq_nr()
                return out

            # Inputs: a parameter or buffer by name, else the recorded op that produced it; and
            # the highest taint among them (see _taint: FINITE < UNKNOWN < PENDING < HARMFUL).
            named = r.modules.named_tensors
            states = r.taint.states if r.judge_here else None
            in_taint = 0
            in_origin = None
            inputs = []
            first = None
            for a in (args if not kwargs else (*args, *kwargs.values())):
                if isinstance(a, _Tensor):
                    group = (a,)
                elif type(a) in (list, tuple) and a and isinstance(a[0], _Tensor):
                    group = a
                else:
                    continue
                for t in group:
                    key = id(t)
                    e = named.get(key)
                    p = producers.get(key)
                    if p is not None and p[0]() is not t:
                        p = None
                    if p is not None and states and t._base is not None:
                        p = _written_through_base(producers, states, t, p)
                    if e is not None and e[0]() is t:
                        inputs.append((e[2], e[1]))
                        # its state is its producer's: a buffer made before its module first ran
                        # (a noise schedule's +inf) keeps the origin it was made with
                        if states and p is not None and not (info[7] and first is None):
                            st = states.get(p[1])
                            if st is not None and st[0] >= PENDING and st[0] > in_taint:
                                in_taint, in_origin = st
                    else:
                        if p is not None:
                            inputs.append(("op", p[1]))
                            # (an overwrite, copy_ or fill_, does not count its first input's old values)
                            if states and not (info[7] and first is None):
                                st = states.get(p[1])
                                if st is not None and st[0] == UNKNOWN and _base_written(producers, t, p[1]):
                                    st = None  # uninitialised no more (see _taint.WRITTEN)
                                if st is not None and (st[0] > in_taint or (
                                        st[0] == in_taint and st[1] is not None and st[1] < in_origin)):
                                    in_taint, in_origin = st
                        else:
                            inputs.append(("input", None))
                    if first is None:
                        first = t

            cls = info[6]
            # a view of a parameter, or an in-place write into one (emb.weight[1] = inf): see _taint
            into = None
            if r.judge_here and inputs:  # (most ops: one string compare, or one dict look-up)
                k0 = inputs[0]
                if k0[0] == "param" or k0[0] == "buffer" or (k0[0] == "op" and k0[1] in r.taint.param_views):
                    into = r.taint.view_of_model_state(seq, cls, info[8], inputs)
            fields = r.fields
            summaries = [] if fields else None
            metas = []
            health = 0
            immediate_only = True
            alias = None
            garbage = in_taint == UNKNOWN and (cls == VIEW or cls == COPY)  # a view or copy of uninitialised memory
            if info[3] and first is not None and summaries is not None:
                # A pure alias (view, t, detach, ...) holds the same values as its input: reuse that
                # input's summary while the shared version counter says nothing wrote to it since.
                p = producers.get(id(first))
                if (p is not None and p[4] is not None and p[0]() is first and p[5] is not None
                        and p[5] == first._version):
                    alias = p[4]
            known = info[2]  # outputs that hold values: -1 all, 0 none, n the first n (a workspace follows)
            for o in outs:
                if not isinstance(o, _Tensor):
                    continue
                v = o if type(o) is _Tensor else _local(o)  # a DTensor: the shard this rank holds
                cpu = v.is_cpu
                dt = v.dtype
                metas.append((_DTYPE_NAMES.get(dt) or _dtype_name(dt), tuple(v.shape),
                              "cpu" if cpu else _device_name(v.device)))
                s = None
                if summaries is not None:
                    if garbage or len(metas) > known >= 0:  # uninitialised memory, a collective's, a workspace
                        s = unknown_summary(r.mode, v.numel())
                    elif alias is not None:
                        s = alias
                    elif ((cpu and r.strategy != "deferred") or r.strategy == "immediate"
                          or v.is_meta or v.layout is not _strided):  # no data, or sparse: rare, may sync
                        s = summarize_immediate(v, r.mode, in_taint == HARMFUL)
                    else:
                        immediate_only = False
                        r.deferred_used = True
                        dev = v.device
                        lst = r.deferred.setdefault(dev, [])
                        summaries.append(("d", dev, len(lst)))
                        lst.append(summarize_deferred(v, r.mode))
                        if r.check and not bool(raw_isfinite(v).all()):
                            # check_numerics may synchronise: it must stop at this op.
                            health |= _numerics.health_sync(v)
                    if s is not None:
                        health |= health_of(fields, s)
                        summaries.append(s)
                # A collective's output must never lend its summary to a later view: its values
                # arrive after this, without moving the version counter.
                _register(r, producers, o, seq, name, stack_id, None if info[9] else s)
                if v is not o:
                    # A DTensor's shard was made (or written) by this op, inside the subclass where
                    # this mode does not see it: FSDP2 reads it directly (``_local_tensor.view(-1)``
                    # after ``to_empty``), and must find this op, and its taint, as the producer.
                    _register(r, producers, v, seq, name, stack_id, None if info[9] else s)
            for o in inner or ():  # made inside the collective's kernel: it wrote them (see _inside_collective)
                _register(r, producers, o, seq, name, stack_id, None)
            if r.mode == "full_tensor" and not info[9]:  # a collective's values are not there yet
                _save_payloads(r, seq, outs)

            # The taint of the outputs, where their health is known now (see _taint.Tracker).
            taint = 0
            origin = None
            if not r.judge_here or not (immediate_only or r.check):
                if r.judge_here:
                    r._judge_in_writer()
                taint = None
            elif health or in_taint or cls == ALLOC:
                taint, origin = r.taint.settle(
                    seq, _clock.step, phase, name, cls,
                    into is not None or _writes_model_state(name, info[8], inputs, len(metas)),
                    in_taint, in_origin, health, inputs, fwd_seq, fields, summaries, (module_id, stack_id, fwd_op))
                if origin == seq:
                    if r.check:
                        r._note_origin(seq, args, outs)
                    if r.nonfinite_rows is not None:
                        r._note_rows(seq, outs)
            if info[8] and (health or not immediate_only) and first is not None and first._base is not None:
                # An in-place write of a non-finite value (or one not summarised yet) through a view:
                # the base holds it now, and its readers must find this op, not the base's maker
                # (``emb.weight[1] = inf``; ``x[5, 0, 2, 2] = inf`` in a data set a DataLoader reads
                # later). A finite write leaves the rest of the base as it was. (recorder.cpp: the same)
                _register(r, producers, first._base, seq, name, stack_id, None)
            stop = r.check and (taint == HARMFUL or (r.strict and health and taint != UNKNOWN))
            if r.writer is None and not taint:  # check_numerics without a run directory, finite
                r.last_nr = _get_seq_nr()
                return out
            # A record is a tuple of atoms and tuples: the garbage collector untracks such tuples, so
            # the thousands of records the writer holds never make its full collections slower.
            rec = (seq, _clock.step, phase, name, module_id, stack_id, fwd_seq,
                   health if immediate_only or r.check else None, tuple(inputs), tuple(metas),
                   None if summaries is None else tuple(summaries), taint, origin)
            if taint == PENDING:
                r.taint.keep(rec)
            if stop:
                r._stop_at(rec, args, outs, health, fwd_op)
            if r.writer is None:
                r.last_nr = _get_seq_nr()
                return out
            pending = r.pending
            pending.append(rec)
            r.recorded += 1
            n = len(pending)
            if n >= FLUSH_RECORDS or (n & 31 == 0 and (r.taint.urgent or _monotonic() - r.last_flush > FLUSH_SECONDS)):
                r.flush()
            r.last_nr = _get_seq_nr()
            return out
        except NonFiniteError:
            raise
        except Exception as exc:  # observing training never kills training
            _record_failed(r, str(func), exc)
            return out


def _record_failed(r: Recorder, name: str, exc: Exception) -> None:
    """An op's output could not be recorded: say so once per op type, keep training."""
    r.failures += 1
    if name not in r.failed_ops:
        r.failed_ops.add(name)
        log.warning("trainguard: could not record an output of %s (%s: %s); training goes on",
                    name, type(exc).__name__, exc)
    r.last_nr = _get_seq_nr()


# A process forked while recording (DataLoader workers, by default on Linux) inherits the
# active mode in its thread state, but not the writer's thread: its ops pass through unrecorded.
_live_modes: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mode in list(_live_modes):
        mode.rec = None
    _compile.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_compile.keep_dynamo_out(_DispatchMode.__torch_dispatch__)


class _Inside(TorchDispatchMode):
    """Collects the tensors that the calls right inside a collective's kernel make on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[_Tensor] = []
        self.open = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.open and type(out) is _Tensor:
            self.made.append(out)
        return out


_AFTER_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


def _first_tensor(args) -> _Tensor | None:
    for a in args:
        if isinstance(a, _Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


def _inside_collective(func, args: tuple, kwargs: dict) -> tuple:
    """Run a reduce-scatter with :class:`_Inside` around its kernel: gloo's (FSDP2 on CPU)
    reduces a clone of its input, made inside the kernel, and splits it into the output only when
    the program waits for it (a split and a copy_ this mode records). The clone is what the
    collective wrote; the native core makes it the collective's the same way (recorder.cpp)."""
    t = _first_tensor(args)
    if t is None:
        return func(*args, **kwargs), None
    inside = _Inside()
    with inside:
        try:
            return func.redispatch(torch._C._dispatch_keys(t) & _AFTER_PYTHON, *args, **kwargs), inside.made
        finally:
            inside.open = False


def _written_through_base(producers: dict, states: dict, t: _Tensor, p: tuple) -> tuple:
    """The producer ``t``, a view, holds now: the later op that wrote a non-finite value into
    its base through another view, else its own. mambapy's PScan.forward scans in place through
    views of ``X = X.transpose(2, 1)`` and returns ``X.transpose(2, 1)``: the overflow is the
    write's, not the final transpose's. (recorder.cpp, input_of: the same)"""
    b = t._base
    q = producers.get(id(b))
    if q is None or q[1] <= p[1] or q[0]() is not b:
        return p
    st = states.get(q[1])
    return q if st is not None and st[0] >= PENDING else p


def _base_written(producers: dict, t: _Tensor, seq: int) -> bool:
    """Whether ``t``, a view that ``seq`` made, had its base written by a later op: the memory
    of an allocation is unknown no more once an op writes it (see _taint.WRITTEN)."""
    b = t._base
    if b is None:
        return False
    p = producers.get(id(b))
    return p is not None and p[1] > seq and p[0]() is b


def _on_cpu(outs) -> bool:
    first = next((o for o in outs if isinstance(o, _Tensor)), None)
    return first is not None and first.device.type == "cpu"


def _register(r: Recorder, producers: dict, o: _Tensor, seq: int, name: str, stack_id, summary) -> None:
    key = id(o)
    try:
        version = o._version
    except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
        version = None
    p = producers.get(key)
    if p is not None and p[0]() is o:  # an in-place op: o now holds this op's output
        producers[key] = (p[0], seq, name, stack_id, summary, version)
        return
    producers[key] = (_weakref(o), seq, name, stack_id, summary, version)
    if len(producers) > r.sweep_at:
        r._sweep()


def _save_payloads(r: Recorder, seq: int, outs) -> None:
    if r.writer is None:
        return
    for slot, o in enumerate(x for x in outs if isinstance(x, _Tensor)):
        # full_tensor mode copies values to the host by definition; the file is written by the
        # writer. One copy, already contiguous: the writer appends its memory as it is (a
        # transposed output copied with its strides would be copied again there).
        o = o.detach()
        fmt = torch.contiguous_format if o.layout is _strided else torch.preserve_format
        r.writer.put_payload_tensor(seq, slot, o.to("cpu", copy=True, memory_format=fmt))
