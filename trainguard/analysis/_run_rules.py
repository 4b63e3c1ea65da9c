"""Rules over how the run went as a whole: mixed precision kept overflowing; the ranks of a job
trained models of their own.

A crash is not a rule here: the run stores how it ended and :mod:`._outcome` makes it the
``script_crashed`` error (one mechanism for ``trainguard run``, the monitor and the callbacks).
"""

from __future__ import annotations

import math
import shlex

import numpy as np

from trainguard.analysis._context import Context, fmt
from trainguard.analysis._rules import register_rule
from trainguard.analysis._suggest import origin_of, where
from trainguard.store import Finding, RankedRun

SOURCE = "monitor"

BF16_TEXT = (
    "train in bfloat16, which has float32's range and needs no scaler: `torch.autocast(device, "
    "dtype=torch.bfloat16)` without a GradScaler (Lightning `precision='bf16-mixed'`, the HF Trainer `bf16=True`)"
)


def _longest_run(flags: np.ndarray) -> tuple[int, int]:
    """(length, start index) of the longest run of True values."""
    best, start, cur, cur_start = 0, 0, 0, 0
    for i, f in enumerate(flags):
        if f:
            if cur == 0:
                cur_start = i
            cur += 1
            if cur > best:
                best, start = cur, cur_start
        else:
            cur = 0
    return best, start


def _log2(x: float) -> str:
    if not (math.isfinite(x) and x > 0):
        return fmt(x)
    k = math.log2(x)
    return f"2**{int(k)}" if k == int(k) else fmt(x)


@register_rule("grad_scaler_skips")
def grad_scaler_skips(ctx: Context) -> list[Finding]:
    sk = ctx.amp_skipped
    if not len(sk):
        return []
    skipped = sk.values > 0.5
    if not skipped.any():
        return []
    steps = sk.steps
    # A step whose loss was NaN/Inf before any scaling (a 0/0 in a float32 forward pass, MAE's
    # norm_pix_loss without its eps) is skipped at every scale: nonfinite_loss names its origin, and
    # no float16 range or bfloat16 is the fix.
    loss_at = dict(zip(ctx.loss.steps.tolist(), ctx.loss.values.tolist()))
    lost = np.array([not math.isfinite(loss_at.get(int(s), 0.0)) for s in steps], dtype=bool)
    if (skipped & lost).any():
        n = int((skipped & lost).sum())
        skipped = skipped & ~lost
        if not skipped.any():
            ev = {"skipped_steps": n, "steps": len(steps), "nonfinite_loss_skips": n}
            return [Finding(kind="grad_scaler_skips", severity="info",
                            title=f"The GradScaler skipped {n} step(s) whose loss was already NaN/Inf",
                            evidence=ev,
                            suggestion="the loss was not finite before any scaling, so no scale or precision makes it "
                                       "finite: nonfinite_loss names the op and line that made it",
                            steps=(int(steps[0]), int(steps[-1])), source=SOURCE)]
    scale_at = dict(zip(ctx.amp_scale.steps.tolist(), ctx.amp_scale.values.tolist()))
    ok = np.nonzero(~skipped)[0]
    settle = int(ok[0]) if len(ok) else len(skipped)  # the scale halves at each skip until a step succeeds
    later = skipped[settle:]
    th = ctx.th
    ev: dict = {"skipped_steps": int(skipped.sum()), "steps": len(skipped), "settling_skips": settle}
    first_scale = scale_at.get(int(steps[0]))
    if first_scale is not None:
        ev["initial_scale"] = first_scale
    reasons, since = [], None
    if not len(ok):
        low = min((scale_at.get(int(s), math.inf) for s in steps), default=math.inf)
        ev["lowest_scale"] = low
        if low < th.amp_min_scale:
            reasons.append(f"every one of the {len(skipped)} steps was skipped and the scale fell to {fmt(low)}")
            since = int(steps[0])
    else:
        ev["settled_scale"] = scale_at.get(int(steps[settle]))
        run, at = _longest_run(later)
        if run > th.amp_skip_run:
            reasons.append(f"{run} steps in a row were skipped from step {int(steps[settle + at])}")
            since = int(steps[settle + at])
        w = min(int(th.amp_skip_window), len(later))
        if w >= th.min_loss_points:
            frac = np.convolve(later.astype(float), np.ones(w), "valid") / w
            i = int(np.argmax(frac))
            if frac[i] > th.amp_skip_fraction:
                reasons.append(f"{frac[i]:.0%} of {w} steps were skipped (from step {int(steps[settle + i])})")
                since = int(steps[settle + i]) if since is None else since
    if not reasons:
        settled = ev.get("settled_scale")
        text = f"The GradScaler skipped {ev['skipped_steps']} step(s)"
        if settle:
            text += " while its scale settled" + (f" from {_log2(first_scale)} to {_log2(settled)}" if
                                                   first_scale and settled else "")
        fix = "routine: the scaler halves its scale at each overflow until the gradients fit float16"
        if settle and settled:
            fix += f"; `GradScaler(init_scale={_log2(settled)})` starts there and skips none"
        return [Finding(kind="grad_scaler_skips", severity="info", title=text, evidence=ev, suggestion=fix,
                        steps=(int(steps[0]), int(steps[-1])), source=SOURCE)]
    fixes = []
    origin = origin_of(ctx.run, since_step=since, handled=True)  # the skipped steps' own values
    if origin:
        ev["origin"] = origin
        fixes.append(f"the first Inf/NaN of those steps came from {where(origin)} ({origin.get('phase')} pass): "
                     "compute it in float32 (`with torch.autocast(device, enabled=False):` around it, inputs "
                     "`.float()`) or keep its values in float16's range (max 65504)")
    else:
        fixes.append("record a skipped step (`trainguard run --monitor script.py`, or `trainguard.record`) to find the "
                     "op that overflows in float16 (max 65504)")
    fixes.append(BF16_TEXT)
    lowest = ev.get("lowest_scale")
    if lowest is not None and lowest < th.amp_min_scale:
        fixes.append("the scale is below 1, so scaling is not the cause: the gradients (or the loss) are Inf/NaN "
                     "at any scale")
    return [
        Finding(
            kind="grad_scaler_skips",
            severity="error",
            title="Mixed precision keeps overflowing: " + reasons[0] + "; those steps did not train",
            evidence=ev | {"reasons": reasons},
            suggestion="; ".join(fixes),
            steps=(since, int(steps[-1])) if since is not None else None,
            layers=[origin["module"]] if origin and origin.get("module") else [],
            source=SOURCE,
        )
    ]


