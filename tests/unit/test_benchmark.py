"""The bench harness's pure parts: scenario files, the lower bound, the README table."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlane import benchmark
from gradlane.benchmark import (
    PAYLOAD_EFFICIENCY,
    cells,
    compute_and_bytes,
    dependency_bound,
    load_scenario,
    lower_bound,
    markdown_table,
    narrowed,
    reading,
    run_scenario,
    summarize,
    trace_layers,
    worker_args,
)
from gradlane.cli import cli
from gradlane.demo import (
    MAX_RATE,
    MIN_RATE,
    RUN_TIMEOUT,
    SystemRun,
    pick_rate,
    run_timeout,
    steady_start,
)
from gradlane.errors import ConfigError, TestbedError
from gradlane.policies.chunks import trial_schedule
from gradlane.systems import DAEMON_SYSTEMS, REFERENCE, SYSTEMS
from tests import REPO, examples

SCENARIOS = sorted((REPO / "bench/scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_load(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert {"ddp", "gradlane"} <= set(scenario.systems)  # every scenario: the issue's pair


@pytest.mark.parametrize(
    "text, key",
    [
        ('name = "x"\n[workload]\nkind = "gpu"\n', "workload.kind"),
        ('name = "x"\n[workload]\nkind = "trace"\nmodel = "alexnet"\n', "workload.model"),
        ('name = "x"\nsystems = ["ddp", "nccl"]\n[workload]\nkind = "cnn"\n', "systems"),
        # Each measured once a round: a second would mix with the first's times.
        ('name = "x"\nsystems = ["ddp", "fifo", "ddp"]\n[workload]\nkind = "cnn"\n',
         "systems must be a list drawn from ddp, fifo, priority, gradlane, ddp-hook, each once"),
        ('name = "x"\nlayout = "tiny"\n[workload]\nkind = "cnn"\n', "layout"),
        ('name = "x"\nexchange = "tree"\n[workload]\nkind = "cnn"\n', "exchange"),
        ('name = "x"\nchunk_bytes = "1M"\n[workload]\nkind = "cnn"\n',
         "chunk_bytes must be a whole number, got '1M'"),
        ('name = "x"\nhosts = 4.0\n[workload]\nkind = "cnn"\n',
         "hosts must be a whole number, got 4.0"),
        ('name = "x"\nsteps = true\n[workload]\nkind = "cnn"\n',
         "steps must be a whole number, got True"),
        ('name = "x"\ncomm_to_compute = "1"\n[workload]\nkind = "cnn"\n',
         "comm_to_compute must be a number, got '1'"),
        ('name = "x"\nsystems = "ddp"\n[workload]\nkind = "cnn"\n',
         "systems must be a list, got 'ddp'"),
        ('name = "x"\nworkload = "cnn"\n', "workload must be a table, got 'cnn'"),
        ('name = 4\n[workload]\nkind = "cnn"\n', "name must be a string, got 4"),
        ('hosts = 4\n[workload]\nkind = "cnn"\n', "name must be a string, missing"),
        ('name = "x"\n[workload\n', "x.toml"),
        # Misspelt: refused, not run on the default.
        ('name = "x"\nstepz = 10\n[workload]\nkind = "cnn"\n', "'stepz'"),
        ('name = "x"\n[workload]\nkind = "trace"\nmodel = "vgg19"\nmodel_mb = 1\n'
         'forward_ms = 5\nforward_sm = 5\n', "'forward_sm'"),
        ('name = "x"\n[workload]\nkind = "cnn"\nmodel = "vgg19"\n',
         "keys ['model'] for kind 'cnn'"),
    ],
)
def test_bad_scenarios_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_scenario(path)


CNN = '\n[workload]\nkind = "cnn"\n'


def _trace(model_mb: str = "10", forward_ms: str = "50") -> str:
    """A trace workload's table body (TOML values). A trace's compute and bytes come from
    its profile (a CNN's would be measured: seconds)."""
    return f'kind = "trace"\nmodel = "vgg19"\nmodel_mb = {model_mb}\nforward_ms = {forward_ms}\n'


_TRACE = _trace()


@pytest.mark.parametrize(
    "lines, refused",
    [
        # Each range's edges are taken, and the values just past them refused with the range.
        ("hosts = 2", None),
        ("hosts = 8", None),
        ("hosts = 1", "need hosts 2..8"),
        ("hosts = 9", "need hosts 2..8"),
        ("steps = 10", None),
        ("steps = 9", "steps >= 10"),
        ("rounds = 1", None),
        ("rounds = 0", "rounds >= 1"),
        ("comm_to_compute = 0.01", None),
        ("comm_to_compute = 0", "comm_to_compute must be positive"),
        ("chunk_bytes = 4096", None),
        ("chunk_bytes = 1073741824", None),
        ("chunk_bytes = 4095", "chunk_bytes must be 4096..1073741824"),
        ("chunk_bytes = 1073741825", "chunk_bytes must be 4096..1073741824"),
        ("credit_bytes = 1024", None),
        ("credit_bytes = 1073741824", None),
        ("credit_bytes = 1023", "credit_bytes must be 1024..1073741824"),
        ("credit_bytes = 1073741825", "credit_bytes must be 1024..1073741824"),
    ],
)
def test_a_scenario_s_ranges_take_their_edges_and_refuse_past_them(
        tmp_path: Path, lines: str, refused: str | None) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\n' + lines + CNN)
    if refused is None:
        load_scenario(path)
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_scenario(path)


@pytest.mark.parametrize("key", ["model_mb", "forward_ms"])
@pytest.mark.parametrize("value, taken", [("0.5", True), ("0", False), ("-1", False),
                                          ('"1"', False)])
def test_a_trace_s_size_and_time_must_be_positive_numbers(
        tmp_path: Path, key: str, value: str, taken: bool) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\n[workload]\n' + _trace(**{key: value}))
    if taken:
        assert load_scenario(path).workload[key] == 0.5
        return
    with pytest.raises(ConfigError, match=f"workload.{key} must be a positive number"):
        load_scenario(path)


def test_a_scenario_s_defaults(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"' + CNN)
    scenario = load_scenario(path)
    assert (scenario.hosts, scenario.steps, scenario.rounds) == (4, 30, 2)
    assert (scenario.chunk_bytes, scenario.credit_bytes, scenario.comm_to_compute) == (
        None, None, 1.0)
    assert scenario.systems == tuple(SYSTEMS) and scenario.description == ""


def test_a_scenario_that_is_not_text_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_bytes(b"\xff\xfe\x00name")  # saved as UTF-16, say
    with pytest.raises(ConfigError, match=r"^.*x\.toml: 'utf-8' codec can't decode"):
        load_scenario(path)


def test_layout_reaches_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nlayout = "coarse"\n[workload]\nkind = "cnn"\n')
    args = worker_args(load_scenario(path))
    assert args[args.index("--layout") + 1] == "coarse"
    path.write_text('name = "x"\n[workload]\nkind = "cnn"\n')
    args = worker_args(load_scenario(path))
    assert args[args.index("--layout") + 1] == "auto"
    assert "--chunk-bytes" not in args and "--credit-bytes" not in args  # the shim's own
    assert args[args.index("--exchange") + 1] == "auto"
    path.write_text('name = "x"\nexchange = "ring"\n[workload]\nkind = "cnn"\n')
    assert worker_args(load_scenario(path))[args.index("--exchange") + 1] == "ring"


def test_chunk_and_credit_bytes_reach_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nchunk_bytes = 262144\ncredit_bytes = 32768\n'
                    '[workload]\nkind = "cnn"\n')
    args = worker_args(load_scenario(path))
    assert args[args.index("--chunk-bytes") + 1] == "262144"
    assert args[args.index("--credit-bytes") + 1] == "32768"


def test_a_run_can_be_narrowed_to_some_systems_and_rounds(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nrounds = 3\n[workload]\nkind = "cnn"\n')
    scenario = load_scenario(path)
    one = narrowed(scenario, ["gradlane", "ddp"], 1)
    assert (one.systems, one.rounds) == (("ddp", "gradlane"), 1)  # the scenario's order
    assert narrowed(scenario) == scenario
    with pytest.raises(ConfigError, match="not nccl"):
        narrowed(scenario, ["nccl"])
    two = tmp_path / "y.toml"
    two.write_text('name = "y"\nsystems = ["ddp", "gradlane"]\n[workload]\nkind = "cnn"\n')
    with pytest.raises(ConfigError, match="compares ddp, gradlane; not fifo"):
        narrowed(load_scenario(two), ["fifo"])


def test_a_narrowed_run_must_not_replace_the_scenarios_result(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\n[workload]\nkind = "cnn"\n')
    for args in (["--system", "gradlane"], ["--rounds", "1"]):
        result = CliRunner().invoke(cli, ["bench", "run", str(path), *args])
        assert result.exit_code == 2 and "need --json" in result.output, result.output
    result = CliRunner().invoke(cli, ["bench", "run", str(path), "--system", "nccl",
                                      "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 2 and "not nccl" in result.output, result.output
    assert not (tmp_path / "r.json").exists()


def test_a_scenario_is_named_as_the_issue_names_it_or_given_as_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gradlane bench run trace-vgg19`, from any directory; an unknown name lists the
    shipped ones."""
    monkeypatch.chdir(tmp_path)
    narrowed_run = ["--system", "nccl", "--json", str(tmp_path / "r.json")]
    result = CliRunner().invoke(cli, ["bench", "run", "trace-vgg19", *narrowed_run])
    # Past the scenario, loaded from the checkout's bench/scenarios/trace-vgg19.toml, to
    # the systems it compares.
    assert result.exit_code == 2 and "compares ddp, fifo, priority, gradlane; not nccl" in \
        result.output, result.output
    result = CliRunner().invoke(cli, ["bench", "run", "trace-vgg", *narrowed_run])
    assert result.exit_code == 2 and "no file 'trace-vgg', nor a scenario of that name" in \
        result.output and "trace-vgg19-x2" in result.output, result.output
    (tmp_path / "trace-vgg19").write_text('name = "mine"\nsystems = ["ddp"]\n'
                                          '[workload]\nkind = "cnn"\n')
    result = CliRunner().invoke(cli, ["bench", "run", "trace-vgg19", *narrowed_run])
    assert "compares ddp; not nccl" in result.output, result.output  # a file goes first


def test_summary_p90_is_the_nearest_rank_below_and_the_median_the_middle() -> None:
    times = [0.011, 0.003, 0.007, 0.001, 0.009, 0.005, 0.002, 0.010, 0.004, 0.008, 0.006]
    (row,) = summarize({"gradlane": times}, 0.001).values()
    assert (row["median_s"], row["p90_s"]) == (0.006, 0.010)


def test_summary_speedups_are_over_ddp_and_skip_the_reference() -> None:
    summary = summarize({"local": [0.1] * 5, "ddp": [0.4] * 5, "gradlane": [0.2] * 5}, 0.1)
    assert summary["gradlane"]["speedup_over_ddp"] == pytest.approx(2.0)
    assert summary["gradlane"]["achieved_over_bound"] == pytest.approx(2.0)
    assert "speedup_over_ddp" not in summary["local"]


def test_lower_bound_is_the_larger_of_compute_and_traffic() -> None:
    # 4 workers send 1.5 model sizes each: 8 MB -> 12 MB = 96 Mbit at 1448/1514 of 100 Mbit/s
    comm = 1.5 * 8e6 * 8 / (100e6 * 1448 / 1514)
    assert lower_bound(4, 0.5, 8_000_000, 100e6) == pytest.approx(max(0.5, comm))
    assert lower_bound(4, 2.0, 8_000_000, 100e6) == 2.0


def test_the_demo_s_rate_makes_the_exchange_as_long_as_the_compute() -> None:
    # 4 workers, 8 MB: 96 Mbit per iteration, in full frames 100.4 Mbit; in 0.5 s, 200.8 Mbit/s.
    rate = pick_rate(4, 0.5, 8_000_000)
    assert rate == 200e6
    assert lower_bound(4, 0.0, 8_000_000, rate) == pytest.approx(0.5, rel=0.01)
    assert pick_rate(2, 0.5, 8_000_000) == 133e6  # 1 model size each way over 2 workers
    # Whole Mbit/s, never outside the demo's range.
    assert pick_rate(4, 0.5, 1) == MIN_RATE and pick_rate(4, 1e-6, 8_000_000) == MAX_RATE


def test_a_demo_run_is_called_hung_only_well_past_what_its_steps_take() -> None:
    # The default 60 steps of about 0.25 s: the fixed limit, start-up included.
    assert run_timeout(60, 0.25) == RUN_TIMEOUT
    # --steps 10000 (the option's top) ran past the fixed 300 s, hung or not.
    assert run_timeout(10_000, 0.25) == 10_000.0
    # A slow --rate: a step of 2 s (the exchange alone), 100 steps.
    assert run_timeout(100, 2.0) == 800.0


def test_dependency_bound_is_the_simple_bound_when_the_bytes_come_last() -> None:
    # All bytes in the last layer: no cut puts traffic and compute in series.
    layers = [(0, 0.1), (0, 0.2), (8_000_000, 0.05)]
    for compute_s in (0.35, 3.5):
        scaled = [(b, c * compute_s / 0.35) for b, c in layers]
        assert dependency_bound(4, scaled, 100e6) == pytest.approx(
            lower_bound(4, compute_s, 8_000_000, 100e6))


def test_dependency_bound_adds_the_compute_past_the_last_bytes() -> None:
    # BERT's shape: bytes up front, a parameterless layer (the decoder) at the end.
    comm = 1.5 * 8e6 * 8 / (100e6 * 1448 / 1514)
    layers = [(8_000_000, 0.1), (0, 0.03)]
    assert dependency_bound(4, layers, 100e6) == pytest.approx(comm + 0.03)
    assert lower_bound(4, 0.13, 8_000_000, 100e6) == pytest.approx(comm)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**7), st.floats(0, 1)), min_size=1, max_size=30),
    st.integers(2, 8),
)
def test_dependency_bound_lies_between_the_simple_bound_and_no_overlap(
    layers: list[tuple[int, float]], hosts: int
) -> None:
    compute = sum(c for _, c in layers)
    size = sum(b for b, _ in layers)
    simple = lower_bound(hosts, compute, size, 1e9)
    serial = compute + lower_bound(hosts, 0.0, size, 1e9)  # nothing overlapped at all
    bound = dependency_bound(hosts, layers, 1e9)
    assert simple - 1e-9 <= bound <= serial + 1e-9


def test_trace_layers_sum_to_the_measured_compute() -> None:
    scenario = load_scenario(next(p for p in SCENARIOS if "bert" in p.name))
    layers = trace_layers(scenario, 0.2)
    assert layers is not None
    assert sum(c for _, c in layers) == pytest.approx(0.2)
    assert sum(b for b, _ in layers) == compute_and_bytes(scenario)[1]
    # Traffic takes 1.5x the compute, as in the scenario. BERT-base's decoder (a fifth
    # of the FLOPs, no bytes of its own) comes last: its compute adds to the traffic.
    size = compute_and_bytes(scenario)[1]
    rate = 1.5 * size * 8 / (0.3 * PAYLOAD_EFFICIENCY)
    assert lower_bound(4, 0.2, size, rate) == pytest.approx(0.3)
    assert 0.3 + 0.2 * 0.2 < dependency_bound(4, layers, rate) < 0.3 + 0.2 * 0.25
    cnn = load_scenario(next(p for p in SCENARIOS if p.stem == "cnn"))
    assert trace_layers(cnn, 0.2) is None


def test_trace_compute_is_three_times_the_forward() -> None:
    scenario = load_scenario(next(p for p in SCENARIOS if "vgg19" in p.name))
    compute, size = compute_and_bytes(scenario)
    assert compute == pytest.approx(3 * scenario.workload["forward_ms"] / 1000)
    assert size == pytest.approx(scenario.workload["model_mb"] * (1 << 20), rel=0.01)


def test_steady_steps_begin_past_the_warm_up_and_the_shim_s_layout_trial() -> None:
    decide = trial_schedule()[-1]  # 17: from the next step on, the layout is settled
    assert steady_start(40) == decide + 1 == 18
    assert steady_start(100) == 20  # the first fifth, later than the trial's end
    # Too short a run to leave half of it past the trial: only the first fifth is dropped.
    assert steady_start(30) == 6 and steady_start(10) == 2 and steady_start(0) == 0
    # At 36 steps, the 18 past the trial are half the run: enough; at 35, 17 of 35 too
    # (half rounds down); at 34, 16 are not.
    assert (steady_start(36), steady_start(35), steady_start(34)) == (18, 18, 6)


def result(name: str) -> dict[str, object]:
    return {
        "scenario": {"name": name},
        "summary": {
            "ddp": {"median_s": 0.2, "achieved_over_bound": 2.0, "speedup_over_ddp": 1.0},
            "gradlane": {"median_s": 0.1, "achieved_over_bound": 1.0, "speedup_over_ddp": 2.0},
        },
        "lower_bound_s": 0.1,
        "environment": {
            "commit": "abcdef1234567",
            "date": "2026-11-22T00:00:00Z",
            "cpu": "cpu",
            "cores": 2,
        },
    }


def test_readme_table_is_generated_between_markers(tmp_path: Path) -> None:
    simulated = {"experiment": "cluster", "results": {}}  # not a testbed result: left out
    table = markdown_table([result("s1"), simulated])
    assert "| s1 | gradlane | 100.0 ms | 2.00x | 1.00 | - | - |" in table
    assert "dependency bound:" not in table  # no trace result with it
    assert "at commit abcdef1234 on cpu (2 cores)." in table  # one commit: no list
    assert "no exchange" not in table  # no compute-alone reference in these results
    later = result("s4")
    later["environment"] = {**later["environment"], "commit": "1234567abcdef"}  # type: ignore[dict-item]
    table = markdown_table([result("s1"), later, result("s5")])
    assert "at commit abcdef1234 on cpu (2 cores): `s1`, `s5`." in table
    assert "at commit 1234567abc on cpu (2 cores): `s4`." in table
    with_reference = result("s2")
    with_reference["summary"]["local"] = {"median_s": 0.1, "achieved_over_bound": 1.0}  # type: ignore[index]
    table = markdown_table([with_reference])
    assert "| s2 | local (no exchange) | 100.0 ms | - | 1.00 |" in table
    assert "its median is the compute of the bound" in table
    ordered = result("s3")
    ordered["dependency_bound_s"] = 0.125
    ordered["summary"] = summarize({"gradlane": [0.15] * 5}, 0.1, None, 0.125)
    table = markdown_table([ordered])
    assert "| s3 | gradlane | 150.0 ms | - | 1.50 | 1.20 | - |" in table
    assert "dependency bound: against the bound that also holds the layers' order" in table
    assert "Steady steps" not in table  # no result says its window
    windows = [result(n) for n in ("s6", "s7", "s8")]
    for r, first in zip(windows, (18, 18, 20), strict=True):
        r.update(scenario={"name": r["scenario"]["name"], "steps": 40},  # type: ignore[index]
                 steady_from_step=first)
    table = markdown_table(windows)
    assert ("Steady steps (each run's, for the medians): from step 18 of 40: `s6`, `s7`; "
            "from step 20 of 40: `s8`.") in table
    res = tmp_path / "s1.json"
    res.write_text(json.dumps(result("s1")))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench-table:begin -->\nold\n<!-- bench-table:end -->\nend\n")
    out = CliRunner().invoke(cli, ["bench", "table", str(res), "--readme", str(readme)])
    assert out.exit_code == 0, out.output
    text = readme.read_text()
    assert "old" not in text and "| s1 | ddp |" in text
    assert text.startswith("intro\n") and text.endswith("end\n")


def test_every_ranks_cpu_use_is_collected(tmp_path: Path) -> None:
    from gradlane.demo import _collect

    for rank, cores in enumerate((0.91234, 0.4)):
        (tmp_path / f"gradlane-rank{rank}.json").write_text(
            json.dumps(
                {
                    "times": [0.1] * 10,
                    "losses": [1.0] * 10,
                    "waited": [0.0] * 10,
                    "cpu_cores": cores,
                    "cpu_sys_cores": cores / 4,
                    "cpu_train_cores": cores / 2,
                    "run_queue_s_per_step": cores / 100,
                }
            )
        )
    run = _collect("gradlane", tmp_path, 5.0)  # rounded: cores to 0.001, waits to 10 us
    assert run.cpu_cores == [0.912, 0.4]
    assert run.cpu_sys_cores == [0.228, 0.1]
    assert run.cpu_train_cores == [0.456, 0.2]
    assert run.run_queue_s == [0.00912, 0.004]


def test_the_machine_s_cpu_is_taken_over_rank_0_s_steady_steps(tmp_path: Path) -> None:
    from gradlane.demo import _collect

    class Cpu:
        def over(self, start: float, end: float) -> dict[str, float]:
            self.asked = (start, end)
            return {"busy": 0.5}

    ends = [0.1 * (k + 1) for k in range(10)]
    record = {"times": [0.1] * 10, "losses": [1.0] * 10, "ends": ends}
    (tmp_path / "ddp-rank0.json").write_text(json.dumps(record))
    cpu = Cpu()
    run = _collect("ddp", tmp_path, 1.0, cpu)  # type: ignore[arg-type]
    assert run.ends == ends and run.machine_cpu == {"busy": 0.5}
    # Steps 2..9 are steady (`steady_start`): from the end of step 1 to the last.
    assert steady_start(10) == 2 and cpu.asked == pytest.approx((0.2, 1.0))
    # Two steps: the window is the second (steady from step 0: no fifth to warm up).
    (tmp_path / "ddp-rank0.json").write_text(json.dumps({**record, "ends": ends[:2]}))
    assert _collect("ddp", tmp_path, 1.0, cpu).machine_cpu == {"busy": 0.5}  # type: ignore[arg-type]
    assert cpu.asked == pytest.approx((0.1, 0.2))
    # A worker that recorded one step end, or none: no window, nothing asked.
    del record["ends"]
    for some in ({"ends": [0.1]}, {}):
        (tmp_path / "ddp-rank0.json").write_text(json.dumps({**record, **some}))
        unasked = Cpu()
        assert _collect("ddp", tmp_path, 1.0, unasked).machine_cpu is None  # type: ignore[arg-type]
        assert not hasattr(unasked, "asked")


def test_run_queue_wait_grows_when_the_cores_are_taken() -> None:
    from gradlane.worker import run_queue_s

    before = run_queue_s()
    if before is None:
        pytest.skip("no /proc/thread-self/schedstat (not Linux, or schedstats off)")
    spin = "import time\nend = time.monotonic() + 1\nwhile time.monotonic() < end: pass"
    cores, started = os.cpu_count() or 1, time.monotonic()
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cores + 1)]
    try:
        _spin(0.6)  # this thread wants a core all along, more processes than cores do too
    finally:
        for hog in hogs:
            hog.wait(10)
    after = run_queue_s()
    assert after is not None
    # Seconds: shared fairly among cores + 2 runnable threads, this one waited about
    # 2 / (cores + 2) of its 0.6 s (0.3 s on 2 cores; 0.3-0.5 s measured), at least a
    # quarter of that here; and never longer than the time that passed.
    assert 0.6 * 2 / (cores + 2) / 4 < after - before <= time.monotonic() - started, (
        before, after)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _stat(user: int, system: int, idle: int, softirq: int, steal: int = 0) -> tuple[int, ...]:
    """/proc/stat's order; nice, iowait and irq a fifth of user, idle and softirq."""
    return (user, user // 5, system, idle, idle // 5, softirq // 5, softirq, steal)


def test_machine_cpu_shares_come_from_the_samples_inside_the_window(tmp_path: Path) -> None:
    from gradlane.demo import MachineCpu

    cpu = MachineCpu(limit=0.0)
    cpu.stop()
    cpu.samples = [
        (0.0, _stat(0, 0, 0, 0)),
        (1.0, _stat(100, 50, 100, 0)),  # the window: from here ...
        (2.0, _stat(200, 100, 120, 20, 10)),  # ... to here
        (3.0, _stat(900, 900, 900, 900)),
    ]
    shares = cpu.over(0.5, 2.5)
    # user 100 + nice 20, system 50, idle 20 + iowait 4, softirq 20 + irq 4, steal 10: 228.
    assert shares == pytest.approx({"busy": 1 - 24 / 228, "user": 120 / 228,
                                    "system": 50 / 228, "softirq": 24 / 228,
                                    "steal": 10 / 228}, abs=1e-4)
    assert cpu.over(1.0, 2.0) == shares  # samples at the window's edges are in it
    assert cpu.over(1.5, 2.5) is None  # one sample cannot tell
    cpu.samples = [(0.0, _stat(5, 5, 5, 5)), (1.0, _stat(5, 5, 5, 5)), (2.0, _stat(5, 5, 5, 6))]
    assert cpu.over(0.0, 1.0) is None  # no tick between them
    assert cpu.over(0.0, 2.0) is not None  # one is enough
    # The machine's own counters: a busy loop shows up as busy time.
    real = MachineCpu(every=0.05)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.4:
        pass
    real.stop()
    measured = real.over(t0, time.monotonic())
    assert measured is not None and 0 < measured["busy"] <= 1
    assert measured["user"] + measured["system"] + measured["softirq"] <= measured["busy"] + 1e-3


def _demo_runs(ddp: dict[str, Any] | None = None, ours: dict[str, Any] | None = None
               ) -> tuple[SystemRun, SystemRun]:
    """A demo's two runs of 10 steps, the first 2 (9 s each) warm-up: DDP's others 0.1 to
    0.8 s, gradlane's half as long; gradlane's last loss 2.2, every other 2.0. `ddp` and
    `ours`: more fields of each."""
    steps = [0.1 * k for k in range(1, 9)]
    return (SystemRun("ddp", [9.0, 9.0, *steps], [2.0] * 12, 1.0, **(ddp or {})),
            SystemRun("gradlane", [9.0, 9.0, *(t / 2 for t in steps)], [2.0] * 11 + [2.2],
                      1.0, **(ours or {})))


def test_the_demo_s_figures_come_from_the_steady_steps() -> None:
    """Median, p90 and the speedup over the steps past the warm-up (the first fifth of
    10: 2 steps, here 9 s each); the final loss over the last 10 steps."""
    from gradlane.demo import DemoResult

    ddp, ours = _demo_runs()
    assert ddp.p(0.0) == pytest.approx(0.1) and ddp.p(1.0) == pytest.approx(0.8)
    assert ddp.p(0.5) == pytest.approx(0.5) and ddp.p(0.9) == pytest.approx(0.8)
    result = DemoResult(2, 100_000_000, 0.1, {"ddp": ddp, "gradlane": ours})
    assert result.speedup == pytest.approx(2.0)
    assert result.loss_gap == pytest.approx(0.01)  # 2.02 against 2.0
    assert result.loss_curve_gap == pytest.approx(0.1)  # the last step's 2.2 against 2.0
    shown = result.as_json()
    assert shown["systems"]["ddp"]["median_s"] == pytest.approx(0.45)
    assert shown["systems"]["gradlane"]["p90_s"] == pytest.approx(0.4)


def test_the_demo_s_table_shows_each_run_s_figures() -> None:
    from rich.console import Console

    from gradlane.demo import DemoResult, report

    ddp, ours = _demo_runs(
        ddp={"wire_bytes": 12_345_678, "utilization": 0.456, "cpu_cores": [0.8, 1.0],
             "cpu_sys_cores": [0.1, 0.3], "cpu_train_cores": [0.7, 0.9],
             "machine_cpu": {"busy": 0.6}},
        ours={"exposed": [0.0] * 10, "slowest": [0.0] * 10})
    console = Console(record=True, width=250)
    report(DemoResult(2, 100_000_000, 0.1, {"ddp": ddp, "gradlane": ours}), console)
    text = console.export_text()
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.count("│") > 5}
    assert rows["PyTorch DDP (gloo)"] == ["450.0 ms", "800.0 ms", "1.00x", "12.3 MB", "46%",
                                          "0.90 cores (0.20 kernel, 0.10 other threads)",
                                          "60%", "-", "2.0000"]
    assert rows["gradlane"][:3] == ["225.0 ms", "400.0 ms", "2.00x"]
    assert rows["gradlane"][3:7] == ["-", "-", "-", "-"]  # not measured on this run
    assert rows["gradlane"][7].startswith("0.0 ms") and rows["gradlane"][8] == "2.0200"
    assert "gradlane demo: 2 workers, 100 Mbit/s links" in text
    assert "worker CPU: cores per worker over its training loop, of them in the kernel" in text
    assert "final losses differ by 1.00%" in text and "at most 10.00% at any of the 12" in text
    console = Console(record=True, width=250)
    report(DemoResult(2, None, 0.1, {"ddp": ddp, "gradlane": ours}), console)
    assert "2 workers, loopback (no traffic control)" in console.export_text()


def _plotted(result: Any, path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`gradlane.demo.plot`'s figure (kept open), after it wrote `path`."""
    import matplotlib.pyplot as plt

    from gradlane.demo import plot

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return kept[0]


Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]  # each call's arguments and keywords


def _spied(monkeypatch: pytest.MonkeyPatch, method: str) -> Calls:
    """The arguments of every call of matplotlib's ``Axes.<method>`` (which still draws)."""
    from matplotlib.axes import Axes

    calls: Calls = []
    drawn = getattr(Axes, method)

    def spy(ax: Axes, *args: Any, **kw: Any) -> Any:
        calls.append((args, kw))
        return drawn(ax, *args, **kw)

    monkeypatch.setattr(Axes, method, spy)
    return calls


def test_the_demo_s_figure_shows_the_bands_the_link_rate_and_both_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradlane.demo import WINDOW_S, DemoResult

    ddp = SystemRun("ddp", [0.2] * 10, [2.0] * 10, 1.0)
    ours = SystemRun("gradlane", [0.1] * 10, [2.0] * 10, 1.0)
    t = [0.025, 0.05, 0.075, 0.1]
    bands = {"t": t, "span_s": 0.1, "iterations": 12, "band0": [60e6, 0, 0, 0],
             "band1": [0, 40e6, 0, 0], "band2": [0, 0, 0, 0], "band3": [0, 0, 0, 90e6]}
    result = DemoResult(4, 100_000_000, 0.1, {"ddp": ddp, "gradlane": ours}, bands)
    stacked = _spied(monkeypatch, "stackplot")
    usage, times = _plotted(result, tmp_path / "demo.png", monkeypatch).axes
    # Each band's Mbit/s, held from 0 until the first sample's end (steps "pre").
    ((x, *per_band), _), = stacked
    assert x == [0.0, *t]
    assert per_band == [[60, 60, 0, 0, 0], [0, 0, 40, 0, 0], [0] * 5, [0, 0, 0, 0, 90]]
    assert [c.get_label() for c in usage.collections] == [f"band {b}" for b in range(4)]
    assert [line.get_label() for line in usage.lines] == ["link rate"]
    assert list(usage.lines[0].get_ydata()) == [100, 100]  # Mbit/s
    assert usage.get_xlim() == (0, 0.1)  # the median iteration
    assert usage.get_ylim() == pytest.approx((0, 130))  # the rate, the largest, and room
    assert usage.get_xlabel() == ("seconds into an iteration: the gradlane run's 12 steady "
                                  "iterations\naveraged, each scaled to the median (100 ms)")
    assert [line.get_label() for line in times.lines] == ["PyTorch DDP", "gradlane"]
    assert list(times.lines[1].get_ydata()) == pytest.approx([100] * 10)  # ms
    assert "2.00x" in times.get_title()
    # One iteration's samples (none averaged): a window of the run, said as such.
    unsaid = {k: v for k, v in bands.items() if k != "iterations"}
    for one in ({**bands, "iterations": 1}, {**bands, "span_s": None}, unsaid):
        alone = DemoResult(4, 100_000_000, 0.1, {"ddp": ddp, "gradlane": ours}, one)
        usage, _ = _plotted(alone, tmp_path / "demo.png", monkeypatch).axes
        assert usage.get_xlabel() == f"seconds (a {WINDOW_S:.0f} s window of the gradlane run)"


def test_the_demo_s_figure_on_loopback_says_there_are_no_bands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradlane.demo import DemoResult

    runs = {s: SystemRun(s, [0.1] * 10, [2.0] * 10, 1.0) for s in ("ddp", "gradlane")}
    usage, _ = _plotted(DemoResult(2, None, 0.1, runs), tmp_path / "demo.png",
                        monkeypatch).axes
    assert not usage.collections and not usage.axison
    assert "no traffic control on loopback" in usage.texts[0].get_text()


def test_summary_means_worker_and_machine_cpu_over_runs() -> None:
    from gradlane.demo import SystemRun

    runs = [SystemRun("gradlane", [0.2] * 5, [1.0] * 5, 1.0, cpu_cores=[0.2, 0.4],
                      cpu_sys_cores=[0.1, 0.1], cpu_train_cores=[0.1, 0.3],
                      machine_cpu={"busy": 0.6}, run_queue_s=[0.002, 0.004]),
            SystemRun("gradlane", [0.2] * 5, [1.0] * 5, 1.0, cpu_cores=[0.3, 0.3],
                      cpu_sys_cores=[0.0, 0.2], cpu_train_cores=[0.3, 0.1],
                      machine_cpu={"busy": 0.8}, run_queue_s=[0.006, 0.008])]
    s = summarize({"gradlane": [0.2] * 5}, 0.1, {"gradlane": runs})["gradlane"]
    assert s["worker_cpu_cores_mean"] == pytest.approx(0.3)
    assert s["worker_cpu_sys_cores_mean"] == pytest.approx(0.1)
    assert s["worker_cpu_train_cores_mean"] == pytest.approx(0.2)
    assert s["machine_busy_mean"] == pytest.approx(0.7)
    assert s["run_queue_s_mean"] == pytest.approx(0.005)
    assert cells(s)[-4:-1] == ["0.30 cores (0.10 kernel, 0.10 other threads)", "70%", "5.0 ms"]
    bare = summarize({"gradlane": [0.2] * 5}, 0.1)["gradlane"]  # nothing measured: "-"
    assert cells(bare)[-4:] == ["-", "-", "-", "-"]


@pytest.mark.parametrize(("measured", "cell"), [
    ((None, 0.1, 0.2), "-"),
    ((0.5, None, None), "0.50 cores"),
    ((0.5, 0.1, None), "0.50 cores (0.10 kernel)"),  # a result from before the split
    ((0.5, None, 0.4), "0.50 cores (0.10 other threads)"),
    ((0.5, 0.1, 0.5), "0.50 cores (0.10 kernel, 0.00 other threads)"),
])
def test_a_worker_s_cpu_cell_shows_what_was_measured(
        measured: tuple[float | None, float | None, float | None], cell: str) -> None:
    """The kernel's share and the other threads' (the worker's CPU less its training
    thread's) are each shown when measured: results written before either still read."""
    from gradlane.benchmark import cpu_cell

    assert cpu_cell(*measured) == cell


def _rank(computes: list[float], waited: list[float]) -> dict[str, Any]:
    """A rank's record: each step starts when the last ended (step 0 at 0), its forward
    waits waited[k], it computes computes[k]; the optimizer then takes 1 ms."""
    record: dict[str, Any] = {"backward_ends": [], "waited": waited, "ends": []}
    start = 0.0
    for compute, wait in zip(computes, waited, strict=True):
        record["backward_ends"].append(start + wait + compute)
        start = record["backward_ends"][-1] + 0.001
        record["ends"].append(start)
    return record


def test_the_wait_for_averages_is_split_by_what_held_the_slowest_worker_back() -> None:
    from gradlane.demo import waits_for_slowest

    # Step 1: both compute 0.1 s, but rank 1 waited 0.03 longer for step 0's averages
    # (the exchange's doing), so its backward ends 0.03 late: of rank 0's wait in step
    # 2 (0.04), none is the slowest worker's.
    # Step 2: rank 1 computes 0.02 longer and ends 0.02 late: of rank 0's 0.05 in step 3,
    # 0.02 is the slowest worker's; rank 1 was the last itself (none of its 0.01).
    # Step 3: rank 1 computes 0.03 longer but, having waited less, ends only 0.01 late:
    # of rank 0's 0.02 in step 4, that 0.01 is the slowest worker's.
    ranks = [_rank([0.1, 0.1, 0.10, 0.10, 0.1], [0.0, 0.00, 0.04, 0.05, 0.02]),
             _rank([0.1, 0.1, 0.12, 0.13, 0.1], [0.0, 0.03, 0.01, 0.01, 0.00])]
    exposed, slowest = waits_for_slowest(ranks)
    assert exposed == pytest.approx([0.0, 0.015, 0.025, 0.03, 0.01])
    # Steps 0 and 1 have no step before theirs to compare: 0.
    assert slowest == pytest.approx([0.0, 0.0, 0.0, 0.01, 0.005])
    # A rank that did not record every series (an older worker): nothing to say.
    assert waits_for_slowest([ranks[0], {"waited": [0.0] * 5}]) == ([], [])


def test_waits_for_averages_are_collected_for_shim_systems_only(tmp_path: Path) -> None:
    from gradlane.demo import _collect

    for system in ("gradlane", "ddp"):
        for rank, slower in enumerate((0.0, 0.004)):  # rank 1 computes 4 ms longer
            record = _rank([0.1 + slower] * 10, [0.0] + [0.005] * 9)
            record.update(times=[0.1] * 10, losses=[1.0] * 10)
            (tmp_path / f"{system}-rank{rank}.json").write_text(json.dumps(record))
    run = _collect("gradlane", tmp_path, 1.0)
    assert run.exposed == pytest.approx([0.0] + [0.005] * 9)
    # Rank 0 waits 4 ms for rank 1's compute; the first two steps cannot tell.
    assert run.slowest == pytest.approx([0.0, 0.0] + [0.002] * 8)
    assert [r["waited"] for r in run.rank_steps] == [[0.0] + [0.005] * 9] * 2  # kept raw
    ddp = _collect("ddp", tmp_path, 1.0)  # DDP's wait is inside its backward
    assert ddp.exposed == [] and ddp.slowest == []
    s = summarize({"gradlane": [0.1] * 8}, 0.1, {"gradlane": [run]})["gradlane"]
    assert s["exposed_s_mean"] == pytest.approx(0.005)  # the steady steps: 2 warm up
    assert cells(s)[-1] == "5.0 ms (2.0 slowest)"
    # A result from before the split shows the wait alone, and the table says why.
    old = {k: v for k, v in s.items() if k != "slowest_compute_s_mean"}
    assert cells({**old, "slowest_worker_s_mean": 0.002})[-1] == "5.0 ms"
    env = {"commit": "0" * 40, "date": "2026-11-23", "cpu": "x", "cores": 2}
    result = {"scenario": {"name": "a"}, "lower_bound_s": 0.1, "environment": env}
    new_only = markdown_table([{**result, "summary": {"gradlane": s}}])
    assert "5.0 ms (2.0 slowest)" in new_only and "without brackets" not in new_only
    mixed = markdown_table([{**result, "summary": {"gradlane": s}},
                            {**result, "scenario": {"name": "b"}, "summary": {"gradlane": old}}])
    assert "without brackets: a result from before that split" in mixed


def test_the_readme_table_is_the_one_the_results_make() -> None:
    # `gradlane bench table bench/results/*.json --readme README.md` after every re-run.
    results = sorted((REPO / "bench/results").glob("*.json"))
    table = markdown_table([json.loads(p.read_text()) for p in results])
    readme = (REPO / "README.md").read_text()
    shown = readme.split("<!-- bench-table:begin -->\n", 1)[1]
    shown = shown.split("\n<!-- bench-table:end -->", 1)[0]
    assert shown == table, "README table is stale: run gradlane bench table ... --readme README.md"


def _sampler(samples: list[tuple[float, dict[int, int]]]) -> Any:
    from gradlane.demo import _BandSampler

    sampler = _BandSampler.__new__(_BandSampler)  # no namespace: samples given
    sampler.samples = samples
    return sampler


def test_the_demo_averages_band_usage_over_the_phase_of_its_steady_iterations() -> None:
    from gradlane.demo import PHASE_BINS, steady_iterations

    ends = [0.1 * (k + 1) for k in range(20)]
    assert steady_iterations(ends)[0] == (ends[3], ends[4])  # the first fifth warms up
    assert len(steady_iterations(ends)) == 16 and steady_iterations(ends[:5]) == []
    assert steady_iterations(ends[:6]) == [(ends[k - 1], ends[k]) for k in range(1, 6)]

    # Band leaves 1:101 (band 0) and 1:102 (band 1) of job slot 1, sampled every 5 ms
    # (a twentieth of an iteration): band 0 sends 1 Mbit/s in each iteration's first
    # half, band 1 2 Mbit/s in its second. Two other jobs (slots 2 and 3) each send 0.6
    # of that on their band 0. Leaves had counted bytes before sampling began: 8 MB each
    # of job 1's, 20 MB job 2's, none job 3's (only bytes since count). Parent classes
    # count their leaves' sum and are no band: the jobs' (1:S00) and the root (1:1, more
    # than any one job).
    def sent(t: float) -> dict[int, int]:
        tick = round(t * 200)
        whole, phase = divmod(tick, 20)  # 5 ms ticks: iterations, ticks into one
        leaves = {0x101: 8_000_000 + 625 * (10 * whole + min(phase, 10)),
                  0x102: 8_000_000 + 1250 * (10 * whole + max(phase - 10, 0)),
                  0x201: 20_000_000 + 560 * tick, 0x301: 560 * tick}
        jobs = {0x100: leaves[0x101] + leaves[0x102], 0x200: leaves[0x201],
                0x300: leaves[0x301]}
        return {**leaves, **jobs, 0x1: sum(jobs.values())}

    usage = _sampler([(k / 200, sent(k / 200)) for k in range(400)]).band_usage(
        2, steady_iterations(ends))
    assert usage["span_s"] == pytest.approx(0.1) and usage["iterations"] == 16
    assert usage["t"][0] == pytest.approx(0.1 / PHASE_BINS) and usage["t"][-1] == pytest.approx(0.1)
    half = PHASE_BINS // 2
    assert usage["band0"] == pytest.approx([1e6] * half + [0.0] * half, abs=1)
    assert usage["band1"] == pytest.approx([0.0] * half + [2e6] * half, abs=1)


def test_the_parts_of_an_iteration_no_sample_covers_read_zero() -> None:
    # Samples (1 Mbit/s on band 0) until 1 s; the window asked for runs on to 2 s.
    samples = [(k / 100, {0x101: 1250 * k}) for k in range(101)]
    usage = _sampler(samples).band_usage(1, [(0.0, 2.0)])
    half = len(usage["band0"]) // 2
    assert usage["band0"] == pytest.approx([1e6] * half + [0.0] * half)  # not NaN: JSON


def test_without_iterations_band_usage_is_a_window_from_the_run_s_middle() -> None:
    from gradlane.demo import WINDOW_S

    # 4 s of samples every 10 ms; band 0 at 1 Mbit/s throughout. Band 1's class is made at
    # 1.5 s (absent before: counted from 0) and sends 2 Mbit/s from 2 s.
    samples = []
    for k in range(401):
        t = k / 100
        counts = {0x101: 1250 * k}
        if t >= 1.5:
            counts[0x102] = 2500 * max(0, k - 200)
        samples.append((t, counts))
    usage = _sampler(samples).band_usage(2)
    assert usage["span_s"] == WINDOW_S and usage["iterations"] == 1
    assert usage["band0"] == pytest.approx([1e6] * len(usage["band0"]))
    assert usage["band1"] == pytest.approx([2e6] * len(usage["band1"]))  # 2 s .. 3 s


def test_the_demo_s_band_profile_does_not_read_above_a_link_sent_in_whole_segments() -> None:
    # TCP hands the qdisc 64 KB segments: at 128 Mbit/s, one every 4.1 ms, so one 10 ms
    # counter sample holds two or three of them and reads 20% under or over the rate.
    rate, segment = 128e6, 65536
    rng = random.Random(1)
    times = [0.0]
    while times[-1] < 6.0:
        times.append(times[-1] + 0.01 + rng.uniform(0, 0.004))  # a busy machine's sampling
    samples = [(t, {0x101: segment * int(rate * t / 8 / segment)}) for t in times]
    per_sample = [(b[1][0x101] - a[1][0x101]) * 8 / (b[0] - a[0])
                  for a, b in itertools.pairwise(samples)]
    assert max(per_sample) > 1.2 * rate  # what one iteration's samples would show
    ends = [0.107 * (k + 1) for k in range(50)]
    usage = _sampler(samples).band_usage(1, list(itertools.pairwise(ends)))
    assert usage["band0"] == pytest.approx([rate] * len(usage["band0"]), rel=0.05)


def test_table_and_plot_refuse_files_that_are_not_bench_results(tmp_path: Path) -> None:
    garbled, other = tmp_path / "garbled.json", tmp_path / "sim.json"
    garbled.write_text("nope")
    other.write_text(json.dumps({"experiment": "cluster", "results": {}}))  # the simulator's
    shown = CliRunner().invoke(cli, ["bench", "table", str(other)])
    assert shown.exit_code == 1 and "none of these is a result of" in shown.output
    shown = CliRunner().invoke(cli, ["bench", "plot", str(other)])
    assert shown.exit_code == 1 and "not a result of `gradlane bench run`" in shown.output
    # A summary without the bound it is measured against is no bench result either.
    other.write_text(json.dumps({"summary": {"gradlane": {"median_s": 0.1}}}))
    shown = CliRunner().invoke(cli, ["bench", "table", str(other)])
    assert shown.exit_code == 1 and "none of these is a result of" in shown.output
    shown = CliRunner().invoke(cli, ["bench", "table", str(garbled)])
    assert isinstance(shown.exception, ConfigError)
    assert "garbled.json: not a results file" in str(shown.exception)


def test_reading_a_result_names_the_file_of_a_field_of_the_wrong_kind_only() -> None:
    path = Path("r.json")
    assert reading(path, lambda: 7) == 7
    with pytest.raises(ConfigError, match=r"^r.json: not a results file gradlane can read "
                                          r"\(KeyError: 'runs'\)"):
        reading(path, lambda: {}["runs"])

    def says_why() -> None:
        raise ConfigError("a scenario's own error")

    with pytest.raises(ConfigError, match="^a scenario's own error$"):  # as it was raised
        reading(path, says_why)


@pytest.mark.parametrize(("command", "field", "value"), [
    ("table", ("summary", "gradlane", "median_s"), [0.1]),
    ("table", ("environment",), None),
    ("plot", ("runs", "ddp", 0, "iteration_s"), 0.1),
    ("plot", ("lower_bound_s",), None),
])
def test_table_and_plot_name_a_results_file_with_a_field_of_the_wrong_kind(
        tmp_path: Path, command: str, field: tuple[str | int, ...], value: object) -> None:
    """An edited or cut result: an error naming the file, not a traceback."""
    result = json.loads((REPO / "bench" / "results" / "cnn.json").read_text())
    good, bad = tmp_path / "good.json", tmp_path / "edited.json"
    good.write_text(json.dumps(result))
    inner = result
    for key in field[:-1]:
        inner = inner[key]
    inner[field[-1]] = value
    bad.write_text(json.dumps(result))
    files = [good, bad] if command == "table" else [bad]  # the table: the one named
    shown = CliRunner().invoke(cli, ["bench", command, *map(str, files)])
    assert isinstance(shown.exception, ConfigError), shown.output  # `main` shows it
    assert "edited.json: not a results file gradlane can read" in str(shown.exception)


def test_plot_draws_a_result_next_to_it_or_where_told(tmp_path: Path) -> None:
    result = tmp_path / "cnn.json"
    result.write_text((REPO / "bench" / "results" / "cnn.json").read_text())
    shown = CliRunner().invoke(cli, ["bench", "plot", str(result)])
    assert shown.exit_code == 0, shown.output
    assert shown.output == f"{tmp_path / 'cnn.png'}\n"
    told = tmp_path / "figures" / "iterations.png"
    told.parent.mkdir()
    shown = CliRunner().invoke(cli, ["bench", "plot", str(result), "--png", str(told)])
    assert shown.exit_code == 0 and shown.output == f"{told}\n", shown.output
    for png in (tmp_path / "cnn.png", told):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_bench_figure_shows_each_system_s_steady_steps_and_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One box per system of its runs' steady iteration times (ms), whose median is the
    summary's, and the lower bound's line."""
    import matplotlib.pyplot as plt

    result = json.loads((REPO / "bench" / "results" / "cnn.json").read_text())
    boxed = _spied(monkeypatch, "boxplot")
    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    benchmark.plot(result, tmp_path / "cnn.png")
    ((data,), kw), = boxed
    systems = list(result["summary"])
    assert kw["tick_labels"] == systems
    for system, times in zip(systems, data, strict=True):
        assert statistics.median(times) == pytest.approx(
            result["summary"][system]["median_s"] * 1000)
    ax, = kept[0].axes
    bound, = (line for line in ax.lines if line.get_label() == "lower bound")
    assert list(bound.get_ydata()) == pytest.approx([result["lower_bound_s"] * 1000] * 2)


class _Cluster:
    """Stands in for the emulated cluster: `run_on_cluster` is faked too. Each one built is
    kept in `built`, with the hosts it started daemons on and its runs' (system, port,
    daemon sockets' names)."""

    gone: list[bool] = []
    built: list[_Cluster] = []
    timeouts: list[float] = []  # each run's, in order

    def __init__(self, topology: Any) -> None:
        self.topology = topology
        self.daemons_on: list[int] = []
        self.runs: list[tuple[str, int, list[str] | None]] = []
        self.built.append(self)

    def start_daemons(self, hosts: Any, out: Path) -> dict[str, tuple[None, Path]]:
        self.daemons_on.extend(hosts)
        return {f"h{h}": (None, out / f"gl{h}.sock") for h in hosts}

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.gone.append(True)


def _runs_until(monkeypatch: pytest.MonkeyPatch, stop: BaseException | None, after: int,
                steps: int) -> list[str]:
    """Fake every run (`steps` steps of 0.1 s), the one after `after` raising `stop`;
    return the systems run, in order."""
    started: list[str] = []

    def run_on_cluster(c: _Cluster, system: str, args: list[str], *, port: int, out: Path,
                       sockets: list[Path] | None, timeout: float) -> tuple[SystemRun, Any]:
        started.append(system)
        _Cluster.timeouts.append(timeout)
        c.runs.append((system, port, sockets and [p.name for p in sockets]))
        if stop is not None and len(started) > after:
            assert not _Cluster.gone
            raise stop
        return SystemRun(system, [0.1] * steps, [1.0] * steps, wall_s=0.1 * steps), {}

    _Cluster.gone, _Cluster.built, _Cluster.timeouts = [], [], []
    monkeypatch.setattr("gradlane.testbed.Cluster", _Cluster)
    monkeypatch.setattr("gradlane.demo.run_on_cluster", run_on_cluster)
    return started


@pytest.mark.parametrize(("stop", "said"), [
    (SystemExit(128), "SystemExit: 128"),  # no signal 0: an exit status as any other
    (SystemExit(1), "SystemExit: 1"),
    (SystemExit("no cluster"), "SystemExit: no cluster"),
    (TestbedError("x" * 5000), "TestbedError: " + "x" * (2000 - len("TestbedError: "))),
])
def test_why_a_run_stopped_is_said_in_at_most_2000_characters(
        stop: BaseException, said: str) -> None:
    from gradlane.benchmark import stopped_by

    assert stopped_by(stop) == said


@pytest.mark.parametrize(("stop", "said"), [
    (TestbedError("rank 1 exited with 1"), "TestbedError: rank 1 exited with 1"),
    (KeyboardInterrupt(), "interrupted (Ctrl-C)"),
    (SystemExit(143), "stopped by SIGTERM"),
    (SystemExit(129), "stopped by SIGHUP"),
])
def test_a_run_that_stops_keeps_the_runs_it_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException, said: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nhosts = 2\nsteps = 30\nrounds = 2\n'
                    f'systems = ["ddp", "fifo"]\n[workload]\n{_TRACE}')
    scenario = load_scenario(path)
    started = _runs_until(monkeypatch, stop, after=4, steps=30)
    kept: list[dict[str, Any]] = []

    def keep(data: dict[str, Any]) -> None:
        assert _Cluster.gone  # the cluster was removed first
        kept.append(data)

    with pytest.raises(type(stop)):
        run_scenario(scenario, say=lambda _: None, keep_partial=keep)
    assert started == ["local", "ddp", "fifo", "local", "ddp"]
    (data,) = kept
    assert data["complete"] is False and data["stopped_by"] == said
    assert {s: len(rs) for s, rs in data["runs"].items()} == {"local": 2, "ddp": 1, "fifo": 1}
    assert data["runs"]["ddp"][0]["iteration_s"] == [0.1] * 30
    assert data["scenario"]["systems"] == ["ddp", "fifo"]


@pytest.mark.parametrize("hosts, ratio", [(2, 1.0), (4, 0.5), (8, 2.0)])
def test_the_link_rate_makes_an_iteration_s_bytes_take_the_scenario_s_share_of_compute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hosts: int, ratio: float) -> None:
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\nhosts = {hosts}\ncomm_to_compute = {ratio}\n'
                    f'systems = ["ddp", "fifo"]\n[workload]\n{_TRACE}')
    scenario = load_scenario(path)
    _runs_until(monkeypatch, None, after=0, steps=30)
    result = run_scenario(scenario, say=lambda _: None)
    compute, size = compute_and_bytes(scenario)
    rate = result["link_bps"]
    # Each worker sends 2(W-1)/W model sizes an iteration, in whole segments' goodput.
    seconds = 2 * (hosts - 1) / hosts * size * 8 / (rate * PAYLOAD_EFFICIENCY)
    assert seconds == pytest.approx(ratio * compute, rel=1e-6)
    assert result["nominal_lower_bound_s"] == pytest.approx(max(compute, seconds))
    (cluster,) = _Cluster.built
    assert list(cluster.topology.rates) == [rate] * hosts
    # A run is hung past RUN_TIMEOUT, or four times its steps of compute then exchange.
    step = compute * (1 + ratio)
    assert _Cluster.timeouts == [max(RUN_TIMEOUT, 4 * scenario.steps * step)] * 6


def test_a_long_scenario_s_runs_may_take_longer_than_the_fixed_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\nhosts = 2\nsteps = 5000\nrounds = 1\nsystems = ["ddp"]\n'
                    f'[workload]\n{_TRACE}')
    scenario = load_scenario(path)
    _runs_until(monkeypatch, None, after=0, steps=5000)
    run_scenario(scenario, say=lambda _: None)
    compute, _ = compute_and_bytes(scenario)
    assert _Cluster.timeouts == [4 * 5000 * 2 * compute] * 2 and 4 * 5000 * 2 * compute > 300


def test_every_round_runs_every_system_and_only_the_daemon_systems_get_the_daemons(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\nhosts = 3\nrounds = 2\nsystems = {list(SYSTEMS)!r}\n'
                    f'[workload]\n{_TRACE}'.replace("'", '"'))
    _runs_until(monkeypatch, None, after=0, steps=30)
    result = run_scenario(load_scenario(path), say=lambda _: None)
    (cluster,) = _Cluster.built
    ran = cluster.runs
    assert cluster.daemons_on == [1, 2, 3]  # once, on every host, for all the rounds
    order = [REFERENCE, *SYSTEMS]
    assert [system for system, _, _ in ran] == order * 2
    for system, _, sockets in ran:
        want = ["gl1.sock", "gl2.sock", "gl3.sock"] if system in DAEMON_SYSTEMS else None
        assert sockets == want, system
    assert len({port for _, port, _ in ran}) == len(ran)  # each run its own rendezvous
    assert {s: len(r) for s, r in result["runs"].items()} == dict.fromkeys(order, 2)


def test_a_run_that_stops_before_any_run_keeps_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\nhosts = 2\n[workload]\n{_TRACE}')
    _runs_until(monkeypatch, KeyboardInterrupt(), after=0, steps=40)
    kept: list[dict[str, Any]] = []
    with pytest.raises(KeyboardInterrupt):
        run_scenario(load_scenario(path), say=lambda _: None, keep_partial=kept.append)
    assert kept == []


def test_bench_run_keeps_a_stopped_run_beside_the_result_until_a_complete_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nhosts = 2\nsteps = 30\nrounds = 1\n'
                    f'systems = ["ddp"]\n[workload]\n{_TRACE}')
    result, partial = tmp_path / "r.json", tmp_path / "r.partial.json"
    monkeypatch.setattr("gradlane.cli._require_root", lambda what: None)
    run = ["bench", "run", str(path), "--json", str(result)]

    _runs_until(monkeypatch, TestbedError("rank 1 exited with 1"), after=1, steps=30)
    shown = CliRunner().invoke(cli, run)
    assert shown.exit_code != 0 and not result.exists()
    # The log's lines as one, without the source locations rich adds where they wrap:
    said = " ".join(w for w in shown.output.split() if not re.fullmatch(r"\w+\.py:\d+", w))
    assert f"rank 1 exited with 1; what it measured before (1 run) is in {partial}" in said
    data = json.loads(partial.read_text())
    assert list(data["runs"]) == ["local"] and "commit" in json.dumps(data["environment"])
    # Neither drawn nor tabled as a result:
    shown = CliRunner().invoke(cli, ["bench", "plot", str(partial)])
    assert shown.exit_code == 1 and "no summary to plot" in shown.output
    shown = CliRunner().invoke(cli, ["bench", "table", str(partial)])
    assert shown.exit_code == 1 and "none of these is a result of" in shown.output

    _runs_until(monkeypatch, None, after=0, steps=30)
    shown = CliRunner().invoke(cli, run)
    assert shown.exit_code == 0, shown.output
    assert set(json.loads(result.read_text())["summary"]) == {"local", "ddp"}
    assert not partial.exists()  # superseded


@pytest.mark.parametrize("script", ["two_jobs", "co_located", "daemon"])
def test_a_cluster_benchmark_without_root_says_so_before_it_runs(
        script: str, tmp_path: Path) -> None:
    # Every script that builds an emulated cluster checks through bench/common.py: through
    # `record_cluster_run` (two_jobs), `owners_bench` (co_located) or itself (daemon).
    out = tmp_path / "result.json"
    as_a_user = ("import os, runpy, sys\nos.geteuid = lambda: 1000\n"
                 f"sys.argv = [{script!r}, '--json', {str(out)!r}]\n"
                 f"sys.path.insert(0, {str(REPO / 'bench')!r})\n"
                 f"runpy.run_path({str(REPO / 'bench' / (script + '.py'))!r}, "
                 "run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", as_a_user], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"bench/{script}.py needs root (it builds an emulated cluster): run it with sudo")
    assert not out.exists()


@pytest.mark.parametrize("model_mb, hosts, fits", [(10, 4, True), (600, 4, True),
                                                    (1000, 4, False), (1000, 2, True)])
def test_a_scenario_whose_workers_would_not_fit_in_memory_is_refused_before_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_mb: int, hosts: int,
        fits: bool) -> None:
    # A model_mb of 100,000 (a typo for 100) ran until the kernel's out-of-memory killer
    # ended a worker, or some other process of the machine.
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\nhosts = {hosts}\nsystems = ["ddp"]\n[workload]\n'
                    f'{_trace(model_mb=str(model_mb))}')
    scenario = load_scenario(path)
    started = _runs_until(monkeypatch, None, after=0, steps=30)
    monkeypatch.setattr(benchmark, "available_memory", lambda: 24 << 30)  # this machine's
    if fits:
        run_scenario(scenario, say=lambda _: None)
        assert started and _Cluster.built
        return
    _, size = compute_and_bytes(scenario)
    needed = hosts * (8 * size + (350 << 20))
    with pytest.raises(ConfigError, match=(
            f"^x: its {hosts} workers need about {needed / 2**30:.1f} GiB \\(a {size / 1e6:.0f} "
            r"MB model about 8 times over, each\), more than the 24.0 GiB this machine has "
            "available: lower workload.model_mb or hosts$")):
        run_scenario(scenario, say=lambda _: None)
    assert not started and not _Cluster.built  # nothing was built


def test_a_scenario_that_needs_exactly_the_memory_available_runs(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\nhosts = 4\nsystems = ["ddp"]\n[workload]\n{_trace()}')
    scenario = load_scenario(path)
    _, size = compute_and_bytes(scenario)
    needed = 4 * (8 * size + (350 << 20))
    benchmark.check_memory(scenario, size, needed)
    benchmark.check_memory(scenario, size, None)  # not known: not refused
    with pytest.raises(ConfigError, match="^x: its 4 workers need about"):
        benchmark.check_memory(scenario, size, needed - 1)


def test_the_memory_this_machine_has_available_is_read() -> None:
    available = benchmark.available_memory()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * \
        os.sysconf("SC_PHYS_PAGES")
