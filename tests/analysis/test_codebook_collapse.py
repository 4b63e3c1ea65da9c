"""codebook_collapse: a layer whose outputs take one or two values while its inputs take many (a
vector quantizer using 1-2 of its codes), on a VQ-VAE written as zalandoresearch/pytorch-vq-vae's
notebook writes it: the quantizer has no parameters of its own and computes with
``self._embedding.weight``, so the ``nn.Embedding`` never runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from qat_models import prepared
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.analysis import diagnose
from trainguard.analysis._causes import explain
from trainguard.store import Finding


class _VectorQuantizer(nn.Module):
    """zalandoresearch/pytorch-vq-vae (vq-vae.ipynb, VectorQuantizer), shortened; the codebook is
    initialised as the notebook's VectorQuantizerEMA does (``normal_()``), far larger than the
    encoder's outputs: the code nearest to every input is the one nearest to 0."""

    def __init__(self, num_embeddings, embedding_dim, commitment_cost=0.25, init=None):
        super().__init__()
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.normal_()
        if init is not None:
            self._embedding.weight.data.copy_(init)
        self._d, self._commitment_cost = embedding_dim, commitment_cost

    def forward(self, inputs):
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        flat = inputs.view(-1, self._d)
        w = self._embedding.weight
        distances = flat.pow(2).sum(1, keepdim=True) + w.pow(2).sum(1) - 2 * flat @ w.t()
        encodings = F.one_hot(distances.argmin(1), w.shape[0]).float()
        quantized = (encodings @ w).view(inputs.shape)
        loss = F.mse_loss(quantized, inputs.detach()) + self._commitment_cost * F.mse_loss(quantized.detach(), inputs)
        quantized = inputs + (quantized - inputs).detach()
        return loss, quantized.permute(0, 3, 1, 2).contiguous()


class _VQVAE(nn.Module):
    def __init__(self, codes=32, dim=4):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.ReLU(), nn.Conv2d(8, dim, 1))
        self.vq = _VectorQuantizer(codes, dim)
        self.dec = nn.Sequential(nn.Conv2d(dim, 8, 3, 1, 1), nn.ReLU(), nn.ConvTranspose2d(8, 1, 4, 2, 1))

    def forward(self, x):
        vq_loss, q = self.vq(self.enc(x))
        return vq_loss, self.dec(q)


def _images(n=64):
    g = torch.Generator().manual_seed(0)
    return F.interpolate(torch.randn(n, 1, 4, 4, generator=g), size=12, mode="bilinear").tanh()


def _train(tmp_path, codes_from_inputs: bool, resumed: bool = False):
    torch.manual_seed(0)
    model = _VQVAE()
    x = _images()
    if codes_from_inputs:  # a k-means-like start: codes drawn from the encoder's outputs
        with torch.no_grad():
            z = model.enc(x).permute(0, 2, 3, 1).reshape(-1, 4)
            model.vq._embedding.weight.copy_(z[torch.randperm(len(z))[:32]])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    if resumed:  # trained before the monitor came (as after a resume): its first recording is no start
        vq_loss, recon = model(x[:16])
        (F.mse_loss(recon, x[:16]) + vq_loss).backward()
        opt.step()
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(30):
            b = x[(step * 16) % 64:][:16]
            vq_loss, recon = model(b)
            loss = F.mse_loss(recon, b) + vq_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    return trainguard.open(tmp_path / "r")


def test_a_quantizer_giving_every_position_one_or_two_codes_is_a_codebook_collapse(tmp_path):
    # No rule saw it: the quantizer was not even a layer (no parameters of its own, its
    # nn.Embedding never called), and its outputs were never measured. It uses ~2 of 32 codes.
    run = _train(tmp_path, codes_from_inputs=False)
    assert "vq" in run.layers()
    [f] = [f for f in diagnose(run) if f.kind == "codebook_collapse"]
    assert f.layers[0] == "vq" and f.severity == "warning"
    ev = f.evidence
    assert ev["codes"] < 3 and ev["input_codes"] > 8 * ev["codes"]
    assert ev["downstream"] == ["dec.0", "dec.1", "dec.2"]
    # the codes start at RMS ~1, the encoder's outputs far below: said with the parameter's name
    assert set(ev["scale"]) == {"vq._embedding.weight"}
    assert ev["scale"]["vq._embedding.weight"]["code_rms"] > 4 * ev["scale"]["vq._embedding.weight"]["input_rms"]
    assert "kmeans_init=True" in f.suggestion and "commitment cost" in f.suggestion


