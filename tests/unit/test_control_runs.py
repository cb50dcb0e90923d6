"""The control-plane runs' bookkeeping: which iterations (and which stretch of time) two
jobs shared; a workload's options, compute and bytes; stopping the daemons; from which
step the planned owners are measured; the two-job bound."""

import re
import subprocess
import sys

import pytest

from gradlane.benchmark import PAYLOAD_EFFICIENCY, compute_and_bytes, load_scenario
from gradlane.control_runs import (
    TWO_JOB_WORKLOAD,
    _overlapping,
    _shared_window,
    owners_steady_step,
    stop_daemons,
    trace_totals,
    two_job_bound,
    worker_option,
)
from gradlane.errors import ConfigError, TestbedError
from tests import REPO


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
    # b 5 s behind: from b's third step (7 s) to a's end (10 s), three of each: enough.
    rank0 = {"a": _rank0(0.0, 10, 1.0), "b": _rank0(5.0, 10, 1.0)}
    assert _overlapping(rank0) == {"a": [1.0] * 3, "b": [1.0] * 3}


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


def test_a_worker_option_is_the_last_given_or_the_default() -> None:
    argv = ["--model", "vgg19", "--speed", "1", "--model", "bert_base", "--steps"]
    assert worker_option(argv, "--model") == "bert_base"
    assert worker_option(argv, "--forward-ms", "50") == "50"
    assert worker_option(argv, "--steps", "60") == "60"  # last, without a value: not given
    with pytest.raises(ConfigError, match=r"needs --forward-ms$"):
        worker_option(argv, "--forward-ms")


def test_a_trace_s_totals_are_the_bench_harness_s() -> None:
    # VGG-19 scaled to 10 MiB with a 50 ms forward: the backward twice that, 150 ms in all;
    # each module's bytes rounded to whole fp32 elements, at least 1024 of them.
    compute, size = trace_totals(["--model", "vgg19", "--model-mb", "10", "--forward-ms", "50"])
    assert compute == pytest.approx(0.150)
    assert size == pytest.approx(10 * 2**20, rel=1e-3) and size % 4 == 0
    # A shipped scenario's workload, given as the worker's argv, adds up as the harness's.
    scenario = load_scenario(REPO / "bench" / "scenarios" / "trace-bert-comm-bound.toml")
    w = scenario.workload
    argv = ["--model", w["model"], "--model-mb", str(w["model_mb"]),
            "--forward-ms", str(w["forward_ms"])]
    assert trace_totals(argv) == compute_and_bytes(scenario)


# A daemon's stand-in: on SIGTERM it says its last words on stderr and exits with argv[1].
# It sleeps in slices: CPython runs a handler between bytecodes, so a SIGTERM that came just
# before a long sleep began would wait for its end.
_DAEMON = """
import signal, sys, time
def stop(*_):
    if sys.argv[1] != "0":
        sys.stderr.write("could not restore the qdisc")
    sys.exit(int(sys.argv[1]))
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
for _ in range(600):
    time.sleep(0.05)
"""


def test_stopping_the_daemons_gives_their_codes_and_what_a_failed_one_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    daemons = {host: subprocess.Popen([sys.executable, "-c", _DAEMON, code], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for host, code in (("h1", "0"), ("h2", "3"))}
    try:
        for proc in daemons.values():
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert stop_daemons(daemons) == [0, 3]
    finally:
        for proc in daemons.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    said = capsys.readouterr().err
    assert said == "gradlaned on h2 exited with 3:\ncould not restore the qdisc\n"
    assert all(proc.stderr is not None and proc.stderr.closed for proc in daemons.values())


def test_the_planned_owners_are_measured_from_two_steps_past_the_ranks_take() -> None:
    assert owners_steady_step([40, 40, 40], 60) == 42
    assert owners_steady_step([48], 60) == 50  # exactly 10 steps left to measure
    for taken_at in ([49, 49], [55], [40, 50], [40, None], [None, None], []):
        with pytest.raises(TestbedError, match=re.escape(f"at steps {taken_at} of 60 (None: ")):
            owners_steady_step(taken_at, 60)


def test_the_two_job_bound_is_the_compute_or_both_models_across_the_uplink() -> None:
    _, size = trace_totals(TWO_JOB_WORKLOAD)
    uplink_s = 2 * size * 8 / (100e6 * PAYLOAD_EFFICIENCY)  # two jobs, 100 Mbit/s uplink
    assert two_job_bound(0.0, size) == pytest.approx(uplink_s)
    # The host links (100 Mbit/s, 4 workers: 1.5 models each) carry less than the uplink.
    assert two_job_bound(0.9 * uplink_s, size) == pytest.approx(uplink_s)
    assert two_job_bound(10 * uplink_s, size) == 10 * uplink_s
