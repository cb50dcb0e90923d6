"""The transport's room for its connections (the open-file limit), and `relay` (over one
plane, or several: `relay_planes`), which copies rank 0's model down the routes (each
rank's part of them: `tree_neighbours`)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from gradlane.errors import TransportError
from gradlane.shim import transport
from gradlane.shim.transport import Mesh, _room_for, relay, relay_planes, tree_neighbours
from tests.ranks import on_every_rank


def test_tree_neighbours_are_a_rank_s_parent_and_its_children_in_rank_order() -> None:
    parents = [-1, 0, 3, 0, 1, 3]
    assert tree_neighbours(parents, 0) == (-1, [1, 3])
    assert tree_neighbours(parents, 3) == (0, [2, 5])
    assert tree_neighbours(parents, 4) == (1, [])


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def _pair(made: list[tuple[socket.socket, socket.socket]]) -> tuple[socket.socket, socket.socket]:
    made.append(socket.socketpair())
    return made[-1]


def _read(sock: socket.socket, n: int, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    got = bytearray()
    while len(got) < n:
        part = sock.recv(n - len(got))
        if not part:
            break
        got += part
    return bytes(got)


def test_relay_passes_each_piece_on_before_the_rest_is_in(pairs: list) -> None:
    """A hop forwards a piece as soon as it holds it: with the rest of the tensor not sent
    yet, the next hop already has the first piece (held whole, it would have nothing)."""
    upstream, source = _pair(pairs)
    sink, downstream = _pair(pairs)
    data = os.urandom(3 * 4096 + 100)
    view = memoryview(bytearray(len(data)))
    hop = threading.Thread(target=relay, args=([view], source, [sink], 4096, 30.0))
    hop.start()
    try:
        upstream.sendall(data[:4096])
        assert _read(downstream, 4096) == data[:4096]
        upstream.sendall(data[4096:])
        assert _read(downstream, len(data) - 4096) == data[4096:]
    finally:
        upstream.close()
        hop.join(30)
    assert not hop.is_alive() and bytes(view) == data


def test_relay_copies_every_view_to_every_sink(pairs: list) -> None:
    sinks = [_pair(pairs) for _ in range(3)]
    views = [memoryview(os.urandom(n)) for n in (0, 1, 5000, 4096)]
    relay(views, None, [near for near, _ in sinks], 1000, 30.0)
    everything = b"".join(bytes(v) for v in views)
    for _, far in sinks:
        assert _read(far, len(everything)) == everything


def test_relay_names_a_source_that_closes_or_stalls(pairs: list) -> None:
    upstream, source = _pair(pairs)
    upstream.sendall(b"x" * 10)
    upstream.close()
    with pytest.raises(ConnectionError, match="closed after 10 of 64"):
        relay([memoryview(bytearray(100))], source, [], 64, 30.0)
    upstream, source = _pair(pairs)
    with pytest.raises(TimeoutError):
        relay([memoryview(bytearray(100))], source, [], 64, 0.2)


def test_relay_planes_spreads_the_pieces_over_every_plane(pairs: list) -> None:
    """Rank 0 -> a hop -> the last rank, two planes: piece k rides plane k mod 2, on every
    hop, and the hop ends with every byte."""
    piece = 1000
    data = [os.urandom(n) for n in (2500, 0, 4096)]
    links = [[_pair(pairs) for _ in range(2)] for _ in range(2)]  # [hop][plane]: (near, far)
    hop_views = [memoryview(bytearray(len(d))) for d in data]
    hop = threading.Thread(target=relay_planes, args=(
        hop_views, [(links[0][p][1], [links[1][p][0]]) for p in range(2)], piece, 30.0))
    hop.start()
    relay_planes([memoryview(d) for d in data], [(None, [links[0][p][0]]) for p in range(2)],
                 piece, 30.0)
    hop.join(30)
    assert not hop.is_alive() and [bytes(v) for v in hop_views] == data
    # Pieces 1000, 1000, 500 (the first view), then 1000 x 4 and 96.
    pieces = [d[i : i + piece] for d in data for i in range(0, len(d), piece)]
    for p in range(2):
        expected = b"".join(pieces[p::2])
        assert _read(links[1][p][1], len(expected)) == expected
        links[1][p][1].setblocking(False)
        with pytest.raises(BlockingIOError):  # and nothing more on that plane
            links[1][p][1].recv(1)


def test_relay_takes_pieces_down_to_one_byte_and_refuses_less(pairs: list) -> None:
    one, planes = _pair(pairs), [_pair(pairs) for _ in range(2)]
    relay([memoryview(b"abc")], None, [one[0]], 1, 30.0)
    assert _read(one[1], 3) == b"abc"
    relay_planes([memoryview(b"abcd")], [(None, [near]) for near, _ in planes], 1, 30.0)
    assert [_read(far, 2) for _, far in planes] == [b"ac", b"bd"]
    with pytest.raises(ValueError, match="piece_bytes must be >= 1, got 0"):
        relay([memoryview(b"abc")], None, [one[0]], 0, 30.0)
    with pytest.raises(ValueError, match="piece_bytes must be >= 1, got 0"):
        relay_planes([memoryview(b"abcd")], [(None, [near]) for near, _ in planes], 0, 30.0)


def test_relay_planes_raises_a_plane_s_failure(pairs: list) -> None:
    up = [_pair(pairs) for _ in range(2)]
    up[1][0].sendall(b"x" * 10)
    up[1][0].close()  # plane 1's source closes after 10 bytes of its first piece
    up[0][0].sendall(b"y" * 64)
    with pytest.raises(ConnectionError, match="closed after 10 of 64"):
        relay_planes([memoryview(bytearray(128))], [(up[p][1], []) for p in range(2)], 64, 30.0)
    up = [_pair(pairs) for _ in range(2)]  # now plane 0's, which the caller reads itself
    up[0][0].sendall(b"x" * 20)
    up[0][0].close()
    up[1][0].sendall(b"y" * 64)
    with pytest.raises(ConnectionError, match="closed after 20 of 64"):
        relay_planes([memoryview(bytearray(128))], [(up[p][1], []) for p in range(2)], 64, 30.0)
    with pytest.raises(ValueError, match="at least one plane"):
        relay_planes([], [], 64, 30.0)


def test_the_soft_open_file_limit_is_raised_for_the_connections() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    if hard != resource.RLIM_INFINITY and hard < in_use + 400:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to raise the soft one")
    low = in_use + 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        _room_for(300, 0)
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised >= in_use + 300, (low, raised)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_soft_open_file_limit_with_room_is_left_as_it_is() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    roomy = len(os.listdir("/proc/self/fd")) + 1000
    if hard != resource.RLIM_INFINITY and hard < roomy:
        pytest.skip(f"the hard open-file limit ({hard}) is below {roomy}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (roomy, hard))
    try:
        _room_for(10, 0)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (roomy, hard)  # not lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hard_limit_with_just_the_room_needed_is_enough_and_one_without_is_named() -> None:
    # The hard limit cannot be raised again without privileges: in a process of its own.
    script = (
        "import os, resource\n"
        "from gradlane.errors import TransportError\n"
        "from gradlane.shim.transport import _room_for\n"
        # Room for exactly as many (and the 64 spare) is room enough: the soft limit rises
        # to the hard one.
        "n = len(os.listdir('/proc/self/fd')) + 100 + 64\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n - 100, n))\n"
        "_room_for(100, 3)\n"
        "print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0] == n)\n"
        "n = len(os.listdir('/proc/self/fd')) + 20\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
        "try:\n"
        "    _room_for(1196, 3)\n"
        "except TransportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "rank 3 needs 1196 connections" in out and "ulimit -n" in out, out
    assert "soft True" in out, out


@pytest.mark.parametrize(("families", "said"), [
    ([socket.AF_INET6], "^MASTER_ADDR 'head' is IPv6 only"),
    ([socket.AF_INET6, socket.AF_INET], "^cannot resolve MASTER_ADDR 'head'"),  # IPv4 failed
    ([socket.AF_INET], "^cannot resolve MASTER_ADDR 'head'"),
    (None, "^cannot resolve MASTER_ADDR 'head'"),  # the name is not known at all
])
def test_a_rendezvous_name_without_an_ipv4_address_is_said_to_be_ipv6_only_or_unresolved(
        monkeypatch: pytest.MonkeyPatch, families: list[int] | None, said: str) -> None:
    def gethostbyname(host: str) -> str:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def getaddrinfo(host: str, port: object, **kw: object) -> list[tuple[object, ...]]:
        if families is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(f, socket.SOCK_STREAM, 6, "", ("::1", 0)) for f in families]

    monkeypatch.setattr(socket, "gethostbyname", gethostbyname)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(TransportError, match=said):
        transport.local_address("head")


def _two_ranks(store: dist.Store, prefix: str) -> list[Mesh]:
    """Ranks 0 and 1 of a job meeting at `store` under `prefix`: listening, two bands each,
    not connected yet."""
    return [Mesh(r, 2, store, "127.0.0.1", (46, 0), credit_bytes=128 << 10, timeout_s=30,
                 prefix=prefix, connect=False) for r in range(2)]


def test_strays_at_the_rendezvous_are_dropped_and_the_ranks_still_connect(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port scan or probe reaching a rank's listener while its peers connect (it closes at
    once, sends a stranger's bytes, or nothing at all) is dropped; it does not fail the
    rendezvous."""
    monkeypatch.setattr(transport, "HELLO_WAIT_S", 0.5)
    store = dist.HashStore()
    meshes = _two_ranks(store, "strays")
    try:
        host, port = json.loads(store.get("strays/addr/0"))[0].rsplit(":", 1)
        for data in (b"", b"GLS", b"GET / HTTP/1.0\r\n\r\n"):  # queued before the peer's
            with socket.create_connection((host, int(port))) as stray:
                stray.sendall(data)
        with (socket.create_connection((host, int(port))),  # silent, open all along
              caplog.at_level(logging.WARNING, logger="gradlane.shim.transport")):
            on_every_rank(2, lambda rank: meshes[rank].connect([1 - rank]))
        assert sorted(meshes[0].links) == [(1, 0, 0), (1, 1, 0)]  # (peer, band, plane)
        assert sorted(meshes[1].links) == [(0, 0, 0), (0, 1, 0)]
        dropped = [r.getMessage() for r in caplog.records]
        assert dropped == ["rank 0: dropped a connection that sent no hello"] * 2 + [
            "rank 0: dropped a connection with a bad hello",
            "rank 0: dropped a connection that sent no hello"]
    finally:
        for mesh in meshes:
            mesh.close()


