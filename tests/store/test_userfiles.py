"""Which frames are the user's."""

from __future__ import annotations

import os
import sysconfig

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
