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



def _with_trial(start: float, steps: int) -> dict[str, list[float]]:
    """Steps of 1 s but the first 18, the layout trial's, of 1.5 s."""
    times = [1.5 if k < 18 else 1.0 for k in range(steps)]
    ends = [start + sum(times[: k + 1]) for k in range(steps)]
    return {"times": times, "ends": ends}


def test_a_long_run_counts_only_steps_past_the_layout_trial() -> None:
    # Of 50 steps each job counts from step 18 on (`steady_start`), b 0.5 s behind a:
    # the trial's steps, which run both groupings, never enter the medians.
    rank0 = {"a": _with_trial(0.0, 50), "b": _with_trial(0.5, 50)}
    assert _shared_window(rank0) == (27.5, 59.0)  # b's step 18 begins .. a ends
    assert _overlapping(rank0) == {"a": [1.0] * 31, "b": [1.0] * 31}
