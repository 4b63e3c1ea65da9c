"""Train/validation leakage, watched live: signatures of sampled input rows in each mode.

Every forward of a watched model hashes up to ``ROWS_PER_FORWARD`` rows of its first tensor input
into a signature: ``FEATURES`` fixed positions of the flattened row, projected on ``DIMS`` random
directions (a Johnson-Lindenstrauss sketch: rows far apart stay far apart, copies coincide). The
signatures go into preallocated buffers on the input's device (training and evaluation rows
apart, ``TRAIN_ROWS`` and ``EVAL_ROWS`` at most), so a forward costs a gather, a small matmul and
a copy, with no host sync; once a buffer is full that mode costs nothing more.

When the monitor closes, :func:`LeakWatch.summary` finds each evaluation row's nearest training
row (on the buffers' device, in chunks) and stores the distances that are small relative to the
typical distance between rows: exact copies have a relative distance near 0, near copies (a
re-encoded or slightly noised sample) a few percent, unrelated rows about 1. The diagnosis
(``train_val_leakage``) judges them.

Evaluation batches are grouped into passes by where the script ran the forward (the chain of its
own frames, as the validation loss groups them by the loss call): karpathy/makemore evaluates the
training set and then the test set through one ``evaluate()`` called from two lines. The last
pass to start in an evaluation (between two training forwards) is the validation, as for
``val_loss``; the rows of the passes before it are marked so, and the diagnosis leaves them out:
an evaluation of the training data, of which the run has trained on only part so far (batches
drawn with replacement), is neither all copies nor leakage.
A pass whose frames name the training split (see ``pass_key``) is never the validation, one that
names a validation split always is: nanoGPT evaluates its train split, then its val split, from
one line.

Integer inputs (token ids, category codes) have no distance: a name one letter longer than a
training name ("adriana", "adrian") differs from it by 1 in one position, a few percent of the
typical distance, yet it is another sample. Their batches are marked ``exact_only`` and the
diagnosis counts only exact copies there.

A validation set is usually evaluated again and again (every epoch): a validation row whose
signature equals an earlier validation row's is that sample again (``seen_before``), and its
copy of a training row is counted once, so that one duplicate in a validation set evaluated
four times is not four copies (the diagnosis lets one or two pass as chance).

A recurrent model's batches are often time-major (``[src len, batch]``, torch's RNN default and
torchtext's): their first dimension's rows are time steps, the first all <sos> and the last
mostly <pad> in every batch, which read as copies. :func:`samples_first` puts the samples first
(for that batch and, the model's layout being fixed, every later one of the same model)
when another integer input of the forward says the second dimension is the batch's: a 1-D tensor
of that size whose largest value is the padded length (the lengths ``pack_padded_sequence`` takes,
on the CPU), or a ``[trg len, batch]`` target.

Only a model fed with data is hashed. A watched model whose training input was computed with
autograd (another watched model's output) is fed activations, which are no samples: PyG's
link-prediction example calls ``model.encode`` (``conv2(conv1(x).relu())``), never ``forward``,
so ``trainguard run --monitor`` finds the two convolutions as two models, and the second one's
input rows, the hidden features of the whole graph, are evaluated in every pass as they are
trained on (a ``train_val_leakage`` warning on a healthy run). Such a model (``forget``) is left
out, its rows hashed before it was known included.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.capture._monitor_eval import TRAIN_SPLITS, VAL_SPLITS, pass_key, split_of
from trainguard.capture._monitor_tap import quiet

ROWS_PER_FORWARD = 1024
FEATURES = 256  # positions of a row that enter its signature
DIMS = 32  # signature length
TRAIN_ROWS = 32768
EVAL_ROWS = 4096
MIN_FEATURES = 4  # rows of fewer values (a scalar regression input) repeat by chance
MAX_SHAPES = 4  # distinct row lengths hashed (variable-length inputs: the first few)
KEEP_BELOW = 0.2  # relative distances stored for the diagnosis (unrelated rows are near 1)
_CHUNK = 512
_PAIRS = 64  # training rows each evaluation row is compared with for its typical distance


class _Sketch:
    """The projection and buffers for one row length on one device."""

    def __init__(self, width: int, device: torch.device, exact_only: bool = False):
        self.exact_only = exact_only  # integer rows: only an exact copy is a copy
        g = torch.Generator().manual_seed(0x7E57 + width)
        k = min(width, FEATURES)
        self.idx = torch.randperm(width, generator=g)[:k].sort().values.to(device)
        self.proj = (torch.randn(k, DIMS, generator=g) / k**0.5).to(device)
        self.train = torch.empty(TRAIN_ROWS, DIMS, device=device)
        self.eval = torch.empty(EVAL_ROWS, DIMS, device=device)
        self.n_train = 0
        self.n_eval = 0
        self.batches: list[tuple[int, int, int, int]] = []  # (pass, step, first row, rows) of eval forwards

    def sign(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        flat = x[:rows].reshape(rows, -1)
        return flat.index_select(1, self.idx).float() @ self.proj


class LeakWatch:
    def __init__(self) -> None:
        self._sketches: dict[tuple[int, str], _Sketch] = {}
        self._pass = 0  # the newest pass's number
        self._passes: dict[tuple, int] = {}  # this evaluation's passes, by where the script ran them
        self._first_passes: set[int] = set()  # the passes that began an evaluation
        self._keys: dict[int, tuple] = {}  # each pass's key (see ``pass_key``)
        self._groups: dict[int, dict] = {}  # each pass's evaluation: the keys of the passes in it
        self._train_since_eval = True
        self._fed: set[int] = set()  # models fed with another model's output (see the module doc)
        self._time_major: set[int] = set()  # models whose inputs were seen time-major (samples_first)

    def forget(self, source: int) -> None:
        """``source`` is fed activations, not data: its rows, hashed or to come, are no samples."""
        if source not in self._fed:
            self._fed.add(source)
            self._sketches = {k: sk for k, sk in self._sketches.items() if k[0] != source}

    def on_forward(self, x: Any, evaluating: bool, step: int, source: int = 0, others=()) -> None:
        """Hash sampled rows of ``x`` (the input of a watched model's forward; ``source`` names
        the model, ``others`` are the forward's other inputs)."""
        if source in self._fed:
            return
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            # A model's layout does not change between batches: one whose source and target are
            # as long (or square) says nothing, the batches before did.
            t = samples_first(x, others)
            if t is not x:
                self._time_major.add(source)
            elif source in self._time_major:
                t = x.transpose(0, 1)
            x = t
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] == 0 or x.is_complex():
            return
        if x.layout != torch.strided or x.is_meta:
            return
        width = x[:1].numel()
        if width < MIN_FEATURES:
            return
        exact_only = not x.is_floating_point()
        key = (source, width, str(x.device), exact_only)
        sk = self._sketches.get(key)
        if sk is None:
            if len(self._sketches) >= MAX_SHAPES:
                return
            with quiet(), torch.no_grad():
                sk = self._sketches[key] = _Sketch(width, x.device, exact_only)
        if evaluating:
            if self._train_since_eval:
                self._passes = {}
                self._first_passes.add(self._pass + 1)
                self._train_since_eval = False
            key = pass_key()
            p = self._passes.get(key)
            if p is None:
                self._pass += 1
                p = self._passes[key] = self._pass
                self._keys[p], self._groups[p] = key, self._passes
            room = EVAL_ROWS - sk.n_eval
        else:
            self._train_since_eval = True
            room = TRAIN_ROWS - sk.n_train
        rows = min(int(x.shape[0]), ROWS_PER_FORWARD, room)
        if rows <= 0:
            return
        with quiet(), torch.no_grad():
            sig = sk.sign(x.detach(), rows)
            if evaluating:
                sk.eval[sk.n_eval : sk.n_eval + rows].copy_(sig)
                sk.batches.append((p, step, sk.n_eval, rows))
                sk.n_eval += rows
            else:
                sk.train[sk.n_train : sk.n_train + rows].copy_(sig)
                sk.n_train += rows

    def _validation(self, p: int) -> bool:
        """Whether pass ``p`` is a validation: one whose frames name a validation split, else the
        last of its evaluation, unless they name the training split."""
        split = split_of(self._keys.get(p), self._groups.get(p, ()))
        if split in TRAIN_SPLITS:
            return False
        return split in VAL_SPLITS or p == self._pass or p + 1 in self._first_passes

    def summary(self) -> dict[str, Any] | None:
        """Per evaluation batch, the relative distances of its rows to their nearest training row
        (only those below ``KEEP_BELOW``) and whether its pass was the validation (the last of
        its evaluation); None when nothing was evaluated."""
        out = {"train_rows": 0, "eval_rows": 0, "batches": [], "keep_below": KEEP_BELOW}
        with quiet(), torch.no_grad():
            for sk in self._sketches.values():
                out["train_rows"] += sk.n_train
                out["eval_rows"] += sk.n_eval
                if not sk.n_eval or not sk.n_train:
                    continue
                ev = sk.eval[: sk.n_eval]
                rel = _relative_nearest(sk.train[: sk.n_train], ev).cpu().tolist()
                validation = [self._validation(p) for p, *_ in sk.batches]
                in_val = torch.zeros(len(ev), dtype=torch.bool)
                for (_, _, first, rows), last in zip(sk.batches, validation):
                    in_val[first : first + rows] = last
                again = _repeated(ev, in_val.to(ev.device)).cpu().tolist()
                for (p, step, first, rows), last in zip(sk.batches, validation):
                    span = range(first, first + rows)
                    close = [round(rel[i], 4) for i in span if rel[i] < KEEP_BELOW and not again[i]]
                    out["batches"].append({"pass": p, "step": step, "rows": rows, "close": close, "validation": last,
                                           "exact_only": sk.exact_only, "seen_before": sum(again[i] for i in span)})
        return out if out["eval_rows"] else None


