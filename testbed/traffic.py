"""A bounded traffic tool: DSCP-marked TCP bulk flows with goodput measured at the receiver.

Command line (run inside a host, e.g. via ``gradlane testbed run``)::

    python -m gradlane.testbed.traffic recv --port 5201 --flows 2 [--timeout 60]
    python -m gradlane.testbed.traffic send --to 10.200.0.2 --port 5201 \\
        --dscp 46 --label high (--seconds 4 | --bytes 100000000)

The receiver prints ``READY`` once listening, then one JSON document when all
expected flows have closed: per flow its label, DSCP, byte count, first and
last byte times and a time series of cumulative bytes (CLOCK_MONOTONIC, the
same clock in every namespace). Everything is bounded: a sender stops after
its bytes or seconds, a receiver after its timeout.

From Python, `run_flows` starts receivers and senders in a `Cluster` and
returns `FlowResult`s; `window_goodputs` gives each flow's goodput over the
interval in which all of them were running, `steady_goodputs` the rate each held
there (the median over short slices, which a stalled process does not move).
"""

from __future__ import annotations

import argparse
import itertools
import json
import selectors
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradlane.errors import TestbedError

if TYPE_CHECKING:
    from gradlane.testbed.cluster import Cluster

__all__ = ["Flow", "FlowResult", "run_flows", "steady_goodputs", "window_goodputs"]

DEFAULT_PORT = 5201
MAX_SECONDS = 3600  # of any wait or flow: every run of the tool is bounded
MAX_BYTES = 1 << 40
SAMPLE_EVERY = 0.02
_CHUNK = 256 * 1024


@dataclass(frozen=True)
class Flow:
    """A bulk TCP flow from `src` to `dst` (hosts as "h1" or 1), sized by seconds or bytes."""

    src: str | int
    dst: str | int
    dscp: int = 0
    seconds: float | None = None
    nbytes: int | None = None
    label: str = ""
    nic: int = 0
    delay: float = 0.0  # seconds after the other flows start

    def __post_init__(self) -> None:
        if not 0 <= self.delay <= 60:
            raise TestbedError(f"flow {self.label!r}: delay must be in 0..60 s, got {self.delay}")
        if (self.seconds is None) == (self.nbytes is None):
            raise TestbedError(f"flow {self.label!r}: give exactly one of seconds and nbytes")
        if not 0 <= self.dscp < 64:
            raise TestbedError(f"flow {self.label!r}: DSCP must be in 0..63, got {self.dscp}")
        if self.seconds is not None and not 0 < self.seconds <= MAX_SECONDS:
            raise TestbedError(f"flow {self.label!r}: seconds must be in (0, {MAX_SECONDS}], "
                               f"got {self.seconds}")
        if self.nbytes is not None and not 1 <= self.nbytes <= MAX_BYTES:
            raise TestbedError(f"flow {self.label!r}: nbytes must be in 1..{MAX_BYTES}, "
                               f"got {self.nbytes}")


@dataclass(frozen=True)
class FlowResult:
    """What the receiver saw of one flow."""

    label: str
    dscp: int
    bytes: int
    first: float
    last: float
    samples: tuple[tuple[float, int], ...]

    @property
    def goodput_bps(self) -> float:
        """Payload bits per second from first to last byte."""
        return self.bytes * 8 / max(self.last - self.first, 1e-9)

    @property
    def seconds(self) -> float:
        return self.last - self.first

    def bytes_at(self, t: float) -> float:
        """Cumulative bytes received at time `t` (linear between samples)."""
        samples = self.samples
        if t <= samples[0][0]:
            return 0.0 if t < samples[0][0] else float(samples[0][1])
        for (t0, b0), (t1, b1) in zip(samples, samples[1:], strict=False):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-12)
        return float(samples[-1][1])

    def goodput_between(self, start: float, end: float) -> float:
        if end <= start:
            raise TestbedError(f"empty measurement window [{start}, {end}]")
        return (self.bytes_at(end) - self.bytes_at(start)) * 8 / (end - start)


def _common_window(results: Sequence[FlowResult], skip: float) -> tuple[float, float]:
    start = max(r.first for r in results) + skip
    end = min(r.last for r in results) - skip
    if end - start < 0.5:
        raise TestbedError(
            f"flows overlapped for only {end - start + 2 * skip:.2f}s: too short to measure"
        )
    return start, end


def window_goodputs(results: Sequence[FlowResult], skip: float = 0.5) -> list[float]:
    """Each flow's goodput while all flows ran, `skip` seconds trimmed at both ends."""
    start, end = _common_window(results, skip)
    return [r.goodput_between(start, end) for r in results]


