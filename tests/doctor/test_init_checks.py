"""init_checks: shapes, initial loss against chance, parameter counts."""

from __future__ import annotations

import inspect
import io
import json
import math

import pytest
import torch
from rich.console import Console
from torch import nn

from trainguard import doctor
from trainguard.store import dumps


def kinds(r) -> set[str]:
    return {f.kind for f in r.findings() if f.is_problem}


def test_healthy_classifier(mlp, batch):
    r = doctor.init_checks(mlp, batch, nn.CrossEntropyLoss())
    assert r.passed and kinds(r) == set()
    assert r.output_shape == [32, 10] and r.target_shape == [32] and r.input_shape == [32, 20]
    assert r.task == "classification" and r.num_classes == 10
    assert r.expected_loss == pytest.approx(math.log(10)) and r.expected_rule == "ln 10"
    assert r.initial_loss == pytest.approx(math.log(10), rel=0.1)
    # 20*64+64 + 64*64+64 + 64*10+10
    assert (r.parameters, r.trainable, r.frozen) == (6154, 6154, 0)
    assert r.by_module == {"0": {"parameters": 1344, "trainable": 1344}, "2": {"parameters": 4160, "trainable": 4160},
                           "4": {"parameters": 650, "trainable": 650}}


def test_over_confident_init_is_flagged(mlp, batch):
    with torch.no_grad():
        mlp[4].weight.mul_(50)
    r = doctor.init_checks(mlp, batch, nn.CrossEntropyLoss())
    assert kinds(r) == {"initial_loss_high"} and not r.passed
    f = next(f for f in r.findings() if f.kind == "initial_loss_high")
    assert f.evidence["ratio"] > 1.5


def test_initial_loss_below_chance_is_flagged(batch):
    x, y = batch

    class Cheater(nn.Module):  # "knows" the labels before training: a leak
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(20, 10)

        def forward(self, inp):
            return self.fc(inp) + 10 * nn.functional.one_hot(y, 10)

    assert "initial_loss_low" in kinds(doctor.init_checks(Cheater(), (x, y), nn.CrossEntropyLoss()))


def test_an_initial_loss_of_exactly_zero_is_flagged():
    # pytorch/examples' distributed/ddp-tutorial-series (multigpu_torchrun.py's load_train_objs):
    # torch.nn.Linear(20, 1) trained with F.cross_entropy against float targets of shape [B, 1]. The
    # log_softmax of one score is 0: the loss is 0 and every gradient 0 whatever the model does. The
    # doctor passed init_checks ("initial loss -0") and blamed a .detach() for the zero gradients.
    torch.manual_seed(0)
    x, y = torch.rand(32, 20), torch.rand(32, 1)
    r = doctor.init_checks(nn.Linear(20, 1), (x, y), nn.functional.cross_entropy)
    assert "initial_loss_zero" in kinds(r) and not r.passed
    f = next(f for f in r.findings() if f.kind == "initial_loss_zero")
    assert "one output per sample" in f.suggestion and "cross_entropy" in f.suggestion


def test_broadcasting_regression_output_is_an_error(batch):
    x, _ = batch
    r = doctor.init_checks(nn.Linear(20, 1), (x, torch.randn(32)), nn.MSELoss())
    f = next(f for f in r.findings() if f.kind == "output_target_shape")
    assert f.severity == "error" and f.evidence["broadcast"] == [32, 32]
    assert r.task == "regression" and r.expected_loss is None


def test_binary_expects_ln2(batch):
    x, _ = batch
    r = doctor.init_checks(nn.Linear(20, 1), (x, (torch.rand(32, 1) > 0.5).float()), nn.BCEWithLogitsLoss())
    assert r.expected_loss == pytest.approx(math.log(2)) and r.passed


def test_labels_out_of_range(mlp, batch):
    x, y = batch
    r = doctor.init_checks(mlp, (x, y + 3), nn.CrossEntropyLoss())
    f = next(f for f in r.findings() if f.kind == "labels_out_of_range")
    assert f.evidence["max_label"] == int((y + 3).max()) and f.evidence["classes"] == 10
    assert "loss_failed" in kinds(r)  # and the loss itself raised: reported, not thrown


