"""`gradlane.policies.demand`: the load-equivalent flows carry what the reduction trees carry."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlane.errors import ConfigError
from gradlane.policies import FlowTable, demand
from gradlane.policies.chunks import all_reduction_parents, assign_owners, reduction_parents
from gradlane.policies.demand import Exchange, bucket_starts
from tests import examples


@settings(max_examples=examples(200))
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_all_reduction_parents_are_each_owners_tree(leaves: list[int]) -> None:
    every = all_reduction_parents(leaves)
    assert [row.tolist() for row in every] == [
        reduction_parents(owner, leaves) for owner in range(len(leaves))]
    some = list(range(len(leaves)))[::-2]  # some owners, any order: their rows
    np.testing.assert_array_equal(all_reduction_parents(leaves, owners=some), every[some])
    with pytest.raises(ConfigError, match="not all ranks"):
        all_reduction_parents(leaves, owners=[len(leaves)])


@settings(max_examples=examples(200))
@given(st.lists(st.integers(0, 5), min_size=1, max_size=14),
       st.lists(st.integers(0, 3), min_size=6, max_size=6), st.booleans())
def test_two_level_trees_for_every_owner_at_once_are_each_owners_tree(
    hosts: list[int], leaf_of_host: list[int], stray: bool,
) -> None:
    # Ranks on hosts in any order, each host under one leaf; or (`stray`) rank 0 naming
    # another leaf than its host's, which the vectorized path leaves to the loop.
    leaves = [leaf_of_host[h] for h in hosts]
    if stray:
        leaves[0] += 1
    every = all_reduction_parents(leaves, hosts)
    assert [row.tolist() for row in every] == [
        reduction_parents(owner, leaves, hosts) for owner in range(len(leaves))]
    some = list(range(len(leaves)))[::-2]
    np.testing.assert_array_equal(all_reduction_parents(leaves, hosts, some), every[some])


def _peers_by_loop(leaf: list[int], host: list[int]) -> tuple[list[int], list[int]]:
    """`Exchange._peers` rank by rank, as its docstring says."""
    w, leaves = len(leaf), sorted(set(leaf))
    members = {lf: [r for r in range(w) if leaf[r] == lf] for lf in leaves}
    in_leaf, next_leaf = [], []
    for r in range(w):
        mine = members[leaf[r]]
        pos = mine.index(r)
        after = [mine[(pos + k) % len(mine)] for k in range(1, len(mine))]
        elsewhere = [x for x in after if host[x] != host[r]]
        in_leaf.append((elsewhere or after or [(r + 1) % w])[0])
        other = members[leaves[(leaves.index(leaf[r]) + 1) % len(leaves)]]
        next_leaf.append(other[pos % len(other)])
    return in_leaf, next_leaf


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=14))
def test_peers_are_the_next_rank_elsewhere_in_the_leaf_and_one_in_the_next_leaf(
    ranks: list[tuple[int, int]]
) -> None:
    leaf, host = [lf for lf, _ in ranks], [h for _, h in ranks]
    ex = Exchange(leaf, uplinks=True, host=host)
    assert (ex.peer_in_leaf.tolist(), ex.peer_next_leaf.tolist()) == _peers_by_loop(leaf, host)


def test_bucket_starts() -> None:
    assert bucket_starts([0, 0, 1, 3, 3, 3]).tolist() == [0, 2, 3, 6]
    assert bucket_starts([]).tolist() == [0, 0]


def test_flat_exchange_sends_a_bucket_plus_w_minus_2_owned() -> None:
    w, sizes, layers = 4, [100, 200, 300, 400, 500], [0, 0, 1, 1, 2]
    owners = assign_owners(sizes, w)
    starts = bucket_starts(layers)
    ex = Exchange([0] * w, uplinks=False)
    local, remote = ex.loads(ex.owned(owners, starts, sizes), in_leaf=False)
    assert not remote.any()
    for b, (lo, hi) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        bucket = sum(sizes[lo:hi])
        for r in range(w):
            owned = sum(s for s, o in zip(sizes[lo:hi], owners[lo:hi], strict=True) if o == r)
            assert local[b, r] == bucket + (w - 2) * owned


@settings(max_examples=examples(150))
@given(st.integers(1, 9), st.lists(st.tuples(st.integers(1, 10_000), st.integers(0, 99)),
                                   min_size=1, max_size=12))
def test_ring_exchange_sends_every_chunk_to_the_successor_once_each_way(
    w: int, chunks: list[tuple[int, int]]
) -> None:
    sizes, owners = [s for s, _ in chunks], [o % w for _, o in chunks]
    layers = sorted(o % 3 for _, o in chunks)  # up to three buckets
    starts = bucket_starts(layers)
    ex = Exchange([0] * w, uplinks=False, ring=True)
    local, remote = ex.loads(ex.owned(owners, starts, sizes), in_leaf=False)
    assert not remote.any()
    for b, (lo, hi) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        for r in range(w):
            # ring_routes: every rank but the owner sends the sum on, all but the owner's
            # predecessor the average.
            sent = sum((r != o) * s + (r != (o - 1) % w) * s
                       for s, o in zip(sizes[lo:hi], owners[lo:hi], strict=True))
            assert local[b, r] == sent
    flows = ex.demand_flows(list(range(w)), local, remote, 0, starts)
    assert all(dst == (src + 1) % w for src, dst in zip(flows.src, flows.dst, strict=True))


@st.composite
def placements(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], list[int], bool]:
    """Ranks on hosts (some sharing one), hosts under leaves, chunks, owners, in_leaf."""
    hosts = draw(st.integers(1, 6))
    host_leaf = [draw(st.integers(0, 2)) for _ in range(hosts)]
    w = draw(st.integers(2, 9))
    rank_host = sorted(draw(st.integers(0, hosts - 1)) for _ in range(w))
    sizes = draw(st.lists(st.integers(1, 10_000), min_size=1, max_size=12))
    owners = [draw(st.integers(0, w - 1)) for _ in sizes]
    return rank_host, host_leaf, sizes, owners, draw(st.booleans())


@settings(max_examples=examples(150))
@given(placements())
def test_demand_flows_load_hosts_and_uplinks_as_the_trees_do(case) -> None:  # type: ignore[no-untyped-def]
    rank_host, host_leaf, sizes, owners, in_leaf = case
    leaf = [host_leaf[h] for h in rank_host]
    # What the shim's trees carry, edge by edge; edges within a host are loopback.
    egress = np.zeros(len(host_leaf))
    up = np.zeros(max(host_leaf) + 1)
    for size, owner in zip(sizes, owners, strict=True):
        parents = _shim_tree(owner, rank_host, leaf, in_leaf)
        for child, parent in enumerate(parents):
            if parent < 0 or rank_host[child] == rank_host[parent]:
                continue
            for a, b in ((child, parent), (parent, child)):
                egress[rank_host[a]] += size
                if leaf[a] != leaf[b]:
                    up[leaf[a]] += size
    ex = Exchange(leaf, uplinks=True, host=rank_host)
    starts = bucket_starts([0] * len(sizes))
    local, remote = ex.loads(ex.owned(owners, starts, sizes), in_leaf)
    flows = ex.demand_flows(rank_host, local, remote, 0, starts)
    got_egress = np.zeros(len(host_leaf))
    got_up = np.zeros(len(up))
    for src, dst, nbytes in zip(flows.src, flows.dst, flows.bytes, strict=True):
        assert src != dst and nbytes > 0
        got_egress[src] += nbytes
        if host_leaf[src] != host_leaf[dst]:
            got_up[host_leaf[src]] += nbytes
    np.testing.assert_allclose(got_egress, egress)
    np.testing.assert_allclose(got_up, up)
    # Chunks counted with each bucket's chunk size (the simulator's way) load the links as
    # their bytes do: here a bucket a chunk.
    apart = bucket_starts(list(range(len(sizes))))
    by_count = ex.loads(ex.owned(owners, apart), in_leaf, [float(s) for s in sizes])
    by_bytes = ex.loads(ex.owned(owners, apart, sizes), in_leaf)
    for counted, summed in zip(by_count, by_bytes, strict=True):
        np.testing.assert_allclose(counted, summed)


def test_rows_take_the_buckets_priority_fraction_left_and_readiness() -> None:
    ex = Exchange([0, 0], uplinks=False)
    starts = bucket_starts([0, 1])
    local, remote = ex.loads(ex.owned([0, 1], starts, [10, 20]), in_leaf=False)
    flows = ex.demand_flows([5, 7], local, remote, 3, starts, left=np.array([0.0, 0.5]),
                            ready_s=np.array([0.0, 0.25]), priority=[4, 9])
    # Bucket 0 is done; bucket 1 (chunk 1, owned by rank 1): rank 0 sends its 20, rank 1 the result.
    assert flows.equals(FlowTable.build([(5, 7, 10.0, 0.25, 9, 3, 1), (7, 5, 10.0, 0.25, 9, 3, 1)]))


@settings(max_examples=examples(100))
@given(placements(), st.sampled_from(["trees", "ring", "by host"]), st.integers(1, 3))
def test_trees_built_a_few_owners_at_a_time_are_those_built_at_once(  # type: ignore[no-untyped-def]
    case, kind: str, per_block: int,
) -> None:
    """`Exchange.trees` takes owners in blocks (of `BLOCK_FLOWS` flows): the same
    counts as one block of every owner, the last block short or not; and `link_loads`,
    from blocks it does not keep, the same as from the trees kept."""
    rank_host, host_leaf, _, _, in_leaf = case
    leaf = [host_leaf[h] for h in rank_host]

    def built(block_flows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(demand, "BLOCK_FLOWS", block_flows)
            ex = Exchange(leaf, uplinks=True, host=rank_host, ring=kind == "ring",
                          by_host=kind == "by host")
            unkept = ex.link_loads(in_leaf)
            return (*ex.trees(in_leaf), unkept, ex.link_loads(in_leaf))

    at_once, in_blocks = built(1 << 40), built(per_block * len(rank_host))
    for whole, pieces in zip(at_once, in_blocks, strict=True):
        np.testing.assert_array_equal(pieces, whole)
    np.testing.assert_array_equal(in_blocks[2], at_once[3])


@settings(max_examples=examples(60))
@given(placements(), st.sampled_from(["trees", "ring", "by host"]), st.data())
def test_link_loads_of_some_owners_are_their_rows_of_every_owner_s(  # type: ignore[no-untyped-def]
    case, kind: str, data: st.DataObject,
) -> None:
    rank_host, host_leaf, _, _, in_leaf = case
    leaf = [host_leaf[h] for h in rank_host]
    some = data.draw(st.lists(st.integers(0, len(rank_host) - 1), max_size=6))

    def exchange() -> Exchange:
        return Exchange(leaf, uplinks=True, host=rank_host, ring=kind == "ring",
                        by_host=kind == "by host")

    every = exchange().link_loads(in_leaf)
    np.testing.assert_array_equal(exchange().link_loads(in_leaf, some), every[some])
    kept = exchange()
    kept.trees(in_leaf)  # from the trees kept, too
    np.testing.assert_array_equal(kept.link_loads(in_leaf, some), every[some])


@settings(max_examples=examples(100))
@given(placements(), st.sampled_from(["trees", "ring", "by host"]))
def test_loads_from_the_owners_trees_alone_are_those_from_every_tree(  # type: ignore[no-untyped-def]
    case, kind: str,
) -> None:
    """`Exchange.loads` builds only its owners' trees, and more as other ranks come to
    own chunks: the loads every owner's trees (`trees`, kept) give."""
    rank_host, host_leaf, sizes, owners, in_leaf = case
    leaf = [host_leaf[h] for h in rank_host]

    def exchange() -> Exchange:
        return Exchange(leaf, uplinks=True, host=rank_host, ring=kind == "ring",
                        by_host=kind == "by host")

    every, lazy = exchange(), exchange()
    every.trees(in_leaf)
    starts = bucket_starts(range(len(sizes)))
    for some in (owners[: len(owners) // 2], owners[::-1], owners):  # new owners each time
        owned = every.owned(some, starts[: len(some) + 1], sizes[: len(some)])
        for want, got in zip(every.loads(owned, in_leaf), lazy.loads(owned, in_leaf),
                             strict=True):
            np.testing.assert_array_equal(got, want)
    assert len(lazy._rows[in_leaf][1]) == len(set(owners))  # each owner's rows built once


@settings(max_examples=examples(150))
@given(placements())
def test_a_chunk_s_tree_stages_go_up_by_subtree_then_down_by_depth(case) -> None:  # type: ignore[no-untyped-def]
    rank_host, host_leaf, _, _, in_leaf = case
    w = len(rank_host)
    leaf = [host_leaf[h] for h in rank_host]
    ex = Exchange(leaf, uplinks=True, host=rank_host)
    n_stages, counts = ex.stages(in_leaf)
    per_owner, _ = ex.trees(in_leaf)
    np.testing.assert_allclose(counts.sum(axis=1), per_owner)  # every flow, at one stage
    for owner in range(w):
        parents = _shim_tree(owner, rank_host, leaf, in_leaf)
        height, depth = _height(parents), _depth(parents)
        up = height[owner]
        assert n_stages[owner] == 2 * up
        # Per stage, the flows on each link: ranks' egress, their ingress, then each leaf's
        # uplink and downlink (leaves in increasing order).
        leaves = sorted(set(leaf))
        on = np.zeros((max(2 * up, 1), ex.columns))
        for child, parent in enumerate(parents):
            if parent < 0 or rank_host[child] == rank_host[parent]:
                continue
            # Its (partial) sum up; the result down, level by level.
            for a, b, stage in ((child, parent, height[child]),
                                (parent, child, up + depth[parent])):
                on[stage, [a, w + b]] += 1
                if leaf[a] != leaf[b]:
                    on[stage, 2 * w + leaves.index(leaf[a])] += 1
                    on[stage, 2 * w + len(leaves) + leaves.index(leaf[b])] += 1
        np.testing.assert_allclose(counts[owner, : len(on)], on)
        assert not counts[owner, len(on):].any()  # other owners' trees may be deeper


def _height(parents: list[int]) -> list[int]:
    """Each rank's subtree height: a rank sends its sum up once its subtree's are in."""
    height = [0] * len(parents)
    for _ in parents:  # a level a pass
        for child, parent in enumerate(parents):
            if parent >= 0:
                height[parent] = max(height[parent], height[child] + 1)
    return height


def _depth(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for _ in parents:
        for child, parent in enumerate(parents):
            if parent >= 0:
                depth[child] = depth[parent] + 1
    return depth


def _shim_tree(owner: int, rank_host: list[int], leaf: list[int], in_leaf: bool) -> list[int]:
    """The shim's reduction tree of `owner`'s chunks: flat, or within leaves first, ranks
    sharing hosts reducing within them before (two levels)."""
    if not in_leaf:
        return reduction_parents(owner, [0] * len(rank_host))
    shared = rank_host if len(set(rank_host)) < len(rank_host) else None
    return reduction_parents(owner, leaf, shared)
