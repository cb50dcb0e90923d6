"""The control plane's first plan of one large job: time and memory by the job's ranks.

    .venv/bin/python bench/control_big_job.py [--ranks 1024 ... 65536] [--per-host 8]
                                              [--per-leaf 32] [--links equal mixed]
                                              [--fabric one-switch oversubscribed]
                                              [--json PATH]

For each size, a fresh process builds a control plane (the default policy)
and hands it what the daemons of one job would report: ``--per-host`` ranks
on each host, ``--per-leaf`` hosts a leaf (32), 64 chunks of 1 MiB, and 10 Gbit/s links
(``equal``) or every fourth host's at 25 (``mixed``: owner shares to weigh,
not even ones). It then
makes the state and the plan twice, as the planner does: the first plan
builds its chunk owners' reduction trees and solves its owner shares, which later
plans take from caches while the placement holds, so the first is what a
control plane's restart, or a job's start, costs. Recorded per size: both
plans' seconds (state, then policy), the process's peak resident memory
and what it keeps after the plans, the state's flows, the share of the
chunks the plan gives every fourth host's ranks (a quarter with equal links,
more with mixed ones), and per doubling of the ranks how much the first
plan's time and the peak memory grew. And one push of the plan: every
daemon's plan message built and encoded (JSON), as the control plane's
event loop does each second, not sent: bytes and seconds (the median of
three) for daemons that take ``rank_shares`` (their own ranks' batch
shares) and, in the same run, for older daemons (every rank's), with the
ratios.

The fabric is one switch (``one-switch``: the job reduces within hosts
first, the exchange such jobs use) or leaves of 32 hosts under a spine at
2:1 (``oversubscribed``: the plan has the shims reduce within leaves first,
and the reports say so, as from a job's second plan on). Within hosts
first, owner shares weigh every host as an owner (ranks of one host load
the links alike there), with the load its chunks put on every host's links
(`gradlane.policies.demand.Exchange.link_loads`), so time and memory grow
with the square of the hosts (64 bytes per host squared, about twice what
8,192 hosts of 8 ranks took; with one rank a host at one rate, shares are
even with no loads built, and the estimate is far over). Within leaves too,
ranks numbered host by host as here: 128 bytes per host squared (8,192
hosts with mixed links took 6.6 GB). A size whose estimated peak would not
fit in MemAvailable is skipped, said so in its result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, write_result  # noqa: E402

from gradlane.benchmark import available_memory  # noqa: E402

RANKS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)  # to the protocol's most
PER_HOST = 8
LINKS = ("equal", "mixed")
FABRICS = ("one-switch", "oversubscribed")
HOSTS_PER_LEAF = 32
CHUNKS = 64
LINK_BPS = 10**10
# Peak bytes per host squared, from this benchmark's own results (8,192 hosts: 2.4 GB
# within hosts first; 6.6 GB within leaves, mixed links).
PEAK_BYTES_PER_HOST2 = {"one-switch": 64, "oversubscribed": 128}
PUSHES = 3  # a push's time: the median of so many


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"/proc/self/status has no {field}")


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _peak_mb() -> float:
    return _status_mb("VmHWM")  # the resident high-water mark, kept with VmRSS


def _plane(ranks: int, per_host: int, mixed: bool = False, oversubscribed: bool = False,
           per_leaf: int = HOSTS_PER_LEAF) -> Any:
    """A control plane holding the reports of one job of `ranks`, `per_host` a host (with
    `mixed`, every fourth host's link 2.5 times the others'; `oversubscribed`, leaves'
    uplinks at half their hosts' links, and the job reducing within leaves first),
    `per_leaf` hosts a leaf."""
    from gradlane.daemon import control
    from gradlane.daemon import control_protocol as cp

    uplink = per_leaf * LINK_BPS // 2 if oversubscribed else None
    plane = control.ControlPlane(control.ControlConfig(token="bench-token-0123456789abcdef",
                                                       uplink_bps=uplink))
    for h in range(ranks // per_host):
        register = cp.parse_register({
            "type": "register", "version": 1, "host": f"h{h:05d}",
            "leaf": h // per_leaf, "gradlane": "bench",
            "interfaces": [{"name": "eth0", "rate_bps": 25 * 10**9 if mixed and h % 4 == 0
                            else LINK_BPS}]})
        job = {"name": "big", "global_batch": 16 * ranks, "layers": CHUNKS,
               "chunk_bytes": [1 << 20] * CHUNKS, "chunk_layers": list(range(CHUNKS)),
               "world_size": ranks, "exchange": "leaf" if oversubscribed else "host",
               "workers": [{"rank": h * per_host + k, "throughput": 100.0, "batch": 16}
                           for k in range(per_host)]}
        report = cp.parse_report({"type": "report", "seq": 1, "jobs": [job]})
        plane.daemons[register.host] = control._Daemon(register, report, ws=None)
    return plane


def _push(plane: Any, takes: bool) -> dict[str, Any]:
    """One push of `plane`'s plan, as `ControlPlane.push` makes it on its event loop: every
    daemon's message built and encoded (JSON, as gradlaned speaks), not sent. With `takes`
    the daemons say they take ``rank_shares`` (gradlaned since 75e3d13), else they are
    older daemons, sent every rank's batch shares."""
    from dataclasses import replace

    from gradlane.daemon import control_protocol as cp

    takes_fields = frozenset(cp.PLAN_FIELDS) if takes else frozenset()
    for daemon in plane.daemons.values():
        daemon.report = replace(daemon.report, takes=takes_fields)
    times = []
    for _ in range(PUSHES):
        started = time.perf_counter()
        sizes = [len(cp.fit(plane.message_for(host), binary=False)[0])
                 for host in plane.daemons]
        times.append(time.perf_counter() - started)
    if takes:  # each daemon its own ranks' shares, and no one else's
        for host, daemon in plane.daemons.items():
            message = plane.message_for(host)
            ranks = {w.rank for job in daemon.report.jobs for w in job.workers}
            sent = {r for pairs in message["rank_shares"].values() for r, _ in pairs}
            if sent != ranks or message["batch_shares"]:
                raise SystemExit(f"{host}: the plan message has the shares of ranks "
                                 f"{sorted(sent)[:8]}, not its own")
    return {"seconds": statistics.median(times), "bytes": sum(sizes), "largest_bytes": max(sizes),
            "over_max_message": sum(size > cp.MAX_MESSAGE for size in sizes)}


def one(ranks: int, per_host: int, mixed: bool, oversubscribed: bool,
        per_leaf: int) -> dict[str, Any]:
    """Plan one job of `ranks` in this process: what `main` records for its size."""
    from gradlane.policies.loadbalance import load_solver

    load_solver()  # as `gradlane control` does once listening: not a plan's cost
    warm = _plane(2 * per_host, per_host)  # nor the planner's imports; a job of another
    warm.policy.plan(warm.build_state())   # shape leaves nothing the measured one can use
    plane = _plane(ranks, per_host, mixed, oversubscribed, per_leaf)
    before_mb = _rss_mb()
    plans = []
    for _ in range(2):
        started = time.perf_counter()
        state = plane.build_state()
        built = time.perf_counter()
        plan = plane.policy.plan(state)
        done = time.perf_counter()
        plane.state, plane.plan = state, plan
        plans.append({"state_s": built - started, "policy_s": done - built,
                      "total_s": done - started})
    push = {"takes_rank_shares": _push(plane, takes=True),
            "older_daemons": _push(plane, takes=False)}
    push["bytes_x"] = push["older_daemons"]["bytes"] / push["takes_rank_shares"]["bytes"]
    push["seconds_x"] = push["older_daemons"]["seconds"] / push["takes_rank_shares"]["seconds"]
    owners = plan.ownership.get("big", ())
    on_fast = sum((owner // per_host) % 4 == 0 for owner in owners)  # mixed: the 25G hosts
    return {"ranks": ranks, "hosts": ranks // per_host, "flows": len(state.flows),
            "owners_planned": len(owners) == CHUNKS, "reduce_in_leaf": plan.reduce_in_leaf,
            "chunks_on_every_fourth_host": on_fast / max(len(owners), 1),
            "first_plan": plans[0], "next_plan": plans[1], "push": push,
            "rss_before_plans_mb": before_mb, "peak_rss_mb": _peak_mb(),
            "rss_after_mb": _rss_mb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=list(RANKS),
                    help="job sizes, each a multiple of --per-host (default: %(default)s)")
    ap.add_argument("--per-host", type=int, default=PER_HOST, help="ranks a host")
    ap.add_argument("--per-leaf", type=int, default=HOSTS_PER_LEAF,
                    help="hosts a leaf switch (default: %(default)s)")
    ap.add_argument("--links", nargs="+", choices=LINKS, default=list(LINKS),
                    help="equal links, mixed ones, or both (default: %(default)s)")
    ap.add_argument("--fabric", nargs="+", choices=FABRICS, default=list(FABRICS),
                    help="one switch (the job reduces within hosts first), leaves under "
                         "a 2:1 spine (within leaves first), or both (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/control_big_job.json",
                    help="result file (default: %(default)s)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one size
    args = ap.parse_args()
    if args.per_host < 1 or args.per_leaf < 1:
        ap.error("--per-host and --per-leaf must be at least 1")
    bad = [r for r in args.ranks if r < 2 * args.per_host or r % args.per_host]
    if bad:
        ap.error(f"--ranks {bad}: each must be a multiple of --per-host "
                 f"({args.per_host}) and span two hosts at least")
    if args.one is not None:
        print(json.dumps(one(args.one, args.per_host, args.links == ["mixed"],
                             args.fabric == ["oversubscribed"], args.per_leaf)))
        return
    write_result(args.json, {"benchmark": "control_big_job", "per_host": args.per_host,
                             "hosts_per_leaf": args.per_leaf, "chunks": CHUNKS,
                             "policy": "gradlane",
                             "fabrics": {fabric: {links: _sizes(args, fabric, links)
                                                  for links in args.links}
                                         for fabric in args.fabric}})
    print(f"-> {args.json}")


def _sizes(args: argparse.Namespace, fabric: str, links: str) -> list[dict[str, Any]]:
    """Each size of `args.ranks` planned on `fabric` with `links` in a process of its own."""
    sizes: list[dict[str, Any]] = []
    what = f"{fabric}, {links} links"
    for ranks in sorted(set(args.ranks)):
        need = PEAK_BYTES_PER_HOST2[fabric] * (ranks // args.per_host) ** 2
        available = available_memory()
        if available is not None and need > available:
            print(f"{what}, {ranks:6d} ranks: skipped, needs about "
                  f"{need / 2**30:.1f} GiB", flush=True)
            sizes.append({"ranks": ranks, "skipped": f"needs about {need / 2**30:.1f} GiB"})
            continue
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(ranks), "--per-host", str(args.per_host),
             "--ranks", str(ranks), "--links", links, "--fabric", fabric,
             "--per-leaf", str(args.per_leaf)],
            capture_output=True, text=True, check=False, timeout=1800)
        if out.returncode:
            raise SystemExit(f"{ranks} ranks failed (exit {out.returncode}):\n{out.stderr}")
        size = json.loads(out.stdout)
        if not size["owners_planned"]:
            raise SystemExit(f"{ranks} ranks: the plan has no chunk owners for the job")
        if size["reduce_in_leaf"] != (fabric == "oversubscribed"):
            raise SystemExit(f"{ranks} ranks on {fabric}: the plan has reduce_in_leaf "
                             f"{size['reduce_in_leaf']}")
        sizes.append(size)
        print(f"{what}, {ranks:6d} ranks: first plan "
              f"{size['first_plan']['total_s']:6.2f} s, "
              f"next {size['next_plan']['total_s']:5.2f} s, "
              f"peak {size['peak_rss_mb']:6.0f} MB, "
              f"{size['chunks_on_every_fourth_host']:.0%} of the chunks on every fourth host; "
              f"a push {size['push']['takes_rank_shares']['bytes'] / 1e6:.1f} MB in "
              f"{size['push']['takes_rank_shares']['seconds']:.2f} s "
              f"({size['push']['older_daemons']['bytes'] / 1e6:.1f} MB in "
              f"{size['push']['older_daemons']['seconds']:.2f} s to older daemons)",
              flush=True)
    measured = [s for s in sizes if "skipped" not in s]
    for small, large in zip(measured, measured[1:], strict=False):
        if large["ranks"] == 2 * small["ranks"]:
            large["doubling"] = {
                "first_plan_x": large["first_plan"]["total_s"] / small["first_plan"]["total_s"],
                "peak_rss_x": large["peak_rss_mb"] / small["peak_rss_mb"]}
    return sizes


if __name__ == "__main__":
    main()
