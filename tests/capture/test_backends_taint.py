"""Both recorder backends judge alike: harmful, intended, unknown (capture/_taint.py).

The programs are issue 11's (``tests/true_models.py``) and the small cases of
``test_taint.py``: every execution's taint and origin, the first harmful value, the intended
infinities and the harmful counts must be the same under the native core and the dispatch
mode (see crosscheck.py). Each program is also checked to hold what it is about, so that a
comparison of two empty answers cannot pass.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
import true_models as M
from tests_capture_crosscheck import crosscheck  # noqa: I001 - see conftest (path of this folder)
from torch import nn

from trainguard.store._codec import T_UNKNOWN

INF = float("inf")


def _exp_into_loss():
    return lambda: M.train_exp(4)


def _masked_gpt():
    return lambda: M.train_gpt(2, padded=True)


def _fully_masked_row():
    return lambda: M.train_gpt(3, padded=True, empty_at=1)


def _rmsnorm_backward():
    return lambda: M.train_rmsnorm(steps=2, width=8, depth=2)


def _gcn():
    return lambda: M.train_gcn(2)


def _read_pending_inf():
    def program():
        big = torch.tensor([1.0, 100.0]).exp() * 1e-30  # +inf, pending until read
        unread = torch.tensor([100.0]).exp()  # never read: intended, absorbed by nothing
        with redirect_stdout(io.StringIO()):
            print(big)
        big.add(1).tolist()
        unread.neg()
    return program


def _garbage():
    def program():
        bucket = torch.empty(1000)
        view = bucket.as_strided((10, 10), (10, 1), 100)  # DDP's gradient buckets
        view.copy_(torch.ones(10, 10))
        view.mul(2)
        torch.empty(8).copy_(torch.empty(8)).view(2, 4).t()
    return program


def _nt_xent_masked_diagonal():
    # SimCLR's NT-Xent (sthalles/SimCLR): the diagonal masked with -inf before cross_entropy;
    # log_softmax makes -inf there and saves it for its backward, which absorbs it.
    def program():
        torch.manual_seed(0)
        z = nn.functional.normalize(torch.randn(6, 4, requires_grad=True), dim=1)
        sim = (z @ z.T / 0.5).masked_fill(torch.eye(6, dtype=torch.bool), -INF)
        nn.functional.cross_entropy(sim, torch.tensor([3, 4, 5, 0, 1, 2])).backward()
    return program


def _temperature_zero():
    # MoCo's logits /= self.T (facebookresearch/moco moco/builder.py) with T = 0: +-inf into
    # cross_entropy's log_softmax, NaN there; the division is the origin.
    def program():
        torch.manual_seed(0)
        q = nn.functional.normalize(torch.randn(4, 8, requires_grad=True), dim=1)
        logits = q @ nn.functional.normalize(torch.randn(8, 6), dim=0)
        logits /= 0.0
        nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).backward()
    return program


def _param_and_optimizer():
    def make():
        lin = nn.Linear(3, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=1e30)  # the update overflows: optimizer-phase inf
        x = torch.full((4, 3), 1e10)

        def program():
            lin(x).pow(2).sum().backward()
            opt.step()
            with torch.no_grad():
                lin.bias.add_(torch.tensor([INF, 0.0]))  # an inf written into a parameter
        return program
    return make


def _inf_into_an_embedding_row():
    # facebookresearch/dlrm's nn.EmbeddingBag(mode="sum", sparse=True) table, one row of which
    # a user overwrites with +inf (a pretrained vector read with an overflow): the write into the
    # parameter, through the row's view, is where the inf became harmful.
    def make():
        emb = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
        ids = torch.tensor([[1, 2], [3, 4]])

        def program():
            emb(ids).sum()  # (the recorder names a module's parameters when it first runs)
            with torch.no_grad():
                emb.weight[1] = INF  # ROW_LINE
            emb(ids).sum()
        return program
    return make


def _inf_written_into_the_data():
    # lucidrains/vector-quantize-pytorch examples/autoencoder.py's VQ autoencoder, trained on a
    # synthetic image tensor one pixel of which was set to +inf after it was made (X[i, c, h, w]
    # = inf): the DataLoader's collate selects samples (X[i]) and stacks them, and the conv's
    # output reaches the loss. The write into the data, through the pixel's view, made the inf;
    # the select that later reads the tensor only passes it on.
    def make():
        x = torch.rand(8, 1, 4, 4) * 2 - 1
        conv = nn.Conv2d(1, 2, 3, padding=1)

        def program():
            data = x.clone()
            data[5, 0, 1, 1] = INF  # WRITE_LINE
            batch = torch.stack([data[i] for i in range(4, 8)])  # default_collate
            conv(batch).abs().mean().backward()
        return program
    return make



def _inf_written_into_a_sample():
    # pytorch/ignite's examples/mnist/mnist.py (create_supervised_trainer over a DataLoader) with a
    # synthetic data set, one sample of which is overwritten with +inf before training: a write
    # through a view (``x[5, 0, 2, 2] = inf`` is select, select, select, copy_), which the
    # DataLoader hands out two batches later. The write is the origin, not the DataLoader's select.
    def make():
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3), nn.LogSoftmax(-1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def program():
            x = torch.randn(8, 1, 6, 6)
            y = torch.randint(0, 3, (8,))
            x[5, 0, 2, 2] = INF  # SAMPLE_LINE
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.nll_loss(model(xb), yb).backward()
                opt.step()
        return program
    return make

PROGRAMS = {
    # name: (make_program, what the run must hold: "harmful", "intended" or both)
    "exp_into_loss": (_exp_into_loss, {"harmful"}),
    "masked_gpt": (_masked_gpt, {"intended"}),
    "fully_masked_row": (_fully_masked_row, {"harmful", "intended"}),
    "rmsnorm_backward": (_rmsnorm_backward, {"harmful"}),
    "gcn_reciprocal": (_gcn, {"intended"}),
    "read_pending_inf": (_read_pending_inf, {"harmful", "intended"}),
    "garbage": (_garbage, {"unknown"}),
    "param_and_optimizer": (_param_and_optimizer(), {"harmful"}),
    "nt_xent_masked_diagonal": (_nt_xent_masked_diagonal, {"intended"}),
    "temperature_zero": (_temperature_zero, {"harmful"}),
    "inf_into_an_embedding_row": (_inf_into_an_embedding_row(), {"harmful"}),
    "inf_written_into_the_data": (_inf_written_into_the_data(), {"harmful"}),
    "inf_written_into_a_sample": (_inf_written_into_a_sample(), {"harmful"}),
}


def _holds(got) -> set[str]:
    run = got["run"]
    out = set()
    if run.first_harm() is not None:
        out.add("harmful")
    if run.intended():
        out.add("intended")
    if any(r[11] == T_UNKNOWN for r in got["records"]):
        out.add("unknown")
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_same_taint_and_origin(tmp_path, name):
    make, holds = PROGRAMS[name]
    problems, _, py, nat = crosscheck(make, tmp_path, "full_health")
    assert problems == [], "\n".join(problems[:20])
    assert holds <= _holds(nat) and holds <= _holds(py)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["curt_health", "concise_health", "stats"])
def test_same_taint_in_other_modes(tmp_path, mode):
    problems, _, py, nat = crosscheck(_fully_masked_row, tmp_path, mode)
    assert problems == [], "\n".join(problems[:20])
    assert nat["run"].first_harm()["op"] == "aten._softmax.default"


@pytest.mark.filterwarnings("ignore")
def test_same_taint_with_deferred_summaries(tmp_path):
    # Judged by the writer's thread under both backends (the health arrives with the batch).
    problems, _, py, nat = crosscheck(_exp_into_loss, tmp_path, "full_health", strategy="deferred")
    assert problems == [], "\n".join(problems[:20])
    assert any(r[11] is None for r in nat["records"])  # handed to the writer's judge
    assert nat["run"].first_harm()["reason"] == "loss"


def test_native_records_say_which_backend_judged(tmp_path):
    import trainguard as tg
    from trainguard.store import open_run

    with tg.record(tmp_path / "r", backend="native") as rec:
        M.train_exp(4)
    assert rec.backend == "native"
    run = open_run(tmp_path / "r")
    assert run.meta["backend"] == "native"
    assert run.first_harm()["reason"] == "loss" and run.execution(run.first_harm()["origin"])["op"] == "aten.exp"


def _both_backends_and_line(factory, marker: str, tmp_path):
    """The program ``factory()`` makes, recorded by both backends and cross-checked (no problem),
    and the line of ``factory``'s source marked ``marker``."""
    import inspect

    problems, _, py, nat = crosscheck(factory(), tmp_path, "full_health")
    assert problems == [], "\n".join(problems[:20])
    lines, start = inspect.getsourcelines(factory)
    return py["run"], nat["run"], start + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.filterwarnings("ignore")
