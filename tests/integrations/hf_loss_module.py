"""A Trainer whose loss is a module holding the model and parameters of its own, as
sentence-transformers' ``SentenceTransformerTrainer`` trains ``SoftmaxLoss`` (examples/
sentence_transformer/training/nli/training_nli.py): ``compute_loss`` calls ``self.loss(features,
labels)``, the loss calls the model on each sentence and a classifier of its own on
``[u, v, |u - v|]``; the optimizer takes the loss's parameters. Pure transformers, tiny random BERT.

    python hf_loss_module.py OUT_DIR [--steps 8] [--callback LOGDIR] [--save-steps N]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import BertConfig, BertModel, Trainer, TrainingArguments  # noqa: E402

VOCAB, SEQ = 64, 8


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.a = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.b = torch.where(torch.rand(n, SEQ, generator=g) < 0.5, self.a, torch.randint(1, VOCAB, (n, SEQ), generator=g))
        self.labels = ((self.a == self.b).float().mean(1) > 0.5).long()

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return {"a": self.a[i], "b": self.b[i], "labels": self.labels[i]}


class Encoder(nn.Module):
    """SentenceTransformer([Transformer, Pooling]): a BERT whose token embeddings are mean-pooled."""

    def __init__(self):
        super().__init__()
        cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=SEQ)
        self.bert = BertModel(cfg, add_pooling_layer=False)

    def forward(self, ids):
        return self.bert(input_ids=ids).last_hidden_state.mean(1)


class SoftmaxLoss(nn.Module):
    def __init__(self, model, dim=32, num_labels=2):
        super().__init__()
        self.model = model
        self.classifier = nn.Linear(3 * dim, num_labels)

    def forward(self, a, b, labels):
        u, v = self.model(a), self.model(b)
        return nn.functional.cross_entropy(self.classifier(torch.cat([u, v, (u - v).abs()], 1)), labels)


class LossTrainer(Trainer):
    def __init__(self, *args, loss, **kwargs):
        self.loss = loss
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        self.optimizer = torch.optim.AdamW(self.loss.parameters(), lr=self.args.learning_rate)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = self.loss(inputs["a"], inputs["b"], inputs["labels"])
        return (loss, {}) if return_outputs else loss


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--callback", default=None)
    p.add_argument("--save-steps", type=int, default=0)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model = Encoder()
    callbacks = []
    if a.callback:
        from trainguard.integrations.transformers import TrainguardCallback

        callbacks.append(TrainguardCallback(a.callback, every=2))
    args = TrainingArguments(a.out, max_steps=a.steps, per_device_train_batch_size=16, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                             save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
                             remove_unused_columns=False)
    trainer = LossTrainer(model=model, args=args, train_dataset=Pairs(), data_collator=collate,
                          loss=SoftmaxLoss(model), callbacks=callbacks)
    trainer.train()
    return model, trainer


if __name__ == "__main__":
    main()
