"""The doctor's model checks on graph batches shaped like PyTorch Geometric's ``Data`` and
``Batch`` (the tests do not install PyG: ``Graph``/``GraphBatch`` below follow its API, duck-typed
by the doctor: ``apply``, ``subgraph``, ``num_nodes``; ``num_graphs``, ``to_data_list`` and
``from_data_list``). Every check raised ``batch inputs hold no tensor, got DataBatch`` on
pytorch_geometric's examples/mutag_gin.py batches, and a graph batch passed as its tensors has
more nodes than targets."""

from __future__ import annotations

import torch
from torch import nn

from trainguard import doctor


class Graph:
    """torch_geometric.data.Data, cut down: node features ``x``, ``edge_index`` [2, E], labels ``y``."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __copy__(self):
        return type(self)(**self.__dict__)

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])

    def apply(self, fn):  # in place on every tensor attribute, returns self (as PyG's)
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                self.__dict__[k] = fn(v)
        return self

    def subgraph(self, subset: torch.Tensor) -> Graph:
        """The nodes ``subset`` and the edges between them, relabelled (PyG's Data.subgraph)."""
        keep = torch.isin(self.edge_index, subset).all(0)
        relabel = torch.full((self.num_nodes,), -1, dtype=torch.long)
        relabel[subset] = torch.arange(subset.numel())
        out = {k: (v[subset] if isinstance(v, torch.Tensor) and k != "edge_index" and v.shape[:1] == (self.num_nodes,)
                   else v) for k, v in self.__dict__.items()}
        out["edge_index"] = relabel[self.edge_index[:, keep]]
        return type(self)(**out)


class GraphBatch(Graph):
    """torch_geometric.data.Batch: graphs collated into one big graph, ``batch`` says whose each node is."""

    @classmethod
    def from_data_list(cls, graphs: list[Graph]) -> GraphBatch:
        xs, edges, ys, owner, offset = [], [], [], [], 0
        for i, g in enumerate(graphs):
            xs.append(g.x), ys.append(g.y), owner.append(torch.full((g.num_nodes,), i))
            edges.append(g.edge_index + offset)
            offset += g.num_nodes
        return cls(x=torch.cat(xs), edge_index=torch.cat(edges, 1), y=torch.cat(ys), batch=torch.cat(owner),
                   sizes=[g.num_nodes for g in graphs])

    @property
    def num_graphs(self) -> int:
        return len(self.sizes)

    def to_data_list(self) -> list[Graph]:
        out, start = [], 0
        for i, n in enumerate(self.sizes):
            keep = (self.batch[self.edge_index[0]] == i)
            out.append(Graph(x=self.x[start:start + n], edge_index=self.edge_index[:, keep] - start,
                             y=self.y[i:i + 1]))
            start += n
        return out


def _graphs(n: int, seed: int = 0) -> list[Graph]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        nodes = 4 + i % 5
        y = torch.tensor([i % 2])
        src = torch.randint(0, nodes, (2 * nodes,), generator=g)
        dst = torch.randint(0, nodes, (2 * nodes,), generator=g)
        out.append(Graph(x=torch.randn(nodes, 6, generator=g) + y, edge_index=torch.stack([src, dst]), y=y))
    return out


class GIN(nn.Module):
    """examples/mutag_gin.py's GIN: GINConv (sum of the neighbours plus the node, then an MLP) and
    global_add_pool, written with index_add_ as PyG's scatter does."""

    def __init__(self, hidden: int = 16, classes: int = 2):
        super().__init__()
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, hidden)),
                                   nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))])
        self.head = nn.Linear(hidden, classes)

    def forward(self, data: GraphBatch) -> torch.Tensor:
        x = data.x
        for mlp in self.mlps:
            agg = torch.zeros_like(x).index_add_(0, data.edge_index[1], x[data.edge_index[0]])
            x = mlp(x + agg).relu()
        pooled = x.new_zeros(data.num_graphs, x.shape[1]).index_add_(0, data.batch, x)
        return self.head(pooled)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def test_the_model_checks_take_a_batch_of_graphs():
    torch.manual_seed(0)
    model = GIN()
    batches = [GraphBatch.from_data_list(_graphs(48)[i:i + 8]) for i in range(0, 48, 8)]
    batch = (batches[0], batches[0].y)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    init = doctor.init_checks(model, batch, _loss)
    assert init.verdict != "fail", init.summary
    fit = doctor.overfit_one_batch(model, batch, _loss, steps=80, max_samples=4)
    assert fit.passed, fit.summary
    assert fit.to_dict()["samples"] == 4  # four graphs, not four nodes
    grad = doctor.gradient_check(model, batch, _loss, max_samples=2)
    assert grad.passed and not grad.bad_params, grad.summary
    lr = doctor.lr_range_test(model, [(b, b.y) for b in batches], _loss,
                              lambda p: torch.optim.SGD(p, lr=0, momentum=0.9), steps=60)
    assert lr.suggestion is not None, lr.summary
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert batches[0].x.dtype == torch.float32 and batches[0].num_graphs == 8  # the caller's batch is untouched


