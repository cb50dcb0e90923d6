"""The qdisc manager's pure parts: spec validation, the wanted tree, the filter diff; and
reading its state file."""

import errno
import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pyroute2.netlink.rtnl import (
    RTM_DELQDISC,
    RTM_NEWQDISC,
    RTM_NEWTCLASS,
    RTM_NEWTFILTER,
    TC_H_ROOT,
)

from gradlane.daemon.qdisc import (
    ACK_PREF_BASE,
    ACK_WORDS,
    DSCP_PREF_BASE,
    FLOW_HASHKEY,
    FLOW_PREF,
    FLOW_TABLE,
    LINK_KEYS,
    MARKER,
    MAX_BANDS,
    MAX_JOBS,
    FlowMatch,
    JobSpec,
    QdiscManager,
    QdiscSpec,
    RootWatch,
    _diff_filters,
    _free_node,
    _wanted_classes,
    _wanted_filters,
)
from gradlane.daemon.tc import U32Filter, bytemap_entries, dscp_key, handle, u32_bytemap
from gradlane.errors import ConfigError

M = 1_000_000


def spec(**kw: object) -> QdiscSpec:
    base: dict[str, object] = {
        "rate_bps": 100 * M,
        "other_rate_bps": 5 * M,
        "jobs": (JobSpec("a", 40 * M, 100 * M), JobSpec("b", 40 * M, 100 * M, prio=2)),
        "dscp_job": "a",
    }
    base.update(kw)
    return QdiscSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rate_bps": 0}, "rate_bps must be positive"),
        ({"other_rate_bps": 200 * M}, "other_rate_bps"),
        ({"bands": ()}, "bands"),
        ({"bands": (46, 46)}, "must differ"),
        ({"bands": (0, 46)}, "DSCP must be in 1..63"),
        ({"quantum": 100}, "quantum"),
        ({"dscp_job": "zzz"}, "dscp_job 'zzz'"),
        ({"jobs": (JobSpec("a", 1, 1), JobSpec("a", 1, 1))}, "unique"),
        ({"jobs": (JobSpec("a", 50 * M, 10 * M),), "dscp_job": None}, "rate_bps <= ceil_bps"),
        ({"jobs": (JobSpec("a", M, 500 * M),), "dscp_job": None}, "root rate"),
        ({"jobs": (JobSpec("a", M, M, prio=9),), "dscp_job": None}, "prio"),
        ({"jobs": (JobSpec("a", M, M, flows=(FlowMatch(band=4),)),), "dscp_job": None}, "band 4"),
        ({"other_prio": 8}, "other_prio must be in 0..7, got 8"),
        ({"bands": tuple(range(1, MAX_BANDS + 2))}, f"need 1..{MAX_BANDS} bands, got 16"),
        ({"jobs": tuple(JobSpec(f"j{i}", 1, 1) for i in range(MAX_JOBS + 1)), "dscp_job": None},
         f"at most {MAX_JOBS} jobs per interface, got {MAX_JOBS + 1}"),
        ({"jobs": (JobSpec("", M, M),), "dscp_job": None}, "a job name must not be empty"),
    ],
)
def test_invalid_specs_are_refused_naming_the_problem(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^invalid qdisc spec: .*" + message):
        spec(**change)


def test_wanted_tree_shape() -> None:
    wanted = _wanted_classes(spec(), {"a": 1, "b": 2})
    ids = list(wanted)
    # every parent is created before its children
    for want in wanted.values():
        if want.parent != TC_H_ROOT:
            assert ids.index(want.parent) < ids.index(want.classid)
    assert wanted[0x474C0001].rate_bps == wanted[0x474C0001].ceil_bps == 100 * M
    assert wanted[0x474C0002].rate_bps == 5 * M and wanted[0x474C0002].prio == 7
    acks = wanted[0x474C0003]  # ACKs first, in a class of their own, up to the root's rate
    assert (acks.parent, acks.prio, acks.ceil_bps) == (0x474C0001, 0, 100 * M)
    # job a (prio 0): leaves prio 0..3; job b (prio 2): 2, 3, 4, 5
    assert [wanted[0x474C0100 + b + 1].prio for b in range(4)] == [0, 1, 2, 3]
    assert [wanted[0x474C0200 + b + 1].prio for b in range(4)] == [2, 3, 4, 5]
    leaf = wanted[0x474C0104]
    assert leaf.parent == 0x474C0100 and leaf.ceil_bps == 100 * M
    assert leaf.rate_bps <= leaf.ceil_bps // 1000  # leaves live on borrowed bandwidth


FLOW = FlowMatch(1, src="10.0.0.1", sport=40000, dst="10.0.0.2", dport=5000)
TABLE = U32Filter(FLOW_PREF, 0, frozenset(), FLOW_TABLE, divisor=256)
LINK = U32Filter(FLOW_PREF, 0, u32_bytemap(LINK_KEYS), 0x80000001, link=FLOW_TABLE,
                 hashkey=FLOW_HASHKEY, terminal=False)  # fmt: skip


def flow_node(flow: FlowMatch, classid: int, node: int = 1) -> U32Filter:
    """`flow` as the kernel reports it in its bucket of the hash table."""
    bucket = flow.bucket()
    assert bucket is not None
    return U32Filter(FLOW_PREF, classid, u32_bytemap(flow.keys()), FLOW_TABLE | bucket << 12 | node)


def test_filters_existing_in_kernel_are_kept_and_missing_ones_added() -> None:
    s = spec(jobs=(JobSpec("a", M, 100 * M, flows=(FLOW,)),))
    want = _wanted_filters(s, {"a": 1})
    dscp0 = U32Filter(DSCP_PREF_BASE, 0x474C0101, u32_bytemap([dscp_key(46)]))
    flow = flow_node(FLOW, 0x474C0102)
    gone = flow_node(FlowMatch(2, dport=6000), 0x474C0103)
    older = U32Filter(0x101, 0x474C0103, u32_bytemap(FlowMatch(2, dport=6000).keys()))
    wrong_dscp = U32Filter(DSCP_PREF_BASE + 1, 0x474C0102, u32_bytemap([dscp_key(10)]))
    diff = _diff_filters(want, [dscp0, TABLE, LINK, flow, gone, older, wrong_dscp])
    # a flow that left goes alone; a priority per flow (an older gradlane's) and a
    # wrong DSCP fallback go whole; the table stays
    assert diff.drop_prefs == {0x101, DSCP_PREF_BASE + 1} and diff.drop_nodes == [gone]
    # the ACKs' filters (a TCP header of 5..15 words), DSCP bands 1..3
    assert [(w.pref, w.classid) for w in diff.add] == [
        (ACK_PREF_BASE + words, 0x474C0003) for words in range(5, 16)] + [
        (DSCP_PREF_BASE + band, 0x474C0101 + band) for band in (1, 2, 3)]
    assert not diff.build_table and diff.retarget == []
    diff = _diff_filters(want, [])
    assert diff.build_table and len(diff.add) == 11 + 4 + 1 and diff.drop_prefs == set()
    ours = U32Filter(ACK_PREF_BASE + 8, 0x474C0003, acks(8))
    assert ACK_PREF_BASE + 8 not in _diff_filters(want, [ours]).drop_prefs  # kept as it is


def tcp_packet(flags: int, data: int = 0, options: int = 12, ip_options: int = 0) -> bytes:
    """The IPv4 and TCP headers of a segment: `options` bytes of TCP options (12: the
    timestamps), `data` bytes of payload after them."""
    ihl = 5 + ip_options // 4
    tcp_len = 20 + options
    ip = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 4 * ihl + tcp_len + data, 0, 0, 64, 6, 0,
                     bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])) + bytes(ip_options)
    tcp = struct.pack("!HHIIBBHHH", 40000, 5201, 1, 1, (tcp_len // 4) << 4, flags, 0, 0, 0)
    return ip + tcp + bytes(options)


def acks(words: int) -> bytes:
    """The match of the ACKs' filter of a TCP header of `words` words, as the manager wants it."""
    [match] = [w.bytemap for w in _wanted_filters(spec(), {"a": 1, "b": 2})
               if w.pref == ACK_PREF_BASE + words]
    return match


def first(packet: bytes) -> bool:
    """Whether one of the ACKs' filters takes `packet`."""
    return any(all(packet[off] & mask == value for off, value, mask in bytemap_entries(acks(w)))
               for w in ACK_WORDS)


@pytest.mark.parametrize(("packet", "ahead"), [
    (tcp_packet(0x10), True),  # an ACK with timestamps: 52 bytes
    (tcp_packet(0x10, options=0), True),  # without: 40
    (tcp_packet(0x10, options=24), True),  # timestamps and a SACK block
    (tcp_packet(0x10, options=40), True),  # the most options a header holds
    (tcp_packet(0x11), True),  # FIN, no data
    (tcp_packet(0x12), True),  # SYN-ACK
    (tcp_packet(0x10, data=1448), False),  # a full segment
    (tcp_packet(0x18, data=1), False),  # one byte of data: it would overtake its band's
    (tcp_packet(0x18, data=4, options=0), False),  # as long as a header with options
    (tcp_packet(0x02), False),  # SYN: no ACK flag
    (tcp_packet(0x10, ip_options=4), False),  # IP options: the TCP header is elsewhere
], ids=["ack", "ack-no-timestamps", "sack", "40-bytes-of-options", "fin", "syn-ack",
        "segment", "one-byte", "four-bytes", "syn", "ip-options"])
def test_the_acks_filters_take_pure_acks_and_nothing_with_data(packet: bytes, ahead: bool
                                                                ) -> None:
    assert first(packet) is ahead
    udp = bytearray(packet)
    udp[9] = 17
    assert not first(bytes(udp))


@pytest.mark.parametrize("left", [[TABLE], [LINK], [TABLE, flow_node(FLOW, 0x474C0102)]],
                         ids=["table-without-link", "link-without-table", "no-link"])
def test_a_flow_table_half_there_is_built_again(left: list[U32Filter]) -> None:
    # What a crash between the table and its link, or someone's `tc filter del`, leaves:
    # the flows' priority goes whole and is built again, not used as it is.
    want = _wanted_filters(spec(jobs=(JobSpec("a", M, 100 * M, flows=(FLOW,)),)), {"a": 1})
    diff = _diff_filters(want, left)
    assert diff.build_table and FLOW_PREF in diff.drop_prefs


def test_a_flow_moved_to_another_band_is_retargeted_in_place() -> None:
    moved = FlowMatch(3, FLOW.src, FLOW.sport, FLOW.dst, FLOW.dport)
    want = _wanted_filters(spec(jobs=(JobSpec("a", M, 100 * M, flows=(moved,)),)), {"a": 1})
    node = flow_node(FLOW, 0x474C0102)
    diff = _diff_filters(want, [TABLE, LINK, node])
    assert [(old, item.classid) for old, item in diff.retarget] == [(node, 0x474C0104)]
    assert [w for w in diff.add if w.pref == FLOW_PREF] == [] and diff.drop_nodes == []


def test_a_flow_out_of_its_bucket_is_replaced() -> None:
    want = _wanted_filters(spec(jobs=(JobSpec("a", M, 100 * M, flows=(FLOW,)),)), {"a": 1})
    in_root = U32Filter(FLOW_PREF, 0x474C0102, u32_bytemap(FLOW.keys()), 0x80000002)
    diff = _diff_filters(want, [TABLE, LINK, in_root])
    assert diff.drop_nodes == [in_root]
    assert [w.bucket for w in diff.add if w.pref == FLOW_PREF] == [FLOW.bucket()]


@pytest.mark.parametrize(
    "link",
    [
        replace(LINK, terminal=True),  # would end classification before the DSCP fallbacks
        replace(LINK, hashkey=(0xFF, 20)),
        replace(LINK, link=0x12300000),
    ],
)
def test_a_broken_flow_table_is_rebuilt(link: U32Filter) -> None:
    want = _wanted_filters(spec(jobs=(JobSpec("a", M, 100 * M, flows=(FLOW,)),)), {"a": 1})
    diff = _diff_filters(want, [TABLE, link, flow_node(FLOW, 0x474C0102)])
    assert diff.build_table and FLOW_PREF in diff.drop_prefs
    assert [w.classid for w in diff.add if w.pref == FLOW_PREF] == [0x474C0102]


def test_the_flow_table_stays_when_the_last_flow_goes() -> None:
    want = _wanted_filters(spec(), {"a": 1, "b": 2})
    node = flow_node(FLOW, 0x474C0102)
    diff = _diff_filters(want, [TABLE, LINK, node])
    assert FLOW_PREF not in diff.drop_prefs and diff.drop_nodes == [node]
    assert not diff.build_table


def test_flows_hash_on_bits_1_to_8_of_the_destination_port() -> None:
    # the kernel's bucket: (port word & 0x1fe) >> 1, the port word being sport << 16 | dport
    assert FlowMatch(0, dport=5301).bucket() == (5301 & 0x1FE) >> 1 == 0x5A
    evens = {FlowMatch(0, dport=32768 + 2 * i).bucket() for i in range(256)}
    assert evens == set(range(256))  # connect()'s even ephemeral ports fill every bucket
    assert FlowMatch(0, sport=5301).bucket() is None  # no port to hash: the root table


def test_a_bucket_holds_at_most_4095_flows() -> None:
    same_bucket = tuple(FlowMatch(0, sport=1 + i, dport=5000) for i in range(4096))
    with pytest.raises(ConfigError, match="at most 4095 registered flows in one hash bucket"):
        spec(jobs=(JobSpec("a", M, 100 * M, flows=same_bucket),))
    spread = tuple(FlowMatch(0, sport=1 + i % 60000, dport=1 + i % 65535) for i in range(40_000))
    spec(jobs=(JobSpec("a", M, 100 * M, flows=spread),))  # far beyond 2,047 priorities
    no_port = tuple(FlowMatch(0, sport=1 + i) for i in range(4095))
    with pytest.raises(ConfigError, match="at most 4094 registered flows without a destination"):
        spec(jobs=(JobSpec("a", M, 100 * M, flows=no_port),))


def test_root_watch_hears_roots_deleted_or_replaced_not_its_own_nor_classes() -> None:
    def message(kind: int, ifindex: int, qhandle: int, parent: int, pad: int = 0) -> bytes:
        body = struct.pack("=BxxxiIII", 0, ifindex, qhandle, parent, 0) + b"\0" * pad
        header = struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0)  # length before padding
        return header + body + b"\0" * (-len(body) % 4)

    ours, theirs = handle(MARKER, 0), handle(0x8001, 0)
    heard = RootWatch.roots_in(b"".join([
        message(RTM_NEWQDISC, 2, ours, TC_H_ROOT),  # gradlane's own tree installed
        message(RTM_NEWTCLASS, 3, handle(MARKER, 1), ours),  # classes and filters: not roots
        message(RTM_NEWTFILTER, 4, 0, ours),
        message(RTM_NEWQDISC, 5, handle(0x10, 0), handle(MARKER, 0x101), pad=3),  # not a root
        message(RTM_DELQDISC, 6, ours, TC_H_ROOT, pad=1),  # `tc qdisc del ... root`
        message(RTM_NEWQDISC, 7, theirs, TC_H_ROOT),  # someone else's root put in
    ]))
    assert heard == {6, 7}
    assert RootWatch.roots_in(b"\x08\0\0\0" + b"\0" * 40) == set()  # a bad length: no loop


def test_root_watch_that_overflowed_says_anything_may_have_changed() -> None:
    # The kernel drops messages a full socket cannot take and says ENOBUFS once: every
    # tree must then be looked at, and what was read after it still counts.
    deleted = struct.pack("=IHHII", 36, RTM_DELQDISC, 0, 0, 0) + struct.pack(
        "=BxxxiIII", 0, 9, handle(MARKER, 0), TC_H_ROOT, 0)
    reads: list[bytes | OSError] = [OSError(errno.ENOBUFS, "No buffer space"), deleted,
                                    BlockingIOError()]

    class Overflowed:
        def recv(self, size: int) -> bytes:
            word = reads.pop(0)
            if isinstance(word, OSError):
                raise word
            return word

    watch = RootWatch()
    try:
        real, watch._sock = watch._sock, Overflowed()  # type: ignore[assignment]
        assert watch.roots_changed() == {RootWatch.ALL, 9}
        assert reads == []
        reads.append(OSError(errno.EBADF, "Bad file descriptor"))
        with pytest.raises(OSError, match="Bad file descriptor"):  # not taken for an overflow
            watch.roots_changed()
    finally:
        real.close()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"original": {"nope": 1}}',
                                  '{"slots": {"a": "one"}}', '{"original": 5}'])
