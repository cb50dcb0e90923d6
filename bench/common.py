"""What the benchmarks share: the repository's root and the result writer."""

from __future__ import annotations

from pathlib import Path

from gradlane.provenance import write_result

__all__ = ["REPO", "write_result"]

REPO = Path(__file__).resolve().parents[1]
