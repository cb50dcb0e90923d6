"""The qdisc manager: a desired state in, an HTB tree with u32 filters out.

The tree gradlane owns on an interface (handle major 0x474c, "GL", is the
marker by which a later manager recognizes it after a crash)::

    474c:      htb root qdisc, unclassified traffic -> 474c:2
    474c:1     root class, rate = ceil = QdiscSpec.rate_bps (a little under line rate)
    474c:2       other traffic: guaranteed other_rate_bps, may borrow up to the root
    474c:3       pure TCP ACKs, of every job and band: first (prio 0), up to the root
    474c:S00     one class per job (slot S = 1..254): rate/ceil from the plan
    474c:S0B       one leaf per band B (1-based): near-strict priority

Priority. HTB guarantees every class its own `rate` and arbitrates only the
*excess* by `prio`, and it uses the leaves' prio at every level (an inner
class's prio is not used by the kernel). So leaves get a tiny rate, borrow
everything up to the job's ceil, and carry prio = min(7, job prio + band):
band 0 of a prio-0 job goes first, and a lower band gets only what the higher
ones leave (measured: >= 90% of the link to band 0 when both are saturating).

ACKs. Every exchange sends both ways at once, and a TCP flow is clocked by the
ACKs its peer sends on the same connection, which belong to the same band there:
a low band's ACKs queued behind the peer's higher bands, on their leaf's tiny
guaranteed rate, starved the flow (measured, 96 Mbit/s, band 0 data coming
back: 18 Mbit/s against 92 alone). So IPv4 TCP segments with the ACK flag and
no data go first, in a class of their own, whatever band their connection is
in: they weigh on the link next to nothing. Only those: a segment with data,
however small, sent ahead of its connection's earlier ones queued in its band,
would arrive out of order. u32 cannot compare the total length with the TCP
header's, so there is one filter per TCP header length (5..15 words), each
matching that length and a total length of exactly the two headers.

Classification, first match wins: the pure ACKs, then the registered flows
(IPv4 TCP 5-tuple -> the job's leaf for that band), then one filter per band
on its DSCP (-> the leaves of `QdiscSpec.dscp_job`), then the root's default
class. The flows live in one u32 filter (`FLOW_PREF`) as nodes of a 256-bucket
hash table keyed on bits 1-8 of the destination port (the port that varies on
both ends of a connection: the peer's listening port or its ephemeral one), so
a packet is compared with the few flows of its bucket, not with every flow on
the host: each filter priority of its own is one more classifier every packet
walks through (measured on a veth, one TCP stream: 18 Gbit/s with none, 7.4
with 2,000), and the kernel has at most 2,047 of them per qdisc. A flow
without a destination port sits in the filter's root table, after the link to
the hash table. One flow is added, retargeted or removed as one node, by a
handle the manager chooses.

`QdiscManager.apply` diffs the spec against what the kernel reports and sends
only the differences: the same spec twice sends nothing; one job's new rate
changes one class. The interface's original root qdisc is recorded in a state
file before gradlane replaces it, and `restore` puts it back exactly.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST
from pyroute2.netlink.rtnl import (
    RTM_DELQDISC,
    RTM_DELTFILTER,
    RTM_NEWQDISC,
    RTM_NEWTFILTER,
    TC_H_ROOT,
)

from gradlane.daemon.protocol import DEFAULT_BAND_DSCP
from gradlane.daemon.tc import (
    TC_U32_ROOT,
    ByteMap,
    HtbClass,
    HtbParams,
    U32Filter,
    U32Key,
    dscp_key,
    fmt_handle,
    fmt_u32_handle,
    handle,
    htb_class_kwargs,
    ipv4_tcp_keys,
    parse_htb_class,
    parse_u32_filter,
    translated,
    u32_bytemap,
    u32_message,
)
from gradlane.errors import ConfigError, ForeignQdiscError, TcError
from gradlane.units import MIN_RATE_BPS, first_of

__all__ = [
    "DEFAULT_BAND_DSCP",
    "MARKER",
    "ClassStats",
    "FlowMatch",
    "JobSpec",
    "QdiscManager",
    "RootQdisc",
    "QdiscSpec",
    "RootWatch",
]

logger = logging.getLogger(__name__)

MARKER = 0x474C  # "GL": the handle major of every object gradlane installs
ROOT = handle(MARKER, 0)
ROOT_CLASS = handle(MARKER, 1)
OTHER_CLASS = handle(MARKER, 2)
ACK_CLASS = handle(MARKER, 3)
MAX_BANDS = 15
LOGGED_CHANGES = 12  # a reconcile's changes listed at INFO, the rest counted
MAX_JOBS = 254
ACK_PREF_BASE = 0x80  # + the TCP header's length in words (5..15): pure ACKs, tried first
FLOW_PREF = 0x100  # the registered flows, tried next
FLOW_TABLE = 0x474 << 20  # their hash table "474:" (a u32 table id: the top 12 bits)
FLOW_BUCKETS = 256
FLOW_HASHKEY = (0x000001FE, 20)  # bits 1-8 of the destination port (ephemeral ports are even)
_HASH_SHIFT = (FLOW_HASHKEY[0] & -FLOW_HASHKEY[0]).bit_length() - 1  # the kernel's: to bit 0
MAX_NODE = 0xFFF  # node ids per bucket: 1..0xFFF
LINK_NODE = 1  # the link's node id in the root table: ahead of flows without a port
DSCP_PREF_BASE = 0x8000  # + band: the DSCP fallbacks, tried after the flows
RESTORABLE_KINDS = ("pfifo", "bfifo")
NETNS_DIR = Path("/run/netns")


@dataclass(frozen=True)
class FlowMatch:
    """An IPv4 TCP flow (None = any) that belongs to one band of a job."""

    band: int
    src: str | None = None
    sport: int | None = None
    dst: str | None = None
    dport: int | None = None

    def keys(self) -> list[tuple[int, int, int]]:
        return ipv4_tcp_keys(self.src, self.sport, self.dst, self.dport)

    def bucket(self) -> int | None:
        """Its bucket of the flow hash table (None: no port to hash, the root table)."""
        if self.dport is None:
            return None
        return (self.dport & FLOW_HASHKEY[0]) >> _HASH_SHIFT


@dataclass(frozen=True)
class JobSpec:
    """One job's class: guaranteed `rate_bps`, at most `ceil_bps`, base prio 0..7."""

    name: str
    rate_bps: int
    ceil_bps: int
    prio: int = 0
    flows: tuple[FlowMatch, ...] = ()


