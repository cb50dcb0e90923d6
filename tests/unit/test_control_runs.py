"""The two-job run's bookkeeping: which iterations (and which stretch of time) both jobs shared."""

import pytest

from gradlane.control_runs import _overlapping, _shared_window
from gradlane.errors import TestbedError


def _rank0(start: float, steps: int, step_s: float) -> dict[str, list[float]]:
    ends = [start + step_s * (k + 1) for k in range(steps)]
    return {"times": [step_s] * steps, "ends": ends}


def test_shared_window_and_iterations_are_where_both_jobs_trained() -> None:
    # Job a runs 0..10 s, b 3..13 s, both 1 s steps; the first 2 of each are warm-up.
    rank0 = {"a": _rank0(0.0, 10, 1.0), "b": _rank0(3.0, 10, 1.0)}
    assert _shared_window(rank0) == (5.0, 10.0)  # b past its warm-up .. a's end
    shared = _overlapping(rank0)
    assert shared == {"a": [1.0] * 5, "b": [1.0] * 5}  # a's steps 6..10, b's 3..7


def test_jobs_that_hardly_overlap_are_an_error() -> None:
    rank0 = {"a": _rank0(0.0, 10, 1.0), "b": _rank0(8.0, 10, 1.0)}
    with pytest.raises(TestbedError, match="fewer than 3"):
        _overlapping(rank0)
