import errno
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_NEWTFILTER
from pyroute2.netlink.rtnl.tcmsg import cls_u32, tcmsg

import gradlane.daemon.tc as tc_module
from gradlane.daemon.tc import (
    TC_U32_ROOT,
    HtbParams,
    U32Filter,
    bytemap_entries,
    dscp_key,
    fmt_handle,
    fmt_u32_handle,
    handle,
    htb_class_kwargs,
    ipv4_tcp_keys,
    parse_htb_class,
    parse_u32_filter,
    tos_class_key,
    translated,
    u32_bytemap,
    u32_key_strings,
    u32_message,
)
from gradlane.errors import TcError


def test_handles() -> None:
    assert handle(0x474C, 0x101) == 0x474C0101
    assert fmt_handle(0x474C0101) == "474c:101"


def test_dscp_key_matches_tos_byte_without_ecn() -> None:
    # DSCP 46 (EF) is TOS 0xb8; the two ECN bits are masked out.
    assert dscp_key(46) == (0x00B80000, 0x00FC0000, 0)
    assert tos_class_key(5) == (0x00A00000, 0x00E00000, 0)


def test_dscp_and_class_selector_keys_take_their_ranges_only() -> None:
    assert dscp_key(0)[0] == 0 and dscp_key(63) == (0x00FC0000, 0x00FC0000, 0)
    assert tos_class_key(0)[0] == 0 and tos_class_key(7) == (0x00E00000, 0x00E00000, 0)
    for bad in (-1, 64):
        with pytest.raises(ValueError, match=f"^DSCP must be in 0..63, got {bad}$"):
            dscp_key(bad)
    for bad in (-1, 8):
        with pytest.raises(ValueError, match=f"^class selector must be in 0..7, got {bad}$"):
            tos_class_key(bad)


def test_netlink_errors_become_tc_errors_with_the_kernel_s_words() -> None:
    with pytest.raises(TcError) as raised, translated("eth0", "class 474c:101"):
        raise NetlinkError(errno.EINVAL, "Invalid rate")
    assert (raised.value.errno, raised.value.detail) == (errno.EINVAL, "Invalid rate")
    assert str(raised.value) == "class 474c:101 on eth0: Invalid rate (EINVAL)"
    with pytest.raises(TcError) as raised, translated("eth0", "root qdisc"):
        raise NetlinkError(errno.EPERM)  # no extended ack: the errno's own words
    assert str(raised.value) == "root qdisc on eth0: Operation not permitted (EPERM)"


def test_bytemap_is_independent_of_packing() -> None:
    # pyroute2 sends "0x00b80000/0x00fc0000+0" as b8000000/fc000000 at offset 1.
    assert u32_bytemap([dscp_key(46)]) == u32_bytemap([(0xB8000000, 0xFC000000, 1)])
    assert bytemap_entries(u32_bytemap([dscp_key(46)])) == [(1, 0xB8, 0xFC)]


def test_bytemap_distinguishes_different_matches() -> None:
    assert u32_bytemap([dscp_key(46)]) != u32_bytemap([dscp_key(34)])
    assert u32_bytemap(ipv4_tcp_keys(dport=5000)) != u32_bytemap(ipv4_tcp_keys(sport=5000))


@given(
    st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 60)),
        max_size=6,
    )
)
def test_bytemap_equals_bytewise_repacking(keys: list[tuple[int, int, int]]) -> None:
    # Split every key into one-byte keys at their own offsets: same match.
    bytewise = []
    for value, mask, offset in keys:
        for i in range(4):
            shift = 24 - 8 * i
            bytewise.append(
                ((value >> shift & 0xFF) << 24, (mask >> shift & 0xFF) << 24, offset + i)
            )
    assert u32_bytemap(keys) == u32_bytemap(bytewise)


