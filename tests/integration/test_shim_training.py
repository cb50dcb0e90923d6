"""The shim end to end: 4 worker processes over loopback TCP.

Every replica must end bit-identical to the others and match one process
trained on the concatenated batch; a dead peer must make the others raise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import gradlane.shim as gl
from gradlane import worker
from gradlane.policies.chunks import MIN_CHUNK_BYTES
from tests import shim_worker
from tests.forked import Forked
from tests.integration.helpers import (
    AgentStore,
    RunningDaemon,
    port_below_ephemeral,
    start_daemon,
)
from tests.shim_worker import reference

WORLD = 4


class Ranks(list[Forked]):
    """The ranks `launch` started, and the store they meet at (listening as long as this
    list is referenced)."""

    def __init__(self, procs: list[Forked], store: AgentStore) -> None:
        super().__init__(procs)
        self.store = store


def launch(
    out: Path, *args: str, world: int = WORLD, per_rank: dict[int, list[str]] | None = None,
    main: Callable[[Sequence[str]], None] = shim_worker.main,
) -> Ranks:
    """`world` ranks of `main` (`tests.shim_worker`'s by default; forked: `tests.forked`),
    each with its log."""
    store = AgentStore()
    procs = []
    for rank in range(world):
        env = {**os.environ, **store.env, "RANK": str(rank), "WORLD_SIZE": str(world),
               "OMP_NUM_THREADS": "1"}
        argv = ["--out", str(out), *args, *(per_rank or {}).get(rank, [])]
        procs.append(Forked(main, argv, env, out / f"rank{rank}.log"))
    return Ranks(procs, store)


def finish(procs: list[Forked], timeout: float = 90) -> list[tuple[int | None, str]]:
    """Each rank's exit code and output, once all have ended (bounded by `timeout`; those
    still running then are killed: code -9)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [(p.returncode, p.output()) for p in procs]


def report(procs: list[Forked]) -> str:
    """Why a test stopped waiting on ranks: each one's exit code and the end of its log
    (text, which pytest shows whole, where a list's repr is cut short)."""
    return "\n".join(f"--- rank {rank}, exit code {code}:\n{log[-3000:]}"
                     for rank, (code, log) in enumerate(finish(procs)))


def run_script(out: Path, text: str, envs: list[dict[str, str]], *args: str) -> list[str]:
    """`text` saved as a script in `out` and run once per environment of `envs` (added to
    this one's), given `out` and `args`; each run's output, once all exited 0 (each
    bounded: 90 s, then killed)."""
    (out / "train.py").write_text(text)
    procs = [subprocess.Popen([sys.executable, str(out / "train.py"), str(out), *args],
                              env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for env in envs]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=90)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    return outputs


def assert_replicas_equal(out: Path, world: int) -> None:
    """The states ranks saved as ``out/rank<R>.pt`` are bit for bit rank 0's."""
    states = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    for r in range(1, world):
        for name, value in states[0].items():
            assert torch.equal(value, states[r][name]), f"rank {r} differs in {name}"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# (optimizer, dtype, per-rank batches, lr schedule, worker flags, where the ranks are:
