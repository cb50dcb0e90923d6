"""Worker-to-worker connections: K DSCP-marked TCP connections per peer.

Rendezvous goes through a key-value store (torch.distributed's TCPStore, or
any object with ``set(key, value)`` and ``get(key) -> bytes`` that blocks
until the key exists); only addresses travel through it. Every worker listens
on an ephemeral port, publishes ``addr:port``, connects K times to every
lower rank and accepts K connections from every higher rank. A connection
opens with a fixed hello (magic, rank, band) so the acceptor knows whose and
which band it is.

Every connection carries its band's DSCP in IP_TOS (the TOS byte is
``dscp << 2``; the two low bits are ECN), TCP_NODELAY, and TCP_NOTSENT_LOWAT
so that only ``credit_bytes`` of unsent data sit in the kernel per band.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gradlane.errors import TransportError
from gradlane.policies.chunks import host_groups

__all__ = [
    "MAX_PLANES",
    "Link",
    "Mesh",
    "Store",
    "agree_batch",
    "gather",
    "local_address",
    "mark",
    "reduction_groups",
    "same_host",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sIII")  # magic, rank, band, plane
_IPV4_ONLY = "gradlane's transport and gradlaned's filters are IPv4 only"
_MAGIC = b"GLS2"
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


def gather(store: Store, key: str, rank: int, world: int, mine: str) -> list[str]:
    """Every rank's post under `key`, in rank order: this rank posts `mine` and waits for
    the others' (the store's timeout bounds the wait).

    Raises:
        TransportError: a rank or the store is gone.
    """
    try:
        store.set(f"{key}/{rank}", mine)
        return [store.get(f"{key}/{r}").decode() for r in range(world)]
    except RuntimeError as exc:  # torch's DistStoreError: a rank or the store is gone
        raise TransportError(f"rank {rank}: rendezvous failed: {exc}") from exc


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
    """Writable byte view of a contiguous CPU tensor's storage (no copy)."""
    return t.view(torch.uint8).reshape(-1).numpy().data


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


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("closed during hello")
        got += k
    return bytes(buf)


class Mesh:
    """All band connections of one worker, established at construction.

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
        timeout_s: bound on the whole rendezvous.
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
        bands = len(self.dscp)
        deadline = time.monotonic() + timeout_s
        listeners: list[socket.socket] = []
        try:
            for a in addresses:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listeners.append(listener)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((a, 0))
                listener.listen(max(16, world * bands))
            mine = [f"{a}:{listener.getsockname()[1]}"
                    for a, listener in zip(addresses, listeners, strict=True)]
            try:
                store.set(f"{prefix}/addr/{rank}", json.dumps(mine))
                where = [json.loads(store.get(f"{prefix}/addr/{p}")) for p in range(rank)]
            except RuntimeError as exc:  # torch's DistStoreError: the store or a rank is gone
                raise TransportError(f"rank {rank}: rendezvous failed: {exc}") from exc
            for peer in range(rank):
                if len(where[peer]) != self.planes:
                    raise TransportError(
                        f"rank {rank} listens on {self.planes} addresses, rank {peer} on "
                        f"{len(where[peer])}: give every rank one per NIC, as many")
                for plane, spot in enumerate(where[peer]):
                    host, _, peer_port = spot.rpartition(":")
                    for band in range(bands):
                        self._connect(peer, band, plane, (host, int(peer_port)), deadline,
                                      credit_bytes, sndbuf_bytes)
            self._accept(listeners, (world - 1 - rank) * bands * self.planes, deadline,
                         timeout_s, credit_bytes, sndbuf_bytes)
        except BaseException:
            self.close()
            raise
        finally:
            for listener in listeners:
                listener.close()

    def _accept(self, listeners: list[socket.socket], expected: int, deadline: float,
                timeout_s: float, credit: int, sndbuf: int) -> None:
        """Take the later ranks' `expected` connections on `listeners` (one per plane)."""
        bands = len(self.dscp)
        while expected:
            ready, _, _ = select.select(listeners, [], [], max(0.1, deadline - time.monotonic()))
            if not ready:
                missing = sorted(set(range(self.rank + 1, self.world)) - self._peers_seen())
                raise TransportError(f"rank {self.rank}: ranks {missing} did not connect "
                                     f"within {timeout_s:.0f} s")
            for listener in ready:
                sock, _ = listener.accept()
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                magic, peer, band, plane = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
                if (magic != _MAGIC or not self.rank < peer < self.world or not 0 <= band < bands
                        or plane != listeners.index(listener)):
                    sock.close()
                    logger.warning("rank %d: dropped a connection with a bad hello", self.rank)
                    continue
                sock.settimeout(None)
                _tune(sock, self.dscp[band], credit, sndbuf)
                self.links[(peer, band, plane)] = Link(peer, band, sock, plane)
                expected -= 1

    def _peers_seen(self) -> set[int]:
        return {peer for peer, _, _ in self.links}

    def _connect(
        self,
        peer: int,
        band: int,
        plane: int,
        where: tuple[str, int],
        deadline: float,
        credit: int,
        sndbuf: int,
    ) -> None:
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _tune(sock, self.dscp[band], credit, sndbuf)
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
            self.links[(peer, band, plane)] = Link(peer, band, sock, plane)
            return

    def link(self, peer: int, band: int, plane: int = 0) -> Link:
        return self.links[(peer, band, plane)]

    def peers(self) -> Iterable[int]:
        return (p for p in range(self.world) if p != self.rank)

    def flows(self) -> list[dict[str, object]]:
        """Every band connection as gradlaned's flow spec."""
        return [link.five_tuple() for link in self.links.values()]

    def remark(self, dscp: tuple[int, ...]) -> None:
        """Adopt a new DSCP table (e.g. the daemon's); same number of bands."""
        if len(dscp) != len(self.dscp):
            raise TransportError(
                f"DSCP table has {len(dscp)} bands, connections have {len(self.dscp)}"
            )
        self.dscp = tuple(dscp)
        for link in self.links.values():
            mark(link.sock, dscp[link.band])

    def close(self) -> None:
        for link in self.links.values():
            link.sock.close()