def steady_goodputs(
    results: Sequence[FlowResult], skip: float = 0.5, slice_s: float = 0.25
) -> list[float]:
    """Each flow's median goodput over `slice_s`-second slices of the window of
    `window_goodputs`: the rate it held.

    Both ends of a flow are processes on a shared machine; one stalled for a tenth of a
    second lowers a flow's mean over a 2-second window by 5% while the link had nothing
    to carry, and the next slice catches up. The median tells what the link and its
    qdiscs gave while the ends kept up."""
    start, end = _common_window(results, skip)
    slices = max(1, round((end - start) / slice_s))
    edges = [start + (end - start) * i / slices for i in range(slices + 1)]
    return [
        statistics.median(r.goodput_between(a, b) for a, b in itertools.pairwise(edges))
        for r in results
    ]


def run_flows(
    cluster: Cluster, flows: Sequence[Flow], *, port: int = DEFAULT_PORT, timeout: float = 60
) -> list[FlowResult]:
    """Run `flows` at once in `cluster`; return their results in the same order.

    One receiver per destination host; all senders start together once every
    receiver listens. Bounded by `timeout` seconds overall.
    """
    if not 0 < timeout <= MAX_SECONDS:
        raise TestbedError(f"timeout must be in (0, {MAX_SECONDS}] s, got {timeout}")
    labels = [f.label or f"flow{i}" for i, f in enumerate(flows)]
    if len(set(labels)) != len(labels):
        raise TestbedError(f"flow labels must be unique, got {labels}")
    by_dst: dict[tuple[int, int], int] = {}
    for flow in flows:
        key = (cluster.host_index(flow.dst), flow.nic)
        by_dst[key] = by_dst.get(key, 0) + 1
    tool = [sys.executable, "-m", "gradlane.testbed.traffic"]
    deadline = time.monotonic() + timeout
    receivers = {}
    senders = []
    try:
        for (dst, nic), count in by_dst.items():
            argv = [*tool, "recv", "--bind", cluster.addr(dst, nic), "--port", str(port)]
            argv += ["--flows", str(count), "--timeout", str(timeout)]
            proc = cluster.popen(dst, argv, stdout=subprocess.PIPE, text=True)
            receivers[(dst, nic)] = proc
        for (dst, _nic), proc in receivers.items():
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()  # bounded by the receiver's own timeout
            if line != "READY":
                raise TestbedError(f"receiver in h{dst} did not start (said {line!r})")
        for flow, label in zip(flows, labels, strict=True):
            argv = [*tool, "send", "--to", cluster.addr(flow.dst, flow.nic), "--port", str(port)]
            argv += ["--dscp", str(flow.dscp), "--label", label, "--delay", str(flow.delay)]
            if flow.seconds is not None:
                argv += ["--seconds", str(flow.seconds)]
            else:
                argv += ["--bytes", str(flow.nbytes)]
            senders.append(cluster.popen(flow.src, argv, stdout=subprocess.PIPE, text=True))
        for proc in senders:
            _wait(proc, deadline, "sender")
        found: dict[str, FlowResult] = {}
        for (dst, _), proc in receivers.items():
            out = _wait(proc, deadline, f"receiver in h{dst}")
            for item in json.loads(out)["flows"]:
                found[item["label"]] = FlowResult(
                    label=item["label"],
                    dscp=item["dscp"],
                    bytes=item["bytes"],
                    first=item["first"],
                    last=item["last"],
                    samples=tuple((t, b) for t, b in item["samples"]),
                )
    finally:
        for proc in [*senders, *receivers.values()]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    missing = [label for label in labels if label not in found]
    if missing:
        raise TestbedError(f"no result for flows {missing}")
    return [found[label] for label in labels]