def test_ipv4_tcp_keys_cover_the_5tuple() -> None:
    keys = ipv4_tcp_keys(src="10.200.0.1", sport=40000, dst="10.200.0.2", dport=5201)
    assert (0x0AC80001, 0xFFFFFFFF, 12) in keys
    assert (0x0AC80002, 0xFFFFFFFF, 16) in keys
    assert ((40000 << 16) | 5201, 0xFFFFFFFF, 20) in keys
    assert (0x00060000, 0x00FF0000, 8) in keys  # TCP
    assert (0x05000000, 0x0F000000, 0) in keys  # IHL 5: ports really at offset 20
    # One port alone: the other half of the word neither matched nor set.
    assert ipv4_tcp_keys(dport=5201)[-1] == (5201, 0x0000FFFF, 20)
    assert ipv4_tcp_keys(sport=40000)[-1] == (40000 << 16, 0xFFFF0000, 20)


def test_htb_kwargs_are_bytes_per_second_with_explicit_bursts() -> None:
    kw = htb_class_kwargs(200_000_000, 400_000_000, prio=3, quantum=3028)
    assert kw["rate"] == 25_000_000 and kw["ceil"] == 50_000_000
    assert kw["prio"] == 3 and kw["quantum"] == 3028
    assert kw["burst"] == 25_000 and kw["cburst"] == 50_000
    small = htb_class_kwargs(8_000, 8_000, 0, 1514)
    assert small["burst"] == small["cburst"] == 2 * 1514  # never under two frames
    assert htb_class_kwargs(0, 0, 0, 1514)["rate"] == 1  # the kernel's least: 1 byte/s


def test_a_class_as_the_kernel_keeps_it_has_whole_bytes_and_ceil_at_least_rate() -> None:
    asked = HtbParams(classid=0x474C0101, parent=0x474C0001, rate_bps=1001, ceil_bps=500,
                      prio=1, quantum=1514)
    kept = asked.as_kernel_stores()
    assert (kept.rate_bps, kept.ceil_bps) == (1000, 1000)
    assert kept == HtbParams(0x474C0101, 0x474C0001, 1000, 1000, 1, 1514)


def _round_trip(msg: Any) -> U32Filter | None:
    """`msg` encoded, then decoded as a dump of the kernel's would be."""
    msg["header"]["type"] = RTM_NEWTFILTER
    msg.encode()
    echoed = tcmsg(bytes(msg.data))
    echoed.decode()
    return parse_u32_filter(echoed)


def test_u32_messages_say_what_ipr_tc_cannot() -> None:
    # pyroute2 compiles a message class's attribute table at first use, and a subclass
    # would inherit the parent's: use the parents first, as a running daemon has.
    tcmsg(), cls_u32.options()
    link = _round_trip(
        u32_message(3, 0x474C0000, 0x100, 1, match=u32_bytemap(ipv4_tcp_keys()), table=TC_U32_ROOT,
                    link=0x47400000, hashkey=(0x1FE, 20))
    )  # fmt: skip
    assert link is not None
    assert (link.link, link.hashkey, link.terminal, link.classid) == (0x47400000, (0x1FE, 20),
                                                                     False, 0)  # fmt: skip
    assert link.bytemap == u32_bytemap(ipv4_tcp_keys()) and link.pref == 0x100
    flow = _round_trip(
        u32_message(3, 0x474C0000, 0x100, 0x4745A001, match=u32_bytemap(ipv4_tcp_keys(dport=5301)),
                    classid=0x474C0102, table=0x4745A000)
    )  # fmt: skip
    assert flow is not None and flow.terminal and flow.classid == 0x474C0102
    assert flow.handle == 0x4745A001 and fmt_u32_handle(flow.handle) == "474:5a:1"
    table = _round_trip(u32_message(3, 0x474C0000, 0x100, 0x47400000, divisor=256))
    assert table is not None and (table.divisor, table.handle) == (256, 0x47400000)
    assert _round_trip(u32_message(3, 0x474C0000, 0x100, 0x4745A001)) is None  # a delete