@dataclass(frozen=True)
class QdiscSpec:
    """The desired state of one interface's egress.

    Attributes:
        rate_bps: what the root class shapes to. Set it a few percent under
            the line rate so that the queue, and so the scheduling, sits here
            rather than in the NIC or the switch.
        other_rate_bps: bandwidth guaranteed to traffic that is not gradlane's.
        bands: the DSCP value of each band, band 0 first (highest priority).
        jobs: the job classes.
        dscp_job: the job whose band leaves receive DSCP-marked packets that
            no registered flow claims; None sends them to the other class.
        other_prio: HTB prio of the other class when borrowing (7 = last).
        quantum: bytes per DRR round between classes of equal prio (>= MTU).
    """

    rate_bps: int
    other_rate_bps: int
    bands: tuple[int, ...] = DEFAULT_BAND_DSCP
    jobs: tuple[JobSpec, ...] = ()
    dscp_job: str | None = None
    other_prio: int = 7
    quantum: int = 3028

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ConfigError("invalid qdisc spec: " + "; ".join(problems))

    def _problems(self) -> Iterable[str]:
        if self.rate_bps <= 0:
            yield f"rate_bps must be positive, got {self.rate_bps}"
        if not 0 < self.other_rate_bps <= self.rate_bps:
            yield f"other_rate_bps must be in (0, rate_bps], got {self.other_rate_bps}"
        if not 1 <= len(self.bands) <= MAX_BANDS:
            yield f"need 1..{MAX_BANDS} bands, got {len(self.bands)}"
        if len(set(self.bands)) != len(self.bands):
            yield f"band DSCP values must differ, got {self.bands}"
        for dscp in self.bands:
            if not 0 < dscp < 64:
                yield f"band DSCP must be in 1..63 (0 is unmarked traffic), got {dscp}"
        if not 0 <= self.other_prio <= 7:
            yield f"other_prio must be in 0..7, got {self.other_prio}"
        if self.quantum < 1514:
            yield f"quantum must be at least one frame (1514), got {self.quantum}"
        names = [job.name for job in self.jobs]
        if len(set(names)) != len(names):
            yield f"job names must be unique, got {names}"
        if len(self.jobs) > MAX_JOBS:
            yield f"at most {MAX_JOBS} jobs per interface, got {len(self.jobs)}"
        if self.dscp_job is not None and self.dscp_job not in names:
            yield f"dscp_job {self.dscp_job!r} is not one of the jobs {names}"
        for job in self.jobs:
            if not job.name:
                yield "a job name must not be empty"
            if not 0 < job.rate_bps <= job.ceil_bps <= self.rate_bps:
                yield (
                    f"job {job.name!r}: need 0 < rate_bps <= ceil_bps <= root rate "
                    f"{self.rate_bps}, got {job.rate_bps}/{job.ceil_bps}"
                )
            if not 0 <= job.prio <= 7:
                yield f"job {job.name!r}: prio must be in 0..7, got {job.prio}"
            for flow in job.flows:
                if not 0 <= flow.band < len(self.bands):
                    top = len(self.bands) - 1
                    yield f"job {job.name!r}: flow band {flow.band} outside 0..{top}"
        per_bucket = Counter(flow.bucket() for job in self.jobs for flow in job.flows)
        for bucket, count in per_bucket.items():
            room = MAX_NODE - (LINK_NODE if bucket is None else 0)
            if count > room:
                where = "without a destination port" if bucket is None else "in one hash bucket"
                yield f"at most {room} registered flows {where}, got {count}"


@dataclass(frozen=True)
class ClassStats:
    """Counters of one class gradlane installed, with the rate since the last read."""

    classid: str
    role: str  # "root", "other", "acks", "job" or "band"
    job: str | None
    band: int | None
    rate_bps: int
    ceil_bps: int
    bytes: int
    packets: int
    drops: int
    backlog: int
    qlen: int
    throughput_bps: float | None  # None on the first read of this class


@dataclass(frozen=True)
class RootQdisc:
    """An interface's root qdisc, as `QdiscManager.root` found it."""

    kind: str | None  # None: there is none
    ours: bool  # a gradlane tree (a running gradlaned's, or one a crash left)
    # What `apply` would raise (an operator's own tree it could not restore), else None.
    foreign: ForeignQdiscError | None


@dataclass
class _Original:
    """The root qdisc gradlane replaced: the kernel default, or a fifo to re-create."""

    kind: str
    handle: int
    limit: int | None = None

    @property
    def is_default(self) -> bool:
        # The kernel's own root qdiscs (noqueue, pfifo_fast, mq, ...) have handle 0.
        return self.handle == 0


@dataclass
class _View:
    classes: dict[int, HtbParams]
    filters: list[U32Filter]


@dataclass
class _Persisted:
    original: _Original | None = None
    slots: dict[str, int] = field(default_factory=dict)


def _claim_address(ifname: str) -> bytes:
    return b"\0gradlane/qdisc/" + ifname.encode()


def _claim_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX,
                         socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


