"""Chunking, ownership and band mapping: pure functions, property-tested."""

from __future__ import annotations

import heapq
import re

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gradlane.errors import ConfigError
from gradlane.policies import chunks
from gradlane.policies.chunks import (
    COARSE_GROUP_BYTES,
    MIN_GROUP_BYTES,
    RING_AUTO_MAX_WORLD,
    Routes,
    all_reduction_parents,
    exchange_kind,
    group_consecutive,
    host_groups,
    layout_sizes,
    reduction_parents,
    ring_routes,
    trial_schedule,
    uses_ring,
)
from gradlane.shim.layout import assign_owners, band_of, split


@given(st.integers(0, 10**7), st.sampled_from([1, 2, 4, 8]), st.integers(4096, 1 << 22))
def test_split_covers_exactly_with_chunks_under_the_size(numel: int, elem: int, chunk: int) -> None:
    ranges = split(numel, elem, chunk)
    assert sum(stop - start for start, stop in ranges) == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    if ranges:
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        sizes = [stop - start for start, stop in ranges]
        assert max(sizes) * elem <= max(chunk, elem)
        assert max(sizes) - min(sizes) <= 1  # no tiny tail chunk


def test_split_examples() -> None:
    assert split(10, 4, 4096) == [(0, 10)]
    assert split(0, 4, 4096) == []
    assert split(1, 4, 4096) == [(0, 1)]  # a one-element layer (a scalar parameter)
    assert split(1, 4, 4096, tail=2) == [(0, 3)]
    assert split(3, 8, 4) == [(0, 1), (1, 2), (2, 3)]  # chunks under an element: one each
    assert split(3000, 4, 4096) == [(0, 1000), (1000, 2000), (2000, 3000)]


@given(st.integers(0, 10**6), st.integers(1, 64), st.sampled_from([1, 2, 4, 8]),
       st.integers(4096, 1 << 20))
def test_a_tail_rides_in_the_last_chunk(numel: int, tail: int, elem: int, chunk: int) -> None:
    """A group's flags (one per parameter) never change how its gradients are cut: a
    group of exactly four chunks stays four, with the same owners."""
    plain, with_tail = split(numel, elem, chunk), split(numel, elem, chunk, tail)
    if not plain:
        assert with_tail == [(0, tail)]
        return
    assert with_tail[:-1] == plain[:-1]
    assert with_tail[-1] == (plain[-1][0], numel + tail)


def test_a_tail_on_a_whole_number_of_chunks() -> None:
    assert split(4096, 1, 1024, tail=3) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4099)]


@given(st.lists(st.integers(1, 1 << 20), max_size=200), st.integers(1, 16))
def test_owners_each_chunk_once_and_balanced(sizes: list[int], world: int) -> None:
    owners = assign_owners(sizes, world)
    assert len(owners) == len(sizes) and all(0 <= o < world for o in owners)
    load = [0] * world
    for size, owner in zip(sizes, owners, strict=True):
        load[owner] += size
    # Greedy least-loaded: no owner exceeds the mean by more than one chunk.
    if sizes:
        assert max(load) <= sum(sizes) / world + max(sizes)
    assert owners == assign_owners(sizes, world)  # deterministic: every worker agrees


def _owners_one_heap_a_group(sizes: list[int], world: int, groups: list[int] | None
                             ) -> list[int]:
    """`assign_owners`' equal weights as they were computed until the plan at 1,024 hosts
    was timed: a heap of every rank, keyed (load in the group, owned, rank), each group."""
    total = [0] * world
    heap = [(0, 0, r) for r in range(world)]
    owners = []
    current = groups[0] if groups else None
    for i, size in enumerate(sizes):
        if groups is not None and groups[i] != current:
            current = groups[i]
            heap = [(0, total[r], r) for r in range(world)]
            heapq.heapify(heap)
        load, _, best = heap[0]
        total[best] += size
        heapq.heapreplace(heap, (load + size, total[best], best))
        owners.append(best)
    return owners


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 3)), max_size=120),
       st.integers(1, 12), st.booleans())
