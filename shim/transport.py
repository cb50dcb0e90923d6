"""Worker-to-worker connections: K DSCP-marked TCP connections per peer.

Rendezvous goes through a key-value store (torch.distributed's TCPStore, or
any object with ``set(key, value)`` and ``get(key) -> bytes`` that blocks
until the key exists); only addresses travel through it. Every worker listens
on an ephemeral port, publishes ``addr:port``, connects K times to each of its
peers of lower rank and accepts K connections from each of higher rank. Its
peers are every other rank, or (`Mesh.connect`) the ranks its exchange sends
chunks to (`gradlane.policies.chunks.Routes.peers`). A connection opens with
a fixed hello (magic, rank, band, plane) so the acceptor knows whose and which
band it is.

Every connection carries its band's DSCP in IP_TOS (the TOS byte is
``dscp << 2``; the two low bits are ECN), TCP_NODELAY, and TCP_NOTSENT_LOWAT
so that only ``credit_bytes`` of unsent data sit in the kernel per band.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gradlane.errors import TransportError
from gradlane.openfiles import NoRoom, make_room
from gradlane.policies.chunks import host_groups

__all__ = [
    "MAX_PLANES",
    "Link",
    "Mesh",
    "Store",
    "agree_batch",
    "gather",
    "get_all",
    "local_address",
    "mark",
    "meeting_prefix",
    "reduction_groups",
    "relay",
    "relay_planes",
    "same_host",
    "tensor_bytes",
    "tree_neighbours",
]

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sIII")  # magic, rank, band, plane
# A peer sends its hello as it connects; a connection silent this long is something else.
HELLO_WAIT_S = 10.0
_IPV4_ONLY = "gradlane's transport and gradlaned's filters are IPv4 only"
# The chunk protocol's version (`gradlane.shim.engine`'s frames; 3: PING and PONG): ranks
# of another version drop each other's connections at the hello, not mid-training.
_MAGIC = b"GLS3"
MAX_PLANES = 8


class Store(Protocol):
    """The part of torch.distributed.Store that rendezvous needs."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class Link:
    """One band connection to one peer, over one plane (one NIC of each end)."""

    peer: int
    band: int
    sock: socket.socket
    plane: int = 0

    def five_tuple(self) -> dict[str, object]:
        """The local view ``{band, src, sport, dst, dport}`` (gradlaned's flow)."""
        src, sport = self.sock.getsockname()[:2]
        dst, dport = self.sock.getpeername()[:2]
        return {"band": self.band, "src": src, "sport": sport, "dst": dst, "dport": dport}


# How many times each (name, rank) met its peers in this process (`meeting_prefix`).
_MEETINGS: collections.Counter[tuple[str, int]] = collections.Counter()


def meeting_prefix(name: str, rank: int) -> str:
    """The store keys of `rank`'s next rendezvous under `name` (a job's Sync, its DDP hook):
    the n-th in this process, of this torchrun attempt (TORCHELASTIC_RESTART_COUNT).

    A store can outlive a rendezvous (torchrun's agent holds it across restarts; the
    default process group's lasts the whole run): under the same keys, a rank ahead of
    rank 0 at the next one (attaching again to train unfrozen layers) would read the
    last one's addresses and connect to listeners closed since. Every rank meets its
    peers as many times and in the same order (it runs the same script), so every rank
    names each meeting alike.
    """
    n = _MEETINGS[name, rank]
    _MEETINGS[name, rank] = n + 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"gradlane/{name}/attempt{attempt}/{n}"


def gather(store: Store, key: str, rank: int, world: int, mine: str) -> list[str]:
    """Every rank's post under `key`, in rank order: this rank posts `mine` and waits for
    the others' (the store's timeout bounds the wait).

    Raises:
        TransportError: a rank or the store is gone.
    """
    try:
        store.set(f"{key}/{rank}", mine)
        return [v.decode() for v in get_all(store, [f"{key}/{r}" for r in range(world)])]
    except RuntimeError as exc:  # torch's DistStoreError: a rank or the store is gone
        raise TransportError(f"rank {rank}: rendezvous failed: {exc}") from exc


def get_all(store: Store, keys: list[str]) -> list[bytes]:
    """The values of `keys`, each waited for (the store's timeout bounds the wait), in one
    request to the store where it takes several (torch's stores: ``multi_get``). With
    every rank reading every rank's post, 1,024 ranks make 1,024 requests to the store
    instead of a million.

    Raises:
        RuntimeError: torch's DistStoreError (a key did not come in time, the store is gone).
    """
    many = getattr(store, "multi_get", None)
    if many is None:
        return [store.get(k) for k in keys]
    return list(many(keys))


