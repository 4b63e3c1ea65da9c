"""The guard names the samples of a skipped batch in whose rows the first harmful value is.

Found on thuml/Time-Series-Library (models/PatchTST.py's normalisation without its eps, a sensor
stuck for 50 hours in the data): the guard skipped five batches, each with 16 sample indices,
and the user could not tell which sample in each was bad (the windows over the stuck rows)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.store import open_run

from .conftest import BS, PolyNet, finite, line_of, make_data, make_state, train


def test_the_samples_that_made_the_nan_are_named_in_the_event_the_line_and_the_run(tmp_path, caplog):
    state = make_state(make_data(30, poison_sample=77), shuffle=True)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        train(guard.batches(state, total_steps=40), state)
    [event] = guard.events
    samples = event["skipped"][0]["samples"]
    assert 77 in samples and len(samples) == BS
    assert event["culprits"] == {"size": BS, "rows": [samples.index(77)], "samples": [77]}
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.endswith(f"skipped batch {event['skipped'][0]['batch']} (the first inf is in its sample 77)")
    with open_run(tmp_path / "run") as run:
        [stored] = run.findings(source="guard")
        assert stored["event"]["culprits"]["samples"] == [77]
    out = subprocess.run([sys.executable, "-m", "trainguard", "report", str(tmp_path / "run")], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert f"the first non-finite values are in the row of sample 77 (row {samples.index(77)} of {BS} in the batch)" in out


class Normalised(nn.Module):
    """Time-Series-Library's PatchTST normalisation (models/PatchTST.py, ``forecast``) without
    its ``+ 1e-5``: a window whose channel is constant divides 0 by 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6 * 2, 3)

    def forward(self, x):  # [batch, time, channels]
        x = x - x.mean(1, keepdim=True)
        x = x / torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False))
        return self.fc(x.flatten(1))


def test_two_stuck_windows_in_one_batch_are_both_named(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, 2, generator=g), torch.randn(40, 3, generator=g)
    x[13, :, 1] = 3.0  # a channel stuck in two windows
    x[14, :, 1] = 3.0
    torch.manual_seed(0)
    model = Normalised()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=8))
    guard = tg.Guard(tmp_path / "run", snapshot_every=2)
    for _, (xb, yb) in guard.batches(state, total_steps=4):
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    [event] = guard.events
    assert event["skipped"][0]["samples"] == list(range(8, 16))
    assert event["culprits"] == {"size": 8, "rows": [5, 6], "samples": [13, 14]}
    assert event["message"].endswith("(the first nan is in its samples 13, 14)")


class Transposed(nn.Module):
    """The overflow is made in a tensor whose first dimension is the features', not the batch's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(BS, 1)

    def forward(self, x):  # [batch, features]
        f = x.t().pow(2)  # [features, batch]: the bad sample's column is inf in every row
        return self.fc(f).sum() * torch.ones(x.shape[0], 1)


@pytest.mark.parametrize("features", [3, BS])  # BS: the first dimension has the batch's size by chance
def test_no_sample_is_named_when_the_first_dimension_is_not_the_batch(tmp_path, features):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30 * BS, features, generator=g), torch.randn(30 * BS, 1, generator=g)
    x[77] = 1e20
    state = make_state(TensorDataset(x, y), model=Transposed(), lr=1e-3)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    train(guard.batches(state, total_steps=30), state)
    [event] = guard.events
    assert event["origin"]["origin"]["op"].startswith("aten.pow")
    assert 77 in event["skipped"][0]["samples"]
    assert "culprits" not in event and "first inf is in" not in event["message"]


class Critic(nn.Module):
    """pytorch/examples dcgan/main.py's discriminator, shrunk: a convolution first, then
    BatchNorm, LeakyReLU and a Sigmoid. One image of the dataset holds an inf pixel."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Conv2d(1, 4, 4, 2, 1), nn.BatchNorm2d(4), nn.LeakyReLU(0.2),
                                  nn.Conv2d(4, 1, 4, 1, 0), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


