"""What the benchmarks share: the repository's root, the result writer, SIGTERM and SIGHUP
handling, and the command line and scratch directory of the emulated-cluster runs."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gradlane.provenance import start, write_result
from gradlane.signals import unwind_on_signals

start()  # a benchmark imports this first: the checkout its results come from

__all__ = ["REPO", "cluster_args", "owners_bench", "record_cluster_run",
           "require_cluster_privileges", "run_ranks", "unwind_on_signals", "write_result"]

REPO = Path(__file__).resolve().parents[1]


def cluster_args(doc: str, name: str, steps: int, steps_help: str | None = None
                 ) -> argparse.ArgumentParser:
    """The command line of a cluster benchmark `name`: ``--steps`` and ``--json``
    (default ``bench/results/<name>.json``); add to it before parsing."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--json", type=Path, default=REPO / f"bench/results/{name}.json")
    return ap


Popen = Callable[..., "subprocess.Popen[str]"]


def run_ranks(argv: list[str], hosts: Sequence[tuple[str, Popen]], timeout_s: float = 900
              ) -> list[str]:
    """Run `argv` once per rank, ``--rank i --address a`` added, `hosts` giving each
    rank's (address, popen function: e.g. `gradlane.testbed.Cluster.popen` in its
    host); returns their outputs, or exits with the first failed rank's error."""
    procs = [popen([*argv, "--rank", str(rank), "--address", address], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)
             for rank, (address, popen) in enumerate(hosts)]
    outs = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout_s)
        if p.returncode:
            raise SystemExit(f"rank {rank} failed ({p.returncode}):\n{err[-3000:]}")
        outs.append(out)
    return outs


def require_cluster_privileges(what: str) -> None:
    """Exit, saying what is missing, if this process cannot build an emulated cluster
    (`gradlane.testbed.netns.missing_privileges`): before a run, not from inside it."""
    from gradlane.testbed.netns import missing_privileges

    missing = missing_privileges()
    if missing:
        fix = "run it with sudo" if missing == "root" else "in a container, run it privileged"
        raise SystemExit(f"{what} needs {missing} (it builds an emulated cluster): {fix}")


def record_cluster_run(name: str, path: Path, run: Callable[[Path], dict[str, Any]]
                       ) -> dict[str, Any]:
    """``run(workdir)`` in a scratch directory removed after it; its result written to
    `path` as benchmark `name` (`write_result`) and returned."""
    require_cluster_privileges(f"bench/{name}.py")
    with tempfile.TemporaryDirectory(prefix=f"gradlane-{name}-") as tmp:
        result = run(Path(tmp))
    write_result(path, {"benchmark": name, **result})
    return result


def owners_bench(doc: str, name: str, run: Callable[..., dict[str, Any]]) -> None:
    """The command line of a `gradlane.control_runs.run_planned_owners` benchmark `name`:
    ``run(workdir, steps, say=print, reference=True)``, recorded, then one line per run."""
    args = cluster_args(doc, name, 60).parse_args()
    result = record_cluster_run(name, args.json, lambda workdir: run(
        workdir, args.steps, say=print, reference=True))
    without, with_control = result["without_control"], result["with_control"]
    print(f"median iteration {without['median_s'] * 1000:.1f} ms with owned bytes "
          f"{without['owned_bytes']}, {with_control['median_s'] * 1000:.1f} ms with the "
          f"plan's {with_control['owned_bytes']} (taken at step "
          f"{with_control['owners_taken_at'][0]}): {result['speedup']:.2f}x; bound "
          f"{result['lower_bound_s'] * 1000:.1f} ms -> {args.json}")
    for label, also in result.get("also", {}).items():
        print(f"{label} ({also['exchange']}): median iteration {also['median_s'] * 1000:.1f} ms")
