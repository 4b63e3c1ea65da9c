"""Harmful, intended, unknown: the taint of every recorded output, judged online.

A non-finite value is harmful when it is a NaN, or when a +-inf (or a value computed from it)
reaches a sink: the loss (the tensor backward() runs from), a gradient (any backward-pass
output), a parameter or optimizer state (optimizer-phase outputs, in-place writes into a
parameter, batch norm's running statistics) or a value the program reads (``.item()``,
``.tolist()``, printing). A +-inf that is absorbed first is intended. Allocation outputs, and
views and copies of them until written, are unknown: never evidence. See docs/recorder.md,
"Harmful, intended, unknown".

The state of a tensor is kept by the seq of the execution that produced it (a record's inputs
name their producers by seq; an in-place op makes its output the tensor's new producer), only
for outputs that are not finite: ``states[seq] = (taint, origin)``. The rule that turns an op's
inputs into its output's taint is :func:`propagate`, a lookup in ``RULES`` by the op's class,
the highest input taint and the output's health; the native recorder's records are judged by
this same code as they are drained (:meth:`Tracker.judge`).
:class:`Tracker` adds what needs memory: the sinks, the first harmful chain to pin, counts.
Pure Python without torch: the recorder calls it on the training thread, the run writer on its
own thread for accelerator records whose health arrives later.
"""

from __future__ import annotations

from collections.abc import Callable

from trainguard.store._codec import (
    NAN,
    NEG_INF,
    NONFINITE,
    POS_INF,
    T_FINITE,
    T_HARMFUL,
    T_PENDING,
    T_UNKNOWN,
)
from trainguard.store._ranks import is_collective

FINITE, UNKNOWN, PENDING, HARMFUL = T_FINITE, T_UNKNOWN, T_PENDING, T_HARMFUL

# ---------------------------------------------------------------------- op classes
# DEFAULT: computes new values from its inputs. VIEW: aliases its input (schema says so). COPY:
# copies its input's values. ALLOC: uninitialised memory. RENORM: softmax-like ops built to
# absorb -inf masks: what non-finite value they output is theirs (a fully masked row).
# READ: hands a value to the program (no tensor output). COLLECTIVE: sends this rank's values
# and writes what the other ranks send, later (torch.distributed): what it writes is judged by
# the op that reads it, and what this rank sent passes on its harm.
DEFAULT, VIEW, COPY, ALLOC, RENORM, READ, COLLECTIVE = range(7)

# A record's input ("written", seq) is ("op", seq) for a view that ``seq`` made whose base a later
# op wrote (the base's producer is later than ``seq``): FSDP2's flat view of a shard that
# to_empty allocated and reset_parameters then filled. Uninitialised memory written that way is
# unknown no more; any other state the view had still counts. A write into the base does not
# move the view's producer (nor, inside a tensor subclass's dispatch, its version counter). The
# native core hands this kind over; the judge stores it as "op" (see Tracker.judge). The
# dispatch mode judging on the training thread applies the same rule in place.
WRITTEN = "written"

# Batch norm's kernels in training write the running statistics (arguments 3 and 4) into the
# module's buffers, which their schemas do not mark as written: {op: (position of its `training`
# flag, or -1 for always; how many tensors it returns)}. Both backends record those two tensors
# after the returned ones, and a non-finite value written there is harmful (model state, as a
# parameter is): the model in eval mode would normalise every input with it.
STATS_WRITES = {
    "aten.native_batch_norm.default": (5, 3), "aten._native_batch_norm_legit.default": (5, 3),
    "aten.cudnn_batch_norm.default": (5, 4), "aten.miopen_batch_norm.default": (5, 3),
    "aten._batch_norm_with_update.default": (-1, 4),
}
STATS_ARGS = ((3, "running_mean"), (4, "running_var"))


def writes_model_state(op: str, inplace: bool, inputs, n_outputs: int) -> bool:
    """Whether an op writes into a parameter (in place into its first input) or into a module's
    buffers (batch norm's running statistics, when it recorded them as outputs)."""
    if inplace and inputs and inputs[0][0] == "param":
        return True
    stats = STATS_WRITES.get(op)
    # (its buffer inputs are the running statistics, whichever slots they take: absent tensor
    # arguments, a weight and bias of an affine=False norm, have none)
    return stats is not None and n_outputs > stats[1] and any(k[0] == "buffer" for k in inputs[1:])


CLASS_NAMES = ("default", "view", "copy", "alloc", "renorm", "read", "collective")

# Tensor.__deepcopy__ (copy.deepcopy of a module: an EMA of the model, ema_pytorch's and timm's)
# copies a tensor as ``new_empty`` of it, then ``set_`` of the new tensor to a copy of the storage,
# made by storage calls that no op sees in terms of the source. The set_ holds the source's
# values: a copy of it, whose taint and origin it keeps.
STORAGE_SETS = frozenset({"aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset"})

