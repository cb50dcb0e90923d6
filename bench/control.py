"""The control plane under 200 daemons: plan push latency, CPU and memory.

    .venv/bin/python bench/control.py [--daemons 200] [--seconds 15] [--json PATH]

Starts `gradlane control` as its own process on loopback (a fresh token in a
temporary file), then connects `--daemons` lightweight simulated daemons
from this process, each holding a WebSocket like gradlaned: it registers,
reports 4 workers of one of 25 jobs (8 hosts per job, workers of unequal
throughput) once a second, saying it takes its own ranks' batch shares as
gradlaned does, and receives plans. Push latency is, per plan
message, the receive time minus the plan's `computed_at` (same clock: one
machine). Also, per daemon, the time from when the daemons start connecting to
its first plan with its job's chunk owners (all connect at once, as after a
control plane's restart). Over the measured window the control plane's CPU (user + system,
from /proc), its resident memory and its mean time per plan (each job's
demand flows built from the reports, then the policy: its own
``gradlane_control_plan_seconds`` histogram) are recorded. The simulated daemons
share this 2-core machine with the control plane, so the latency includes
their own event loop's delay: an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, write_result  # noqa: E402

TARGET_MS = 100.0
MIN_WINDOW_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _daemon(i: int, url: str, token: str, stop: float, lat: list[float],
                  ready: asyncio.Event, connected: list[int], total: int,
                  owned_at: list[float], started: float) -> None:
    job, first_rank = f"job{i // 8}", (i % 8) * 4
    register = {"type": "register", "version": 1, "host": f"sim{i:03d}", "leaf": i // 32,
                "gradlane": "bench", "interfaces": [{"name": "eth0", "rate_bps": 25 * 10**9}]}
    report = {"type": "report", "seq": 0, "jobs": [{
        "name": job, "global_batch": 32 * 32, "layers": 16, "chunk_bytes": [1 << 20] * 64,
        "workers": [{"rank": first_rank + k, "throughput": 100.0 + 10 * ((i + k) % 5),
                     "batch": 32} for k in range(4)]}]}
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"{url}/api/v1/daemon", headers=headers) as ws:
        await ws.send_json(register)
        welcome = await ws.receive_json()
        if "takes" in welcome.get("features", ()):  # as gradlaned: its own ranks' shares
            report["takes"] = ["rank_shares"]
        connected.append(i)
        if len(connected) == total:
            ready.set()
        await ws.send_json(report)
        next_report = time.monotonic() + 1.0
        owned = False
        while time.time() < stop:
            try:
                async with asyncio.timeout(max(0.01, next_report - time.monotonic())):
                    msg = await ws.receive()
            except TimeoutError:
                report["seq"] += 1
                await ws.send_json(report)
                next_report = time.monotonic() + 1.0
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"daemon {i}: connection ended: {msg.type}")
            data = json.loads(msg.data)
            if data["type"] == "plan" and not owned and job in data["ownership"]:
                owned = True  # its job's first full plan: every rank reported, owners set
                shares = data.get("rank_shares", {}).get(job, [])
                if "takes" in report and {r for r, _ in shares} != set(range(first_rank,
                                                                              first_rank + 4)):
                    raise RuntimeError(f"daemon {i}: its plan has the shares of {shares}")
                owned_at.append(time.monotonic() - started)
            if data["type"] == "plan" and data["computed_at"] and ready.is_set():
                lat.append((time.time() - data["computed_at"]) * 1000)


async def _get(url: str, token: str, path: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(
            f"{url}{path}", headers={"Authorization": f"Bearer {token}"}) as response:
        response.raise_for_status()
        return await response.text()


async def _planning(url: str, token: str) -> tuple[float, float]:
    """The control plane's plan-time histogram so far: (seconds summed, plans)."""
    text = await _get(url, token, "/metrics")
    found = {s.name: s.value for family in text_string_to_metric_families(text)
             for s in family.samples if s.name.startswith("gradlane_control_plan_seconds")}
    return found["gradlane_control_plan_seconds_sum"], found["gradlane_control_plan_seconds_count"]