def samples_first(x: Any, others) -> Any:
    """``x`` with its samples in the first dimension: transposed when an integer tensor among
    ``others`` (the forward's other inputs) is 1-D with ``x``'s second size and reads as the
    sequences' lengths (:func:`_lengths`), or 2-D with ``x``'s second size second and another first
    (a time-major target); as it is otherwise. bentrevett/pytorch-seq2seq calls ``model(src, src_len, trg)``."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] == x.shape[1]:
        return x
    n = x.shape[1]
    for y in others:
        if y is x or not isinstance(y, torch.Tensor) or y.is_floating_point() or y.is_complex():
            continue
        if y.dtype == torch.bool:
            continue  # a mask ([len, len] causal, or [batch, len] padding) says nothing about the order
        if y.dim() == 2 and y.shape[1] == n and y.shape[0] != x.shape[0] or y.dim() == 1 and y.shape[0] == n and _lengths(y, x):
            return x.transpose(0, 1)
    return x


def _lengths(y: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``y`` reads as the lengths of ``x``'s sequences padded to the longest (its largest
    value is ``x``'s first size), not ``position_ids`` beside batch-first tokens. Read only on the
    CPU, where ``pack_padded_sequence`` wants its lengths: elsewhere it would be a sync."""
    return y.device.type == "cpu" and y.numel() > 0 and int(y.max()) == x.shape[0]


