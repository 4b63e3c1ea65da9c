"""What the diagnosis rules read: a run's per-step scalars and layer statistics as NumPy series.

Built once per diagnosis from the reader; rules only look things up here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainguard.analysis._thresholds import Thresholds

# Module types whose weights are lookup tables, not transforms: gradient-flow ratios skip them.
_TABLE_TYPES = ("Embedding", "EmbeddingBag")
# Layers that apply matrices of their own beside a child layer (nn.MultiheadAttention's in_proj_weight
# beside its out_proj): their matrices are checked for initialisation like any layer's.
_MATRICES_BESIDE_LAYERS = ("MultiheadAttention",)
# Pass-through modules whose statistics repeat their input's.
POOL_TYPES = ("MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
              "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "Flatten", "Dropout")


@dataclass
class Series:
    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, pairs: list[tuple[int, float]] | None) -> Series:
        pairs = pairs or []
        if any(a[0] >= b[0] for a, b in zip(pairs, pairs[1:])):
            # A resumed run wrote some steps again: the last value of each step is the one kept.
            pairs = sorted({s: v for s, v in pairs}.items())
        return cls(np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=float))

    def __len__(self) -> int:
        return len(self.values)

    def finite(self) -> Series:
        ok = np.isfinite(self.values)
        return Series(self.steps[ok], self.values[ok])

    def before(self, step: int) -> Series:
        ok = self.steps < step
        return Series(self.steps[ok], self.values[ok])

    def tail(self, fraction: float = 0.5, minimum: int = 2) -> Series:
        """The last ``fraction`` of the points (at least ``minimum``, at most all)."""
        n = len(self)
        k = min(n, max(minimum, int(math.ceil(n * fraction))))
        return Series(self.steps[n - k :], self.values[n - k :])

    def at(self, step: int) -> float | None:
        hit = np.nonzero(self.steps == step)[0]
        return float(self.values[hit[0]]) if len(hit) else None


def median(values: np.ndarray) -> float:
    v = values[np.isfinite(values)]
    return float(np.median(v)) if len(v) else math.nan


def rolling_median(values: np.ndarray, w: int) -> np.ndarray:
    """Median of each window of ``w`` consecutive values (len - w + 1 results)."""
    if len(values) < w:
        return np.array([])
    view = np.lib.stride_tricks.sliding_window_view(values, w)
    return np.median(view, axis=1)


def sig(x: float, digits: int = 2) -> float:
    """Round to ``digits`` significant digits (for suggested values people type in)."""
    if not math.isfinite(x) or x == 0:
        return x
    return float(f"{x:.{digits}g}")


def fmt(x: Any) -> str:
    """A number as a short human string: 3 significant digits, exponent when small or large."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e6):
        return str(int(x))
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return f"{x:.3g}"


