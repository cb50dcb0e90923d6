"""The chunk engine on random layouts: every rank ends with the exact same average.

Several ranks run in this one process (a thread each) over real TCP
connections on loopback. Hypothesis draws the job (ranks, exchange, leaf
switches), the groups (sizes, dtypes, chunks, owners, bands, priorities), the
order in which each rank hands its groups over and each rank's sample count
per step; whatever it draws, every rank must hold the same bytes, and they
must be the sample-weighted mean of the ranks' gradients.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradlane.errors import PeerLost, TransportError
from gradlane.policies.chunks import Routes
from gradlane.shim.engine import (
    _HDR,
    AG,
    BYE,
    PING,
    PING_GRACE_S,
    PONG,
    RS,
    Engine,
    Group,
    _unacknowledged,
)
from gradlane.shim.layout import split
from gradlane.shim.transport import Mesh
from tests import examples
from tests.ranks import on_every_rank

DSCP = (46, 0)  # two bands: enough for the order across connections, few sockets
PLANES = ("127.0.0.1", "127.0.1.1")  # two loopback addresses, as if two NICs
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_jobs = itertools.count()


@dataclass(frozen=True)
class GroupSpec:
    numel: int
    dtype: torch.dtype
    chunk_elems: int
    owners_seed: int
    band: int
    priority: int


@dataclass(frozen=True)
class Job:
    world: int
    exchange: str
    leaves: tuple[int, ...] | None
    groups: tuple[GroupSpec, ...]
    samples: tuple[tuple[int, ...], ...]  # per step, per rank
    orders: tuple[tuple[int, ...], ...]  # per rank, the order it makes its groups ready
    planes: int = 1  # addresses each rank listens on (one per NIC)


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    world = draw(st.integers(2, 5))
    exchange = draw(st.sampled_from(["flat", "ring", "leaf"]))
    leaves = None
    if exchange == "leaf":
        leaves = tuple(draw(st.lists(st.integers(0, 2), min_size=world, max_size=world)))
    groups = tuple(
        GroupSpec(
            numel=draw(st.integers(0, 3000)),
            dtype=draw(st.sampled_from(DTYPES)),
            chunk_elems=draw(st.integers(1, 1200)),
            owners_seed=draw(st.integers(0, 1000)),
            band=draw(st.integers(0, len(DSCP) - 1)),
            priority=draw(st.integers(0, 5)),
        )
        for _ in range(draw(st.integers(1, 5)))
    )
    steps = draw(st.integers(1, 3))
    # At least one sample per step in all: an average of nothing is not defined.
    samples = tuple(
        tuple(draw(st.lists(st.integers(0, 4), min_size=world, max_size=world).filter(any)))
        for _ in range(steps)
    )
    orders = tuple(tuple(draw(st.permutations(range(len(groups))))) for _ in range(world))
    return Job(world, exchange, leaves, groups, samples, orders, draw(st.integers(1, 2)))


def gradient(spec: GroupSpec, gid: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((gid, rank, step)) & 0xFFFF_FFFF)
    return torch.randn(spec.numel, generator=g, dtype=torch.float64).to(spec.dtype)


def run(job: Job) -> list[list[list[torch.Tensor]]]:
    """Every step's averages, per rank and group."""
    store = dist.HashStore()
    prefix = f"engine-test/{next(_jobs)}"
    engines: list[Engine | None] = [None] * job.world
    groups: list[list[Group]] = [[] for _ in range(job.world)]
    results: list[list[list[torch.Tensor]]] = [[] for _ in range(job.world)]

    def connect(rank: int) -> None:
        # Connections to the ranks the exchange sends to only, as the shim's.
        mesh = Mesh(rank, job.world, store, PLANES[:job.planes], DSCP, credit_bytes=128 << 10,
                    timeout_s=30, prefix=prefix, connect=False)
        routes = Routes.agreed(job.exchange, job.world, job.leaves)
        mesh.connect(routes.peers(rank))
        engine = Engine(mesh, timeout_s=30, routes=routes)
        engines[rank] = engine
        for gid, spec in enumerate(job.groups):
            esize = torch.empty(0, dtype=spec.dtype).element_size()
            ranges = split(spec.numel, esize, spec.chunk_elems * esize)
            # The same owners on every rank, any rank for any chunk.
            owners = torch.randint(0, job.world, (len(ranges),),
                                   generator=torch.Generator().manual_seed(spec.owners_seed))
            groups[rank].append(engine.add_group(
                gid, f"g{gid}", torch.zeros(spec.numel, dtype=spec.dtype), ranges,
                owners.tolist(), spec.priority, spec.band))

    def train(rank: int) -> None:
        engine = engines[rank]
        assert engine is not None
        for step, samples in enumerate(job.samples):
            engine.begin(step, samples[rank])
            for gid in job.orders[rank]:
                group = groups[rank][gid]
                group.grad.copy_(gradient(job.groups[gid], gid, rank, step))
                engine.ready(group)
            engine.wait(groups[rank], step)
            results[rank].append([g.out.clone() for g in groups[rank]])

    def close(rank: int) -> None:
        engine = engines[rank]
        if engine is not None:
            engine.close(linger_s=10)

    try:
        on_every_rank(job.world, connect)
        # What the shim lays its chunks out by (finer around the ring: `layout_sizes`);
        # below three ranks the ring is the flat exchange.
        assert [e.ring for e in engines if e is not None] \
            == [job.exchange == "ring" and job.world >= 3] * job.world
        on_every_rank(job.world, train)
    finally:
        on_every_rank(job.world, close)
    return results


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_every_rank_holds_the_same_weighted_mean(job: Job) -> None:
    results = run(job)
    for step, samples in enumerate(job.samples):
        total = sum(samples)
        for gid, spec in enumerate(job.groups):
            outs = [results[rank][step][gid] for rank in range(job.world)]
            for out in outs[1:]:  # replicas stay identical, bit for bit
                assert torch.equal(out.view(torch.uint8), outs[0].view(torch.uint8))
            parts = [n * gradient(spec, gid, rank, step).to(torch.float64)
                     for rank, n in enumerate(samples)]
            expected = sum(parts) / total
            # Rounding: the owner sums in float32 or better and rounds once, but a partial
            # sum on its way (ring hops, leaf leaders) is rounded to the group's dtype at
            # each hop: at most W + 1 roundings, each within eps of the sum of magnitudes.
            scale = sum(part.abs() for part in parts) / total
            error = (outs[0].to(torch.float64) - expected).abs()
            bound = (job.world + 1) * torch.finfo(spec.dtype).eps * scale
            worst = int(torch.argmax(error - bound)) if spec.numel else 0
            assert bool((error <= bound).all()), (
                f"{job}: group {gid} element {worst} is off by {float(error[worst])}, "
                f"more than {float(bound[worst])}"
            )


