"""What the benchmarks share: the repository's root, the result writer, SIGTERM handling."""

from __future__ import annotations

from pathlib import Path

from gradlane.provenance import write_result
from gradlane.signals import unwind_on_sigterm

__all__ = ["REPO", "unwind_on_sigterm", "write_result"]

REPO = Path(__file__).resolve().parents[1]