def rank0_says(store: Store, key: str, rank: int, said: object, previous: str | None = None
               ) -> object:
    """What rank 0 says under `key` (JSON): rank 0 posts `said`, every rank reads it.

    Rank 0 then deletes `previous`, the key of its last such post, when every
    rank is known to have read it (a store that cannot delete keeps it).

    Raises:
        TransportError: rank 0 or the store is gone (the store's timeout bounds the wait).
    """
    try:
        if rank == 0:
            store.set(key, json.dumps(said))
            if previous is not None:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    store.delete_key(previous)
        return json.loads(store.get(key))
    except RuntimeError as exc:  # torch's DistStoreError: a rank or the store is gone
        raise TransportError(f"rank {rank}: rendezvous failed: {exc}") from exc


def reduction_groups(store: Store, prefix: str, rank: int, world: int, leaf: int | None,
                     host: str | None, address: str, exchange: str
                     ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(leaves, hosts): the groups each chunk is reduced within first, each None for none.

    Each rank posts its `leaf` switch (None: unknown), its `host` as its
    gradlaned names it (`DaemonClient.host`; None: no daemon answered) and
    the `address` it listens on, and reads everyone's, in one round.
    Leaves: every rank's when all know theirs and there are several (one
    rank without keeps the whole job off them: every rank must build the
    same reduction trees). Hosts: ranks share one when their gradlaned names
    one, or when they listen on one address (`same_host`); every rank's
    when some share one (`gradlane.policies.chunks.host_groups`). With both,
    two levels: within hosts, then within leaves.
    """
    posts = [json.loads(p) for p in gather(store, f"{prefix}/where", rank, world,
                                           json.dumps([leaf, host, address]))]
    leaves = tuple(-1 if p[0] is None else int(p[0]) for p in posts)
    agreed = None if min(leaves) < 0 or len(set(leaves)) == 1 else leaves
    hosts = same_host([p[1] for p in posts], [str(p[2]) for p in posts])
    return agreed, host_groups([str(h) for h in hosts], exchange)


def same_host(names: Sequence[str | None], addresses: Sequence[str]) -> list[int]:
    """Per rank, the lowest rank on its host: ranks whose gradlaned gave one name (None:
    none did) or that listen on one address share a host, and so do ranks sharing one
    with a same third (a rank whose daemon did not answer in time still joins the ranks
    of its address)."""
    parent = list(range(len(addresses)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for keys in (names, addresses):
        first: dict[str, int] = {}
        for r, key in enumerate(keys):
            if key is not None:
                a, b = root(first.setdefault(key, r)), root(r)
                parent[max(a, b)] = min(a, b)
    return [root(r) for r in range(len(addresses))]


def agree_batch(store: Store, prefix: str, rank: int, world: int, mine: int | None
                ) -> int | None:
    """The job's global batch: the sum of every rank's samples in its first step (None
    if a rank does not know its own, `mine` None).

    The control plane splits it into batch shares (straggler mitigation). It
    is agreed once, before any share is taken: a sum of later steps could mix
    batches of two plans, ranks taking a new plan at different steps.
    """
    posts = [int(p) for p in gather(store, f"{prefix}/batch", rank, world, str(mine or 0))]
    return sum(posts) if min(posts) > 0 else None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's storage (no copy); a 0-dim one's
    too (BatchNorm's batch count, a scalar parameter)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def mark(sock: socket.socket, dscp: int) -> None:
    """Put `dscp` on every packet `sock` sends from now on."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)


def local_address(toward: str) -> str:
    """The local IPv4 address the kernel would use to reach `toward`.

    A connected UDP socket sends nothing; it only asks the routing table.
    """
    try:
        target = socket.gethostbyname(toward)
    except OSError as exc:
        if _ipv6_only(toward):
            raise TransportError(
                f"MASTER_ADDR {toward!r} is IPv6 only, and {_IPV4_ONLY}: give the "
                "rendezvous an IPv4 address (or a host name that has one)"
            ) from exc
        raise TransportError(f"cannot resolve MASTER_ADDR {toward!r}: {exc}") from exc
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))
        except OSError as exc:
            raise TransportError(f"no route to {target} to pick a local address: {exc}") from exc
        address: str = probe.getsockname()[0]
        return address


