"""A job's gradient exchange as the demand flows a planner sees.

Each chunk is reduced along its reduction tree
(`gradlane.policies.chunks.reduction_parents`, the shim's own) to its
owner, and the result goes back down: one flow up and one down per tree
edge. Flat (one leaf, or no reduction within leaves), a rank sends
``S + (W - 2) * owned`` bytes of a bucket of ``S`` bytes of which it owns
``owned``; with reduction within leaves, one copy of each chunk per leaf
crosses the spine each way. With ``ring`` (the shim's ring exchange,
`gradlane.policies.chunks.uses_ring`: one leaf), every chunk goes around the
ring of ranks instead (`gradlane.policies.chunks.ring_routes`), and a rank
sends ``2 * S - owned(r) - owned(r + 1)`` bytes of a bucket, all to its
successor: the same as flat over an iteration whose owners are balanced, but
not bucket by bucket (a one-chunk bucket: 2 S from every rank but the owner
and its predecessor, where flat has the owner send (W - 1) S).

A planner needs the load, not every chunk's every edge: per bucket (a layer,
in forward order) and rank, `Exchange.demand_flows` gives at most two
*load-equivalent* flows: one to a rank of its own leaf carrying what the
rank sends within its leaf, and one to a rank of the next leaf carrying what
it sends across the spine. They put on every host link and uplink what the
real exchange puts there, with two flows per rank and bucket instead of one
per chunk and tree edge. The simulator (`gradlane.policies.sim`) and the
control plane (`gradlane control`) build their states with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gradlane.policies.base import FloatArray, FlowTable, IntArray
from gradlane.policies.chunks import all_reduction_parents, leader_parents

__all__ = ["Exchange", "SparseLoads", "bucket_starts"]

# `Exchange.trees` takes owners in blocks of about this many tree edges: its temporaries
# (some ten integers an edge) stay near 100 MB at any world size, not ~40 W^2 bytes.
BLOCK_FLOWS = 1 << 20


def bucket_starts(chunk_layers: Sequence[int] | IntArray) -> IntArray:
    """Where each bucket starts in a job's chunks, and the end: ``len(buckets) + 1`` indices.

    A bucket is a run of consecutive chunks of one layer.
    """
    layers = np.asarray(chunk_layers, dtype=np.int64)
    starts = np.flatnonzero(np.diff(layers)) + 1 if len(layers) else np.zeros(0, np.int64)
    return np.concatenate([[0], starts, [len(layers)]]).astype(np.int64)


@dataclass(frozen=True)
class SparseLoads:
    """`Exchange.link_loads` as a load per column and what some rows put there beyond it:
    ``loads[r, c] = base[c] + extra`` at the given ``(row, col)`` (each at most once).

    A large job's trees cross most hosts' links once each way per chunk, whoever
    owns it (every host sends its contribution up and takes the result back), so
    beyond that base, an owner's row differs only at the hosts its tree gathers
    at: a leaf's leader and the owner's own. 8,192 hosts in leaves of 32: 512 of
    16,384 columns a row.
    """

    base: FloatArray  # per column
    row: IntArray
    col: IntArray
    extra: FloatArray
    rows: int

    def dense(self) -> FloatArray:
        loads = np.tile(self.base, (self.rows, 1))
        loads[self.row, self.col] += self.extra
        return loads


class Exchange:
    """The reduction trees of one job's ranks, given each rank's host leaf.

    Args:
        leaf: per rank, the leaf switch of its host.
        uplinks: whether the fabric has leaf uplinks at all (a one-switch
            cluster has none: no leaf columns, no spine traffic).
        host: per rank, its host (default: one host per rank). What ranks of
            one host send each other stays off the network (loopback).
        ring: every chunk around the ring of ranks (`ring_routes`) instead of
            its reduction tree; the caller decides
            (`gradlane.policies.chunks.uses_ring`).
        by_host: `trees` ``in_leaf`` reduces within each host first instead of
            each leaf (`gradlane.policies.chunks.host_groups`, ranks sharing hosts).
    """

    def __init__(self, leaf: Sequence[int] | IntArray, uplinks: bool,
                 host: Sequence[int] | IntArray | None = None, ring: bool = False,
                 by_host: bool = False) -> None:
        self.leaf = np.asarray(leaf, dtype=np.int64)
        self.w = len(self.leaf)
        self.host = np.arange(self.w) if host is None else np.asarray(host, dtype=np.int64)
        self.uplinks = uplinks
        self.ring = ring
        self.by_host = by_host
        self.leaves = np.unique(self.leaf) if uplinks else np.zeros(0, dtype=np.int64)
        self.peer_in_leaf, self.peer_next_leaf = self._peers()
        self._trees: dict[bool, tuple[FloatArray, FloatArray]] = {}
        # `loads`' rows of `trees` for the owners it met: each owner's slot (-1: none yet),
        # and per slot its flows out of each rank and out of each rank's leaf.
        self._rows: dict[bool, tuple[IntArray, FloatArray, FloatArray]] = {}

    def trees(self, in_leaf: bool) -> tuple[FloatArray, FloatArray]:
        """Per owner rank, the flows one chunk puts on each link, and per rank its flows
        that leave its leaf (cached: they depend on the placement only).

        Columns of the first: ranks' egress, their ingress, then the job's leaves'
        uplinks and downlinks (`leaves` order). Each tree edge carries one flow
        up (the contribution) and one down (the result); on the ring, every rank
        but the owner sends the partial sum to its successor, and every rank but
        the owner's predecessor the average (`ring_routes`). `in_leaf` (reduce
        within each leaf first, and within each host before that when ranks
        share hosts; with `by_host`, within each host only) does not apply to
        the ring.
        """
        if in_leaf in self._trees:
            return self._trees[in_leaf]
        w = self.w
        per_owner = np.zeros((w, self.columns))
        crossed = np.zeros((w, w))
        for first, last, on_links, leaving in self._tree_blocks(in_leaf, np.arange(w)):
            per_owner[first:last], crossed[first:last] = on_links, leaving
        self._trees[in_leaf] = per_owner, crossed
        return self._trees[in_leaf]

    def _tree_blocks(self, in_leaf: bool, owners: IntArray
                     ) -> Iterator[tuple[int, int, FloatArray, FloatArray]]:
        """`trees`' rows of `owners`, a block of them at a time: (where the block starts
        in `owners`, where it ends, its rows of both). All owners' flows at once are W^2
        (some ten integers each)."""
        w, cols = self.w, self.columns
        step = max(1, BLOCK_FLOWS // w)
        for first in range(0, len(owners), step):
            last = min(first + step, len(owners))
            if self.ring:  # every rank but the owner
                owner, rank = np.nonzero(owners[first:last, None] != np.arange(w))
                edges = [(owner, rank, (rank + 1) % w), (owner, (rank - 1) % w, rank)]
            else:
                owner, child, parent = _edges(self._parents(in_leaf, owners[first:last]))
                edges = [(owner, child, parent), (owner, parent, child)]  # up, then down
            cells: list[IntArray] = []  # flat (owner, column) of each flow on a link
            crossing: list[IntArray] = []  # flat (owner, rank) of each flow leaving its leaf
            for of, a, b in edges:  # `of`: the owner, from `first`
                at, col, leaving = self._flow_columns(a, b)
                cells.append(of[at] * cols + col)
                crossing.append(of[leaving] * w + a[leaving])
            n = last - first
            on_links = np.bincount(np.concatenate(cells), minlength=n * cols)
            leaving = np.bincount(np.concatenate(crossing), minlength=n * w)
            yield (first, last, on_links.reshape(n, cols).astype(np.float64),
                   leaving.reshape(n, w).astype(np.float64))

    @property
    def columns(self) -> int:
        """`trees`' columns: ranks' egress, their ingress, the leaves' up and down links."""
        return 2 * self.w + 2 * len(self.leaves)

    def _flow_columns(self, sender: IntArray, receiver: IntArray
                      ) -> tuple[IntArray, IntArray, IntArray]:
        """The link columns flows from `sender` to `receiver` (element by element) take:
        (the flow each entry is of, its column, and the flows that leave their leaf).
        Flows within one host take none (loopback)."""
        w, n_leaves = self.w, len(self.leaves)
        apart = np.flatnonzero(self.host[sender] != self.host[receiver])
        a, b = sender[apart], receiver[apart]
        at, col = [apart, apart], [a, w + b]  # a's egress, b's ingress
        leaving = apart[:0]
        if n_leaves:
            slot = np.searchsorted(self.leaves, self.leaf)  # each rank's leaf column
            cross = self.leaf[a] != self.leaf[b]
            leaving = apart[cross]
            at += [leaving, leaving]
            col += [2 * w + slot[a[cross]], 2 * w + n_leaves + slot[b[cross]]]  # up, down
        return np.concatenate(at), np.concatenate(col), leaving

    def _parents(self, in_leaf: bool, owners: IntArray | None = None) -> IntArray:
        """The reduction trees (not the ring's) of `owners` (default: every rank),
        `all_reduction_parents`."""
        if in_leaf and self.by_host:
            return all_reduction_parents(self.host, owners=owners)
        if in_leaf and self.uplinks:  # within hosts too, when ranks share some
            return all_reduction_parents(
                self.leaf, self.host if self._two_levels(in_leaf) else None, owners)
        return all_reduction_parents(np.zeros(self.w, dtype=np.int64), owners=owners)

    def _two_levels(self, in_leaf: bool) -> bool:
        """Whether `_parents` reduces within hosts, then within leaves."""
        return in_leaf and not self.by_host and self.uplinks and len(self.hosts) < self.w

    @staticmethod
    def _edge_stages(parents: IntArray, owner: IntArray, child: IntArray, parent: IntArray
                     ) -> tuple[IntArray, IntArray]:
        """Each tree edge's up and down stage (`stages`).

        A chunk's stages, as the shim stores and forwards it whole: a rank sends its
        (partial) sum up once all of its subtree's have reached it, so an edge goes
        up at the height of the child's subtree (0 for a rank with no children); the
        result goes down each level once it has come down the one above, after the
        owner's height in stages: at that plus the parent's depth.
        """
        w = len(parents)
        depth = np.zeros((w, w), dtype=np.int64)
        height = np.zeros((w, w), dtype=np.int64)
        rows = np.arange(w)[:, None]
        above = parents  # each rank's ancestor `level` levels up, -1 past its root
        for level in range(1, w + 1):  # bounded: a tree of w ranks is less than w deep
            on = above >= 0
            if not on.any():
                break
            depth += on
            # The ancestor's subtree is at least `level` high; levels only grow, so the
            # last write is the largest (writes of one level are all the same).
            height[np.nonzero(on)[0], above[on]] = level
            above = np.where(on, parents[rows, np.maximum(above, 0)], -1)
        return height[owner, child], height[owner, owner] + depth[owner, parent]

    def stages(self, in_leaf: bool) -> tuple[IntArray, FloatArray]:
        """Per owner, the flows one chunk puts on each link at each of its stages
        (`_edge_stages`; not the ring's): ``(n_stages, counts)``, counts shaped
        ``(owners, max stages, columns)`` (`trees`' columns); a chunk's stages sum
        to its row of `trees`."""
        if self.ring:
            raise ValueError("the ring's hops are not tree stages")
        parents = self._parents(in_leaf)
        owner, child, parent = _edges(parents)
        up, down = self._edge_stages(parents, owner, child, parent)
        n_stages = np.zeros(self.w, dtype=np.int64)
        np.maximum.at(n_stages, owner, down + 1)
        depth = int(n_stages.max(initial=0))
        counts = np.zeros((self.w, max(depth, 1), self.columns))
        for of, a, b, stage in ((owner, child, parent, up), (owner, parent, child, down)):
            at, col, _ = self._flow_columns(a, b)
            np.add.at(counts, (of[at], stage[at], col), 1.0)
        return n_stages, counts

    @cached_property
    def hosts(self) -> IntArray:
        """The job's hosts, each once, in increasing order (`link_loads`' columns)."""
        return np.unique(self.host)

    def link_loads(self, in_leaf: bool,
                   owners: Sequence[int] | IntArray | None = None) -> FloatArray:
        """Per owner rank (every rank, or `owners`), the bytes one byte it owns puts on
        each host link the job uses.

        Columns: each of `hosts`' egress, then each one's ingress. Ranks of one
        host share its links; what they send each other is loopback and on none.
        """
        w, n_hosts = self.w, len(self.hosts)
        rows = self._rows_of(owners)
        on_host = self._on_host
        if in_leaf not in self._trees and not self.ring:
            return self.sparse_link_loads(in_leaf, owners).dense()
        blocks: Iterable[tuple[int, int, FloatArray]]
        if in_leaf in self._trees:
            kept = self._trees[in_leaf][0]
            blocks = [(0, len(rows), kept if owners is None else kept[rows])]
        else:  # not kept: a planner asks once per placement, and they are W^2
            blocks = ((first, last, per_owner) for first, last, per_owner, _ in
                      self._tree_blocks(in_leaf, rows))
        # Each rank's egress and ingress column is its host's: summed by host.
        column = np.concatenate([on_host] * 2)
        column[w:] += n_hosts
        loads = np.zeros((len(rows), 2 * n_hosts))
        for first, last, per_owner in blocks:
            n = last - first
            cell = (np.arange(n)[:, None] * 2 * n_hosts + column[None, :]).ravel()
            loads[first:last] = np.bincount(cell, weights=per_owner[:, : 2 * w].ravel(),
                                            minlength=n * 2 * n_hosts).reshape(n, 2 * n_hosts)
        return loads

    def _rows_of(self, owners: Sequence[int] | IntArray | None) -> IntArray:
        return np.arange(self.w) if owners is None else np.asarray(owners, dtype=np.int64)

    @cached_property
    def _on_host(self) -> IntArray:
        """Each rank's host column (`hosts`)."""
        return np.asarray(np.searchsorted(self.hosts, self.host), dtype=np.int64)

    def _host_edges(self, in_leaf: bool, owners: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """The tree edges between hosts of `owners`: each one's owner (its index in
        `owners`) and the child's and the parent's host (`hosts` columns)."""
        on_host = self._on_host
        if self._two_levels(in_leaf):  # only hosts' leaders send between hosts
            between = leader_parents(self.leaf, self.host, owners)
            if between is not None:
                above = between.above
                at, child = np.nonzero(above >= 0)
                return at, child, on_host[above[at, child]]
        parents = self._parents(in_leaf, owners)
        parent_host = on_host[np.maximum(parents, 0)]
        at, child = np.nonzero((parents >= 0) & (parent_host != on_host[None, :]))
        return at, on_host[child], parent_host[at, child]

    def sparse_link_loads(self, in_leaf: bool,
                          owners: Sequence[int] | IntArray | None = None) -> SparseLoads:
        """`link_loads` of trees (not the ring's) as `SparseLoads`: one flow each way
        on every host link, and what each owner's tree puts there beyond it.

        From the trees' parents, a block of owners at a time: a tree edge between
        two hosts carries the chunk up and the result down, one flow each way, so
        each of its ends' egress and ingress carries one, and a host's egress
        carries what its ingress does. (From the flows of `trees` instead, 8,192
        ranks took 3.4 s; from the parents, 0.6 s.) Dense, 8,192 hosts' owners
        took 1 GB a copy.
        """
        if self.ring:
            raise ValueError("the ring's loads are not trees'")
        n_hosts = len(self.hosts)
        owners = self._rows_of(owners)
        step = max(1, BLOCK_FLOWS // self.w)
        row, col, extra = [], [], []
        for first in range(0, len(owners), step):
            last = min(first + step, len(owners))
            at, child, parent = self._host_edges(in_leaf, owners[first:last])
            ends = np.concatenate([at * n_hosts + child, at * n_hosts + parent])
            beyond = np.bincount(ends, minlength=(last - first) * n_hosts) - 1
            cells = np.flatnonzero(beyond)
            row.append(first + cells // n_hosts)
            col.append(cells % n_hosts)
            extra.append(beyond[cells].astype(np.float64))
        rows, cols, more = (np.concatenate(a) if a else np.zeros(0) for a in (row, col, extra))
        rows, cols = rows.astype(np.int64), cols.astype(np.int64)
        return SparseLoads(base=np.ones(2 * n_hosts),  # egress, then ingress: the same
                           row=np.concatenate([rows, rows]),
                           col=np.concatenate([cols, cols + n_hosts]),
                           extra=np.concatenate([more, more]), rows=len(owners))

    def owned(self, owners: Sequence[int], starts: IntArray,
              weights: Sequence[float] | None = None) -> FloatArray:
        """Per bucket and rank, the chunks it owns (or their summed `weights`, e.g. bytes)."""
        nb = len(starts) - 1
        bucket = np.repeat(np.arange(nb), np.diff(starts))  # each chunk's bucket
        cell = bucket * self.w + np.asarray(owners, dtype=np.int64)
        counted = np.bincount(cell, weights, minlength=nb * self.w)
        return np.asarray(counted, dtype=np.float64).reshape(nb, self.w)

    def loads(self, owned: FloatArray, in_leaf: bool,
              chunk_size: Sequence[float] | None = None) -> tuple[FloatArray, FloatArray]:
        """Per bucket and rank, the bytes it sends to its own leaf and to other leaves.

        `owned`: per bucket and rank, the bytes of the bucket's chunks it owns;
        or the count of them, with `chunk_size` the bytes of each bucket's chunks.

        Only the trees of ranks that own something are built (and kept, for the
        next call): a job's chunks have far fewer owners than a large job has
        ranks (64 chunks, 8,192 ranks), and all of the trees are W^2.
        """
        size = 1.0 if chunk_size is None else np.asarray(chunk_size, dtype=np.float64)[:, None]
        if in_leaf in self._trees:
            per_owner, crossing = self._trees[in_leaf]
            egress, remote = owned @ per_owner[:, : self.w], owned @ crossing
        else:
            slot, out, leaving = self._owner_rows(in_leaf, np.flatnonzero(owned.any(axis=0)))
            known = slot >= 0
            by_slot = np.zeros((len(owned), len(out)))
            by_slot[:, slot[known]] = owned[:, known]
            egress, remote = by_slot @ out, by_slot @ leaving
        egress, remote = egress * size, remote * size
        return egress - remote, remote

    def _owner_rows(self, in_leaf: bool, owners: IntArray
                    ) -> tuple[IntArray, FloatArray, FloatArray]:
        """`_rows`, with those of `owners` built if they were not."""
        w = self.w
        slot, out, leaving = self._rows.get(
            in_leaf, (np.full(w, -1, dtype=np.int64), np.zeros((0, w)), np.zeros((0, w))))
        new = owners[slot[owners] < 0]
        if len(new):
            slot = slot.copy()
            slot[new] = len(out) + np.arange(len(new))
            out_new, leaving_new = np.zeros((len(new), w)), np.zeros((len(new), w))
            for first, last, on_links, crossed in self._tree_blocks(in_leaf, new):
                out_new[first:last], leaving_new[first:last] = on_links[:, :w], crossed
            out, leaving = np.concatenate([out, out_new]), np.concatenate([leaving, leaving_new])
            self._rows[in_leaf] = slot, out, leaving
        return slot, out, leaving

    def demand_flows(
        self,
        hosts: Sequence[int] | IntArray,
        local: FloatArray,
        remote: FloatArray,
        coflow: int,
        starts: IntArray,
        *,
        left: FloatArray | None = None,
        ready_s: FloatArray | None = None,
        priority: Sequence[int] | IntArray | None = None,
    ) -> FlowTable:
        """The load-equivalent flows of one coflow, bucket by bucket, rank by rank.

        Args:
            hosts: per rank, its host (an index into the topology's hosts).
            local, remote: `loads`.
            coflow: the coflow's index in the state.
            starts: `bucket_starts`; a flow's chunk is its bucket's first.
            left: per bucket, the fraction still to send (default: all of it).
            ready_s: per bucket, seconds until its gradient is ready (default 0).
            priority: per bucket, its forward-order priority (default: its index).
        """
        nb = len(starts) - 1
        left = np.ones(nb) if left is None else np.asarray(left, dtype=np.float64)
        ready = np.zeros(nb) if ready_s is None else np.asarray(ready_s, dtype=np.float64)
        prio = np.arange(nb, dtype=np.int64) if priority is None else np.asarray(
            priority, dtype=np.int64)
        host = np.asarray(hosts, dtype=np.int64)
        peers = np.stack([self.peer_in_leaf, self.peer_next_leaf], axis=1)  # (ranks, 2)
        sent = np.stack([local, remote], axis=2)  # (buckets, ranks, 2)
        sent[left == 0] = 0.0
        b, r, kind = np.nonzero(sent > 0)
        n = len(b)
        return FlowTable(host[r], host[peers[r, kind]], sent[b, r, kind] * left[b], ready[b],
                         prio[b], np.full(n, coflow, np.int64), starts[b])

    def _peers(self) -> tuple[IntArray, IntArray]:
        """Per rank, the next rank (rank order, cyclic) of another host in its own leaf
        (else the next rank of its leaf, else the next rank), and the rank at its own
        position among the next leaf's ranks (cyclic)."""
        w = self.w
        by_leaf = np.lexsort((np.arange(w), self.leaf))  # ranks by leaf, then rank
        _, start, count = np.unique(self.leaf[by_leaf], return_index=True, return_counts=True)
        group = np.repeat(np.arange(len(start)), count)  # each sorted slot's leaf group
        pos, leaf_of = np.empty(w, dtype=np.int64), np.empty(w, dtype=np.int64)
        pos[by_leaf] = np.arange(w) - start[group]  # each rank's place among its leaf's
        leaf_of[by_leaf] = group
        in_leaf = np.empty(w, dtype=np.int64)
        for first, n in zip(start.tolist(), count.tolist(), strict=True):
            mine = by_leaf[first : first + n]
            if n == 1:
                in_leaf[mine] = (mine + 1) % w
                continue
            # The first rank after each (cyclic: the leaf's ranks twice) on another host:
            # the end of the run of equal hosts it starts, plus one.
            hosts = self.host[np.concatenate([mine, mine])]
            run = np.concatenate([[0], np.cumsum(hosts[1:] != hosts[:-1])])
            run_end = np.flatnonzero(np.append(hosts[1:] != hosts[:-1], True))
            differs = run_end[run[:n]] + 1  # index into the doubled ranks
            here = np.arange(n)
            found = differs - here <= n - 1
            in_leaf[mine] = mine[np.where(found, differs, here + 1) % n]
        nxt = (leaf_of + 1) % len(start)
        next_leaf = by_leaf[start[nxt] + pos % count[nxt]]
        return in_leaf, next_leaf


def _edges(parents: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """The tree edges of `parents` rows (`all_reduction_parents`), each once: (the row,
    the child, its parent)."""
    row, child = np.nonzero(parents >= 0)
    return row, child, parents[row, child]
