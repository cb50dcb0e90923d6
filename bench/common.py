"""What the benchmarks share: the repository's root, the result writer, SIGTERM handling,
and the command line and scratch directory of the emulated-cluster runs."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradlane.provenance import write_result
from gradlane.signals import unwind_on_sigterm

__all__ = ["REPO", "cluster_args", "record_cluster_run", "unwind_on_sigterm", "write_result"]

REPO = Path(__file__).resolve().parents[1]


def cluster_args(doc: str, name: str, steps: int, steps_help: str | None = None
                 ) -> argparse.ArgumentParser:
    """The command line of a cluster benchmark `name`: ``--steps`` and ``--json``
    (default ``bench/results/<name>.json``); add to it before parsing."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--json", type=Path, default=REPO / f"bench/results/{name}.json")
    return ap


def record_cluster_run(name: str, path: Path, run: Callable[[Path], dict[str, Any]]
                       ) -> dict[str, Any]:
    """``run(workdir)`` in a scratch directory removed after it; its result written to
    `path` as benchmark `name` (`write_result`) and returned."""
    with tempfile.TemporaryDirectory(prefix=f"gradlane-{name}-") as tmp:
        result = run(Path(tmp))
    write_result(path, {"benchmark": name, **result})
    return result