def test_an_empty_group_is_done_at_once() -> None:
    job = Job(2, "flat", None, (GroupSpec(0, torch.float32, 10, 0, 0, 0),), ((1, 1),),
              ((0,), (0,)))
    assert [[out.numel() for out in step] for step in run(job)[0]] == [[0]]


@pytest.mark.parametrize("exchange", ["flat", "ring"])
def test_a_rank_with_no_samples_weighs_nothing(exchange: str) -> None:
    spec = GroupSpec(500, torch.float64, 100, 3, 0, 0)
    job = Job(3, exchange, None, (spec,), ((0, 2, 1),), ((0,), (0,), (0,)))
    out = run(job)[0][0][0]
    expected = (2 * gradient(spec, 0, 1, 0) + gradient(spec, 0, 2, 0)) / 3
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_chunks_spread_over_the_planes_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on two planes; rank 1 owns every chunk: one of 16,000 bytes, then four of
    4,000 (in turn, the planes would carry 24,000 and 8,000). Rank 0's contributions leave
    by either address, half the bytes each, and rank 1's averages come back the same
    ways. Each owner's chunks spread over the planes."""
    import gradlane.shim.engine as engine_module

    sent: dict[str, int] = {}
    send_all = engine_module._send_all

    def counted(sock, header, payload):  # type: ignore[no-untyped-def]
        address = sock.getsockname()[0]
        sent[address] = sent.get(address, 0) + len(payload)
        send_all(sock, header, payload)

    monkeypatch.setattr(engine_module, "_send_all", counted)
    store, prefix = dist.HashStore(), f"engine-test/{next(_jobs)}"
    engines: list[Engine | None] = [None, None]
    groups: list[list[Group]] = [[], []]
    sizes = [4000, 1000, 1000, 1000, 1000]  # float32 elements, each group one chunk

    def connect(rank: int) -> None:
        mesh = Mesh(rank, 2, store, PLANES, DSCP, credit_bytes=128 << 10, timeout_s=30,
                    prefix=prefix)
        assert sorted(mesh.links) == [(1 - rank, band, plane)
                                      for band in range(2) for plane in range(2)]
        engines[rank] = engine = Engine(mesh, timeout_s=30)
        for gid, n in enumerate(sizes):
            ranges = split(n, 4, 4 * n)
            groups[rank].append(engine.add_group(gid, f"g{gid}", torch.full((n,), rank + 1.0),
                                                 ranges, [1] * len(ranges), gid, 0))

    def step(rank: int) -> None:
        engine = engines[rank]
        assert engine is not None
        engine.begin(0, 1)
        for group in groups[rank]:
            engine.ready(group)
        engine.wait(groups[rank], 0)
        assert all(torch.equal(g.out, torch.full_like(g.out, 1.5)) for g in groups[rank])

    try:
        on_every_rank(2, connect)
        on_every_rank(2, step)
        # Owners 0, 1, 0, 1 of equal chunks: each owner's spread over both planes. (By
        # turns, or by bytes alone, all of rank 0's would ride plane 0 and rank 1's plane 1.)
        for rank in range(2):
            engine = engines[rank]
            assert engine is not None
            group = engine.add_group(9, "g9", torch.zeros(4000), split(4000, 4, 4000),
                                     [0, 1, 0, 1], 9, 0)
            assert [c.plane for c in group.chunks] == [0, 0, 1, 1]
            engine.retire([group])
    finally:
        on_every_rank(2, lambda r: engines[r].close(linger_s=10) if engines[r] else None)
    # Each way, the model (8,000 elements) once: 16,000 bytes by each address.
    assert sent == {PLANES[0]: 32000, PLANES[1]: 32000}, sent
    # Regrouped, the retired groups' bytes leave the count: new ones balance afresh.
    for rank in range(2):
        engine = engines[rank]
        assert engine is not None
        engine.retire(groups[rank][:1])
        assert engine._plane_bytes[1] == [0, 16000]