def undone_before(meta: dict, loss: list[tuple[int, float]], th: Thresholds) -> int:
    """The first step trained from weights loaded back into the model (``meta["weights_loaded"]``,
    see the monitor's ``_weights_loaded``), at the last such load that enough steps with a loss
    followed to judge them on their own; 0 when there is none."""
    loads = [(d.get("step"), d.get("model")) for d in meta.get("weights_loaded") or [] if isinstance(d, dict)]
    loads = [(s, m) for s, m in loads if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    # Two loads into one model with no update between swap weights in and back (EMA weights for an
    # evaluation, then the trained ones): the training goes on, nothing was undone.
    once = {s for s, m in loads if loads.count((s, m)) == 1}
    for step in sorted(once, reverse=True):
        if sum(1 for s, _ in loss if s >= step) >= th.min_loss_points:
            return step
    return 0


def whole_windows(loss: Series, windows: Any) -> Series:
    """``loss`` with each step that summed fewer micro-batch losses than the run's usual window
    scaled up to it (``windows``: the monitor's ``loss_windows``, [[first step, count], ...]; 0:
    leave as is). Gradient accumulation written by hand (``loss / k`` each, an update on
    ``step % k == 0``) sums one micro-batch in its first window and maybe fewer than k at an
    epoch's end: a half loss at step 0 read as a loss that rose from initialisation."""
    if not isinstance(windows, list) or not len(loss):
        return loss
    runs = sorted((int(w[0]), int(w[1])) for w in windows
                  if isinstance(w, (list, tuple)) and len(w) == 2 and all(isinstance(v, int) for v in w))
    if len(runs) < 2:
        return loss
    starts = np.array([r[0] for r in runs])
    idx = np.searchsorted(starts, loss.steps, side="right") - 1
    counts = np.where(idx >= 0, np.array([r[1] for r in runs])[np.maximum(idx, 0)], 0)
    known = counts[counts > 0]
    if not len(known):
        return loss
    values, freq = np.unique(known, return_counts=True)
    usual = int(values[np.argmax(freq)])
    short = (counts > 0) & (counts < usual)
    if not short.any():
        return loss
    scaled = loss.values.copy()
    scaled[short] *= usual / counts[short]
    return Series(loss.steps, scaled)


class Context:
    """A run's monitoring data, indexed for the rules."""

    def __init__(self, run: Any, thresholds: Thresholds):
        self.run = run
        self.th = thresholds
        self.meta: dict = run.meta.get("monitor") or {}
        scalars = run.scalars()
        # Weights loaded back into a watched model after it trained undo the steps before (an LR
        # range test: fastai's lr_find, torch-lr-finder, Lightning's Tuner restore the weights they
        # saved before the real fit): only the training the model kept is judged.
        self.undone_before = undone_before(self.meta, scalars.get("loss") or [], thresholds)
        if self.undone_before:
            scalars = {k: [sv for sv in v if sv[0] >= self.undone_before] for k, v in scalars.items()}
        self.loss = whole_windows(Series.of(scalars.get("loss")), self.meta.get("loss_windows"))
        # The loss of a step sums separate objectives, each before its own optimizer's update (a
        # GAN's discriminator and generator losses): no trend of it means anything.
        self.losses_summed = bool(self.meta.get("separate_losses"))
        # Another optimizer took over ending steps at this step (layers trained one after another,
        # each by its own optimizer and loss: forward-forward; SAC's actor between its critic's steps):
        # one loss curve per objective, no trend
        # across them means anything. None when none did.
        seq = self.meta.get("objectives_in_sequence")
        self.objectives_in_sequence = int(seq) if isinstance(seq, int) and not isinstance(seq, bool) else None
        # Models trained one after another, each new one after every earlier one was freed (a
        # sweep's trials, cross-validation's folds): [{"prefix", "first_step"}, ...], or [].
        seq_models = self.meta.get("models_in_sequence")
        self.models_in_sequence: list[dict] = [m for m in seq_models if isinstance(m, dict)] \
            if isinstance(seq_models, list) else []
        # Steps a GradScaler skipped: their gradients overflowed in float16 by design (the scaler's
        # own rule judges those), so the gradient-norm rules never see them.
        self.amp_skipped = Series.of(scalars.get("amp/skipped"))
        self.amp_scale = Series.of(scalars.get("amp/scale"))
        skipped = set(self.amp_skipped.steps[self.amp_skipped.values > 0.5].tolist())
        self.skipped_steps = skipped
        self.grad_norm = Series.of([sv for sv in scalars.get("grad_norm") or [] if sv[0] not in skipped])
        # A run whose first recording came after updates (resumed, or watched from mid-training)
        # does not know its initial weights; older runs did not say and recorded from step 0.
        self.weights_initial = bool(self.meta.get("weights_initial", True))
        # the reinforcement-learning environment package the script imported (gymnasium), if any
        self.environment: str | None = self.meta.get("environment")
        # How the loop clips its gradients ({"function", "value", "first_step"}), if it does.
        self.clipping: dict | None = self.meta.get("clipping")
        self.lrs = {k: Series.of(v) for k, v in scalars.items() if k.startswith("lr/")}
        grouped: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
        for row in run.layer_stats():
            if row["step"] < self.undone_before:
                continue
            if row["kind"] == "gradient" and row["step"] in skipped:
                continue
            grouped.setdefault((row["layer"], row["kind"], row["stat"]), []).append((row["step"], row["value"]))
        self._stats = {k: Series.of(v) for k, v in grouped.items()}
        layer_meta = {d["name"]: d for d in self.meta.get("layers", [])}
        self.layer_type = {name: d.get("type", "") for name, d in layer_meta.items()}
        self.layer_units = {name: d["units"] for name, d in layer_meta.items() if d.get("units")}
        # Output units whose incoming weights a pruning mask zeroes whole (capture/_monitor_model.pruned_units).
        self.layer_pruned = {name: d["pruned_units"] for name, d in layer_meta.items() if d.get("pruned_units")}
        self.params: dict[str, dict] = self.meta.get("params", {})
        order = list(self.meta.get("order") or [])
        seen = set(order)
        for layer in run.layers():
            if layer not in seen and (layer, "activation", "mean") in self._stats:
                order.append(layer)
                seen.add(layer)
        self.layer_order = [la for la in order if (la, "activation", "mean") in self._stats]
        self.recorded_steps = sorted({int(s) for ser in self._stats.values() for s in ser.steps})

    # ------------------------------------------------------------------ lookups
    def stat(self, layer: str, kind: str, stat: str) -> Series:
        return self._stats.get((layer, kind, stat)) or Series.of(None)

    def has(self, layer: str, kind: str, stat: str) -> bool:
        return (layer, kind, stat) in self._stats

    def layers_with(self, kind: str, stat: str) -> list[str]:
        names = [la for (la, k, s) in self._stats if k == kind and s == stat]
        return self.ordered(names)

    def ordered(self, names: list[str]) -> list[str]:
        """Layers in forward order; parameters by their layer's position, then their own order."""
        pos = {la: i for i, la in enumerate(self.layer_order)}
        pnames = list(self.params)

        def key(n: str) -> tuple:
            layer = self.params.get(n, {}).get("layer", n)
            return (pos.get(layer, len(pos)), pnames.index(n) if n in pnames else 0, n)

        return sorted(set(names), key=key)

    def by_model(self, names: list[str]) -> list[list[str]]:
        """``names`` (layers or parameters) split by the watched model they belong to (the longest
        root prefix they start with), each list in the order given, models in order of appearance."""
        prefixes = sorted({r.get("prefix") or "" for r in self.meta.get("roots") or []} or {""}, key=len, reverse=True)
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(next((p for p in prefixes if n.startswith(p)), ""), []).append(n)
        return list(groups.values())

    def weight_matrices(self) -> list[str]:
        """Parameters that transform (ndim >= 2, not embedding tables), in forward order."""
        out = []
        for name, info in self.params.items():
            if len(info.get("shape", [])) >= 2 and info.get("module_type") not in _TABLE_TYPES:
                out.append(name)
        return self.ordered(out)

    def weight_decay(self, layers: list[str]) -> float | None:
        """The smallest weight decay among the weight matrices of ``layers`` when every one of them
        is decayed (> 0), else None (one undecayed, or not known: runs before the monitor stored it)."""
        decays = [info.get("weight_decay") for info in self.params.values()
                  if info.get("layer") in layers and len(info.get("shape", [])) >= 2]
        if not decays or any(not isinstance(d, (int, float)) or d <= 0 for d in decays):
            return None
        return min(decays)

    def orthogonalising_optimizer(self, layers: list[str]) -> str | None:
        """The optimizer that updates every weight matrix of ``layers`` with orthogonalised steps
        (Muon: a step's size is the learning rate's, whatever the gradient's), or None when any of
        them is updated otherwise or not known to be (runs before the monitor stored it)."""
        names = {info.get("optimizer") for info in self.params.values()
                 if info.get("layer") in layers and len(info.get("shape", [])) >= 2 and info.get("orthogonalised")}
        others = [info for info in self.params.values()
                  if info.get("layer") in layers and len(info.get("shape", [])) >= 2 and not info.get("orthogonalised")]
        return next(iter(names)) if len(names) == 1 and not others else None

    def window(self, series: Series) -> Series:
        """The later half of the recordings: the state a layer ended up in."""
        return series.tail(0.5, minimum=2)

    def lr_groups(self) -> list[int]:
        """The optimizer's parameter groups whose learning rates were logged, in order."""
        return sorted(int(k[3:]) for k in self.lrs if k[3:].isdigit())

    def initial_step(self, name: str) -> int | None:
        """The step at which the model holding layer or parameter ``name`` had its initial weights:
        the run's first recording, or, for a model trained after earlier ones were freed (a sweep's
        later trial), the step it was found in (``models_in_sequence``; the longest prefix wins)."""
        first = self.recorded_steps[0] if self.recorded_steps else None
        own = [m for m in self.models_in_sequence
               if isinstance(m.get("prefix"), str) and name.startswith(m["prefix"]) and isinstance(m.get("first_step"), int)]
        if own:
            return max(own, key=lambda m: len(m["prefix"]))["first_step"]
        return first

    def other_optimizers(self) -> dict[int, list[int]]:
        """The parameter groups of each optimizer after the first (logged as ``lr/K.G``: Muon's
        AdamW for the embeddings, a GAN's generator), by the optimizer's index K, in order."""
        out: dict[int, list[int]] = {}
        for k in self.lrs:
            opt, dot, group = k[3:].partition(".")
            if dot and opt.isdigit() and group.isdigit():
                out.setdefault(int(opt), []).append(int(group))
        return {k: sorted(v) for k, v in sorted(out.items())}

    def lr(self, step: int | None = None, group: int | str = 0) -> float | None:
        """The learning rate of parameter group ``group`` (the first by default; ``"K.G"`` for group G
        of the K-th optimizer): at ``step``, the one in
        force then (the last logged at or before it); else the median of the rates it had, always one
        it had (the lower middle one of an even count: a StepLR's 1.0 and 0.7 are not averaged into 0.85)."""
        s = self.lrs.get(f"lr/{group}")
        if s is None or not len(s):
            return None
        if step is not None:
            upto = s.finite().before(step + 1)
            if len(upto):
                return float(upto.values[-1])
        v = np.sort(s.values[np.isfinite(s.values)])
        return float(v[(len(v) - 1) // 2]) if len(v) else None

    def lr_peak(self) -> float | None:
        """The highest learning rate the first parameter group had: under a schedule (a warmup, a
        decay), the optimizer's own ``lr`` as the program set it."""
        s = self.lrs.get("lr/0")
        v = s.values[np.isfinite(s.values)] if s is not None else ()
        return float(v.max()) if len(v) else None

    def input_rms(self, layer: str | None = None) -> float:
        """RMS of the model's input (1 when unknown, e.g. token ids); with ``layer``, of the input of
        the model that layer belongs to (several models: ``name.<input>``)."""
        inputs = self.input_layers()
        if layer is not None:
            own = [la for la in inputs if layer.startswith(la[: -len("<input>")])]
            inputs = sorted(own, key=len, reverse=True)  # the longest prefix: "gen." before ""
        for layer in inputs:
            mean = median(self.stat(layer, "input", "mean").values)
            std = median(self.stat(layer, "input", "std").values)
            if math.isfinite(mean) and math.isfinite(std):
                return max(math.hypot(mean, std), 1e-12)
        return 1.0

    def output_layer(self, classes: int) -> tuple[str | None, str | None]:
        """The layer that makes the logits (the last transforming layer with ``classes`` units) and,
        when it owns no weight of its own, the embedding weight it shares ([classes, d])."""
        layer = next((la for la in reversed(self.layer_order)
                      if self.layer_type.get(la) not in ("Embedding", "EmbeddingBag") and self.unit_count(la) == classes),
                     None)
        if layer is None:
            return None, None
        if any(info.get("layer") == layer for info in self.params.values()):
            return layer, None
        tied = [name for name, info in self.params.items() if info.get("module_type") == "Embedding"
                and len(info.get("shape", [])) == 2 and int(info["shape"][0]) == classes]
        return layer, tied[0] if len(tied) == 1 else None

    def model_name(self, prefix: str) -> str:
        """How findings name the watched model whose layers start with ``prefix``: the prefix; for the
        first model found (no prefix) the script's variable that held it when known, else
        "(the first model)"."""
        if prefix:
            return prefix.rstrip(".")
        first = next((r for r in self.meta.get("roots") or [] if isinstance(r, dict) and not r.get("prefix")), {})
        variable = first.get("variable")
        return variable if isinstance(variable, str) and variable else "(the first model)"

    def input_layers(self) -> list[str]:
        return sorted({la for (la, k, _) in self._stats if k == "input"})

    def relgrad(self, param: str) -> Series:
        """Gradient norm divided by weight norm, at the steps where both were recorded."""
        g = self.stat(param, "gradient", "norm")
        w = self.stat(param, "weight", "norm")
        wmap = dict(zip(w.steps.tolist(), w.values.tolist()))
        pairs = [(s, v / wmap[s]) for s, v in zip(g.steps.tolist(), g.values.tolist()) if wmap.get(s)]
        return Series.of(pairs)

    def update_ratio_by_step(self, floor: bool = False) -> Series:
        """Per recording step, the median update-to-weight ratio over weight matrices.

        ``floor``: each matrix's update measured against at least a third of the norm Kaiming
        initialisation gives it (PyTorch's default init, at 0.41 of it, stays above), not its own when
        smaller: weights initialised far below that scale (seq2seq's ``nn.init.normal_(std=0.01)``,
        a tenth of it) make any rate that trains move them by a large part of their norm at first.

        Matrices that started at zero (a zero-initialised residual branch) are left out: their
        first update is their whole value. So are frozen ones (``requires_grad=False``): a LoRA
        fine-tune's base matrices, 15 of the 27 that started non-zero in a tiny torchtune Llama,
        never move, and their ratio of 0 made the median 0 whatever rate the adapters trained at.
        Nor, at a step, matrices no gradient reached then: their update is the weight decay's alone
        (timm's resnet10t under AdamW at lr 5: the 8 convolutions behind BatchNorms that
        ``zero_init_last`` set to 0 moved by 1e-4 at step 0, and the median of the 15 matrices hid
        the stem's 5150% first update).
        """
        per_step: dict[int, list[float]] = {}
        for p in self.weight_matrices():
            if not self.params.get(p, {}).get("requires_grad", True):
                continue
            w = self.stat(p, "weight", "norm")
            if len(w) and w.values[0] == 0:
                continue
            g = self.stat(p, "gradient", "norm")
            no_grad = {s for s, v in zip(g.steps.tolist(), g.values.tolist()) if v == 0}
            r = self.stat(p, "update", "ratio")
            scale = dict(zip(w.steps.tolist(), w.values.tolist()))
            check = self.weight_init_check(p) if floor else None
            least = check["kaiming"] * math.sqrt(math.prod(self.params[p]["shape"])) / 3 if check else None
            for s, v in zip(r.steps.tolist(), r.values.tolist()):
                if math.isfinite(v) and s not in no_grad:
                    norm = scale.get(s)
                    if least and norm and math.isfinite(norm) and norm < least:
                        v *= norm / least
                    per_step.setdefault(s, []).append(v)
        return Series.of([(s, float(np.median(v))) for s, v in sorted(per_step.items())])

    def unit_count(self, layer: str) -> int | None:
        """Output units of a layer: the size of its output's unit axis as recorded (runs before
        it: from the shape of its weight, Linear/Conv dim 0)."""
        if layer in self.layer_units:
            return self.layer_units[layer]
        for info in self.params.values():
            if info.get("layer") == layer and len(info.get("shape", [])) >= 2:
                return int(info["shape"][0])
        return None

    def loss_classes(self) -> int | None:
        """The classes of the cross-entropy the loss is, as the loss watch read them off the loss's
        autograd graph (C of its [N, C] input: a contrastive loss's candidates per row, the batch
        for CLIP, 1 + the queue for MoCo); None unless every loss head is one and they agree."""
        heads = [h for rec in self.run.meta.get("loss_graph") or [] for h in rec.get("heads") or []]
        classes = {h.get("classes") if h.get("loss") in ("nll_loss", "soft_cross_entropy") else None for h in heads}
        c = classes.pop() if len(classes) == 1 else None
        return c if isinstance(c, int) and c > 1 else None

    def output_units(self) -> int | None:
        """Units of the model's output layer: the last layer in forward order that transforms."""
        for layer in reversed(self.layer_order):
            if self.layer_type.get(layer) not in _TABLE_TYPES and (units := self.unit_count(layer)):
                return units
        mats = self.weight_matrices()
        return self.unit_count(self.params[mats[-1]]["layer"]) if mats else None

    def weight_init_check(self, param: str) -> dict | None:
        """Weight RMS at the first recording against Kaiming (ReLU) and Xavier/Glorot (tanh) scales.

        None for a parameter a module holds beside layers of its own (the model's, when it is no
        layer itself): a ViT's ``cls_token`` and ``pos_embed`` (``[1, N, D]``, a fixed sin-cos table
        in MAE) are added to the activations, with no fan-in to initialise by. A model with no layers
        inside is its own layer, and its matrices are checked (pytorch/tutorials' ``Mnist_Logistic``)."""
        info = self.params.get(param)
        w = self.stat(param, "weight", "norm")
        if not info or not len(w) or len(info.get("shape", [])) < 2:
            return None
        owner = info.get("layer")
        if self.layer_type and (owner not in self.layer_type or (
                info.get("module_type") not in _MATRICES_BESIDE_LAYERS
                and any(la.startswith(f"{owner}.") for la in self.layer_type))):
            return None
        shape = info["shape"]
        numel = math.prod(shape)
        fan_in = numel // shape[0]
        fan_out = numel // shape[1] if len(shape) >= 2 else shape[0]
        rms = float(w.values[0]) / math.sqrt(numel)
        return {
            "param": param,
            "rms": rms,
            "kaiming": math.sqrt(2.0 / fan_in),
            "xavier": math.sqrt(2.0 / (fan_in + fan_out)),
            "fan_in": fan_in,
            "step": int(w.steps[0]),
        }
