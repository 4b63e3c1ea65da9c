"""validate_data: each problem found on data that has it, and none on data that does not."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
import torch
from rich.console import Console
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from trainguard import doctor
from trainguard.doctor import _dedup
from trainguard.store import Finding, dumps


@pytest.fixture
def clean():
    """Standardised features, balanced labels, disjoint splits."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    y = rng.integers(0, 5, 3000)
    xt = rng.standard_normal((600, 16)).astype(np.float32)
    yt = rng.integers(0, 5, 600)
    return x, y, xt, yt


def kinds(report) -> set[str]:
    return {f.kind for f in report.findings()}


def test_clean_data_passes(clean):
    x, y, xt, yt = clean
    r = doctor.validate_data((x, y), (xt, yt))
    assert r.passed and r.verdict == "pass"
    assert [f for f in r.findings() if f.is_problem] == []
    assert r.splits["train"]["samples"] == 3000 and r.splits["test"]["samples"] == 600
    assert r.stats["task"] == "classification"
    assert all(isinstance(f, Finding) and f.source == "doctor" for f in r.findings())


def test_leaked_duplicates_across_splits_are_found(clean):
    x, y, xt, yt = clean
    xt, yt = xt.copy(), yt.copy()
    xt[[5, 77, 300]] = x[[10, 20, 30]]
    r = doctor.validate_data((x, y), (xt, yt))
    (f,) = r.by_kind("leaked_duplicates")
    assert f.severity == "error" and not r.passed and r.verdict == "fail"
    assert f.evidence["count"] == 3
    assert f.evidence["examples"] == [{"test": 5, "train": 10}, {"test": 77, "train": 20}, {"test": 300, "train": 30}]


def test_leak_found_across_dtypes_and_signed_zeros(clean):
    x, y, xt, yt = clean
    x = x.copy()
    x[0] = 0.0
    xt64 = xt.astype(np.float64)
    xt64[1] = -0.0
    r = doctor.validate_data((x, y), (xt64, yt))
    assert r.by_kind("leaked_duplicates")[0].evidence["examples"] == [{"test": 1, "train": 0}]


def test_duplicates_within_a_split_and_conflicting_labels(clean):
    x, y, _, _ = clean
    x, y = x.copy(), y.copy()
    x[100:160] = x[0]  # 60 copies of sample 0: 2% of the data
    y[100:160] = y[0]
    x[200] = x[1]
    y[200] = (y[1] + 1) % 5  # same input, different label
    r = doctor.validate_data((x, y))
    (dup,) = r.by_kind("duplicate_samples")
    assert dup.evidence["duplicates"] == 61 and dup.evidence["groups"] == 2 and dup.severity == "warning"
    (conflict,) = r.by_kind("conflicting_labels")
    assert conflict.evidence["examples"] == [[1, 200]]


def test_a_few_duplicates_are_only_info(clean):
    x, y, _, _ = clean
    x = x.copy()
    x[1] = x[0]
    y = y.copy()
    y[1] = y[0]
    r = doctor.validate_data((x, y))
    assert r.by_kind("duplicate_samples")[0].severity == "info" and r.passed


def test_near_duplicates_across_splits(clean):
    x, y, xt, yt = clean
    xt = xt.copy()
    noise = np.random.default_rng(1).normal(0, 0.005, (4, 16)).astype(np.float32)
    xt[[0, 1, 2, 3]] = x[[40, 41, 42, 43]] + noise
    r = doctor.validate_data((x, y), (xt, yt))
    (f,) = r.by_kind("leaked_near_duplicates")
    assert f.evidence["pairs"] >= 3  # a cheap screen: most, not necessarily all
    assert {"train": 40, "test": 0} in f.evidence["examples"] or {"train": 41, "test": 1} in f.evidence["examples"]
    assert not r.by_kind("leaked_duplicates")


