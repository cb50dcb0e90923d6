"""Small netlink helpers shared by the qdisc manager and the testbed.

Everything that talks to the kernel's traffic control goes through pyroute2
(never the `tc` binary) and every call site sits inside `translated()`, which
turns `NetlinkError` into `TcError` naming the interface and the object.

u32 keys are handled as *byte maps*: they are sent re-packed into words that
start at a masked byte (``0x00b80000/0x00fc0000+0`` is sent as
``b8000000/fc000000 at 1``), as pyroute2 packs them (`u32_message` packs its
messages itself, the same bytes, faster), so comparing key lists literally
would never match what the kernel reports. A byte map, (offset, value byte,
mask byte) of every masked byte in offset order, is the same whatever the
packing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg import plugins, sched_pfifo, tcmsg

from gradlane.errors import TcError

# pyroute2 0.9 knows pfifo's options but not bfifo's, which are the same struct
# (tc_fifo_qopt: the limit, in bytes for bfifo): without this a bfifo root reads as
# a hex string and is re-created with the kernel's default limit, whatever is asked.
plugins.setdefault("bfifo", sched_pfifo)

__all__ = [
    "ETH_P_ALL",
    "ETH_P_IP",
    "TC_U32_ROOT",
    "ByteMap",
    "HtbClass",
    "HtbParams",
    "U32Filter",
    "U32Key",
    "bytemap_entries",
    "dscp_key",
    "fmt_handle",
    "fmt_u32_handle",
    "handle",
    "htb_class_kwargs",
    "ipv4_tcp_keys",
    "parse_htb_class",
    "parse_u32_filter",
    "tos_class_key",
    "translated",
    "u32_bytemap",
    "u32_key_strings",
    "u32_message",
]

ETH_P_IP = 0x0800
ETH_P_ALL = 0x0003

# Ethernet frame bytes around one full-sized IPv4 packet: what HTB charges.
WIRE_MTU = 1514

U32Key = tuple[int, int, int]
"""One u32 match: (value, mask, offset), 32-bit value/mask at a byte offset
from the start of the IP header."""


def handle(major: int, minor: int) -> int:
    """Return the 32-bit tc handle ``major:minor``."""
    return ((major & 0xFFFF) << 16) | (minor & 0xFFFF)


def fmt_handle(value: int) -> str:
    """Format a tc handle as tc prints it, e.g. ``474c:101``."""
    return f"{value >> 16:x}:{value & 0xFFFF:x}"


def fmt_u32_handle(value: int) -> str:
    """Format a u32 node handle as tc prints it: table, bucket, node (``474:c5:1``)."""
    return f"{value >> 20:x}:{(value >> 12) & 0xFF:x}:{value & 0xFFF:x}"


@contextlib.contextmanager
def translated(ifname: str, obj: str) -> Iterator[None]:
    """Turn netlink errors raised inside the block into `TcError`."""
    try:
        yield
    except NetlinkError as exc:
        detail = ""
        if len(exc.args) > 1 and isinstance(exc.args[1], str):
            detail = exc.args[1]
        raise TcError(exc.code, ifname, obj, detail) from exc


def htb_class_kwargs(
    rate_bps: int, ceil_bps: int, prio: int, quantum: int, mtu: int = WIRE_MTU
) -> dict[str, Any]:
    """Keyword arguments for ``ipr.tc("add-class", "htb", ...)``.

    Rates go to pyroute2 as integers in *bytes* per second (its unit for
    integers). Bursts are one millisecond of traffic, at least two frames, as
    tc itself computes them; explicit so that kernel state is reproducible.
    """
    rate = max(1, rate_bps // 8)
    ceil = max(rate, ceil_bps // 8)
    return {
        "rate": rate,
        "ceil": ceil,
        "prio": prio,
        "quantum": quantum,
        "burst": max(rate // 1000, 2 * mtu),
        "cburst": max(ceil // 1000, 2 * mtu),
    }


@dataclass(frozen=True)
class HtbParams:
    """What defines an HTB class (rates in bit/s)."""

    classid: int
    parent: int
    rate_bps: int
    ceil_bps: int
    prio: int
    quantum: int

    def as_kernel_stores(self) -> HtbParams:
        """The same class with rates as the kernel keeps them (whole bytes/s, ceil >= rate)."""
        kwargs = htb_class_kwargs(self.rate_bps, self.ceil_bps, self.prio, self.quantum)
        return replace(self, rate_bps=kwargs["rate"] * 8, ceil_bps=kwargs["ceil"] * 8)


@dataclass(frozen=True)
class HtbClass:
    """An HTB class as the kernel reports it: its parameters and counters."""

    params: HtbParams
    bytes: int
    packets: int
    drops: int
    backlog: int
    qlen: int
    overlimits: int


def parse_htb_class(msg: Any) -> HtbClass:
    """Decode one class message from ``ipr.get_classes()``."""
    options = msg.get_attr("TCA_OPTIONS")
    parms = options.get_attr("TCA_HTB_PARMS")
    rate = options.get_attr("TCA_HTB_RATE64") or parms["rate"]
    ceil = options.get_attr("TCA_HTB_CEIL64") or parms["ceil"]
    basic = msg.get_nested("TCA_STATS2", "TCA_STATS_BASIC") or {}
    queue = msg.get_nested("TCA_STATS2", "TCA_STATS_QUEUE") or {}
    return HtbClass(
        params=HtbParams(
            classid=msg["handle"],
            parent=msg["parent"],
            rate_bps=rate * 8,
            ceil_bps=ceil * 8,
            prio=parms["prio"],
            quantum=parms["quantum"],
        ),
        bytes=basic.get("bytes", 0),
        packets=basic.get("packets", 0),
        drops=queue.get("drops", 0),
        backlog=queue.get("backlog", 0),
        qlen=queue.get("qlen", 0),
        overlimits=queue.get("overlimits", 0),
    )


def dscp_key(dscp: int) -> U32Key:
    """Match the 6 DSCP bits of the IPv4 TOS byte (ECN bits ignored)."""
    if not 0 <= dscp < 64:
        raise ValueError(f"DSCP must be in 0..63, got {dscp}")
    return ((dscp << 2) << 16, 0x00FC0000, 0)


def tos_class_key(selector: int) -> U32Key:
    """Match a DSCP class selector: the top 3 bits of the TOS byte."""
    if not 0 <= selector < 8:
        raise ValueError(f"class selector must be in 0..7, got {selector}")
    return ((selector << 5) << 16, 0x00E00000, 0)


def ipv4_tcp_keys(
    src: str | None = None,
    sport: int | None = None,
    dst: str | None = None,
    dport: int | None = None,
) -> list[U32Key]:
    """Keys matching IPv4 TCP packets with the given 5-tuple fields.

    Fields left as None match anything. Ports are read at the fixed offset
    20, so the keys also require a 20-byte IP header (IHL 5): a packet with IP
    options does not match and falls through to the next filter.
    """
    keys: list[U32Key] = [(0x05000000, 0x0F000000, 0), (0x00060000, 0x00FF0000, 8)]
    if src is not None:
        keys.append((int(ipaddress.IPv4Address(src)), 0xFFFFFFFF, 12))
    if dst is not None:
        keys.append((int(ipaddress.IPv4Address(dst)), 0xFFFFFFFF, 16))
    if sport is not None or dport is not None:
        value = ((sport or 0) << 16) | (dport or 0)
        mask = (0xFFFF0000 if sport is not None else 0) | (0xFFFF if dport is not None else 0)
        keys.append((value, mask, 20))
    return keys


def u32_key_strings(keys: Iterable[U32Key]) -> list[str]:
    """Keys in pyroute2's ``"0xVALUE/0xMASK+OFFSET"`` form."""
    return [f"0x{value:08x}/0x{mask:08x}+{offset}" for value, mask, offset in keys]


