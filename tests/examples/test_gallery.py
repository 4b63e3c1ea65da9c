"""Every gallery script under the monitor: the broken ones get their finding, the healthy ones none.

Each script runs in this process through ``trainguard monitor --json`` (the same path as the
command line), with layer statistics every 5 steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainguard.cli import main

GALLERY = Path(__file__).resolve().parents[2] / "examples" / "broken"
SCRIPTS = sorted(p for p in GALLERY.glob("*.py") if not p.name.startswith("_"))


def expected(script: Path) -> str:
    """The finding a script's docstring promises (``healthy`` for the healthy ones)."""
    m = re.search(r"Expected finding: ``(\w+)``", script.read_text())
    return m.group(1) if m else "healthy"


def test_the_gallery_has_the_promised_size_and_readme():
    broken = [s for s in SCRIPTS if expected(s) != "healthy"]
    healthy = [s for s in SCRIPTS if expected(s) == "healthy"]
    assert len(broken) >= 15 and len(healthy) >= 4
    assert len({expected(s) for s in broken}) == len(broken)  # one fault kind per script
    assert {"healthy_mlp.py", "healthy_cnn.py", "healthy_rnn.py", "healthy_transformer.py"} <= {s.name for s in healthy}
    readme = (GALLERY / "README.md").read_text()
    for s in SCRIPTS:
        assert re.search(rf"`{s.name}` \| .* \| `{expected(s)}` \|", readme), s.name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_script_under_the_monitor(script, tmp_path, capsys):
    code = main(["monitor", "--logdir", str(tmp_path / "run"), "--every", "5", "--json", str(script), "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    problems = [f["kind"] for f in out["findings"] if f["severity"] != "info"]
    want = expected(script)
    if want == "healthy":
        assert problems == [], out["findings"]
        assert out["verdict"] == "healthy"
    else:
        assert want in problems, out["findings"]
        finding = next(f for f in out["findings"] if f["kind"] == want)
        assert finding["suggestion"] and finding["evidence"]