def test_an_inf_written_into_a_row_of_a_parameter_is_harmful_at_the_write(tmp_path):
    *runs, row_line = _both_backends_and_line(_inf_into_an_embedding_row, "ROW_LINE", tmp_path)
    for run in runs:
        first = run.first_harm()
        assert first["reason"] == "parameter" and first["op"] == "aten.fill_.Tensor", first
        assert run.user_frame(run.execution(first["seq"])["stack_id"])["lineno"] == row_line


@pytest.mark.filterwarnings("ignore")
def test_an_inf_written_into_an_element_of_the_data_is_the_origin_not_the_select_that_reads_it(tmp_path):
    *runs, write_line = _both_backends_and_line(_inf_written_into_the_data, "WRITE_LINE", tmp_path)
    for run in runs:
        first = run.first_harm()
        assert first["reason"] == "loss", first
        origin = run.execution(first["origin"])
        assert origin["op"] != "aten.select.int", origin
        assert run.user_frame(origin["stack_id"])["lineno"] == write_line, origin


@pytest.mark.filterwarnings("ignore")
def test_an_inf_written_into_a_sample_of_the_data_is_the_origin(tmp_path):
    from trainguard.analysis import origin

    *runs, sample_line = _both_backends_and_line(_inf_written_into_a_sample, "SAMPLE_LINE", tmp_path)
    for run in runs:
        o = origin(run)
        assert o is not None and o.chain[0].step == 2, o  # the batch that holds sample 5
        assert o.origin.op != "aten.select.int", o.summary  # the DataLoader reading the sample
        assert o.origin.line == sample_line, o.summary
        assert "overflowing" not in o.suggestion, o.suggestion  # no learning rate made it