# "leaves" on two leaf switches, "hosts" two on each of two hosts, "both" on three hosts
# under two leaves, "" one host)
CASES = {
    "sgd-momentum-fp32": ("sgd", "float32", "4,4,4,4", False, (), ""),
    "adamw-fp64": ("adamw", "float64", "4,4,4,4", False, (), ""),
    "sgd-unequal-batches-lr-schedule": ("sgd", "float32", "3,5,2,6", True, (), ""),
    "adamw-fp64-unequal-no-overlap": ("adamw", "float64", "6,2,5,3", True, ("--no-overlap",),
                                      ""),
    "ddp-comm-hook-sgd-unequal": ("sgd", "float32", "3,5,2,6", True, ("--ddp-hook",), ""),
    # Ranks 0, 1 on one leaf and 2, 3 on another: reduced within each leaf first.
    "sgd-two-leaves-unequal": ("sgd", "float32", "3,5,2,6", True, (), "leaves"),
    "ddp-comm-hook-two-leaves": ("sgd", "float32", "3,5,2,6", True, ("--ddp-hook",), "leaves"),
    # Ranks 0, 1 listening on 127.0.0.1 and 2, 3 on 127.0.0.2, as if on two hosts: the
    # shims see it and reduce within each host first.
    "adamw-fp64-two-hosts-unequal": ("adamw", "float64", "6,2,5,3", True, (), "hosts"),
    "ddp-comm-hook-two-hosts": ("sgd", "float32", "3,5,2,6", True, ("--ddp-hook",), "hosts"),
    # Every rank listens on two loopback addresses, as on two NICs (one switch plane
    # each): chunks spread over the planes.
    "sgd-two-planes-unequal": ("sgd", "float32", "3,5,2,6", True, (), "planes"),
    "ddp-comm-hook-two-planes": ("sgd", "float32", "3,5,2,6", True, ("--ddp-hook",), "planes"),
    # Ranks 0, 1 on one host and 2 on another under leaf 0, rank 3 under leaf 1: within
    # hosts, then within leaves (trees up to three ranks deep).
    "sgd-hosts-in-leaves-unequal": ("sgd", "float32", "3,5,2,6", True, (), "both"),
    "ddp-comm-hook-hosts-in-leaves": ("sgd", "float32", "3,5,2,6", True, ("--ddp-hook",),
                                      "both"),
    # The default ("auto") sends every chunk around the ring of four ranks (partial sums
    # three hops deep); these send each part straight to the chunk's owner.
    "adamw-fp64-unequal-flat": ("adamw", "float64", "6,2,5,3", True, ("--exchange", "flat"),
                                ""),
    "ddp-comm-hook-flat": ("sgd", "float32", "3,5,2,6", True, ("--ddp-hook", "--exchange", "flat"),
                           ""),
    # Chunks as large as 1 MiB allowed: the hook takes `attach`'s fine chunk size for this
    # model, 64 KiB (`layout_sizes`), and cuts its one 159 KB bucket into three. (What the
    # size does to a large model's buckets, bench/README.md "Keeping DDP" measures.)
    "ddp-comm-hook-chunks-from-the-model": ("sgd", "float32", "3,5,2,6", True,
                                            ("--ddp-hook", "--chunk-bytes", str(1 << 20),
                                             "--hidden", "512"), ""),
    # Gradient accumulation: the hook's gradient hooks send nothing in backwards under
    # DDP's no_sync(), only the step's last (3 micro-batches; rank 2's 2 samples, 2).
    "ddp-comm-hook-no-sync": ("sgd", "float32", "3,5,2,6", True,
                              ("--ddp-hook", "--accumulate", "3"), ""),
    # A parameter no rank's backward reaches (find_unused_parameters=True): its bucket's
    # group goes when DDP calls the hook, with DDP's zeros for it.
    "ddp-comm-hook-unused-parameter": ("adamw", "float32", "3,5,2,6", True,
                                       ("--ddp-hook", "--unused"), ""),
    # DDP's options that change how its buckets and gradients are kept.
    "ddp-comm-hook-bucket-view": ("sgd", "float32", "3,5,2,6", True,
                                  ("--ddp-hook", "--ddp-option", "gradient_as_bucket_view"), ""),
    "ddp-comm-hook-static-graph": ("sgd", "float32", "3,5,2,6", True,
                                   ("--ddp-hook", "--ddp-option", "static_graph"), ""),
    # No `samples` set: the plain mean of the ranks' gradients, as DDP takes it (equal
    # batches, so the reference's weighted mean is the same).
    "ddp-comm-hook-no-samples": ("sgd", "float32", "4,4,4,4", True,
                                 ("--ddp-hook", "--no-samples"), ""),
    # DDP's buckets of at most 4 KB: the test CNN in several, each cut and sent on its own
    # (the one-bucket cases above would not see the hook confuse two buckets).
    "ddp-comm-hook-buckets": ("sgd", "float32", "3,5,2,6", True,
                              ("--ddp-hook", "--bucket-cap-mb", "0.004"), ""),
    # Rank 0 is advised, as by a control plan, that rank 3 owns every chunk: all ranks take
    # it at step 10 (`OWNERS_EVERY`) and regroup, and training stays exact.
    "ddp-comm-hook-plan-owners": ("sgd", "float32", "3,5,2,6", True,
                                  ("--ddp-hook", "--advise-owners", "3"), ""),
}
LEAVES = (0, 0, 1, 1)
PLACEMENTS = {  # per-rank flags, and what every rank says it reduces within first
    "leaves": ({r: ["--leaf", str(leaf)] for r, leaf in enumerate(LEAVES)},
               f"{LEAVES} hosts None leaf"),
    "hosts": ({r: ["--address", f"127.0.0.{1 + leaf}"] for r, leaf in enumerate(LEAVES)},
              f"None hosts {LEAVES} host"),
    "planes": ({r: ["--address", f"127.0.{r}.1,127.1.{r}.1"] for r in range(WORLD)},
               "None hosts None"),
    "both": ({r: ["--address", f"127.0.0.{1 + host}", "--leaf", str(leaf)]
              for r, (host, leaf) in enumerate(zip((0, 0, 1, 2), (0, 0, 0, 1), strict=True))},
             "(0, 0, 0, 1) hosts (0, 0, 1, 2) leaf"),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(CASES))