def test_planes_take_chunks_in_proportion_to_their_rates() -> None:
    """A plane twice as fast takes twice the bytes of each owner's chunks; rates that do
    not fit the planes are refused."""
    from types import SimpleNamespace

    mesh = SimpleNamespace(rank=0, world=2, planes=2, links={}, dscp=(46,), peers=lambda: [1])
    engine = Engine(mesh, timeout_s=5, plane_rates=(200, 100))  # type: ignore[arg-type]
    group = engine.add_group(0, "g", torch.zeros(6000), split(6000, 4, 4000), [0] * 3 + [1] * 3,
                             0, 0)
    assert [c.plane for c in group.chunks] == [0, 1, 0, 0, 1, 0]
    for rates in ((1.0,), (1.0, 0.0)):
        with pytest.raises(TransportError, match="one positive rate per plane"):
            Engine(mesh, timeout_s=5, plane_rates=rates)  # type: ignore[arg-type]


def test_a_lost_rank_is_named_by_the_ranks_not_connected_to_it() -> None:
    """Around a ring of four, rank 1 has no connection to rank 3: when rank 3 dies, rank 1
    hears of it from a neighbour's goodbye, and names rank 3, not the neighbour."""
    store, prefix, routes = dist.HashStore(), f"engine-test/{next(_jobs)}", Routes.agreed("ring", 4)
    engines: list[Engine] = []
    errors: dict[int, PeerLost] = {}

    def connect(rank: int) -> None:
        mesh = Mesh(rank, 4, store, "127.0.0.1", DSCP, credit_bytes=128 << 10, timeout_s=30,
                    prefix=prefix, connect=False)
        mesh.connect(routes.peers(rank))
        engine = Engine(mesh, timeout_s=30, routes=routes)
        engine.add_group(0, "g", torch.zeros(3000), [(0, 3000)], [0], 0, 0)
        engines.append(engine)

    def train(rank: int) -> None:
        engine = next(e for e in engines if e.rank == rank)
        engine.begin(0, 1)
        try:
            engine.ready(engine.groups[0])
            engine.wait([engine.groups[0]], 0)
        except PeerLost as exc:
            errors[rank] = exc
        finally:
            engine.close(linger_s=5)  # as leaving `attach`'s block does

    on_every_rank(4, connect)
    dead = next(e for e in engines if e.rank == 3)
    try:
        assert dead.mesh.peers() == [0, 2]
        for link in dead.mesh.links.values():  # rank 3 dies: no goodbye
            link.sock.shutdown(socket.SHUT_RDWR)
        on_every_rank(3, train)
    finally:
        dead.close(linger_s=0)
    assert {r: e.rank for r, e in errors.items()} == {0: 3, 1: 3, 2: 3}, errors
    assert "having lost rank 3" in str(errors[1]), errors[1]


def _connected(world: int, planes: int = 1) -> list[Mesh]:
    """Ranks 0 to `world` - 1, each a mesh of its own, connected to every other; by rank."""
    store, prefix = dist.HashStore(), f"engine-test/{next(_jobs)}"
    meshes: list[Mesh] = []

    def connect(rank: int) -> None:
        mesh = Mesh(rank, world, store, PLANES[:planes], DSCP, credit_bytes=128 << 10,
                    timeout_s=30, prefix=prefix, connect=False)
        mesh.connect([r for r in range(world) if r != rank])
        meshes.append(mesh)

    on_every_rank(world, connect)
    return sorted(meshes, key=lambda m: m.rank)


@pytest.fixture
def two_meshes() -> Iterator[tuple[Mesh, Mesh]]:
    """Ranks 0 and 1 connected, each a mesh of its own; closed after the test."""
    mesh0, mesh1 = _connected(2)
    yield mesh0, mesh1
    mesh0.close()
    mesh1.close()


# A peer that breaks the chunk protocol (a bug, or two versions that differ): the frame
# rank 1 sends rank 0, who owns the group's one chunk unless `rank1_owns`, and what rank 0
# says of it.
BAD_FRAMES = [
    ("an unknown kind", (9, 0, 0, 0, 4000, 1), False, "rank 1 sent an unknown frame kind 9"),
    ("a chunk it does not have", (RS, 0, 0, 5, 4000, 1), False,
     "rank 1 sent a bad chunk header for g"),
    ("a chunk of another size", (RS, 0, 0, 0, 40, 1), False,
     "rank 1 sent a bad chunk header for g"),
    ("a group it does not know", (RS, 9, 0, 0, 4000, 1), False,
     "rank 1 sent data for unknown group 9"),
    ("a contribution out of step", (RS, 0, 7, 0, 4000, 1), False,
     "rank 1 sent a contribution for step 7 during step 0: workers are out of step"),
    ("a result it does not send", (AG, 0, 0, 0, 4000, 0), False,
     "rank 1 sent a result of chunk 0 of g it does not send"),
    ("a contribution to a rank that does not reduce it", (RS, 0, 0, 0, 4000, 1), True,
     "rank 1 sent chunk 0 of g to a rank that does not reduce it for them"),
]