def test_nan_and_inf_in_inputs_and_targets(clean):
    x, y, _, _ = clean
    x = x.copy()
    x[3, 2] = np.nan
    x[9, 2] = np.inf
    yr = np.random.default_rng(0).standard_normal(3000)
    yr[4] = np.nan
    r = doctor.validate_data((x, yr))
    inputs = next(f for f in r.by_kind("data_nonfinite") if f.evidence["part"] == "inputs")
    assert (inputs.evidence["nan"], inputs.evidence["inf"], inputs.evidence["examples"]) == (1, 1, [3, 9])
    assert inputs.evidence["features"] == [2]
    targets = next(f for f in r.by_kind("data_nonfinite") if f.evidence["part"] == "targets")
    assert targets.evidence["examples"] == [4]
    assert r.stats["task"] == "regression"


@pytest.mark.parametrize("ratio, flagged", [(9, False), (12, True)])
def test_label_imbalance_over_ten_to_one(ratio, flagged):
    rng = np.random.default_rng(0)
    y = np.r_[np.zeros(100 * ratio, int), np.ones(100, int)]
    x = rng.standard_normal((len(y), 8))
    r = doctor.validate_data((x, y))
    found = r.by_kind("label_imbalance")
    assert bool(found) == flagged
    if flagged:
        assert found[0].evidence["ratio"] == pytest.approx(12)
        assert found[0].evidence["class_weights"] == {"0": round(1300 / 2400, 4), "1": 6.5}


def test_unseen_test_labels_and_single_class(clean):
    x, y, xt, yt = clean
    r = doctor.validate_data((x, y), (xt, np.where(yt == 0, 7, yt)))
    assert r.by_kind("unseen_labels")[0].evidence["labels"] == [7]
    assert r.by_kind("single_class") == [] and doctor.validate_data((x, np.zeros(3000, int))).by_kind("single_class")


def test_unnormalised_inputs_give_the_values_to_normalise_with():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (2000, 3, 8, 8)).astype(np.float32)  # raw pixels, channels first
    x[:, 1] = x[:, 1] * 0.5
    r = doctor.validate_data(x)
    (f,) = r.by_kind("inputs_not_normalised")
    assert f.evidence["per"] == "channel"
    mean = x.transpose(1, 0, 2, 3).reshape(3, -1).mean(axis=1)
    std = x.transpose(1, 0, 2, 3).reshape(3, -1).std(axis=1)
    assert np.allclose(f.evidence["mean"], mean, rtol=1e-5) and np.allclose(f.evidence["std"], std, rtol=1e-5)
    assert "Normalize(mean=[" in f.suggestion


def test_features_on_different_scales():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 4))
    x[:, 2] *= 500  # std 500, far above the others
    r = doctor.validate_data(x)
    f = r.by_kind("inputs_not_normalised")[0]
    assert f.evidence["per"] == "feature"
    assert any("std up to" in reason for reason in f.evidence["reasons"])
    assert f.evidence["std"][2] == pytest.approx(x[:, 2].std())


def test_constant_features_are_named(clean):
    x, y, _, _ = clean
    x = x.copy()
    x[:, [3, 11]] = 0.5
    r = doctor.validate_data((x, y))
    (f,) = r.by_kind("constant_features")
    assert f.evidence["features"] == [3, 11] and f.evidence["count"] == 2
    assert doctor.validate_data(np.ones((10, 3))).by_kind("constant_features")[0].severity == "error"


def test_a_single_feature_that_gives_the_label_away(clean):
    x, y, _, _ = clean
    x = x.copy()
    x[:, 6] = y * 10 + np.random.default_rng(0).uniform(0, 1, len(y))  # the label, thinly disguised
    r = doctor.validate_data((x, y))
    (f,) = r.by_kind("feature_leak")
    assert f.evidence["feature"] == 6 and f.evidence["score"] >= 0.99


def test_sample_id_sorted_by_class_is_a_leak(clean):
    x, y, _, _ = clean
    order = np.argsort(y, kind="stable")
    x, y = x[order].copy(), y[order]
    x[:, 0] = np.arange(len(y))  # an id column, and the file was sorted by label
    assert doctor.validate_data((x, y)).by_kind("feature_leak")[0].evidence["feature"] == 0