def test_forward_that_raises_is_reported(mlp, batch):
    x, y = batch
    r = doctor.init_checks(mlp, (x[:, :5], y), nn.CrossEntropyLoss())
    assert kinds(r) == {"forward_failed"} and r.output_shape is None and r.verdict == "fail"


def test_batch_dimension_lost(batch):
    x, y = batch

    class Flattens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(20, 10)

        def forward(self, inp):
            return self.fc(inp).view(-1)

    assert "output_batch_mismatch" in kinds(doctor.init_checks(Flattens(), (x, y), nn.CrossEntropyLoss()))


def test_no_gradient_path_and_frozen_counts(mlp, batch):
    for p in mlp.parameters():
        p.requires_grad_(False)
    r = doctor.init_checks(mlp, batch, nn.CrossEntropyLoss())
    assert {"no_gradient_path", "no_trainable_parameters"} <= kinds(r)
    assert (r.trainable, r.frozen) == (0, 6154)


def test_non_scalar_loss(mlp, batch):
    assert "loss_not_scalar" in kinds(doctor.init_checks(mlp, batch, nn.CrossEntropyLoss(reduction="none")))


def test_num_classes_override_and_eval_mode_note(mlp, batch):
    mlp.eval()
    r = doctor.init_checks(mlp, batch, nn.CrossEntropyLoss(), num_classes=12)
    assert r.expected_rule == "ln 12"
    assert any(f.kind == "model_in_eval_mode" for f in r.findings())
    assert not mlp.training


def test_report_serialises_and_renders(mlp, batch):
    r = doctor.init_checks(mlp, batch, nn.CrossEntropyLoss())
    d = json.loads(dumps(r.to_dict()))
    assert d["parameters"] == 6154 and d["verdict"] == "pass"
    buf = io.StringIO()
    Console(file=buf, width=120).print(r)
    assert "6,154" in buf.getvalue()


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_classes=1), "num_classes"),
    (dict(batch=[torch.zeros(3, 20)]), "pair"),
    (dict(loss_fn="ce"), "callable"),
    (dict(loss_fn=lambda o, t: 1.0), "must return a tensor"),
])
def test_bad_inputs_are_value_errors(kwargs, match, mlp, batch):
    args = dict(model=mlp, batch=batch, loss_fn=nn.CrossEntropyLoss())
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        doctor.init_checks(**args)


class TinyLM(nn.Module):
    """A language model shaped like karpathy/minGPT's GPT: ``forward(idx)`` returns
    ``(logits [B, T, V], loss or None)``; projects/adder masks the prompt positions with target -1
    and its loss is ``cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-1)``."""

    def __init__(self, vocab: int = 10, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)
        with torch.no_grad():
            self.head.weight.mul_(0.01)

    def forward(self, idx):
        return self.head(self.emb(idx)), None


def _adder_batch(vocab: int = 10, b: int = 32, t: int = 5):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (b, t), generator=g)
    y = torch.randint(0, vocab, (b, t), generator=g)
    y[:, :3] = -1  # the prompt's positions: no loss there
    return x, y


def _lm_loss(out, y):
    logits = out[0]
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)


def test_a_language_models_tuple_output_is_judged_by_its_logits():
    r = doctor.init_checks(TinyLM(vocab=10), _adder_batch(), _lm_loss)
    assert r.output_shape == [32, 5, 10]  # the logits, not "None"
    # The class axis is the last one ([B, T, V] against targets [B, T]), not dim 1 (T = 5).
    assert r.task == "classification" and r.num_classes == 10
    assert r.expected_loss == pytest.approx(math.log(10))
    assert r.initial_loss == pytest.approx(math.log(10), rel=0.05)
    assert "[32, 5, 10]" in r.summary and "None" not in r.summary
    # Targets of -1 that the loss accepted are its ignore index, not labels out of range.
    assert r.passed and kinds(r) == set(), kinds(r)
    ignored = next(f for f in r.findings() if f.kind == "ignored_targets")
    assert ignored.evidence == {"value": -1, "count": 96, "of": 160}