def test_a_full_graph_is_a_batch_of_its_nodes():
    """examples/gcn.py's full-batch node classification: one graph, a label per node; the first
    max_samples nodes are the subgraph they induce."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (60,), generator=g)
    src = torch.randint(0, 60, (240,), generator=g)
    dst = torch.randint(0, 60, (240,), generator=g)
    data = Graph(x=torch.randn(60, 6, generator=g) + y[:, None], edge_index=torch.stack([src, dst]), y=y)
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(6, 16), nn.Linear(16, 3)

    class GCNish(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.lin2 = lin1, lin2

        def forward(self, d):
            h = self.lin1(d.x)
            h = (h + torch.zeros_like(h).index_add_(0, d.edge_index[1], h[d.edge_index[0]])).relu()
            return self.lin2(h)

    fit = doctor.overfit_one_batch(GCNish(), (data, data.y), _loss, steps=200, lr=0.02, max_samples=16)
    assert fit.passed and fit.to_dict()["samples"] == 16, fit.summary
    assert data.num_nodes == 60 and data.edge_index.shape == (2, 240)


def test_validate_data_says_it_does_not_read_graphs():
    """On mutag_gin.py's batches the error read "... a re-iterable of (inputs, targets) batches; got
    list", which is what it was given."""
    import pytest

    batches = [(b, b.y) for b in (GraphBatch.from_data_list(_graphs(16)[i:i + 8]) for i in (0, 8))]
    for data in (batches, batches[0], GraphBatch.from_data_list(_graphs(4))):
        with pytest.raises(doctor.DoctorInputError) as e:
            doctor.validate_data(data)
        assert "graph" in str(e.value) and "(data.x, data.y)" in str(e.value), str(e.value)


class AttentionConv(nn.Module):
    """PyG's GATConv(dropout=0.6) cut down: attention over each node's in-edges, its coefficients
    dropped with ``F.dropout(alpha, p=self.dropout, training=self.training)``."""

    def __init__(self, channels: int, out: int, dropout: float):
        super().__init__()
        self.lin = nn.Linear(channels, out)
        self.att = nn.Parameter(torch.randn(2 * out) * 0.1)
        self.dropout = dropout

    def forward(self, x, edge_index):
        h = self.lin(x)
        src, dst = edge_index
        score = (torch.cat([h[src], h[dst]], 1) @ self.att).exp()
        alpha = score / torch.zeros(x.shape[0]).index_add_(0, dst, score)[dst]
        alpha = nn.functional.dropout(alpha, p=self.dropout, training=self.training)
        return h + torch.zeros_like(h).index_add_(0, dst, alpha[:, None] * h[src])


class PygMLP(nn.Module):
    """PyG's MLP([16, 16, 2], dropout=0.5): a list of rates, F.dropout after each hidden layer,
    its norm layers modules of their own."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 2)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(16)])
        self.dropout = [0.5, 0.0]

    def forward(self, x):
        x = self.norms[0](self.lins[0](x)).relu()
        x = nn.functional.dropout(x, p=self.dropout[0], training=self.training)
        return self.lins[1](x)


def test_overfit_switches_off_the_dropout_rates_pyg_layers_keep():
    """examples/gat.py's GATConv(dropout=0.6) and mutag_gin.py's MLP(dropout=0.5) draw their masks
    with F.dropout on a rate they hold: overfit_one_batch said "random" and told to use an
    nn.Dropout module instead, which a library layer does not let the user do."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = AttentionConv(6, 16, dropout=0.6)
            self.mlp = PygMLP()

        def forward(self, d):
            return self.mlp(self.conv(d.x, d.edge_index))

    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 2, (40,), generator=g)
    data = Graph(x=torch.randn(40, 6, generator=g) + y[:, None], y=y,
                 edge_index=torch.stack([torch.randint(0, 40, (160,), generator=g),
                                         torch.randint(0, 40, (160,), generator=g)]))
    torch.manual_seed(0)
    model = Net()
    fit = doctor.overfit_one_batch(model, (data, data.y), _loss, steps=150, lr=0.01, max_samples=16)
    assert fit.reason != "random" and fit.passed, fit.summary
    assert model.training and model.conv.training and model.mlp.training and model.mlp.norms[0].training
