"""Gradients, weights, updates and learning rates, as the monitor reads them around the update.

When the gradients are read (always after the last ``backward()`` of the step, before the
update and before clipping, so the norm is the one frameworks log):

- with an optimizer: at the first of ``clip_grad_norm_``/``clip_grad_value_``/
  ``clip_grads_with_norm_``, the end of the first call of a closure passed to
  ``optimizer.step(closure)``, a framework's "before optimizer step" callback, or
  ``optimizer.step()`` itself. Each parameter is read once per step (a GAN's
  two optimizers each read theirs).
- with no optimizer known yet (the first step of any loop, or a loop that updates by hand):
  after every ``backward()``, each reading replacing the last, so gradient accumulation ends up
  with the complete gradients.

Every step: the squared norm of the gradients read (summed into the global norm). A DTensor's
gradient (FSDP2) is read from this rank's shard, so that norm is this rank's part only; the
squares of those shards, each divided by how many ranks hold it, are also kept
(``grad_sq_sharded``), beside the squares of the plain gradients (``grad_sq_plain``, the same on
every rank): the plain part plus every rank's sharded part is the job's squared norm, which the
merged reader computes (store/_ranked), with no collective here. At recording
steps also, per parameter: gradient statistics, whether it has a gradient and is in an optimizer,
its weight norm before the update, its update norm and update-to-weight ratio (from a copy taken
just before the update), and whether its gradient was stale when the step's first gradient
arrived (``zero_grad`` missing). All values stay on the device until the monitor ships them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainguard.capture._layer_stats import grad_stats, histogram, sparse_values, squared_norm_sum
from trainguard.capture._local import holders, local
from trainguard.capture._monitor_model import Param, is_lazy
from trainguard.capture._monitor_ship import Shipper


def _stack32(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t if t.dtype == torch.float32 else t.float() for t in ts])


def _ratio(row: int, v: list[float]) -> list[float]:
    """(update norm, weight norm before it) -> (update norm, update / weight); a zero weight gives inf or nan."""
    return _ratio1(v)


def _ratio1(v: list[float]) -> list[float]:
    u, w = v
    return [u, u / w if w else (math.inf if u else math.nan)]


class _Reading:
    """What one step's gradient readings produced, committed to the shipper when the step ends."""

    __slots__ = ("sq", "sharded", "dtensor", "stats", "consts", "wnorm")

    def __init__(self) -> None:
        self.sq: list[torch.Tensor] = []
        self.sharded: list[torch.Tensor] = []  # squares of DTensor shards / their holders (see above)
        self.dtensor: list[torch.Tensor] = []  # squares of DTensor shards (in ``sq`` too)
        self.stats: list[tuple] = []
        self.consts: list[tuple] = []
        self.wnorm: dict[int, torch.Tensor] = {}  # id(Param) -> weight norm before the update


def orthogonalises(opt: torch.optim.Optimizer, group: dict, state: dict | None = None) -> bool:
    """Whether ``opt`` orthogonalises the updates of ``group``'s parameters (Muon): their size is
    then set by the learning rate, whatever the gradient's scale. ``torch.optim.Muon`` and
    Keller Jordan's ``Muon`` orthogonalise every group; optimizers that pair Muon with AdamW say
    which groups are Muon's (``use_muon`` in ``MuonWithAuxAdam``, ``kind="muon"`` in nanochat's
    ``MuonAdamW``), or which parameters, in their state once they stepped (``state["use_muon"]``
    in timm's ``Muon``, which sends by shape a bias, a ``pos_embed`` of ``[1, N, D]`` or a depthwise
    conv's ``[C, 1, k, k]`` weight to its AdamW fallback); ``state`` is a parameter's."""
    if "muon" not in type(opt).__name__.lower():
        return False
    if state and "use_muon" in state:
        return bool(state["use_muon"])
    if "use_muon" in group:
        return bool(group["use_muon"])
    if "kind" in group:
        return str(group["kind"]).lower() == "muon"
    return True


# Optimizers that, given a sparse gradient, change only the rows it or their own sparse state
# holds (SGD's momentum buffer is sparse then, and keeps moving the rows of earlier steps). Any
# other optimizer may change any row (a subclass too): its tables are copied whole.
_ROW_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