def test_a_dict_output_is_judged_by_its_logits_and_negative_labels_the_loss_refuses_stay_errors():
    class DictLM(TinyLM):
        def forward(self, idx):
            return {"loss": None, "logits": self.head(self.emb(idx))}

    x, y = _adder_batch()
    r = doctor.init_checks(DictLM(), (x, y), lambda out, t: _lm_loss((out["logits"],), t))
    assert r.output_shape == [32, 5, 10] and r.num_classes == 10 and r.passed
    # The same labels given to a loss without that ignore index: cross_entropy refuses -1.
    r = doctor.init_checks(TinyLM(), (x, y), lambda out, t: nn.functional.cross_entropy(
        out[0].reshape(-1, 10), t.reshape(-1)))
    assert {"labels_out_of_range", "loss_failed"} <= kinds(r)


class _LastPositionLM(nn.Module):
    """karpathy/llama2.c's model.py ``Transformer.forward(tokens, targets=None)`` in small (tied
    embedding and output): without targets it returns only the last position's logits,
    ``self.output(h[:, [-1], :])`` ([B, 1, V], its inference shortcut), so ``model(x)`` against the
    targets ``[B, T]`` of its training batches fits neither class axis."""

    def __init__(self, vocab: int = 128, width: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.output = nn.Linear(width, vocab, bias=False)
        self.tok_embeddings.weight = self.output.weight

    def forward(self, tokens, targets=None):
        h = self.tok_embeddings(tokens)
        return self.output(h if targets is not None else h[:, [-1], :])


def _flat_lm_loss(logits, y):  # llama2.c's loss: cross_entropy over (B*T, V), ignore_index=-1
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)


def test_logits_of_the_last_position_only_are_a_shape_mismatch_not_one_class():
    # Found with `trainguard doctor` on llama2.c's Transformer: "Class labels span [0, 127] but the
    # output has 1 classes -- give the last layer 128 outputs" (it has 128): dim 1 of [8, 1, 128] was
    # taken for the classes although neither [B, C, ...] nor [B, T, V] fits the targets [8, 32].
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (8, 32), generator=g), torch.randint(0, 128, (8, 32), generator=g)
    r = doctor.init_checks(_LastPositionLM(), (x, y), _flat_lm_loss)
    assert r.output_shape == [8, 1, 128] and r.num_classes is None
    assert "labels_out_of_range" not in kinds(r)
    assert {"output_target_shape", "loss_failed"} <= kinds(r) and not r.passed
    shape = next(f for f in r.findings() if f.kind == "output_target_shape")
    assert shape.severity == "error"
    assert shape.title == "Output [8, 1, 128] does not fit targets [8, 32]: it holds 1 position of the targets' 32"
    assert "every position" in shape.suggestion and "h[:, [-1], :]" in shape.suggestion
    # Given the targets, the same model returns every position's logits: nothing to say.
    r = doctor.init_checks(_Targets(_LastPositionLM()), (x, y), _flat_lm_loss)
    assert r.output_shape == [8, 32, 128] and r.num_classes == 128 and r.passed, kinds(r)


class _Targets(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x, x)


def test_channel_first_class_axis_for_segmentation_shaped_outputs():
    # [B, C, H, W] logits against [B, H, W] labels: classes on dim 1 (what cross_entropy expects).
    model = nn.Conv2d(3, 4, 1)
    x, y = torch.randn(2, 3, 6, 6), torch.randint(0, 4, (2, 6, 6))
    r = doctor.init_checks(model, (x, y), nn.CrossEntropyLoss())
    assert r.num_classes == 4 and r.expected_loss == pytest.approx(math.log(4))


