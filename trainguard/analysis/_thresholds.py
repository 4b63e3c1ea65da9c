"""The thresholds of the diagnosis rules: each a named value with the reason for it.

Override any of them per call (``diagnose(run, thresholds={"dead_units_warn": 0.3})``) or from
the command line (``trainguard diagnose RUN --set dead_units_warn=0.3``). Names are accepted in
either case.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


def _t(value: float, reason: str) -> Any:
    return field(default=value, metadata={"reason": reason})


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Every number a diagnosis rule compares against. ``Thresholds.reasons()`` explains each."""

    # ---- how much data a judgement needs
    min_loss_points: float = _t(20, "fewer per-step losses cannot separate a trend from minibatch noise")
    window_fraction: float = _t(
        0.2, "trend windows are a fifth of the run: long enough to average noise, short enough to see the end"
    )
    # ---- loss
    loss_min_progress: float = _t(
        0.05, "a run whose best loss is within 5% of its starting loss has learned nothing a healthy run would miss"
    )
    loss_saturated_ratio: float = _t(
        1e-4, "a loss and a gradient norm 10,000x below their values before one update: the loss hit its floor "
        "(a sigmoid or softplus of a scaled margin rounds to 0), not a fit that converged step by step"
    )
    loss_slow_progress: float = _t(0.10, "under 10% improvement over a whole run is slow enough to blame the step size")
    loss_sign_changes: float = _t(
        0.2, "a loss whose sign flips between a fifth of its steps is a surrogate (policy gradient, WGAN critic), "
        "not an error training drives toward 0; one that falls through 0 flips only where it crosses"
    )
    loss_above_chance_ratio: float = _t(
        1.5, "a cross-entropy half again above ln C, a uniform guess's loss, at the start and the end of a run is a "
        "model confidently wrong, not minibatch noise around chance (mamba-minimal's N(0, 1) tied embedding: 15.7 "
        "-> 9.62 against ln 64 = 4.16)"
    )
    loss_diverge_ratio: float = _t(
        2.0, "a smoothed loss above twice its value at initialisation means updates make the model worse"
    )
    loss_noisy: float = _t(
        0.5, "a loss whose log spreads this wide around its local level (MAD from the median of 5 steps) gives a "
        "first value that may be off by 2x on its own (a diffusion loss drawn at random timesteps): a rise is "
        "judged from a median"
    )
    loss_spike_ratio: float = _t(3.0, "a loss three times its recent median is far outside minibatch noise")
    rl_loss_large: float = _t(
        1e8, "a reinforcement learning loss above this at the start: a value loss is the squared error of the "
        "returns, 1e8 a return error of 1e4 (TorchRL's PPO on Pendulum starts near 3e3; with rewards 1e6x, 1.9e15)"
    )
    loss_spike_min_z: float = _t(6.0, "six robust standard deviations (MAD) above the recent median")
    loss_spike_over_max: float = _t(
        1.5, "and half again above the recent maximum: heavy-tailed minibatch noise repeats its outliers"
    )
    loss_spike_min_rise: float = _t(
        0.25, "the jump must be a quarter of the starting loss: tiny losses near convergence are relatively noisy"
    )
    loss_spike_min_rise_span: float = _t(
        0.5, "a loss with no floor at 0 (it went below 0: a log-likelihood's offset is arbitrary) must jump by half "
        "the span it fell since the start, measured from its lowest value so far: the minimum rise that does not "
        "depend on where 0 is (heavy-tailed noise of a flat loss passes 5% of healthy runs at 0.5, 9% at 0.25)"
    )
    loss_spike_quiet_grad: float = _t(
        1.0, "spikes whose gradient norms are all below this multiple of the run's median made smaller updates than a "
        "usual step: a hard or rare batch (a class one image in 64 holds), not a disturbance of training"
    )
    osc_autocorr: float = _t(
        -0.4, "detrended i.i.d. noise has |autocorrelation| < 0.2 at 40+ points; -0.4 needs a real back-and-forth"
    )
    osc_fisher_p: float = _t(
        1e-3, "Fisher's g test: white noise concentrates this much power in one frequency once in 1,000 runs"
    )
    osc_min_amplitude: float = _t(0.05, "swings under 5% of the loss level are not worth acting on")
    # ---- learning rate (update-to-weight ratio ||dW|| / ||W|| of weight matrices per step)
    update_ratio_high: float = _t(
        0.25, "one step that moves the weights by a quarter of their norm rewrites the layer (healthy: 1e-4..1e-2)"
    )
    update_ratio_calm: float = _t(
        0.01, "no step moved the weights by 1% of their norm: a loss that rises slowly under such updates is not "
        "diverging from the step size (rate-driven divergences measured here moved them by 48% to 1190% in a step; "
        "cleanrl's PPO, whose value loss grows with the returns, by at most 0.14%)"
    )
    update_ratio_low: float = _t(1e-5, "at this pace the weights need 100,000 steps to change by their own size")
    update_total_small: float = _t(
        0.01, "steps that add up to 1% of the weights' norm over the whole run leave the loss where it started, "
        "whatever the data (healthy runs here moved them by 70% to 280% in 40 steps)"
    )
    # ---- activations
    dead_units_warn: float = _t(0.5, "half of a layer's units silent for a whole batch halves its capacity")
    dead_units_error: float = _t(0.9, "nine units in ten silent: the layer passes almost nothing on")
    dead_units_min_rows: float = _t(
        8, "a ReLU unit is 0 on about half of its inputs: on 1 row half the units look dead by chance, on 8 rows 0.4%"
    )
    act_explode_rms: float = _t(
        100.0, "activations 100x the input scale: each layer amplifies (healthy layers stay within ~10x)"
    )
    act_collapse_std: float = _t(
        1e-4, "a layer whose outputs vary 10,000x less than the input carries almost no information"
    )
    row_collapse_ratio: float = _t(
        0.1, "a model output whose rows (one per input) differ 10x less than its values: inputs 99% alike in cosine"
    )
    codebook_collapse_codes: float = _t(
        3.0, "a layer whose outputs take under 3 distinct values in effect (perplexity): a quantizer using 1-2 codes"
    )
    target_range_excess: float = _t(
        1.0, "a regression target beyond its bounded prediction's range by the range's own width (a sigmoid's 0..1 "
        "against 2 or more) is in other units, not a label a little off"
    )
    target_collapse_perplexity: float = _t(
        3.0, "soft targets (a teacher's probabilities) whose mean over the batch's rows takes under 3 classes in effect "
        "(perplexity): every input is sent to the same one or two classes"
    )
    target_uniform_entropy: float = _t(
        0.97, "soft targets whose rows hold 97% of ln C of entropy are uniform: a healthy DINO teacher's rows stayed "
        "under 92% at temperature 0.04"
    )
    codebook_input_factor: float = _t(
        8.0, "while its inputs take 8x as many: the layer maps inputs that differ onto one or two outputs"
    )
    posterior_kl_nats: float = _t(
        0.1, "a latent whose posterior lies within 0.1 nats (0.14 bits) of the prior N(0, 1), all dimensions "
        "together, tells the decoder almost nothing about its input (a healthy VAE's holds nats, in the few "
        "dimensions it uses)"
    )
    saturation_warn: float = _t(0.4, "40% of tanh/sigmoid outputs within 1% of a bound, where the gradient is < 2%")
    rl_value_growth: float = _t(
        10.0, "a value head whose mean output grew 10x past its initial size (mean plus spread) follows returns far "
        "above its starting range: stable-baselines3's A2C on CartPole, -0.064 -> 49.3, saturated its critic's Tanh"
    )
    # ---- gradients
    vanish_ratio: float = _t(
        1e-3, "first-layer gradient (relative to its weights) 1000x below the last: one LR cannot suit both"
    )
    vanish_update_balance: float = _t(
        0.1, "yet the first layer's updates are a tenth of the last's or more: the optimizer (Adam) makes up for it"
    )
    explode_ratio: float = _t(1e3, "first-layer gradient (relative to its weights) 1000x above the last")
    grad_spike_factor: float = _t(100.0, "a gradient norm two orders of magnitude above its recent median")
    grad_spike_vs_start: float = _t(
        10.0, "and 10x above the first steps' norm: a converged model's occasional large gradient stays below that"
    )
    grad_growth: float = _t(100.0, "the typical gradient norm grew 100x from the start of training to the end")
    # ---- inputs
    input_scale_max: float = _t(10.0, "inputs with mean or std above 10 push first-layer units far from their linear range")
    input_scale_spread: float = _t(1e3, "features whose scales differ 1000x train at very different speeds")
    # ---- mixed precision (GradScaler)
    amp_skip_run: float = _t(
        5, "after the scale settled, more than 5 skipped steps in a row: halving the scale is not fixing it"
    )
    amp_skip_fraction: float = _t(
        0.1, "more than 10% of a window of steps skipped once settled (a growth attempt skips 1 step in 2000)"
    )
    amp_skip_window: float = _t(100, "the window the skip fraction is measured over, in steps")
    # ---- iterations the loop skipped itself (a non-finite loss checked, no backward)
    skipped_error_fraction: float = _t(
        0.1, "one iteration in ten left untrained is no odd bad sample: the model or the data keeps making NaN/Inf"
    )
    amp_min_scale: float = _t(
        1.0, "a scale below 1 still overflowing: the values are Inf/NaN unscaled, so scaling is not the cause"
    )
    # ---- ranks of one job (torchrun)
    replicas_rel_diff: float = _t(
        1e-3, "DDP replicas all hold the same averaged gradients, so their norms agree to the bit; rank-local "
        "gradients (each rank's own batch) differ by far more than 0.1%"
    )
    replicas_diff_fraction: float = _t(
        0.5, "gradient norms apart on most steps is the rule, not an odd step (a rank that skipped a step)"
    )
    # ---- parameters and modes
    stale_fraction: float = _t(
        0.5, "most parameters still holding the last step's gradient when the new one arrives: no zero_grad"
    )
    mode_min_fraction: float = _t(0.1, "eval mode during at least a tenth of the training steps is not a one-off")
    # ---- the loss's op graph (loss misuse)
    prob_tolerance: float = _t(
        1e-3, "probability rows sum to 1 and log-probabilities stay <= 0 within float32 round-off, far inside 1e-3"
    )
    pad_target_share: float = _t(
        0.1, "a tenth of a cross entropy's targets being padding: the loss and its gradient lean on predicting padding"
    )
    pad_run_share: float = _t(
        0.25, "a quarter of the input sequences ending in a run of one value: padding to the longest of the batch"
    )
    # ---- the validation pass
    overfit_min_points: float = _t(4, "four evaluations: a best point and a sustained rise after it, not one noisy pass")
    overfit_val_rise: float = _t(
        0.1, "the validation loss 10% above its minimum, at the end and over most evaluations after it"
    )
    overfit_gap_growth: float = _t(0.1, "the validation-minus-training gap grew by a tenth of the best validation loss")
    overfit_train_drop: float = _t(0.05, "while the training loss kept falling, by 5% or more after the best point")
    chance_tolerance: float = _t(
        0.1, "a validation loss within 10% of chance (or above: the label entropy, ln(classes) if unknown) is a guess"
    )
    chance_acc_margin: float = _t(0.03, "a validation accuracy within 3 points of the majority share (1/classes) is chance on a few hundred rows")
    memorise_fraction: float = _t(
        0.7, "a training loss under 70% of the chance loss while validation stays at chance is memorised"
    )
    one_class_min_labels: float = _t(
        32, "a few dozen validation labels all of one class among several is no accident of a small split"
    )
    leak_near: float = _t(
        0.05, "a validation row within 5% of the typical row-to-row distance of a training row is a (near) copy"
    )
    leak_exact: float = _t(1e-6, "at this relative distance the signatures coincide: an exact copy")
    leak_min_rows: float = _t(3, "one or two coincidences can be chance (repeated samples in real data)")
    leak_min_fraction: float = _t(0.01, "one validation row in a hundred copied from training biases the validation loss")
    leak_train_eval: float = _t(
        0.9, "an evaluation batch made of training rows (90% or more) is a pass over the training data, not leakage"
    )
    # ---- gradients through a recurrent loop (a module called many times per forward)
    tt_growth_per_call: float = _t(
        1.1, "the gradient grows 10% per time step going back: over 50 steps that is 100x"
    )
    tt_explode_ratio: float = _t(
        1e3, "the gradient reaching the first time step 1000x the last one's: early steps dominate every update"
    )

    @classmethod
    def reasons(cls) -> dict[str, tuple[float, str]]:
        return {f.name: (f.default, f.metadata["reason"]) for f in fields(cls)}

    @classmethod
    def from_overrides(cls, overrides: Thresholds | dict[str, Any] | None) -> Thresholds:
        """Defaults with ``overrides`` applied; an unknown name or a non-number is a ValueError."""
        if overrides is None:
            return cls()
        if isinstance(overrides, Thresholds):
            return overrides
        if not isinstance(overrides, dict):
            raise ValueError(f"thresholds must be a dict or Thresholds, got {type(overrides).__name__}")
        known = {f.name for f in fields(cls)}
        clean: dict[str, float] = {}
        for key, value in overrides.items():
            name = str(key).lower()
            if name not in known:
                raise ValueError(f"unknown threshold {key!r}; known: {', '.join(sorted(known))}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"threshold {key!r} must be a number, got {value!r}")
            clean[name] = float(value)
        return replace(cls(), **clean)