ByteMap = bytes
"""The canonical form of a u32 match (`u32_bytemap`): for each masked byte, in offset
order, its offset, value and mask (`_BYTE`). Bytes, not a set of tuples: the qdisc
manager holds a host's flows twice (wanted, and as the kernel has them), 65,536 in
37 MB against 235 (tracemalloc)."""
_BYTE = struct.Struct(">iBB")


def u32_bytemap(keys: Iterable[U32Key]) -> ByteMap:
    """The canonical form of a key list: what a packet must have, byte by byte,
    however the keys pack it."""
    out: dict[int, tuple[int, int]] = {}
    for value, mask, offset in keys:
        for i in range(4):
            shift = 24 - 8 * i
            mbyte = (mask >> shift) & 0xFF
            if mbyte:
                vbyte = (value >> shift) & mbyte
                old_v, old_m = out.get(offset + i, (0, 0))
                out[offset + i] = (old_v | vbyte, old_m | mbyte)
    return b"".join(_BYTE.pack(off, v, m) for off, (v, m) in sorted(out.items()))


def bytemap_entries(match: ByteMap) -> list[tuple[int, int, int]]:
    """A byte map's (offset, value byte, mask byte), in offset order."""
    return list(_BYTE.iter_unpack(match))


@dataclass(frozen=True)
class U32Filter:
    """A u32 node as the kernel reports it.

    Three kinds: a terminal filter (`classid` set: a match sends the packet
    there), a link (`link` set: a match looks the packet up in that hash
    table, in the bucket its `hashkey` picks), and a hash table (`divisor`
    buckets, no selector).
    """

    pref: int
    classid: int
    bytemap: ByteMap
    handle: int = 0  # the kernel's node handle (e.g. 800::800); 0 when not known
    link: int = 0  # the handle of the hash table a link leads to
    divisor: int = 0  # a hash table's number of buckets
    hashkey: tuple[int, int] = (0, 0)  # a link's (mask, offset) of the word it hashes
    terminal: bool = True