@example([(5, 0), (10, 1), (1, 1)], 2, True)  # the second group's ranks by owned bytes
@example([(0, 0), (5, 0)], 2, True)  # a chunk of no bytes leaves its rank the least loaded
@example([(3, 0), (1, 0), (2, 0)], 2, True)  # more chunks than ranks
@example([(10, 0), (5, 1), (5, 1), (5, 1)], 2, True)  # ... by load in the group, then owned
# More chunks than ranks, then a group of at most the world: its ranks by owned bytes (4, 2,
# 1: rank 2 first), of three ranks (of two, a mutant numbering them backwards lived).
@example([(4, 0), (1, 0), (1, 0), (1, 0), (5, 1)], 3, True)
# More chunks than ranks, one byte in all: packed keys still fit under their span (a span
# one short, zero here, lived).
@example([(1, 0), (0, 0), (0, 0)], 2, False)
def test_equal_owners_are_a_heap_of_every_rank_s_owners(
        chunks: list[tuple[int, int]], world: int, grouped: bool) -> None:
    """The owners of groups of at most `world` chunks are taken from one heap of the
    ranks; bit for bit those of a heap of every rank a group (chunks of no bytes and groups
    larger than the world included)."""
    sizes = [size for size, _ in chunks]
    groups = [group for _, group in chunks] if grouped else None
    assert assign_owners(sizes, world, None, groups) == \
        _owners_one_heap_a_group(sizes, world, groups)


def _owners_one_job_at_a_time(sizes: list[int], world: int, weights: list[float],
                              groups: list[int] | None) -> list[int]:
    """`assign_owners`' unequal weights as they were computed until 128 jobs' owners were
    timed in one plan: one job, one chunk at a time."""
    w = np.asarray(weights, dtype=np.float64)
    total, group_load, out, current = np.zeros(world), np.zeros(world), [], None
    for i, size in enumerate(sizes):
        if groups is not None and groups[i] != current:
            current, group_load = groups[i], np.zeros(world)
        finish = (group_load + size) / w
        tied = np.flatnonzero(finish <= finish.min() * (1 + 1e-9))
        overall = (total[tied] + size) / w[tied]
        best = int(tied[np.flatnonzero(overall <= overall.min() * (1 + 1e-9))[0]])
        group_load[best] += size
        total[best] += size
        out.append(best)
    return out


_WEIGHTS = st.sampled_from([1.0, 0.5, 0.25, 0.24999999999999992, 3.0, 1e-3])


@st.composite
def _weighted_jobs(draw: st.DrawFn) -> tuple[list[int], int, list[float], list[int] | None]:
    world = draw(st.integers(1, 9))
    chunks = draw(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3)), max_size=40))
    weights = draw(st.lists(_WEIGHTS, min_size=world, max_size=world))
    grouped = draw(st.booleans())
    return ([c for c, _ in chunks], world, weights,
            [g for _, g in chunks] if grouped else None)


@given(st.lists(_weighted_jobs(), min_size=1, max_size=5))
# A chunk of no bytes finishes at once on a rank with no load in its group (rank 1 here):
# it goes there, not to rank 0 as if no rank were tied for the least finish.
@example([([5, 0], 2, [1.0, 0.5], None)])
def test_owners_of_jobs_side_by_side_are_each_job_s_own(
        jobs: list[tuple[list[int], int, list[float], list[int] | None]]) -> None:
    """Every job's unequal-weight greedy steps taken in one array (jobs of other worlds,
    lengths and groups beside it) give the owners of that job alone, tie for tie."""
    from gradlane.policies.chunks import assign_owners_of

    got = assign_owners_of(jobs)
    for (sizes, world, weights, groups), owners in zip(jobs, got, strict=True):
        if max(weights) > min(weights) * (1 + 1e-9):
            assert owners == _owners_one_job_at_a_time(sizes, world, weights, groups)
        assert owners == assign_owners(sizes, world, weights, groups)


def test_owners_follow_weights() -> None:
    owners = assign_owners([1] * 300, 3, weights=[2.0, 1.0, 0.0001 + 1.0])
    assert owners.count(0) == pytest.approx(150, abs=2)
    for weights in ([1.0, 0.0], [1.0]):
        with pytest.raises(ConfigError,
                           match=re.escape(f"need 2 positive owner weights, got {weights}")):
            assign_owners([1], 2, weights=weights)
    with pytest.raises(ConfigError, match="^world size must be >= 1, got 0"):
        assign_owners([1], 0)
    with pytest.raises(ConfigError, match="^need one group per chunk: 1 groups, 2 chunks"):
        assign_owners([1, 1], 2, groups=[0])


