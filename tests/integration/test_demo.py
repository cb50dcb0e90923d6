"""`gradlane demo` end to end, small: it must run, report and draw.

The speed claims belong to the full-size demo and the benchmarks; here the
run is short (2 hosts, 15 steps), so only what must hold at any size is
checked: both systems trained the same model to the same loss, the report
and the figure exist, the bands carried the gradlane run's bytes. Without
root the demo says so and runs both systems on loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_demo_runs_both_systems_and_writes_table_figure_and_json(tmp_path: Path) -> None:
    png, raw = tmp_path / "demo.png", tmp_path / "demo.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradlane.cli",
            "demo",
            "--hosts",
            "2",
            "--steps",
            "15",
            "--png",
            str(png),
            "--json",
            str(raw),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PyTorch DDP" in out.stdout and "gradlane" in out.stdout
    result = json.loads(raw.read_text())
    assert result["final_loss_relative_gap"] < 0.01
    assert result["loss_curve_max_relative_gap"] < 0.01  # same seed, same batches: same curve
    assert result["environment"]["commit"] and result["environment"]["kernel"]
    for system in ("ddp", "gradlane"):
        run = result["systems"][system]
        assert len(run["iteration_s"]) == 15
        assert run["wire_bytes"] > 0
    assert any(max(result["band_usage_h1"][f"band{b}"]) > 0 for b in range(4))
    assert png.stat().st_size > 10_000


@pytest.mark.timeout(200)
def test_demo_without_root_runs_both_systems_on_loopback(tmp_path: Path) -> None:
    png, raw = tmp_path / "demo.png", tmp_path / "demo.json"
    argv = ["gradlane", "demo", "--hosts", "2", "--steps", "10", "--png", str(png),
            "--json", str(raw)]
    as_a_user = ("import os, sys\nos.geteuid = lambda: 1000  # what a user without root sees\n"
                 f"sys.argv = {argv!r}\nfrom gradlane.cli import main\nmain()")
    out = subprocess.run([sys.executable, "-c", as_a_user], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert "not root" in said and "loopback" in said and "[yellow]" not in said
    result = json.loads(raw.read_text())
    assert result["link_bps"] is None  # no traffic control
    assert result["final_loss_relative_gap"] < 0.01
    for system in ("ddp", "gradlane"):
        run = result["systems"][system]
        assert len(run["iteration_s"]) == 10
        assert run["machine_cpu"] is None or 0 < run["machine_cpu"]["busy"] <= 1
    # gradlane's wait for averages, and of it what the slowest worker's compute held
    # back; DDP's cannot be timed. Every rank's raw series are kept.
    waits = result["systems"]["gradlane"]
    assert len(waits["exposed_s"]) == 10 and result["systems"]["ddp"]["exposed_s"] == []
    assert all(0 <= s <= e for s, e in zip(waits["slowest_compute_s"], waits["exposed_s"],
                                            strict=True))
    assert [len(r["backward_ends"]) for r in waits["rank_steps"]] == [10] * 2  # --hosts 2
    # Each system is what it is named: DDP's workers never wait in a forward for averages
    # (its wait is inside backward), the shim's do.
    assert all(w == 0.0 for r in result["systems"]["ddp"]["rank_steps"] for w in r["waited"])
    assert any(w > 0.0 for r in waits["rank_steps"] for w in r["waited"])
    assert "waiting for averages:" in out.stdout
    assert png.stat().st_size > 10_000