@pytest.mark.parametrize("frame, rank1_owns, says",
                         [pytest.param(f, o, s, id=what) for what, f, o, s in BAD_FRAMES])
def test_a_frame_that_breaks_the_protocol_stops_the_rank_naming_its_sender(
        frame: tuple[int, ...], rank1_owns: bool, says: str,
        two_meshes: tuple[Mesh, Mesh]) -> None:
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=1)  # rank 1 runs no engine: the test speaks for it
    try:
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [int(rank1_owns)], 0, 0)
        engine.begin(0, 1)
        engine.ready(group)
        mesh1.link(0, 0, 0).sock.sendall(_HDR.pack(*frame))
        deadline = time.monotonic() + 10  # an unknown group is waited for 1 s (timeout_s)
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PeerLost) as lost:  # what the training thread then gets
            engine.wait([group], 0)
        assert lost.value is engine.error and lost.value.rank == 1
        assert str(lost.value) == f"step 0: rank 1 lost: protocol violation: {says}"
    finally:
        engine.close(linger_s=0)


def test_an_engine_refuses_what_its_caller_gets_wrong(two_meshes: tuple[Mesh, Mesh]) -> None:
    mesh0, _ = two_meshes
    with pytest.raises(TransportError, match=r"^routes for 3 ranks on a mesh of 2"):
        Engine(mesh0, timeout_s=5, routes=Routes.agreed("flat", 3))
    lonely = Mesh(0, 3, dist.HashStore(), "127.0.0.1", DSCP, credit_bytes=128 << 10,
                  timeout_s=5, prefix="lonely", connect=False)
    try:
        with pytest.raises(TransportError, match=r"^rank 0 has no connections to ranks \[1, 2\]"):
            Engine(lonely, timeout_s=5)
    finally:
        lonely.close()
    engine = Engine(mesh0, timeout_s=5)
    try:
        group = engine.add_group(0, "g", torch.zeros(10), [(0, 10)], [0], 0, 0)
        with pytest.raises(TransportError, match=r"^group 0 \(g\) registered twice"):
            engine.add_group(0, "g", torch.zeros(10), [(0, 10)], [0], 0, 0)
        with pytest.raises(TransportError, match="^group h: need a flat contiguous CPU"):
            engine.add_group(1, "h", torch.zeros(2, 5), [(0, 10)], [0], 0, 0)
        with pytest.raises(TransportError, match="^sample count must be >= 0, got -1"):
            engine.begin(0, -1)
        engine.begin(0, 1)
        engine.ready(group)
        with pytest.raises(TransportError, match="^group g was made ready twice in step 0"):
            engine.ready(group)
    finally:
        engine.close(linger_s=0)


def test_an_error_on_an_engine_thread_stops_the_waits_at_once_saying_what_it_was(
        two_meshes: tuple[Mesh, Mesh], monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a silence until the timeout blamed on a peer: the thread's own error."""
    mesh0, mesh1 = two_meshes

    contribute = Engine._contribute

    def broken(engine: Engine, chunk: Any, rank: int, *rest: Any) -> None:
        if rank == 1:  # on the thread that receives rank 1's part
            raise RuntimeError("a bug in the reduction")
        contribute(engine, chunk, rank, *rest)

    monkeypatch.setattr(Engine, "_contribute", broken)
    engine = Engine(mesh0, timeout_s=60)
    try:
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [0], 0, 0)
        engine.begin(0, 1)
        engine.ready(group)
        sock = mesh1.link(0, 0, 0).sock
        sock.sendall(_HDR.pack(RS, 0, 0, 0, 4000, 1) + bytes(4000))  # rank 1's contribution
        started = time.monotonic()
        with pytest.raises(TransportError) as failed:
            engine.wait([group], 0)
        assert time.monotonic() - started < 30  # not the 60 s timeout
        assert str(failed.value) == (
            "rank 0: gl-recv-1.0 failed: RuntimeError: a bug in the reduction")
    finally:
        engine.close(linger_s=0)


def test_a_contribution_for_a_group_not_registered_yet_waits_for_it(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """Groups are registered lazily (a layer's at its first backward): a peer ahead may send
    a chunk of one this rank has not registered yet, which is taken once it is."""
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=30)
    try:
        ones = torch.ones(1000)
        mesh1.link(0, 0, 0).sock.sendall(_HDR.pack(RS, 0, 0, 0, 4000, 1) + ones.numpy().tobytes())
        time.sleep(0.3)  # rank 0's receiver holds the frame meanwhile
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [0], 0, 0)
        engine.begin(0, 3)
        group.grad.fill_(5.0)
        engine.ready(group)
        engine.wait([group], 0)
        assert torch.equal(group.out, torch.full((1000,), (3 * 5.0 + 1) / 4))
        # and the average goes back to rank 1
        back = _recv_frame(mesh1.link(0, 0, 0).sock, 4000)
        assert back[0][:4] == (AG, 0, 0, 0) and back[1] == group.out.numpy().tobytes()
    finally:
        engine.close(linger_s=0)


