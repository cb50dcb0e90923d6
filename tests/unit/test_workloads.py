"""The workloads: the trace's emulated accelerator (late wake-ups do not add up), how the
demo measures its CNN's compute, and the worker that trains them (`gradlane.worker`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

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
    # The process's accelerator, fresh: no lateness left by a real run before.
    monkeypatch.setattr(workloads, "_ACCELERATOR", workloads._Accelerator())
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
    # A worker at half speed (the heterogeneous scenarios' slow one) takes twice as long.
    clock.asked.clear()
    slow = workloads.make_trace("vgg19", 1, forward_s=0.05, speed=0.5)
    slow(workloads.trace_batch()).sum().backward()
    assert sum(clock.asked) == pytest.approx(0.300)


def test_the_demo_measures_its_model_with_every_worker_training_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`gradlane.demo.calibrate`: one process per worker, all started before any is waited
    for; the step time is the median of theirs and the bytes are the CNN's."""
    from gradlane.demo import calibrate
    from gradlane.testbed import forked

    events: list[str] = []

    class Counted(forked.Forked):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            events.append("start")

        def wait(self, timeout: float | None = None) -> int:
            events.append("wait")
            return super().wait(timeout)

    monkeypatch.setattr(forked, "Forked", Counted)
    step_s, size = calibrate(3)
    assert events[:4] == ["start", "start", "start", "wait"]
    model = workloads.make_cnn()
    assert size == sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < step_s < 10


def test_only_steps_that_ran_while_every_process_did_count() -> None:
    from gradlane.demo import steps_together

    def steps(start: float, n: int, length: float) -> list[tuple[float, float]]:
        return [(start + k * length, start + (k + 1) * length) for k in range(n)]

    # One process starts 1 s before the other and ends 1 s before it.
    early, late = steps(0.0, 6, 0.5), steps(1.0, 6, 0.5)
    # Together from the late one's second step (1.5 s: each one's first is a warm-up) to
    # the early one's end (3.0 s): three steps of each.
    assert sorted(steps_together([early, late])) == [0.5] * 6
    # From 1.7 s to 3.0 s: two steps of each.
    assert steps_together([early, steps(1.2, 6, 0.5)]) == pytest.approx([0.5] * 4)
    assert steps_together([steps(0.0, 3, 1.0), steps(5.0, 3, 1.0)]) == []  # never at once


def test_the_worker_trains_a_trace_alone_and_records_each_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gradlane.worker --system local` (the bound's compute reference: nothing sent) on a
    trace at half speed, with a batch of its own and advice asked for that no control plane
    gives (no shim to take it from): every step is recorded, and the steps took at least
    the compute they replay."""
    import torch

    from gradlane import worker

    steps, forward_ms = 4, 10
    monkeypatch.setenv("RANK", "0")
    # An accelerator of its own: the real lateness it ends with stays with this test.
    monkeypatch.setattr(workloads, "_ACCELERATOR", workloads._Accelerator())
    threads, started = torch.get_num_threads(), time.perf_counter()
    try:
        worker.main(["--system", "local", "--out", str(tmp_path), "--steps", str(steps),
                     "--workload", "trace", "--model", "vgg19", "--model-mb", "1",
                     "--forward-ms", str(forward_ms), "--speed", "0.5", "--batch", "16",
                     "--follow-advice"])
        assert torch.get_num_threads() == 1  # a worker computes on one thread
    finally:
        torch.set_num_threads(threads)  # this process's other tests keep theirs
    elapsed = time.perf_counter() - started
    record = json.loads((tmp_path / "local-rank0.json").read_text())
    assert record["batch"] == [16] * steps
    assert record["waited"] == [0.0] * steps  # no exchange to wait for
    assert all(len(record[k]) == steps for k in ("times", "ends", "losses", "backward_ends"))
    assert all(b <= e for b, e in zip(record["backward_ends"], record["ends"], strict=True))
    assert record["ends"] == sorted(record["ends"])
    # Forward and backward (twice the forward) of half a batch at half speed: the sleeps
    # end no sooner than asked, so the steps together take at least that.
    compute_s = 3 * forward_ms / 1000 * (16 / workloads.BATCH) / 0.5
    assert steps * compute_s * (1 - 1e-6) <= sum(record["times"]) <= elapsed
    # The training loop's own Python and autograd work, over its wall time.
    assert 1e-3 < record["cpu_cores"] <= (os.cpu_count() or 1)
    assert record["cpu_sys_cores"] >= 0
    # The training thread's share: this loop has no other thread doing its work.
    assert 0 < record["cpu_train_cores"] <= record["cpu_cores"]
    if worker.run_queue_s() is not None:  # Linux with schedstats: the wait for a core
        assert 0 <= record["run_queue_s_per_step"] <= elapsed / steps


def test_each_system_gets_the_shim_it_is_named_for() -> None:
    """`gradlane.worker`'s systems as the shim's options: ``fifo`` one band and no overlap,
    ``priority`` the shim's bands and overlap without gradlaned, ``gradlane`` and
    ``ddp-hook`` gradlaned's socket and the exchange asked for; every option one the shim
    takes."""
    from gradlane.shim.config import ShimConfig
    from gradlane.worker import attach_options, parse_args, shim_options

    def config(options: dict[str, Any]) -> ShimConfig:
        return ShimConfig(**{k: v for k, v in options.items() if k != "address"})  # attach's

    out = ["--out", "/nonexistent"]
    fifo = config(attach_options(parse_args(["--system", "fifo", *out])))
    assert (fifo.dscp, fifo.overlap, fifo.daemon_socket) == ((0,), False,
                                                             "/nonexistent/gradlaned.sock")
    shim = ShimConfig()
    priority = config(attach_options(parse_args(["--system", "priority", *out])))
    assert (priority.dscp, priority.overlap, priority.exchange) == (shim.dscp, True, "auto")
    assert len(priority.dscp) == 4 and priority.daemon_socket == "/nonexistent/gradlaned.sock"
    full = attach_options(parse_args([
        "--system", "gradlane", *out, "--daemon-socket", "/run/g.sock", "--exchange", "ring",
        "--layout", "fine", "--chunk-bytes", "65536", "--credit-bytes", "4096",
        "--address", "10.0.1.1,10.1.1.1", "--job", "a"]))
    assert full == {"job": "a", "address": ["10.0.1.1", "10.1.1.1"], "chunk_bytes": 65536,
                    "credit_bytes": 4096, "daemon_socket": "/run/g.sock", "exchange": "ring",
                    "layout": "fine"}
    config(full)
    hook = shim_options(parse_args(["--system", "ddp-hook", *out]))
    assert hook == {"job": "bench", "address": None,
                    "daemon_socket": "/run/gradlane/gradlaned.sock", "exchange": "auto"}