_PORTS = st.none() | st.integers(1, 65535)
_ADDRESSES = st.none() | st.ip_addresses(v=4).map(str)


@given(src=_ADDRESSES, sport=_PORTS, dst=_ADDRESSES, dport=_PORTS,
       classid=st.integers(1, 0xFFFFFFFF), bucket=st.integers(0, 255),
       node=st.integers(1, 0xFFF), pref=st.integers(1, 0xFFFF),
       extra=st.lists(st.integers(0, 63).map(dscp_key), max_size=1))
def test_a_flow_node_reads_back_as_written_from_the_message_s_bytes(
        src: str | None, sport: int | None, dst: str | None, dport: int | None, classid: int,
        bucket: int, node: int, pref: int, extra: list[tuple[int, int, int]]) -> None:
    # `parse_u32_filter` reads the attributes from the bytes itself: every key, the class,
    # the node's handle and priority, as a dump gives them back.
    tcmsg(), cls_u32.options()
    keys = ipv4_tcp_keys(src, sport, dst, dport) + extra
    table = 0x47400000 | bucket << 12
    got = _round_trip(u32_message(7, 0x474C0000, pref, table | node, match=u32_bytemap(keys),
                                  classid=classid, table=table))
    assert got == U32Filter(pref, classid, u32_bytemap(keys), handle=table | node)


class _Pyroute2Options(cls_u32.options):  # type: ignore[misc]
    """pyroute2's u32 options with a selector that need not be terminal (a link)."""

    class u32_sel(cls_u32.options.u32_sel):  # type: ignore[misc]
        def encode(self) -> None:
            terminal = self.get("terminal", True)
            super().encode()  # always writes flags = TC_U32_TERMINAL
            self.data[self.offset + 4] = 1 if terminal else 0


class _Pyroute2Message(tcmsg):  # type: ignore[misc]
    @staticmethod
    def get_options(self: Any, *argv: Any, **kwarg: Any) -> type:
        return _Pyroute2Options


# pyroute2 compiles a message class's attribute table once, and a subclass inherits
# it compiled: without their own, these two would encode as their parents do.
for _cls in (_Pyroute2Options, _Pyroute2Message):
    _cls._nlmsg_base__compiled_nla = False


def _pyroute2_encoded(index: int, pref: int, node: int, keys: list[tuple[int, int, int]] | None,
                      classid: int = 0, table: int = 0, link: int = 0,
                      hashkey: tuple[int, int] = (0, 0), divisor: int = 0) -> bytes:
    """What pyroute2's own encoding makes of the filter `u32_message` packs itself."""
    msg = _Pyroute2Message()
    msg["family"], msg["index"], msg["handle"] = 0, index, node
    msg["parent"], msg["info"] = 0x474C0000, pref << 16 | 8
    options: list[list[Any]] = []
    if divisor:
        options.append(["TCA_U32_DIVISOR", divisor])
    elif keys is not None:
        if table:
            options.append(["TCA_U32_HASH", table])
        if link:
            options.append(["TCA_U32_LINK", struct.pack("=I", link)])
        if classid:
            options.append(["TCA_U32_CLASSID", classid])
        options.append(["TCA_U32_SEL", {"keys": u32_key_strings(keys), "terminal": not link,
                                        "hmask": hashkey[0], "hoff": hashkey[1]}])
    msg["attrs"] = [["TCA_KIND", "u32"]]
    if options:
        msg["attrs"].append(["TCA_OPTIONS", {"attrs": options}])
    _with_header(msg)
    msg.encode()
    return bytes(msg.data)


def _with_header(msg: Any) -> None:
    header = msg["header"]
    header["type"], header["flags"] = RTM_NEWTFILTER, 0x605
    header["sequence_number"], header["pid"] = 77, 4242