class _ReturnsItsLoss(nn.Module):
    """lucidrains/denoising-diffusion-pytorch's GaussianDiffusion.forward in small: the model takes the
    images and returns the training loss itself (a scalar), which loss_fn passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 16)

    def forward(self, img):
        noise = torch.randn_like(img)
        return nn.functional.mse_loss(self.net(img + noise), noise)


def test_a_model_that_returns_its_own_loss_is_no_merged_batch_dimension():
    # Found with `trainguard doctor` on GaussianDiffusion: "error: The output has shape [] for a batch
    # of 8 samples: look for a flatten/view that merges the batch dimension".
    torch.manual_seed(0)
    r = doctor.init_checks(_ReturnsItsLoss(), (torch.rand(8, 16), torch.zeros(8)), lambda out, y: out)
    kinds = {f.kind: f for f in r.findings()}
    assert "output_batch_mismatch" not in kinds, [(f.kind, f.title) for f in r.findings()]
    f = kinds["model_returns_loss"]
    assert f.severity == "info" and "shape" in f.title


def test_a_model_that_averages_over_the_batch_by_mistake_is_still_a_mismatch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1), nn.Flatten(0))
    r = doctor.init_checks(_Mean(model), (torch.rand(8, 16), torch.rand(8)), nn.MSELoss())
    assert "output_batch_mismatch" in {f.kind for f in r.findings()}


class _Mean(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).mean()


class ZeroStdPositions(nn.Module):
    # Derived from karpathy/llm.c train_gpt2.py's GPT.forward (token + position embeddings, a
    # tied lm_head), with the position embeddings standardised by their std after a zero init.
    def __init__(self, vocab: int = 11, n_embd: int = 8, block: int = 6):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        nn.init.zeros_(self.wpe.weight)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx):
        pos_emb = self.wpe(torch.arange(idx.size(1)))
        pos_emb = (pos_emb - pos_emb.mean(-1, keepdim=True)) / pos_emb.std(-1, keepdim=True)  # STD
        return self.lm_head(self.wte(idx) + pos_emb)


def test_a_nan_initial_loss_names_the_op_and_line_that_made_it():
    torch.manual_seed(0)
    idx = torch.randint(0, 11, (4, 6))

    def flat_ce(logits, targets):
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    r = doctor.init_checks(ZeroStdPositions(), (idx, idx.roll(-1, 1)), flat_ce)
    [f] = [f for f in r.findings() if f.kind == "initial_loss_nonfinite"]
    lines, start = inspect.getsourcelines(ZeroStdPositions)
    line = start + next(i for i, text in enumerate(lines) if "# STD" in text)
    assert f.evidence["origin"]["op"] == "aten.div.Tensor"
    assert f.evidence["origin"]["line"] == line and f.evidence["origin"]["file"].endswith("test_init_checks.py")
    assert f"test_init_checks.py:{line}" in f.suggestion and "input 1 = std output" in f.suggestion


class _TwoInputDLRM(nn.Module):
    """facebookresearch/dlrm's DLRM_Net in small: forward(dense_x, indices), the dense features
    through a bottom MLP and the categorical ones through nn.EmbeddingBag(sparse=True) tables."""

    def __init__(self) -> None:
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, 4, mode="sum", sparse=True) for n in (20, 12))
        self.bot_l = nn.Linear(6, 4)
        self.top_l = nn.Linear(12, 1)

    def forward(self, dense_x, indices):
        feats = [self.bot_l(dense_x)] + [e(indices[:, k]) for k, e in enumerate(self.emb_l)]
        return self.top_l(torch.cat(feats, dim=1)).squeeze(1)


def test_a_model_of_several_arguments_given_a_tuple_is_told_to_unpack_it():
    # The doctor calls model(inputs): a batch ((dense_x, indices), y) reached DLRM.forward(dense_x,
    # indices) as one argument, and the fix said "Fix the forward pass for this batch (shapes,
    # dtypes, devices)", which nothing in the model is wrong about.
    torch.manual_seed(0)
    batch = ((torch.rand(8, 6), torch.stack([torch.randint(0, 20, (8, 2)), torch.randint(0, 12, (8, 2))], 1)),
             torch.rand(8))
    r = doctor.init_checks(_TwoInputDLRM(), batch, nn.BCEWithLogitsLoss())
    (f,) = [f for f in r.findings() if f.kind == "forward_failed"]
    assert "shapes, dtypes, devices" not in f.suggestion, f.suggestion
    assert "model(*inputs)" in f.suggestion and "(dense_x, indices)" in f.suggestion, f.suggestion


class _TimeFirstCTC(nn.Module):
    """Holmeyoung/crnn-pytorch's CRNN (models/crnn.py) in small: a conv over the image's columns, a
    BiLSTM over them and log_softmax, returned time first, ``[T, N, C]``, the layout ``nn.CTCLoss`` takes
    (its train.py: ``criterion(preds, text, preds_size, length) / batch_size``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, kernel_size=3, stride=2, padding=1)
        self.rnn = nn.LSTM(8, 8, bidirectional=True)
        self.out = nn.Linear(16, 6)

    def forward(self, x):  # [N, 4, W] -> [W // 2, N, 6]
        seq = torch.relu(self.conv(x)).permute(2, 0, 1)
        return self.out(self.rnn(seq)[0]).log_softmax(2)


