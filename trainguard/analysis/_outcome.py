"""How the recorded script ended: a crash or a non-zero exit is said first and outranks "healthy"."""

from __future__ import annotations

from typing import Any

from trainguard.store import Finding


def script_outcome(meta: dict[str, Any]) -> dict[str, Any] | None:
    """``{step, exit_code, error, text}`` when the script raised or exited non-zero, else None.

    ``trainguard run`` stores ``exit_code``, ``error`` (the exception's type and message) and
    ``crash_step``; a ``with tg.record(...)`` block, a monitor closed by an error and the
    framework callbacks store the same (``trainguard.capture._ending``).
    """
    error, code, step = meta.get("error"), meta.get("exit_code"), meta.get("crash_step")
    step = step if isinstance(step, int) else None
    if error:
        where = f" at step {step}" if step is not None else ""
        return {"step": step, "exit_code": code, "error": str(error), "text": f"the script crashed{where}: {error}"}
    if isinstance(code, int) and code != 0 and meta.get("status") != "interrupted":
        return {"step": step, "exit_code": code, "error": None, "text": f"the script exited with code {code}"}
    return None


# torch's error for backward() from a tensor that nothing trainable leads to.
NOTHING_REQUIRES_GRAD = "does not require grad and does not have a grad_fn"


def _cause(meta: dict[str, Any], error: str | None) -> str:
    """Why backward() found nothing to differentiate, when the monitor saw layers run with gradients
    off inside the training forward (its ``no_grad_layers``); else nothing."""
    if not error or NOTHING_REQUIRES_GRAD not in error:
        return ""
    ran = set(((meta.get("monitor") or {}).get("no_grad_layers") or {}).values())
    if "checkpoint" in ran:
        return ("nothing in the loss's graph requires grad: the layers that train run inside activation "
                "checkpointing with `use_reentrant=True` (`torch.utils.checkpoint`, transformers' "
                "`gradient_checkpointing_enable`) whose inputs need no gradient (a frozen embedding, as under "
                "LoRA), so the checkpoint's output has none either. Call `model.enable_input_require_grads()` "
                "before training (or make the checkpoint's input require grad), or checkpoint with "
                "`use_reentrant=False`; ")
    if "no_grad" in ran:
        return ("nothing in the loss's graph requires grad: layers ran with gradients off inside the training "
                "forward (`torch.no_grad()`, `torch.set_grad_enabled(False)`); ")
    return ""


def _harm_step(meta: dict[str, Any], step: int | None) -> int | None:
    """The step of the first harmful NaN/Inf the recording saw, when it was made no later than the
    step the script ended in (what it stopped or crashed on), else None."""
    harm = meta.get("first_harm")
    if not (isinstance(harm, dict) and isinstance(harm.get("step"), int)) or (step is not None and harm["step"] > step):
        return None
    return harm["step"]


_NAMES_IT = "`trainguard report` on this run names the op and line that made it; fix that"


def _fault_before(meta: dict[str, Any], step: int | None) -> str | None:
    """What the guard read, at the loop's end, of a bad step before the one the script crashed
    in: ``"step 30 ended with loss nan"``; None when it read none."""
    guard = meta.get("guard")
    fault = guard.get("fault_before_crash") if isinstance(guard, dict) else None
    if not isinstance(fault, dict) or not isinstance(fault.get("step"), int):
        return None
    if step is not None and fault["step"] >= step:
        return None
    what = " and ".join(f"{label} {fault[key]}" for key, label in (("loss", "loss"), ("grad_norm", "gradient norm"))
                        if fault.get(key))
    return f"step {fault['step']} ended with {what}" if what else None


def _batch_held(meta: dict[str, Any], step: int | None) -> str | None:
    """What the guard found, as the loop closed, of NaN/Inf in the batch of the step the script
    crashed in: ``"its sample 17 holds nan in the batch itself"``; None when it found none."""
    guard = meta.get("guard")
    bad = guard.get("batch_nonfinite_at_crash") if isinstance(guard, dict) else None
    if not isinstance(bad, dict) or (step is not None and bad.get("step") != step):
        return None
    items = bad.get("samples") or bad.get("rows") or []
    kinds = " and ".join(bad.get("kinds") or ["non-finite values"])
    word = "sample" if bad.get("samples") else "row"
    shown = ", ".join(str(i) for i in items[:8]) + (f" ... ({len(items)} in all)" if len(items) > 8 else "")
    if not items:
        return f"its batch holds {kinds} itself"
    return f"its {word}{'s' if len(items) > 1 else ''} {shown} hold{'' if len(items) > 1 else 's'} {kinds} in the batch itself"