def test_every_connection_carries_its_band_s_dscp_and_credit_and_takes_a_new_table() -> None:
    meshes: list[Mesh] = []
    try:
        meshes += _two_ranks(dist.HashStore(), "marks")
        on_every_rank(2, lambda rank: meshes[rank].connect([1 - rank]))

        def tos(mesh: Mesh) -> dict[int, int]:  # band -> the TOS byte (DSCP << 2, ECN 0)
            return {band: link.sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
                    for (_, band, _), link in mesh.links.items()}

        assert [tos(m) for m in meshes] == [{0: 46 << 2, 1: 0}] * 2
        for link in (link for m in meshes for link in m.links.values()):  # both ends
            assert link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) \
                == 128 << 10  # the credit: no more unsent data in the kernel per band
        for mesh in meshes:  # gradlaned's flows: the connection as this end sees it
            for link in mesh.links.values():
                src, sport = link.sock.getsockname()
                dst, dport = link.sock.getpeername()
                assert link.five_tuple() == {"band": link.band, "src": src, "sport": sport,
                                             "dst": dst, "dport": dport}
        meshes[0].remark((10, 18))
        assert tos(meshes[0]) == {0: 10 << 2, 1: 18 << 2}
        with pytest.raises(TransportError, match="DSCP table has 3 bands, connections have 2"):
            meshes[0].remark((10, 18, 26))
        assert tos(meshes[0]) == {0: 10 << 2, 1: 18 << 2}
    finally:
        for mesh in meshes:
            mesh.close()