def test_a_collapse_first_seen_after_training_began_says_nothing_of_where_the_codes_started(tmp_path):
    # The codes' and the inputs' RMS at the first recording were said to be where they "start"
    # even when the optimizer had stepped before the monitor came (a resumed run).
    run = _train(tmp_path, codes_from_inputs=False, resumed=True)
    assert run.meta["monitor"]["weights_initial"] is False
    [f] = [f for f in diagnose(run) if f.kind == "codebook_collapse"]
    assert "scale" not in f.evidence and "start at RMS" not in f.suggestion
    assert not f.evidence["from_start"] and "from initialisation" not in f.title
    assert "from its first recording (step" in f.title and "kmeans_init=True" in f.suggestion


def test_a_codebook_started_from_the_inputs_is_no_collapse(tmp_path):
    run = _train(tmp_path, codes_from_inputs=True)
    fs = diagnose(run)
    assert "codebook_collapse" not in [f.kind for f in fs]
    codes = [r["value"] for r in run.layer_stats(layer="vq", kind="activation", stat="codes")]
    assert len(codes) >= 2 and min(codes) > 5  # 9-21 codes in effect


def test_units_dead_after_a_collapsed_codebook_are_its_symptom_not_those_before_it():
    # zalando's VQ-VAE: 56% of the decoder's _res._block.0 "dead" (its input is one code), with
    # Kaiming init advised for the decoder; the collapse explains them. Dead units in the encoder do not.
    def findings(dead_layer):
        cause = Finding(kind="codebook_collapse", severity="warning", title="c", layers=["vq"],
                        evidence={"downstream": ["dec.0", "dec.1"]})
        dead = Finding(kind="dead_units", severity="error", title="d", layers=[dead_layer], evidence={})
        explain([cause, dead])
        return cause, dead

    cause, dead = findings("dec.1")
    assert dead.severity == "info" and dead.evidence["explained_by"] == ["codebook_collapse"]
    assert cause.severity == "error" and cause.evidence["explains"] == ["dead_units"]
    cause, dead = findings("enc.1")
    assert dead.severity == "error" and "explained_by" not in dead.evidence


class _LookupQuantizer(nn.Module):
    """CompVis/taming-transformers' VectorQuantizer2, shortened: the nn.Embedding runs, on the argmin
    indices (``z_q = self.embedding(min_encoding_indices)``): its input is integers, its output the
    codes; the quantizer itself has no parameters of its own. Codes initialised with ``normal_()``
    against encoder outputs of RMS ~0.1, as in _VectorQuantizer."""

    def __init__(self, n_e, e_dim, beta=0.25):
        super().__init__()
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.normal_()
        self.e_dim, self.beta = e_dim, beta

    def forward(self, z):
        z = z.permute(0, 2, 3, 1).contiguous()
        flat = z.view(-1, self.e_dim)
        w = self.embedding.weight
        d = flat.pow(2).sum(1, keepdim=True) + w.pow(2).sum(1) - 2 * flat @ w.t()
        z_q = self.embedding(d.argmin(1)).view(z.shape)
        loss = self.beta * F.mse_loss(z_q.detach(), z) + F.mse_loss(z_q, z.detach())
        z_q = z + (z_q - z).detach()
        return z_q.permute(0, 3, 1, 2).contiguous(), loss