def outcome_finding(meta: dict[str, Any]) -> Finding | None:
    """The crash as a finding (severity error), so that no verdict calls the run healthy."""
    outcome = script_outcome(meta)
    if outcome is None:
        return None
    text = outcome["text"]
    harm = _harm_step(meta, outcome["step"])
    if outcome["error"] is None:
        # sys.exit(code), no exception: the check training loops make on a non-finite loss
        # (torchvision's detection reference, DeiT, MAE: "Loss is nan, stopping training").
        fix = "the script stopped itself (sys.exit, no exception: its last printed lines say why)"
        guard = meta.get("guard")
        if harm is not None:
            fix += f" after the first harmful NaN/Inf, in step {harm}: {_NAMES_IT}"
        elif isinstance(guard, dict) and not guard.get("events") and isinstance(guard.get("stopped_step"), int):
            # The guard judges a step's loss after backward(); a loop that reads the loss and exits on
            # a NaN before that (DINO, DeiT, MAE) leaves it nothing to rewind.
            fix += (f" in step {guard['stopped_step']} of the guarded loop, before the guard saw that step's loss: "
                    "a check such as `if not math.isfinite(loss.item()): sys.exit(1)` ends the run before "
                    "backward(), where the guard looks. Under the guard, drop that check (the guard stops a loss "
                    "that stays non-finite itself, naming its origin) and run again")
        fix += ", then judge training health on a run that finishes"
    elif (fault := _fault_before(meta, outcome["step"])) is not None:
        # Under the guard, which reads a step when the next one ends on an accelerator: the next step raised on the
        # weights the bad one left (a validated distribution, scipy's matcher) before it could rewind.
        at = meta.get("crash_at")
        if isinstance(at, dict) and "observer range" in str(at.get("detail", "")):
            # a fake-quant raising on the range its observer kept: no check the script could turn off
            keep = ("The guard cannot rewind a step that raised: drop or repair the non-finite samples before "
                    "training (`trainguard doctor` validates a data set)")
        else:
            keep = ("Keep such a check from raising under the guard, e.g. build a torch.distributions policy with "
                    "`validate_args=False`, so that it can rewind, replay and skip the bad batch")
        fix = (_cause(meta, outcome["error"]) + f"{fault} (on an accelerator the guard reads each step when the next one ends, and "
               f"this error came first, most likely from the NaN weights or state that step left). {keep}; or run "
               "`trainguard run --check-numerics` to stop at the op that made the first NaN/Inf")
    elif harm is None and (held := _batch_held(meta, outcome["step"])) is not None:
        # Under the guard: the step's batch held NaN/Inf, and a check raised on what it made before any loss
        # (detr's generalized_box_iou asserts on the NaN boxes of a corrupt image, in its matcher).
        fix = (f"the step it crashed in read a corrupt batch: {held}. The error most likely came from that value "
               "reaching a check inside the step (an `assert` or validation on what it made, as detr's "
               "generalized_box_iou asserts on NaN boxes), before any loss the guard could rewind. Drop or repair "
               "that sample before training (`trainguard doctor` validates a data set); `trainguard run "
               "--check-numerics` stops at the first op it made non-finite; or wrap the loop body in `with "
               "loop.guarded():`, and the guard rewinds and skips such a batch instead of ending the run")
    elif harm is not None:
        # An error raised on the NaN (a distribution's argument check on NaN logits, multinomial on
        # NaN probabilities: cleanrl's PPO): where it showed, not what to fix.
        fix = (_cause(meta, outcome["error"]) + f"the error came after the first harmful NaN/Inf, in step {harm}, "
               f"most likely from that value reaching the check that raised: {_NAMES_IT}, then judge training "
               "health on a run that finishes")
    else:
        fix = (_cause(meta, outcome["error"]) + "the statistics stop where the script did: fix the error it raised "
               "(its traceback was printed when it ran), then judge training health on a run that finishes")
    evidence = {k: v for k, v in outcome.items() if k != "text" and v is not None}
    at = meta.get("crash_at")
    if outcome["error"] is not None and isinstance(at, dict) and at.get("file"):
        # torch's own messages name no line or layer ("index out of range in self")
        where = f"{at['file']}:{at.get('line')}"
        evidence["at"] = where + (f": {at['code']}" if at.get("code") else "")
        if at.get("module"):
            evidence["module"] = at["module"]
        if at.get("module_path"):
            evidence["module_path"] = at["module_path"]
        if at.get("detail"):
            evidence["detail"] = at["detail"]
        inside = f" inside {at['module']}" if at.get("module") else ""
        if at.get("module") and at.get("module_path"):
            inside = f" inside {at['module_path']} ({at['module']})"
        text = f"{text} (raised{inside}, {'at' if at.get('raised_here') else 'called from'} {where})"
        if at.get("detail"):
            fix = f"{at['detail']}; " + fix
    return Finding(kind="script_crashed", severity="error", title=text[0].upper() + text[1:],
                   evidence=evidence, suggestion=fix, source="run")