def _recv_frame(sock: socket.socket, nbytes: int) -> tuple[tuple[int, ...], bytes]:
    """One frame of the chunk protocol: its header's fields and `nbytes` of payload."""
    sock.settimeout(10)
    data = b""
    while len(data) < _HDR.size + nbytes:
        part = sock.recv(_HDR.size + nbytes - len(data))
        assert part, f"closed after {len(data)} bytes"
        data += part
    (frame,) = _frames(data)
    return frame


def test_a_wait_with_nothing_coming_names_the_rank_it_waits_on(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=1)  # rank 1 is connected, and says nothing
    try:
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [0], 0, 0)
        empty = engine.add_group(1, "e", torch.zeros(0), [], [], 0, 0)
        engine.begin(0, 1)
        engine.ready(group)
        engine.ready(empty)
        started = time.monotonic()
        with pytest.raises(PeerLost, match=r"^step 0: rank 1 lost: nothing received for \d+ s "
                                           r"while waiting for g; waiting on ranks \[1\]$"
                           ) as lost:
            engine.wait([group], 0)
        assert time.monotonic() - started >= 1 + engine.ping_grace  # asked, no answer
        assert lost.value.rank == 1
        engine.wait([empty], 0)  # a group averaged still returns (flush, for a checkpoint)
    finally:
        engine.close(linger_s=0)
    # Asked first (rank 1 did not answer); then, as a hung rank says nothing, this one's
    # goodbyes name it for the others.
    frames = [(h[0], h[3]) for h, _ in _frames(_read_until_closed(mesh1.link(0, 0, 0).sock))]
    assert frames == [(PING, 0), (BYE, 2)]  # rank 1 lost (a goodbye says the rank plus one)


def test_a_peer_that_answers_is_waited_on_until_its_goodbye_names_the_rank_lost(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    # Rank 1 is alive but waits itself (on a rank 2 that hung): it answers the PING, so
    # rank 0 waits on instead of blaming it, and hears its goodbye naming rank 2.
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=1)
    said: list[int] = []

    def rank_1() -> None:
        sock = mesh1.link(0, 0, 0).sock
        sock.settimeout(30)
        said.append(_HDR.unpack(sock.recv(_HDR.size))[0])
        sock.sendall(_HDR.pack(PONG, 0, 0, 0, 0, 0))
        time.sleep(0.5)  # then it gives up on rank 2
        for band in range(len(DSCP)):
            mesh1.link(0, band, 0).sock.sendall(_HDR.pack(BYE, 0, 0, 2 + 1, 0, 0))

    answering = threading.Thread(target=rank_1, daemon=True)
    try:
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [0], 0, 0)
        engine.begin(0, 1)
        engine.ready(group)
        answering.start()
        with pytest.raises(PeerLost) as lost:
            engine.wait([group], 0)
        assert said == [PING]
        assert str(lost.value) == "step 0: rank 2 lost: rank 1 stopped at step 0, having lost " \
                                  "rank 2"
    finally:
        answering.join(30)
        engine.close(linger_s=0)


def test_a_ping_is_answered_on_its_connection_ahead_of_what_is_queued_and_is_no_word(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """Rank 1 asks on band 1, where 56 MB of rank 0's contributions wait for it (it reads
    nothing): the answer overtakes them, and the asking is no word from rank 1 for rank
    0's own waits (a rank asks because it waits too)."""
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=30)
    group = engine.add_group(0, "g", torch.zeros(7 * BIG), _big_chunks(7), [1] * 7, 0, 1)
    band1 = mesh1.link(0, 1, 0).sock
    try:
        engine.begin(3, 1)
        engine.ready(group)
        time.sleep(0.2)
        heard = engine.last_rx
        band1.sendall(_HDR.pack(PING, 0, 3, 0, 0, 0))
        time.sleep(0.2)  # rank 0's receiver queues the answer
        assert engine.last_rx == heard
    finally:
        with _reading(band1) as got:
            engine.close(linger_s=20)
    headers = [header for header, _ in _frames(got[0])]
    at = headers.index((PONG, 0, 3, 0, 0, 0))
    assert 1 <= at <= 3, headers  # behind what the kernel had taken before the asking
    assert headers[:at] + headers[at + 1 :] == [(RS, 0, 3, i, 4 * BIG, 1) for i in range(7)] + [
        (BYE, 0, 3, 0, 0, 0)]


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    parts = []
    while part := sock.recv(1 << 20):
        parts.append(part)
    return b"".join(parts)


@contextlib.contextmanager
def _reading(sock: socket.socket) -> Iterator[list[bytes]]:
    """`sock` read until closed on another thread while the block runs; what came, in the
    list it yields, once the block has ended."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_read_until_closed(sock)))
    reader.start()
    try:
        yield got
    finally:
        reader.join(30)


BIG = 2 << 20  # float32 elements: 8 MB, more than a connection's kernel buffers hold


def _big_chunks(n: int) -> list[tuple[int, int]]:
    """The element ranges of `n` consecutive chunks of BIG elements."""
    return [(k * BIG, (k + 1) * BIG) for k in range(n)]


def _frames(data: bytes) -> list[tuple[tuple[int, ...], bytes]]:
    """The frames of the chunk protocol in `data`: each header's fields, and its payload."""
    frames = []
    while data:
        header = _HDR.unpack(data[: _HDR.size])
        frames.append((header, data[_HDR.size : _HDR.size + header[4]]))
        data = data[_HDR.size + header[4] :]
    return frames