class Claim:
    """This process's claim on an interface's root qdisc, so that no two gradlaneds manage
    one: an abstract Unix socket named for the interface. Abstract names belong to a
    network namespace, as interfaces do, and go with the process that holds them, however
    it ends (a tree a crash left is then taken over or restored, as before). Who asks
    (`claim_holder`) is told the holder's pid by the kernel (SO_PEERCRED).

    Raises:
        TcError: EBUSY, another process holds the claim (its pid in the message).
    """

    def __init__(self, ifname: str) -> None:
        self._sock = _claim_socket()
        try:
            self._sock.bind(_claim_address(ifname))
            self._sock.listen(16)
        except OSError as exc:
            self._sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise TcError(exc.errno or errno.EIO, ifname, "claim", str(exc)) from exc
            holder = claim_holder(ifname)
            who = f"gradlaned (pid {holder})" if holder else "another gradlaned"
            raise TcError(errno.EBUSY, ifname, "root qdisc",
                          f"{who} manages it already, in this network namespace: one "
                          "gradlaned per interface (stop that one first)") from None

    def answer(self) -> None:
        """Let go of the askers that connected since the last call (the kernel told them
        who holds the claim); they would fill the backlog."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.close()

    def close(self) -> None:
        self._sock.close()


def claim_holder(ifname: str) -> int | None:
    """The pid of the process that holds `ifname`'s `Claim` in this network namespace: None
    if none does, 0 if one does but its backlog was full."""
    with _claim_socket() as sock:
        try:
            sock.connect(_claim_address(ifname))
        except (BlockingIOError, InterruptedError):  # EAGAIN: its backlog is full
            return 0
        except OSError:  # ECONNREFUSED: no such name
            return None
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", cred)[0]
        return pid


class QdiscManager:
    """Owns the egress root qdisc of one interface.

    Use as a context manager (it holds a netlink socket). `apply` installs or
    updates the tree, `restore` removes it and puts the original back,
    `class_stats` reads the counters. One manager per interface at a time.

    Args:
        ifname: the interface.
        state_file: where the original root qdisc and the job -> class slot
            map are kept, so that a manager started after a crash restores
            the interface exactly. Put it on tmpfs (/run): qdiscs do not
            survive a reboot either.
        netns: the network namespace of the interface (None: the current one).
        clock: monotonic seconds, for throughput between two reads.
        exclusive: `open` claims the interface (`Claim`) for as long as the manager is
            open, and raises if another process holds it: gradlaned's managers are.
    """

    def __init__(
        self,
        ifname: str,
        *,
        state_file: Path,
        netns: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        exclusive: bool = False,
    ) -> None:
        if exclusive and netns is not None:
            raise ValueError("an exclusive manager claims an interface of its own namespace")
        self.ifname = ifname
        self.netns = netns
        self._exclusive = exclusive
        self._claim: Claim | None = None
        self._state_file = Path(state_file)
        self._clock = clock
        self._ipr: IPRoute | None = None
        self._state = self._load_state()
        self._last_bytes: dict[int, tuple[float, int]] = {}
        # What the kernel holds, as last read and since updated with every
        # change sent; None = read it again before the next diff.
        self._view: _View | None = None
        self._matches: dict[_FiveTuple, ByteMap] = {}  # the wanted flows' (`_wanted_filters`)
        self._ifindex: int | None = None
        # Whether this manager has held the root (installed or taken over its tree):
        # a default root found after that means the tree was deleted behind its back.
        self._holding = False

    # -- lifecycle -------------------------------------------------------

    def __enter__(self) -> QdiscManager:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if self._exclusive and self._claim is None:
            self._claim = Claim(self.ifname)  # before anything is read or changed
        if self._ipr is not None:
            return
        if self.netns is not None and not (NETNS_DIR / self.netns).exists():
            # Checked first: pyroute2 leaks a socket when IPRoute(netns=...) fails.
            raise TcError(errno.ENOENT, self.ifname, f"netns {self.netns}")
        with translated(self.ifname, f"netlink socket in netns {self.netns or '(current)'}"):
            # groups=0: pyroute2 joins the link, address, route, neighbour and
            # tc multicast groups by default; this socket never reads events,
            # and parsing every one of the host's cost ~1.5 ms per change.
            if self.netns is None:
                self._ipr = IPRoute(ext_ack=True, groups=0)
            else:
                self._ipr = IPRoute(netns=self.netns, flags=0, ext_ack=True, groups=0)

    def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    @property
    def ipr(self) -> IPRoute:
        if self._ipr is None:
            self.open()
        assert self._ipr is not None
        return self._ipr

    # -- public operations -------------------------------------------------

    def root(self) -> RootQdisc:
        """The interface's root qdisc as it is now, read once."""
        root = self._root_qdisc(self._index())
        if root is None:
            return RootQdisc(None, False, None)
        if _is_ours(root):
            return RootQdisc(str(root.get_attr("TCA_KIND")), True, None)
        try:
            self._snapshot(root)
        except ForeignQdiscError as exc:
            return RootQdisc(str(root.get_attr("TCA_KIND")), False, exc)
        return RootQdisc(str(root.get_attr("TCA_KIND")), False, None)

    def owned(self) -> bool:
        """True if the interface's root qdisc is a gradlane tree (ours or left by a crash)."""
        return self.root().ours

    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]:
        """Make the interface's tree match `spec`; return the changes sent.

        The diff runs against the manager's view of the kernel: read on the
        first call, after an error, and whenever `verify` is set (call it so
        now and then to repair changes made behind gradlane's back); kept up
        to date with every change sent otherwise, so that a small change
        costs only its own netlink messages.

        Raises:
            ForeignQdiscError: the current root qdisc is not gradlane's and
                could not be restored exactly later; nothing was changed.
            TcError: the kernel refused a change (the message names it).
        """
        started = time.perf_counter()
        try:
            changes = self._apply(spec, verify)
        except TcError:
            self._view, self._ifindex = None, None
            raise
        if changes and logger.isEnabledFor(logging.INFO):  # not joined for nobody
            # The first few at INFO (a journal line stays short when hundreds of flows move),
            # every one at DEBUG.
            listed = logger.isEnabledFor(logging.DEBUG) or len(changes) <= LOGGED_CHANGES
            logger.info(
                "%s: %d change(s) in %.2f ms: %s%s",
                self.ifname,
                len(changes),
                (time.perf_counter() - started) * 1000,
                first_of(changes, len(changes) if listed else LOGGED_CHANGES),
                "" if listed else " (the debug log lists them all)",
            )
        return changes

    def _apply(self, spec: QdiscSpec, verify: bool) -> list[str]:
        changes: list[str] = []
        read = False
        if verify or self._view is None:
            read = True
            self._ifindex = None
            index = self._index()
            self._ensure_root(index, changes)
            self._view = _View(
                classes={c.params.classid: c.params for c in self._classes(index)},
                filters=self._filters(index),
            )
        index = self._index()
        slots = self._assign_slots(spec)
        want_classes = _wanted_classes(spec, slots)
        want_filters = _wanted_filters(spec, slots, self._matches)
        view = self._view
        moved = _moved_class(view.classes, want_classes) if read else None
        if moved:
            # Someone else's doing: the kernel moves no class to another parent, and deletes
            # none with children or a filter pointing to it. Start afresh.
            changes.append(f"rebuild the tree: {moved}")
            logger.warning("%s: %s: rebuilding gradlane's tree", self.ifname, moved)
            with translated(self.ifname, "delete root qdisc"):
                self.ipr.tc("del", index=index, handle=ROOT, parent=TC_H_ROOT)
            self._install_root(index, changes)
            self._view = view = _View(classes={}, filters=[])
            self._last_bytes.clear()

        have_classes = dict(view.classes)
        diff = _diff_filters(want_filters, view.filters)
        self._drop_filters(index, diff, view, changes)

        for want in want_classes.values():  # parents come before children
            have = have_classes.get(want.classid)
            stored = want.as_kernel_stores()
            if have is None:
                self._set_class("add-class", index, want)
                changes.append(f"add class {fmt_handle(want.classid)}")
            elif have != stored:
                self._set_class("change-class", index, want)
                changes.append(f"change class {fmt_handle(want.classid)}")
            view.classes[want.classid] = stored

        if diff.build_table:
            self._build_flow_table(index)
            view.filters = [f for f in view.filters if f.pref != FLOW_PREF]
            view.filters += [f for f in self._filters(index) if f.pref == FLOW_PREF]
            changes.append("add flow hash table")
            # The flows against the new table (an adopted one may hold some).
            diff = _diff_filters(want_filters, view.filters)
            self._drop_filters(index, diff, view, changes)
        self._add_filters(index, diff, view, changes)

        stale = [cid for cid in have_classes if cid not in want_classes]
        for classid in sorted(stale, key=lambda cid: cid & 0xFF == 0):  # leaves first
            self._del_class(index, classid)
            del view.classes[classid]
            self._last_bytes.pop(classid, None)
            changes.append(f"delete class {fmt_handle(classid)}")

        if slots != self._state.slots or not self._state_file.exists():
            self._state.slots = slots
            self._save_state()
        return changes

    def restore(self) -> bool:
        """Remove gradlane's tree and put the original root qdisc back.

        Returns False when there was no gradlane tree to remove. The state
        file is removed either way.
        """
        index = self._index()
        root = self._root_qdisc(index)
        restored = False
        if root is not None and _is_ours(root):
            original = self._state.original
            if original is None:
                logger.warning(
                    "%s: gradlane tree without a state file (%s): restoring the kernel default",
                    self.ifname,
                    self._state_file,
                )
            if original is None or original.is_default:
                with translated(self.ifname, "delete root qdisc"):
                    self.ipr.tc("del", index=index, handle=ROOT, parent=TC_H_ROOT)
            else:
                with translated(self.ifname, f"restore root qdisc {original.kind}"):
                    self.ipr.tc(
                        "replace", original.kind, index, original.handle, limit=original.limit
                    )
            restored = True
            logger.info("%s: original root qdisc restored", self.ifname)
        self._state = _Persisted()
        self._state_file.unlink(missing_ok=True)
        self._last_bytes.clear()
        self._view = None
        self._holding = False
        return restored

    def class_stats(self) -> list[ClassStats]:
        """Counters of every class gradlane installed, with throughput since the last call."""
        if self._claim is not None:
            self._claim.answer()  # read as often as gradlaned reads its counters
        index = self._index()
        now = self._clock()
        names = {slot: name for name, slot in self._state.slots.items()}
        out = []
        for cls in sorted(self._classes(index), key=lambda c: c.params.classid):
            previous = self._last_bytes.get(cls.params.classid)
            self._last_bytes[cls.params.classid] = (now, cls.bytes)
            throughput = None
            if previous is not None and now > previous[0]:
                throughput = (cls.bytes - previous[1]) * 8 / (now - previous[0])
            role, job, band = _describe(cls.params.classid, names)
            out.append(
                ClassStats(
                    classid=fmt_handle(cls.params.classid),
                    role=role,
                    job=job,
                    band=band,
                    rate_bps=cls.params.rate_bps,
                    ceil_bps=cls.params.ceil_bps,
                    bytes=cls.bytes,
                    packets=cls.packets,
                    drops=cls.drops,
                    backlog=cls.backlog,
                    qlen=cls.qlen,
                    throughput_bps=throughput,
                )
            )
        return out

    def addresses(self) -> set[str]:
        """The interface's IPv4 addresses (flows from these leave through it)."""
        index = self._index()
        with translated(self.ifname, "dump addresses"):
            msgs = self.ipr.get_addr(index=index, family=socket.AF_INET)
        return {m.get_attr("IFA_ADDRESS") for m in msgs}

    def leaf_classid(self, job: str, band: int) -> int:
        """The classid of `job`'s leaf for `band` (after `apply` placed the job)."""
        try:
            return handle(MARKER, (self._state.slots[job] << 8) | (band + 1))
        except KeyError:
            raise ConfigError(f"job {job!r} has no class on {self.ifname}") from None

    # -- kernel access ---------------------------------------------------

    def _index(self) -> int:
        if self._ifindex is not None:
            return self._ifindex
        with translated(self.ifname, "interface lookup"):
            found = self.ipr.link_lookup(ifname=self.ifname)
        if not found:
            where = f" in netns {self.netns}" if self.netns else ""
            raise TcError(errno.ENODEV, self.ifname, "", f"no such interface{where}")
        self._ifindex = int(found[0])
        return self._ifindex

    def _root_qdisc(self, index: int) -> Any | None:
        with translated(self.ifname, "dump qdiscs"):
            qdiscs = self.ipr.get_qdiscs(index)
        for qdisc in qdiscs:
            if qdisc["parent"] == TC_H_ROOT:
                return qdisc
        return None

    def _classes(self, index: int) -> list[HtbClass]:
        with translated(self.ifname, "dump classes"):
            msgs = self.ipr.get_classes(index)
        found = [
            parse_htb_class(m)
            for m in msgs
            if m.get_attr("TCA_KIND") == "htb" and m["handle"] >> 16 == MARKER
        ]
        return found

    def _filters(self, index: int) -> list[U32Filter]:
        with translated(self.ifname, "dump filters"):
            msgs = self.ipr.get_filters(index, parent=ROOT)
        return [f for f in map(parse_u32_filter, msgs) if f is not None]

    def _ensure_root(self, index: int, changes: list[str]) -> None:
        root = self._root_qdisc(index)
        if root is not None and _is_ours(root):
            self._holding = True
            return
        found = self._snapshot(root)
        if self._holding and found.is_default and self._state.original is not None:
            # Our tree was deleted behind our back (`tc qdisc del ... root`): the kernel's
            # default came back, but what the end restores stays what we found at first.
            logger.warning("%s: gradlane's root qdisc was removed by someone else; "
                           "installing it again", self.ifname)
        else:
            if self._holding:
                logger.warning("%s: gradlane's root qdisc was replaced by %s %s; taking the "
                               "interface over again (that one is restored at the end)",
                               self.ifname, found.kind, fmt_handle(found.handle))
            self._state = _Persisted(original=found)
            self._save_state()
        self._install_root(index, changes)

    def _install_root(self, index: int, changes: list[str]) -> None:
        with translated(self.ifname, "install root qdisc htb 474c:"):
            self.ipr.tc("replace", "htb", index, ROOT, default=OTHER_CLASS & 0xFFFF)
        self._holding = True
        changes.append("install root qdisc")

    def _snapshot(self, root: Any | None) -> _Original:
        if root is None:
            return _Original(kind="none", handle=0)
        kind = root.get_attr("TCA_KIND")
        original = _Original(kind=kind, handle=root["handle"])
        if original.is_default:
            return original
        if kind in RESTORABLE_KINDS:
            original.limit = root.get_attr("TCA_OPTIONS")["limit"]
            return original
        raise ForeignQdiscError(
            errno.EEXIST,
            self.ifname,
            f"root qdisc {kind} {fmt_handle(root['handle'])}",
            "installed by someone else and not restorable by gradlane (it restores the "
            "kernel default and pfifo/bfifo roots); remove it first if gradlane should "
            "own this interface",
        )

    def _set_class(self, command: str, index: int, want: HtbParams) -> None:
        kwargs = htb_class_kwargs(want.rate_bps, want.ceil_bps, want.prio, want.quantum)
        with translated(self.ifname, f"{command} {fmt_handle(want.classid)}"):
            self.ipr.tc(command, "htb", index, want.classid, parent=want.parent, **kwargs)

    def _del_class(self, index: int, classid: int) -> None:
        with translated(self.ifname, f"delete class {fmt_handle(classid)}"):
            self.ipr.tc("del-class", index=index, handle=classid)

    def _u32(self, op: str, index: int, pref: int, node: int, **options: Any) -> None:
        """`op` ("add", "change" or "delete") one u32 node of priority `pref`
        (`gradlane.daemon.tc.u32_message` for `options`). Node 0: the kernel picks
        the handle of an added node; a delete removes the whole priority."""
        flags = NLM_F_REQUEST | NLM_F_ACK
        if op == "add":
            flags |= NLM_F_CREATE | NLM_F_EXCL
        elif op == "change":
            flags |= NLM_F_REPLACE
        msg = u32_message(index, ROOT, pref, node, **options)
        msg["header"]["type"] = RTM_DELTFILTER if op == "delete" else RTM_NEWTFILTER
        msg["header"]["flags"] = flags
        what = f"{op} u32 node {fmt_u32_handle(node)}" if node else f"{op} filter"
        with translated(self.ifname, f"{what} pref {pref:#x}"):
            self.ipr.nlm_request_batch([msg])

    def _drop_filters(self, index: int, diff: _FilterDiff, view: _View, changes: list[str]) -> None:
        for pref in sorted(diff.drop_prefs):
            self._u32("delete", index, pref, 0)
            view.filters = [f for f in view.filters if f.pref != pref]
            changes.append(f"delete filter pref {pref:#x}")
        for node in diff.drop_nodes:
            self._u32("delete", index, FLOW_PREF, node.handle)
            changes.append(f"delete flow {fmt_u32_handle(node.handle)}")
        if diff.drop_nodes:  # one pass: thousands of flows may leave at once
            gone = {node.handle for node in diff.drop_nodes}
            view.filters = [f for f in view.filters if f.pref != FLOW_PREF or f.handle not in gone]

    def _add_filters(self, index: int, diff: _FilterDiff, view: _View, changes: list[str]) -> None:
        for node, item in diff.retarget:  # a registered flow moved to another band
            self._u32("change", index, FLOW_PREF, node.handle, match=item.bytemap,
                      classid=item.classid)
            target = fmt_handle(item.classid)
            changes.append(f"change flow {fmt_u32_handle(node.handle)} -> {target}")
        if diff.retarget:
            moved = {node.handle: item.classid for node, item in diff.retarget}
            view.filters = [
                replace(f, classid=moved[f.handle]) if f.pref == FLOW_PREF and f.handle in moved
                else f
                for f in view.filters
            ]
        flow_nodes = [f for f in view.filters if f.pref == FLOW_PREF]
        used = {f.handle for f in flow_nodes}
        root = next((f.handle & 0xFFF00000 for f in flow_nodes if f.link), 0)
        cursors: dict[int, int] = {}
        for item in diff.add:
            if item.pref != FLOW_PREF:  # an ACKs' or a DSCP fallback: a priority of its own
                self._u32("add", index, item.pref, 0, match=item.bytemap, classid=item.classid,
                          table=TC_U32_ROOT)  # fmt: skip
                view.filters.append(U32Filter(item.pref, item.classid, item.bytemap))
                changes.append(f"add filter pref {item.pref:#x} -> {fmt_handle(item.classid)}")
                continue
            table = TC_U32_ROOT if item.bucket is None else FLOW_TABLE | item.bucket << 12
            new = _free_node(root if item.bucket is None else table, used, cursors)
            self._u32("add", index, FLOW_PREF, new, match=item.bytemap, classid=item.classid,
                      table=table)  # fmt: skip
            used.add(new)
            view.filters.append(U32Filter(FLOW_PREF, item.classid, item.bytemap, new))
            changes.append(f"add flow {fmt_u32_handle(new)} -> {fmt_handle(item.classid)}")

    def _build_flow_table(self, index: int) -> None:
        """Create the flows' hash table and, first in `FLOW_PREF`'s root table, the link to it."""
        try:
            self._u32("add", index, FLOW_PREF, FLOW_TABLE, divisor=FLOW_BUCKETS)
        except TcError as exc:
            if exc.errno != errno.EEXIST:
                raise
            # The table outlived its filter priority: the kernel keeps u32 tables while
            # other u32 filters share the qdisc (and frees one only some time after its
            # last link goes, so it is never deleted here). The link adopts it.
            logger.info("%s: adopting the flow hash table already in the kernel", self.ifname)
        self._u32("add", index, FLOW_PREF, LINK_NODE, match=_LINK_MATCH, table=TC_U32_ROOT,
                  link=FLOW_TABLE, hashkey=FLOW_HASHKEY)  # fmt: skip

    # -- persisted state -------------------------------------------------

    def _assign_slots(self, spec: QdiscSpec) -> dict[str, int]:
        names = {job.name for job in spec.jobs}
        slots = {n: s for n, s in self._state.slots.items() if n in names}
        free = iter(sorted(set(range(1, MAX_JOBS + 1)) - set(slots.values())))
        for job in spec.jobs:
            if job.name not in slots:
                slots[job.name] = next(free)
        return slots

    def _load_state(self) -> _Persisted:
        try:
            raw = json.loads(self._state_file.read_text())
            original = raw.get("original")
            return _Persisted(
                original=_Original(**original) if original else None,
                slots={str(k): int(v) for k, v in raw.get("slots", {}).items()},
            )
        except FileNotFoundError:
            return _Persisted()
        # Not JSON, or JSON of another shape (edited by hand, or another version's).
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"unreadable qdisc state file {self._state_file}: {exc}") from exc

    def _save_state(self) -> None:
        original = self._state.original
        raw = {
            "ifname": self.ifname,
            "original": None if original is None else vars(original),
            "slots": self._state.slots,
        }
        self._state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(raw, indent=1))
        os.replace(tmp, self._state_file)



