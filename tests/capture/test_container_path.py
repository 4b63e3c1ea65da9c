"""Where a called model sits in the modules that hold it, found without scanning every live object
when nothing can hold it: a scan of ``gc.get_objects()`` cost 48 ms of CPU in a process that had
only imported torch and 357 ms beside 5 million small lists, once per model found (14 and 70 ms
with one ``gc.get_referrers`` first)."""

from __future__ import annotations

import gc

import pytest
from torch import nn

from trainguard.capture import _modules
from trainguard.capture._modules import container_path


@pytest.fixture
def no_scan(monkeypatch):
    def scan(*args, **kwargs):
        raise AssertionError("scanned every live object")
    monkeypatch.setattr(_modules.gc, "get_objects", scan)


def test_a_model_held_by_a_local_needs_no_scan(no_scan):
    model = nn.Sequential(nn.Linear(2, 2))
    assert container_path(model) == ""


MODEL = nn.Sequential(nn.Linear(2, 2))  # a script's global, as nanoGPT's train.py holds its model


def test_a_model_held_by_a_modules_globals_needs_no_scan(no_scan):
    assert container_path(MODEL) == ""


def test_a_member_of_a_container_is_named_by_its_path():
    agent = nn.Module()
    agent.actor = nn.Sequential(nn.Linear(2, 2))
    agent.heads = nn.ModuleList([nn.Linear(2, 2)])
    assert container_path(agent.actor) == "actor"
    assert container_path(agent.heads[0]) == "heads.0"
    assert container_path(agent) == ""


def test_a_model_in_a_users_dict_is_looked_up_and_has_no_path():
    models = {"generator": nn.Linear(2, 2)}
    assert container_path(models["generator"]) == ""


def test_a_model_held_by_two_containers_has_no_path():
    shared = nn.Linear(2, 2)
    a, b = nn.Sequential(shared), nn.Sequential(shared)
    assert container_path(shared) == ""
    assert gc.is_tracked(a) and gc.is_tracked(b)