HALF = 4 << 20  # float32 elements: a 16 MB chunk


def _two_chunks_for_rank_1(mesh0: Mesh, samples: int) -> tuple[Engine, torch.Tensor]:
    """Rank 0's engine with two 16 MB chunks, more than the sockets hold, queued for their
    owner, rank 1, on band 0 at step 0; and the gradient they carry."""
    engine = Engine(mesh0, timeout_s=30)
    grad = torch.randn(2 * HALF, generator=torch.Generator().manual_seed(7))
    group = engine.add_group(0, "g", grad.clone(), [(0, HALF), (HALF, 2 * HALF)], [1, 1], 0, 0)
    engine.begin(0, samples)
    engine.ready(group)
    return engine, grad


def _both_chunks_then_goodbye(data: bytes, grad: torch.Tensor, samples: int) -> None:
    frames = _frames(data)
    # (kind, group, step, chunk, bytes, samples); a goodbye's chunk: the rank lost + 1, 0
    assert [header for header, _ in frames] == [
        (RS, 0, 0, 0, 4 * HALF, samples), (RS, 0, 0, 1, 4 * HALF, samples), (BYE, 0, 0, 0, 0, 0)]
    assert frames[0][1] + frames[1][1] == grad.numpy().tobytes()


def test_a_rank_closing_delivers_what_it_queued_then_says_goodbye(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """Every byte of the two chunks arrives, then the goodbyes; the close ends once rank
    1's kernel has them all."""
    mesh0, mesh1 = two_meshes
    engine, grad = _two_chunks_for_rank_1(mesh0, 2)
    with _reading(mesh1.link(0, 0, 0).sock) as got:
        started = time.monotonic()
        engine.close(linger_s=20)
        assert time.monotonic() - started < 10  # delivered: not the linger's end
    _both_chunks_then_goodbye(got[0], grad, 2)
    assert _frames(_read_until_closed(mesh1.link(0, 1, 0).sock)) == [((BYE, 0, 0, 0, 0, 0), b"")]


def test_a_rank_closing_waits_until_its_peer_has_every_byte_for_a_later_frame_resets(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """Rank 1 reads slowly and, once rank 0's close has returned, sends rank 0 a frame.
    A socket closed for reading answers data with a reset, and the reset drops what that
    socket still held to send. So the close must wait until rank 1's kernel has every
    byte, not only until rank 0's kernel took them: then rank 1 reads both 16 MB chunks
    and the goodbye whole."""
    mesh0, mesh1 = two_meshes
    engine, grad = _two_chunks_for_rank_1(mesh0, 1)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (engine.close(linger_s=20), closed.set()))
    closer.start()
    sock, parts = mesh1.link(0, 0, 0).sock, []
    sock.settimeout(30)
    try:
        time.sleep(0.3)  # rank 0's sends fill the kernels' buffers and wait
        while not closed.is_set():  # about 30 MB/s
            parts.append(sock.recv(64 << 10))
            time.sleep(0.002)
        sock.sendall(_HDR.pack(BYE, 0, 0, 0, 0, 0))  # too late: rank 0 reads no more
        with contextlib.suppress(ConnectionResetError):
            while part := sock.recv(1 << 20):
                parts.append(part)
    finally:
        closer.join(30)
    _both_chunks_then_goodbye(b"".join(parts), grad, 1)


def test_queued_sends_go_by_priority_and_a_group_s_results_before_its_contributions(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """Rank 1 reads nothing while rank 0's 56 MB of contributions to group a (priority 5)
    wait on band 0. Then group b (priority 0) is made ready, and rank 1 sends its part of
    a's chunk 7, which rank 0 owns: b's contribution and then chunk 7's result overtake
    every contribution of a still queued (first used, first sent; an average sent back
    frees its owner's peers, where one more contribution would only queue at them)."""
    mesh0, mesh1 = two_meshes
    done = threading.Event()
    engine = Engine(mesh0, timeout_s=30,
                    on_event=lambda group, chunk, kind: kind == "done" and done.set())
    a = engine.add_group(0, "a", torch.zeros(8 * BIG), _big_chunks(8), [1] * 7 + [0], 5, 0)
    b = engine.add_group(1, "b", torch.zeros(1000), [(0, 1000)], [1], 0, 0)
    engine.begin(0, 1)
    engine.ready(a)  # chunks 0-6 for rank 1; the first fills the kernel's buffers
    time.sleep(0.2)
    engine.ready(b)
    mesh1.link(0, 0, 0).sock.sendall(_HDR.pack(RS, 0, 0, 7, 4 * BIG, 1) + bytes(4 * BIG))
    assert done.wait(10)  # a's chunk 7 is averaged: its result is queued
    with _reading(mesh1.link(0, 0, 0).sock) as got:
        engine.close(linger_s=20)
    order = [(kind, gid, index) for (kind, gid, _, index, _, _), _ in _frames(got[0])]
    overtook = [(RS, 1, 0), (AG, 0, 7)]
    at = order.index(overtook[0])
    assert order[at : at + 2] == overtook, order
    assert 1 <= at <= 3, order  # behind what the kernel had taken before b was ready
    assert [o for o in order if o not in overtook] == [(RS, 0, i) for i in range(7)] + [
        (BYE, 0, 0)]


@pytest.mark.parametrize("planes", [1, 2])
def test_a_peer_is_gone_once_it_said_goodbye_on_every_connection_and_fails_what_needs_it(
        planes: int) -> None:
    """Rank 1 gives its part of step 0 and leaves (as a rank ending before the others, in
    `test_ranks_that_leave_one_after_the_other_end_identical`), saying goodbye on each of
    its connections (two bands, on one plane or two): it is gone only after the last one.
    Step 0 still averages it, and only a step that needs rank 1 again fails."""
    mesh0, mesh1 = _connected(2, planes)
    engine = Engine(mesh0, timeout_s=30)
    failures: list[TransportError] = []
    engine.on_failure = failures.append
    try:
        group = engine.add_group(0, "g", torch.full((1000,), 3.0), [(0, 1000)], [0], 0, 0)
        engine.begin(0, 1)
        mesh1.link(0, 0, 0).sock.sendall(_HDR.pack(RS, 0, 0, 0, 4000, 1)
                                         + torch.ones(1000).numpy().tobytes()
                                         + _HDR.pack(BYE, 0, 0, 0, 0, 0))
        *first, last = [link.sock for key, link in sorted(mesh1.links.items())
                        if key != (0, 0, 0)]
        for sock in first:
            sock.sendall(_HDR.pack(BYE, 0, 0, 0, 0, 0))
        time.sleep(0.3)
        assert engine.healthy and engine.left == {}  # one connection may still carry data
        last.sendall(_HDR.pack(BYE, 0, 0, 0, 0, 0))
        deadline = time.monotonic() + 10
        while not engine.left and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.left == {1: "left (closed its shim at step 0)"} and not engine.healthy
        assert engine.lost([group]) is None  # what it gave before it left stands
        engine.ready(group)
        engine.wait([group], 0)
        assert torch.equal(group.out, torch.full((1000,), 2.0))
        assert engine.lost([group], 0) is None  # nothing of step 0 waits on rank 1 now
        assert failures == []  # a goodbye is no failure of the job
        engine.begin(1, 1)
        engine.ready(group)  # the next step needs rank 1's part
        assert isinstance(engine.lost([group]), PeerLost)
        with pytest.raises(PeerLost, match=r"^step 1: rank 1 lost: left \(closed its shim"):
            engine.wait([group], 1)
    finally:
        engine.close(linger_s=0)
        mesh1.close()


def test_a_peer_that_closes_without_goodbye_is_lost_at_once(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=30)
    failures: list[TransportError] = []
    engine.on_failure = failures.append
    try:
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [0], 0, 0)
        mesh1.link(0, 0, 0).sock.shutdown(socket.SHUT_WR)  # between frames: its process died
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(f.rank, str(f)) for f in failures if isinstance(f, PeerLost)] == [
            (1, "step 0: rank 1 lost: closed its connections without saying goodbye")]
        engine.begin(0, 1)
        engine.ready(group)
        with pytest.raises(PeerLost, match="closed its connections without saying goodbye"):
            engine.wait([group], 0)
    finally:
        engine.close(linger_s=0)


