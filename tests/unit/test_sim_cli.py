"""`gradlane sim`: one command writes the JSON and the figure."""

import json
from pathlib import Path

from click.testing import CliRunner

from gradlane.cli import cli


def test_sim_heterogeneous_writes_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "het.json"
    result = CliRunner().invoke(cli, ["sim", "heterogeneous", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["experiment"] == "heterogeneous" and "environment" in data
    assert set(data["results"]) == {"fifo", "priority", "straggler", "gradlane"}
    assert data["over_ideal"]["straggler"] <= 1.1
    assert out.with_suffix(".png").stat().st_size > 0
    assert "ideal" in result.output


def test_sim_validate_without_results_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["sim", "validate", "--results", str(tmp_path),
                                      "--json", str(tmp_path / "v.json")])
    assert result.exit_code != 0
    assert "no trace-scenario results" in result.output


def test_sim_unknown_policy_is_an_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["sim", "heterogeneous", "--policy", "nope",
                                      "--json", str(tmp_path / "x.json")])
    assert result.exit_code != 0
    assert "unknown policy 'nope'" in result.output
