"""Result files record where they were measured; "dirty" means code differed from the commit."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
from pathlib import Path

import pytest

from gradlane import provenance


def _git(repo: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(repo), *argv], check=True, capture_output=True)


def _repo(repo: Path, files: tuple[str, ...]) -> None:
    """A git repository at `repo` with `files` (each holding "1") in one commit."""
    for name in files:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")


def test_only_code_changes_make_a_run_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    repo = tmp_path / "repo"
    _repo(repo, ("README.md", "code.py", "bench/results/r.json"))
    monkeypatch.setattr(provenance, "REPO", repo)
    assert provenance.environment()["dirty"] is False
    # Prose and the results this very run rewrites do not count.
    (repo / "README.md").write_text("2\n")
    (repo / "bench" / "results" / "r.json").write_text("2\n")
    (repo / "bench" / "results" / "new.json").write_text("2\n")
    assert provenance.environment()["dirty"] is False
    (repo / "code.py").write_text("2\n")
    assert provenance.environment()["dirty"] is True
    (repo / "code.py").write_text("1\n")
    (repo / "new.py").write_text("2\n")  # an untracked source file counts too
    assert provenance.environment()["dirty"] is True


def test_a_run_records_the_checkout_it_started_from(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A long run writes its results at the end: a commit or an edit made meanwhile must
    not pass for the code that ran."""
    repo = tmp_path / "repo"
    _repo(repo, ("code.py",))
    monkeypatch.setattr(provenance, "REPO", repo)
    monkeypatch.setattr(provenance, "_started", {})
    provenance.start()
    first = provenance.environment()["commit"]
    assert "checkout_changed_during_run" not in provenance.environment()
    (repo / "code.py").write_text("2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "second")
    env = provenance.environment()
    assert env["commit"] == first and env["dirty"] is False
    assert env["checkout_changed_during_run"] is True


def test_a_result_file_holds_the_result_and_where_it_was_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    _repo(repo, ("code.py",))
    monkeypatch.setattr(provenance, "REPO", repo)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    path = tmp_path / "results" / "new" / "r.json"  # directories made as needed
    for figure in (1.5, 2.5):  # written again over the first
        provenance.write_result(path, {"figure": figure})
    text = path.read_text()
    assert text.endswith("}\n")
    result = json.loads(text)
    env = result.pop("environment")
    assert result == {"figure": 2.5}
    assert env["commit"] == head and env["dirty"] is False
    assert env["torch"] == importlib.metadata.version("torch")
    named = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    if named:  # x86 names its CPU there
        assert env["cpu"] == named.group(1).strip()
