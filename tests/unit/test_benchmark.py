"""The bench harness's pure parts: scenario files, the lower bound, the README table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradlane.benchmark import (
    compute_and_bytes,
    load_scenario,
    lower_bound,
    markdown_table,
    summarize,
    worker_args,
)
from gradlane.cli import cli
from gradlane.errors import ConfigError

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "bench/scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_load(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert set(scenario.systems) == {"ddp", "fifo", "priority", "gradlane"}


@pytest.mark.parametrize(
    "text, key",
    [
        ('name = "x"\n[workload]\nkind = "gpu"\n', "workload.kind"),
        ('name = "x"\n[workload]\nkind = "trace"\nmodel = "alexnet"\n', "workload.model"),
        ('name = "x"\nsystems = ["ddp", "nccl"]\n[workload]\nkind = "cnn"\n', "systems"),
        ('name = "x"\nhosts = 99\n[workload]\nkind = "cnn"\n', "hosts"),
        ('name = "x"\nlayout = "tiny"\n[workload]\nkind = "cnn"\n', "layout"),
        ('hosts = 4\n[workload]\nkind = "cnn"\n', "name"),
        ('name = "x"\n[workload\n', "x.toml"),
    ],
)
def test_bad_scenarios_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_scenario(path)


def test_layout_reaches_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\nlayout = "coarse"\n[workload]\nkind = "cnn"\n')
    args = worker_args(load_scenario(path))
    assert args[args.index("--layout") + 1] == "coarse"
    path.write_text('name = "x"\n[workload]\nkind = "cnn"\n')
    args = worker_args(load_scenario(path))
    assert args[args.index("--layout") + 1] == "auto"


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


def test_trace_compute_is_three_times_the_forward() -> None:
    scenario = load_scenario(next(p for p in SCENARIOS if "vgg19" in p.name))
    compute, size = compute_and_bytes(scenario)
    assert compute == pytest.approx(3 * scenario.workload["forward_ms"] / 1000)
    assert size == pytest.approx(scenario.workload["model_mb"] * (1 << 20), rel=0.01)


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
    assert "| s1 | gradlane | 100.0 ms | 2.00x | 1.00 | - |" in table
    assert "commit abcdef1234" in table
    assert "no exchange" not in table  # no compute-alone reference in these results
    with_reference = result("s2")
    with_reference["summary"]["local"] = {"median_s": 0.1, "achieved_over_bound": 1.0}  # type: ignore[index]
    table = markdown_table([with_reference])
    assert "| s2 | local (no exchange) | 100.0 ms | - | 1.00 |" in table
    assert "its median is the compute of the bound" in table
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

    for rank, cores in enumerate((0.9, 0.4)):
        (tmp_path / f"gradlane-rank{rank}.json").write_text(
            json.dumps(
                {
                    "times": [0.1] * 10,
                    "losses": [1.0] * 10,
                    "waited": [0.0] * 10,
                    "cpu_cores": cores,
                }
            )
        )
    run = _collect("gradlane", tmp_path, 5.0)
    assert run.cpu_cores == [0.9, 0.4]
