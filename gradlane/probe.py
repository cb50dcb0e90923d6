"""``gradlane probe``: do the bands' DSCP marks survive the path between two hosts?

gradlaned's HTB orders the bands on each host by connection, whatever the
marks; the switches between hosts order them only by DSCP, and a network that
re-marks (bleaches) DSCP at some hop silently takes that away. `serve` runs on
one host; `probe` on another sends a few UDP datagrams per band, each carrying
the band's DSCP, and the server answers each with the TOS byte it received,
in a datagram marked with the same DSCP, so both directions are seen:

    gradlane probe --serve                 # on host A (UDP 7801)
    gradlane probe 10.0.0.5                # on host B

A reply is one byte longer than its request (nothing to amplify); datagrams
without the magic are ignored. IPv4, as gradlane's transport.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_PORT", "BandResult", "probe", "serve", "tos_of"]

DEFAULT_PORT = 7801
_REQUEST = struct.Struct("<4sBBIQd")  # magic, band, dscp, seq, nonce, sent (monotonic)
_REPLY = struct.Struct("<4sBBIQdB")  # the request's fields, then the TOS it arrived with
_ASK, _ANSWER = b"GLPQ", b"GLPA"
_TOS_SPACE = socket.CMSG_SPACE(1)


@dataclass
class BandResult:
    """What came of one band's datagrams: the DSCP each was sent with, the DSCP the peer
    saw on each (there), the DSCP each reply arrived with (back), round trips."""

    band: int
    dscp: int
    sent: int = 0
    there: list[int] = field(default_factory=list)
    back: list[int] = field(default_factory=list)
    rtt_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every datagram answered, its mark intact both ways."""
        return (len(self.there) == self.sent > 0
                and all(d == self.dscp for d in self.there + self.back))

    def summary(self) -> str:
        if not self.there:
            return f"no answer to {self.sent} datagrams"
        parts = [f"{len(self.there)} of {self.sent} answered",
                 _marks("there", self.there, self.dscp), _marks("back", self.back, self.dscp),
                 f"round trip {statistics.median(self.rtt_s) * 1000:.2f} ms"]
        return ", ".join(parts)


def _marks(way: str, seen: list[int], dscp: int) -> str:
    changed = sorted({d for d in seen if d != dscp})
    if not changed:
        return f"{way} DSCP {dscp} kept"
    return f"{way} DSCP {dscp} arrived as {', '.join(map(str, changed))} (re-marked)"


def tos_of(ancillary: Sequence[tuple[int, int, bytes]]) -> int | None:
    """The TOS byte a datagram arrived with (IP_RECVTOS's ancillary data), or None."""
    for level, kind, data in ancillary:
        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and data:
            return data[0]
    return None


def _socket(bind: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        sock.bind(bind)
    except OSError:
        sock.close()
        raise
    return sock


def _receive(sock: socket.socket, shape: struct.Struct, wait_s: float
             ) -> tuple[tuple[Any, ...], int, tuple[str, int]] | None:
    """The next datagram of `shape` within `wait_s` (its fields, the TOS it arrived with,
    its sender), or None: nothing came, or something else did."""
    if not select.select([sock], [], [], wait_s)[0]:
        return None
    data, ancillary, _, sender = sock.recvmsg(shape.size + 1, _TOS_SPACE)
    tos = tos_of(ancillary)
    if len(data) != shape.size or tos is None:
        return None
    return shape.unpack(data), tos, sender


def serve(address: tuple[str, int] = ("0.0.0.0", DEFAULT_PORT), seconds: float | None = None,
          ready: Callable[[], object] | None = None, stop: threading.Event | None = None
          ) -> int:
    """Answer probes on `address` until `seconds` are over (None: until interrupted) or
    `stop` is set; returns how many were answered. `ready` is called once bound."""
    answered = 0
    deadline = None if seconds is None else time.monotonic() + seconds
    with _socket(address) as sock:
        if ready is not None:
            ready()
        while ((deadline is None or time.monotonic() < deadline)
               and not (stop is not None and stop.is_set())):
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            got = _receive(sock, _REQUEST, wait)
            if got is None:
                continue
            (magic, band, dscp, seq, nonce, sent), tos, peer = got
            if magic != _ASK or dscp > 63:
                continue
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
            sock.sendto(_REPLY.pack(_ANSWER, band, dscp, seq, nonce, sent, tos), peer)
            answered += 1
    return answered


def probe(peer: tuple[str, int], bands: Sequence[int], count: int = 5,
          timeout_s: float = 1.0) -> list[BandResult]:
    """Send `count` datagrams per band (band b marked ``bands[b]``) to a `serve` at `peer`
    and collect the answers that come within `timeout_s` of the last datagram."""
    results = [BandResult(b, dscp) for b, dscp in enumerate(bands)]
    nonce = int.from_bytes(os.urandom(8), "little")
    with _socket(("0.0.0.0", 0)) as sock:
        for seq in range(count):
            for r in results:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, r.dscp << 2)
                sock.sendto(_REQUEST.pack(_ASK, r.band, r.dscp, seq, nonce, time.monotonic()),
                            peer)
                r.sent += 1
        expected = count * len(results)
        deadline = time.monotonic() + timeout_s
        answered: set[tuple[int, int]] = set()  # (band, seq): a duplicate counts once
        while len(answered) < expected and (left := deadline - time.monotonic()) > 0:
            got = _receive(sock, _REPLY, left)
            if got is None:
                continue
            (magic, band, _, seq, their_nonce, sent, seen), tos, _ = got
            if (magic != _ANSWER or their_nonce != nonce or band >= len(results)
                    or (band, seq) in answered):
                continue
            answered.add((band, seq))
            r = results[band]
            r.there.append(seen >> 2)
            r.back.append(tos >> 2)
            r.rtt_s.append(time.monotonic() - sent)
    return results
