"""Result files record where they were measured; "dirty" means code differed from the commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gradlane import provenance


def _git(repo: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(repo), *argv], check=True, capture_output=True)


def test_only_code_changes_make_a_run_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    for name in ("README.md", "code.py", "bench/results/r.json"):
        (repo / name).write_text("1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
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
