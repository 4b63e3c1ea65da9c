"""Shared by every test folder: the small real models of ``true_models.py`` are importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