@register_rule("replicas_not_synchronized")
def replicas_not_synchronized(ctx: Context) -> list[Finding]:
    """The ranks of one job (read as one: ``trainguard.open(job)``) whose gradients are plain tensors
    of the same parameters, but whose gradient norms differ step after step: nothing averages them
    (no DistributedDataParallel), so each rank trains a model of its own on its share of the data.
    Sharded gradients (FSDP2, tensor parallelism) and ranks holding different parameters (pipeline
    stages) differ by design, and are left alone."""
    run = ctx.run
    if not isinstance(run, RankedRun) or len(run.ranks) < 2:
        return []
    norms, shapes = [], []
    for r in run.rank_runs().values():
        sc = r.scalars()
        if any(v > 0 for _, v in sc.get("grad_sq_sharded", [])):
            return []
        norms.append({s: v for s, v in sc.get("grad_norm", []) if math.isfinite(v) and v > 0})
        params = (r.meta.get("monitor") or {}).get("params") or {}
        shapes.append({name: p.get("shape") for name, p in params.items() if isinstance(p, dict)})
    if any(s != shapes[0] for s in shapes):
        return []
    common = sorted(set.intersection(*(set(n) for n in norms)))
    if len(common) < ctx.th.min_loss_points:
        return []
    apart = [s for s in common if max(n[s] for n in norms) > (1 + ctx.th.replicas_rel_diff) * min(n[s] for n in norms)]
    if len(apart) < ctx.th.replicas_diff_fraction * len(common):
        return []
    s = apart[0]
    values = ", ".join(f"rank {k} {fmt(n[s])}" for k, n in zip(run.ranks, norms))
    return [
        Finding(
            kind="replicas_not_synchronized",
            severity="error",
            title=f"The {len(run.ranks)} ranks train separate models: their gradients are never averaged "
            f"(the gradient norms differ at {len(apart)} of {len(common)} steps; step {s}: {values})",
            evidence={"steps_compared": len(common), "steps_differing": len(apart), "first_step": s,
                      "grad_norms": {k: n[s] for k, n in zip(run.ranks, norms)}},
            suggestion="wrap the model in `torch.nn.parallel.DistributedDataParallel(model)` after "
            "`init_process_group` (on CPU without `device_ids`), and train and save that; without it each rank "
            "learns from its own share of the data and rank 0's checkpoint holds its copy alone "
            "(pytorch/examples' imagenet/main.py wraps the model only on an accelerator)",
            source=SOURCE,
        )
    ]


