"""The stand-alone benchmarks in bench/, run small: each must finish and write its JSON.

Their figures are for the full-size runs (README); here each runs for a few
seconds so that a change that breaks a script is caught before the next
measurement session, and each result must carry the environment and a
measured figure of the right sign. Those that build an emulated cluster
need root (``netns``); the long testbed ones (``control_straggler.py``,
``two_jobs.py``) run their scenarios in ``test_control_netns.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import REPO

BENCH = REPO / "bench"


def _plan(r: dict[str, Any]) -> bool:
    return r["hosts"] == 1024 and all(p["median_ms"] > 0 and p["first_ms"] > 0
                                      for p in r["policies"].values())


def _control(r: dict[str, Any]) -> bool:
    return r["plans_received"] >= 5 and r["push_latency_ms"]["median"] > 0  # a plan to each


def _transport(r: dict[str, Any]) -> bool:
    return all(row["median_s"] > 0 for row in r["loopback"])


def _overlap(r: dict[str, Any]) -> bool:
    return all(t > 0 for t in r["median_iteration_s"].values())


def _daemon(r: dict[str, Any]) -> bool:
    return r["results"]["change_to_kernel_ms"]["median"] > 0


def _flow_filters(r: dict[str, Any]) -> bool:
    row = r["results"]["50"]
    return (row["median_goodput_bps"].keys() == {"hashed", "per-priority", "no-acks"}
            and all(v > 0 for v in row["median_goodput_bps"].values())
            and row["hashed_apply_s"] and row["hashed_over_no_acks"] > 0)


def _coflow_orders(r: dict[str, Any]) -> bool:
    rows = r["results"]
    return (r["cct_ceiling"] > 0 and {"fair", "coflow", "srpt", "loadbalance+coflow"} <= rows.keys()
            and all(row["mean_cct_s"] > 0 and row["fair_over_this_cct"] > 0
                    for row in rows.values()))


def _coflow_ages(r: dict[str, Any]) -> bool:
    settings = r["settings"]
    return ([s["loop"] for s in settings] == ["closed", "open"]
            and all(s["runs"].keys() == {"coflow", "coflow-ageless"}
                    and all(run["mean_cct_s"] > 0 for run in s["runs"].values())
                    and s["ageless_over_aged"]["mean_cct_s"] > 0
                    and s["runs"]["coflow-ageless"]["plans_with_ages_taken"] > 0
                    for s in settings))


def _big_job(r: dict[str, Any]) -> bool:
    return r["fabrics"].keys() == {"one-switch", "oversubscribed"} and all(
        fabric.keys() == {"equal", "mixed"} for fabric in r["fabrics"].values()) and all(
        [s["ranks"] for s in sizes] == [32, 64] and sizes[1]["doubling"]["peak_rss_x"] > 0
        and all(s["owners_planned"] and s["first_plan"]["total_s"] > 0
                and s["reduce_in_leaf"] == (name == "oversubscribed")
                and s["peak_rss_mb"] >= s["rss_before_plans_mb"] > 0 for s in sizes)
        for name, fabric in r["fabrics"].items() for sizes in fabric.values())


def _state_copy(r: dict[str, Any]) -> bool:
    return all(t > 0 for ways in r["median_s"].values() for t in ways.values())


SCRIPTS: list[tuple[str, list[str], Callable[[dict[str, Any]], bool], bool]] = [
    ("policy_plan.py", ["--repeat", "1"], _plan, False),
    ("coflow_orders.py", ["--hosts", "64", "--iterations", "2"], _coflow_orders, False),
    ("coflow_ages.py", ["--hosts", "64", "--loads", "0.6", "--seeds", "0"], _coflow_ages, False),
    ("control.py", ["--daemons", "5", "--seconds", "2"], _control, False),
    ("control_big_job.py", ["--ranks", "64", "32", "--per-host", "4", "--per-leaf", "4"],
     _big_job, False),
    ("shim_transport.py", ["--size-mb", "1", "--reps", "1"], _transport, False),
    ("shim_overlap.py", ["--iters", "3", "--warmup", "1", "--rounds", "1", "--forward-ms", "5",
                         "--model-mb", "1"], _overlap, True),
    ("daemon.py", ["--samples", "5"], _daemon, True),
    ("flow_filters.py", ["--flows", "50", "--rounds", "1", "--seconds", "2"], _flow_filters, True),
    ("state_copy.py", ["--hosts", "3", "--model-mb", "2", "--reps", "1"], _state_copy, True),
    ("state_copy.py", ["--hosts", "3", "--model-mb", "2", "--reps", "1", "--nics", "2"],
     _state_copy, True),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "script, args, measured",
    [pytest.param(s, a, m, marks=[pytest.mark.netns] if root else [],
                  id=s + ("-2nics" if "--nics" in a else ""))
     for s, a, m, root in SCRIPTS],
)
def test_bench_script_runs_small_and_writes_its_result(
    script: str, args: list[str], measured: Callable[[dict[str, Any]], bool], tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json", str(out)],
        capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"commit", "dirty", "kernel", "cpu", "date"} <= result["environment"].keys()
    assert measured(result), result


@pytest.mark.parametrize("script", ["slow_link.py", "co_located.py", "control_straggler.py",
                                    "two_jobs.py", "two_nics.py"])
def test_the_long_testbed_scripts_import_and_say_how_to_run_them(script: str) -> None:
    """The scenarios of all but co_located.py and two_nics.py run in test_control_netns.py
    (what co_located adds, reducing within hosts first, in test_co_located_netns.py;
    two_nics.py's in test_planes_netns.py); here only that each script imports and parses
    its command line."""
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--json" in out.stdout


def test_the_plan_benchmark_sizes_its_cluster_and_jobs_and_refuses_what_it_cannot_build(
        tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run = [sys.executable, str(BENCH / "policy_plan.py"), "--repeat", "1", "--json", str(out)]
    proc = subprocess.run([*run, "--hosts", "64"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["hosts"], result["workers"]) == (64, 64)
    out.unlink()
    proc = subprocess.run([*run, "--hosts", "64", "--jobs", "16", "--group", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["jobs"] == 16
    out.unlink()
    for wrong in (["--hosts", "100"], ["--hosts", "64", "--jobs", "9"]):
        proc = subprocess.run([*run, *wrong], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "hosts must fill whole leaves" in proc.stderr
        assert not out.exists()