@pytest.mark.parametrize("sent, says", [
    (_HDR.pack(RS, 0, 0, 0, 4000, 1)[:5], f"closed after 5 of {_HDR.size} bytes"),
    (_HDR.pack(RS, 0, 0, 0, 4000, 1), "closed mid-chunk"),
    (_HDR.pack(RS, 0, 0, 0, 4000, 1) + bytes(1000), "closed after 1000 of 4000 bytes"),
], ids=["mid-header", "after-header", "mid-chunk"])
def test_a_peer_that_dies_inside_a_frame_is_lost_saying_where(
        sent: bytes, says: str, two_meshes: tuple[Mesh, Mesh]) -> None:
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=30)
    try:
        group = engine.add_group(0, "g", torch.zeros(1000), [(0, 1000)], [0], 0, 0)
        engine.begin(0, 1)
        engine.ready(group)
        mesh1.link(0, 0, 0).sock.sendall(sent)
        mesh1.link(0, 0, 0).sock.shutdown(socket.SHUT_WR)  # its process died
        with pytest.raises(PeerLost) as lost:
            engine.wait([group], 0)
        assert lost.value.rank == 1
        assert str(lost.value) == f"step 0: rank 1 lost: connection broke: {says}"
    finally:
        engine.close(linger_s=0)


def test_a_failing_rank_drops_what_it_queued_and_its_goodbye_names_the_rank_lost(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """Rank 1 breaks the protocol on band 1 while 64 MB of rank 0's contributions wait on
    band 0 (rank 1 reads nothing): rank 0 closes at once, without them, and says on band 1
    that it stopped because it lost rank 1."""
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=30)
    group = engine.add_group(0, "g", torch.zeros(8 * BIG), _big_chunks(8), [1] * 8, 0, 0)
    engine.begin(0, 1)
    engine.ready(group)
    mesh1.link(0, 1, 0).sock.sendall(_HDR.pack(9, 0, 0, 0, 0, 0))  # an unknown kind
    deadline = time.monotonic() + 10
    while engine.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(engine.error, PeerLost) and engine.error.rank == 1
    started = time.monotonic()
    engine.close(linger_s=20)
    assert time.monotonic() - started < 10  # not the linger: what is queued is dropped
    assert _frames(_read_until_closed(mesh1.link(0, 1, 0).sock)) == [((BYE, 0, 0, 2, 0, 0), b"")]