def test_replicas_identical_and_match_reference(tmp_path: Path, case: str) -> None:
    optimizer, dtype, batches, sched, flags, placement = CASES[case]
    args = ["--optimizer", optimizer, "--dtype", dtype, "--batches", batches, "--steps", "20"]
    args += ["--sched", *flags] if sched else [*flags]
    per_rank, groups = PLACEMENTS.get(placement, (None, "None hosts None"))
    results = finish(launch(tmp_path, *args, per_rank=per_rank))
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{log[-3000:]}"
        assert f"rank {rank} leaves {groups}" in log, log[-3000:]
        if "--chunk-bytes" in flags:
            cut = re.search(rf"rank {rank} hook chunk bytes {MIN_CHUNK_BYTES}, largest cut (\d+)",
                            log)
            assert cut and int(cut.group(1)) <= MIN_CHUNK_BYTES, log[-3000:]
        if "--ddp-hook" in flags:
            # Once DDP's buckets settle (after its first step), groups go from their
            # parameters' gradient hooks, before DDP calls the hook for their bucket.
            assert f"rank {rank} early sends in step 0: 0" in log, log[-3000:]
            early = re.search(rf"rank {rank} hook chunk bytes .* early sends (\d+)", log)
            assert early and int(early.group(1)) > 0, log[-3000:]
            assert f"rank {rank} DDP freed before the group: True" in log, log[-3000:]
            buckets = re.search(rf"rank {rank} hook chunk bytes .* buckets (\d+)", log)
            assert buckets and (int(buckets.group(1)) > 1) == ("--bucket-cap-mb" in flags), \
                log[-3000:]
        if "--advise-owners" in flags:
            owned = re.search(r"owners taken at 10, owned \[0, 0, 0, (\d+)\]", log)
            assert owned and int(owned.group(1)) > 0, log[-3000:]
        elif "--ddp-hook" in flags:  # the hook's own owners: every rank reduces a part
            owned = re.search(rf"rank {rank} owners taken at None, owned \[([\d, ]+)\]", log)
            assert owned and min(int(b) for b in owned.group(1).split(",")) > 0, log[-3000:]
    if "--ddp-hook" not in flags:
        # 20 steps: the layout trial regrouped twice or once (at steps 9 and 16), the
        # same way on every rank, and the replicas still match (below).
        layouts = {re.search(r"layout (\w+) trial (\w+)", log).groups()  # type: ignore[union-attr]
                   for _, log in results}
        assert len(layouts) == 1 and next(iter(layouts))[0] == next(iter(layouts))[1], layouts
    assert_replicas_equal(tmp_path, WORLD)
    first = torch.load(tmp_path / "rank0.pt")
    hidden = int(flags[flags.index("--hidden") + 1]) if "--hidden" in flags else 32
    ref = reference(
        optimizer, getattr(torch, dtype), 20, [int(b) for b in batches.split(",")], sched, hidden
    )
    for name, value in ref.items():
        assert relative_error(first[name], value) <= 1e-5, name
        assert not torch.equal(
            value, reference(optimizer, getattr(torch, dtype), 0, [1], False, hidden)[name]
        ), f"{name} never trained"