def _ipv6_only(host: str) -> bool:
    """Whether `host` resolves to IPv6 addresses and no IPv4 one."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    families = {family for family, *_ in found}
    return socket.AF_INET6 in families and socket.AF_INET not in families


def _check_ipv4(address: str) -> None:
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        raise TransportError(f"address {address!r} is not an IPv4 address: {_IPV4_ONLY}") from None


def _tune(sock: socket.socket, dscp: int, credit: int, sndbuf: int) -> None:
    mark(sock, dscp)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, credit)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)


def _room_for(sockets: int, rank: int) -> None:
    """Make room for `sockets` more open files (`gradlane.openfiles.make_room`: a flat
    exchange of 300 ranks needs 1,196 connections a rank; the usual soft limit is
    1,024), or say what to raise.

    Raises:
        TransportError: the hard limit leaves no room.
    """
    try:
        make_room(sockets, f"rank {rank}'s {sockets} connections")
    except NoRoom as no:
        raise TransportError(
            f"rank {rank} needs {sockets} connections and has {no.in_use} files open, over "
            f"the open-file limit of {no.hard}: raise it (ulimit -n, or LimitNOFILE= in a "
            "systemd unit), or reduce within hosts or leaves (fewer connections a rank)"
        ) from None


def tree_neighbours(parents: Sequence[int], rank: int) -> tuple[int, list[int]]:
    """`rank`'s parent in the tree `parents` (each rank's parent, -1 at the root) and its
    children, in rank order."""
    return parents[rank], [r for r, up in enumerate(parents) if up == rank]


def relay(views: Iterable[memoryview], source: socket.socket | None,
          sinks: Sequence[socket.socket], piece_bytes: int, timeout_s: float) -> None:
    """Fill `views` from `source` (None: this rank holds them already) and pass them on to
    each of `sinks`, in order, piece by piece: every `piece_bytes` go on as soon as they
    are in. Down a path of H hops that takes one model's time on the wire and H pieces',
    not H models' (a whole tensor held at each hop before it went on: a 400 MB layer
    would cross an 8-rank ring in 7 of its own times).

    Every rank of the path calls it; the routes must be a tree (no rank waits on
    itself). `timeout_s` bounds each receive and each send.

    Raises:
        OSError: a connection broke, or (TimeoutError) stalled for `timeout_s`.
        ConnectionError: `source` closed before the end.
    """
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
    socks = ([source] if source is not None else []) + list(sinks)
    for sock in socks:
        sock.settimeout(timeout_s)
    try:
        for view in views:
            for start in range(0, len(view), piece_bytes):
                piece = view[start : start + piece_bytes]
                if source is not None:
                    _fill(source, piece, "a piece")
                for sink in sinks:
                    sink.sendall(piece)
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.settimeout(None)


def relay_planes(views: Iterable[memoryview],
                 planes: Sequence[tuple[socket.socket | None, Sequence[socket.socket]]],
                 piece_bytes: int, timeout_s: float) -> None:
    """`relay` over several planes (NICs) at once: `planes` holds each plane's source (None
    on the path's first rank) and sinks. Piece k of the views rides plane k mod P, every
    plane on a thread of its own, so the NICs carry their shares at the same time. Each
    rank of the path cuts the same pieces (the same views and `piece_bytes`), so a piece
    arrives on the plane it is read from.

    Raises:
        ValueError: no plane.
        OSError, ConnectionError: as `relay`: the first plane's at once (its threads,
            daemons, end as their connections close or within `timeout_s`), else the
            first other plane's to fail.
    """
    if not planes:
        raise ValueError("relay_planes needs at least one plane")
    if len(planes) == 1:
        relay(views, planes[0][0], planes[0][1], piece_bytes, timeout_s)
        return
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
    pieces = [view[start : start + piece_bytes] for view in views
              for start in range(0, len(view), piece_bytes)]
    failed: list[BaseException] = []

    def plane(p: int) -> None:
        relay(pieces[p :: len(planes)], planes[p][0], planes[p][1], piece_bytes, timeout_s)

    def other(p: int) -> None:
        try:
            plane(p)
        except BaseException as exc:  # re-raised on the calling thread
            failed.append(exc)

    threads = [threading.Thread(target=other, args=(p,), name=f"gl-copy-{p}", daemon=True)
               for p in range(1, len(planes))]
    for t in threads:
        t.start()
    plane(0)  # here: its failure (or Ctrl-C) goes up at once
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def _fill(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill `view` from `sock`.

    Raises:
        ConnectionError: `sock` closed first (naming `what` and how much came).
    """
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"closed after {got} of {len(view)} bytes of {what}")
        got += n


