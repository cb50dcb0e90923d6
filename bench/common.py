"""What the benchmarks share: the environment record and result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradlane.provenance import environment

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, result: dict[str, Any]) -> None:
    """Write a result file with the environment it was measured in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "environment": environment()}, indent=1) + "\n")