def test_the_send_buffer_is_the_kernel_s_to_tune_unless_one_is_given() -> None:
    """By default (`ShimConfig.sndbuf_bytes` 0) SO_SNDBUF is left alone: set, it would turn
    the kernel's autotuning of it off. Given, it is set (Linux keeps twice the value)."""
    from gradlane.shim.config import ShimConfig

    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        initial = int(f.read().split()[1])  # a TCP socket's send buffer to begin with
    for sndbuf in (ShimConfig().sndbuf_bytes, 64 << 10):  # under any net.core.wmem_max
        store = dist.HashStore()
        meshes = [Mesh(r, 2, store, "127.0.0.1", (46, 0), credit_bytes=128 << 10,
                       sndbuf_bytes=sndbuf, timeout_s=30, prefix="buffers", connect=False)
                  for r in range(2)]
        try:
            on_every_rank(2, lambda rank, these=meshes: these[rank].connect([1 - rank]))
            sizes = {link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                     for mesh in meshes for link in mesh.links.values()}
            if sndbuf:
                assert sizes == {2 * sndbuf}
            else:  # the kernel's own, which autotuning only grows
                assert min(sizes) >= initial, sizes
        finally:
            for mesh in meshes:
                mesh.close()


@pytest.mark.parametrize("addresses", [[], ["127.0.0.1", "127.0.0.1"],
                                       [f"127.0.0.{i}" for i in range(1, 10)]])
