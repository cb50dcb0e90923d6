"""The transport's room for its connections (the open-file limit), and `relay` (over one
plane, or several: `relay_planes`), which copies rank 0's model down the routes (each
rank's part of them: `tree_neighbours`)."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
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


def test_a_hard_limit_without_room_is_named_with_the_way_out() -> None:
    # The hard limit cannot be raised again without privileges: in a process of its own.
    script = (
        "import os, resource\n"
        "from gradlane.errors import TransportError\n"
        "from gradlane.shim.transport import _room_for\n"
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


def test_strays_at_the_rendezvous_are_dropped_and_the_ranks_still_connect(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port scan or probe reaching a rank's listener while its peers connect (it closes at
    once, sends a stranger's bytes, or nothing at all) is dropped; it does not fail the
    rendezvous."""
    monkeypatch.setattr(transport, "HELLO_WAIT_S", 0.5)
    store = dist.HashStore()
    meshes = [Mesh(r, 2, store, "127.0.0.1", (46, 0), credit_bytes=128 << 10, timeout_s=30,
                   prefix="strays", connect=False) for r in range(2)]
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


def test_every_connection_carries_its_band_s_dscp_and_takes_a_new_table() -> None:
    store = dist.HashStore()
    meshes: list[Mesh] = []
    try:
        meshes += [Mesh(r, 2, store, "127.0.0.1", (46, 0), credit_bytes=128 << 10,
                        timeout_s=30, prefix="marks", connect=False) for r in range(2)]
        on_every_rank(2, lambda rank: meshes[rank].connect([1 - rank]))

        def tos(mesh: Mesh) -> dict[int, int]:  # band -> the TOS byte (DSCP << 2, ECN 0)
            return {band: link.sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
                    for (_, band, _), link in mesh.links.items()}

        assert [tos(m) for m in meshes] == [{0: 46 << 2, 1: 0}] * 2
        meshes[0].remark((10, 18))
        assert tos(meshes[0]) == {0: 10 << 2, 1: 18 << 2}
        with pytest.raises(TransportError, match="DSCP table has 3 bands, connections have 2"):
            meshes[0].remark((10, 18, 26))
        assert tos(meshes[0]) == {0: 10 << 2, 1: 18 << 2}
    finally:
        for mesh in meshes:
            mesh.close()


@pytest.mark.parametrize("addresses", [[], ["127.0.0.1", "127.0.0.1"],
                                       [f"127.0.0.{i}" for i in range(1, 10)]])
def test_a_mesh_needs_one_to_eight_distinct_addresses(addresses: list[str]) -> None:
    with pytest.raises(TransportError, match="need 1..8 distinct addresses"):
        Mesh(0, 2, dist.HashStore(), addresses, (0,), credit_bytes=1 << 16, connect=False)