@pytest.mark.parametrize("workers", [0, 2])  # 2: the batch is made in another process
def test_a_batch_that_holds_the_inf_itself_is_blamed_on_the_data_not_on_an_overflow(tmp_path, workers):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12 * BS, 1, 8, 8, generator=g)
    x[21, 0, 3, 3] = float("inf")  # one corrupt pixel
    y = torch.ones(12 * BS)
    torch.manual_seed(0)
    state = make_state(TensorDataset(x, y), model=Critic(), lr=2e-4, num_workers=workers)
    guard = tg.Guard(tmp_path / "run", snapshot_every=2)
    train(guard.batches(state, total_steps=8), state)
    [event] = guard.events
    assert event["skipped"][0]["samples"] == [20, 21, 22, 23]
    assert event["batch_nonfinite"] == {"size": BS, "rows": [1], "samples": [21], "kinds": ["inf"], "where": "[0]"}
    fix = event["origin"]["suggestion"]
    assert "learning rate" not in fix and "the batch itself" in fix and "doctor" in fix, fix
    assert event["message"].endswith("(its sample 21 holds inf in the batch itself)"), event["message"]


def test_a_sample_that_held_the_inf_itself_is_skipped_in_later_epochs_without_a_rewind(tmp_path, capsys, caplog):
    # Found by the ddp trial on pytorch/examples' imagenet loop: a corrupt sample came back every
    # epoch, and every epoch the guard rewound, replayed and skipped it again, spending a rewind
    # (max_rewinds ends the run) and a full recording per epoch on a fault it had already named.
    data = make_data(12)
    data.tensors[0][21, 0] = float("inf")  # one corrupt value in sample 21
    state = make_state(data, shuffle=True)
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        steps = train(guard.batches(state, total_steps=4 * 12), state)
    assert steps[-1] == 4 * 12 - 1 and finite(state)
    assert guard.rewinds == 1 and len(guard.events) == 1
    assert guard.events[0]["batch_nonfinite"]["samples"] == [21]
    # epochs 1, 2 and 3 each drew the batch holding sample 21 once, and skipped it unread
    assert [s["epoch"] for s in guard.skipped_known] == [1, 2, 3]
    assert all(21 in s["samples"] and s["known_from_event"] == 1 for s in guard.skipped_known)
    last = guard.skipped_known[-1]
    said = [r.getMessage() for r in caplog.records if "held NaN/Inf" in r.getMessage()]
    assert said[-1] == (f"trainguard: skipped batch {last['batch']} at step {last['step']}: its sample 21 held "
                        "NaN/Inf in the batch itself (event 1)"), said
    meta = open_run(tmp_path / "run").meta["guard"]
    assert meta["rewinds"] == 1 and meta["skipped_known"] == 3
    from trainguard.cli import main

    assert main(["report", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "3 later batches held a sample an event found corrupt in the batch itself, and were skipped unread" in out, out


def test_a_known_corrupt_sample_skipped_again_in_a_replay_is_counted_once(tmp_path):
    # A later fault's rewind replays the steps since the snapshot, a known skip among them: the
    # batch is skipped again (as the first time), but it is one batch the run never trained on.
    data = make_data(12)
    data.tensors[0][21, 0] = float("inf")  # batch 5 of every epoch (no shuffle)
    data.tensors[1][44, 0] = 1e6  # batch 11: a loss that takes the log of (1e4 - y) goes NaN on it

    def loss_fn(out, y, step):
        return nn.functional.mse_loss(out, y) + 0 * torch.log(1e4 - y).mean()

    state = make_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=7, max_rewinds=10)
    train(guard.batches(state, total_steps=22), state, loss_fn=loss_fn)
    # sample 21 at step 5; batch 11's fault at steps 10 and 20, the last rewound to step 14, before
    # the known skip of step 15
    assert [(e["step"], e["rewound_to"]) for e in guard.events] == [(5, 0), (10, 7), (20, 14)]
    assert [(s["step"], s["epoch"], s["index"]) for s in guard.skipped_known] == [(15, 1, 5)]
    assert open_run(tmp_path / "run").meta["guard"]["skipped_known"] == 1


class _Windows(torch.utils.data.Dataset):
    """thuml/Time-Series-Library's Dataset_Custom (data_provider/data_loader.py), reduced: sample i
    is the window series[i:i+4] and the value after it, so one missing value in the file is in
    every window over it."""

    def __init__(self, series):
        self.series = series

    def __len__(self):
        return len(self.series) - 4

    def __getitem__(self, i):
        return self.series[i:i + 4], self.series[i + 4:i + 5]


def test_batches_after_a_skipped_one_that_hold_nan_themselves_are_data_not_a_code_bug(tmp_path):
    # Time-Series-Library with one empty cell in its CSV (ETT format) under `trainguard run
    # --guard`: the guard skipped the first batch ("its sample 271 holds nan in the batch itself"),
    # then stopped: "the next batch fails the same way, so the fault follows the code, not the
    # data (trainguard.Diverged)" - the next batch held windows over the same missing value.
    series = torch.randn(12 * BS + 4, generator=torch.Generator().manual_seed(0))
    series[20] = float("nan")  # in samples 16 to 20: batches 4 and 5
    state = make_state(_Windows(series))
    guard = tg.Guard(tmp_path / "run", snapshot_every=2)
    steps = train(guard.batches(state, total_steps=10), state)
    assert steps[-1] == 9 and finite(state)
    assert [e["action"] for e in guard.events] == ["skip", "skip"], [e["message"] for e in guard.events]
    assert [20] in [e["batch_nonfinite"]["samples"] for e in guard.events]
    assert all("the batch itself" in e["message"] for e in guard.events), [e["message"] for e in guard.events]


def test_samples_whose_targets_hold_nan_are_named_beside_those_whose_inputs_do():
    # Time-Series-Library's windows under the guard: one window's input held a missing value and
    # another window's target did; the event named the first sample only (the first tensor of the
    # batch that held NaN), so the skip that followed for the second came as a surprise.
    from trainguard.guard._replay import batch_nonfinite

    x, y = torch.zeros(4, 3), torch.zeros(4, 2)
    x[1, 0] = float("nan")
    y[3, 1] = float("inf")
    assert batch_nonfinite((x, y), [20, 21, 22, 23]) == {
        "size": 4, "rows": [1, 3], "samples": [21, 23], "kinds": ["nan", "inf"], "where": "[0] and batch[1]"}
    y[3, 1] = 0.0
    assert batch_nonfinite((x, y), [20, 21, 22, 23])["samples"] == [21]


def test_max_rewinds_spent_on_batches_that_held_nan_themselves_says_the_data_set_does(tmp_path):
    # Time-Series-Library with missing values in many rows of its CSV under `trainguard run
    # --guard`: five skips, each naming a sample holding NaN in the batch itself, then only
    # "stopped: max_rewinds=5 spent", with no word that the data set holds NaN throughout.
    data = make_data(12)
    for s in (5, 14, 23, 30, 41):  # a bad sample in five batches
        data.tensors[0][s, 1] = float("nan")
    state = make_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=2, max_rewinds=3)
    with pytest.raises(tg.Diverged) as info:
        train(guard.batches(state, total_steps=12), state)
    last = guard.events[-1]
    assert last["action"] == "max_rewinds" and last["data_samples"] == [5, 14, 23], last
    msg = str(info.value)
    assert "every rewind went to a batch holding NaN/Inf itself" in msg, msg
    assert "samples 5, 14, 23)" in msg and "the data set" in msg and "doctor" in msg, msg