_SEL_HEADER = 16  # struct tc_u32_sel before its keys
# struct tc_u32_key: mask and val in network order, off and offmask in host order
_KEY_MASK_VAL = struct.Struct(">II")
_KEY_OFF = struct.Struct("=i")
_KEY_SIZE = 16
TC_U32_TERMINAL = 1  # tc_u32_sel.flags: a match ends the classification
TC_U32_ROOT = 0xFFF00000  # TCA_U32_HASH: the root table of the filter's priority

# What `parse_u32_filter` reads from a message's bytes: the netlink header's length,
# the tcmsg's handle and info, attributes (length, type) and the u32 selector's head.
_NLMSG_LEN = struct.Struct("=I")
_TCMSG_HANDLE_PARENT_INFO = struct.Struct("=III")  # at 24: past nlmsghdr (16), family, ifindex
_TCMSG_END = 36
_NLA = struct.Struct("=HH")
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
_U32 = struct.Struct("=I")
_SEL = struct.Struct("=BBBxHHhh")  # flags, offshift, nkeys, offmask (0 here), off, offoff, hoff
_SEL_HMASK = struct.Struct(">I")  # after `_SEL`, in network order
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_U32_CLASSID, TCA_U32_HASH, TCA_U32_LINK, TCA_U32_DIVISOR, TCA_U32_SEL = 1, 2, 3, 4, 5


def _attributes(data: bytes | bytearray, start: int, end: int) -> dict[int, tuple[int, int]]:
    """The netlink attributes between `start` and `end`: type -> (its payload's start,
    end). Bounded by `end`: a malformed length ends the walk."""
    found = {}
    at = start
    while at + _NLA.size <= end:
        length, kind = _NLA.unpack_from(data, at)
        if length < _NLA.size or at + length > end:
            break
        found[kind & _NLA_TYPE_MASK] = (at + _NLA.size, at + length)
        at += (length + 3) & ~3
    return found