def _wait(proc: subprocess.Popen[str], deadline: float, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise TestbedError(f"{what} did not finish in time") from None
    if proc.returncode != 0:
        raise TestbedError(f"{what} failed with exit code {proc.returncode}: {out.strip()[-500:]}")
    return out


# -- the processes -----------------------------------------------------------


def _send(args: argparse.Namespace) -> dict[str, Any]:
    time.sleep(args.delay)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, args.dscp << 2)
    deadline = time.monotonic() + args.connect_timeout
    while True:
        try:
            sock.connect((args.to, args.port))
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.settimeout(30)  # a stalled network ends the sender instead of hanging it
    header = json.dumps({"label": args.label, "dscp": args.dscp}).encode() + b"\n"
    sock.sendall(header)
    payload = memoryview(bytearray(_CHUNK))
    sent = 0
    start = time.monotonic()
    end = start + args.seconds if args.seconds is not None else None
    limit = args.bytes if args.bytes is not None else None
    while True:
        if end is not None and time.monotonic() >= end:
            break
        if limit is not None:
            if sent >= limit:
                break
            sent += sock.send(payload[: min(_CHUNK, limit - sent)])
        else:
            sent += sock.send(payload)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the receiver to close: all bytes arrived
    sock.close()
    return {"label": args.label, "bytes": sent, "seconds": time.monotonic() - start}


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.header = b""
        self.meta: dict[str, Any] | None = None
        self.bytes = 0
        self.first = 0.0
        self.last = 0.0
        self.samples: list[tuple[float, int]] = []


def _recv(args: argparse.Namespace) -> dict[str, Any]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.bind, args.port))
    listener.listen(args.flows)
    listener.setblocking(False)
    print("READY", flush=True)
    deadline = time.monotonic() + args.timeout
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    buf = memoryview(bytearray(_CHUNK))
    accepted = 0
    done: list[_Conn] = []
    while len(done) < args.flows:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SystemExit(f"receiver timed out with {len(done)}/{args.flows} flows done")
        for key, _ in sel.select(timeout=min(remaining, 1.0)):
            if key.data is None:
                sock, _ = listener.accept()
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_READ, _Conn(sock))
                accepted += 1
                if accepted == args.flows:
                    sel.unregister(listener)
                continue
            conn: _Conn = key.data
            n = conn.sock.recv_into(buf)
            now = time.monotonic()
            if n == 0:
                sel.unregister(conn.sock)
                conn.sock.close()
                conn.samples.append((conn.last, conn.bytes))
                done.append(conn)
                continue
            if conn.meta is None:
                conn.header += bytes(buf[:n])
                if b"\n" not in conn.header:
                    continue
                line, rest = conn.header.split(b"\n", 1)
                conn.meta = json.loads(line)
                n = len(rest)
                conn.first = now
                conn.samples.append((now, 0))
            conn.bytes += n
            conn.last = now
            if now - conn.samples[-1][0] >= SAMPLE_EVERY:
                conn.samples.append((now, conn.bytes))
    listener.close()
    return {
        "flows": [
            {
                "label": c.meta["label"] if c.meta else "",
                "dscp": c.meta["dscp"] if c.meta else 0,
                "bytes": c.bytes,
                "first": c.first,
                "last": c.last,
                "samples": c.samples,
            }
            for c in done
        ]
    }


def _within(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], Any]:
    """An argparse type: a `kind` in low..high (finite: every run of this tool is bounded)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:  # also refuses nan, and inf beyond a finite high
            raise argparse.ArgumentTypeError(f"must be in {kind(low)}..{kind(high)}, got {text}")
        return value
    return parse


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gradlane.testbed.traffic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    port = _within(int, 1, 65535)
    seconds = _within(float, 0, MAX_SECONDS)
    send = sub.add_parser("send", help="send one bulk flow")
    send.add_argument("--to", required=True, help="the receiver's address")
    send.add_argument("--port", type=port, default=DEFAULT_PORT, help="the receiver's port")
    send.add_argument("--dscp", type=_within(int, 0, 63), default=0,
                      help="the DSCP code point to mark the flow with")
    send.add_argument("--label", default="", help="the flow's name in the receiver's report")
    size = send.add_mutually_exclusive_group(required=True)
    size.add_argument("--seconds", type=seconds, help="send for this long")
    size.add_argument("--bytes", type=_within(int, 1, MAX_BYTES), help="send this many bytes")
    send.add_argument("--delay", type=seconds, default=0.0,
                      help="wait this long before connecting")
    send.add_argument("--connect-timeout", type=seconds, default=10,
                      help="give up connecting after this long")
    recv = sub.add_parser("recv", help="receive flows and report them")
    recv.add_argument("--bind", default="0.0.0.0", help="the address to listen on")
    recv.add_argument("--port", type=port, default=DEFAULT_PORT, help="the port to listen on")
    recv.add_argument("--flows", type=_within(int, 1, 1024), default=1,
                      help="report once this many flows have ended")
    recv.add_argument("--timeout", type=seconds, default=60,
                      help="give up (exit 1) after this long")
    args = parser.parse_args(argv)
    result = _send(args) if args.cmd == "send" else _recv(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