def test_sends_a_peer_does_not_take_name_it_once_the_drain_gives_up(
        two_meshes: tuple[Mesh, Mesh], caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 reads nothing (hung, its connections open) while 64 MB of rank 0's
    contributions are queued for it: a drain (before clipping, stepping, regrouping) gives
    up naming rank 1, and rank 0's goodbye, which does not wait for them, names it too."""
    mesh0, mesh1 = two_meshes
    engine = Engine(mesh0, timeout_s=30)
    group = engine.add_group(0, "g", torch.zeros(8 * BIG), _big_chunks(8), [1] * 8, 0, 0)
    try:
        engine.begin(0, 1)
        engine.ready(group)
        with pytest.raises(PeerLost) as lost:
            engine.drain_before("clipping", 0.2)
        stuck = lost.value
        assert stuck.rank == 1
        assert re.fullmatch(r"step 0: rank 1 lost: sends to ranks \[1\] did not drain within "
                            r"0.2 s before clipping \(\d+\.\d MB still queued\)", str(stuck))
        queued = float(str(stuck).rsplit("(", 1)[1].split()[0])
        assert 0 < queued <= 8 * BIG * 4 / 1e6  # what the kernel's buffers took is not queued
    finally:
        started = time.monotonic()
        engine.close(linger_s=20)
    assert time.monotonic() - started < 10  # not the linger: what is queued is dropped
    frames = _frames(_read_until_closed(mesh1.link(0, 1, 0).sock))  # band 1: nothing queued
    assert frames == [((BYE, 0, 0, 2, 0, 0), b"")]  # rank 1 lost
    # The sends its close cut short are no new failure: the drain's error said it all.
    assert engine.error is None and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_drain_that_gives_up_names_only_the_ranks_whose_sends_are_still_queued() -> None:
    """Of rank 0's contributions, 56 MB wait for rank 1, which reads nothing, and one
    small one for rank 2, which reads: the drain names rank 1 alone, and rank 0's
    goodbye to rank 2 blames rank 1 (its queue dropped), not rank 2."""
    meshes = _connected(3)
    engine = Engine(meshes[0], timeout_s=30)
    ranges = [*_big_chunks(7), (7 * BIG, 7 * BIG + 1000)]
    group = engine.add_group(0, "g", torch.zeros(7 * BIG + 1000), ranges, [1] * 7 + [2], 0, 0)
    try:
        with _reading(meshes[2].link(0, 0, 0).sock) as got:
            try:
                engine.begin(0, 1)
                engine.ready(group)
                with pytest.raises(PeerLost, match=r"^step 0: rank 1 lost: sends to ranks "
                                                   r"\[1\] did "):
                    engine.drain_before("stepping", 0.5)
            finally:
                engine.close(linger_s=20)
    finally:
        for mesh in meshes:
            mesh.close()
    assert [header for header, _ in _frames(got[0])] == [
        (RS, 0, 0, 7, 4000, 1), (BYE, 0, 0, 2, 0, 0)]  # rank 1 lost (its rank + 1)


def test_a_silent_wait_asks_after_the_timeout_then_gives_up_after_the_grace_or_a_timeout_more(
        two_meshes: tuple[Mesh, Mesh]) -> None:
    """`silence` and `next_look`, the waits' clock: read at given instants."""
    engine = Engine(two_meshes[0], timeout_s=5.0)
    try:
        grace = engine.ping_grace
        assert grace == min(PING_GRACE_S, 5.0)
        engine.last_rx = 100.0  # the last word from a peer
        # Not asked yet: wait out the timeout, then ask.
        assert engine.silence(4.9, None, 104.9) == "wait"
        assert engine.next_look(4.9, None, 104.9) == pytest.approx(0.1)
        assert engine.silence(5.0, None, 105.0) == "ask"
        # Asked at 105 and no word since: lost once the grace is out.
        assert engine.silence(5.0, 105.0, 105.0 + grace - 0.01) == "wait"
        assert engine.next_look(5.0, 105.0, 105.0 + grace - 0.01) == pytest.approx(0.01)
        assert engine.silence(5.0, 105.0, 105.0 + grace) == "lost"
        # A word came after the asking (at 105.5): lost after a timeout more without one.
        engine.last_rx = 105.5
        assert engine.silence(4.9, 105.0, 110.4) == "wait"
        assert engine.next_look(4.9, 105.0, 110.4) == pytest.approx(0.1)
        assert engine.silence(5.0, 105.0, 110.5) == "lost"
    finally:
        engine.close(linger_s=0)


def test_a_socket_past_use_has_nothing_left_to_deliver(two_meshes: tuple[Mesh, Mesh]) -> None:
    """What a close waits for (`Engine.close`): nothing of a socket closed meanwhile."""
    sock = two_meshes[0].link(1, 0, 0).sock
    assert _unacknowledged(sock) == 0  # connected, nothing sent
    sock.close()
    assert _unacknowledged(sock) == 0
