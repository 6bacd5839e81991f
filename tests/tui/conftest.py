from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tui_helpers import load_snapshots  # noqa: E402


@pytest.fixture(scope="session")
def snapshots() -> list[dict]:
    """Snapshots recorded from a real engine run (scripts/record_snapshots.py)."""
    return load_snapshots()
