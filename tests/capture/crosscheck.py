"""Run one program under both recorder backends and compare their records field by field.

The records compared are the tuples handed to the writer (``RunWriter.put_executions``), with
device summaries resolved. Ops only one backend sees are allowed where the dispatch mode itself
changes what autograd runs (DESIGN.md: with any dispatch mode active every tensor counts as a
subclass): the mode's extra ``detach`` of each output autograd saves, and its out-of-place
gradient accumulation (``add`` where plain autograd runs ``add_``). Everything else must match:
the same ops in the same order, steps, phases, modules, stacks (as frames), forward ops of
backward ops, input producers, output dtypes, shapes, devices, summaries, and the taint and
origin of each execution (as finally stored: records sent again when they turned harmful count
in their last form), and the loss chains pinned before the first backward passes (the same loss
op, its window of executions in the batches' pins). Then the stored runs: each execution's taint and origin, the first harmful
value, the intended infinities and the harmful counts per step and op (the mode's own ops aside).
"""

from __future__ import annotations

import difflib
import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

import trainguard as tg
from trainguard.capture import _recorder
from trainguard.store import _writer, open_run

# (python op, native op): what the dispatch mode runs instead of plain autograd: a detach of each
# output autograd saves; a copy (new_empty_strided + copy_) of a gradient AccumulateGrad steals,
# where plain autograd detaches it.
MODE_ONLY = {"aten.detach.default", "aten.new_empty_strided.default", "aten.copy_.default"}
MODE_REPLACES = {("aten.add.Tensor", "aten.add_.Tensor"), ("aten.view.default", "aten._reshape_alias.default")}
# What plain PyTorch runs and the dispatch mode cannot see: an allocation of SDPA's backward, and
# the detach inside nn.Parameter() (torch stashes every dispatch mode around it).
PLAIN_ONLY = {"aten.empty.memory_format", "aten.detach.default"}


def sgd_program(model, call=None):
    """Two SGD steps of a small classifier, ``call`` (the model, or what wraps it: a compiled
    model, DDP) run on a fixed batch: a program for :func:`crosscheck`."""
    call = call or model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def program():
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(call(x), y).backward()
            opt.step()
    return program


def capture(make_program, tmp_path, backend: str, mode: str, seed: int = 0, **kw):
    """(records, stacks {id: frames}, modules {id: path}, the recorder) of ``make_program()()``,
    a fresh program built after seeding, so that both backends run the same one."""
    got = {"records": [], "stacks": {}, "modules": {}, "run": None, "pins": set(), "loss_ends": [], "sent": 0}
    by_seq: dict[int, tuple] = {}
    orig_exec, orig_stack, orig_module = (_writer.RunWriter.put_executions, _writer.RunWriter.put_stack,
                                          _writer.RunWriter.put_module)
    orig_loss_end = _recorder.Recorder._loss_end

    def put_executions(self, batch, must_keep=False):
        # The rows made as the writer makes them, on a thread without the dispatch mode (this
        # runs on the training thread: a step's hand-over is outside any op or graph call).
        with _disable_current_modes():
            resolved = _writer._resolve(batch)
        for r in resolved:
            by_seq[r[0]] = r
            got["sent"] += 1
        got["pins"].update(batch.pins or ())
        for r in batch.resend or ():  # sent again, harmful now: its last form is the record's
            by_seq[r[0]] = r
        return orig_exec(self, batch, must_keep=must_keep)

    def put_stack(self, sid, frames):
        got["stacks"][sid] = [tuple(f) for f in frames]
        return orig_stack(self, sid, frames)

    def put_module(self, mid, path, type_name):
        got["modules"][mid] = (path, type_name)
        return orig_module(self, mid, path, type_name)

    def loss_end(self, loss):  # the loss-chain pins (LOSS_PIN_WINDOW executions up to the loss's op)
        end = orig_loss_end(self, loss)
        got["loss_ends"].append(end)
        return end

    _writer.RunWriter.put_executions, _writer.RunWriter.put_stack, _writer.RunWriter.put_module = (
        put_executions, put_stack, put_module)
    _recorder.Recorder._loss_end = loss_end
    try:
        torch.manual_seed(seed)
        program = make_program()
        with tg.record(tmp_path / f"{backend}-{mode}", mode=mode, buffer=-1, backend=backend, **kw) as rec:
            program()
    finally:
        _writer.RunWriter.put_executions, _writer.RunWriter.put_stack, _writer.RunWriter.put_module = (
            orig_exec, orig_stack, orig_module)
        _recorder.Recorder._loss_end = orig_loss_end
    assert rec.backend == backend
    got["records"] = sorted(by_seq.values(), key=lambda r: r[0])
    got["run"] = open_run(tmp_path / f"{backend}-{mode}")
    return got, rec