def test_a_mesh_needs_one_to_eight_distinct_addresses(addresses: list[str]) -> None:
    with pytest.raises(TransportError, match="need 1..8 distinct addresses"):
        Mesh(0, 2, dist.HashStore(), addresses, (0,), credit_bytes=1 << 16, connect=False)


def test_a_mesh_makes_room_for_a_connection_per_peer_band_and_plane(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(transport, "_room_for",
                        lambda sockets, rank: asked.append((sockets, rank)))
    store, meshes = dist.HashStore(), []
    try:
        meshes += [Mesh(r, 3, store, ["127.0.0.1", "127.0.0.2"], (46, 0), credit_bytes=1 << 16,
                        timeout_s=30, prefix="room", connect=False) for r in range(3)]
        on_every_rank(3, lambda rank: meshes[rank].connect(r for r in range(3) if r != rank))
        assert sorted(asked) == [(8, 0), (8, 1), (8, 2)]  # 2 peers x 2 bands x 2 planes
        assert [len(m.links) for m in meshes] == [8] * 3
    finally:
        for mesh in meshes:
            mesh.close()


def test_the_local_address_is_the_one_the_routing_table_picks() -> None:
    assert transport.local_address("localhost") == "127.0.0.1"
    # Not a loopback address by its name: the kernel's route to this host says it.
    assert transport.local_address("0.0.0.0") == "127.0.0.1"


def _listening_later(after_s: float, links: int) -> tuple[str, threading.Thread, list[bytes]]:
    """A port that refuses connections for `after_s`, then takes `links` and reads each
    one's hello (a rank busy before it listens); its address and thread, and the hellos."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    hellos: list[bytes] = []

    def serve() -> None:
        with sock:
            time.sleep(after_s)
            sock.listen(links)
            for _ in range(links):
                conn, _ = sock.accept()
                with conn:
                    hellos.append(_read(conn, 16))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{sock.getsockname()[1]}", thread, hellos


def test_a_rank_retries_a_lower_rank_until_it_listens_or_the_timeout_ends() -> None:
    store = dist.HashStore()
    where, thread, hellos = _listening_later(0.5, 2)
    store.set("late/addr/0", json.dumps([where]))
    mesh = Mesh(1, 2, store, "127.0.0.1", (46, 0), credit_bytes=1 << 16, timeout_s=30,
                prefix="late", connect=False)
    try:
        mesh.connect([0])
        thread.join(30)
        assert sorted(mesh.links) == [(0, 0, 0), (0, 1, 0)]
        assert sorted(hellos) == [b"GLS3" + bytes([1, 0, 0, 0]) + bytes([b, 0, 0, 0]) + bytes(4)
                                  for b in (0, 1)]  # magic, rank 1, band, plane 0
    finally:
        mesh.close()
    with socket.socket() as never:  # bound, never listening: refuses every connection
        never.bind(("127.0.0.1", 0))
        port = never.getsockname()[1]
        store.set("never/addr/0", json.dumps([f"127.0.0.1:{port}"]))
        mesh = Mesh(1, 2, store, "127.0.0.1", (46, 0), credit_bytes=1 << 16, timeout_s=0.5,
                    prefix="never", connect=False)
        try:
            started = time.monotonic()
            with pytest.raises(TransportError,
                               match=rf"rank 1: cannot connect to rank 0 at .*{port}\)"):
                mesh.connect([0])
            assert time.monotonic() - started >= 0.5  # tried until the timeout
        finally:
            mesh.close()


def test_a_rank_waits_for_higher_ranks_that_connect_late_and_names_those_that_never_do(
) -> None:
    store = dist.HashStore()
    meshes = _two_ranks(store, "slow")
    try:
        def body(rank: int) -> None:
            if rank == 1:
                time.sleep(0.5)  # rank 0 is accepting meanwhile
            meshes[rank].connect([1 - rank])

        on_every_rank(2, body)
        assert sorted(meshes[0].links) == [(1, 0, 0), (1, 1, 0)]
    finally:
        for mesh in meshes:
            mesh.close()
    alone = Mesh(0, 3, store, "127.0.0.1", (46, 0), credit_bytes=1 << 16, timeout_s=1,
                 prefix="alone", connect=False)
    try:
        with pytest.raises(TransportError, match=r"rank 0: ranks \[1, 2\] did not connect "
                                                 r"within 1 s"):
            alone.connect([1, 2])
    finally:
        alone.close()


class _GoneStore:
    """A store whose server is gone: torch raises its DistStoreError, a RuntimeError."""

    def set(self, key: str, value: str) -> None:
        raise RuntimeError("Connection reset by peer")

    def get(self, key: str) -> bytes:
        raise RuntimeError("Connection reset by peer")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_rank_whose_peers_never_post_or_whose_store_is_gone_gets_a_rendezvous_error(
) -> None:
    # A rank that died before posting: the others wait the store's timeout, then get a
    # TransportError saying so (not torch's own error), and hold no socket open.
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=0.3))
    with pytest.raises(TransportError, match=r"^rank 0: rendezvous failed: .*"):
        transport.gather(store, "g", 0, 2, "mine")
    with pytest.raises(TransportError, match=r"^rank 1: rendezvous failed: .*"):
        transport.rank0_says(store, "k", 1, None)  # rank 0 never says
    assert transport.rank0_says(store, "k2", 0, {"a": 1}) == {"a": 1}
    before = _open_fds()
    mesh = Mesh(1, 2, store, "127.0.0.1", (46, 0), credit_bytes=1 << 16, timeout_s=30,
                prefix="none", connect=False)
    with pytest.raises(TransportError, match=r"^rank 1: rendezvous failed: .*"):
        mesh.connect([0])  # rank 0 never posted its addresses
    mesh.close()
    assert _open_fds() == before
    with pytest.raises(TransportError, match=r"^rank 0: rendezvous failed: Connection reset"):
        Mesh(0, 2, _GoneStore(), "127.0.0.1", (46, 0), credit_bytes=1 << 16)  # type: ignore[arg-type]
    assert _open_fds() == before  # its listener closed


@pytest.mark.parametrize("peers", [[2], [0], [-1], [1, 5]])
def test_a_mesh_connects_only_to_other_ranks_of_its_job(peers: list[int]) -> None:
    mesh = Mesh(0, 2, dist.HashStore(), "127.0.0.1", (0,), credit_bytes=1 << 16,
                connect=False)
    try:
        with pytest.raises(TransportError, match=r"are not other ranks of 2"):
            mesh.connect(peers)
    finally:
        mesh.close()
