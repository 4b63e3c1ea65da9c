"""TrainguardCallback for the Hugging Face Trainer, and the same script unmodified under
``trainguard run --monitor``: loss and gradient norm equal to the Trainer's own logs with
gradient accumulation and clipping, its global_step across a resume, tiny GPT-2 and BERT."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: models come from configs
os.environ["TRANSFORMERS_OFFLINE"] = "1"
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainguard  # noqa: E402
from trainguard.cli import main as cli  # noqa: E402

SCRIPT = Path(__file__).with_name("hf_train.py")


def script_module():
    spec = importlib.util.spec_from_file_location("hf_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_logs(path) -> dict[int, dict]:
    """The Trainer's per-step logs, keyed by trainguard's step (HF logs step s as global_step s + 1)."""
    return {e["step"] - 1: e for e in json.loads(Path(path).read_text()) if "loss" in e}


@pytest.mark.parametrize("how", ["callback", "unmodified"])
def test_gpt2_accumulation_and_clipping_match_the_trainers_logs(tmp_path, how):
    args = [str(tmp_path / "out"), "--model", "gpt2", "--steps", "8", "--accumulate", "2", "--max-grad-norm", "1.0",
            "--history", str(tmp_path / "h.json")]
    logdir = tmp_path / "run"
    if how == "callback":
        script_module().main([*args, "--callback", str(logdir)])
    else:
        assert cli(["run", "--monitor", "--every", "5", "--logdir", str(logdir), str(SCRIPT), *args]) == 0
    logs = hf_logs(tmp_path / "h.json")
    s = trainguard.open(logdir).scalars()
    assert sorted(logs) == list(range(8)) == [st for st, _ in s["loss"]]
    # The loss the Trainer logs (the sum of the two micro-batches' losses) and its grad_norm, taken
    # before max_grad_norm clipped it: above 1.0 here, so a reading after clipping would differ.
    assert [v for _, v in s["loss"]] == pytest.approx([logs[k]["loss"] for k in range(8)], rel=1e-6)
    assert [v for _, v in s["grad_norm"]] == pytest.approx([logs[k]["grad_norm"] for k in range(8)], rel=1e-5)
    assert max(logs[k]["grad_norm"] for k in range(8)) > 1.0
    assert [v for _, v in s["lr/0"]] == pytest.approx([logs[k]["learning_rate"] for k in range(8)], rel=1e-6)


def test_bert_resumed_from_a_trainer_checkpoint_continues_the_steps(tmp_path):
    mod = script_module()
    logdir, out = tmp_path / "run", tmp_path / "out"
    mod.main([str(out), "--model", "bert", "--steps", "6", "--save-steps", "6", "--callback", str(logdir)])
    trainer = mod.main([str(out), "--model", "bert", "--steps", "12", "--resume", str(out / "checkpoint-6"),
                        "--callback", str(logdir), "--history", str(tmp_path / "h.json")])
    assert trainer.state.global_step == 12
    run = trainguard.open(logdir)
    assert [st for st, _ in run.scalars("loss")["loss"]] == list(range(12))
    logs = hf_logs(tmp_path / "h.json")
    got = dict(run.scalars("loss")["loss"])
    assert [got[k] for k in range(6, 12)] == pytest.approx([logs[k]["loss"] for k in range(6, 12)], rel=1e-6)
    assert sorted({r["step"] for r in run.layer_stats()}) == [0, 5, 10]
    assert run.meta["monitor"]["status"] == "finished"
    assert any(r["layer"].startswith("bert.encoder.layer.1") for r in run.layer_stats(kind="activation"))


KILLED = '''
import os, signal, sys
sys.path.insert(0, {here!r})
import hf_train
from transformers import TrainerCallback
from transformers import Trainer as _Trainer


class KillAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):  # checkpoint-6 is on disk: die as kill -9 does
        os.kill(os.getpid(), signal.SIGKILL)


hf_train.Trainer = lambda *a, callbacks=(), **k: _Trainer(*a, callbacks=[*callbacks, KillAfterSave()], **k)
hf_train.main([{out!r}, "--model", "bert", "--steps", "12", "--save-steps", "6", "--callback", {logdir!r}])
'''


def _killed_after_checkpoint(tmp_path):
    """A Trainer (BERT, the callback) killed with SIGKILL right after it saved checkpoint-6."""
    logdir, out = tmp_path / "run", tmp_path / "out"
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(here=str(SCRIPT.parent), out=str(out), logdir=str(logdir)))
    path = os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": path})
    assert proc.returncode == -9, proc.stderr[-2000:]
    return logdir, out


def test_a_run_killed_and_resumed_from_a_trainer_checkpoint_ends_finished(tmp_path):
    # A Trainer killed with SIGKILL right after saving checkpoint-6, then resumed from it (found on
    # a tiny Wav2Vec2ForCTC fine-tuning shaped like transformers' run_speech_recognition_ctc.py):
    # the resumed process appended every step up to the last, yet the run stayed "running (still
    # being written, or its process was killed)", as the killed process had left it.
    logdir, out = _killed_after_checkpoint(tmp_path)
    assert trainguard.open(logdir).status == "running"  # what the killed process left
    trainer = script_module().main([str(out), "--model", "bert", "--steps", "12", "--resume",
                                    str(out / "checkpoint-6"), "--callback", str(logdir)])
    assert trainer.state.global_step == 12
    run = trainguard.open(logdir)
    assert run.status == "finished" and run.meta["monitor"]["status"] == "finished"
    assert [st for st, _ in run.scalars("loss")["loss"]][-6:] == list(range(6, 12))



def test_a_run_killed_after_a_trainer_checkpoint_holds_every_step_the_checkpoint_holds(tmp_path):
    # The steps between the last flush and the checkpoint were in the writer's queue when the kill
    # came, and the resumed process starts after them: a hole in the run for good (steps 10-19 of
    # a Seq2SeqTrainer killed right after checkpoint-20; found on a tiny T5 fine-tuned as in
    # transformers' examples/pytorch/translation/run_translation.py).
    logdir, out = _killed_after_checkpoint(tmp_path)
    assert [st for st, _ in trainguard.open(logdir).scalars("loss").get("loss", [])] == list(range(6))
    script_module().main([str(out), "--model", "bert", "--steps", "12", "--resume", str(out / "checkpoint-6"),
                          "--callback", str(logdir)])
    assert [st for st, _ in trainguard.open(logdir).scalars("loss")["loss"]] == list(range(12))

CRASHING = '''
import sys
sys.path.insert(0, {here!r})
import hf_train
from transformers import Trainer, TrainerCallback, TrainingArguments
from trainguard.integrations.transformers import TrainguardCallback


class Planted(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 25:
            raise RuntimeError("the data loader ran dry")


model, task = hf_train.build("gpt2")
targs = TrainingArguments(output_dir={out!r}, max_steps=40, per_device_train_batch_size=4, logging_steps=1,
                          report_to=[], use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no")
Trainer(model=model, args=targs, train_dataset=hf_train.Phrases(256, task),
        callbacks=[TrainguardCallback({logdir!r}, every=5), Planted()]).train()
'''


def test_a_trainer_that_crashes_is_stored_as_crashed(tmp_path):
    # The Trainer has no exception callback: the run is closed when the interpreter exits, and
    # must then say that the script crashed, never "finished" with a healthy verdict.
    logdir = tmp_path / "run"
    script = tmp_path / "crashing.py"
    script.write_text(CRASHING.format(here=str(SCRIPT.parent), out=str(tmp_path / "out"), logdir=str(logdir)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": str(SCRIPT.parent)})
    assert proc.returncode == 1 and "the data loader ran dry" in proc.stderr
    run = trainguard.open(logdir)
    assert (run.status, run.meta["error"], run.meta["crash_step"]) == ("crashed", "RuntimeError: the data loader ran dry", 25)
    findings = run.findings()
    assert findings[0]["kind"] == "script_crashed" and "step 25" in findings[0]["title"]
    assert not any(f["kind"] == "healthy" for f in findings)


def _train_under_callback(logdir, steps, *, start=0, warm_up=False):
    """A plain loop driven through TrainguardCallback(record=True)'s Trainer hooks (fakes of the
    Trainer's args and state): what trl's DPOTrainer resumed from checkpoint-10 does to the run."""
    from types import SimpleNamespace

    import torch

    from trainguard.integrations.transformers import TrainguardCallback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = TrainguardCallback(logdir, record=True, monitor=False, mode="full_health")
    args, state = SimpleNamespace(process_index=0, world_size=1), SimpleNamespace(global_step=start)
    cb.on_train_begin(args, state, None, model=model)
    if warm_up:  # the first process ran other ops first: its op ids are not the resumed one's
        torch.ones(3).exp().sum()
    for step in range(start, steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        cb.on_step_begin(args, state, None)
        loss = (model(x) - x[:, :1]).pow(2).mean()  # LOSS LINE
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.global_step += 1
        cb.on_step_end(args, state, None)
    cb.on_train_end(args, state, None)


def _ops_of(run, step):
    out = []
    for e in run.executions(0, run.count()):
        if e["step"] == step:
            frames = run.stack(e["stack_id"]) if e["stack_id"] is not None else []
            out.append((e["op"], e["module"], [(f["filename"], f["lineno"]) for f in frames][-1:]))
    return out


def test_a_recording_resumed_into_its_run_keeps_both_processes_ops_and_stacks(tmp_path):
    # huggingface/trl DPOTrainer with TrainguardCallback(record=True), killed after checkpoint-10 and
    # resumed into the same run: the resumed process's executions were stored under the first
    # process's op names and stacks (ids both processes numbered from 1: step 19 of the resumed
    # recording showed "aten.embedding in adam.py"), and its first new source file stopped the
    # writer ("IntegrityError: UNIQUE constraint failed: source_files.path").
    _train_under_callback(tmp_path / "whole", 8, warm_up=True)
    _train_under_callback(tmp_path / "resumed", 4, warm_up=True)
    _train_under_callback(tmp_path / "resumed", 8, start=4)
    whole, resumed = trainguard.open(tmp_path / "whole"), trainguard.open(tmp_path / "resumed")
    assert resumed.meta.get("writer_error") is None, resumed.meta.get("writer_error")
    assert resumed.status == "finished"
    for step in (0, 3, 4, 7):
        assert _ops_of(resumed, step) == _ops_of(whole, step) != [], step


@pytest.mark.parametrize("how", ["callback", "unmodified"])
def test_a_loss_module_holding_the_model_keeps_the_models_own_names(tmp_path, how):
    # sentence-transformers' SentenceTransformerTrainer calls its loss module (SoftmaxLoss: the
    # model and a classifier of its own), which calls the model. Under `trainguard run --monitor` the
    # loss was the model found: every layer and parameter was named after the loss's attribute
    # (model.0.model.encoder.layer.0..., not the model's state_dict name 0.model.encoder.layer.0...),
    # and the callback, given the Trainer's model, never watched the classifier the optimizer trains.
    spec = importlib.util.spec_from_file_location("hf_loss_module", Path(__file__).with_name("hf_loss_module.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    logdir, args = tmp_path / "run", [str(tmp_path / "out"), "--steps", "4", "--save-steps", "2"]
    if how == "callback":
        mod.main([*args, "--callback", str(logdir)])
    else:
        assert cli(["run", "--monitor", "--every", "2", "--logdir", str(logdir), str(mod.__file__), *args]) == 0
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    names = [n for n, _ in mod.Encoder().named_parameters()]
    run = trainguard.open(logdir)
    watched = list(run.meta["monitor"]["params"])
    assert sorted(watched) == sorted([*names, "loss.classifier.weight", "loss.classifier.bias"]), watched[:4]
    if how == "unmodified":  # recorded too: the recorder names modules as the monitor does
        modules = {e["module"] for e in run.executions(0, run.count()) if e["module"] is not None}
        assert {"bert.encoder.layer.0.attention.self.query", "loss.classifier", "loss"} <= modules, sorted(modules)
        assert not any(m.startswith("model.") or m == "classifier" for m in modules), sorted(modules)
    # The Trainer's checkpoints (checkpoint-2, checkpoint-4) hold trainer.model only: a resume starts
    # the classifier again from its initialisation (sentence-transformers' SoftmaxLoss: the resumed
    # run's weights summed 156.4955 against 156.5223 uninterrupted, with or without trainguard).
    (f,) = [f for f in run.findings() if f["kind"] == "checkpoint_misses_loss_params"]
    assert f["evidence"]["params"] == ["loss.classifier.weight", "loss.classifier.bias"], f
    assert "resume_from_checkpoint" in f["title"] and "trainer.loss" in f["suggestion"], f


def _mean_loss_classifier(accepts_loss_kwargs=None):
    """A classifier shaped after transformers 5.25's ``BertForSequenceClassification.forward``
    (src/transformers/models/bert/modeling_bert.py): it takes ``**kwargs``, so the Trainer passes it
    ``num_items_in_batch`` and leaves the loss undivided by ``gradient_accumulation_steps``, but its
    loss is a plain mean ``CrossEntropyLoss`` that ignores that count."""
    import torch

    class MeanLossClassifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 2)

        def forward(self, input_ids, labels=None, **kwargs):
            logits = self.head(self.emb(input_ids).mean(1))
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    torch.manual_seed(0)
    model = MeanLossClassifier()
    if accepts_loss_kwargs is not None:
        model.accepts_loss_kwargs = accepts_loss_kwargs
    return model


@pytest.mark.parametrize("accepts_loss_kwargs", [None, False])
def test_a_trainer_that_does_not_divide_the_accumulated_loss_gets_the_trainers_fix(tmp_path, accepts_loss_kwargs):
    # transformers' run_glue.py (examples/pytorch/text-classification, 3034a13b) with
    # --gradient_accumulation_steps 4 on a BERT: the Trainer logged loss 2.78 for a cross entropy of
    # 0.696, and trainguard's fix said "divide each micro-batch's loss ... before backward() at
    # run_glue.py:552: `loss = loss / 4`", a line that is `trainer.train(...)`. The Trainer skips its
    # own division for a model whose forward takes **kwargs (model_accepts_loss_kwargs); the fix
    # that a Trainer user has is `model.accepts_loss_kwargs = False`, after which nothing is found.
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainguardCallback

    mod = script_module()
    logdir = tmp_path / "run"
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=8,
                              gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                              use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no")
    Trainer(model=_mean_loss_classifier(accepts_loss_kwargs), args=targs, train_dataset=mod.Phrases(64, "cls"),
            callbacks=[TrainguardCallback(logdir, every=2)]).train()
    found = [f for f in trainguard.open(logdir).findings() if f["kind"] == "accumulation_not_averaged"]
    if accepts_loss_kwargs is False:
        assert found == []
        return
    (f,) = found
    assert f["evidence"]["backward_per_step"] == 2 and f["evidence"]["divisor"] == pytest.approx(1)
    assert "model.accepts_loss_kwargs = False" in f["suggestion"] and "num_items_in_batch" in f["suggestion"], f
    assert "loss = loss / 2" not in f["suggestion"], f


KILLED_AT = '''
import os, signal, sys
sys.path.insert(0, {here!r})
import hf_train
from transformers import TrainerCallback
from transformers import Trainer as _Trainer


class KillAfterSave(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == {kill_at}:  # checkpoint-{kill_at} is on disk, and the run flushed
            os.kill(os.getpid(), signal.SIGKILL)


hf_train.Trainer = lambda *a, callbacks=(), **k: _Trainer(*a, callbacks=[*callbacks, KillAfterSave()], **k)
hf_train.main([{out!r}, "--model", "bert", "--steps", "12", "--save-steps", "3", *{how!r}])
'''


@pytest.mark.parametrize("how", ["callback", "unmodified"])
def test_a_trainer_resumed_from_an_earlier_checkpoint_replaces_the_steps_it_runs_again(tmp_path, how):
    # transformers' run_clm.py (examples/pytorch/language-modeling, 3034a13b) under
    # `trainguard run --monitor`, killed with SIGKILL after checkpoint-20 had run on to step 29,
    # then run again with --resume_from_checkpoint checkpoint-20 (and `trainguard run --resume`):
    # the run held steps 20-29 twice, the killed process's and the resumed one's.
    logdir, out = tmp_path / "run", tmp_path / "out"
    script = tmp_path / "killed.py"
    tail = ["--callback", str(logdir)] if how == "callback" else []
    script.write_text(KILLED_AT.format(here=str(SCRIPT.parent), out=str(out), kill_at=9, how=tail))
    path = os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH")) if p)
    cmd = [str(script)] if how == "callback" else ["-m", "trainguard", "run", "--monitor", "--logdir", str(logdir),
                                                   str(script)]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": path})
    assert proc.returncode in (-9, 137), proc.stderr[-2000:]
    assert [st for st, _ in trainguard.open(logdir).scalars("loss")["loss"]] == list(range(9))
    args = [str(out), "--model", "bert", "--steps", "12", "--resume", str(out / "checkpoint-6"),
            "--history", str(tmp_path / "h.json")]
    if how == "callback":
        script_module().main([*args, "--callback", str(logdir)])
    else:
        assert cli(["run", "--monitor", "--resume", "--logdir", str(logdir), str(SCRIPT), *args]) == 0
    run = trainguard.open(logdir)
    assert [st for st, _ in run.scalars("loss")["loss"]] == list(range(12))
    logs, got = hf_logs(tmp_path / "h.json"), dict(run.scalars("loss")["loss"])
    assert [got[k] for k in range(6, 12)] == pytest.approx([logs[k]["loss"] for k in range(6, 12)], rel=1e-6)


class _Tagged:
    """Token-tagging rows padded to 16 with input id 0, their padded labels ``pad_label``: a collator
    that pads labels with the pad token id instead of -100 (what transformers'
    DataCollatorForTokenClassification, used by examples/pytorch/token-classification/run_ner.py, avoids)."""

    def __init__(self, pad_label, n=128, seq=16):
        import torch

        g = torch.Generator().manual_seed(0)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(4, 9, (1,), generator=g))
            ids = torch.randint(5, 64, (length,), generator=g)
            pad = torch.zeros(seq - length, dtype=torch.long)
            self.rows.append({"input_ids": torch.cat([ids, pad]),
                              "attention_mask": torch.cat([torch.ones_like(ids), pad]),
                              "labels": torch.cat([(ids < 25).long() + (ids < 45).long(), pad + pad_label])})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.parametrize("pad_label", [0, -100])
def test_a_trainer_scoring_padded_labels_is_told_padding_in_loss(tmp_path, pad_label):
    # A BERT token classifier (run_ner.py's model) whose padded labels are 0, the pad token id, not
    # -100: the Trainer calls model(**inputs), the monitor read padding only off positional inputs,
    # and the run was called healthy with 69% of the targets padding.
    import torch
    from transformers import BertConfig, BertForTokenClassification, Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainguardCallback

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3, pad_token_id=0)
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=16,
                              learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                              disable_tqdm=True, save_strategy="no")
    Trainer(model=BertForTokenClassification(config), args=targs, train_dataset=_Tagged(pad_label),
            callbacks=[TrainguardCallback(tmp_path / "run", every=2)]).train()
    found = [f for f in trainguard.open(tmp_path / "run").findings() if f["kind"] == "padding_in_loss"]
    if pad_label == -100:
        assert found == []
        return
    (f,) = found
    assert f["evidence"]["class"] == 0 and f["evidence"]["share"] > 0.5, f
    assert "ignore_index=0" in f["suggestion"] and "-100" in f["suggestion"], f