@given(src=_ADDRESSES, sport=_PORTS, dst=_ADDRESSES, dport=_PORTS,
       extra=st.lists(st.integers(0, 63).map(dscp_key) | st.integers(0, 7).map(tos_class_key),
                      max_size=1),
       kind=st.sampled_from(["flow", "link", "table", "delete"]), classid=st.integers(1, 2**32 - 1),
       node=st.integers(1, 2**32 - 1), pref=st.integers(1, 0xFFFF), index=st.integers(1, 2**31 - 1),
       hashkey=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 60)))
def test_a_u32_message_packs_the_bytes_pyroute2_would(
        src: str | None, sport: int | None, dst: str | None, dport: int | None,
        extra: list[tuple[int, int, int]], kind: str, classid: int, node: int, pref: int,
        index: int, hashkey: tuple[int, int]) -> None:
    # `u32_message` packs itself for speed: the kernel must get what pyroute2 would send.
    tcmsg(), cls_u32.options()
    keys = ipv4_tcp_keys(src, sport, dst, dport) + extra
    options: dict[str, Any] = {
        "flow": {"keys": keys, "classid": classid, "table": node & 0xFFFFF000},
        "link": {"keys": keys, "table": TC_U32_ROOT, "link": 0x47400000, "hashkey": hashkey},
        "table": {"divisor": 256},
        "delete": {"keys": None},
    }[kind]
    ours = {k: v for k, v in options.items() if k != "keys"}
    if "keys" in options:
        ours["match"] = None if options["keys"] is None else u32_bytemap(options["keys"])
    msg = u32_message(index, 0x474C0000, pref, node, **ours)
    _with_header(msg)
    msg.encode()
    assert bytes(msg.data) == _pyroute2_encoded(index, pref, node, **{"keys": None, **options})


def test_a_dump_s_messages_are_read_where_each_starts_in_the_buffer() -> None:
    # A dump's messages share one buffer: each is read from its own offset.
    tcmsg(), cls_u32.options()
    first, second = (u32_message(3, 0x474C0000, 0x100, 0x47400000 | n,
                                 match=u32_bytemap(ipv4_tcp_keys(dport=n)), classid=0x474C0100 | n,
                                 table=0x47400000) for n in (1, 2))
    data = bytearray()
    for msg in (first, second):
        msg["header"]["type"] = RTM_NEWTFILTER
        msg.encode()
        data += msg.data
    echoed = tcmsg(data, offset=len(first.data))
    echoed.decode()
    got = parse_u32_filter(echoed)
    assert got is not None and (got.handle, got.classid) == (0x47400002, 0x474C0102)
    assert got.bytemap == u32_bytemap(ipv4_tcp_keys(dport=2))


def _flow_node_bytes() -> bytes:
    """One flow's u32 node (to 5201, into 474c:102) as the kernel would dump it."""
    tcmsg(), cls_u32.options()
    msg = u32_message(3, 0x474C0000, 0x100, 0x47400001,
                      match=u32_bytemap(ipv4_tcp_keys(dport=5201)), classid=0x474C0102,
                      table=0x47400000)
    msg["header"]["type"] = RTM_NEWTFILTER
    msg.encode()
    return bytes(msg.data)


def test_lengths_past_a_message_s_end_are_not_read_beyond_it() -> None:
    # Read from the bytes, a length is trusted only within the message: options that say
    # they run past its end are no filter; a selector claiming more keys than it holds
    # gives the keys it holds. Neither reads the next message's bytes.
    good = _flow_node_bytes()
    options = good.index(b"u32\0") + 4  # TCA_OPTIONS follows TCA_KIND
    length, kind = struct.unpack_from("=HH", good, options)
    assert kind & 0x3FFF == 2
    nkeys_at = good.rindex(struct.pack("=HH", 4 + 16 + 16 * 3, 5)) + 4 + 2  # TCA_U32_SEL
    assert good[nkeys_at] == 3
    cases = {"options": (options, struct.pack("=H", length + 64)),
             "keys": (nkeys_at, bytes([9]))}
    read = {}
    for what, (at, patch) in cases.items():
        bad = bytearray(good[:at] + patch + good[at + len(patch):]) + bytearray(good)
        echoed = tcmsg(bad)
        read[what] = parse_u32_filter(echoed)
    assert read["options"] is None
    keys = read["keys"]
    assert keys is not None and keys.bytemap == u32_bytemap(ipv4_tcp_keys(dport=5201))