class RootWatch:
    """The kernel's word of root qdiscs replaced or deleted, in this network namespace.

    A netlink socket in rtnetlink's tc group (no privilege needed), read without
    blocking (`fileno` for an event loop's reader): `roots_changed` says which
    interfaces' root qdisc someone deleted or replaced since it was last called,
    so a tree removed behind gradlane's back is rebuilt at once rather than at
    the next periodic verification. The kernel also announces every class and
    filter change (gradlane's own: one per flow registered): a socket filter
    (classic BPF) drops all but qdisc messages in the kernel, so gradlaned's
    own changes never wake it to read them.
    """

    ALL = -1  # in `roots_changed`: messages were lost (the socket overflowed)
    _RTMGRP_TC = 0x8
    _SO_ATTACH_FILTER = 26
    _NLMSG = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
    _TCMSG = struct.Struct("=BxxxiIII")  # tcmsg: family, ifindex, handle, parent, info
    _BPF = struct.Struct("=HBBI")  # sock_filter: code, jump if true, jump if false, k

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK,
                                   socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                   socket.NETLINK_ROUTE)
        try:
            self._keep_qdisc_messages()
            self._sock.bind((0, self._RTMGRP_TC))
        except OSError:
            self._sock.close()
            raise

    def _keep_qdisc_messages(self) -> None:
        # A = nlmsg_type (ld h reads big-endian, hence htons); keep the message if it is
        # RTM_NEWQDISC or RTM_DELQDISC, else drop it.
        ld_h_abs, jeq_k, ret_k = 0x28, 0x15, 0x06
        program = b"".join([
            self._BPF.pack(ld_h_abs, 0, 0, 4),
            self._BPF.pack(jeq_k, 2, 0, socket.htons(RTM_NEWQDISC)),
            self._BPF.pack(jeq_k, 1, 0, socket.htons(RTM_DELQDISC)),
            self._BPF.pack(ret_k, 0, 0, 0),
            self._BPF.pack(ret_k, 0, 0, 0xFFFFFFFF),
        ])
        code = ctypes.create_string_buffer(program)  # the kernel copies it in setsockopt
        fprog = struct.pack("@HP", len(program) // self._BPF.size, ctypes.addressof(code))
        self._sock.setsockopt(socket.SOL_SOCKET, self._SO_ATTACH_FILTER, fprog)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def roots_changed(self) -> set[int]:
        """The ifindex of every interface whose root qdisc went or was replaced by one
        not gradlane's since the last call (`ALL` among them if some word was lost)."""
        changed: set[int] = set()
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                return changed
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                changed.add(self.ALL)  # the receive buffer overflowed: anything may have
                continue
            changed |= self.roots_in(data)

    @classmethod
    def roots_in(cls, data: bytes) -> set[int]:
        """The interfaces of the root qdiscs deleted, or added not gradlane's, in one
        read of netlink messages."""
        changed: set[int] = set()
        offset = 0
        while offset + cls._NLMSG.size + cls._TCMSG.size <= len(data):
            length, kind = cls._NLMSG.unpack_from(data, offset)[:2]
            if length < cls._NLMSG.size:
                break
            if kind in (RTM_NEWQDISC, RTM_DELQDISC):
                _, ifindex, qhandle, parent, _ = cls._TCMSG.unpack_from(data, offset
                                                                        + cls._NLMSG.size)
                if parent == TC_H_ROOT and not (kind == RTM_NEWQDISC and qhandle == ROOT):
                    changed.add(ifindex)
            offset += (length + 3) & ~3  # NLMSG_ALIGN
        return changed


def _is_ours(root: Any) -> bool:
    return bool(root.get_attr("TCA_KIND") == "htb" and root["handle"] == ROOT)


def _leaf_rate(ceil_bps: int) -> int:
    # Tiny guaranteed rate: leaves live on borrowed bandwidth, arbitrated by prio.
    return max(ceil_bps // 1000, MIN_RATE_BPS)


def _moved_class(have: dict[int, HtbParams], want: dict[int, HtbParams]) -> str | None:
    """Says the first class of `have` under another parent than `want` puts it, if any."""
    for classid, params in sorted(have.items()):
        wanted = want.get(classid)
        if wanted is not None and wanted.parent != params.parent:
            return (f"class {fmt_handle(classid)} is under {fmt_handle(params.parent)}, "
                    f"not {fmt_handle(wanted.parent)}")
    return None


def _wanted_classes(spec: QdiscSpec, slots: dict[str, int]) -> dict[int, HtbParams]:
    """Desired classes in creation order (every parent before its children)."""
    want = [
        HtbParams(ROOT_CLASS, TC_H_ROOT, spec.rate_bps, spec.rate_bps, 0, spec.quantum),
        HtbParams(
            OTHER_CLASS,
            ROOT_CLASS,
            spec.other_rate_bps,
            spec.rate_bps,
            spec.other_prio,
            spec.quantum,
        ),
        HtbParams(ACK_CLASS, ROOT_CLASS, _leaf_rate(spec.rate_bps), spec.rate_bps, 0, spec.quantum),
    ]
    for job in spec.jobs:
        job_id = handle(MARKER, slots[job.name] << 8)
        want.append(
            HtbParams(job_id, ROOT_CLASS, job.rate_bps, job.ceil_bps, job.prio, spec.quantum)
        )
        for band in range(len(spec.bands)):
            want.append(
                HtbParams(
                    job_id + band + 1,
                    job_id,
                    _leaf_rate(job.ceil_bps),
                    job.ceil_bps,
                    min(7, job.prio + band),
                    spec.quantum,
                )
            )
    return {w.classid: w for w in want}


LINK_KEYS = ipv4_tcp_keys()  # IPv4 TCP with a 20-byte header: the port word at offset 20
_LINK_MATCH = u32_bytemap(LINK_KEYS)


def ack_keys(words: int) -> list[U32Key]:
    """IPv4 TCP segments with a 20-byte IP header, a TCP header of `words` 32-bit words
    (its data offset, the top nibble of byte 32), no data (total length, bytes 2-3: the
    two headers) and the ACK flag (byte 13 of the TCP header, 33 of the packet)."""
    return [*LINK_KEYS, (20 + 4 * words, 0x0000FFFF, 0),
            (words << 28 | 0x00100000, 0xF0100000, 32)]


ACK_WORDS = range(5, 16)  # a TCP header's length in words: 20 to 60 bytes
_LINK = (FLOW_TABLE, FLOW_HASHKEY, False, 0, _LINK_MATCH)  # what `_flow_table_ok` wants


@dataclass(frozen=True)
class _Want:
    """A wanted terminal filter: an ACKs' or a DSCP fallback (`pref` of its own) or a flow
    (`FLOW_PREF`, in `bucket` of the hash table; None: the root table)."""

    pref: int
    bytemap: ByteMap
    classid: int
    bucket: int | None = None


_ACKS = [_Want(ACK_PREF_BASE + words, u32_bytemap(ack_keys(words)), ACK_CLASS)
         for words in ACK_WORDS]


@dataclass
class _FilterDiff:
    drop_prefs: set[int] = field(default_factory=set)  # whole filter priorities to delete
    drop_nodes: list[U32Filter] = field(default_factory=list)  # single flows to delete
    build_table: bool = False  # (re)create the flow hash table and its link first
    add: list[_Want] = field(default_factory=list)
    retarget: list[tuple[U32Filter, _Want]] = field(default_factory=list)  # to another band


_FiveTuple = tuple[str | None, int | None, str | None, int | None]


def _wanted_filters(spec: QdiscSpec, slots: dict[str, int],
                    matches: dict[_FiveTuple, ByteMap] | None = None) -> list[_Want]:
    """The filters `spec` wants, flows first. `matches`: the flows' byte maps by 5-tuple,
    as the last call left them (the caller keeps it): every reconcile wants every
    registered flow again, and parsing the addresses into keys was most of its time
    with thousands of flows, so each flow's is computed once while it stays. On return
    it holds this spec's flows' only."""
    known = {} if matches is None else matches
    now: dict[_FiveTuple, ByteMap] = {}
    out: list[_Want] = list(_ACKS)
    for job in spec.jobs:
        base = handle(MARKER, slots[job.name] << 8)
        for flow in job.flows:
            key = (flow.src, flow.sport, flow.dst, flow.dport)
            bytemap = now.get(key)
            if bytemap is None:
                bytemap = known.get(key)
                if bytemap is None:
                    bytemap = u32_bytemap(ipv4_tcp_keys(*key))
                now[key] = bytemap
            out.append(_Want(FLOW_PREF, bytemap, base + flow.band + 1, flow.bucket()))
    if spec.dscp_job is not None:
        base = handle(MARKER, slots[spec.dscp_job] << 8)
        for band, dscp in enumerate(spec.bands):
            out.append(_Want(DSCP_PREF_BASE + band, u32_bytemap([dscp_key(dscp)]), base + band + 1))
    if matches is not None:
        matches.clear()
        matches.update(now)
    return out


def _bucket_of(node: U32Filter) -> int | None:
    """Where a flow node sits: its hash bucket, None for the root table."""
    if node.handle & 0xFFF00000 == FLOW_TABLE:
        return (node.handle >> 12) & 0xFF
    return None


def _flow_table_ok(nodes: list[U32Filter]) -> bool:
    """Whether `FLOW_PREF` holds the hash table and, first in its root table, the link."""
    table = [n for n in nodes if n.handle == FLOW_TABLE and n.divisor == FLOW_BUCKETS]
    root = sorted(
        (n for n in nodes if not n.divisor and _bucket_of(n) is None),
        key=lambda n: n.handle & 0xFFF,
    )
    if not table or not root:
        return False
    link = root[0]
    return (link.link, link.hashkey, link.terminal, link.classid, link.bytemap) == _LINK


def _diff_filters(want: list[_Want], have: list[U32Filter]) -> _FilterDiff:
    """What to send so that the kernel's filters (`have`) become `want`.

    The ACKs' filters and the DSCP fallbacks are kept or replaced whole (one
    per priority). Flows are kept, retargeted in place (a flow moved to
    another band), deleted or added one node each, within an intact hash
    table (kept when no flow is left); without one, the table is (re)built
    first. Any other priority (e.g. a tree of an older gradlane, with a
    priority per flow) is deleted.
    """
    diff = _FilterDiff()
    by_pref: dict[int, list[U32Filter]] = {}
    for f in have:
        by_pref.setdefault(f.pref, []).append(f)
    flows = [w for w in want if w.pref == FLOW_PREF]
    keep: set[int] = set()
    for item in want:
        if item.pref == FLOW_PREF:
            continue
        found = [f for f in by_pref.get(item.pref, []) if f.classid]
        if len(found) == 1 and (found[0].bytemap, found[0].classid) == (item.bytemap, item.classid):
            keep.add(item.pref)
        else:
            diff.add.append(item)
    nodes = by_pref.get(FLOW_PREF, [])
    if nodes and _flow_table_ok(nodes):  # kept even when empty: see `_build_flow_table`
        keep.add(FLOW_PREF)
        wanted: dict[tuple[int | None, ByteMap], _Want]
        wanted = {(w.bucket, w.bytemap): w for w in flows}
        for node in nodes:
            if not node.classid:
                continue  # the table, the link
            match = wanted.pop((_bucket_of(node), node.bytemap), None)
            if match is None:
                diff.drop_nodes.append(node)
            elif match.classid != node.classid:
                diff.retarget.append((node, match))
        diff.add += wanted.values()
    elif flows:
        diff.build_table = True
        diff.add += flows
    diff.drop_prefs = set(by_pref) - keep
    return diff


def _free_node(table: int, used: set[int], cursors: dict[int, int]) -> int:
    """The lowest free node handle in `table`: a bucket of the hash table, or the
    root table (its handle, from the link's), where the link comes first. `cursors`:
    where each table's search ends, for one `used` that only grows (a bucket of 256
    flows would otherwise be walked from its start for each)."""
    first = 1 if table & 0xFFF00000 == FLOW_TABLE else LINK_NODE + 1
    for node in range(cursors.get(table, first), MAX_NODE + 1):
        if table | node not in used:
            cursors[table] = node + 1
            return table | node
    # QdiscSpec refuses more flows than a table holds.
    raise ConfigError(f"no free u32 node in table {fmt_u32_handle(table)}")


def _describe(classid: int, names: dict[int, str]) -> tuple[str, str | None, int | None]:
    if classid == ROOT_CLASS:
        return "root", None, None
    if classid == OTHER_CLASS:
        return "other", None, None
    if classid == ACK_CLASS:
        return "acks", None, None
    minor = classid & 0xFFFF
    job = names.get(minor >> 8)
    if minor & 0xFF == 0:
        return "job", job, None
    return "band", job, (minor & 0xFF) - 1
