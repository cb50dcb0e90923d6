"""The control plane end to end on emulated clusters: stragglers, crashes, shared uplinks.

Four hosts with gradlaned, a fifth running `gradlane control`; one training
job (a VGG-19 trace whose compute grows with the batch) on workers at
relative speeds 1, 1, 1, 0.5. First the control plane is down (the daemons
run their local policy, every worker keeps its batch of 32); then it is
started, the shims' timings reach it through the daemons, it answers with
batch shares by throughput, and the workers take them. Both runs in the same
cluster (`gradlane.control_runs.run_control_straggler`, which
bench/control_straggler.py also runs to record the figures). A third run
goes through a SIGKILL of the control plane and its restart, then the control
plane's host is cut off.

Also: one job on four hosts, one on a link half as fast: the shims take the
chunk owners the control plan weighs by link rate (`run_slow_link`); and two
jobs across an oversubscribed uplink (`run_two_jobs`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradlane.benchmark import lower_bound
from gradlane.control_runs import (
    STRAGGLER_SPEEDS,
    STRAGGLER_WORKLOAD,
    run_control_straggler,
    run_slow_link,
    run_two_jobs,
    trace_totals,
)

pytestmark = pytest.mark.netns


@pytest.mark.timeout(300)
def test_the_shims_take_the_plan_s_owners_and_relieve_a_slow_link(tmp_path: Path) -> None:
    result = run_slow_link(tmp_path, steps=45)  # raises unless every rank took them at once
    assert result["daemon_exit_codes"] == [0, 0, 0, 0]
    without, with_control = result["without_control"], result["with_control"]
    # On their own, the ranks own about a quarter each; the plan (the ring: a rank's own
    # chunks skip its links) gives the rank on the slow link every byte.
    assert without["owners_taken_at"] is None
    assert max(without["owned_bytes"]) < 1.2 * min(without["owned_bytes"])
    assert with_control["owned_bytes"][:3] == [0, 0, 0]
    assert with_control["owned_bytes"][3] == sum(without["owned_bytes"])
    print(f"iteration: {without['median_s'] * 1000:.1f} ms with owned bytes equal, "
          f"{with_control['median_s'] * 1000:.1f} ms with the plan's ({result['speedup']:.2f}x)")
    # A mechanism check, not a speed target (bench/slow_link.py records the figure): the
    # slow link's load falls from 1.5 to 1 model each way, so anything short of 1.1x means
    # the owners did not relieve it.
    assert result["speedup"] > 1.1
    # The model behind the bound: on the ring the slow link carries 1.5 models each way
    # with equal owners, 1 with the plan's, the least any scheme could, and no run beats it.
    ring = result["model_exchange_s"]["ring"]
    assert ring["by_rate"] == pytest.approx(ring["equal"] * 2 / 3)
    assert ring["by_rate"] == pytest.approx(result["lower_bound_s"])  # not compute-bound
    assert result["lower_bound_s"] < with_control["median_s"]


@pytest.mark.timeout(420)
def test_batch_shares_from_the_control_plane_cut_the_straggler(tmp_path: Path) -> None:
    result = run_control_straggler(tmp_path, steps=24, ttl_s=5)  # the bench keeps 10 s
    assert result["daemon_exit_codes"] == [0, 0, 0, 0]  # each restored its qdisc
    batches = result["batches"]
    # The advice arrived: the slow worker ends with about half a fast one's batch, each fast
    # one with more than the slow one and above the even 32 on average. (Ranks may take a
    # new plan at different steps, so one step's batches need not sum to 128; a busy host
    # may leave one fast worker near 32.)
    fast, slow = [b[-1] for b in batches[:3]], batches[3][-1]
    assert slow < 24 and min(fast) > slow and sum(fast) > 3 * 32, batches
    print(f"final batches {[b[-1] for b in batches]}; iteration: "
          f"{result['without_control']['median_s'] * 1000:.1f} ms without the control plane, "
          f"{result['with_control']['median_s'] * 1000:.1f} ms with it "
          f"({result['speedup']:.2f}x)")
    # A mechanism check, not a speed target (bench/control_straggler.py records the figure):
    # balanced compute alone would give 1.75x, so anything short of 1.1x means the shares
    # did not cut the wait; the exact figure moves with the machine's load.
    assert result["speedup"] > 1.1
    # The bound (nominal: no reference run here): every worker computing the global batch
    # over the sum of speeds, as perfect shares would make it; the trace's compute is
    # slept, so no run beats it. Each run's steady median over it is what the bench reports.
    compute, size = trace_totals(STRAGGLER_WORKLOAD)
    bound = result["lower_bound_s"]
    assert bound == result["nominal_lower_bound_s"] == pytest.approx(
        lower_bound(4, compute * len(STRAGGLER_SPEEDS) / sum(STRAGGLER_SPEEDS), size, 1e9))
    summary = result["summary"]
    for system, run in (("gradlane", "without_control"), ("gradlane+control", "with_control")):
        assert summary[system]["median_s"] == result[run]["median_s"] > bound
        assert summary[system]["achieved_over_bound"] == pytest.approx(
            result[run]["median_s"] / bound)
    # SIGKILL of the control plane mid-training, restart 2 s later: every step completed
    # (`run_control_straggler` raises otherwise), and each daemon held a plan from the new
    # control plane within 5 s of the restart, as its own /status tells.
    crash = result["control_crash"]
    print(f"plans after the restart: {[round(d, 2) for d in crash['plan_after_restart_s']]} s")
    assert crash["steps_completed"] == 2 * len(result["with_control"]["iteration_s"])
    assert crash["training_throughout"]
    # None came before it: each plan counted is the new control plane's.
    assert 0 <= min(crash["plan_after_restart_s"]) <= max(crash["plan_after_restart_s"]) < 5.0
    # Both control planes split the batch of 128 the shims agreed at their first step,
    # whatever batches the ranks had when the new one started.
    assert [tuple(s) for s in crash["split"]] == [(128, 128), (128, 128)], crash["split"]
    # The control plane's host cut off: each daemon says the local policy is back once the
    # plan's 5 s TTL is over (`run_control_straggler` raises if one does not within 30 s).
    partition = result["partition_local_policy_after_s"]
    print(f"local policy after the cut: {[round(d, 2) for d in partition]} s")
    # (Its last plan came at most a push before the cut; the probes would wait 30 s.)
    assert 4.0 <= min(partition) <= max(partition) < 2 * result["plan_ttl_s"] == 10


@pytest.mark.timeout(420)
def test_two_jobs_across_an_oversubscribed_uplink_reduce_within_leaves(tmp_path: Path) -> None:
    """Two 4-worker jobs, two workers of each on each leaf, a 4:1 uplink between the leaves.

    With the control plane (told the uplink rate) the shims reduce within each
    leaf first, so half as many bytes cross the uplink, and the average
    iteration time must drop against the same daemons without it.
    """
    result = run_two_jobs(tmp_path, steps=24, fifo=False)  # bench/two_jobs.py runs fifo too
    assert result["daemon_exit_codes"] == [0] * 8
    assert result["leaves"]["gradlane"] == {"a": None, "b": None}
    assert result["leaves"]["gradlane+control"] == {"a": [0, 0, 1, 1], "b": [0, 0, 1, 1]}
    # ... and said so, through their daemons, to the control plane, whose demand follows it.
    assert result["control_saw_exchange"] == {"a": "leaf", "b": "leaf"}
    average = result["average_median_s"]
    print({k: round(v * 1000, 1) for k, v in average.items()},
          f"the control plane: {result['control_speedup']:.2f}x")
    assert average["gradlane+control"] < average["gradlane"]
    assert result["control_speedup"] == pytest.approx(
        average["gradlane"] / average["gradlane+control"]) and result["gradlane_over_fifo"] is None