@register_rule("checkpoint_misses_loss_params")
def checkpoint_misses_loss_params(ctx: Context) -> list[Finding]:
    """A framework that checkpoints its model (the HF Trainer's ``checkpoint-N`` holds
    ``trainer.model``) while the optimizer also trains parameters of the loss module that holds the
    model (sentence-transformers' SoftmaxLoss classifier, TSDAE's decoder): a resume from such a
    checkpoint restores the model and the optimizer's moments for them, and starts them again from
    their initialisation."""
    saved = ctx.meta.get("framework_checkpoint")
    held = [p for p in ctx.meta.get("loss_params") or [] if (ctx.params.get(p) or {}).get("requires_grad")]
    if not isinstance(saved, dict) or not held:
        return []
    names = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    return [
        Finding(
            kind="checkpoint_misses_loss_params",
            severity="warning",
            title=f"The Trainer's checkpoints hold its model, not {names}, which the optimizer trains: "
            "resume_from_checkpoint starts them again from their initial values",
            evidence={"params": held, "first_checkpoint_step": saved.get("first_step")},
            suggestion="save the loss module's own parameters beside each checkpoint and load them before "
            "resuming, e.g. a TrainerCallback whose on_save writes `trainer.loss.state_dict()` into "
            "`checkpoint-{global_step}` and a `trainer.loss.load_state_dict(...)` before "
            "`trainer.train(resume_from_checkpoint=...)`; or train with a loss that has no parameters of its own "
            "(sentence-transformers: MultipleNegativesRankingLoss, CoSENTLoss)",
            source=SOURCE,
        )
    ]


def _steps_text(steps: list[int]) -> str:
    """``17, 30-39``: steps as ranges."""
    out: list[str] = []
    for s in sorted(steps):
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _script(run) -> str:
    """The script and its arguments as the run's command line gave them (``script.py`` when unknown)."""
    argv = (getattr(run, "meta", None) or {}).get("argv") or []
    for i, a in enumerate(argv):
        if isinstance(a, str) and a.endswith(".py") and not a.replace("\\", "/").endswith("trainguard/__main__.py"):
            return shlex.join(str(x) for x in argv[i:])
    return "script.py"


@register_rule("iterations_skipped")
def iterations_skipped(ctx: Context) -> list[Finding]:
    """The loop skipped iterations itself (capture/_skips): the model ran its training forward, the
    program checked the loss, found NaN/Inf and went on without backward() or optimizer.step()
    (normflows' ``if ~(torch.isnan(loss) | torch.isinf(loss)): loss.backward()``). Those batches
    trained nothing, and the loss curve and every other rule leave them out."""
    sk = ctx.meta.get("skipped_iterations")
    if not isinstance(sk, dict) or not sk.get("count"):
        return []
    n = int(sk["count"])
    first = sk.get("first") or {}
    trained = {int(s) for s in ctx.loss.steps.tolist()}
    steps = [int(s) for s in sk.get("steps") or []]
    iterations = len(trained | set(steps)) + max(n - len(steps), 0)
    at = first.get("step")
    value = fmt(first.get("loss"))
    more = n - 1
    title = (f"{n} of {iterations} iterations ran the model but never called backward(): the loop skipped "
             f"{'them' if n > 1 else 'it'}; the loss was {value} at step {at}")
    if more:
        title += f" (and non-finite at {more} later step{'s' if more > 1 else ''})"
    ev: dict = {"skipped": n, "iterations": iterations, "first": first, "nonfinite": sk.get("nonfinite") or {}}
    if steps:
        ev["steps"] = _steps_text(steps)
    # Every iteration after the last one that trained was skipped: training stopped there.
    last_trained = max(trained) if trained else None
    after = [s for s in steps if last_trained is None or s > last_trained]
    fixes = []
    check = f" at {first['file']}:{first['line']}" if first.get("file") else ""
    fixes.append(f"your loop checks the loss for NaN/Inf{check} and skips the update when it is not finite: "
                 + (f"those {n} batches trained nothing, and the loss curve and the other findings leave them out"
                    if n > 1 else "that batch trained nothing, and the loss curve and the other findings leave it out"))
    if len(after) > 1 and len(after) > len(steps) // 2:
        ev["skipped_from"] = after[0]
        stopped = f"training stopped at step {last_trained}" if last_trained is not None else "nothing trained"
        fixes.append(f"from step {after[0]} on every iteration was skipped: {stopped} while the script went on")
    origin = origin_of(ctx.run, since_step=at if isinstance(at, int) else None)
    if origin:
        ev["origin"] = origin
        fixes.append(f"the first NaN/Inf of those steps came from {where(origin)}")
    else:
        script = _script(ctx.run)
        fixes.append(f"find where the first NaN/Inf comes from: `trainguard run --check-numerics {script}` stops at "
                     "the op that made it, with its line and inputs (`trainguard run --monitor` records it for "
                     "`trainguard report`)")
    severity = "error" if n / max(iterations, 1) > ctx.th.skipped_error_fraction or "skipped_from" in ev else "warning"
    return [Finding(kind="iterations_skipped", severity=severity, title=title, evidence=ev,
                    suggestion="; ".join(fixes), steps=(int(at), int(sk.get("last", first).get("step", at)))
                    if isinstance(at, int) else None, source=SOURCE)]