def test_a_quantizer_that_looks_its_codes_up_by_index_is_judged_by_its_own_output(tmp_path):
    # Its nn.Embedding ran, on integer indices (no input rows to compare with), so the quantizer was
    # no stand-in either: nothing compared the codes with the encoder's rows.
    class VQModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.ReLU(), nn.Conv2d(8, 4, 1))
            self.quantize = _LookupQuantizer(32, 4)
            self.decoder = nn.Sequential(nn.Conv2d(4, 8, 3, 1, 1), nn.ReLU(), nn.ConvTranspose2d(8, 1, 4, 2, 1))

        def forward(self, x):
            z_q, vq_loss = self.quantize(self.encoder(x))
            return self.decoder(z_q), vq_loss

    torch.manual_seed(0)
    model = VQModel()
    x = _images()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(30):
            b = x[(step * 16) % 64:][:16]
            recon, vq_loss = model(b)
            loss = F.mse_loss(recon, b) + vq_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    run = trainguard.open(tmp_path / "r")
    [f] = [f for f in diagnose(run) if f.kind == "codebook_collapse"]
    assert f.layers[0] == "quantize" and f.evidence["codes"] < 3


def test_a_wrapper_of_token_embeddings_is_no_codebook_collapse(tmp_path):
    # the same rows, looked up by token ids from the data: one token type (BERT's token_type_ids all
    # 0) is the data's doing, not a collapse
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.word, self.kind = nn.Embedding(50, 8), nn.Embedding(2, 8)

        def forward(self, ids):
            return self.word(ids) + self.kind(torch.zeros_like(ids))

    torch.manual_seed(0)
    model = nn.Sequential(Tokens(), nn.Linear(8, 50))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(30):
            ids = torch.randint(0, 50, (16, 6))
            loss = F.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    assert "codebook_collapse" not in [f.kind for f in diagnose(trainguard.open(tmp_path / "r"))]


def test_weights_gone_nan_are_no_codebook_collapse(tmp_path):
    # `trainguard demo` (the digits MLP whose log(0) makes its weights NaN at step 3) reported
    # "Codebook collapse: fc1's outputs take 1 distinct value(s) in effect while its inputs take 128":
    # every row of NaN counted as one code. A NaN output is the NaN's symptom, not a code.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    with Monitor(model, tmp_path / "r", every=1) as mon:
        for step in range(30):
            x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
            if step == 3:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")  # as the demo's NaN update leaves it
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    kinds = [f.kind for f in diagnose(trainguard.open(tmp_path / "r"))]
    assert "nonfinite_loss" in kinds and "codebook_collapse" not in kinds, kinds


class _QatNet(nn.Module):
    """pytorch/tutorials' static quantization tutorial, QAT part, shortened: a QuantStub, a fused
    Conv-BN-ReLU, global mean pooling and the classifier initialised as the tutorial's MobileNetV2
    does (``normal_(0, 0.01)``, zero bias), trained from random weights under ``prepare_qat``."""

    def __init__(self):
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.conv = nn.Conv2d(3, 64, 3, bias=False)
        self.bn = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(64, 10)
        nn.init.normal_(self.fc.weight, 0, 0.01)
        nn.init.zeros_(self.fc.bias)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(x.mean((2, 3))))


def test_a_fake_quantized_layer_whose_outputs_differ_by_less_than_a_step_is_told_of_qat_not_of_codebooks(tmp_path):
    # trainguard run --monitor of the tutorial's QAT loop (MobileNetV2 at width 0.25, random
    # weights, synthetic images) found the classifier's fake-quantized logits the same row for
    # every image from step 3 on (true: its outputs differ between images by less than the
    # activation fake-quantizer's step), and told the user to initialise a codebook by k-means,
    # reset dead codes and lower a commitment cost: a VQ-VAE's fixes, for a model with none.
    torch.manual_seed(0)
    model = _QatNet().train()
    prepared(model, [["conv", "bn", "relu"]])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, 16, generator=g)
    y = (x.mean((2, 3)) @ torch.randn(3, 10, generator=g)).argmax(1)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(30):
            b = slice((step * 16) % 64, (step * 16) % 64 + 16)
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    [f] = [f for f in diagnose(trainguard.open(tmp_path / "r")) if f.kind == "codebook_collapse"]
    assert f.layers[0] == "fc" and f.evidence["codes"] < 2  # one row for 16 images: the finding is right
    assert f.evidence["fake_quantized"] == "fc.activation_post_process"
    assert "fake-quantiz" in f.suggestion and "prepare_qat" in f.suggestion
    for vq in ("kmeans_init", "commitment cost", "dead-code", "codebook"):
        assert vq not in f.suggestion, vq