async def _run(args: argparse.Namespace, url: str, token: str, pid: int) -> dict[str, Any]:
    lat: list[float] = []
    owned_at: list[float] = []
    ready, connected = asyncio.Event(), []
    stop = time.time() + args.seconds + 30
    started = time.monotonic()
    tasks = [asyncio.create_task(_daemon(i, url, token, stop, lat, ready, connected,
                                         args.daemons, owned_at, started))
             for i in range(args.daemons)]
    async with asyncio.timeout(30):
        await ready.wait()
    all_connected = time.monotonic() - started
    lat.clear()
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    planned0 = await _planning(url, token)
    await asyncio.sleep(args.seconds)
    cpu, wall = _cpu_s(pid) - cpu0, time.monotonic() - t0
    planned = await _planning(url, token)
    rss = _rss_mb(pid)
    view = json.loads(await _get(url, token, "/api/v1/cluster"))
    samples = sorted(lat)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if not samples:
        raise SystemExit("no plan arrived during the window")
    if len(owned_at) < args.daemons:
        raise SystemExit(f"{args.daemons - len(owned_at)} daemons never had their job's "
                         "chunk owners in a plan")
    owned_at.sort()
    return {
        "daemons": args.daemons,
        "seconds": wall,
        "plans_received": len(samples),
        "push_latency_ms": {
            "median": statistics.median(samples),
            "p90": samples[int(0.9 * (len(samples) - 1))],
            "max": samples[-1],
        },
        "median_over_target": statistics.median(samples) / TARGET_MS,
        # From when the daemons start connecting (as after a control plane's restart, all at
        # once) to each daemon's first plan with its job's chunk owners (every rank of the
        # job reported): median and last.
        "owners_after_connect_s": {"median": statistics.median(owned_at),
                                   "max": owned_at[-1]},
        "all_connected_s": all_connected,  # the last daemon welcomed
        "target_ms": TARGET_MS,
        "control_cpu_cores": cpu / wall,
        "control_rss_mb": rss,
        # Planning (from the control plane's own histogram over the window): each
        # job's demand flows built from the reports, then the policy.
        "plans_computed": planned[1] - planned0[1],
        "plan_ms_mean": 1000 * (planned[0] - planned0[0]) / max(1.0, planned[1] - planned0[1]),
        "jobs_with_demand": sum(1 for j in view["jobs"].values() if j.get("demand_bytes")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemons", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=15.0,
                    help=f"the measured window (at least {MIN_WINDOW_S:g} s)")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/control.json")
    args = ap.parse_args()
    if args.daemons < 1:
        ap.error("--daemons must be at least 1")
    if args.seconds < MIN_WINDOW_S:
        # Daemons that connected together report together, so plans come a cadence (1 s)
        # plus react_s and the plan's own time apart: a 1 s window can fall between two.
        ap.error(f"--seconds must be at least {MIN_WINDOW_S:g}: two plan cadences, or the "
                 "window may see no plan")
    token = secrets.token_hex(16)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        gradlane = Path(sys.executable).parent / "gradlane"
        log = (Path(tmp) / "control.log").open("w")  # shown only when something fails
        proc = subprocess.Popen([str(gradlane), "control", "--listen", f"127.0.0.1:{port}",
                                 "--token-file", str(token_file), "--cadence", "1"],
                                stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            result = asyncio.run(_run(args, url, token, proc.pid))
        except BaseException:
            log.flush()
            sys.stderr.write((Path(tmp) / "control.log").read_text()[-4000:])
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()
    write_result(args.json, {"benchmark": "control", **result})
    lat = result["push_latency_ms"]
    print(f"{args.daemons} daemons: push latency median {lat['median']:.1f} ms, "
          f"p90 {lat['p90']:.1f} ms; {result['plans_computed']:.0f} plans "
          f"({result['jobs_with_demand']} jobs' demand), {result['plan_ms_mean']:.1f} ms each; "
          f"control plane {result['control_cpu_cores']:.2f} cores, "
          f"{result['control_rss_mb']:.0f} MB; every daemon had its job's owners "
          f"{result['owners_after_connect_s']['max']:.2f} s after connecting "
          f"-> {args.json}")


if __name__ == "__main__":
    main()