def _ctc(preds, target):
    text, length = target
    frames = torch.full((preds.size(1),), preds.size(0), dtype=torch.long)
    return nn.CTCLoss()(preds, text, frames, length) / preds.size(1)


def test_a_time_first_ctc_output_is_no_merged_batch_dimension():
    # Found with `trainguard doctor` on Holmeyoung/crnn-pytorch's CRNN: "error: The output has shape
    # [26, 16, 37] for a batch of 16 samples: look for a flatten/view that merges the batch dimension",
    # for the [T, N, C] output nn.CTCLoss requires.
    torch.manual_seed(0)
    x = torch.randn(5, 4, 16)
    target = (torch.randint(1, 6, (5, 3)), torch.tensor([3, 2, 3, 1, 2]))
    r = doctor.init_checks(_TimeFirstCTC(), (x, target), _ctc)
    assert "output_batch_mismatch" not in {f.kind for f in r.findings()}, [(f.kind, f.title) for f in r.findings()]
    assert r.output_shape == [8, 5, 6] and r.verdict != "fail", (r.verdict, r.summary)
    # a flattened output still is a mismatch, whatever the loss takes
    flat = nn.Sequential(_TimeFirstCTC(), nn.Flatten(0, 1))
    r = doctor.init_checks(flat, (x, torch.zeros(5)), lambda out, y: out.mean())
    assert "output_batch_mismatch" in {f.kind for f in r.findings()}


def _ce_plus_dice(logits, masks):
    # milesial/Pytorch-UNet train.py + utils/dice_score.py (@21d7850): cross entropy plus the multiclass
    # dice loss of the softmax, reduced over the whole batch (dice_loss(..., multiclass=True))
    probs = torch.softmax(logits, dim=1).float()
    onehot = nn.functional.one_hot(masks, logits.shape[1]).permute(0, 3, 1, 2).float()
    inter = 2 * (probs * onehot).sum()
    dice = (inter + 1e-6) / (probs.sum() + onehot.sum() + 1e-6)
    return nn.functional.cross_entropy(logits, masks) + (1 - dice)


def test_the_chance_level_of_a_composite_loss_is_its_loss_at_uniform_predictions():
    # CE + dice starts at ln 3 + (1 - 1/3) for a 3-class segmentation net: "1.6x chance (ln 3)" and
    # "scale down the last layer's initial weights" was a false warning with a wrong fix.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))
    with torch.no_grad():
        net[2].weight.mul_(0.01)
    batch = (torch.rand(2, 3, 16, 16), torch.randint(0, 3, (2, 16, 16)))
    r = doctor.init_checks(net, batch, _ce_plus_dice)
    assert "initial_loss_high" not in kinds(r), r.summary
    assert r.expected_loss == pytest.approx(math.log(3) + 2 / 3, rel=1e-3)
    with torch.no_grad():
        net[2].weight.mul_(5000)  # over-confident at init: still flagged against the same level
    r = doctor.init_checks(net, batch, _ce_plus_dice)
    assert "initial_loss_high" in kinds(r)
    # a plain cross entropy keeps ln C and its rule
    r = doctor.init_checks(net, batch, nn.CrossEntropyLoss())
    assert r.expected_rule == "ln 3"