def test_regression_leak_by_correlation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 5))
    y = 3 * x[:, 4] + 0.01 * rng.standard_normal(2000)
    r = doctor.validate_data((x, y))
    assert r.by_kind("feature_leak")[0].evidence["feature"] == 4


def test_no_leak_from_an_honest_predictor(clean):
    x, y, _, _ = clean
    x = x.copy()
    x[:, 0] = y + np.random.default_rng(0).normal(0, 1.0, len(y))  # informative, not a give-away
    assert not doctor.validate_data((x, y)).by_kind("feature_leak")


def test_input_forms_agree(clean):
    x, y, xt, yt = clean
    xt = xt.copy()
    xt[0] = x[0]

    class MapStyle(Dataset):
        def __init__(self, a, b):
            self.a, self.b = a, b

        def __len__(self):
            return len(self.a)

        def __getitem__(self, i):
            return self.a[i], int(self.b[i])

    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    forms = [
        ((x, y), (xt, yt)),
        ((tx, ty), (torch.from_numpy(xt), torch.from_numpy(yt))),
        (TensorDataset(tx, ty), TensorDataset(torch.from_numpy(xt), torch.from_numpy(yt))),
        (Subset(TensorDataset(tx, ty), range(3000)), MapStyle(xt, yt)),
        (DataLoader(TensorDataset(tx, ty), batch_size=256), (xt, yt)),
    ]
    for train, test in forms:
        r = doctor.validate_data(train, test)
        assert r.splits["train"]["samples"] == 3000
        assert r.by_kind("leaked_duplicates")[0].evidence["examples"] == [{"test": 0, "train": 0}]


def test_unlabelled_inputs(clean):
    x, _, xt, _ = clean
    r = doctor.validate_data(x, xt)
    assert r.stats["task"] == "unlabelled" and r.passed


def test_report_serialises_and_renders(clean):
    x, y, xt, yt = clean
    r = doctor.validate_data((x, y), (xt, yt))
    d = json.loads(dumps(r.to_dict()))
    assert d["check"] == "validate_data" and d["splits"]["test"]["label_counts"]
    buf = io.StringIO()
    Console(file=buf, width=120).print(r)
    assert "validate_data" in buf.getvalue()


@pytest.mark.parametrize("train, test, match", [
    (np.zeros((0, 4)), None, "empty"),
    ((np.zeros((5, 4)), np.zeros(6)), None, "5 samples but targets have 6"),
    (np.zeros((5, 4)), np.zeros((5, 3)), r"train samples have shape \[4\] but test samples \[3\]"),
    ("a string", None, "must be a tensor"),
    ({"x": 1}, None, "must be a tensor"),
    (None, None, "required"),
    (np.array(["a", "b"]), None, "numeric"),
    ((np.zeros((5, 4)), np.zeros(5)), np.zeros((5, 4)), "both splits or for neither"),
    (DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=2), None, "empty"),
])
def test_bad_inputs_are_value_errors(train, test, match):
    with pytest.raises(ValueError, match=match):
        doctor.validate_data(train, test)


def test_bad_task_is_a_value_error(clean):
    with pytest.raises(ValueError, match="task"):
        doctor.validate_data(clean[0], task="clustering")


def test_hashes_equal_for_equal_rows_and_spread_otherwise():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1000, 7)).astype(np.float32)  # 28 bytes: padded to whole words
    b = a.copy()
    assert np.array_equal(_dedup.row_hashes(a), _dedup.row_hashes(b))
    assert len(np.unique(_dedup.row_hashes(a))) == 1000
    b[500, 3] = np.nextafter(b[500, 3], np.float32(10))  # one bit of one value
    assert (_dedup.row_hashes(a) != _dedup.row_hashes(b)).sum() == 1