def _repeated(ev: torch.Tensor, in_val: torch.Tensor) -> torch.Tensor:
    """Which validation rows repeat an earlier validation row (the same validation set evaluated
    again: one sample, whose copy of a training row counts once)."""
    out = torch.zeros(len(ev), dtype=torch.bool, device=ev.device)
    idx = in_val.nonzero().squeeze(1)
    if len(idx) < 2:
        return out
    _, inverse = torch.unique(ev[idx], dim=0, return_inverse=True)
    order = torch.arange(len(idx), device=ev.device)
    first = torch.full((int(inverse.max()) + 1,), len(idx), device=ev.device).scatter_reduce_(0, inverse, order, "amin")
    out[idx] = first[inverse] != order
    return out


def _relative_nearest(train: torch.Tensor, ev: torch.Tensor) -> torch.Tensor:
    """Distance of each evaluation row to its nearest training row, over the typical distance
    between that row and a training row (the lower quartile over ``_PAIRS`` pseudo-random training
    rows). Per row and a quartile, not one median over all pairs: in a series with rare large
    spikes most pairs of windows hold a spike, and against a spike's distance the spike-free
    windows all read as copies."""
    nearest = torch.empty(len(ev), device=ev.device)
    for i in range(0, len(ev), _CHUNK):
        chunk = ev[i : i + _CHUNK]
        # The matmul form finds the neighbour fast; its distance is recomputed exactly (the
        # matmul form loses the digits that tell a copy, distance 0, from a near copy).
        j = torch.cdist(chunk, train).argmin(1)
        nearest[i : i + _CHUNK] = (chunk - train[j]).norm(dim=1)
    rows = torch.arange(len(ev), device=ev.device)
    scale = torch.empty(len(ev), device=ev.device)
    for i in range(0, len(ev), _CHUNK):
        r = rows[i : i + _CHUNK, None]
        pair = (r * 7919 + torch.arange(_PAIRS, device=ev.device) * 104729) % len(train)
        typical = (ev[i : i + _CHUNK, None] - train[pair]).norm(dim=2)
        scale[i : i + _CHUNK] = typical.masked_fill(~torch.isfinite(typical), float("nan")).nanquantile(0.25, dim=1)
    rel = nearest / scale.clamp(min=1e-30)
    return torch.nan_to_num(rel, nan=float("inf"))