def test_outputs_a_rate_far_too_high_collapsed_in_training_are_its_symptom():
    # cleanrl's ppo.py on CartPole-v1 at --learning-rate 1.0 under `trainguard monitor`: the first
    # update moved the weights by 520% and the actor's Tanh layers saturated, so actor.3 gave one
    # output in effect from step 10 (64 at step 0). lr_too_high folded the saturated, collapsed and
    # exploding activations under it, but "Codebook collapse: actor.3's outputs take 1 distinct
    # value(s)" stood beside it as a warning of its own, advising k-means codebook init for a Tanh.
    lr = Finding(kind="lr_too_high", severity="warning", title="Learning rate too high", layers=[],
                 evidence={"divergence": {"initial_loss": 16.7, "step": 1, "smoothed_loss": 80.9, "update_step": 0}})
    collapse = Finding(kind="codebook_collapse", severity="warning", title="Codebook collapse", layers=["actor.3", "critic.3"],
                       evidence={"layer": "actor.3", "codes": 1, "since_step": 10, "from_start": False,
                                 "arose_in_training": True, "downstream": ["actor.4"]})
    explain([lr, collapse])
    assert collapse.severity == "info" and collapse.evidence.get("explained_by") == ["lr_too_high"], collapse
    assert "codebook_collapse" in lr.evidence.get("explains", [])
    # a codebook collapsed from initialisation is not the rate's doing
    lr2 = Finding(kind="lr_too_high", severity="warning", title="Learning rate too high", layers=[],
                  evidence={"divergence": {"step": 1}})
    early = Finding(kind="codebook_collapse", severity="warning", title="Codebook collapse", layers=["vq"],
                    evidence={"from_start": True, "downstream": []})
    explain([lr2, early])
    assert early.severity == "warning", early


def _collapsed_run(path, layer_type, params):
    """A synthetic run whose layer ``mid`` gives ~2 distinct outputs for ~40 distinct inputs from step 10."""
    from trainguard.store import acquire_writer, open_run, release_writer

    layers = [{"name": "enc", "type": "Conv2d"}, {"name": "mid", "type": layer_type}, {"name": "outc", "type": "Conv2d"}]
    w = acquire_writer(path)
    for s in range(30):
        w.add_scalars(s, {"loss": 1.0 / (1 + s), "lr/0": 0.01})
    rows = []
    for s in range(0, 30, 5):
        for la in ("enc", "mid", "outc"):
            codes = 2.0 if la == "mid" and s >= 10 else 200.0
            rows += [(s, la, "activation", "codes", codes), (s, la, "activation", "in_codes", 40.0),
                     (s, la, "activation", "code_rows", 256), (s, la, "activation", "code_sample", 256),
                     (s, la, "activation", "mean", 0.1), (s, la, "activation", "std", 1.0)]
    w.add_layer_stats(rows)
    w.set_meta(monitor={"every": 5, "layers": layers, "params": params, "order": [la["name"] for la in layers],
                        "modes": {}})
    release_writer(w)
    return open_run(path)


def test_a_transposed_convolution_with_few_distinct_outputs_is_no_codebook(tmp_path):
    # milesial/Pytorch-UNet with its dice loss on logits: up4.up (a ConvTranspose2d) gave ~3 distinct
    # outputs and was called a collapsed codebook, with a fix in vector-quantizer terms. Only a layer
    # that looks rows of a table up (a quantizer holding an nn.Embedding or a 2-D table) is a codebook.
    conv = {"mid.weight": {"layer": "mid", "module_type": "ConvTranspose2d", "shape": [8, 4, 2, 2]}}
    run = _collapsed_run(tmp_path / "conv", "ConvTranspose2d", conv)
    assert "codebook_collapse" not in [f.kind for f in diagnose(run)]
    vq = {"mid._embedding.weight": {"layer": "mid._embedding", "module_type": "Embedding", "shape": [32, 4]}}
    run = _collapsed_run(tmp_path / "vq", "VectorQuantizer", vq)
    assert "codebook_collapse" in [f.kind for f in diagnose(run)]