def test_a_state_file_it_cannot_read_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    state = tmp_path / "qdisc-eth0.json"
    state.write_text(text)
    with pytest.raises(ConfigError, match=f"^unreadable qdisc state file {state}: "):
        QdiscManager("eth0", state_file=state)
    state.write_text('{"original": {"kind": "pfifo", "handle": 65536, "limit": 100}, '
                     '"slots": {"a": 1}}')
    QdiscManager("eth0", state_file=state)  # its own format reads


def test_a_job_keeps_its_slot_and_the_slots_of_jobs_gone_are_taken_again(
        tmp_path: Path) -> None:
    # A daemon serves job after job for months: a job's classes stay where they are while
    # others come and go (their counters with them), and a departed job's slot is free.
    manager = QdiscManager("eth0", state_file=tmp_path / "q.json")  # no kernel asked
    for i in range(MAX_JOBS + 5):  # more jobs over time than slots at once
        slots = manager._assign_slots(spec(jobs=(JobSpec("long", M, 100 * M),
                                                 JobSpec(f"short{i}", M, 100 * M)), dscp_job=None))
        assert slots == {"long": 1, f"short{i}": 2}
        manager._state.slots = slots
    full = spec(jobs=tuple(JobSpec(f"j{i}", M, 100 * M) for i in range(MAX_JOBS)), dscp_job=None)
    assert manager._assign_slots(full) == {f"j{i}": i + 1 for i in range(MAX_JOBS)}  # all at once