def parse_u32_filter(msg: Any) -> U32Filter | None:
    """Decode a u32 node from ``ipr.get_filters()``.

    Returns None for the entry the kernel reports for each filter priority
    itself. Read from the message's bytes, not through pyroute2's decoding:
    that took 1.2 of the 1.9 s a re-reading of 8,192 flows' nodes took (this:
    0.1-0.2 s), and pyroute2 0.9 reads the keys at the wrong offset.
    """
    data, offset = msg.data, msg.offset
    (length,) = _NLMSG_LEN.unpack_from(data, offset)
    end = offset + length
    top = _attributes(data, offset + _TCMSG_END, end)
    kind = top.get(TCA_KIND)
    if kind is None or bytes(data[kind[0]:kind[1]]).rstrip(b"\0") != b"u32":
        return None
    if TCA_OPTIONS not in top:
        return None
    handle, _, info = _TCMSG_HANDLE_PARENT_INFO.unpack_from(data, offset + 24)
    options = _attributes(data, *top[TCA_OPTIONS])

    def u32(attribute: int) -> int | None:
        where = options.get(attribute)
        if where is None or where[1] - where[0] < _U32.size:
            return None
        return int(_U32.unpack_from(data, where[0])[0])

    pref = info >> 16
    sel = options.get(TCA_U32_SEL)
    if sel is None or sel[1] - sel[0] < _SEL_HEADER:
        divisor = u32(TCA_U32_DIVISOR)
        if divisor is None:
            return None
        return U32Filter(pref, 0, b"", handle=handle, divisor=divisor)
    flags, _, nkeys, _, _, _, hoff = _SEL.unpack_from(data, sel[0])
    (hmask,) = _SEL_HMASK.unpack_from(data, sel[0] + _SEL.size)
    keys = []
    for i in range(min(nkeys, (sel[1] - sel[0] - _SEL_HEADER) // _KEY_SIZE)):
        at = sel[0] + _SEL_HEADER + i * _KEY_SIZE
        mask, val = _KEY_MASK_VAL.unpack_from(data, at)
        (off,) = _KEY_OFF.unpack_from(data, at + _KEY_MASK_VAL.size)
        keys.append((val, mask, off))
    return U32Filter(
        pref=pref,
        classid=u32(TCA_U32_CLASSID) or 0,
        bytemap=u32_bytemap(keys),
        handle=handle,
        link=u32(TCA_U32_LINK) or 0,
        hashkey=(hmask, hoff),
        terminal=bool(flags & TC_U32_TERMINAL),
    )


_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence number, port id
_TCMSG = struct.Struct("=BxxxiIII")  # family, (padding), ifindex, handle, parent, info


class _U32Message(tcmsg):  # type: ignore[misc]
    """A u32 filter message that packs itself with `struct`: pyroute2's generic
    encoding took 3 of the 3.9 s that installing a worker's 8,192 flows took
    (profiled). The same bytes as pyroute2's (a property test holds it), so the
    same filter in the kernel. Sent through pyroute2 like any other message:
    ``NetlinkRequest`` fills the header and calls `encode`."""

    def __init__(self, attributes: bytes) -> None:
        super().__init__()
        self.attributes = attributes

    def encode(self) -> None:
        header = self["header"]
        body = _TCMSG.pack(self["family"], self["index"], self["handle"], self["parent"],
                           self["info"]) + self.attributes
        length = _NLMSGHDR.size + len(body)
        del self.data[self.offset:]
        self.data += _NLMSGHDR.pack(length, header.get("type") or 0, header.get("flags") or 0,
                                    header.get("sequence_number") or 0,
                                    header.get("pid") or 0) + body
        self.length = header["length"] = length


def _nla(kind: int, payload: bytes) -> bytes:
    length = _NLA.size + len(payload)
    return _NLA.pack(length, kind) + payload + bytes(-length % 4)


def _packed_keys(match: ByteMap) -> list[bytes]:
    """A byte map's keys as pyroute2 packs them (`gradlane.daemon.tc` says why): a word
    from each masked byte not in the word before, as `struct tc_u32_key`s."""
    byte = {offset: (value, mask) for offset, value, mask in bytemap_entries(match)}
    if any(offset < 0 for offset in byte):
        raise ValueError(f"u32 keys before the IP header are not packed here: {sorted(byte)}")
    out, taken = [], 0
    for start in sorted(byte):
        if start < taken:
            continue
        mask = value = 0
        for i in range(min(4, 256 - start)):  # pyroute2 packs no byte past offset 255
            v, m = byte.get(start + i, (0, 0))
            mask |= m << (24 - 8 * i)
            value |= v << (24 - 8 * i)
        out.append(_KEY_MASK_VAL.pack(mask, value) + _KEY_OFF.pack(start) + bytes(4))
        taken = start + 4
    return out


def u32_message(
    index: int,
    parent: int,
    pref: int,
    handle: int,
    *,
    match: ByteMap | None = None,
    classid: int = 0,
    table: int = 0,
    link: int = 0,
    hashkey: tuple[int, int] = (0, 0),
    divisor: int = 0,
) -> Any:
    """A u32 filter message for ``nlm_request_batch`` (the caller sets the header's
    type and flags), for what ``ipr.tc`` cannot build: a hash table (`divisor`
    buckets), a link to one (`link`, hashing the word at ``hashkey[1]`` masked by
    ``hashkey[0]``; not terminal), a node in one of its buckets (`table`: its
    handle plus the bucket << 12; or `TC_U32_ROOT`). `match`: the bytes a packet
    must have (`u32_bytemap` of its keys; empty: any packet); None: no options (a
    delete)."""
    options = b""
    if divisor:
        options = _nla(TCA_U32_DIVISOR, _U32.pack(divisor))
    elif match is not None:
        if table:
            options += _nla(TCA_U32_HASH, _U32.pack(table))
        if link:
            options += _nla(TCA_U32_LINK, _U32.pack(link))
        if classid:
            options += _nla(TCA_U32_CLASSID, _U32.pack(classid))
        packed = _packed_keys(match)
        sel = (_SEL.pack(0 if link else TC_U32_TERMINAL, 0, len(packed), 0, 0, 0, hashkey[1])
               + _SEL_HMASK.pack(hashkey[0]))
        options += _nla(TCA_U32_SEL, sel + b"".join(packed))
    attributes = _nla(TCA_KIND, b"u32\0")
    if options:
        attributes += _nla(TCA_OPTIONS, options)
    msg = _U32Message(attributes)
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = index
    msg["handle"] = handle
    msg["parent"] = parent
    msg["info"] = filter_info(pref)
    return msg


def filter_info(pref: int, protocol: int = ETH_P_IP) -> int:
    """The tcmsg ``info`` that names one filter priority (to delete just it)."""
    return (pref << 16) | socket.htons(protocol)