ALLOC_OPS = frozenset(
    {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
     "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty.out",
     "aten.empty_permuted.default", "aten.resize_.default"}
)
COPY_OPS = frozenset(
    {"aten.clone.default", "aten._to_copy.default", "aten.copy_.default", "aten.copy.default",
     "aten._copy_from.default", "aten._copy_from_and_resize.default", "aten.lift_fresh.default",
     "aten.lift_fresh_copy.default", "aten.contiguous.default", "aten.to.dtype", "aten.to.device",
     "aten.to.dtype_layout", "aten._to_copy.out", "aten.clone.out",
     # FSDP2: copies this rank's shards into its slice of the all-gather's output buffer (an
     # ``empty``) and returns that slice and the whole buffer, the other ranks' slices unwritten
     # until the all-gather: the buffer is unknown, and what this rank sends keeps its harm.
     "fsdp.all_gather_copy_in.default"}
)
RENORM_OPS = frozenset(
    {"aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default",
     "aten.softmax.int", "aten.log_softmax.int", "aten.logsumexp.default",
     "aten._scaled_dot_product_flash_attention_for_cpu.default",
     "aten._scaled_dot_product_flash_attention.default",
     "aten._scaled_dot_product_efficient_attention.default",
     "aten._scaled_dot_product_cudnn_attention.default",
     "aten._scaled_dot_product_fused_attention_overrideable.default",
     "aten._scaled_dot_product_attention_math.default"}
)
READ_OPS = frozenset({"aten._local_scalar_dense.default", "aten.item.default"})
# Ops that only inspect values (a bool out): an inf they see is not consumed yet, so a later
# op that absorbs it (the overwrite after ``isinf``) is named as its absorber instead.
CHECK_OPS = frozenset(
    {"aten.isinf.default", "aten.isnan.default", "aten.isfinite.default", "aten.isposinf.default",
     "aten.isneginf.default", "aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar",
     "aten.lt.Tensor", "aten.lt.Scalar", "aten.le.Tensor", "aten.le.Scalar", "aten.gt.Tensor",
     "aten.gt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar", "aten.any.default", "aten.any.dim",
     "aten.all.default", "aten.all.dim", "aten.isclose.default"}
)
# In-place ops that replace every value of their first input: its old state does not count.
OVERWRITE_OPS = frozenset(
    {"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default",
     "aten.normal_.default", "aten.uniform_.default", "aten.bernoulli_.float", "aten.bernoulli_.Tensor",
     "aten.random_.default", "aten.random_.from", "aten.random_.to", "aten.exponential_.default",
     "aten.geometric_.default", "aten.cauchy_.default", "aten.log_normal_.default",
     "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset", "aten.set_.source_Tensor",
     "aten._copy_from.default"}
)

# In-place ops that write given values into part of their first input, computing nothing from its
# old values: written into uninitialised memory (TorchRL's LazyTensorStorage, a replay buffer
# allocated with ``empty`` and filled a batch of rows at a time), the rows not written yet are
# still garbage, whatever their bytes hold; they are judged where something computes on them.
PARTIAL_WRITE_OPS = frozenset(
    {"aten.index_put_.default", "aten._index_put_impl_.default", "aten.index_copy_.default",
     "aten.index_fill_.int_Scalar", "aten.index_fill_.int_Tensor", "aten.masked_fill_.Scalar",
     "aten.masked_fill_.Tensor", "aten.masked_scatter_.default", "aten.scatter_.src", "aten.scatter_.value"}
)


def classify(name: str, is_view: bool) -> int:
    """The class of an op by its overload name (``aten.copy_.default``) and its schema."""
    if name in ALLOC_OPS:
        return ALLOC
    if is_collective(name):
        return COLLECTIVE
    if name in READ_OPS:
        return READ
    if name in RENORM_OPS:
        return RENORM
    if name in COPY_OPS:
        return COPY
    return VIEW if is_view else DEFAULT


# ---------------------------------------------------------------------- the rule
# Where an output's origin comes from: none, the highest-ranked input's, or this execution.
NONE, INPUT, SELF = 0, 1, 2
_F, _I, _N = 0, 1, 2  # the output holds: only finite values, +-inf (no NaN), NaN