def test_the_state_file_s_directory_is_made(tmp_path: Path) -> None:
    # gradlaned's state_dir (/run/gradlane) may not exist yet at its first start.
    state = tmp_path / "run" / "gradlane" / "qdisc-eth0.json"
    manager = QdiscManager("eth0", state_file=state)  # no kernel asked
    manager._save_state()
    assert json.loads(state.read_text())["ifname"] == "eth0"


def test_new_flows_take_the_lowest_free_nodes_of_their_table() -> None:
    # Node ids are 12 bits: flows that come and go must reuse the holes they leave.
    bucket, other, root = FLOW_TABLE | 5 << 12, FLOW_TABLE | 6 << 12, 0x80000000
    used = {bucket | 1, bucket | 3, root | 1}
    cursors: dict[int, int] = {}
    got = []
    for table in (bucket, bucket, other, bucket, root, root):
        got.append(_free_node(table, used, cursors))
        used.add(got[-1])
    assert got == [bucket | 2, bucket | 4, other | 1, bucket | 5, root | 2, root | 3]
    full = {bucket | node for node in range(1, 0xFFF)}
    assert _free_node(bucket, full, {}) == bucket | 0xFFF  # the last one there is
    full.add(bucket | 0xFFF)
    with pytest.raises(ConfigError, match="no free u32 node in table 474:5:"):
        _free_node(bucket, full, {})
    assert _free_node(root, set(), {}) == root | 2  # the link is the root table's first node


def test_each_flow_s_match_is_worked_out_once_while_it_stays() -> None:
    # Every reconcile wants every flow again: their byte maps are kept between calls, for
    # the flows still wanted only (a host's flows come and go by the thousand).
    other = FlowMatch(2, src="10.0.0.1", sport=40001, dst="10.0.0.3", dport=5000)
    matches: dict[Any, Any] = {}
    def flows(wanted: list[Any]) -> list[Any]:
        return [w for w in wanted if w.pref == FLOW_PREF]

    first = flows(_wanted_filters(spec(jobs=(JobSpec("a", M, 100 * M, flows=(FLOW, other)),)),
                                  {"a": 1}, matches))
    assert len(matches) == 2
    moved = FlowMatch(3, FLOW.src, FLOW.sport, FLOW.dst, FLOW.dport)  # the same 5-tuple
    again = flows(_wanted_filters(spec(jobs=(JobSpec("a", M, 100 * M, flows=(moved,)),)),
                                  {"a": 1}, matches))
    assert again[0].bytemap is first[0].bytemap and again[0].classid == 0x474C0104
    assert list(matches.values()) == [first[0].bytemap]  # `other` is gone
    assert first[1].bytemap == u32_bytemap(other.keys()) != first[0].bytemap