class _GraphBatch:
    """torch_geometric.data.Batch as its DataLoader collates graphs (mutag_gin.py): node features
    ``x`` of all graphs stacked, ``batch`` the graph of each node, ``y`` one label per graph;
    ``to_dict()`` its attributes (the test install has no PyG)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    @property
    def num_graphs(self) -> int:
        return int(self.y.shape[0])

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def test_a_graph_batch_names_the_graph_whose_nodes_hold_nan():
    # pytorch_geometric's examples/mutag_gin.py under the guard with one graph of the data set holding
    # a NaN node feature (sample 37): batch_nonfinite looked into tuples, lists and dicts only, so
    # the guard said "index_select made nan from input 0, which came from outside the recording
    # ... check the inputs and the previous step", and rewound again each epoch the graph came back.
    from trainguard.guard._replay import batch_nonfinite

    sizes = [3, 4, 2, 5]  # nodes of graphs 0..3
    batch = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    x = torch.randn(sum(sizes), 6)
    x[3 + 4 + 1, 2] = float("nan")  # the second node of graph 2
    g = _GraphBatch(x=x, edge_index=torch.tensor([[0, 3, 7], [1, 4, 8]]), y=torch.tensor([0, 1, 1, 0]),
                    batch=batch, edge_attr=torch.ones(3, 2))
    assert batch_nonfinite(g, [35, 36, 37, 38]) == {
        "size": 4, "rows": [2], "samples": [37], "kinds": ["nan"], "where": ".x"}
    g.edge_attr[0, 1] = float("inf")  # an edge of graph 0
    assert batch_nonfinite(g, [35, 36, 37, 38])["samples"] == [35, 37]
    assert batch_nonfinite((g, g.y), [35, 36, 37, 38])["samples"] == [35, 37]


def test_lower_lr_skips_a_batch_that_held_nan_itself(tmp_path):
    # policy="lower_lr" on a corrupt sample: the event's fix said "the data is corrupt ...; the guard
    # skips such a batch each time" while the guard halved the learning rate and fed the same batch
    # again, twice, then stopped (max_rewinds spent) with the rate at a quarter. No learning rate
    # repairs a NaN in the data: that batch is skipped, the rate kept.
    data = make_data(30)
    data.tensors[0][10 * BS + 1, 2] = float("nan")  # one sample of batch 10
    state = make_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=4, policy="lower_lr", max_rewinds=2)
    train(guard.batches(state, total_steps=30), state)
    [event] = guard.events
    assert event["action"] == "skip" and event["skipped"][0]["samples"] == list(range(10 * BS, 11 * BS)), event
    assert "lower_lr" in event["policy_note"] and "data" in event["policy_note"], event
    assert [g["lr"] for g in state.optimizer.param_groups] == [pytest.approx(1e-2 * 0.5 ** (30 // 30))]
    assert state.step == 30 and finite(state)


class _PoissonLike(torch.utils.data.Sampler):
    """Fixed batches of varying size, two of them empty in a row: what opacus' Poisson sampling
    (the loader make_private returns) draws now and then with a small expected batch size."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        start = 0
        for n in self.sizes:
            yield list(range(start, start + n))
            start += n