class Mesh:
    """The band connections of one worker: to every other rank, or to the ranks its
    exchange sends chunks to (`connect`).

    Args:
        rank, world: this worker and the job size.
        store: rendezvous store (keys are namespaced by `prefix`).
        address: the address peers should connect to; or one per plane (a
            NIC of its own, e.g. each on its own switch plane): every rank
            gives as many, and peers connect to each other's k-th address
            from their own k-th, so each plane carries a connection per band
            and peer (`links`, keyed ``(peer, band, plane)``).
        dscp: per-band DSCP, band 0 first.
        credit_bytes, sndbuf_bytes: see `ShimConfig`.
        timeout_s: bound on the rendezvous (`connect`'s).
        connect: connect to every other rank now. Otherwise the mesh only
            listens and posts its addresses until `connect` names the peers
            (`gradlane.policies.chunks.Routes.peers`, known once the ranks agreed
            on their groups): a large job's ranks then hold the connections their
            exchange uses, not K per rank of the job.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        store: Store,
        address: str | Sequence[str],
        dscp: tuple[int, ...],
        *,
        credit_bytes: int,
        sndbuf_bytes: int = 0,
        timeout_s: float = 60.0,
        prefix: str = "gradlane",
        connect: bool = True,
    ) -> None:
        addresses = (address,) if isinstance(address, str) else tuple(address)
        if not 1 <= len(addresses) <= MAX_PLANES or len(set(addresses)) != len(addresses):
            raise TransportError(f"need 1..{MAX_PLANES} distinct addresses (one per NIC), "
                                 f"got {list(addresses)}")
        for a in addresses:
            _check_ipv4(a)
        self.rank, self.world = rank, world
        self.addresses, self.address, self.planes = addresses, addresses[0], len(addresses)
        self.dscp = tuple(dscp)
        self.links: dict[tuple[int, int, int], Link] = {}
        self._store, self._prefix, self._timeout_s = store, prefix, timeout_s
        self._credit, self._sndbuf = credit_bytes, sndbuf_bytes
        self._lock = threading.Lock()  # links and marks: a daemon's table may come meanwhile
        self._listeners: list[socket.socket] = []
        try:
            for a in addresses:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._listeners.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((a, 0))
                listener.listen(max(16, world * len(self.dscp)))
            mine = [f"{a}:{listener.getsockname()[1]}"
                    for a, listener in zip(addresses, self._listeners, strict=True)]
            try:
                store.set(f"{prefix}/addr/{rank}", json.dumps(mine))
            except RuntimeError as exc:  # torch's DistStoreError: the store is gone
                raise TransportError(f"rank {rank}: rendezvous failed: {exc}") from exc
            if connect:
                self.connect(r for r in range(world) if r != rank)
        except BaseException:
            self.close()
            raise

    def connect(self, peers: Iterable[int]) -> None:
        """Open K connections (one per band, on each plane) to each of `peers`: connect to
        the lower ranks, accept the higher ones. Every rank must name the peers that name
        it (`gradlane.policies.chunks.Routes.peers` is symmetric). Once only."""
        wanted = sorted(set(peers))
        if not self._listeners:
            raise TransportError(f"rank {self.rank}: the mesh is connected already")
        if any(not 0 <= p < self.world or p == self.rank for p in wanted):
            raise TransportError(f"rank {self.rank}: peers {wanted} are not other ranks of "
                                 f"{self.world}")
        _room_for(len(wanted) * len(self.dscp) * self.planes, self.rank)
        deadline = time.monotonic() + self._timeout_s
        links: dict[tuple[int, int, int], Link] = {}
        try:
            lower = [p for p in wanted if p < self.rank]
            try:
                where = dict(zip(lower, (json.loads(v) for v in get_all(
                    self._store, [f"{self._prefix}/addr/{p}" for p in lower])), strict=True))
            except RuntimeError as exc:  # torch's DistStoreError: the store or a rank is gone
                raise TransportError(f"rank {self.rank}: rendezvous failed: {exc}") from exc
            for peer in lower:
                if len(where[peer]) != self.planes:
                    raise TransportError(
                        f"rank {self.rank} listens on {self.planes} addresses, rank {peer} on "
                        f"{len(where[peer])}: give every rank one per NIC, as many")
                for plane, spot in enumerate(where[peer]):
                    host, _, peer_port = spot.rpartition(":")
                    for band in range(len(self.dscp)):
                        links[peer, band, plane] = self._connect(
                            peer, band, plane, (host, int(peer_port)), deadline)
            self._accept(links, [p for p in wanted if p > self.rank], deadline)
        except BaseException:
            for link in links.values():
                link.sock.close()
            raise
        finally:
            for listener in self._listeners:
                listener.close()
            self._listeners = []
        with self._lock:  # marked with the table of now: `remark` may have run meanwhile
            for link in links.values():
                mark(link.sock, self.dscp[link.band])
            self.links.update(links)

    def _accept(self, links: dict[tuple[int, int, int], Link], higher: list[int],
                deadline: float) -> None:
        """Take `higher`'s connections into `links` (K per plane each, on the plane's
        listener)."""
        bands, listeners = len(self.dscp), self._listeners
        expected = len(higher) * bands * self.planes
        while expected:
            ready, _, _ = select.select(listeners, [], [], max(0.1, deadline - time.monotonic()))
            if not ready:
                missing = sorted(set(higher) - {peer for peer, _, _ in links})
                raise TransportError(f"rank {self.rank}: ranks {missing} did not connect "
                                     f"within {self._timeout_s:.0f} s")
            for listener in ready:
                sock, _ = listener.accept()
                sock.settimeout(max(0.1, min(HELLO_WAIT_S, deadline - time.monotonic())))
                hello = bytearray(_HELLO.size)
                try:
                    _fill(sock, memoryview(hello), "a hello")
                except OSError:  # closed, reset or silent: a port scan or probe, not a peer
                    sock.close()
                    logger.warning("rank %d: dropped a connection that sent no hello", self.rank)
                    continue
                magic, peer, band, plane = _HELLO.unpack(hello)
                if (magic != _MAGIC or peer not in higher or not 0 <= band < bands
                        or plane != listeners.index(listener) or (peer, band, plane) in links):
                    sock.close()
                    logger.warning("rank %d: dropped a connection with a bad hello", self.rank)
                    continue
                sock.settimeout(None)
                _tune(sock, self.dscp[band], self._credit, self._sndbuf)
                links[peer, band, plane] = Link(peer, band, sock, plane)
                expected -= 1

    def _connect(self, peer: int, band: int, plane: int, where: tuple[str, int],
                 deadline: float) -> Link:
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _tune(sock, self.dscp[band], self._credit, self._sndbuf)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                if self.planes > 1:  # leave by this plane's NIC, whatever the routes say
                    sock.bind((self.addresses[plane], 0))
                sock.connect(where)
                sock.sendall(_HELLO.pack(_MAGIC, self.rank, band, plane))
            except OSError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"rank {self.rank}: cannot connect to rank {peer} at {where}: {exc}"
                    ) from exc
                time.sleep(0.05)
                continue
            sock.settimeout(None)
            return Link(peer, band, sock, plane)

    def link(self, peer: int, band: int, plane: int = 0) -> Link:
        return self.links[(peer, band, plane)]

    def tree(self, parents: Sequence[int]
             ) -> list[tuple[socket.socket | None, list[socket.socket]]]:
        """Per plane, this worker's band-0 sockets in the tree `parents` (each rank's
        parent, -1 at the root): to its parent (None at the root) and to its children,
        as `relay_planes` takes them."""
        source, sinks = tree_neighbours(parents, self.rank)
        return [(self.link(source, 0, plane).sock if source >= 0 else None,
                 [self.link(peer, 0, plane).sock for peer in sinks])
                for plane in range(self.planes)]

    def peers(self) -> list[int]:
        """The ranks this worker has connections to, in rank order."""
        with self._lock:
            return sorted({peer for peer, _, _ in self.links})

    def flows(self) -> list[dict[str, object]]:
        """Every band connection as gradlaned's flow spec."""
        with self._lock:
            return [link.five_tuple() for link in self.links.values()]

    def remark(self, dscp: tuple[int, ...]) -> None:
        """Adopt a new DSCP table (e.g. the daemon's); same number of bands."""
        if len(dscp) != len(self.dscp):
            raise TransportError(
                f"DSCP table has {len(dscp)} bands, connections have {len(self.dscp)}"
            )
        with self._lock:
            self.dscp = tuple(dscp)
            for link in self.links.values():
                mark(link.sock, dscp[link.band])

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        for link in self.links.values():
            link.sock.close()
