"""gradlane's tests.

Property tests draw a number of examples sized for CI (a few minutes in all).
`GRADLANE_EXAMPLES=N` multiplies every one of them by N, for a longer hunt
after touching the code they cover (the shim's multi-rank test found two
races only at 150 examples, against 12 per CI run):

    GRADLANE_EXAMPLES=50 .venv/bin/python -m pytest tests/unit/test_shim_ranks.py
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout's root


def examples(ci_count: int) -> int:
    """`ci_count` examples, times `GRADLANE_EXAMPLES` (default 1)."""
    raw = os.environ.get("GRADLANE_EXAMPLES", "1")
    try:
        factor = int(raw)
    except ValueError:
        factor = 0
    if factor < 1:
        raise ValueError(f"GRADLANE_EXAMPLES must be a positive integer, got {raw!r}")
    return ci_count * factor


def metric_samples(text: str, prefix: str) -> dict[str, float]:
    """The samples of Prometheus exposition `text` whose names start with `prefix`, by the
    rest of their name."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name.removeprefix(prefix): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith(prefix)}