def test_bands_split_layers_by_forward_order() -> None:
    assert [band_of(i, 8, 4) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [band_of(i, 3, 4) for i in range(3)] == [0, 1, 2]
    assert band_of(0, 1, 4) == 0
    # Past the last layer, or with no layers known, the last band (not a band that is none).
    assert band_of(8, 8, 4) == band_of(20, 8, 4) == 3
    assert band_of(0, 0, 4) == 3


def test_the_layout_trial_runs_the_steps_the_shim_s_config_names() -> None:
    """Warm-up steps 0-2, fine 3-5, regroup at 6, coarse 7-12, regroup at 13, fine 14-16,
    decided at 17 (`ShimConfig.layout` says 17): blocks of 3 measured steps, fine, coarse,
    coarse, fine, each regrouping step left out of the measurements."""
    fine1, to_coarse, coarse, to_fine, fine2, decide = trial_schedule()
    assert (fine1, to_coarse, coarse) == (range(3, 6), 6, range(7, 13))
    assert (to_fine, fine2, decide) == (13, range(14, 17), 17)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.data())
def test_reduction_trees_cross_each_uplink_once(leaves: list[int], data: st.DataObject) -> None:
    owner = data.draw(st.integers(0, len(leaves) - 1))
    parents = reduction_parents(owner, leaves)
    assert parents[owner] == -1
    for rank, parent in enumerate(parents):
        if rank == owner:
            continue
        # At most two hops to the owner, the first one inside the rank's own leaf.
        hops = [rank, parent] + ([parents[parent]] if parent != owner else [])
        assert hops[-1] == owner and len(hops) <= 3
        assert leaves[parent] == leaves[rank] or parent == owner
    crossing = [r for r, p in enumerate(parents) if p >= 0 and leaves[p] != leaves[r]]
    # One sender per other leaf: one copy of the chunk per leaf crosses the spine.
    assert sorted(leaves[r] for r in crossing) == sorted(set(leaves) - {leaves[owner]})


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4)), min_size=1, max_size=8),
       st.data())
def test_two_level_trees_cross_each_nic_and_uplink_once(
    host_specs: list[tuple[int, int]], data: st.DataObject,
) -> None:
    """Hosts (each under a leaf, with some ranks), ranks in host order: one copy of the
    chunk leaves each host but the owner's, and one each leaf but the owner's."""
    hosts = [h for h, (_, n) in enumerate(host_specs) for _ in range(n)]
    leaves = [host_specs[h][0] for h in hosts]
    owner = data.draw(st.integers(0, len(hosts) - 1))
    parents = reduction_parents(owner, leaves, hosts)
    assert all_reduction_parents(leaves, hosts)[owner].tolist() == parents
    for rank in range(len(hosts)):  # every rank reaches the owner, at most three hops
        hops = [rank]
        while hops[-1] != owner:
            hops.append(parents[hops[-1]])
            assert len(hops) <= 4
    off_host = [r for r, p in enumerate(parents) if p >= 0 and hosts[p] != hosts[r]]
    assert sorted(hosts[r] for r in off_host) == sorted(set(hosts) - {hosts[owner]})
    off_leaf = [r for r, p in enumerate(parents) if p >= 0 and leaves[p] != leaves[r]]
    assert sorted(leaves[r] for r in off_leaf) == sorted(set(leaves) - {leaves[owner]})


def test_reduction_tree_examples() -> None:
    assert reduction_parents(2, [0, 0, 0, 0]) == [2, 2, -1, 2]  # one leaf: flat
    # Rank 1 is second on leaf 0, so rank 3 (second on leaf 1) leads leaf 1 for it.
    assert reduction_parents(1, [0, 0, 1, 1]) == [1, -1, 3, 1]
    assert reduction_parents(0, [0, 1, 1, 0]) == [-1, 0, 1, 0]
    # Two levels: ranks 0, 1 on one host and 2 on another under leaf 0, rank 3 under leaf
    # 1. For owner 3, rank 0 leads its host and leaf 0: 1 -> 0 -> 3 and 2 -> 0 -> 3.
    assert reduction_parents(3, [0, 0, 0, 1], [0, 0, 1, 2]) == [3, 0, 0, -1]
    assert reduction_parents(2, [0, 0, 0, 1], [0, 0, 1, 2]) == [2, 0, -1, 2]
    with pytest.raises(ConfigError, match="^owner 4 is not a rank of 4"):
        reduction_parents(4, [0, 0, 1, 1])
    with pytest.raises(ConfigError, match="^need one host per rank: 3 for 4"):
        reduction_parents(0, [0, 0, 1, 1], [0, 0, 1])


@given(st.integers(1, 24), st.data())
def test_ring_routes_reach_the_owner_and_everyone_once(world: int, data: st.DataObject) -> None:
    owner = data.draw(st.integers(0, world - 1))
    reduce, result = ring_routes(owner, world)
    assert reduce[owner] == result[owner] == -1
    for rank in range(world):
        if rank != owner:  # every rank sends only to its successor, receives from its predecessor
            assert reduce[rank] == (rank + 1) % world and result[rank] == (rank - 1) % world
    # Following the partial sum from the owner's successor visits every rank once, then the owner.
    path, rank = [], (owner + 1) % world
    for _ in range(world):
        path.append(rank)
        if rank == owner:
            break
        rank = reduce[rank]
    assert sorted(path) == list(range(world)) and path[-1] == owner