class _Rows:
    """The rows of a table that one update can change, copied before it: an embedding table with a
    sparse gradient (``nn.EmbeddingBag(sparse=True)``) changes only in the rows its batch looked up,
    and copying the table (most of a recommender's memory) to measure that doubled its memory at
    every recording. The rows stay in sorted order with their duplicates (one per lookup), which
    are masked out of the norm: no host sync, as ``sparse_values``."""

    __slots__ = ("index", "first", "old", "weight_norm")

    def __init__(self, index: torch.Tensor, first: torch.Tensor, old: torch.Tensor, weight_norm: torch.Tensor):
        self.index, self.first, self.old, self.weight_norm = index, first, old, weight_norm

    @classmethod
    def of(cls, opt: torch.optim.Optimizer | None, t: torch.Tensor) -> _Rows | None:
        """The rows of ``t`` that ``opt.step()`` can change, copied; None when that is not known.
        With no optimizer (an update by hand, or the first step's reading before the optimizer is
        known), the rows of the gradient: ``weight.data.add_(weight.grad, alpha=-lr)``."""
        g = t.grad
        if (opt is not None and type(opt) not in _ROW_OPTIMIZERS or g is None or g.layout != torch.sparse_coo
                or g.sparse_dim() != 1 or type(t.data) is not torch.Tensor):
            return None
        rows = [g._indices()[0]]
        for v in opt.state.get(t, {}).values() if opt is not None else ():
            if isinstance(v, torch.Tensor) and v.shape == t.shape:
                if v.layout == torch.sparse_coo and v.sparse_dim() == 1:
                    rows.append(v._indices()[0])
                elif type(opt) is torch.optim.SGD:
                    return None  # a dense momentum buffer (from dense gradients earlier) moves every row
        index = torch.sort(torch.cat(rows) if len(rows) > 1 else rows[0]).values
        first = torch.ones_like(index, dtype=torch.bool)
        first[1:] = index[1:] != index[:-1]
        w = t.detach()
        return cls(index, first, w.index_select(0, index), torch.linalg.vector_norm(w))

    def update_norm(self, now: torch.Tensor) -> torch.Tensor:
        d = now.index_select(0, self.index).sub_(self.old)
        d.mul_(self.first.view(-1, *[1] * (d.dim() - 1)))  # each row once
        return torch.linalg.vector_norm(d)


def _copies(opt: torch.optim.Optimizer | None, ts: list[torch.Tensor]) -> list[torch.Tensor | _Rows]:
    """Copies of ``ts`` before ``opt`` (None: the loop's own code) updates them: the rows it can
    change of a table with a sparse gradient, the whole tensor otherwise."""
    copies: list = [_Rows.of(opt, t) for t in ts]
    whole = [i for i, c in enumerate(copies) if c is None]
    if whole:
        for i, c in zip(whole, torch._foreach_mul([local(ts[i]).detach() for i in whole], 1.0)):
            copies[i] = c
    return copies