def _collate_with_empty(batch):
    # opacus' DPDataLoader makes an empty batch as tensors of 0 rows (torch.empty)
    if not batch:
        return torch.empty((0, 4)), torch.empty((0, 1))
    return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])


def test_empty_batches_in_a_row_are_the_datas_not_a_code_bug(tmp_path):
    # opacus' examples/mnist.py (Poisson sampling, an expected batch of 2 of 64 samples) in
    # ckpt.resume()'s loop under the guard: an empty batch's mean loss is 0/0, the guard skipped
    # it, the next batch was empty too, and it stopped a healthy run: "the next batch fails the
    # same way, so the fault follows the code, not the data (trainguard.Diverged)".
    state = make_state(make_data(6))
    state.loader = DataLoader(state.loader.dataset, batch_sampler=_PoissonLike([4, 3, 0, 0, 5, 4, 2, 4]),
                              collate_fn=_collate_with_empty)
    guard = tg.Guard(tmp_path / "run", snapshot_every=2)
    steps = train(guard.batches(state, total_steps=6), state)
    assert steps[-1] == 5 and finite(state)
    assert [e["action"] for e in guard.events] == ["skip", "skip"], [e["message"] for e in guard.events]


def test_the_origin_of_an_inf_the_batch_held_itself_is_not_called_an_overflow(tmp_path):
    # Found writing the UI's guard-card test: the batch held an inf before any op ran, the replay's
    # first op to read it was x.pow(2), and the guard's line said "origin: aten.pow.Tensor_Scalar ...
    # — pow overflow: an input value too large for a power in float32 (x**2 passes its largest value
    # above about 1.84e+19); skipped batch 7 (its sample 29 holds inf in the batch itself)": the
    # explanation contradicted the skip text beside it. No finite value overflowed here.
    data = make_data(12)
    data.tensors[0][29, 0] = float("inf")  # batch 7
    state = make_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    train(guard.batches(state, total_steps=10), state)
    [event] = guard.events
    link = event["origin"]["origin"]
    assert link["op"].startswith("aten.pow") and link["line"] == line_of("POW_LINE", PolyNet.forward)
    assert "overflow" not in link["explanation"] and "overflow" not in event["message"], event["message"]
    assert link["explanation"] == ("pow received inf from the batch itself (its sample 29 held inf before "
                                   "any op ran) and passed it on"), link["explanation"]