def _rank_3_ends(tmp_path: Path, flags: tuple[str, ...], how: str, timeout: float
                 ) -> tuple[list[tuple[int | None, str]], float]:
    """Four ranks, rank 3 ending in step 5's backward as `how` says ("die": SIGKILL,
    "hang": SIGSTOP); the other ranks' exit codes and logs, and how long after rank 3
    ended they had all ended."""
    procs = launch(tmp_path, *flags, "--steps", "30", "--timeout", str(timeout),
                   per_rank={3: [f"--{how}-at", "5"]})
    try:
        deadline = time.monotonic() + 60
        while not (procs[3].poll() == -9 if how == "die" else _stopped(procs[3].pid)):
            assert procs[3].poll() in (None, -9) and time.monotonic() < deadline, \
                report(procs)
            time.sleep(0.05)
        ended = time.monotonic()
        # A hung rank is only waited out: the others take their timeout, give or take.
        bound = timeout * (4 if how == "hang" else 1) + 30
        return finish(procs[:3], timeout=bound), time.monotonic() - ended
    finally:
        if procs[3].poll() is None:
            procs[3].kill()
            procs[3].wait(timeout=10)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP): state T in /proc/PID/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


# What the survivors print: `attach`'s PeerLost, or DDP's error around the hook's.
RAISED = {
    # The step the survivor was in: 5, or still 4 where rank 3 died with a step-4 average
    # queued for it (a ring hop; seen once in a full CI run on a busy machine).
    "attach": ((), r"PeerLost: step [45]: rank 3 lost"),
    "ddp-hook": (("--ddp-hook",), r"PeerLost \(through DDP\): .*PeerLost: step [45]: rank 3 "
                                  r"lost"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(RAISED))
def test_a_sigkilled_peer_makes_the_others_raise_well_within_the_timeout(
    tmp_path: Path, path: str
) -> None:
    timeout = 20.0
    flags, raised = RAISED[path]
    # Rank 3 SIGKILLs itself in the backward pass of step 5, with its peers mid-iteration
    # (with the hook, their gradient hooks sending the step's first groups): the lost
    # connection says so, and a rank that hears it only from its peers' goodbyes (not
    # rank 3's neighbour on the ring) need not wait for silence either.
    results, elapsed = _rank_3_ends(tmp_path, flags, "die", timeout)
    for rank, (code, log) in enumerate(results):
        assert code == 3, f"rank {rank} should have raised PeerLost:\n{log[-2000:]}"
        assert re.search(raised, log), log[-2000:]
    print(f"the others raised {elapsed:.1f} s after rank 3 died")
    assert elapsed < timeout / 2


HUNG = {  # what the survivors print when rank 3 goes silent with its connections open
    # Step 5, or still 4 where rank 3 stopped with a step-4 average not yet sent (as in
    # RAISED; seen once in a full CI run on a busy machine).
    "attach": ((), r"PeerLost: step [45]: "),
    "ddp-hook": (("--ddp-hook",), r"PeerLost \(through DDP\): .*PeerLost: step [45]: "),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", sorted(HUNG))
def test_a_hung_peer_makes_the_others_raise_once_their_timeout_passes(
    tmp_path: Path, path: str
) -> None:
    # Rank 3 stops (SIGSTOP: a wedged process, a paused VM) in step 5's backward with every
    # connection open: nothing says it is gone, so the others raise after `timeout` s of
    # silence (with the hook, its watchdog fails DDP's futures), not never. On the ring
    # each rank waits on its predecessor, and all stalled at once: each asks its
    # predecessor (PING); rank 3 cannot answer, so rank 0 names it, and its goodbyes say
    # so to rank 1, which rank 0 answered and which waits on, and so on. Before, a rank
    # named its predecessor (alive, waiting too), or blamed rank 0 for leaving.
    timeout = 3.0
    flags, raised = HUNG[path]
    results, elapsed = _rank_3_ends(tmp_path, flags, "hang", timeout)
    said = []
    for rank, (code, log) in enumerate(results):
        assert code == 3, f"rank {rank} should have raised PeerLost:\n{log[-2000:]}"
        found = re.search(raised + r"(rank \d lost): ", log)
        assert found and "left (closed its shim" not in log, log[-2000:]
        said.append(found[1])
    assert said == ["rank 3 lost"] * 3, said
    print(f"the others raised {elapsed:.1f} s after rank 3 stopped, ranks 0-2 saying {said}")
    assert elapsed < timeout * 4


@pytest.mark.timeout(120)
def test_workers_register_with_the_daemon_and_survive_its_death(
    tmp_path: Path, daemon: RunningDaemon
) -> None:
    procs = launch(
        tmp_path,
        "--steps",
        "400",
        "--step-sleep",
        "0.02",
        "--batches",
        "3,5",
        "--daemon-socket",
        str(daemon.socket),
        world=2,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            jobs = daemon.status()["jobs"]
            workers = [w for j in jobs if j["name"] == "test" for w in j["workers"]]
            if len(workers) == 2 and all(w["chunk_events"] > 0 for w in workers):
                break
            assert all(p.poll() is None for p in procs), report(procs)
            assert time.monotonic() < deadline, jobs
            time.sleep(0.2)
        # One peer, 4 bands: 4 band connections per worker, each a registered flow.
        assert [w["flows"] for w in workers] == [4, 4]
        # How they reduce, said right after the welcome: two ranks are flat (no ring).
        assert [w["exchange"] for w in workers] == ["flat", "flat"]
        # The job's batch, agreed at the first step: what the control plane splits.
        assert [w["global_batch"] for w in workers] == [8, 8]
        daemon.proc.kill()
        daemon.proc.wait()
        # A new daemon on the same socket: the shims find it again by themselves.
        port = port_below_ephemeral()
        again = RunningDaemon(
            start_daemon(daemon.socket, f"127.0.0.1:{port}"),
            daemon.socket,
            f"http://127.0.0.1:{port}",
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError):
                    jobs = again.status()["jobs"]
                    if sum(len(j["workers"]) for j in jobs if j["name"] == "test") == 2:
                        break
                assert time.monotonic() < deadline, "the shims did not re-register"
                time.sleep(0.2)
        finally:
            again.proc.terminate()
            again.proc.wait(timeout=15)
            again.proc.stderr.close()  # type: ignore[union-attr]
    finally:
        results = finish(procs)
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{log[-3000:]}"
        assert f"rank {rank} step 399" in log
        assert "training goes on with the local priority order" in log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("samples", [True, False], ids=["samples", "no-samples"])
def test_ddp_hook_workers_register_with_the_daemon(
    tmp_path: Path, daemon: RunningDaemon, samples: bool
) -> None:
    procs = launch(tmp_path, "--ddp-hook", "--steps", "150", "--step-sleep", "0.02",
                   "--batches", "4,4,4", "--daemon-socket", str(daemon.socket),
                   *([] if samples else ["--no-samples"]), world=3)
    try:
        deadline = time.monotonic() + 60
        while True:
            jobs = daemon.status()["jobs"]
            workers = [w for j in jobs if j["name"] == "test" for w in j["workers"]]
            if len(workers) == 3 and all(w["chunk_events"] > 0 and w["last_timing"]
                                         for w in workers):
                break
            assert all(p.poll() is None for p in procs), report(procs)
            assert time.monotonic() < deadline, jobs
            time.sleep(0.2)
        # Two peers, 4 bands each; three ranks under one switch take the ring, and say so.
        assert [w["flows"] for w in workers] == [8, 8, 8]
        assert [w["exchange"] for w in workers] == ["ring"] * 3
        # Each step's compute (forward start to the last bucket) with its samples, which
        # the control plane turns into throughputs and batch shares.
        timings = [w["last_timing"] for w in workers]
        # Without `samples` the hook cannot count them: it says 0 (not known) and states
        # no global batch, so the control plane plans no batch shares from step rates.
        assert [t["samples"] for t in timings] == ([4, 4, 4] if samples else [0, 0, 0])
        assert [w["global_batch"] for w in workers] == ([12] * 3 if samples else [None] * 3)
        assert all(0 < t["compute_s"] < 5 and 0 <= t["comm_s"] < 5 for t in timings), timings
    finally:
        results = finish(procs)
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{log[-3000:]}"
        assert f"rank {rank} step 149" in log


_NEVER_CLOSED = """
import atexit, multiprocessing, multiprocessing.util, os, sys, time
from pathlib import Path
import torch
from torch import nn


def train(rank, out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 4))

    def save():  # the parameters as they are: state_dict() and the attached model's own
        # named_parameters() would apply a pending last step themselves, hiding whether
        # gradlane's exit handler did; nn.Module's reads them past gradlane.
        torch.save({name: p.detach().clone() for name, p in nn.Module.named_parameters(model)},
                   out / f"rank{rank}.pt")

    # After gradlane's own exit handler: registered before it (last in, first out); in a
    # multiprocessing child, which ends past the exit handlers, a finalizer ranked below.
    if multiprocessing.parent_process() is None:
        atexit.register(save)
    else:
        multiprocessing.util.Finalize(None, save, exitpriority=0)
    import gradlane.shim as gl

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = gl.attach(model, opt, rank=rank, daemon_socket="/nonexistent/gl.sock")
    for step in range(3):
        if rank == 1 and step == 2:
            time.sleep(1.0)  # rank 0 reaches its end before this backward
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if rank == 1:
        sync.flush()  # the averages rank 0 owns come from its exit, or never
    print("done", flush=True)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if sys.argv[2] == "fork":  # both ranks children of this process, started by fork
        ranks = [multiprocessing.get_context("fork").Process(target=train, args=(r, out))
                 for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(90)
        sys.exit(0 if all(p.exitcode == 0 for p in ranks) else 1)
    train(int(os.environ["RANK"]), out)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("started", ["processes", "fork"])
def test_a_script_that_never_closes_its_sync_still_gives_its_peers_the_last_step(
        tmp_path: Path, started: str) -> None:
    """``sync = gl.attach(...)`` and no ``close()``: as the script ends, gradlane closes
    it. Rank 0 ends before rank 1's last backward; without that, its threads went with
    it, the chunks it owns were never averaged, and rank 1's last step failed. Ranks
    run as processes of their own (torchrun's way) or as multiprocessing children
    started by fork, which end past the exit handlers."""
    store = AgentStore()
    ranks = [str(r) for r in range(2)] if started == "processes" else [""]
    envs = [{**store.env, "RANK": rank, "WORLD_SIZE": "2"} for rank in ranks]
    for output in run_script(tmp_path, _NEVER_CLOSED, envs, started):
        assert "lack step" not in output and "lost" not in output, output
    assert_replicas_equal(tmp_path, 2)


_ATTACHED_AGAIN = """
import os, sys, time
from pathlib import Path
import torch
from torch import nn
import gradlane.shim as gl

rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for attach in range(3):
    if rank == attach - 1:  # rank 0 comes last to the second rendezvous, rank 1 to the third
        time.sleep(1.0)
    sync = gl.attach(model, opt, daemon_socket="/nonexistent/gl.sock")
    for step in range(2):
        g = torch.Generator().manual_seed(10 * (2 * attach + step) + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    sync.close()
torch.save(model.state_dict(), Path(sys.argv[1]) / f"rank{rank}.pt")
"""


@pytest.mark.timeout(120)
def test_attaching_again_under_plain_environment_variables_meets_at_the_same_store(
        tmp_path: Path) -> None:
    """A script run by hand or by a batch system (RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set; no process group) attaches, closes and attaches again: rank 0's
    second store could not bind the port its first still held ("address already in use"),
    and its peers lost the first. Now every attach of the process meets at the first."""
    port = str(port_below_ephemeral())
    run_script(tmp_path, _ATTACHED_AGAIN, [
        {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for rank in range(2)])
    assert_replicas_equal(tmp_path, 2)


def restarted_main(argv: Sequence[str]) -> None:
    """A rank of `test_a_job_torchrun_restarts_...`: attempt 0's rank 1 dies at step 1."""
    out = Path(argv[0])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if attempt == 1 and rank == 0:
        time.sleep(1.0)  # rank 1 reaches the store first, where the first attempt's keys are
    with gl.attach(model, opt, daemon_socket="/nonexistent/gl.sock"):
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if attempt == 0 and rank == 1 and step == 1:
                os._exit(3)  # a worker dies: torchrun stops the others, starts them all again
    torch.save(model.state_dict(), out / f"rank{rank}.pt")


@pytest.mark.timeout(120)
def test_a_job_torchrun_restarts_after_a_worker_died_meets_again_and_trains(
        tmp_path: Path) -> None:
    """``torchrun --max-restarts``: the agent's store outlives the first attempt, whose keys
    name listeners gone since; each attempt meets under its own (TORCHELASTIC_RESTART_COUNT,
    which torchrun counts up). The second trains to the end, its replicas equal."""
    store = AgentStore()
    for attempt in range(2):
        procs = [Forked(restarted_main, [str(tmp_path)],
                        {**os.environ, **store.env, "RANK": str(rank), "WORLD_SIZE": "2",
                         "TORCHELASTIC_RESTART_COUNT": str(attempt), "OMP_NUM_THREADS": "1"},
                        tmp_path / f"attempt{attempt}-rank{rank}.log")
                 for rank in range(2)]
        codes = [code for code, _ in finish(procs, timeout=50)]
        assert codes == ([1, 3] if attempt == 0 else [0, 0]), report(procs)
    assert "rank 1 lost" in (tmp_path / "attempt0-rank0.log").read_text()
    assert_replicas_equal(tmp_path, 2)


@pytest.mark.timeout(120)
def test_mismatched_models_are_refused_at_attach_on_every_rank(tmp_path: Path) -> None:
    results = finish(launch(tmp_path, "--steps", "1", world=2, per_rank={1: ["--wider"]}))
    for rank, (code, log) in enumerate(results):
        assert code == 4, f"rank {rank}:\n{log[-2000:]}"
        assert "rank 1's model differs from rank 0's" in log and "[11, 32]" in log, log[-2000:]


@pytest.mark.timeout(120)
def test_the_bench_s_ddp_hook_system_trains_as_ddp_and_registers_with_the_daemon(
    tmp_path: Path, daemon: RunningDaemon
) -> None:
    """`gradlane.worker --system ddp-hook` (the bench's DDP with gradlane's comm hook):
    the job registers with gradlaned as the hook's, and trains as plain DDP does (the
    same model, data and averages: the same losses, up to the order of summation)."""
    losses = {}
    for system in ("ddp", "ddp-hook"):
        out = tmp_path / system
        out.mkdir()
        procs = launch(out, "--system", system, "--workload", "cnn", "--steps", "60",
                       "--daemon-socket", str(daemon.socket), "--job", "hooked", world=2,
                       main=worker.main)
        try:
            if system == "ddp-hook":  # while it trains: its ranks, as gradlaned sees them
                deadline = time.monotonic() + 60
                while True:
                    jobs = {j["name"]: j for j in daemon.status()["jobs"]}
                    workers = jobs.get("hooked", {}).get("workers", [])
                    if len(workers) == 2 and all(w["chunk_events"] > 0 for w in workers):
                        break
                    assert all(p.poll() is None for p in procs), report(procs)
                    assert time.monotonic() < deadline, jobs
                    time.sleep(0.1)
                # Two ranks exchange flat; each says how many samples it trains on.
                assert [w["exchange"] for w in workers] == ["flat", "flat"]
                assert [w["global_batch"] for w in workers] == [2 * 32] * 2
        finally:
            results = finish(procs)
        for rank, (code, log) in enumerate(results):
            assert code == 0, f"{system} rank {rank} failed:\n{log[-3000:]}"
        ranks = [json.loads((out / f"{system}-rank{r}.json").read_text()) for r in range(2)]
        losses[system] = [r["losses"] for r in ranks]
    assert ranks[0]["exchange"] == "flat"
    for rank in range(2):
        assert losses["ddp-hook"][rank] == pytest.approx(losses["ddp"][rank], rel=1e-4)
    first, last = losses["ddp"][0][:10], losses["ddp"][0][-10:]
    assert sum(last) < sum(first)  # it trained: a hook that averaged nothing would differ
