"""The trace workload's emulated accelerator: late wake-ups do not add up."""

from __future__ import annotations

import pytest

from gradlane import workloads


class FakeClock:
    """`time.monotonic` and `time.sleep` where every sleep wakes `late` s after it should."""

    def __init__(self, late: float) -> None:
        self.now, self.late = 100.0, late
        self.asked: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.now += seconds + self.late

    def work(self, seconds: float) -> None:
        """The caller does something else in between (waits, steps the optimizer)."""
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(late=0.002)
    monkeypatch.setattr(workloads.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(workloads.time, "sleep", fake.sleep)
    return fake


def test_back_to_back_layers_end_on_time_despite_late_wakeups(clock: FakeClock) -> None:
    gpu = workloads._Accelerator()
    start = clock.now
    for _ in range(10):
        gpu.run(0.010)
    # Ten 10 ms layers: one oversleep in all (the last), not ten.
    assert clock.now - start == pytest.approx(0.100 + 0.002)
    assert clock.asked[0] == pytest.approx(0.010)
    assert clock.asked[1:] == pytest.approx([0.008] * 9)


def test_time_spent_between_layers_is_charged_in_full(clock: FakeClock) -> None:
    gpu = workloads._Accelerator()
    gpu.run(0.010)
    clock.work(0.030)  # e.g. the forward waited for a layer's average
    before = clock.now
    gpu.run(0.010)
    # Only the previous sleep's own 2 ms lateness is given back, not the 30 ms wait.
    assert clock.asked[-1] == pytest.approx(0.008)
    assert clock.now - before == pytest.approx(0.010)


def test_lateness_longer_than_a_layer_carries_over(clock: FakeClock) -> None:
    clock.late = 0.015
    gpu = workloads._Accelerator()
    gpu.run(0.010)  # ends 15 ms late
    gpu.run(0.005)  # its whole time is already past: no sleep, 10 ms still owed
    gpu.run(0.020)
    assert clock.asked == pytest.approx([0.010, 0.010])
    assert gpu.late == pytest.approx(0.015)


def test_a_trace_batch_computes_the_whole_profile(clock: FakeClock) -> None:
    clock.late = 0.0
    model = workloads.make_trace("vgg19", 1, forward_s=0.05)
    model(workloads.trace_batch()).sum().backward()
    # Forward 50 ms and backward twice that, as the profile asks for BATCH samples.
    assert sum(clock.asked) == pytest.approx(0.150)
    clock.asked.clear()
    model(workloads.trace_batch(workloads.BATCH // 2)).sum().backward()
    assert sum(clock.asked) == pytest.approx(0.075)