def _same_float(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _same_summary(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(len(x) == len(y) and all(map(_same_float, x, y)) for x, y in zip(a, b))


def compare(py: dict, nat: dict) -> tuple[list[str], dict]:
    """(differences that are not the dispatch mode's own, counts of the mode's own)."""
    pr, nr = py["records"], nat["records"]
    pops, nops = [r[3] for r in pr], [r[3] for r in nr]
    # Aligned on (op, phase, module, outputs): the mode's own detaches sit among the plain ones.
    pkeys = [(r[3], r[2], py["modules"].get(r[4]), r[9]) for r in pr]
    nkeys = [(r[3], r[2], nat["modules"].get(r[4]), r[9]) for r in nr]
    sm = difflib.SequenceMatcher(a=pkeys, b=nkeys, autojunk=False)
    seq_map: dict[int, int] = {}  # python seq -> native seq
    mode_seqs: set[int] = set()
    plain_seqs: set[int] = set()
    problems: list[str] = []
    artefacts = {"mode_only": 0, "replaced": 0, "plain_only": 0}
    pairs = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            pairs += list(zip(range(i1, i2), range(j1, j2)))
            continue
        a, b = pops[i1:i2], nops[j1:j2]
        if tag == "replace" and len(a) == len(b) and all(
                (x, y) in MODE_REPLACES and pkeys[i][1:] == nkeys[j][1:]
                for x, y, i, j in zip(a, b, range(i1, i2), range(j1, j2))):
            pairs += list(zip(range(i1, i2), range(j1, j2)))
            artefacts["replaced"] += len(a)
            continue
        rest_a = [x for x in a if x not in MODE_ONLY]
        rest_b = [y for y in b if y not in PLAIN_ONLY]
        mode_seqs.update(pr[i][0] for i in range(i1, i2) if pops[i] in MODE_ONLY)
        plain_seqs.update(nr[j][0] for j in range(j1, j2) if nops[j] in PLAIN_ONLY)
        artefacts["mode_only"] += len(a) - len(rest_a)
        artefacts["plain_only"] += len(b) - len(rest_b)
        if rest_a or rest_b:
            problems.append(f"ops differ at python #{i1} / native #{j1}: {a} vs {b}")
    for i, j in pairs:
        seq_map[pr[i][0]] = nr[j][0]
    anchors = sorted(seq_map.items())
    # The mode's detach of an output autograd saves stands for that output in the backward ops
    # that read it (the native core finds the output itself, by its storage).
    detached = {r[0]: r[8][0][1] for r in pr if r[0] in mode_seqs and r[3] == "aten.detach.default"
                and r[8] and r[8][0][0] == "op"}

    # The detach inside nn.Parameter() that only the native core sees: the dispatch mode gives
    # the Parameter the producer of the tensor it was made from (capture/_params.py).
    plain_alias = {r[0]: r[8][0][1] for r in nr if r[0] in plain_seqs and r[3] == "aten.detach.default"
                   and r[8] and r[8][0][0] == "op"}

    def mapped(seq):
        """A recorded op's native number; for one filtered out, by the offset of the last recorded
        op before it (both backends number every op)."""
        if seq in seq_map:
            return seq_map[seq]
        before = [n - p for p, n in anchors if p < seq]
        return seq + (before[-1] if before else 0)

    def frames(got, sid):
        return got["stacks"].get(sid) if sid is not None else None

    for i, j in pairs:
        p, n = pr[i], nr[j]
        where = f"python seq {p[0]} / native seq {n[0]} ({p[3]})"
        if pops[i] != nops[j] and (pops[i], nops[j]) in MODE_REPLACES:
            continue  # the replaced op's inputs and outputs are the mode's own
        for k, name in ((1, "step"), (2, "phase"), (7, "health"), (9, "outputs")):
            if p[k] != n[k]:
                problems.append(f"{where}: {name} {p[k]!r} vs {n[k]!r}")
        if py["modules"].get(p[4]) != nat["modules"].get(n[4]):
            problems.append(f"{where}: module {py['modules'].get(p[4])} vs {nat['modules'].get(n[4])}")
        if frames(py, p[5]) != frames(nat, n[5]):
            problems.append(f"{where}: stack {frames(py, p[5])} vs {frames(nat, n[5])}")
        if (seq_map.get(p[6]) if p[6] is not None else None) != n[6]:
            problems.append(f"{where}: fwd_seq {p[6]} (-> {seq_map.get(p[6])}) vs {n[6]}")
        if len(p[8]) != len(n[8]):
            problems.append(f"{where}: inputs {p[8]} vs {n[8]}")
        else:
            for a, b in zip(p[8], n[8]):
                if a[0] == "op":
                    src = a[1]
                    while src in detached:
                        src = detached[src]
                    if src in mode_seqs:
                        continue  # made by the mode's own ops (AccumulateGrad's copy)
                    a = ("op", src)
                want = ("op", mapped(a[1])) if a[0] == "op" else a
                if a == ("input", None) and b[0] == "op" and b[1] in plain_seqs:
                    continue  # made by an op the mode cannot see
                if b[0] == "op" and want == ("op", plain_alias.get(b[1])):
                    continue  # a Parameter: the mode names the tensor it was made from
                if want != b:
                    problems.append(f"{where}: input {a} (-> {want}) vs {b}")
        if not _same_summary(p[10], n[10]):
            problems.append(f"{where}: summaries {p[10]} vs {n[10]}")
        if p[11] != n[11]:
            problems.append(f"{where}: taint {p[11]!r} vs {n[11]!r}")
        if (mapped(p[12]) if p[12] is not None else None) != n[12]:
            problems.append(f"{where}: origin {p[12]} (-> {seq_map.get(p[12])}) vs {n[12]}")
    problems += _compare_loss_pins(py, nat, mapped)
    problems += _compare_runs(py["run"], nat["run"], pairs, pr, nr, mapped)
    return problems, artefacts


def _compare_loss_pins(py: dict, nat: dict, mapped) -> list[str]:
    """The loss chains of the first backward passes: the same loss op under both, and its window
    of executions pinned in the batches handed to the writer."""
    problems = []
    want = [mapped(e) for e in py["loss_ends"]]
    if want != nat["loss_ends"]:
        problems.append(f"loss-chain ends {py['loss_ends']} (-> {want}) vs {nat['loss_ends']}")
    for name, got in (("python", py), ("native", nat)):
        for end in got["loss_ends"]:
            missing = set(range(max(0, end - _recorder.LOSS_PIN_WINDOW), end + 1)) - got["pins"]
            if missing:
                problems.append(f"{name}: loss chain up to seq {end} not pinned: {sorted(missing)[:10]}")
    return problems


_OWN_OPS = MODE_ONLY | PLAIN_ONLY | {op for pair in MODE_REPLACES for op in pair}


def _compare_runs(prun, nrun, pairs, pr, nr, mapped) -> list[str]:
    """The stored runs: each paired execution's taint and origin, the first harm, the intended
    infinities, the harmful counts (ops only one backend runs left out)."""
    problems = []
    for i, j in pairs:
        pe, ne = prun.execution(pr[i][0]), nrun.execution(nr[j][0])
        if pe["taint"] != ne["taint"] or (mapped(pe["origin"]) if pe["origin"] is not None else None) != ne["origin"]:
            problems.append(f"stored python seq {pe['seq']} / native {ne['seq']} ({pe['op']}): "
                            f"{pe['taint']}/{pe['origin']} vs {ne['taint']}/{ne['origin']}")
    pf, nf = prun.first_harm(), nrun.first_harm()
    if (pf is None) != (nf is None) or (pf and (
            {k: pf[k] for k in ("reason", "op", "step")} != {k: nf[k] for k in ("reason", "op", "step")}
            or mapped(pf["seq"]) != nf["seq"] or (mapped(pf["origin"]) if pf["origin"] is not None else None)
            != nf["origin"])):
        problems.append(f"first harm {pf} vs {nf}")
    if prun.intended() != nrun.intended():
        problems.append(f"intended {prun.intended()} vs {nrun.intended()}")

    def counts(run):
        return {(step, op): n for step, op, n in run._q("SELECT step, op, count FROM harmful") if op not in _OWN_OPS}
    pc, nc = counts(prun), counts(nrun)
    if pc != nc:
        problems.append(f"harmful counts {sorted(pc.items())} vs {sorted(nc.items())}")
    return problems


def crosscheck(make_program, tmp_path, mode: str = "full_health", **kw):
    """Both backends on a fresh ``make_program()`` each (seeded alike); returns
    (problems, artefacts, python's capture, native's capture)."""
    py, nat = (capture(make_program, tmp_path, backend, mode, **kw)[0] for backend in ("python", "native"))
    problems, artefacts = compare(py, nat)
    return problems, artefacts, py, nat