def _inf_loss_skipped_and_read_through_data():
    # normflows' examples (VincentStimper/normalizing-flows, real_nvp_colab.ipynb): the affine
    # coupling's inverse `(z2 - shift) * torch.exp(-scale_)` overflows, the loop skips the step
    # with `if ~(torch.isnan(loss) | torch.isinf(loss))` and logs `loss.to('cpu').data.numpy()`.
    def make():
        torch.manual_seed(0)
        param_map = nn.Linear(1, 2)
        with torch.no_grad():
            param_map.bias.fill_(-100.0)  # a scale of -100: exp(100) overflows float32
        opt = torch.optim.Adam(param_map.parameters(), lr=1e-3)
        x = torch.randn(8, 2)

        def program():
            opt.zero_grad()
            param = param_map(x[:, :1])
            z2 = (x[:, 1:] - param[:, :1]) * torch.exp(-param[:, 1:])  # EXP_LINE
            loss = -torch.mean(-0.5 * z2.pow(2).sum(1) - param[:, 1:].sum(1))
            if ~(torch.isnan(loss) | torch.isinf(loss)):
                loss.backward()
                opt.step()
            loss.to("cpu").data.numpy()
        return program
    return make


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_loss_the_loop_skips_but_reads_through_data_is_harmful(tmp_path, backend):
    # The native core missed the read: `.data` is a new TensorImpl over the loss's storage that no
    # op made, so numpy()'s own detach of it came "from outside the recording" (an intended +inf
    # of its own) and the read found no producer: "No harmful NaN or Inf", the loss's inf
    # "intended, absorbed by isinf". The dispatch mode sees `.data` as a detach of the loss. (Not
    # a crosscheck: which op stands for `.data` differs by design, see MODE_ONLY.)
    import inspect

    import trainguard as tg
    from trainguard.store import open_run

    program = _inf_loss_skipped_and_read_through_data()()
    with tg.record(tmp_path / "r", backend=backend, mode="full_health"):
        program()
    lines, start = inspect.getsourcelines(_inf_loss_skipped_and_read_through_data)
    exp_line = start + next(i for i, text in enumerate(lines) if "EXP_LINE" in text)
    run = open_run(tmp_path / "r")
    first = run.first_harm()
    assert first is not None and first["reason"] == "read", first
    origin = run.execution(first["origin"])
    assert origin["op"] == "aten.exp", origin
    assert run.user_frame(origin["stack_id"])["lineno"] == exp_line, origin
    assert not [i for i in run.intended() if i["made_by"] == "aten.detach.default"], run.intended()