def test_ring_route_examples() -> None:
    assert ring_routes(2, 4) == ([1, 2, -1, 0], [3, 0, -1, 2])
    assert ring_routes(0, 3) == ([-1, 2, 0], [-1, 0, 1])
    with pytest.raises(ConfigError, match="^owner 3 is not a rank of 3"):
        ring_routes(3, 3)


@given(st.integers(1, 20), st.sampled_from(["auto", "flat", "ring"]), st.data(),
       st.sampled_from([1, 7, 1 << 20]))
def test_routes_connect_exactly_the_ranks_chunks_travel_between(
        world: int, exchange: str, data: st.DataObject, block: int) -> None:
    """`Routes.peers` is what a rank's mesh connects: every hop of every owner's chunks
    (both ways) is between peers, every peer carries one, and each pair agrees. (The
    trees are taken a few owners at a time, `TREE_BLOCK` pairs: one owner, some, all.)"""
    groups = st.none() | st.lists(st.integers(0, 3), min_size=world, max_size=world)
    leaves, hosts = data.draw(groups), data.draw(groups)
    routes = Routes.agreed(exchange, world, leaves, hosts)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunks, "TREE_BLOCK", block)
        routes.peers(0)  # builds the links, once for `routes`
    hops: set[tuple[int, int]] = set()
    for owner in range(world):
        for parents in routes.of(owner):
            hops |= {(r, p) for r, p in enumerate(parents) if p >= 0}
    for rank in range(world):
        used = {p for r, p in hops if r == rank} | {r for r, p in hops if p == rank}
        assert set(routes.peers(rank)) == used, (rank, routes)
        assert all(rank in routes.peers(p) for p in routes.peers(rank))
    if routes.kind == "ring":
        assert routes.peers(0) == tuple(sorted({1, world - 1}))
    # The model's copy at attach: a tree from rank 0 over those connections alone.
    copy = routes.copy_parents()
    assert copy[0] == -1
    for rank in range(1, world):
        assert rank in routes.peers(copy[rank]), (rank, copy, routes)
        seen, up = {rank}, copy[rank]
        while up > 0:  # reaches rank 0, never coming round to a rank again
            assert up not in seen, copy
            seen.add(up)
            up = copy[up]