class _Attrs(dict[str, Any]):
    """The part of a pyroute2 message `parse_htb_class` reads: fields, attributes."""

    def __init__(self, attrs: dict[str, Any], nested: dict[tuple[str, str], Any] | None = None,
                 **fields: Any) -> None:
        super().__init__(fields)
        self.attrs, self.nested = attrs, nested or {}

    def get_attr(self, name: str) -> Any:
        return self.attrs.get(name)

    def get_nested(self, *names: str) -> Any:
        return self.nested.get(names)


def _htb_class(parms: dict[str, int], rate64: int | None = None, ceil64: int | None = None,
               stats: bool = True) -> Any:
    options = _Attrs({"TCA_HTB_PARMS": parms, "TCA_HTB_RATE64": rate64,
                      "TCA_HTB_CEIL64": ceil64})
    nested = {("TCA_STATS2", "TCA_STATS_BASIC"): {"bytes": 1500, "packets": 1},
              ("TCA_STATS2", "TCA_STATS_QUEUE"): {"drops": 2, "backlog": 3, "qlen": 4,
                                                   "overlimits": 5}} if stats else {}
    return _Attrs({"TCA_OPTIONS": options}, nested, handle=0x474C0101, parent=0x474C0100)


def test_a_class_reads_back_in_bits_a_second_with_its_64_bit_rates_past_4_gbyte() -> None:
    parms = {"rate": 12_500_000, "ceil": 25_000_000, "prio": 2, "quantum": 1514}
    got = parse_htb_class(_htb_class(parms))
    assert got.params == HtbParams(0x474C0101, 0x474C0100, 100_000_000, 200_000_000, 2, 1514)
    assert (got.bytes, got.packets, got.drops, got.backlog, got.qlen, got.overlimits) == (
        1500, 1, 2, 3, 4, 5)
    # Past 2^32 bytes/s (34 Gbit/s) the kernel's 32-bit fields saturate; the 64-bit
    # attributes hold the rates.
    big = {**parms, "rate": 0xFFFFFFFF, "ceil": 0xFFFFFFFF}
    got = parse_htb_class(_htb_class(big, rate64=5_000_000_000, ceil64=12_500_000_000,
                                     stats=False))
    assert (got.params.rate_bps, got.params.ceil_bps) == (40_000_000_000, 100_000_000_000)
    assert (got.bytes, got.packets, got.drops, got.backlog, got.qlen, got.overlimits) == (
        0, 0, 0, 0, 0, 0)  # no statistics: nothing counted


def test_an_attribute_with_no_payload_at_the_end_is_read() -> None:
    data = struct.pack("=HH", 8, 1) + b"abcd" + struct.pack("=HH", 4, 2)
    assert tc_module._attributes(data, 0, len(data)) == {1: (4, 8), 2: (12, 12)}
    # A length past the end stops the walk.
    assert tc_module._attributes(data + struct.pack("=HH", 9, 3), 0, len(data) + 4) == {
        1: (4, 8), 2: (12, 12)}


def test_a_filter_of_another_kind_is_no_u32_node() -> None:
    # The operator's own filters (bpf, say) share the dump: not read as gradlane's nodes.
    node = _flow_node_bytes()
    assert parse_u32_filter(tcmsg(node)) is not None
    other = node.replace(b"u32\0", b"bpf\0", 1)
    assert parse_u32_filter(tcmsg(other)) is None
