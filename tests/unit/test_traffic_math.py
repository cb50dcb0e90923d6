from typing import cast

import pytest

from gradlane.errors import TestbedError
from gradlane.testbed.cluster import Cluster
from gradlane.testbed.traffic import Flow, FlowResult, run_flows, steady_goodputs, window_goodputs


def result(label: str, start: float, seconds: float, bps: float) -> FlowResult:
    # a flow sampled every 0.1 s at a constant rate
    steps = round(seconds / 0.1)
    samples = tuple((start + i * 0.1, round(bps / 8 * i * 0.1)) for i in range(steps + 1))
    return FlowResult(label, 0, samples[-1][1], start, start + seconds, samples)


def test_goodput_whole_and_between() -> None:
    r = result("a", 10.0, 4.0, 80e6)
    assert r.goodput_bps == pytest.approx(80e6)
    assert r.goodput_between(11.0, 13.05) == pytest.approx(80e6)
    assert r.bytes_at(9.0) == 0 and r.bytes_at(99.0) == r.bytes


def test_bytes_at_is_zero_before_the_first_byte_and_linear_between_samples() -> None:
    # The receiver's first sample is (first byte, 0); these start at 100 to tell them apart.
    # Twice as fast in the second second: each stretch interpolated on its own.
    r = FlowResult("a", 0, 400, 1.0, 3.0, ((1.0, 100), (2.0, 200), (3.0, 400)))
    assert [r.bytes_at(t) for t in (0.5, 1.0, 1.25, 2.0, 2.5, 3.0, 9.0)] == pytest.approx(
        [0, 100, 125, 200, 300, 400, 400])
    assert r.seconds == 2.0
    assert r.goodput_between(1.0, 3.0) == pytest.approx(300 * 8 / 2.0)
    with pytest.raises(TestbedError, match=r"^empty measurement window \[2.0, 2.0\]$"):
        r.goodput_between(2.0, 2.0)


def test_window_is_the_overlap_of_all_flows() -> None:
    early = result("early", 0.0, 6.0, 100e6)
    late = result("late", 2.0, 3.0, 50e6)
    rates = window_goodputs([early, late], skip=0.5)
    assert rates == [pytest.approx(100e6), pytest.approx(50e6)]


def test_steady_goodput_is_the_rate_held_through_a_stall_of_the_ends() -> None:
    # 100 Mbit/s for 4 s but nothing received for 0.2 s at 2.0 s (a stalled process):
    # the mean over the window [0.5, 3.5] drops by 1/15, the rate held does not.
    samples, received = [], 0.0
    for i in range(401):
        t = i * 0.01
        samples.append((t, round(received)))
        received += 0 if 2.0 <= t < 2.2 else 100e6 / 8 * 0.01
    stalled = FlowResult("s", 0, samples[-1][1], 0.0, 4.0, tuple(samples))
    steady = result("steady", 0.0, 4.0, 50e6)
    (mean, _) = window_goodputs([stalled, steady])
    assert mean == pytest.approx(100e6 * 14 / 15, rel=0.01)
    assert steady_goodputs([stalled, steady]) == [pytest.approx(100e6), pytest.approx(50e6)]
    # and a flow that slows down for most of the window shows it
    slow = FlowResult("slow", 0, 100, 0.0, 4.0, ((0.0, 0), (1.0, 50), (4.0, 100)))
    (held,) = steady_goodputs([slow], slice_s=0.5)
    assert held == pytest.approx(50 * 8 / 3.0)
    with pytest.raises(TestbedError, match="too short"):
        steady_goodputs([result("a", 0, 1.0, 1e6)])


def test_window_too_short_is_an_error() -> None:
    # a: 0..1 s, b: 0.8..1.8 s: 0.2 s together, less than the 0.5 s both skip and 0.5 s more.
    with pytest.raises(TestbedError, match=r"^flows overlapped for only 0.20s: too short"):
        window_goodputs([result("a", 0, 1.0, 1e6), result("b", 0.8, 1.0, 1e6)])


def test_flow_needs_exactly_one_size() -> None:
    with pytest.raises(TestbedError, match="exactly one"):
        Flow("h1", "h2")
    with pytest.raises(TestbedError, match="exactly one"):
        Flow("h1", "h2", seconds=1, nbytes=10)
    for dscp in (-1, 64):
        with pytest.raises(TestbedError, match=f"DSCP must be in 0..63, got {dscp}$"):
            Flow("h1", "h2", seconds=1, dscp=dscp)
    for delay in (-0.1, 60.5):
        with pytest.raises(TestbedError, match=f"delay must be in 0..60 s, got {delay}$"):
            Flow("h1", "h2", seconds=1, delay=delay)
    for seconds in (0, -1, 3600.5, float("inf"), float("nan")):
        with pytest.raises(TestbedError, match=rf"seconds must be in \(0, 3600\], got {seconds}$"):
            Flow("h1", "h2", seconds=seconds)
    for nbytes in (0, (1 << 40) + 1):
        with pytest.raises(TestbedError, match=rf"nbytes must be in 1..{1 << 40}, got {nbytes}$"):
            Flow("h1", "h2", nbytes=nbytes)
    assert Flow("h1", "h2", seconds=1, dscp=63, delay=60).dscp == 63  # the ranges' ends
    assert Flow("h1", "h2", nbytes=1, dscp=0, delay=0).nbytes == 1
    assert Flow("h1", "h2", seconds=3600).seconds == 3600
    assert Flow("h1", "h2", nbytes=1 << 40).nbytes == 1 << 40


def test_the_daemons_line_rate_is_the_nic_an_emulated_link_stands_for() -> None:
    from gradlane.benchmark import PAYLOAD_EFFICIENCY
    from gradlane.testbed.links import line_rate

    # A link emulated at R (frames from their Ethernet header on, as HTB counts) is a NIC
    # of line rate R x 1538/1514, whose full TCP frames carry what the bound says R does.
    rate = 877_543_843
    assert line_rate(rate) == round(rate * 1538 / 1514)
    assert line_rate(rate) * 1448 / 1538 == pytest.approx(rate * PAYLOAD_EFFICIENCY)


def test_run_flows_refuses_an_unbounded_or_empty_timeout_before_touching_the_cluster() -> None:
    for timeout in (0, float("inf")):
        with pytest.raises(TestbedError,
                           match=rf"timeout must be in \(0, 3600\] s, got {timeout}$"):
            run_flows(cast("Cluster", None), [Flow("h1", "h2", seconds=1)], timeout=timeout)