def test_routes_examples() -> None:
    # 32 ranks, 8 a host: each rank reaches its host's 7 others and the ranks at its place
    # on the 3 other hosts, where the flat exchange would connect all 31.
    by_host = Routes.agreed("auto", 32, hosts=[r // 8 for r in range(32)])
    assert by_host.kind == "host" and by_host.peers(0) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24)
    assert by_host.peers(9) == (1, 8, 10, 11, 12, 13, 14, 15, 17, 25)
    assert Routes.agreed("auto", 32).peers(5) == tuple(r for r in range(32) if r != 5)
    # The copy crosses from host to host once each (rank 0 sending it 10 times otherwise).
    assert by_host.copy_parents()[:17] == [-1, 0, 1, 2, 3, 4, 5, 6, 15, 8, 9, 10, 11, 12, 13,
                                           7, 22]
    assert Routes.agreed("auto", 32).copy_parents() == list(range(-1, 31))
    # Hosts under leaves: the copy enters each host and each leaf once (16 hosts, 4 leaves).
    leaves, hosts = [r // 32 for r in range(128)], [r // 8 for r in range(128)]
    copy = Routes.agreed("auto", 128, leaves, hosts).copy_parents()
    assert sum(hosts[r] != hosts[copy[r]] for r in range(1, 128)) == 15
    assert sum(leaves[r] != leaves[copy[r]] for r in range(1, 128)) == 3
    # ... and the chunks reduce within hosts, then within leaves: rank 0 exchanges with its
    # host (1-7), the ranks at its place on its leaf's other hosts (8, 16, 24) and in the
    # other leaves (32, 64, 96); not with the 15 other hosts' as if no leaf were known.
    two_levels = Routes.agreed("auto", 128, leaves, hosts)
    assert two_levels.kind == "leaf" and two_levels.hosts == tuple(hosts)
    assert two_levels.peers(0) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 64, 96)
    # Ranks sharing hosts under one leaf: within hosts first, as with no leaf known; not
    # the ring ("auto", 4 ranks), nor a "flat" job connecting every rank (hypothesis
    # found its routes, host-first, used fewer peers than it connected).
    for exchange, world in (("auto", 4), ("flat", 4), ("auto", 32)):
        hosts = [r // (world // 2) for r in range(world)]
        one_leaf = Routes.agreed(exchange, world, [7] * world, hosts)
        assert one_leaf == Routes.agreed(exchange, world, None, hosts)
        assert one_leaf.kind == "host" and len(one_leaf.peers(0)) == world // 2
    assert Routes.agreed("ring", 5).copy_parents() == [-1, 0, 1, 2, 3]
    assert Routes.agreed("auto", 6).peers(0) == (1, 5)  # the ring
    assert Routes.agreed("auto", 2).peers(1) == (0,)
    assert Routes.agreed("auto", 1).peers(0) == ()
    with pytest.raises(ConfigError, match="^need one leaf per rank: 2 for 4"):
        Routes.agreed("auto", 4, leaves=[0, 1])
    with pytest.raises(ConfigError, match="^rank 4 is not a rank of 4"):
        Routes.agreed("auto", 4).peers(4)


def test_auto_takes_the_ring_only_where_it_was_measured_under_one_leaf() -> None:
    top = RING_AUTO_MAX_WORLD
    assert [w for w in range(1, top + 3) if uses_ring("auto", w, 1)] == list(range(3, top + 1))
    assert [w for w in range(1, top + 3) if uses_ring("ring", w, 1)] == list(range(3, top + 3))
    assert not any(uses_ring("flat", w, 1) for w in range(1, top + 3))
    assert not uses_ring("auto", 4, 2) and not uses_ring("ring", 4, 2)  # two leaves: the tree
    # What the ranks then tell gradlaned.
    assert [exchange_kind("auto", w, 1) for w in (2, 4, top + 1)] == ["flat", "ring", "flat"]
    assert exchange_kind("ring", 4, 2) == exchange_kind("auto", 4, 2) == "leaf"


def test_groups_take_consecutive_layers_of_one_band_until_they_hold_enough() -> None:
    sizes, bands = [10, 10, 100, 10, 10], [0, 0, 0, 1, 1]
    assert group_consecutive(sizes, bands, 20) == [range(0, 2), range(2, 3), range(3, 5)]
    assert group_consecutive(sizes, bands, 1) == [range(k, k + 1) for k in range(5)]
    assert group_consecutive(sizes, bands, 0) == [range(k, k + 1) for k in range(5)]  # no empty
    assert group_consecutive([], [], 20) == []


def test_layout_sizes_of_a_big_and_a_small_model() -> None:
    # 10 MiB on 4 ranks: fine chunks are a quarter of a rank's share, coarse ones a half.
    assert layout_sizes(10 << 20, 4, 1 << 20, "fine") == (MIN_GROUP_BYTES, 10 << 20 >> 4)
    assert layout_sizes(10 << 20, 4, 1 << 20, "coarse") == (COARSE_GROUP_BYTES, 10 << 20 >> 3)
    assert layout_sizes(1 << 30, 4, 1 << 20, "fine")[1] == 1 << 20  # the configured size caps
    assert layout_sizes(100_000, 4, 1 << 20, "fine")[1] == 64 << 10  # not under 64 KiB
    # Around the ring a chunk makes 2(W-1) hops, not 2: its fine chunks are W-1 times smaller.
    assert layout_sizes(10 << 20, 4, 1 << 20, "fine", ring=True) == (
        MIN_GROUP_BYTES, (10 << 20) // 48)
    assert layout_sizes(10 << 20, 4, 1 << 20, "coarse", ring=True)[1] == 10 << 20 >> 3
    assert layout_sizes(4 << 20, 2, 1 << 20, "fine", ring=True)[1] == 4 << 20 >> 3  # 2 hops


def test_ranks_sharing_some_hosts_reduce_within_them_first() -> None:
    four = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert host_groups(four, "auto") == (0, 0, 1, 1)
    assert host_groups(four, "flat") == (0, 0, 1, 1)
    assert host_groups(four, "ring") is None  # asked for the ring, whatever the placement
    assert host_groups(["10.0.0.2", "10.0.0.1", "10.0.0.2"], "auto") == (0, 1, 0)
    assert host_groups(["10.0.0.1"] * 4, "auto") is None  # one host: nothing to group
    assert host_groups(["10.0.0.1", "10.0.0.2", "10.0.0.3"], "auto") is None  # one rank a host
    assert exchange_kind("auto", 4, 2, by_host=True) == "host"
    assert exchange_kind("auto", 4, 2) == "leaf"
    assert exchange_kind("auto", 4, 1, by_host=True) == "ring"
