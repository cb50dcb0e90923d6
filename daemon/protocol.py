"""The shim <-> gradlaned protocol, for both sides.

Transport: a Unix stream socket (default ``/run/gradlane/gradlaned.sock``).
Framing: a 4-byte big-endian length, then that many bytes of msgpack holding
one map with string keys and a ``"type"``. Frames over `MAX_FRAME` bytes are
refused before they are buffered.

Conversation (client = a training process's shim)::

    client                                   daemon
    hello {version, job, rank, world_size,   -> welcome {version, worker, bands,
           flows[, exchange, global_batch]}              leaf, host, nics, features}
    flows {flows[, exchange, global_batch,   (replace the band connections; say how the
           flows_left_out, left_out_from]}   job reduces, its global batch, and how many
                                             connections it did not register, from where)
    chunks {iteration, events}               (batched, no reply)
    timing {iteration, compute_s, comm_s, samples}
                                             <- plan {version, bands, batch_share, ...}
    bye                                      -> connection closed

A flow is one band connection: ``{"band", "src", "sport", "dst", "dport"}``
(IPv4, TCP). A chunk event is ``[layer, nbytes, band, t]`` with t the
sender's clock in seconds. A band past the daemon's last (a shim with more
bands than the daemon has, whose hello goes before it hears how many; or one
that has not heard of a reload yet) counts as the last, as the shim's own
connections are mapped once it knows (`parse`). The welcome's ``host`` is an
opaque name of the daemon's host (`gradlane.daemon.service.host_id`; absent
from an older daemon): workers told the same one share a host, whatever
their addresses. Its ``nics`` lists ``[address, bit/s]``: each address of the
interfaces it shapes and the rate it shapes that interface to (absent from an
older daemon); a shim listening on several addresses, one per NIC, spreads its
chunks over them by these rates. ``exchange`` says how the
job's ranks agreed to reduce: ``"leaf"`` within leaves first (each rank told
its leaf, e.g. by the welcome's ``leaf``), ``"ring"`` around the ring of
ranks, ``"host"`` within hosts first (ranks sharing hosts; said only to a
daemon listing ``host_exchange``), ``"flat"`` the flat exchange; absent, not
agreed yet. The control plane's demand of the job follows it. Older shims say
``in_leaf`` (true or false) instead, which is still accepted. ``global_batch``
is the job's samples per step over all its ranks, as they agreed at their
first step; the control plane splits it into batch shares (absent: not agreed
yet). ``flows_left_out`` counts the band connections a shim did not register
because it has more than `MAX_FLOWS` (it then registers none; its packets go
by their DSCP marks). ``left_out_from`` lists the distinct source addresses of those
connections (at most `MAX_SOURCES`): on a host of several NICs, the interfaces the
worker's traffic leaves by, which the daemon's host link is made of. A daemon
refuses fields it does not know, so a shim sends an optional field only when the
welcome's ``features`` lists it (`FEATURES`; an older daemon's welcome has none).
`hello` must come first and only once. Anything else (bad framing, a wrong
type, an out-of-order message) gets one ``error {code, message}`` and the
connection is closed.

The `pid` of a worker is taken from SO_PEERCRED, not from the message.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from gradlane.daemon.fields import (
    HOST_EXCHANGE,
    exchange,
    get,
    integer,
    listed,
    number,
    only,
    text,
)
from gradlane.errors import ProtocolError

# EF, AF41, AF31, AF21: band 0 (needed first) to band 3. Shims mark their band
# connections with these until gradlaned's welcome says otherwise.
DEFAULT_BAND_DSCP: tuple[int, ...] = (46, 34, 26, 18)

__all__ = [
    "BAND_NUMBERS",
    "DEFAULT_BAND_DSCP",
    "FEATURES",
    "MAX_FRAME",
    "VERSION",
    "Bye",
    "ChunkEvent",
    "Chunks",
    "FlowSpec",
    "FrameDecoder",
    "Hello",
    "Message",
    "SetFlows",
    "Timing",
    "encode",
    "parse",
]

VERSION = 1
# Optional fields this daemon accepts beyond those of VERSION (its welcome lists them).
FEATURES: tuple[str, ...] = ("in_leaf", "exchange", "global_batch", HOST_EXCHANGE,
                             "flows_left_out", "left_out_from")
MAX_FRAME = 1 << 20
# A worker's band connections: the shim's most bands (8) to each peer of a
# 1,025-rank flat job, or of a job of 1,018 hosts of 8 ranks reducing within hosts
# first (about 530 KB of flows, under MAX_FRAME). A shim of more registers none, and says
# how many it left out (a flows message's ``flows_left_out``, to a daemon that takes it).
MAX_FLOWS = 8 * 1024
MAX_SOURCES = 64  # addresses of a worker's connections left out (one per NIC of its host)
MAX_EVENTS = 16384
BAND_NUMBERS = 64  # band numbers a message may carry (no more bands than DSCP values)
_LEN = struct.Struct(">I")


def encode(message: dict[str, Any], max_frame: int = MAX_FRAME) -> bytes:
    """One frame holding `message` (a map with a "type")."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise ProtocolError("too_big", f"message of {len(body)} bytes exceeds {max_frame}")
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Turns a byte stream into decoded maps, refusing oversized or malformed frames."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """Add `data`; yield every complete message now available.

        Raises:
            ProtocolError: a frame is empty, too big, not msgpack, or not a map.
        """
        self._buf += data
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if size == 0 or size > self.max_frame:
                raise ProtocolError("bad_frame", f"frame length {size} not in 1..{self.max_frame}")
            if len(self._buf) < _LEN.size + size:
                return
            body = bytes(self._buf[_LEN.size : _LEN.size + size])
            del self._buf[: _LEN.size + size]
            yield _unpack(body, self.max_frame)

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


def _unpack(body: bytes, max_frame: int) -> dict[str, Any]:
    try:
        value = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=max_frame,
            max_bin_len=max_frame,
            max_array_len=MAX_EVENTS,
            max_map_len=64,
            max_ext_len=0,
        )
    except (ValueError, TypeError) as exc:
        # ValueError covers ExtraData, FormatError, StackError, bad UTF-8 and
        # non-string map keys; TypeError an unhashable key inside a map.
        raise ProtocolError("bad_frame", f"not a msgpack message: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", f"a message is a map, got {type(value).__name__}")
    return value


# -- messages ----------------------------------------------------------------


@dataclass(frozen=True)
class FlowSpec:
    """One band connection, as its sender sees it."""

    band: int
    src: str
    sport: int
    dst: str
    dport: int


@dataclass(frozen=True)
class Hello:
    version: int
    job: str
    rank: int
    world_size: int
    flows: tuple[FlowSpec, ...]
    exchange: str | None = None  # one of `fields.EXCHANGES`; None: not agreed yet
    global_batch: int | None = None  # the job's samples per step; None: not agreed yet


@dataclass(frozen=True)
class SetFlows:
    flows: tuple[FlowSpec, ...]
    exchange: str | None = None
    global_batch: int | None = None
    flows_left_out: int = 0  # band connections the shim did not register (past MAX_FLOWS)
    left_out_from: frozenset[str] = frozenset()  # their source addresses


@dataclass(frozen=True)
class ChunkEvent:
    layer: int
    nbytes: int
    band: int
    t: float


@dataclass(frozen=True)
class Chunks:
    iteration: int
    events: tuple[ChunkEvent, ...]


@dataclass(frozen=True)
class Timing:
    iteration: int
    compute_s: float
    comm_s: float
    samples: int


@dataclass(frozen=True)
class Bye:
    pass


Message = Hello | SetFlows | Chunks | Timing | Bye


def parse(raw: dict[str, Any], bands: int) -> Message:
    """Validate one decoded map and return the message it holds.

    `bands` is how many bands the daemon has: a flow's or a chunk's band past
    the last (up to `BAND_NUMBERS`) is taken as the last.

    Raises:
        ProtocolError: the map is not a valid message; the text names the field.
    """
    kind = raw.get("type")
    if kind == "hello":
        only(raw, {"type", "version", "job", "rank", "world_size", "flows", "in_leaf",
                   "exchange", "global_batch"})
        version = integer(raw, "version", 1, 1 << 16)
        if version != VERSION:
            raise ProtocolError(
                "version", f"protocol version {version} unsupported (want {VERSION})"
            )
        world = integer(raw, "world_size", 1, 1 << 20)
        return Hello(
            version=version,
            job=text(raw, "job"),
            rank=integer(raw, "rank", 0, world - 1),
            world_size=world,
            flows=_flows(raw, bands),
            exchange=exchange(raw),
            global_batch=_global_batch(raw),
        )
    if kind == "flows":
        only(raw, {"type", "flows", "in_leaf", "exchange", "global_batch", "flows_left_out",
                   "left_out_from"})
        return SetFlows(flows=_flows(raw, bands), exchange=exchange(raw),
                        global_batch=_global_batch(raw),
                        flows_left_out=integer(raw, "flows_left_out", 0, 1 << 31)
                        if "flows_left_out" in raw else 0,
                        left_out_from=_sources(raw))
    if kind == "chunks":
        only(raw, {"type", "iteration", "events"})
        events = listed(raw, "events", MAX_EVENTS)
        return Chunks(
            iteration=integer(raw, "iteration", 0, 1 << 62),
            events=tuple(_event(e, i, bands) for i, e in enumerate(events)),
        )
    if kind == "timing":
        only(raw, {"type", "iteration", "compute_s", "comm_s", "samples"})
        return Timing(
            iteration=integer(raw, "iteration", 0, 1 << 62),
            compute_s=number(raw, "compute_s"),
            comm_s=number(raw, "comm_s"),
            samples=integer(raw, "samples", 0, 1 << 31),
        )
    if kind == "bye":
        only(raw, {"type"})
        return Bye()
    raise ProtocolError("bad_message", f"unknown message type {kind!r}")


def _global_batch(raw: dict[str, Any]) -> int | None:
    return integer(raw, "global_batch", 1, 1 << 31) if "global_batch" in raw else None


def _flows(raw: dict[str, Any], bands: int) -> tuple[FlowSpec, ...]:
    out = []
    for i, item in enumerate(listed(raw, "flows", MAX_FLOWS)):
        if not isinstance(item, dict):
            raise ProtocolError("bad_message", f"{raw['type']}: flows[{i}] must be a map")
        where = {**item, "type": f"{raw['type']}: flows[{i}]"}
        only(where, {"type", "band", "src", "sport", "dst", "dport"})
        out.append(
            FlowSpec(
                band=min(integer(where, "band", 0, BAND_NUMBERS - 1), bands - 1),
                src=_ipv4(get(where, "src"), f"{where['type']}: src"),
                sport=integer(where, "sport", 1, 65535),
                dst=_ipv4(get(where, "dst"), f"{where['type']}: dst"),
                dport=integer(where, "dport", 1, 65535),
            )
        )
    return tuple(out)


def _sources(raw: dict[str, Any]) -> frozenset[str]:
    if "left_out_from" not in raw:
        return frozenset()
    return frozenset(_ipv4(a, f"flows: left_out_from[{i}]")
                     for i, a in enumerate(listed(raw, "left_out_from", MAX_SOURCES)))


def _ipv4(value: Any, what: str) -> str:
    """`value` as an IPv4 address in dotted form (a number, which `ipaddress` would take,
    is not one: 5 is not 0.0.0.5 to a shim)."""
    try:
        if isinstance(value, str):
            return str(ipaddress.IPv4Address(value))
    except ValueError:
        pass
    raise ProtocolError("bad_message", f"{what} must be an IPv4 address")


def _event(item: Any, i: int, bands: int) -> ChunkEvent:
    if not isinstance(item, list) or len(item) != 4:
        raise ProtocolError("bad_message", f"chunks: events[{i}] must be [layer, nbytes, band, t]")
    layer, nbytes, band, t = item
    ok = (
        isinstance(layer, int)
        and isinstance(nbytes, int)
        and isinstance(band, int)
        and isinstance(t, int | float)
        and not any(isinstance(v, bool) for v in item)
        and 0 <= layer < 1 << 20
        and 0 <= nbytes < 1 << 40
        and 0 <= band < BAND_NUMBERS
    )
    if not ok:
        raise ProtocolError("bad_message", f"chunks: events[{i}] has a bad value: {item!r:.80}")
    return ChunkEvent(layer, nbytes, min(band, bands - 1), float(t))