# Rules that already say a NaN/Inf reached the loss or a gradient (with their own cause and fix).
NONFINITE_KINDS = ("nonfinite_loss", "nonfinite_gradient", "nonfinite_val_loss", "script_crashed")


def harm_finding(run: Any) -> Finding | None:
    """The recorder's first harmful NaN/Inf as a finding, so that no verdict calls the run healthy
    beside it: a warning when it reached no loss, gradient or parameter (a NaN validation metric that
    ReduceLROnPlateau read, a value the program read), an error when it did. None without one."""
    from trainguard.analysis._origin import origin

    if not callable(getattr(run, "first_harm", None)) or run.first_harm() is None:
        return None
    o = origin(run)
    if o is None:
        return None
    link = o.origin
    where = f"{link.op}" + (f" at {link.file}:{link.line}" if link.file else "") + (
        f" in step {link.step}" if link.step is not None else "")
    evidence: dict[str, Any] = {"op": link.op, "file": link.file, "line": link.line,
                                "reached_training": o.reached_training}
    if o.scheduler is not None:
        s = o.scheduler
        at = f" ({s['file']}:{s['line']})" if s.get("file") else ""
        title = (f"A NaN validation metric: {where} made it, and ReduceLROnPlateau.step{at} read it in "
                 f"{s['steps']} step(s) from step {s['first_step']}: the scheduler counts a NaN metric as no "
                 "improvement and lowers the learning rate after `patience` of them (no loss, gradient or "
                 "parameter was reached)")
        evidence["scheduler"] = s
    elif o.reached_training is False:
        title = f"A harmful NaN/Inf was made by {where}; it reached no loss, gradient or parameter"
        if o.read is not None:
            title += f", but the program read it in step {o.read['step']}" + (
                f" at {o.read['file']}:{o.read['line']}" if o.read.get("file") else "")
            evidence["read"] = o.read
        elif o.crashed is not None:
            title += f", but the script crashed in step {o.crashed['step']} ({o.crashed['error']}), most likely on it"
            evidence["crashed"] = o.crashed
    else:
        title = f"A harmful NaN/Inf was made by {where} and reached training"
    return Finding(kind="harmful_nonfinite", severity="warning" if o.reached_training is False else "error",
                   title=title, evidence=evidence, steps=(link.step, link.step) if link.step is not None else None,
                   suggestion=o.suggestion + "; `trainguard report` on this run shows the chain back to it",
                   source="run")


def interruption_finding(meta: dict[str, Any]) -> Finding | None:
    """A stop by a signal (a preemption, ``timeout``, ``kill``, Ctrl-C) as an info finding: the
    steps before it are judged as they are, and the verdict may still call them healthy."""
    if meta.get("status") != "interrupted" or not meta.get("signal"):
        return None
    step = meta.get("stopped_step")
    at = f" at step {step}" if isinstance(step, int) else ""
    how = "Ctrl-C" if meta["signal"] == "SIGINT" else "a preemption, `timeout` or `kill`"
    return Finding(kind="script_interrupted", severity="info",
                   title=f"The script was stopped by {meta['signal']}{at} ({how}): the findings cover the steps before it",
                   evidence={k: meta[k] for k in ("signal", "stopped_step", "exit_code") if meta.get(k) is not None},
                   suggestion="run it again to go on: a loop under `ckpt.resume(...)` (trainguard.CheckpointManager) "
                   "saves on SIGTERM and continues from that step", source="run")


def with_outcome(meta: dict[str, Any], findings: list[dict]) -> list[dict]:
    """``findings`` with the crash first and any "healthy" verdict taken out, when the script crashed."""
    crash = outcome_finding(meta)
    if crash is None:
        return findings
    rest = [f for f in findings if f.get("kind") not in ("healthy", "script_crashed")]
    return [crash.to_dict(), *rest]