def test_exact_duplicates_on_a_million_samples_are_fast():
    """The claim in docs/doctor.md: hashing and grouping 1M samples takes about a second."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1_000_000, 16), dtype=np.float32)
    x[999_999] = x[12]
    test = rng.standard_normal((100_000, 16), dtype=np.float32)
    test[7] = x[5]
    t0 = time.perf_counter()
    h = _dedup.row_hashes(x)
    groups = _dedup.duplicate_groups(x, h)
    pairs = _dedup.cross_duplicates(x, test, h)
    elapsed = time.perf_counter() - t0
    assert [g.tolist() for g in groups] == [[12, 999_999]]
    assert pairs == [(7, 5)]
    assert elapsed < 10.0  # measured ~0.6 s here; generous for a loaded CI machine


def test_a_list_of_batches_and_an_unsized_loader(clean):
    from torch.utils.data import IterableDataset

    x, y, xt, yt = clean
    xt = xt.copy()
    xt[2] = x[9]
    batches = [(torch.from_numpy(x[i:i + 500]), torch.from_numpy(y[i:i + 500])) for i in range(0, 3000, 500)]

    class Stream(IterableDataset):
        def __iter__(self):
            while True:  # never ends: only the beginning is read
                yield torch.zeros(16), 0

    r = doctor.validate_data(batches, (xt, yt))
    assert r.splits["train"]["samples"] == 3000
    assert r.by_kind("leaked_duplicates")[0].evidence["examples"] == [{"test": 2, "train": 9}]
    r = doctor.validate_data(DataLoader(Stream(), batch_size=4))
    assert r.splits["train"]["samples"] == 4000
    with pytest.raises(ValueError, match="IterableDataset"):
        doctor.validate_data(Stream())


def test_integer_ids_are_not_normalised():
    tokens = np.random.default_rng(0).integers(0, 30000, (500, 12))
    assert not doctor.validate_data(tokens).by_kind("inputs_not_normalised")
    pixels = np.random.default_rng(0).integers(0, 256, (500, 1, 4, 4)).astype(np.uint8)
    assert doctor.validate_data(pixels).by_kind("inputs_not_normalised")


class Batches:
    """A re-iterable of ``(inputs, targets)`` batches that is no DataLoader: what the other checks
    take as ``data`` (the doctor's convention), and what a loader of several inputs is wrapped in."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __iter__(self):
        return iter(self.pairs)


def test_any_iterable_of_batches_and_several_inputs_per_batch_are_read(clean):
    # trainguard doctor on Time-Series-Library (its loader yields (x, y, x_mark, y_mark); the model
    # takes (x, x_mark, y, y_mark)): the checklist passed its data to every check, and validate_data
    # alone said "train data must be a tensor, an array, ... or a DataLoader; got Pairs".
    x, y, xt, yt = clean
    x = x.copy()
    x[3, 2] = np.nan
    xt = xt.copy()
    xt[0] = x[0]
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    marks = torch.zeros(len(x), 4)  # a second input (time features), the same for every sample
    forms = [
        Batches([(tx[i:i + 256], ty[i:i + 256]) for i in range(0, 3000, 256)]),
        Batches([((tx[i:i + 256], marks[i:i + 256]), ty[i:i + 256]) for i in range(0, 3000, 256)]),
        DataLoader(TensorDataset(tx, marks, ty), batch_size=256, collate_fn=lambda b: (
            (torch.stack([s[0] for s in b]), torch.stack([s[1] for s in b])), torch.stack([s[2] for s in b]))),
        Batches([({"x": tx[i:i + 256], "mark": marks[i:i + 256]}, ty[i:i + 256]) for i in range(0, 3000, 256)]),
    ]
    for train in forms:
        r = doctor.validate_data(train, (xt, yt))
        assert r.splits["train"]["samples"] == 3000
        assert r.by_kind("data_nonfinite")[0].evidence["examples"] == [3]
        assert r.by_kind("leaked_duplicates")[0].evidence["examples"][0]["train"] == 0


def test_a_list_of_batches_with_a_dict_or_tuple_of_inputs_is_read():
    # huggingface/trl trl/trainer/reward_trainer.py: DataCollatorForPreference's batches, input_ids and
    # attention_mask (a pair per sample, chosen and rejected) with the dataset's margin column as the
    # target, one margin inf. `trainguard doctor` on such a setup returned a list of them, which every
    # other check took, and validate_data said "train data must be ... ; got list".
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 29, (64, 2, 7), generator=g)
    mask = torch.ones(64, 2, 7, dtype=torch.long)
    margin = torch.full((64,), 0.5)
    margin[37] = float("inf")
    for inputs in (lambda s: {"input_ids": ids[s], "attention_mask": mask[s]}, lambda s: (ids[s], mask[s])):
        data = [(inputs(slice(i, i + 8)), margin[i:i + 8]) for i in range(0, 64, 8)]
        r = doctor.validate_data(data)
        assert r.splits["train"]["samples"] == 64
        assert r.by_kind("data_nonfinite")[0].evidence["examples"] == [37]


