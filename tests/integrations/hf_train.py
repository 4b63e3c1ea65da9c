"""A Hugging Face Trainer script, run by the tests both with ``TrainguardCallback`` and unmodified under
``trainguard run --monitor``. Shaped after transformers' ``examples/pytorch/language-modeling/run_clm.py``
and ``text-classification/run_glue.py`` (a model from a config, a dataset, ``TrainingArguments``,
``Trainer.train``), with tiny random-init models and synthetic data: nothing is downloaded.

    python hf_train.py OUT_DIR --model gpt2|bert --steps 8 [--accumulate 2] [--max-grad-norm 1.0]
                       [--callback LOGDIR] [--resume CKPT] [--save-steps N] [--history OUT.json]
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

VOCAB, SEQ = 64, 16


class Phrases(torch.utils.data.Dataset):
    """Token sequences cut from a repeating random phrase (something to learn), or labelled by their
    first token's parity for classification."""

    def __init__(self, n, task):
        g = torch.Generator().manual_seed(0)
        phrase = torch.randint(0, VOCAB, (11,), generator=g)
        stream = phrase.repeat(n * SEQ // 11 + 2)
        starts = torch.randint(0, 11, (n,), generator=g)
        self.rows = [stream[s:s + SEQ] for s in starts.tolist()]
        self.task = task

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]
        label = ids.clone() if self.task == "lm" else (ids[0] % 2)
        return {"input_ids": ids, "labels": label}


def build(model_name):
    torch.manual_seed(0)
    if model_name == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
        return GPT2LMHeadModel(cfg), "lm"
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=2)
    return BertForSequenceClassification(cfg), "cls"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--callback", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--history", default=None)
    args = p.parse_args(argv)

    model, task = build(args.model)
    callbacks = []
    if args.callback:
        from trainguard.integrations.transformers import TrainguardCallback

        callbacks.append(TrainguardCallback(args.callback, every=5))
    targs = TrainingArguments(
        output_dir=args.out_dir, max_steps=args.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate, max_grad_norm=args.max_grad_norm, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Phrases(256, task), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume)
    if args.history:
        with open(args.history, "w") as f:
            json.dump(trainer.state.log_history, f)
    return trainer


if __name__ == "__main__":
    main()