class GradientWatch:
    def __init__(self, out: Shipper, wants_hist: Callable[[str], bool], bins: int):
        self.out = out
        self.wants_hist = wants_hist
        self.bins = bins
        self.saw_optimizer = False
        self.optimizer_had_state = False  # the first optimizer step found momentum/Adam state: not a fresh run
        # The first optimizer's groups carried no "initial_lr" at its steps: no torch (or timm) LR
        # scheduler, which both add it, owns its rates; the loop writes them (llama2.c's get_lr(it)).
        self.lr_by_hand: bool | None = None
        self._opt_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._opt_index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._routed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Muon -> times its choices were read
        self._opt_params: set[int] = set()  # ids of the parameters some optimizer owns
        self.trainable: set[int] = set()  # ids of the Params an optimizer updated while they required grad
        # id(Param) -> (optimizer class, orthogonalises, its group's weight decay or None)
        self.updaters: dict[int, tuple[str, bool, float | None]] = {}
        # id(Param) -> the steps it had a gradient in, recorded or not: an expert of a mixture that
        # tokens reach only between recordings did get gradients
        self.gradient_steps: dict[int, int] = {}
        self._hooks: list = []
        # id(Param) -> (Param, step, stale flag, the .grad it was read from): a stale gradient of a
        # parameter an optimizer holds, until that optimizer steps (see _stale)
        self._stale_pending: dict[int, tuple[Param, int, torch.Tensor, torch.Tensor]] = {}
        self._reset()

    def _reset(self) -> None:
        self._seen: set[int] = set()  # parameters whose gradient this step has been read
        self._had: set[int] = set()  # parameters with a gradient this step
        self._stale_seen: set[int] = set()
        self._reading = _Reading()
        self._tentative = False
        self._lrs: dict[str, Any] = {}
        self._snap: dict[int, tuple[list[Param], list[torch.Tensor]]] = {}
        self._manual_snap: tuple[list[Param], list[torch.Tensor]] | None = None
        self._stepped = False  # a watched optimizer updated this step

    @property
    def tentative(self) -> bool:
        """The step's reading was made after a backward() and no optimizer has read since."""
        return self._tentative

    def settle(self) -> None:
        """The tentative reading is the step's: later readings add parameters, never replace it."""
        self._tentative = False

    @property
    def active(self) -> bool:
        """Something was read or updated this step."""
        return bool(self._seen or self._stepped or self._snap)

    def forget_optimizers(self) -> None:
        """The watched parameters changed (a model was attached): recompute optimizer membership."""
        self._opt_cache = weakref.WeakKeyDictionary()

    def rebound(self, moved: list[Param]) -> None:
        """``moved`` now point at other tensors (see _monitor_model.rebind): what was known of the old
        ones (the optimizer that held them, their norm this step) is not theirs."""
        self.forget_optimizers()
        for p in moved:
            self.updaters.pop(id(p), None)
            self._reading.wnorm.pop(id(p), None)

    def params_in(self, opt: torch.optim.Optimizer, params: list[Param]) -> list[Param]:
        """The watched parameters ``opt`` updates (cached while its groups keep their sizes)."""
        sig = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self._opt_cache.get(opt)
        if hit is not None and hit[0] == sig:
            return hit[1]
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        self._opt_params |= ids
        mine = [p for p in params if p.ref() is not None and id(p.ref()) in ids]
        orth = {id(p): orthogonalises(opt, g, opt.state.get(p)) for g in opt.param_groups for p in g["params"]}
        decay = {id(p): _decay(g) for g in opt.param_groups for p in g["params"]}
        for p in mine:
            self.updaters[id(p)] = (type(opt).__name__, orth[id(p.ref())], decay[id(p.ref())])
        self._opt_cache[opt] = (sig, mine)
        if mine and opt not in self._opt_index:  # an optimizer of no watched parameter (SAC's log_ent_coef) has none
            if not self._opt_index:  # asked before its first update: state means a trained model
                self.optimizer_had_state = any(len(s) for s in opt.state.values())
            self._opt_index[opt] = len(self._opt_index)
        return mine

    # ------------------------------------------------------------------ reading gradients
    def read(self, params: list[Param], step: int, recording: bool, *, tentative: bool = False,
             snapshot: bool = False) -> None:
        """Read the gradients of ``params``.

        ``tentative``: after a ``backward()`` with no optimizer known, the reading supersedes every
        earlier one of the step (accumulation: the latest is the most complete) and is itself
        superseded by the first reading at an optimizer (after ``GradScaler`` unscaled, say);
        ``snapshot`` then also copies the weights at recording steps, to measure an update made
        by hand. Otherwise only parameters not read yet this step are read.
        """
        if tentative or self._tentative:
            self._reading = _Reading()
            self._seen = set()
        if tentative:
            self._manual_snap = None
        self._tentative = tentative
        buf = self._reading
        grads, owners, sizes = [], [], []
        shards: dict[int, list[torch.Tensor]] = {}  # holders -> DTensor shards
        for p in params:
            key = id(p)
            if key in self._seen:
                continue
            self._seen.add(key)
            t = p.ref()
            if t is None:
                continue
            g = t.grad
            n = None
            if g is not None:
                n = holders(g)
                g = local(g)  # FSDP2: this rank's shard (see _local)
            if recording:
                buf.consts.append((step, p.name, "gradient", "present", 0.0 if g is None else 1.0))
            if g is not None:
                self._had.add(key)
            if g is None or not g.numel():  # an empty shard says nothing about its parameter
                continue
            size = g.numel()
            if g.is_sparse:  # nn.Embedding(sparse=True): its stored values, duplicates summed
                g = sparse_values(g)
                if g is None:
                    continue
            if n is not None:
                shards.setdefault(n, []).append(g.detach())
            grads.append(g.detach())
            owners.append(p)
            sizes.append(size)
        if not grads:
            return
        with torch.no_grad():
            for n, gs in shards.items():
                sq = squared_norm_sum(gs)
                buf.dtensor.append(sq)
                if n:  # (partial sums, n == 0, add up to no norm: left out)
                    buf.sharded.append(sq if n == 1 else sq / n)
            if not recording:
                buf.sq.append(squared_norm_sum(grads))
                return
            by_dev: dict[torch.device, list[int]] = {}
            for i, g in enumerate(grads):
                by_dev.setdefault(g.device, []).append(i)
            for idx in by_dev.values():
                gs = [grads[i] for i in idx]
                mat, names, l2 = grad_stats(gs)
                buf.sq.append(squared_norm_sum(gs, l2))
                n_of = [max(sizes[i], 1) for i in idx]  # a sparse gradient's implicit zeros count

                def finish(r: int, v: list[float], n_of=n_of) -> list[float]:
                    return [v[0] / n_of[r], v[1], v[2], v[3]]  # L1 norm -> mean |g|

                layers = [owners[i].name for i in idx]
                buf.stats.append((("m", layers, "gradient", tuple(names), step, finish), mat.reshape(-1)))
            for p, g in zip(owners, grads):
                if self.wants_hist(p.name):
                    buf.stats.append((("h", p.name, "gradient", step), histogram(g, self.bins)))
            weights = [local(p.ref()).detach() for p in owners]
            for p, n in zip(owners, torch._foreach_norm(weights)):
                buf.wnorm[id(p)] = n  # before the update: the "initial" weights are the initial ones
            if tentative and snapshot:
                self._manual_snap = (owners, _copies(None, [p.ref() for p in owners]))

    def snapshot(self, opt: torch.optim.Optimizer, params: list[Param]) -> None:
        """Copy the weights ``opt`` is about to change (recording steps): the update is new - old.
        Of a table whose gradient is sparse, only the rows the step can change (see ``_Rows``)."""
        # An optimizer updates this step: the copy taken after backward() for an update by hand
        # (the first step, before any optimizer was seen) is never read; holding it while the
        # optimizer's copy is made doubled the weights' memory at the first recording.
        self._manual_snap = None
        live = [(p, p.ref()) for p in params]
        live = [(p, t) for p, t in live if t is not None and not t.is_sparse and local(t).numel()]
        if live:
            with torch.no_grad():
                self._snap[id(opt)] = ([p for p, _ in live], _copies(opt, [t for _, t in live]))

    def after(self, opt: torch.optim.Optimizer, step: int) -> None:
        """After ``opt.step()``: its learning rates, and the updates against the snapshot."""
        self._stepped = True
        k = self._opt_index.get(opt, 0)
        if k == 0 and self.lr_by_hand is not False:
            self.lr_by_hand = not any("initial_lr" in g for g in opt.param_groups)
        for gi, g in enumerate(opt.param_groups):
            lr = g.get("lr")
            if lr is None:
                continue
            if isinstance(lr, torch.Tensor):
                lr = lr.detach().reshape(-1)[0].clone()
            self._lrs[f"lr/{gi}" if k == 0 else f"lr/{k}.{gi}"] = lr
        if self._routed.get(opt, 0) < 10 and "muon" in type(opt).__name__.lower():
            self._route(opt)
        snap = self._snap.pop(id(opt), None)
        if snap is not None:
            self._updates(snap, step)

    def _route(self, opt: torch.optim.Optimizer) -> None:
        """After a Muon's step: the choice it made per parameter and keeps in its state (timm's
        ``state["use_muon"]``), read once every watched parameter has one."""
        hit = self._opt_cache.get(opt)
        if hit is None:
            return
        self._routed[opt] = self._routed.get(opt, 0) + 1  # parameters that never get a gradient: 10 tries
        done = True
        for p in hit[1]:
            t = p.ref()
            st = opt.state.get(t) if t is not None else None
            if not st or "use_muon" not in st:
                done = False  # no gradient yet: asked again after the next step
                continue
            if id(p) in self.updaters:
                name, _, decay = self.updaters[id(p)]
                self.updaters[id(p)] = (name, bool(st["use_muon"]), decay)
        if done or not any("use_muon" in st for st in opt.state.values() if isinstance(st, dict)):
            self._routed[opt] = 10  # all read, or a Muon that keeps no such choice: never asked again

    def _updates(self, snap: tuple[list[Param], list], step: int) -> None:
        ps, old = snap
        now = [p.ref() for p in ps]
        if any(t is None for t in now):
            return
        with torch.no_grad():
            whole = [i for i, c in enumerate(old) if not isinstance(c, _Rows)]
            un: list = [None] * len(ps)
            wn: list = [None] * len(ps)
            if whole:
                copies = [old[i] for i in whole]
                for i, n in zip(whole, torch._foreach_norm(copies)):
                    wn[i] = n
                # the snapshot becomes -update: no second copy
                torch._foreach_sub_(copies, [local(now[i]).detach() for i in whole])
                for i, n in zip(whole, torch._foreach_norm(copies)):
                    un[i] = n
            for i, c in enumerate(old):
                if isinstance(c, _Rows):
                    un[i], wn[i] = c.update_norm(now[i].detach()), c.weight_norm
            if len({u.device for u in un}) == 1:
                mat = torch.stack([_stack32(un), _stack32(wn)], dim=1).reshape(-1)
                self.out.stats.append((("m", [p.name for p in ps], "update", ("norm", "ratio"), step, _ratio), mat))
            else:
                for p, u, w in zip(ps, un, wn):
                    vec = torch.stack([u.float(), w.float()])
                    self.out.stats.append((("l", p.name, "update", ("norm", "ratio"), step, _ratio1, 2), vec))

    # ------------------------------------------------------------------ stale gradients
    def hook_params(self, params: list[Param], step_of: Callable[[], int]) -> None:
        """At recording steps: the first gradient a ``backward()`` brings to a parameter checks what .grad still holds."""
        for p in params:
            t = p.ref()
            if t is not None and t.requires_grad and not is_lazy(t):  # a lazy one is hooked once materialised
                self._hooks.append(t.register_hook(self._make_hook(p, step_of)))

    def unhook_params(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _make_hook(self, p: Param, step_of: Callable[[], int]):
        from trainguard.capture import _monitor_tap
        from trainguard.capture._compile import keep_dynamo_out
        from trainguard.capture._monitor_tap import quiet

        def hook(grad):
            if not _monitor_tap._in_backward:
                # torch.autograd.grad (a MAML inner step over the parameters themselves) hands the
                # gradient back and leaves .grad alone: what .grad holds is no accumulation
                return
            with quiet():
                self._stale(p, step_of())

        keep_dynamo_out(hook)
        return hook

    def _stale(self, p: Param, step: int) -> None:
        key = id(p)
        if key in self._stale_seen:
            return
        self._stale_seen.add(key)
        t = p.ref()
        if t is None:
            return
        held = t.grad
        prior = local(held) if held is not None else None
        if prior is None:
            self.out.consts.append((step, p.name, "gradient", "stale", 0.0))
            return
        if prior.layout == torch.sparse_coo:  # nn.EmbeddingBag(sparse=True): the values it stores
            prior = prior._values()  # (none after zero_grad(set_to_none=False))
        flag = prior.ne(0).any().to(torch.float32).reshape(1)
        if id(t) in self._opt_params:
            # Stale only if the optimizer that holds it steps on this very .grad: cleanrl's SAC adds
            # the actor's loss to the critics' .grad after q_optimizer stepped, and
            # q_optimizer.zero_grad() drops it before the critics' next update (a new tensor then;
            # zero_grad(set_to_none=False) zeroes in place and still counts as stale).
            self._settle_stale(self._stale_pending.pop(key, None), applied=False)
            self._stale_pending[key] = (p, step, flag, held)
            return
        self.out.stats.append((("l", p.name, "gradient", ("stale",), step), flag))

    def stale_applied(self, params: list[Param]) -> None:
        """An optimizer is about to update ``params``: the stale gradients read of them count if
        it steps on them."""
        if not self._stale_pending:
            return
        for p in params:
            entry = self._stale_pending.pop(id(p), None)
            if entry is not None:
                t = p.ref()
                self._settle_stale(entry, applied=t is not None and t.grad is entry[3])

    def settle_stale(self) -> None:
        """The run ends: gradients no optimizer stepped on were never applied."""
        for entry in list(self._stale_pending.values()):
            self._settle_stale(entry, applied=False)
        self._stale_pending.clear()

    def _settle_stale(self, entry: tuple | None, *, applied: bool) -> None:
        if entry is None:
            return
        p, step, flag, _ = entry
        if applied:
            self.out.stats.append((("l", p.name, "gradient", ("stale",), step), flag))
        else:
            self.out.consts.append((step, p.name, "gradient", "stale", 0.0))

    # ------------------------------------------------------------------ end of a step
    def finish(self, params: list[Param], step: int, recording: bool) -> dict[str, Any]:
        """The step's scalars (global gradient norm, learning rates); weights and updates at recording steps."""
        if self.saw_optimizer:
            # Gradients no optimizer took: parameters missing from every optimizer.
            rest = [p for p in params if id(p) not in self._seen]
            if rest:
                self.read(rest, step, recording)
        buf = self._reading
        values: dict[str, Any] = {}
        if buf.sq:
            with torch.no_grad():
                total = buf.sq[0] if len(buf.sq) == 1 else torch.stack(buf.sq).sum()
                values["grad_norm"] = total.sqrt()
                if buf.dtensor:
                    sharded = torch.stack(buf.sharded).sum() if buf.sharded else torch.zeros_like(total)
                    values["grad_sq_sharded"] = sharded
                    values["grad_sq_plain"] = (total - torch.stack(buf.dtensor).sum()).clamp(min=0)
        self.out.stats.extend(buf.stats)
        self.out.consts.extend(buf.consts)
        values.update(self._lrs)
        if recording:
            if self.saw_optimizer:
                for p in params:
                    t = p.ref()
                    if t is not None:
                        flag = 1.0 if id(t) in self._opt_params else 0.0
                        self.out.consts.append((step, p.name, "gradient", "in_optimizer", flag))
            self._weights(params, step, buf.wnorm)
            if self._manual_snap is not None and not self._stepped:
                self._updates(self._manual_snap, step)  # an update made by hand (no optimizer)
        for key in self._had:
            self.gradient_steps[key] = self.gradient_steps.get(key, 0) + 1
        self._reset()
        return values

    def _weights(self, params: list[Param], step: int, known: dict[int, torch.Tensor]) -> None:
        live = [(p, p.ref()) for p in params]
        live = [(p, t) for p, t in live if t is not None and not t.is_sparse and local(t).numel()]
        if not live:
            return
        with torch.no_grad():
            todo = [local(t).detach() for p, t in live if id(p) not in known]
            computed = iter(torch._foreach_norm(todo) if todo else [])
            norms = [known[id(p)] if id(p) in known else next(computed) for p, _ in live]
            by_dev: dict[torch.device, list[int]] = {}
            for i, n in enumerate(norms):
                by_dev.setdefault(n.device, []).append(i)
            for idx in by_dev.values():
                vec = _stack32([norms[i] for i in idx])
                self.out.stats.append((("m", [live[i][0].name for i in idx], "weight", ("norm",), step), vec))
            for p, t in live:
                self.out.consts.append((step, p.name, "weight", "requires_grad", 1.0 if t.requires_grad else 0.0))
                if self.wants_hist(p.name):
                    self.out.stats.append((("h", p.name, "weight", step), histogram(local(t), self.bins)))


# How many parameters' gradients tell that a hand-written loop moved on to its next step.
_PENDING_REFS = 4


def pending_refs(params: list[Param]) -> list | None:
    """What the end of a step without an optimizer is recognised by: a few parameters with a gradient,
    the gradient object, and both version counters (host-side attributes, no device read)."""
    refs = []
    for p in params:
        t = p.ref()
        g = t.grad if t is not None else None
        if g is not None:
            refs.append((p.ref, weakref.ref(g), t._version, g._version))
            if len(refs) >= _PENDING_REFS:
                break
    return refs or None


def replaced(refs: list) -> bool:
    """A gradient read after the last backward() is another tensor now: assigned anew, not changed in
    place (``GradScaler.unscale_`` and clipping change them in place; Opacus' DPOptimizer assigns its
    clipped, noised sum)."""
    for pref, gref, _, _ in refs:
        t = pref()
        if t is not None and t.grad is not None and t.grad is not gref():
            return True
    return False


def used(refs: list) -> bool:
    """The gradients read after the last backward() were applied: cleared (``zero_grad``), replaced,
    zeroed or clipped in place, or the parameter changed in place. A loop that accumulates over
    several backward() calls touches none of these in between."""
    for pref, gref, pver, gver in refs:
        t = pref()
        if t is None:
            continue
        g = t.grad
        if g is None or g is not gref() or t._version != pver or g._version != gver:
            return True
    return False


def _decay(group: dict) -> float | None:
    """A parameter group's weight decay (``weight_decay``, as torch's optimizers name it), or None."""
    v = group.get("weight_decay")
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None