class _NoisedPairs(Dataset):
    """huggingface/diffusers' DDPM training as one fixed draw: a sample is ((noisy image, timestep),
    noise), and the model is ``unet(noisy, t).sample``."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.noisy = torch.randn(n, 3, 4, 4, generator=g)
        self.t = torch.randint(0, 1000, (n,), generator=g)
        self.noise = torch.randn(n, 3, 4, 4, generator=g)
        self.noisy[5, 1, 2, 2] = float("nan")

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return (self.noisy[i], self.t[i]), self.noise[i]


def test_tuple_inputs_of_a_dataset_and_of_its_default_collated_loader_are_read():
    # trainguard doctor on diffusers' DDPM setup (a Dataset of ((noisy, t), noise), a DataLoader over
    # it with the default collate, which turns the (noisy, t) tuple into a list): validate_data alone
    # said "train inputs must be a tensor or a NumPy array, got tuple" (the Dataset, as test split)
    # and "... got list" (the loader), while every other check ran on these batches
    data = _NoisedPairs(24)
    for split in (data, DataLoader(data, batch_size=8), DataLoader(data, batch_size=2)):
        r = doctor.validate_data(split)
        assert r.splits["train"]["samples"] == 24
        assert r.by_kind("data_nonfinite")[0].evidence["examples"] == [5]


def test_a_non_finite_target_is_no_feature_leak():
    # The same preference batches (huggingface/trl trl/trainer/reward_trainer.py): token ids that say
    # nothing of the margin. With one margin inf, the correlation of every feature with the target
    # was NaN, and validate_data warned "input feature 0 alone has correlation +nan with the target".
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 29, (64, 2, 7), generator=g)
    margin = torch.rand(64, generator=g)
    margin[37] = float("inf")
    r = doctor.validate_data([(ids[i:i + 8], margin[i:i + 8]) for i in range(0, 64, 8)])
    assert r.by_kind("data_nonfinite")[0].evidence["examples"] == [37]
    assert not r.by_kind("feature_leak"), r.by_kind("feature_leak")


def test_ctc_batches_with_targets_and_lengths_check_the_inputs():
    # Found with `trainguard doctor` on Holmeyoung/crnn-pytorch's CRNN: each batch is (images, (text,
    # length)), the padded label indices and their lengths as nn.CTCLoss takes them, padded to each
    # batch's longest label; validate_data "could not run: DoctorInputError: train targets must be a
    # tensor or a NumPy array, got tuple" and the checklist showed an ERROR row.
    g = torch.Generator().manual_seed(0)
    batches = []
    for width in (4, 3, 5):
        images = torch.rand(8, 1, 8, 20, generator=g) * 2 - 1
        images[2, 0, 0, 0] = float("nan") if width == 3 else images[2, 0, 0, 0]
        text = torch.randint(1, 11, (8, width), generator=g)
        batches.append((images, (text, torch.full((8,), width))))
    r = doctor.validate_data(batches)
    kinds = {f.kind: f for f in r.findings()}
    assert "data_nonfinite" in kinds and "1 NaN" in kinds["data_nonfinite"].title, list(kinds)
    assert r.splits["train"]["samples"] == 24 and r.splits["train"]["targets"] is None
    f = kinds["targets_not_read"]
    assert f.severity == "info" and "tuple" in f.title, f.title


class _Windows(Dataset):
    """thuml/Time-Series-Library data_provider/data_loader.py's Dataset_Custom.__getitem__
    @4e938a1: ``seq_x = data[s_begin:s_end]``, ``seq_y = data[r_begin:r_end]`` with
    ``r_begin = s_end - label_len``; the target is the horizon, ``seq_y[-pred_len:]``. ``shift``
    moves the target window back into the input (an off-by-``pred_len`` ``r_begin``)."""

    def __init__(self, data, shift=0, seq_len=48, label_len=24, pred_len=24):
        self.data, self.shift, self.s, self.l, self.p = data, shift, seq_len, label_len, pred_len

    def __len__(self):
        return len(self.data) - self.s - self.p + 1

    def __getitem__(self, i):
        s_end = i + self.s
        r_begin = s_end - self.l - self.shift
        seq_x, seq_y = self.data[i:s_end], self.data[r_begin : r_begin + self.l + self.p]
        return (seq_x, seq_y[: self.l]), seq_y[-self.p :]


def _series(n=600):
    rng = np.random.default_rng(0)
    t = np.arange(n)[:, None]
    return (np.sin(2 * np.pi * t / np.array([24, 48, 72])) + 0.1 * rng.standard_normal((n, 3))).astype(np.float32)


def test_a_forecasting_target_inside_its_input_window_is_a_leak():
    """A target window that lies inside the input window (r_begin off by pred_len): the model
    reads the answer, the validation loss sits near 0 (0.028 against a training loss of 0.14 on
    PatchTST) and nothing else looks wrong. The check names the input steps it copies."""
    report = doctor.validate_data(_Windows(_series(), shift=24), _Windows(_series(), shift=24))
    (f,) = report.by_kind("target_in_input")
    assert f.severity == "error" and (f.evidence["first_step"], f.evidence["steps"]) == (24, 24)
    # the honest windows: the decoder's label_len part overlaps the input by design, the horizon not
    assert doctor.validate_data(_Windows(_series()), _Windows(_series())).by_kind("target_in_input") == []


def test_a_dataset_of_numpy_windows_with_several_inputs_is_read():
    """Time-Series-Library's datasets hand out NumPy arrays, and a forecaster's inputs are several
    (the series and the decoder's start): the first array of the inputs is judged, as the first
    tensor is (it raised "train inputs must be a tensor or a NumPy array, got tuple")."""
    report = doctor.validate_data(_Windows(_series()))
    assert report.splits["train"]["shape"] == [48, 3] and report.splits["train"]["targets"]["shape"] == [24, 3]


def test_windows_of_a_series_with_rare_spikes_are_not_near_duplicates():
    """A forecasting series with rare 40-sigma spikes (1% of the time steps), standardised as
    Time-Series-Library's StandardScaler does: the spikes inflate every column's std, against
    which the spike-free windows of a periodic series differ by a few hundredths, and test
    windows read as near copies of training windows (a leaked_near_duplicates warning). A column's
    scale is the spread of its bulk (the median absolute deviation), not its std."""
    rng = np.random.default_rng(1)
    data = _series(1400)
    spikes = rng.random(1400) < 0.01
    data[spikes] += 40 * rng.standard_normal((int(spikes.sum()), 3)).astype(np.float32)
    data = (data - data[:980].mean(0)) / data[:980].std(0)
    report = doctor.validate_data(_Windows(data[:980]), _Windows(data[980 - 48 :]))
    assert report.by_kind("leaked_near_duplicates") == []