def test_a_finite_outlier_that_makes_the_same_nan_every_epoch_stops_costing_rewinds(tmp_path, caplog, capsys):
    # Found trying the guard on a data set with one finite outlier (a sample of 1e20 that x.pow(2)
    # overflows): every epoch the guard rewound, replayed and skipped it again, naming "the first inf
    # is in its sample 29" each time, and after max_rewinds=5 (epoch 6 of 8) it stopped the run with
    # Diverged. The data holds no NaN/Inf itself, so the skip of known-corrupt samples never applied.
    # The second event that names the same sample for the same op and line is evidence enough: later
    # batches holding it are skipped unread.
    data = make_data(10, poison_sample=29)
    state = make_state(data, shuffle=True)
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        steps = train(guard.batches(state, total_steps=8 * 10), state)
    assert steps[-1] == 8 * 10 - 1 and finite(state)
    assert [e["action"] for e in guard.events] == ["skip", "skip"] and guard.rewinds == 2
    assert all(e["culprits"]["samples"] == [29] for e in guard.events)
    assert "as in event 1: later batches holding it are skipped unread" in guard.events[1]["message"]
    # each later epoch drew the batch holding sample 29 once (the first two skipped it with an event);
    # 80 steps and 9 skipped batches reach into epoch 8
    assert [s["epoch"] for s in guard.skipped_known] == [2, 3, 4, 5, 6, 7, 8]
    assert all(29 in s["samples"] for s in guard.skipped_known)
    assert all(s["known_from_event"] == 2 and s["why"] == "repeat" for s in guard.skipped_known)
    said = [r.getMessage() for r in caplog.records if "skipped batch" in r.getMessage() and "at step" in r.getMessage()]
    assert "its sample 29 made the NaN/Inf of events 1 and 2 (aten.pow.Tensor_Scalar at " in said[-1], said
    assert said[-1].endswith(f"conftest.py:{line_of('POW_LINE')})"), said
    meta = open_run(tmp_path / "run").meta["guard"]
    assert meta["rewinds"] == 2 and meta["skipped_known"] == 7 and meta["skipped_repeat"] == 7
    from trainguard.cli import main

    assert main(["report", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert ("7 later batches held a sample two events blamed for the same fault, and were "
            "skipped unread (no rewind); the last at step") in out, out
    assert "found corrupt in the batch itself" not in out
    # a rerun into the same run remembers it too
    state = make_state(data, shuffle=True)
    again = tg.Guard(tmp_path / "run", snapshot_every=5)
    train(again.batches(state, total_steps=2 * 10), state)
    assert again.events == [] and len(again.skipped_known) == 2


def test_a_mislabelled_sample_that_spikes_the_loss_every_epoch_stops_costing_rewinds(tmp_path, caplog):
    # As with a finite outlier that overflows: one sample whose label is 1000x the others' made a
    # loss spike every epoch, each spent a rewind, and after max_rewinds=5 the guard ended the run
    # with Diverged (8 epochs asked, 7 reached). A spike has no NaN to trace to a row, so the
    # suspects are the samples of the spiking batches: a sample in two of them is skipped unread
    # from then on (shuffled batches share no other sample here; without shuffling the whole batch
    # is skipped each epoch, as each rewind would have done anyway).
    data = make_data(10)
    data.tensors[1][29] *= 1000.0
    state = make_state(data, shuffle=True)
    guard = tg.Guard(tmp_path / "run", snapshot_every=5, spike_factor=5.0)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        steps = train(guard.batches(state, total_steps=8 * 10), state)
    assert steps[-1] == 8 * 10 - 1 and finite(state)
    assert [(e["action"], e["trigger"]) for e in guard.events] == [("skip", "spike")] * 2 and guard.rewinds == 2
    assert "as in event 1: later batches holding it are skipped unread" in guard.events[1]["message"]
    assert guard.skipped_known and all(s["samples"].count(29) == 1 and s["why"] == "repeat" for s in guard.skipped_known)
    said = [r.getMessage() for r in caplog.records if "skipped batch" in r.getMessage() and "at step" in r.getMessage()]
    assert said[-1].endswith("its sample 29 was in the batches of the loss spikes of events 1 and 2"), said


def test_batches_of_offsets_into_a_series_holding_nan_are_data_not_a_code_bug(tmp_path):
    # rtqichen/torchdiffeq's examples/ode_demo.py draws batches of start times and reads each
    # window from the trajectory it holds (``true_y[s + i]``). With one NaN in the trajectory under
    # the guard, a batch over it was skipped; the next batch, over it too, made the guard stop: "the
    # next batch fails the same way, so the fault follows the code, not the data" - while the
    # origin said the NaN came in with a tensor made before the replay (the trajectory).
    series = torch.randn(16 * BS + 5, generator=torch.Generator().manual_seed(0))
    series[30] = float("nan")  # in the windows of offsets 26 to 30: batches 6 and 7
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(torch.arange(16 * BS)), batch_size=BS)
    state = tg.TrainState(model=model, optimizer=opt, loader=loader)
    guard = tg.Guard(tmp_path / "run", snapshot_every=2)
    for _step, (s,) in guard.batches(state, total_steps=12):
        x = torch.stack([series[s + i] for i in range(4)], dim=1)
        loss = nn.functional.mse_loss(model(x)[:, 0], series[s + 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [e["action"] for e in guard.events] == ["skip", "skip"], [e["message"] for e in guard.events]
    assert all(torch.isfinite(p).all() for p in model.parameters())


class MnistNet(nn.Module):
    """pytorch/examples mnist/main.py's Net (@77f55b9), as it is."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = torch.flatten(self.dropout1(nn.functional.max_pool2d(x, 2)), 1)
        x = self.fc2(self.dropout2(torch.relu(self.fc1(x))))
        return nn.functional.log_softmax(x, dim=1)


def test_a_sample_that_overflows_the_optimizer_every_epoch_stops_costing_rewinds(tmp_path):
    # Found running pytorch/examples' MNIST model and optimizer (Adadelta, lr 1.0) under the guard
    # with one sample of 1e38 pixels: its gradients overflow Adadelta's square average (the origin is
    # aten.addcmul_ in opt.step(), whose rows are no batch's, so no culprit sample is known), every
    # epoch cost a rewind, and the sixth ended the run with Diverged at step 42 of 64. The samples of
    # the failing batch are the suspects, as for a loss spike: the one in most of them is skipped.
    torch.manual_seed(1)
    x, y = torch.randn(256, 1, 28, 28) * 0.3, torch.randint(0, 10, (256,))
    x[77, 0, 10:14, 10:14] = 1e38
    model = MnistNet()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    state = tg.TrainState(model=model, optimizer=opt,
                          loader=DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    steps = []
    for step, (data, target) in guard.batches(state, total_steps=64):
        opt.zero_grad()
        nn.functional.nll_loss(model(data), target).backward()
        opt.step()
        steps.append(step)
    assert steps[-1] == 63 and finite(state)
    # 32 of 256 samples a batch: two batches share other samples too (4 expected), so the fault's
    # next event decides among them, and only sample 77 is skipped from then on
    assert all(e["action"] == "skip" for e in guard.events) and 2 <= guard.rewinds <= 3, guard.events
    assert guard.events[0]["origin"]["origin"]["op"].startswith("aten.addcmul_")
    assert "sample 77 failed the step, as in event 1: later batches holding it are skipped unread" in guard.events[-1]["message"]
    assert guard.skipped_known and all(77 in s["samples"] and s["why"] == "repeat" for s in guard.skipped_known)


class _Agent(nn.Module):
    """cleanrl's ppo.py Agent in small (vwxyzjn/cleanrl @fe8d8a0): a tanh actor and critic over 4
    observations, 2 actions."""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def get_action_and_value(self, x, action=None):
        probs = torch.distributions.Categorical(logits=self.actor(x), validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def test_a_corrupt_sample_of_one_rollout_is_not_skipped_in_the_next_rollouts(tmp_path, caplog):
    # cleanrl's ppo.py under the guard as docs/guard.md has it: each iteration collects a rollout and
    # sets `state.loader = DataLoader(TensorDataset(b_obs, ...), shuffle=True)`, then runs its
    # update epochs through guard.batches. One NaN observation at row 17 of iteration 3's buffer
    # (4 envs x 64 steps, 16 updates per iteration): the guard rewound and skipped it, then kept
    # skipping every batch holding "sample 17" in iterations 4 on ("its sample 17 held NaN/Inf in
    # the batch itself"), rows of other rollouts that held nothing wrong: 6 healthy batches of 16
    # lost in iteration 4 alone. A fake environment stands in for CartPole here.
    torch.manual_seed(0)
    agent = _Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    state = tg.TrainState(agent=agent, optimizer=optimizer)
    guard = tg.Guard(tmp_path / "g")
    n, per_iter = 64, 4 * 4  # rollout rows (batch_size 16: 4 minibatches), 4 update epochs
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        for iteration in range(3):
            with torch.no_grad():  # the rollout
                b_obs = torch.randn(n, 4)
                b_actions, b_logprobs, _, b_values = agent.get_action_and_value(b_obs)
            b_returns = b_values.view(-1) + torch.randn(n)
            b_advantages = b_returns - b_values.view(-1)
            if iteration == 0:
                b_obs[17, 2] = float("nan")  # one corrupt observation
            state.loader = DataLoader(TensorDataset(b_obs, b_actions, b_logprobs, b_advantages, b_returns),
                                      batch_size=16, shuffle=True)
            for _, (obs, act, old_logprob, adv, ret) in guard.batches(state, total_steps=state.step + per_iter):
                _, logprob, entropy, value = agent.get_action_and_value(obs, act)
                ratio = (logprob - old_logprob).exp()
                pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
                loss = pg_loss - 0.01 * entropy.mean() + 0.5 * 0.5 * ((value.view(-1) - ret) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()
    assert guard.events and all(e["step"] < per_iter for e in guard.events), [e["step"] for e in guard.events]
    later = [i["step"] for i in guard.skipped_known if i["step"] >= per_iter]
    assert later == [], (later, [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()])
    assert all(p.isfinite().all() for p in agent.parameters())


class _PackedAttention(nn.Module):
    """bentrevett/pytorch-seq2seq legacy/4's Encoder and Attention (@ b3cd54c), cut down to one
    query: time-major ``[src len, batch]`` tokens, packed by their lengths (sorted, as
    ``pack_padded_sequence`` wants them), attention masked with ``-inf`` over the padding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = nn.GRU(8, 8)
        self.query = nn.Parameter(torch.randn(8))
        self.out = nn.Linear(8, 1)

    def forward(self, src, src_len):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(src), src_len.clamp(min=1))
        outputs, _ = nn.utils.rnn.pad_packed_sequence(packed, total_length=src.shape[0])
        outputs = outputs.permute(1, 0, 2)  # [batch, src len, hid]
        scores = (outputs @ self.query).masked_fill((src == 0).T, float("-inf"))
        return self.out((torch.softmax(scores, dim=1).unsqueeze(2) * outputs).sum(1))


def _sort_by_length(batch):
    """A collate_fn that sorts the batch by length, longest first, for pack_padded_sequence."""
    batch = sorted(batch, key=lambda p: len(p[0]), reverse=True)
    src = torch.zeros(max(len(s) for s, _ in batch), len(batch), dtype=torch.long)
    for i, (s, _) in enumerate(batch):
        src[: len(s), i] = torch.tensor(s, dtype=torch.long)
    return src, torch.tensor([len(s) for s, _ in batch]), torch.tensor([[y] for _, y in batch])


def test_a_collate_fn_that_sorts_the_batch_names_no_wrong_sample(tmp_path):
    """The rows of a batch a collate_fn sorted by length are not the loader's samples in order:
    with one empty source (sample 45, a fully masked attention row), the guard named whichever
    sample the sampler drew at the empty row's sorted position (a different one each epoch), so
    it never learned the bad sample and spent a rewind every epoch. It names no row's sample then,
    and the batches' samples make the bad one known after two events, as for a loss spike."""
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(1, 20, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist(),
              float(i % 3)) for i in range(96)]
    pairs[45] = ([], 0.0)  # every token of this source was filtered out
    torch.manual_seed(0)
    model = _PackedAttention()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(pairs, batch_size=8, shuffle=True, collate_fn=_sort_by_length,
                        generator=torch.Generator().manual_seed(0))
    state = tg.TrainState(model=model, optimizer=opt, loader=loader)
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    for _, (src, src_len, y) in guard.batches(state, total_steps=12 * 5):
        loss = nn.functional.mse_loss(model(src, src_len), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(e["culprits"]["samples"] == [45] for e in guard.events if "culprits" in e), \
        [e["message"] for e in guard.events]
    assert guard.rewinds <= 3 and guard.skipped_known and all(45 in s["samples"] for s in guard.skipped_known)


class _NestedTensor:
    """facebookresearch/detr util/misc.py's NestedTensor (@ 29901c5): the batched images and their
    padding mask as two attributes of a plain object, what its ``collate_fn`` hands out as
    ``samples`` beside the list of target dicts."""

    def __init__(self, tensors, mask):
        self.tensors = tensors
        self.mask = mask


def test_a_detr_batch_names_the_image_that_holds_nan():
    # facebookresearch/detr's batches are (NestedTensor, [{"boxes", "labels"}, ...]): batch_nonfinite
    # looked into tuples, lists, dicts and to_dict() only, so a NaN image in the NestedTensor was
    # never found in the batch itself (None).
    from trainguard.guard._replay import batch_nonfinite

    images = torch.randn(4, 3, 8, 8)
    images[2, 0, 5, 5] = float("nan")
    targets = [{"boxes": torch.rand(2, 4), "labels": torch.tensor([0, 1])} for _ in range(4)]
    samples = _NestedTensor(images, torch.zeros(4, 8, 8, dtype=torch.bool))
    assert batch_nonfinite((samples, targets), [35, 36, 37, 38]) == {
        "size": 4, "rows": [2], "samples": [37], "kinds": ["nan"], "where": "[0].tensors"}


def test_a_collate_fn_keeps_the_order_of_a_batch_that_holds_nan():
    # facebookresearch/detr's collate_fn (util/misc.py) over a data set with one NaN image: the probe
    # that tells a reordering collate_fn compared the batch collated as drawn and reversed with
    # torch.equal, NaN != NaN, so the failing batch's rows were said to be out of order, and the guard
    # named "row 1" instead of sample 17.
    from trainguard.guard._replay import rows_in_order

    def collate_fn(batch):
        batch = list(zip(*batch))
        batch[0] = _NestedTensor(torch.stack(batch[0]), torch.zeros(len(batch[0]), 4, 4, dtype=torch.bool))
        return tuple(batch)

    data = [(torch.randn(3, 4, 4), {"boxes": torch.rand(1, 4)}) for _ in range(20)]
    data[17][0][0, 1, 2] = float("nan")
    loader = DataLoader(data, batch_size=4, collate_fn=collate_fn)
    assert rows_in_order(loader, [16, 17, 18, 19])