# RULES[class][input taint][output] = (output taint, origin source). The input taint is the
# highest among the op's inputs (FINITE < UNKNOWN < PENDING < HARMFUL). Read a row as: "a
# DEFAULT op whose inputs hold a pending inf and whose output holds NaN makes a harmful value
# whose origin is the inf's" (0 * inf). A finite output is finite whatever came in: that is
# absorption (softmax of -inf, where, masked selection, clamp, nan_to_num, max, comparisons,
# an overwrite). Sinks are applied after the table (Tracker.settle).
_DEFAULT_ROWS = {
    FINITE: ((FINITE, NONE), (PENDING, SELF), (HARMFUL, SELF)),
    UNKNOWN: ((FINITE, NONE), (PENDING, SELF), (HARMFUL, SELF)),  # computing on garbage is a fault
    PENDING: ((FINITE, NONE), (PENDING, INPUT), (HARMFUL, INPUT)),
    HARMFUL: ((FINITE, NONE), (HARMFUL, INPUT), (HARMFUL, INPUT)),
}
_ALIAS_ROWS = {**_DEFAULT_ROWS, UNKNOWN: ((UNKNOWN, NONE),) * 3}  # views and copies of garbage
RULES: tuple[dict, ...] = (
    _DEFAULT_ROWS,  # DEFAULT
    _ALIAS_ROWS,  # VIEW
    _ALIAS_ROWS,  # COPY
    {t: ((UNKNOWN, NONE),) * 3 for t in (FINITE, UNKNOWN, PENDING, HARMFUL)},  # ALLOC
    {  # RENORM: a -inf it receives is absorbed by design; what it makes non-finite is its own
        FINITE: ((FINITE, NONE), (PENDING, SELF), (HARMFUL, SELF)),
        UNKNOWN: ((FINITE, NONE), (PENDING, SELF), (HARMFUL, SELF)),
        PENDING: ((FINITE, NONE), (PENDING, SELF), (HARMFUL, SELF)),
        HARMFUL: ((FINITE, NONE), (HARMFUL, INPUT), (HARMFUL, INPUT)),
    },
    {  # READ: the program receives the value; reading an inf is the sink
        FINITE: ((FINITE, NONE),) * 3,
        UNKNOWN: ((FINITE, NONE),) * 3,
        PENDING: ((HARMFUL, INPUT),) * 3,
        HARMFUL: ((HARMFUL, INPUT),) * 3,
    },
    {  # COLLECTIVE: its outputs' values are not there when it returns (health unknown); a harmful
        # or pending value it sends taints them, what other ranks send is the reader's to judge
        FINITE: ((FINITE, NONE),) * 3,
        UNKNOWN: ((FINITE, NONE),) * 3,  # a DDP bucket is written through views: not garbage
        PENDING: ((PENDING, INPUT),) * 3,
        HARMFUL: ((HARMFUL, INPUT),) * 3,
    },
)


def propagate(cls: int, in_taint: int, in_origin: int | None, health: int, seq: int) -> tuple[int, int | None]:
    """(taint, origin) of an op's output from its class, its highest input taint (with that
    input's origin) and its output's health bits."""
    out = _N if health & NAN else (_I if health & NONFINITE else _F)
    taint, src = RULES[cls][in_taint][out]
    return taint, (seq if src == SELF else in_origin if src == INPUT else None)


# ---------------------------------------------------------------------- memory bounds
# Records kept for the chain of a value that may turn harmful later (pending outputs), most
# recently used last: an origin every step derives from (a mask buffer) stays.
RECORDS_MAX = 4096
# Origins of infinities remembered for the counts of intended ones and for check_numerics.
ORIGINS_MAX = 4096
# States kept by the writer's judge, which cannot see which tensors died (the recorder drops
# the states of dead tensors each step).
STATES_MAX = 65536
# Origins remembered as joined with one origin: a mask buffer made once and a new mask each step
# (joined by an add) would otherwise add one per step for as long as the buffer lives.
JOINED_MAX = 64
# Views of parameters and buffers remembered (a row ``weight[i]``, ``weight.t()`` each forward):
# an in-place write into one is a write into the parameter. The newest are kept.
PARAM_VIEWS_MAX = 4096
# Harmful executions pinned after the first chain: the first of each op type and step, up to
# this many in a run, so that a run that keeps making NaN stays within 2x of its healthy size.
STORM_PINS = 256


def kind_of(health: int) -> str:
    if health & NAN:
        return "nan"
    both = health & (POS_INF | NEG_INF)
    return "±inf" if both == POS_INF | NEG_INF else ("+inf" if both == POS_INF else "-inf")


