"""`make test` does the whole set-up on a fresh machine: Debian's chromium is installed when it is
missing and the machine allows it (root and apt-get), else it stops at once with one line saying
what to install. `.ci/run` calls the same command."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENSURE = ROOT / ".ci" / "ensure-chromium"


def fake_bin(tmp_path: Path, *, uid: int, apt: bool) -> Path:
    """A PATH with no chromium, an ``id`` that says ``uid``, and maybe an apt-get that installs one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"id": f"#!/bin/sh\necho {uid}\n"}
    if apt:
        log = tmp_path / "apt.log"
        tools["apt-get"] = (f"#!/bin/sh\necho \"$@\" >> {log}\n"
                            f"case \"$*\" in *install*chromium*) printf '#!/bin/sh\\n' > {bin_dir}/chromium;"
                            f" /bin/chmod +x {bin_dir}/chromium;; esac\n")
    for name, body in tools.items():
        p = bin_dir / name
        p.write_text(body)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def ensure(tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(bin_dir), "CHROMIUM": str(tmp_path / "no-chromium-here"), "HOME": str(tmp_path)}
    return subprocess.run(["/bin/sh", str(ENSURE)], capture_output=True, text=True, env=env, timeout=60)


def test_installs_chromium_when_missing_and_allowed(tmp_path):
    bin_dir = fake_bin(tmp_path, uid=0, apt=True)
    done = ensure(tmp_path, bin_dir)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert any("install" in c and "chromium" in c for c in calls)
    assert (bin_dir / "chromium").exists()


@pytest.mark.parametrize("uid, apt", [(1000, True), (0, False)], ids=["not-root", "no-apt-get"])
def test_otherwise_one_line_says_what_to_install(tmp_path, uid, apt):
    done = ensure(tmp_path, fake_bin(tmp_path, uid=uid, apt=apt))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "apt-get install chromium" in lines[0], done.stderr
    assert not (tmp_path / "apt.log").exists()  # nothing was tried


def test_nothing_happens_when_chromium_is_there(tmp_path):
    bin_dir = fake_bin(tmp_path, uid=0, apt=True)
    (bin_dir / "chromium").write_text("#!/bin/sh\n")
    (bin_dir / "chromium").chmod(0o755)
    done = ensure(tmp_path, bin_dir)
    assert done.returncode == 0 and done.stdout == done.stderr == ""
    assert not (tmp_path / "apt.log").exists()


def test_make_test_runs_the_check_before_the_tests_and_ci_calls_make_test():
    plan = subprocess.run(["make", "-n", "test"], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env=dict(os.environ, MAKEFLAGS="")).stdout.splitlines()
    check = next(i for i, line in enumerate(plan) if "ensure-chromium" in line)
    tests = next(i for i, line in enumerate(plan) if "pytest" in line)
    assert check < tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "apt-get" not in ci  # one set-up, in the command itself
