"""Which frames are the user's."""

from __future__ import annotations

import os
import sysconfig
import tempfile

import torch

import trainguard
from trainguard.store import is_user_file


def test_the_users_script_is_theirs_and_installed_code_is_not(tmp_path):
    assert is_user_file(str(tmp_path / "train.py"))
    assert not is_user_file(torch.__file__) and not is_user_file(trainguard.__file__)
    assert not is_user_file(os.__file__) and not is_user_file("<frozen runpy>")


def test_console_scripts_are_not_the_users():
    # `trainguard run train.py` stored the launcher, .venv/bin/trainguard, as the user's frame at
    # the top of every stack (as `torchrun` and `accelerate launch` would be).
    assert not is_user_file(os.path.join(sysconfig.get_paths()["scripts"], "trainguard"))


def test_the_modules_pyg_generates_in_the_temp_dir_are_not_the_users():
    # torch_geometric/template.py renders MessagePassing.propagate (and edge_updater, and
    # nn.Sequential's forward) from jinja templates into tempfile.NamedTemporaryFile(prefix=
    # f"{cls.__module__}_{cls.__name__}_propagate_", suffix=".py") and imports it: every op of a
    # GCNConv's aggregation had /tmp/torch_geometric.nn.conv.gcn_conv_GCNConv_propagate_gkc6kozb.py:245
    # as its line instead of the user's ``self.conv1(x, edge_index)``.
    tmp = tempfile.gettempdir()
    for name in ("torch_geometric.nn.conv.gcn_conv_GCNConv_propagate_gkc6kozb.py",
                 "__main___GCNConv_propagate_6q_i9yyc.py",  # a MessagePassing the user wrote
                 "torch_geometric.nn.conv.gat_conv_GATConv_edge_updater_ze91hd_z.py",
                 "torch_geometric.nn.sequential_Sequential_0a1b2c_k3_9x2pq.py"):
        assert not is_user_file(os.path.join(tmp, name)), name
    # the user's own files there, even with such words in their names, are still theirs
    assert is_user_file(os.path.join(tmp, "train.py"))
    assert is_user_file(os.path.join(tmp, "gnn_propagate_test.py"))
    assert is_user_file(os.path.join(tmp, "proj", "models_GCN_propagate_abcdefgh.py"))
