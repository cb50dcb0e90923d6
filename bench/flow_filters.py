"""Benchmark what classifying costs the data path: registered flows and the pure-ACK filters.

    sudo .venv/bin/python bench/flow_filters.py --json bench/results/flow_filters.json

gradlaned classifies every registered band connection (a TCP 5-tuple) into
its job's band leaf with u32. It keeps them in one filter, a 256-bucket hash
table on the destination port (`gradlane.daemon.qdisc`); before, each flow
had a filter priority of its own, and every packet is tried against one
priority after the other. This script builds a 2-host emulated cluster (no
link shaping to speak of: 40 Gbit/s links, so the CPU is the limit), installs
gradlane's tree on h1 with N registered flows from h1 to h2, and sends one
TCP stream from h1 to h2 that none of them claims (DSCP-marked: every flow
filter is tried, then the DSCP fallback takes it), measuring its goodput. Per
N, the layouts alternate in the same run, `--rounds` times each: `hashed` is
what `QdiscManager.apply` installs, `per-priority` the same tree with the
flows added as the manager used to (one u32 filter per priority, from 0x100
up; the kernel refuses the 2,048th priority, so that layout is measured only
for N up to 2,000), `no-acks` the installed tree without its 11 pure-ACK
filters (one a TCP header length, tried before the flows on every packet:
what the ACK class 474c:3 costs a data packet). N past 2,000 is `hashed` and
`no-acks`: a worker registers up to 8,192 band connections
(`gradlane.daemon.protocol.MAX_FLOWS`), and a host of 8 workers of a job of
1,018 hosts up to 65,536. Each N's goodput is also given over that with none
(N = 0, in the same run), and how long `apply` took to install the flows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import require_cluster_privileges, unwind_on_signals, write_result  # noqa: E402

LINK = "40gbit"
OLD_FLOW_PREFS = 0x100  # where the manager used to put the first flow's priority
LAYOUTS = ("hashed", "per-priority", "no-acks")
MAX_PER_PRIORITY = 2000  # the kernel's filter priorities a qdisc (2,047), with room
MAX_N = 65536  # 8 workers of MAX_FLOWS each
PORTS = 17000  # destination ports 30000, 30002, ... 63998


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/flow_filters.json")
    parser.add_argument("--flows", default="0,500,1000,1500,2000,8192,32768,65536",
                        help="the Ns, comma-separated (per-priority up to 2,000)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0, help="each stream's length")
    args = parser.parse_args()
    counts = [int(n) for n in args.flows.split(",")]
    if any(not 0 <= n <= MAX_N for n in counts) or args.rounds < 1 or args.seconds < 2:
        sys.exit(f"--flows in 0..{MAX_N}, --rounds >= 1, --seconds >= 2")
    require_cluster_privileges("bench/flow_filters.py")

    from pyroute2 import IPRoute

    from gradlane.daemon import FlowMatch, JobSpec, QdiscManager, QdiscSpec
    from gradlane.daemon.qdisc import ACK_PREF_BASE, ACK_WORDS, ROOT
    from gradlane.daemon.tc import ETH_P_IP, filter_info, u32_key_strings
    from gradlane.testbed import Cluster, Topology
    from gradlane.testbed.traffic import Flow, run_flows, window_goodputs
    from gradlane.units import parse_rate

    rate = parse_rate(LINK)
    runs: dict[str, dict[str, list[float]]] = {str(n): {k: [] for k in LAYOUTS} for n in counts}
    apply_s: dict[str, list[float]] = {str(n): [] for n in counts}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Topology.build("bflt", 2, LINK)) as c:
        h1, h2 = c.addr("h1"), c.addr("h2")

        def spec(flows: tuple[FlowMatch, ...]) -> QdiscSpec:
            job = JobSpec("bench", rate // 2, rate, flows=flows)
            return QdiscSpec(rate_bps=rate, other_rate_bps=rate // 100, jobs=(job,),
                             dscp_job="bench")  # fmt: skip

        with (
            QdiscManager("eth0", netns=c.ns("h1"), state_file=Path(tmp) / "q.json") as qm,
            IPRoute(netns=c.ns("h1"), flags=0) as ipr,
        ):
            index = ipr.link_lookup(ifname="eth0")[0]
            try:
                for n in counts:
                    flows = tuple(
                        # Destination ports spread over the buckets, each 5-tuple its own.
                        FlowMatch(band=i % 4, src=h1, sport=20000 + i // PORTS, dst=h2,
                                  dport=30000 + 2 * (i % PORTS))
                        for i in range(n)
                    )
                    layouts = [k for k in LAYOUTS if n <= MAX_PER_PRIORITY or k != "per-priority"]
                    for r in range(args.rounds):
                        for layout in layouts if r % 2 == 0 else layouts[::-1]:
                            if layout == "hashed":
                                started = time.perf_counter()
                                qm.apply(spec(flows), verify=True)  # drops the priorities
                                apply_s[str(n)].append(time.perf_counter() - started)
                            elif layout == "no-acks":  # the next `apply` puts them back
                                qm.apply(spec(flows), verify=True)
                                for words in ACK_WORDS:
                                    ipr.tc("del-filter", index=index, parent=ROOT,
                                           info=filter_info(ACK_PREF_BASE + words))
                            else:
                                qm.apply(spec(()), verify=True)
                                for i, flow in enumerate(flows):
                                    ipr.tc("add-filter", "u32", index, parent=ROOT,
                                           prio=OLD_FLOW_PREFS + i, protocol=ETH_P_IP,
                                           target=qm.leaf_classid("bench", flow.band),
                                           keys=u32_key_strings(flow.keys()))  # fmt: skip
                            stream = Flow("h1", "h2", dscp=46, seconds=args.seconds, label="s")
                            (goodput,) = window_goodputs(run_flows(c, [stream]))
                            runs[str(n)][layout].append(goodput)
                            print(f"{n:5d} flows, {layout:12s}: {goodput / 1e9:6.2f} Gbit/s",
                                  flush=True)  # fmt: skip
                            if layout == "per-priority":
                                for i in range(n):
                                    ipr.tc("del-filter", index=index, parent=ROOT,
                                           info=filter_info(OLD_FLOW_PREFS + i))  # fmt: skip
            finally:
                qm.restore()
    results: dict[str, Any] = {}
    for n in counts:
        medians = {k: statistics.median(v) for k, v in runs[str(n)].items() if v}
        results[str(n)] = {
            "goodput_bps": {k: v for k, v in runs[str(n)].items() if v},
            "median_goodput_bps": medians,
            "hashed_over_per_priority": (medians["hashed"] / medians["per-priority"]
                                         if "per-priority" in medians else None),
            "hashed_apply_s": apply_s[str(n)],
            "hashed_over_no_acks": medians["hashed"] / medians["no-acks"],
        }
    if 0 in counts:
        none = results["0"]["median_goodput_bps"]["hashed"]
        for row in results.values():
            row["hashed_over_none"] = row["median_goodput_bps"]["hashed"] / none
    write_result(
        args.json,
        {
            "benchmark": "one unclaimed TCP stream's goodput with N registered flows: "
            "hashed (gradlane's layout) vs a u32 filter priority per flow and vs the "
            "same tree without its pure-ACK filters, same run",
            "config": {"link": LINK, "rounds": args.rounds, "seconds": args.seconds,
                       "flows": counts},  # fmt: skip
            "results": results,
        },
    )
    for n in counts:
        row = results[str(n)]
        line = (f"{n:5d} flows: hashed {row['median_goodput_bps']['hashed'] / 1e9:.2f} Gbit/s "
                f"(installed in {statistics.median(row['hashed_apply_s']):.2f} s), without the "
                f"ACK filters {row['median_goodput_bps']['no-acks'] / 1e9:.2f} "
                f"({row['hashed_over_no_acks']:.3f}x)")
        if row["hashed_over_per_priority"] is not None:
            line += (f", per-priority {row['median_goodput_bps']['per-priority'] / 1e9:.2f} "
                     f"({row['hashed_over_per_priority']:.2f}x)")
        print(line)
    print(f"-> {args.json}")


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's cluster, as Ctrl-C does
    main()