class Tracker:
    """The taint state of one recording (see the module docstring). Not thread-safe: one thread
    judges (the training thread, or the writer's); :meth:`take` may run on another."""

    def __init__(self) -> None:
        self.states: dict[int, tuple[int, int | None]] = {}
        self.records: dict[int, tuple] = {}
        # origin seq -> (op, kind, values, absorbed_by or None, harmful, step, phase, module_id,
        #                stack_id, fwd_op, detail): tuples, which the garbage collector untracks.
        self.origins: dict[int, tuple] = {}
        # (kind, made_by, absorbed_by) -> [values, origins]: infinities never harmful so far.
        self.groups: dict[tuple, list] = {}
        # origin seq -> the later origins whose pending values an op joined with its own (a cat of
        # two logs' -inf): the joined value carries the earliest origin only, and where it goes (a
        # sink, an op that absorbs it), the others go too.
        self.joined: dict[int, tuple[int, ...]] = {}
        self.first: dict | None = None  # where the first harmful value became harmful
        # where a harmful value first reached training (the loss, a gradient, optimizer state or a
        # parameter): a NaN made in a value nothing uses (nerf's disparity, 0/0 for an empty ray)
        # is the first harmful value, but not the origin of a NaN loss many steps later
        self.damage: dict | None = None
        self.pins: list[int] = []
        self.resend: list[tuple] = []
        self.counted: list[tuple[int, str, int]] = []  # (step, op, seq) of harmful executions
        self.seen: set[tuple[int, str]] = set()  # (step, op) whose first harmful execution is pinned
        self.storm_pins = 0
        self.urgent = False
        self.changed = False  # first/groups changed since take()
        self.bounded = False  # the writer's judge: no liveness, bound the states by size
        self.keep_records = True  # False without a run directory: nothing to resend
        self.op_classes: dict[str, tuple[int, bool, bool]] = {}  # name -> (class, overwrite, inplace)
        # name -> op_classes entry, for an op judge() meets first (the native core's records)
        self.resolve_op = None
        self._last_phase = None
        # parameter or buffer name -> the seq of the op whose pending or harmful value it holds:
        # records name such inputs, not their producer, and a buffer made before its module first
        # ran (a noise schedule's +inf) keeps the origin it was made with. Set when it is named
        # (the native core's ModuleTracker.on_named) and by in-place writes into it.
        self.named: dict[str, int] = {}
        # seq of a view of a parameter or buffer (also a view of such a view) -> its input entry,
        # ("param", name) or ("buffer", name): ``emb.weight[1] = inf`` writes the parameter
        self.param_views: dict[int, tuple[str, str]] = {}
        # seq -> record, of the batch being judged: the native core hands judge() only the records
        # it did not judge finite itself, so a finite view of a parameter is looked up there
        self.find_record: Callable[[int], tuple | None] | None = None
        # (seq, taint, origin) of the last allocation made like a pending or harmful tensor (the
        # new_empty of a deepcopy), for the set_ that fills it next (see STORAGE_SETS)
        self.template: tuple[int, int, int | None] | None = None

    # ------------------------------------------------------------------ judging
    def settle(self, seq: int, step: int, phase: str, op: str, cls: int, param_write: bool, in_taint: int,
               in_origin: int | None, health: int, inputs: tuple, fwd_seq: int | None, fields: tuple,
               summaries, where: tuple = (None, None, None), shown: str | None = None) -> tuple[int, int | None]:
        """The taint of execution ``seq``'s outputs; records the events it makes.

        ``fields`` and ``summaries`` (the run's summary fields, the outputs' summaries) count
        the infinities an origin made; ``where`` is (module id, stack id, forward op name) for
        an origin check_numerics may name later; ``shown`` names the op in origins and intended
        counts when that is not ``op`` (an op of a compiled graph by the op it was decomposed
        from: ``aten.where.self`` as ``aten.masked_fill.Scalar``).
        """
        if cls == ALLOC:
            self.template = (seq, in_taint, in_origin) if in_taint >= PENDING else None
        elif op in STORAGE_SETS and self.template is not None and inputs and inputs[0][0] == "op":
            t_seq, t_taint, t_origin = self.template
            if inputs[0][1] == t_seq and t_taint > in_taint:  # a deepcopy: a copy of the template
                cls, in_taint, in_origin = COPY, t_taint, t_origin
            self.template = None
        if in_taint == HARMFUL and cls != ALLOC and (health or cls == READ):
            # Passed on (a run that keeps making NaN does little else): the table's answer, and
            # only the count and the storm's pins to keep.
            self._state(seq, HARMFUL, in_origin)
            self._harmful(seq, step, op, in_origin, None, inputs, fwd_seq)
            self._training_reached(seq, step, op, in_origin, phase, param_write, fwd_seq)
            return HARMFUL, in_origin
        if in_taint == UNKNOWN and op in PARTIAL_WRITE_OPS and inputs and inputs[0][0] == "op" \
                and (st := self.states.get(inputs[0][1])) is not None and st[0] == UNKNOWN:
            cls = COPY  # rows written into garbage: the rest is garbage still (see PARTIAL_WRITE_OPS)
        taint, origin = propagate(cls, in_taint, in_origin, health, seq)
        if in_taint == PENDING and len(inputs) > 1:
            self._join(in_origin, inputs)
        if cls == VIEW and taint == HARMFUL and origin == seq and inputs and inputs[0][0] == "input":
            # A view of a tensor no recorded op made: a recording that began mid-run (the guard's
            # replay) never saw FSDP2 allocate its unsharded parameters, whose storage it frees and
            # allocates again outside any op, and views before the all-gather fills them: after a
            # NaN step, the allocator hands back its NaN. A view computes nothing: what it holds
            # is judged where something computes on it (a pending value, with this view as its
            # origin: "came from outside the recording"), and nowhere if it is overwritten first.
            taint = PENDING
        name = shown or op
        if cls == RENORM and in_taint == PENDING:
            o = self.origins.get(in_origin)
            if taint != FINITE and o is not None and o[1] in ("+inf", "±inf"):
                # A mask is -inf; a +inf is no mask, and softmax makes NaN of it (exp(inf - inf)):
                # what it outputs is the +inf's (MoCo's logits /= T with T = 0), not softmax's own.
                origin = in_origin
            elif health & NAN:
                # A fully masked row (a sequence of length 0): softmax's NaN is its own (the origin),
                # and the mask's -inf that made it are not intended
                self._harmed(in_origin)
            else:  # softmax took the mask's -inf
                self._absorbed(in_origin, name)
        reason = None
        # A view in the backward pass holds a forward value, not a gradient: the dispatch mode's
        # detach that unpacks an output autograd saved (scatter_reduce's -inf max of a node with
        # no incoming edge). What backward computes from it is judged where it is computed.
        # Nor is a value made in the backward pass from no recorded tensor (torchdiffeq's adjoint
        # solves an ODE in its backward with ``max_step = torch.as_tensor(inf)`` as a clamp bound):
        # a constant, harmful once a gradient is computed from it.
        if taint == PENDING and ((phase == "backward" and cls != VIEW) or phase == "optimizer" or param_write) and not (
                phase == "backward" and origin == seq and all(k[0] == "input" for k in inputs)):  # a constant
            taint = HARMFUL
            reason = "gradient" if phase == "backward" else "optimizer" if phase == "optimizer" else "parameter"
        elif taint == HARMFUL and in_taint != HARMFUL:
            reason = "read" if cls == READ else "nan"
        if taint == FINITE:
            if in_taint == PENDING and cls != RENORM:
                self._absorbed(in_origin, name)
            return FINITE, None
        if taint == UNKNOWN:
            self._state(seq, UNKNOWN, None)
            return UNKNOWN, None
        if origin == seq:
            self._born(seq, name, health, inf_values(fields, summaries) if health & (POS_INF | NEG_INF) else 0,
                       step, phase, where)
        elif taint == PENDING:  # derived from an origin still in use: keep it (least recently used goes)
            if origin in self.records:
                self.records[origin] = self.records.pop(origin)
            if origin in self.origins:
                self.origins[origin] = self.origins.pop(origin)
        self._state(seq, taint, origin)
        if taint == HARMFUL:
            self._harmful(seq, step, op, origin, reason, inputs, fwd_seq)
            self._training_reached(seq, step, op, origin, phase, param_write, fwd_seq)
        return taint, origin

    def _state(self, seq: int, taint: int, origin: int | None) -> None:
        states = self.states
        states[seq] = (taint, origin)
        if self.bounded and len(states) > STATES_MAX:
            del states[next(iter(states))]

    def _born(self, seq, op, health, values, step, phase, where) -> None:
        kind = kind_of(health)
        origins = self.origins
        origins[seq] = (op, kind, values, None, health & NAN != 0, step, phase, *where, None)
        if not health & NAN:
            self._group(kind, op, None, values, 1)
        if len(origins) > ORIGINS_MAX:
            gone = next(iter(origins))
            del origins[gone]
            self.joined.pop(gone, None)

    def _join(self, origin: int | None, inputs: tuple) -> None:
        """Remember the other pending origins among ``inputs`` beside ``origin``, the one their
        joined output carries."""
        states, named = self.states, self.named
        for kind, ref in inputs:
            if kind == "param" or kind == "buffer":
                ref = named.get(ref)
            elif kind != "op" and kind != WRITTEN:
                continue
            st = states.get(ref)
            other = st[1] if st is not None and st[0] == PENDING else None
            if other is None or other == origin or origin is None or other not in self.origins:
                continue
            joined = self.joined.get(origin, ())
            if other in joined:
                continue
            if len(joined) >= JOINED_MAX:  # forget the forgotten origins, else the oldest
                joined = tuple(o for o in joined if o in self.origins)[-(JOINED_MAX - 1):]
            self.joined[origin] = (*joined, other)

    def _group(self, kind, made_by, absorbed_by, values, n) -> None:
        g = self.groups.get((kind, made_by, absorbed_by))
        if g is None:
            g = self.groups[(kind, made_by, absorbed_by)] = [0, 0]
        g[0] += values
        g[1] += n
        self.changed = True

    def _absorbed(self, origin: int | None, op: str) -> None:
        """A pending inf went into an op whose output is finite: intended, absorbed by ``op``."""
        for other in self.joined.get(origin, ()):
            self._absorbed(other, op)  # joined origins come later: no cycle
        o = self.origins.get(origin)
        if o is None or o[4] or (o[3] is not None and o[3] not in CHECK_OPS) or o[3] == op:
            return
        self.origins[origin] = o[:3] + (op,) + o[4:]
        self._group(o[1], o[0], o[3], -o[2], -1)
        self._group(o[1], o[0], op, o[2], 1)

    def keep(self, rec: tuple) -> None:
        """Remember a pending record: its value may turn harmful later, and then the run needs it."""
        if not self.keep_records:
            return
        records = self.records
        records[rec[0]] = rec
        if len(records) > RECORDS_MAX:
            del records[next(iter(records))]

    # ------------------------------------------------------------------ sinks seen from outside the op
    def reached(self, seq: int, step: int, reason: str) -> tuple[int, int | None]:
        """The output of execution ``seq`` reached a sink after it was made (backward() was
        called on it, or the program read it): a pending value there becomes harmful."""
        st = self.states.get(seq)
        if st is not None and st[0] == HARMFUL and reason == "loss" and self.damage is None:
            self._damaged(seq, step, "?", st[1], "loss", None)  # a NaN reached the loss
        if st is None or st[0] != PENDING:
            return (st or (FINITE, None))
        origin = st[1]
        self.states[seq] = (HARMFUL, origin)
        rec = self.records.get(seq)
        self._harmful(seq, rec[1] if rec else step, rec[3] if rec else "?", origin, reason,
                      rec[8] if rec else (), rec[6] if rec else None, retro=True)
        if reason == "loss" and self.damage is None:
            self._damaged(seq, step, rec[3] if rec else "?", origin, "loss", None)
        return HARMFUL, origin

    def _training_reached(self, seq: int, step: int, op: str, origin: int | None, phase: str, param_write: bool,
                          fwd_seq: int | None) -> None:
        """A harmful output of a backward or optimizer op, or a parameter write: the first one is
        where a harmful value reached training."""
        if self.damage is None and (phase in ("backward", "optimizer") or param_write):
            self._damaged(seq, step, op, origin, "parameter" if param_write else
                          "gradient" if phase == "backward" else "optimizer", fwd_seq)

    def _damaged(self, seq: int, step: int, op: str, origin: int | None, reason: str, fwd_seq: int | None) -> None:
        """A harmful value reached training for the first time (see ``damage``): keep where, and
        the origin's record when it is not the first harmful value's (that chain is pinned)."""
        self.damage = {"seq": seq, "origin": origin, "reason": reason, "op": op, "step": step}
        self.changed = self.urgent = True
        if self.first is not None and origin == self.first["origin"]:
            return
        self.pins.append(seq)
        if fwd_seq is not None:
            self.pins.append(fwd_seq)
        if origin is not None:
            self.pins.append(origin)
            rec = self.records.get(origin)
            if rec is not None:
                self.pins += [ref for kind, ref in rec[8] if kind == "op"]

    def _harmful(self, seq, step, op, origin, reason, inputs, fwd_seq, retro=False) -> None:
        self.counted.append((step, op, seq))
        if reason is not None:  # passed on: already harmful
            self._harmed(origin)
        key = (step, op)
        if self.first is None:
            self.first = {"seq": seq, "origin": origin, "reason": reason, "op": op, "step": step}
            self.seen.add(key)
            self.changed = self.urgent = True
            self._pin_chain(seq, origin, inputs, fwd_seq, retro)
            return
        if retro and seq in self.records:  # the record was sent before it was harmful
            rec = self.records[seq]
            self.resend.append(rec[:11] + (HARMFUL, origin))
        if key not in self.seen and self.storm_pins < STORM_PINS:
            self.seen.add(key)
            self.storm_pins += 1
            self.pins.append(seq)
            if fwd_seq is not None:
                self.pins.append(fwd_seq)

    def _harmed(self, origin: int | None) -> None:
        """The values of ``origin`` (and of the origins joined with it) became harmful: no longer
        counted among the intended ones."""
        o = self.origins.get(origin)
        if o is None or o[4]:
            return
        self.origins[origin] = o[:4] + (True,) + o[5:]
        if o[1] != "nan":
            self._group(o[1], o[0], o[3], -o[2], -1)
        for other in self.joined.get(origin, ()):
            self._harmed(other)

    def _pin_chain(self, seq, origin, inputs, fwd_seq, retro) -> None:
        """Pin the first harmful value's execution, its producers and forward op, and every
        pending execution on its way back to the origin (sent again, now harmful)."""
        pins = self.pins
        pins.append(seq)
        if fwd_seq is not None:
            pins.append(fwd_seq)
        todo = [ref for kind, ref in inputs if kind == "op"]
        pins += todo
        if retro and seq in self.records:
            todo.append(seq)
        records, states = self.records, self.states
        done = set()
        while todo:
            s = todo.pop()
            if s in done:
                continue
            done.add(s)
            rec = records.get(s)
            if rec is None or rec[12] != origin or rec[11] == HARMFUL:
                continue
            rec = rec[:11] + (HARMFUL, origin)
            records[s] = rec
            self.resend.append(rec)
            if s in states:
                states[s] = (HARMFUL, origin)
            if s != seq:
                self.counted.append((rec[1], rec[3], s))
            producers = [ref for kind, ref in rec[8] if kind == "op"]
            pins.append(s)
            pins += producers
            if rec[6] is not None:
                pins.append(rec[6])
            if s != origin:
                todo += producers
        if origin is not None and origin not in done and origin in records:
            # The walk did not reach it: the value came through a buffer or parameter (an input by
            # name, not by producer) or a deepcopy's set_ of a new_empty. The origin is what the
            # report leads with; it may be far older than the circular buffer's window.
            rec = records[origin]
            if rec[11] != HARMFUL:
                rec = records[origin] = rec[:11] + (HARMFUL, origin)
                self.resend.append(rec)
                self.counted.append((rec[1], rec[3], origin))
            pins.append(origin)
            pins += [ref for kind, ref in rec[8] if kind == "op"]

    def backward_starts(self, fwd_seq: int | None, step: int) -> tuple[int, int | None]:
        """A backward pass starts at the autograd node of execution ``fwd_seq``: its output is
        the loss."""
        if fwd_seq is None:
            return FINITE, None
        return self.reached(fwd_seq, step, "loss")

    # ------------------------------------------------------------------ the writer's judge
    def judge(self, records: list, fields: tuple) -> tuple[list, list, list, list, dict]:
        """Taint the records the hot path did not: accelerator records on the writer's thread
        (their health arrived with the batch), the native core's as they are drained."""
        from trainguard.store._codec import health_of

        out = []
        states = self.states
        for rec in records:
            if len(rec) < 13 or rec[11] is not None:
                out.append(rec)
                self._last_phase = rec[2]
                continue
            seq, step, phase, op = rec[0], rec[1], rec[2], rec[3]
            if phase == "backward" and self._last_phase != "backward":
                self.backward_starts(rec[6], step)
            self._last_phase = phase
            health = rec[7]
            if health is None:  # device summaries: their health is known now
                health = 0
                if rec[10] and fields:
                    for values in rec[10]:
                        health |= health_of(fields, values)
            facts = self.op_classes.get(op)
            if facts is None:
                facts = self.resolve_op(op) if self.resolve_op is not None else (DEFAULT, False, False)
                self.op_classes[op] = facts
            cls, overwrite, inplace = facts
            in_taint, in_origin = FINITE, None
            ins = rec[8]
            fixed = None
            for i, (kind, ref) in enumerate(ins):
                if kind != "op":
                    if kind == "param" or kind == "buffer":
                        ref = self.named.get(ref)  # stored by name, judged by what it holds
                        if ref is None:
                            continue
                    elif kind != WRITTEN:
                        continue
                    else:
                        if fixed is None:
                            fixed = list(ins)
                        fixed[i] = ("op", ref)  # stored as any producer is
                if not states or (i == 0 and overwrite):
                    continue
                st = states.get(ref)
                if st is None or (kind == WRITTEN and st[0] == UNKNOWN):  # uninitialised no more
                    continue
                if st[0] < PENDING and kind != "op" and kind != WRITTEN:
                    continue  # a parameter or buffer passes on only a pending or harmful value
                if st[0] > in_taint or (st[0] == in_taint and st[1] is not None
                                        and (in_origin is None or st[1] < in_origin)):
                    in_taint, in_origin = st
            if fixed is not None:
                rec = rec[:8] + (tuple(fixed),) + rec[9:]
            into = self.view_of_model_state(seq, cls, inplace, ins)
            param_write = into is not None or writes_model_state(op, inplace, rec[8], len(rec[9]))
            if in_taint == UNKNOWN and (cls == VIEW or cls == COPY) and rec[10]:
                # A view or copy of uninitialised memory: no evidence, whatever its bytes hold (as
                # the hot path summarises it; a native or accelerator summary read the bytes).
                rec = rec[:10] + (tuple(unknown_values(fields, m[1]) for m in rec[9]),) + rec[11:]
                health = 0
            taint, origin = FINITE, None
            if health or in_taint or cls == ALLOC:
                taint, origin = self.settle(seq, step, phase, op, cls, param_write, in_taint, in_origin, health,
                                            rec[8], rec[6], fields, rec[10], (rec[4], rec[5], None))
            if inplace and ins and (ins[0][0] == "param" or ins[0][0] == "buffer"):
                if taint >= PENDING:
                    self.named[ins[0][1]] = seq
                else:
                    self.named.pop(ins[0][1], None)
            elif into is not None and taint >= PENDING:
                self.named[into[1]] = seq  # (a finite write into part of it leaves the rest as it was)
            rec = rec[:7] + (health,) + rec[8:11] + (taint, origin)
            if taint == PENDING:
                self.keep(rec)
            out.append(rec)
        pins, resend, counts, _ = self.take()
        return out, pins, resend, counts, self.meta()

    def view_of_model_state(self, seq: int, cls: int, inplace: bool, ins) -> tuple[str, str] | None:
        """Follow views of parameters and buffers: for an in-place op writing into one, the
        parameter's input entry (``("param", name)``); None otherwise."""
        if not ins:
            return None
        kind, ref = ins[0]
        if kind == "op" or kind == WRITTEN:
            entry = self.param_views.get(ref)
            if entry is None and inplace and self.find_record is not None:
                entry = self._view_in_batch(ref)
        elif kind == "param" or kind == "buffer":
            entry = (kind, ref)
        else:
            return None
        if entry is None:
            return None
        if cls == VIEW:
            views = self.param_views
            views[seq] = entry
            if len(views) > PARAM_VIEWS_MAX:
                del views[next(iter(views))]
            return None
        return entry if inplace and kind != "param" and kind != "buffer" else None

    def _view_in_batch(self, seq: int) -> tuple[str, str] | None:
        """The parameter or buffer that the record ``seq`` of the batch being judged is a view of
        (through views: ``weight[1][2]``), or None."""
        for _ in range(8):
            rec = self.find_record(seq) if self.find_record is not None else None
            if rec is None or len(rec) < 9 or not rec[8]:
                return None
            facts = self.op_classes.get(rec[3])
            if facts is None:
                facts = self.resolve_op(rec[3]) if self.resolve_op is not None else (DEFAULT, False, False)
                self.op_classes[rec[3]] = facts
            if facts[0] != VIEW:
                return None
            kind, ref = rec[8][0]
            if kind == "param" or kind == "buffer":
                return (kind, ref)
            if kind != "op" and kind != WRITTEN:
                return None
            seq = ref
        return None

    # ------------------------------------------------------------------ hand-over
    def take(self) -> tuple[list, list, list, bool]:
        """(pins, records to resend, harmful counts as (step, op, count, first seq), urgent)
        gathered since the last call. Safe against appends from the judging thread."""
        n = len(self.pins)
        pins = self.pins[:n]
        del self.pins[:n]
        n = len(self.resend)
        resend = self.resend[:n]
        del self.resend[:n]
        n = len(self.counted)
        counted = self.counted[:n]
        del self.counted[:n]
        agg: dict[tuple[int, str], list] = {}
        for step, op, seq in counted:
            a = agg.get((step, op))
            if a is None:
                agg[(step, op)] = [1, seq]
            else:
                a[0] += 1
                a[1] = min(a[1], seq)
        urgent, self.urgent = self.urgent, False
        return pins, resend, [(s, op, n, f) for (s, op), (n, f) in agg.items()], urgent

    def meta(self) -> dict:
        """The run metadata that changed since the last call: first_harm, intended."""
        if not self.changed:
            return {}
        self.changed = False
        out = {"intended": self.intended()}
        if self.first is not None:
            out["first_harm"] = dict(self.first)
            # None: nothing harmful reached training (yet); a run without the key predates it
            out["first_damage"] = dict(self.damage) if self.damage is not None else None
        return out

    def intended(self) -> list[dict]:
        """Infinities never harmful: by kind, the op that made them and the one that absorbed them."""
        # list(): one C-level copy, safe while the judging thread adds a group (flush may run on
        # the writer's thread when the program stopped making ops)
        rows = [{"kind": k, "made_by": m, "absorbed_by": a, "values": v, "executions": n}
                for (k, m, a), (v, n) in list(self.groups.items()) if n > 0]
        rows.sort(key=lambda r: (r["absorbed_by"] is None, -r["executions"], -r["values"]))
        return rows

    def prune(self, live: set[int]) -> None:
        """Forget the states of tensors that died (the recorder calls this each step)."""
        self.states = {k: v for k, v in self.states.items() if k in live}


def unknown_values(fields: tuple, shape) -> tuple[float, ...]:
    """The summary of ``shape``'s values nobody can read (``capture._summary.unknown_summary``)."""
    if not fields or fields[0] != "size":
        return (0.0,) * len(fields)
    n = 1
    for d in shape:
        n *= d
    return (float(n),) + (float("nan"),) * (len(fields) - 1)


def inf_values(fields: tuple, summaries) -> int:
    """How many +-inf the outputs hold, from their summaries (0 when the mode does not count)."""
    if not summaries or not fields or "pos_inf" not in fields:
        return 0
    i, j = fields.index("neg_inf"), fields.index("pos_inf")
    total = 0
    for s in summaries:
        if isinstance(s, tuple) and len(s) > j and s[i] == s[i] and s[j] == s[j]:
            total += int(s[i]) + int(s[j])
    return total
