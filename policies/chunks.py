"""Who owns each gradient chunk and which band carries it.

Pure functions shared by the shim (every worker computes the same layout
without talking to the others) and the cluster policies (`loadbalance`,
`priority`), so both always agree.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from gradlane.errors import ConfigError

__all__ = [
    "COARSE_GROUP_BYTES", "DEFAULT_CHUNK_BYTES", "EXCHANGE_OPTIONS", "LAYOUTS", "MIN_CHUNK_BYTES",
    "MIN_GROUP_BYTES", "OPTION_BYTES", "RING_AUTO_MAX_WORLD", "TRIAL_BLOCK", "TRIAL_START",
    "Owning", "Routes",
    "all_reduction_parents", "assign_owners", "assign_owners_of", "band_of", "exchange_kind",
    "group_consecutive", "host_groups", "layout_sizes", "reduction_parents", "ring_routes",
    "trial_schedule", "uses_ring",
]

DEFAULT_CHUNK_BYTES = 1 << 20  # `gradlane.shim.ShimConfig.chunk_bytes`
# The ranges of `gradlane.shim.ShimConfig`'s sizes in bytes (here, where the bench's
# scenarios check them too, without torch). Credit and SO_SNDBUF are socket options, C
# ints: 2 GiB or more failed at the first connect.
OPTION_BYTES = {"chunk_bytes": (4096, 1 << 30), "credit_bytes": (1024, 1 << 30),
                "sndbuf_bytes": (0, 1 << 30)}
LAYOUTS = ("auto", "fine", "coarse")  # `gradlane.shim.ShimConfig.layout`
EXCHANGE_OPTIONS = ("auto", "flat", "ring")  # `gradlane.shim.ShimConfig.exchange` (`uses_ring`)
MIN_CHUNK_BYTES = 64 << 10
# Consecutive layers (forward order, same band and dtype) share one group until it holds
# this many bytes: a ResNet's batch-norm layers (a few KB each) ride with a convolution
# instead of costing a message exchange of their own.
MIN_GROUP_BYTES = 64 << 10
# The shim's "coarse" layout: groups of at least this many bytes, chunks up to it. Some
# ten messages per worker and step for a 10 MB model instead of some sixty.
COARSE_GROUP_BYTES = 4 << 20


TIE = 1e-9  # `assign_owners`: finish times this close (relative) are a tie


def assign_owners(
    sizes: Sequence[int],
    world: int,
    weights: Sequence[float] | None = None,
    groups: Sequence[int] | None = None,
) -> list[int]:
    """An owner rank for each chunk so that owned bytes follow `weights`.

    List scheduling on uniform machines (Graham; LPT's greedy step without
    the sort, because the order is the priority order): chunks are taken in
    the given order and each goes to the rank whose owned bytes divided by
    its weight would be smallest afterwards; ties go to the lowest rank.
    Consecutive high-priority chunks thus land on different owners, which
    spreads both the bytes and their timing. Equal weights (the default)
    balance bytes; the `loadbalance` policy passes link rates for
    heterogeneous links.

    `groups` (one id per chunk, consecutive chunks sharing an id, e.g. the
    layer) balances each group on its own first: a group's chunks travel
    together, so its exchange ends when its most loaded owner is done.
    Within a group the rank with the least owned bytes overall breaks ties,
    so the remainders of uneven groups rotate over the ranks.
    """
    return assign_owners_of([(sizes, world, weights, groups)])[0]


Owning = tuple[Sequence[int], int, Sequence[float] | None, Sequence[int] | None]


def assign_owners_of(jobs: Sequence[Owning]) -> list[list[int]]:
    """`assign_owners` of several jobs, each ``(sizes, world, weights, groups)``.

    The same owners as one job at a time; the jobs with unequal weights take
    their greedy steps side by side (every job's ``i``-th chunk in one array
    operation), so a plan of 128 jobs costs as many steps as the longest job
    has chunks, not as all of them have.
    """
    out: list[list[int]] = [[] for _ in jobs]
    weighted: list[tuple[int, Sequence[int], np.ndarray, Sequence[int] | None]] = []
    for k, (sizes, world, weights, groups) in enumerate(jobs):
        if world < 1:
            raise ConfigError(f"world size must be >= 1, got {world}")
        if weights is not None and (len(weights) != world or not all(w > 0 for w in weights)):
            raise ConfigError(f"need {world} positive owner weights, got {list(weights)}")
        if groups is not None and len(groups) != len(sizes):
            raise ConfigError(
                f"need one group per chunk: {len(groups)} groups, {len(sizes)} chunks")
        # Weights a solver computed carry rounding noise (0.24999999999999992 next to
        # 0.25): within `TIE` of each other they count as equal, so ties still go to the
        # lowest rank.
        w = np.ones(world) if weights is None else np.asarray(weights, dtype=np.float64)
        if np.all(w <= w.min() * (1 + TIE)):
            out[k] = list(_equal_weights(tuple(sizes), world,
                                         None if groups is None else tuple(groups)))
        elif len(sizes):
            weighted.append((k, sizes, w, groups))
    if weighted:
        for (k, *_), owners in zip(weighted, _weighted([j[1:] for j in weighted]), strict=True):
            out[k] = owners
    return out


def _weighted(jobs: list[tuple[Sequence[int], np.ndarray, Sequence[int] | None]]
              ) -> list[list[int]]:
    """`assign_owners` with unequal weights, for each ``(sizes, weights, groups)`` at once:
    row ``j`` of every array is job ``j``'s, its ranks past its world (and chunks past
    its own) padding. Each chunk goes to the least finish time in its group (owned in
    the group + the chunk, over the weight), within `TIE`; of those, the least owned
    bytes overall over the weight, within `TIE`; of those, the lowest rank."""
    n, world = len(jobs), max(len(w) for _, w, _ in jobs)
    length = np.array([len(sizes) for sizes, _, _ in jobs])
    weight, rank = np.ones((n, world)), np.zeros((n, world), dtype=bool)
    size = np.zeros((n, int(length.max())))
    group = np.zeros(size.shape, dtype=np.int64)
    for j, (sizes, w, groups) in enumerate(jobs):
        weight[j, :len(w)], rank[j, :len(w)] = w, True
        size[j, :len(sizes)] = sizes
        if groups is not None:
            group[j, :len(sizes)] = groups
    total, group_load = np.zeros((n, world)), np.zeros((n, world))
    owners = np.zeros(size.shape, dtype=np.int64)
    rows = np.arange(n)
    padded, unranked = not rank.all(), ~rank
    anew = (group[:, 1:] != group[:, :-1]).T  # per step, the rows whose group starts anew
    starts = anew.any(axis=1).tolist()
    scale = 1 + TIE
    # Per step, each row's chunk (a column, against the rows' ranks; and a row, to add),
    # and the rows its owners are in.
    steps, adds = size.T[:, :, None], size.T
    at: tuple[np.ndarray, ...] = (rows,)
    if n == 1:  # one job: its row as a vector, the chunk a scalar: half the cost a step
        weight, total, group_load, anew = weight[0], total[0], group_load[0], anew[:, 0]
        steps = adds = size[0]
        at = ()
    for i in range(size.shape[1]):
        if i and starts[i - 1]:
            group_load[anew[i - 1]] = 0.0  # one job's: a True scalar, the whole vector
        s = steps[i]
        finish = (group_load + s) / weight
        if padded:
            finish[unranked] = np.inf
        tied = finish <= finish.min(axis=-1, keepdims=True) * scale
        overall = (total + s) / weight
        overall[~tied] = np.inf
        best = np.argmax(overall <= overall.min(axis=-1, keepdims=True) * scale, axis=-1)
        where = (*at, best)
        group_load[where] += adds[i]
        total[where] += adds[i]
        owners[:, i] = best
    return [owners[j, :length[j]].tolist() for j in range(n)]


@functools.lru_cache(maxsize=1024)
def _equal_weights(sizes: tuple[int, ...], world: int,
                   groups: tuple[int, ...] | None) -> tuple[int, ...]:
    """`assign_owners` with equal weights: each chunk to the rank of least load within its
    group, then least owned bytes overall, then lowest rank. Cached: a cluster's jobs are
    a few models on a few sizes, planned again at every change (400 jobs of 4 models,
    1,024 hosts: 65 of a plan's 140 ms, ad hoc)."""
    total = [0] * world
    # Every rank keyed by owned bytes, then rank, packed into one integer (``owned * world
    # + rank``: integers compare in C, tuples do not). A group of at most `world` chunks of
    # some bytes each goes to as many ranks, those of least owned bytes, in order (each rank
    # taken has a load in the group, those not taken none); only theirs change. So a group
    # costs its chunks' pops and pushes, not a heap of every rank (a plan at 1,024 hosts
    # has hundreds of groups of a few chunks for 128 ranks).
    ranks = list(range(world))
    owners: list[int] = []
    start = 0
    runs = [len(sizes)] if groups is None else [len(list(run)) for _, run in groupby(groups)]
    for run in runs:
        group = sizes[start:start + run]
        start += run
        if not group:
            continue
        if len(group) <= world and min(group) > 0:
            taken = [heapq.heappop(ranks) % world for _ in group]
            for rank, size in zip(taken, group, strict=True):
                total[rank] += size
                heapq.heappush(ranks, total[rank] * world + rank)
            owners += taken
        else:  # ranks take several chunks: keyed (load in the group, owned, rank), packed
            span = (sum(total) + sum(group) + 1) * world
            heap = [total[r] * world + r for r in range(world)]
            heapq.heapify(heap)
            for size in group:
                key = heap[0]
                best = key % world
                total[best] += size
                heapq.heapreplace(heap, (key // span + size) * span + total[best] * world + best)
                owners.append(best)
            ranks = [total[r] * world + r for r in range(world)]
            heapq.heapify(ranks)
    return tuple(owners)


def band_of(order: int, layers: int, bands: int) -> int:
    """The band of the layer that runs `order`-th in the forward pass.

    Layers are split into `bands` equal runs by forward order: the first
    quarter of layers (with 4 bands) rides band 0, the highest priority.
    """
    if layers <= 0:
        return bands - 1
    return min(bands - 1, order * bands // layers)


def layout_sizes(
    model_bytes: int, world: int, chunk_bytes: int, layout: str, ring: bool = False
) -> tuple[int, int]:
    """(the least bytes of a group, the chunk size) of the shim's `layout` ("fine" or
    "coarse", `gradlane.shim.ShimConfig.layout`) for a model of `model_bytes` on `world`
    ranks, `chunk_bytes` being the configured chunk size; `ring`: the job exchanges
    around the ring (`uses_ring`).

    Owners are whole chunks, so a model of few large chunks cannot be
    balanced: one worker would receive and send a large layer's every byte.
    Fine chunks are therefore at most a quarter of a worker's fair share of
    the model (but not under `MIN_CHUNK_BYTES`, where the fixed cost per
    chunk starts to show); coarse ones make fewer messages, and owners still
    get about two each.

    On the ring a chunk crosses 2(W-1) links one after the other, each
    hop stored and forwarded whole, where the reduction tree's crosses two:
    fine chunks are W-1 times smaller there, so that a chunk's trip takes
    as long as on the tree. Otherwise the last chunks' hops are a tail in
    which the links idle: the flow-level simulator, with the hops modeled,
    put four hosts' VGG-19 (10 MB) at 1.12x of its bound with a sixteenth
    of the model per chunk and 1.03x with a 48th; the testbed, in time x2,
    measured 1.12x and 1.08-1.09x (README, "Around the ring").
    """
    hops = max(1, world - 1) if ring else 1
    least = OPTION_BYTES["chunk_bytes"][0]
    fine = max(least, min(chunk_bytes, max(MIN_CHUNK_BYTES, model_bytes // (4 * world * hops))))
    if layout == "coarse":
        return COARSE_GROUP_BYTES, max(fine, min(COARSE_GROUP_BYTES, model_bytes // (2 * world)))
    return MIN_GROUP_BYTES, fine


# "auto": after TRIAL_START warm-up steps, blocks of TRIAL_BLOCK measured steps, fine,
# coarse, coarse, fine (see `trial_schedule`).
TRIAL_START, TRIAL_BLOCK = 3, 3


def trial_schedule() -> tuple[range, int, range, int, range, int]:
    """The shim's layout trial's steps (`gradlane.shim.ShimConfig.layout` "auto"):
    (fine, to coarse, coarse, to fine, fine, decide).

    "to coarse" and "to fine" regroup before their backward and are not
    measured; "decide" is where the ranks agree (and regroup, if coarse won).
    """
    fine1 = range(TRIAL_START, TRIAL_START + TRIAL_BLOCK)
    coarse = range(fine1.stop + 1, fine1.stop + 1 + 2 * TRIAL_BLOCK)
    fine2 = range(coarse.stop + 1, coarse.stop + 1 + TRIAL_BLOCK)
    return fine1, fine1.stop, coarse, coarse.stop, fine2, fine2.stop


def group_consecutive(sizes: Sequence[int], bands: Sequence[int], least: int) -> list[range]:
    """Consecutive items (layers in forward order) grouped: a group takes the next item
    while that has the group's band and the group holds fewer than `least` bytes.

    A group's first layer in forward order is also the last whose gradient
    backward produces, so a group is ready when its first layer alone would
    be: merging delays no layer that runs early.
    """
    groups: list[range] = []
    start, held = 0, 0
    for i, (size, band) in enumerate(zip(sizes, bands, strict=True)):
        if i > start and (band != bands[start] or held >= least):
            groups.append(range(start, i))
            start, held = i, 0
        held += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


def reduction_parents(owner: int, leaves: Sequence[int],
                      hosts: Sequence[int] | None = None) -> list[int]:
    """Where each rank sends its part of one chunk: the chunk's reduction tree.

    `leaves[r]` is the leaf switch of rank r. Ranks send to their leaf's
    *leaf owner*; leaf owners send the leaf's partial sum to `owner`, which
    sends the average back down the same tree. So one copy of the chunk
    crosses each leaf's uplink per direction, not one per rank on the other
    side: with k ranks per leaf, the spine carries k times fewer bytes
    (hierarchical reduction, as Horovod's and PLink's, per chunk).

    The leaf owner of leaf L is the member of L at the owner's position in its
    own leaf, modulo L's size (members in rank order): ranks that own equal
    bytes lead their leaves for equal bytes. With one leaf this is the flat
    exchange, every rank sending straight to `owner`.

    With `hosts` (each rank's host, every host in one leaf), two levels:
    ranks send to their host's leader (chosen the same way among the host's
    ranks, over loopback), and the host leaders form the leaf level above.
    One copy per host then crosses its NIC and one per leaf the spine,
    where a leaf leader alone would take a copy from every rank of its leaf
    on its NIC.

    Returns ``parents[r]``, with ``parents[owner] == -1``.
    """
    world = len(leaves)
    if not 0 <= owner < world:
        raise ConfigError(f"owner {owner} is not a rank of {world}")
    if hosts is None:
        lead = _leads(owner, leaves)
        return [-1 if rank == owner else owner if rank == lead[leaf] else lead[leaf]
                for rank, leaf in enumerate(leaves)]
    if len(hosts) != world:
        raise ConfigError(f"need one host per rank: {len(hosts)} for {world}")
    host_lead = _leads(owner, hosts)
    leaders = sorted(set(host_lead.values()))  # the owner among them: it leads its host
    above = reduction_parents(leaders.index(owner), [leaves[r] for r in leaders])
    parents = []
    for rank, host in enumerate(hosts):
        if rank == owner:
            parents.append(-1)
        elif rank != host_lead[host]:
            parents.append(host_lead[host])
        else:
            parents.append(leaders[above[leaders.index(rank)]])
    return parents


def _leads(owner: int, groups: Sequence[int]) -> dict[int, int]:
    """Per group, the member at `owner`'s position in its own group, modulo the group's
    size (members in rank order): `owner` leads its own."""
    members: dict[int, list[int]] = {}
    for rank, group in enumerate(groups):
        members.setdefault(group, []).append(rank)
    position = members[groups[owner]].index(owner)
    return {group: ranks[position % len(ranks)] for group, ranks in members.items()}


def ring_routes(owner: int, world: int) -> tuple[list[int], list[int]]:
    """One chunk's exchange around the ring of ranks: (reduce parents, result parents).

    The chunk's partial sum travels ``owner+1 -> owner+2 -> ... -> owner``, each
    rank adding its own part, and the average travels on ``owner -> owner+1
    -> ... -> owner-1``: every rank sends only to its successor and receives
    only from its predecessor, whoever owns the chunk. Each link carries one
    copy each way, as in the flat exchange (`reduction_parents`, one leaf),
    and no rank ever receives from several senders at once: no incast at a
    switch port, so the only queue is the sender's own, where its priority
    order holds. The price is latency: W-1 hops each way instead of one.
    (This is ring all-reduce's communication pattern, per chunk.)

    Returns ``(reduce, result)``: ``reduce[r]`` is where rank r sends its
    (partial) sum, ``result[r]`` the rank r receives the average from;
    both -1 for the owner.
    """
    if not 0 <= owner < world:
        raise ConfigError(f"owner {owner} is not a rank of {world}")
    reduce = [-1 if r == owner else (r + 1) % world for r in range(world)]
    result = [-1 if r == owner else (r - 1) % world for r in range(world)]
    return reduce, result


# The largest job "auto" sends around the ring: measured on the testbed up to 8
# hosts (README). A chunk's W-1 store-and-forward hops each way grow with W.
RING_AUTO_MAX_WORLD = 8


def uses_ring(exchange: str, world: int, leaves: int) -> bool:
    """Whether a job of `world` ranks under `leaves` leaf switches takes the ring.

    `exchange` is `gradlane.shim.ShimConfig.exchange`: "auto", "flat" or
    "ring". Below three ranks the ring and the flat exchange are the same
    path; across leaves the reduction tree (`reduction_parents`) keeps one
    copy per leaf on the spine, which a ring of ranks would not.
    """
    if world < 3 or leaves != 1:
        return False
    return exchange == "ring" or (exchange == "auto" and world <= RING_AUTO_MAX_WORLD)


def exchange_kind(exchange: str, world: int, leaves: int, by_host: bool = False) -> str:
    """What a job's ranks on `exchange` do, as they tell gradlaned
    (`gradlane.daemon.fields.EXCHANGES`): "ring" where `uses_ring` says so,
    across several groups reduction trees within them first: "host" when the
    groups are the ranks' hosts (`by_host`, `host_groups`), "leaf" when
    their leaf switches; else "flat"."""
    if uses_ring(exchange, world, leaves):
        return "ring"
    if leaves > 1:
        return "host" if by_host else "leaf"
    return "flat"


# `Routes` builds its ranks' links from the trees of this many (owner, rank) pairs at a
# time: some 40 MB of temporaries at any world size.
TREE_BLOCK = 1 << 20


@dataclass(frozen=True)
class Routes:
    """How a job's chunks travel between its ranks, the same on every rank (the ranks
    agree on `agreed`'s inputs first).

    `kind` is `exchange_kind`'s; `top` each rank's group at the tree's top
    level (its leaf, or its host when only hosts are known; one group: the
    flat exchange), `hosts` each rank's host under the leaves (two levels),
    else None.
    """

    kind: str
    world: int
    top: tuple[int, ...]
    hosts: tuple[int, ...] | None

    @classmethod
    def agreed(cls, exchange: str, world: int, leaves: Sequence[int] | None = None,
               hosts: Sequence[int] | None = None) -> Routes:
        """The routes of a job of `world` ranks on `exchange`
        (`gradlane.shim.ShimConfig.exchange`) reducing within `leaves` first, and
        within `hosts` (`host_groups`) before those or alone; None (or, for leaves,
        one for all): no such groups."""
        for name, given in (("leaf", leaves), ("host", hosts)):
            if given is not None and len(given) != world:
                raise ConfigError(f"need one {name} per rank: {len(given)} for {world}")
        if leaves is not None and len(set(leaves)) == 1:
            # One leaf is no level of the trees: above hosts, a flat kind's peers (every
            # rank) and routes (within hosts first) would differ, and "auto" take the ring.
            leaves = None
        by_host = leaves is None and hosts is not None
        top = hosts if by_host else leaves
        groups = tuple(top) if top is not None else (0,) * world
        lower = tuple(hosts) if hosts is not None and not by_host else None
        return cls(exchange_kind(exchange, world, len(set(groups)), by_host), world, groups,
                   lower)

    def of(self, owner: int) -> tuple[list[int], list[int]]:
        """(reduce parents, result parents) of a chunk `owner` owns: `ring_routes` on the
        ring, else the reduction tree both ways (`reduction_parents`)."""
        if self.kind == "ring":
            return ring_routes(owner, self.world)
        parents = reduction_parents(owner, self.top, self.hosts)
        return parents, parents

    def peers(self, rank: int) -> tuple[int, ...]:
        """The ranks `rank` exchanges chunks with, whoever owns them: the only ones it
        needs connections to. Symmetric (``b in peers(a)`` exactly when ``a in
        peers(b)``).

        Flat: every other rank. Ring: the two neighbours. Trees: the members of
        `rank`'s groups and the ranks at its place in the other groups (with
        8 ranks a host and 128 hosts, 7 + 127 of 1,023).
        """
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is not a rank of {self.world}")
        if self.kind == "ring":
            return tuple(sorted({(rank - 1) % self.world, (rank + 1) % self.world}))
        if self.kind == "flat":
            return tuple(r for r in range(self.world) if r != rank)
        starts, peers = self._tree_links
        return tuple(peers[starts[rank]:starts[rank + 1]].tolist())

    def copy_parents(self) -> list[int]:
        """Where each rank receives rank 0's model from at attach (-1: rank 0): a path
        through the ranks' connections (`peers`), depth first from rank 0, to a peer on
        the same host, else in the same group (leaf), else any (the lowest rank among
        equals). So the copy enters each host and each leaf once (1,024 ranks, 8 a host,
        64 a leaf: 127 host and 15 leaf crossings, the least there can be). Ring and
        flat: 0 -> 1 -> ... -> W-1.

        Each rank passes each piece on as it comes (`gradlane.shim.transport.relay`),
        so the copy takes about one model's time on a link plus a piece's per hop.
        Down a chunk's result routes instead, rank 0 would send the whole model once
        per child: W-1 times in the flat exchange, 134 times at 1,024 ranks, 8 a host.
        """
        if self.kind in ("ring", "flat"):
            return list(range(-1, self.world - 1))
        starts, peers = self._tree_links
        top = np.asarray(self.top)
        host = top if self.hosts is None else np.asarray(self.hosts)
        seen = np.zeros(self.world, dtype=bool)
        seen[0] = True
        parents, path = [-1] * self.world, [0]
        while path:  # bounded: every rank is pushed once and popped once
            here = path[-1]
            linked = peers[starts[here]:starts[here + 1]]
            on = linked[~seen[linked]]
            if not len(on):
                path.pop()
                continue
            away = 2 * (host[on] != host[here]) + (top[on] != top[here])
            nxt = int(on[np.argmin(away)])  # the first, lowest rank, of the nearest
            seen[nxt], parents[nxt] = True, path[-1]
            path.append(nxt)
        if not seen.all():  # every rank reaches every other through its groups' leaders
            raise ConfigError(f"ranks {np.flatnonzero(~seen).tolist()} are not connected "
                              f"to rank 0 in {self}")
        return parents

    @functools.cached_property
    def _tree_links(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The ranks each rank exchanges chunks with in the reduction trees (some owner's
        chunk goes between them, either way), as ``(starts, peers)``: rank r's are
        ``peers[starts[r]:starts[r + 1]]``, in rank order. Once per routes: attach asks
        `peers` and `copy_parents`.

        An owner's tree depends on the owner only through its place (`_tree_places`):
        each place's tree is built once, and each owner adds the ranks that send it
        their groups' sums. 8,192 ranks (8 a host, 32 hosts a leaf) took 2.5 s and a
        W x W table on every rank when every owner's tree was built; 0.4 s now, and
        65,536 ranks 9.8 s and 1.6 GB at the peak (ad hoc).
        """
        w = self.world
        child, parent = _tree_pairs(self.top, self.hosts)
        codes = np.concatenate([child * w + parent, parent * w + child])
        codes.sort()  # then each once: np.unique's hashing took 9 s of 11 at 32,768 ranks
        codes = codes[np.concatenate([[True], codes[1:] != codes[:-1]])]
        return np.searchsorted(codes // w, np.arange(w + 1)), codes % w


def _tree_pairs(top: Sequence[int], hosts: Sequence[int] | None
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Every (child, parent) of every owner's tree (`all_reduction_parents`), some more
    than once.

    Owners at the same place have the same tree but for who it ends at: one level, a
    group's lead is the member at the owner's place in its own group; two levels, a
    host's leader is the member at the owner's place in its host, and a leaf's lead the
    leader at the owner's host's place among its leaf's leaders. So the tree of one
    owner a place, and for each owner, each group's lead sending to it, are all of them.
    Owner by owner where ranks of one host name different leaves.
    """
    w = len(top)
    places = _tree_places(top, hosts)
    if places is None:
        child, parent = [], []
        step = max(1, TREE_BLOCK // w)  # owners a block at a time: W^2 int64 parents at
        for first in range(0, w, step):  # once took 2.2 GB (8,192 ranks) on every rank
            parents = all_reduction_parents(top, hosts, np.arange(first, min(first + step, w)))
            block, ranks = np.nonzero(parents >= 0)
            child.append(ranks)
            parent.append(parents[block, ranks])
        return np.concatenate(child), np.concatenate(parent)
    place, leads = places
    firsts = np.unique(place, return_index=True)[1]  # one owner a place
    parents = all_reduction_parents(top, hosts, firsts)
    block, ranks = np.nonzero(parents >= 0)
    # Each owner: every group's lead at its place sends to it (its own group's: itself).
    to = np.repeat(np.arange(w), leads.shape[1])
    sent = leads[place].reshape(-1)
    apart = sent != to
    return (np.concatenate([ranks, sent[apart]]),
            np.concatenate([parents[block, ranks], to[apart]]))


def _tree_places(top: Sequence[int], hosts: Sequence[int] | None
                 ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """Each owner's place (owners of one place have one tree but for its end, see
    `_tree_pairs`), numbered 0.., and per place the lead of each top group; None where
    ranks of one host name different leaves."""
    leaf = np.asarray(top, dtype=np.int64)
    w = len(leaf)
    if hosts is None:  # a group's lead is the member at the owner's place in its group
        index = _in_groups(leaf)
        _, owner_place = np.unique(_places_in_groups(index), return_inverse=True)
        owner_place = owner_place.reshape(-1)
        return owner_place, _lead_matrix(index, np.unique(owner_place, return_index=True)[1])
    # Two levels: a host's leader is the member at the owner's place in its host ...
    index = _in_groups(hosts)
    in_host = _places_in_groups(index)
    _, host_place = np.unique(in_host, return_inverse=True)
    host_place = host_place.reshape(-1)
    at = leader_parents(leaf, hosts, np.unique(host_place, return_index=True)[1], places=True)
    if at is None:
        return None
    assert at.place is not None  # asked for
    # ... and a leaf's lead the leader at the owner's host's leader's place in its leaf.
    in_leaf = at.place[host_place, at.host_index]
    _, owner_place = np.unique(host_place * (w + 1) + in_leaf, return_inverse=True)
    owner_place = owner_place.reshape(-1)
    leads = leader_parents(leaf, hosts, np.unique(owner_place, return_index=True)[1])
    assert leads is not None  # as `at`
    return owner_place, leads.leaf_lead


def host_groups(hosts: Sequence[str], exchange: str) -> tuple[int, ...] | None:
    """Each rank's host as a group for reducing within hosts first, or None.

    `hosts`: every rank's host name, rank order (gradlaned's, else the
    address the rank listens on: `gradlane.shim.transport.reduction_groups`).
    When some ranks share a host but not all do, each chunk is best reduced
    within each host first: one copy per host crosses its NIC each way
    instead of one per rank (the ring, the alternative, carries ``2 - 1/H``
    models per host link at best, H hosts, against ``2 (H - 1) / H``). Not
    with ``exchange == "ring"``, which asks for the ring whatever the
    placement. Groups are numbered in order of first appearance.
    """
    seen: dict[str, int] = {}
    groups = tuple(seen.setdefault(h, len(seen)) for h in hosts)
    if exchange == "ring" or not 1 < len(seen) < len(hosts):
        return None
    return groups


def all_reduction_parents(
    leaves: Sequence[int] | npt.NDArray[np.int64],
    hosts: Sequence[int] | npt.NDArray[np.int64] | None = None,
    owners: Sequence[int] | npt.NDArray[np.int64] | None = None,
) -> npt.NDArray[np.int64]:
    """`reduction_parents` for many owners at once: row ``i`` is
    ``reduction_parents(owners[i], leaves, hosts)`` (`owners`: every rank by default).

    Vectorized (a planner builds the trees of many ranks of every job), two
    levels (`hosts`) too: 0.06 s for 1,024 ranks, 8 a host, 64 a leaf, where
    owner by owner took 0.23 s. Owner by owner still where ranks of one host
    name different leaves (then each host leader's own leaf counts).
    """
    leaf = np.asarray(leaves, dtype=np.int64)
    world = len(leaf)
    ranks = np.arange(world)
    of = ranks if owners is None else np.asarray(owners, dtype=np.int64).reshape(-1)
    rows = np.arange(len(of))
    if len(of) and not (of.min() >= 0 and of.max() < world):
        raise ConfigError(f"owners {of.tolist()[:8]} are not all ranks of {world}")
    if hosts is None:
        _, index = np.unique(leaf, return_inverse=True)  # each rank's leaf, 0..L-1
        lead = _lead_matrix(index, of)
        parents = lead[:, index]  # (owner, rank): the lead of the rank's leaf
        parents = np.where(parents == ranks[None, :], of[:, None], parents)  # leads: to the owner
        parents[rows, of] = -1
        return np.asarray(parents, dtype=np.int64)
    between = leader_parents(leaf, hosts, of)
    if between is None:  # a host under several leaves
        leaf_list, host_list = leaf.tolist(), np.asarray(hosts).tolist()
        return np.array([reduction_parents(o, leaf_list, host_list) for o in of.tolist()],
                        dtype=np.int64).reshape(len(of), world)
    host_index, host_lead, above = between.host_index, between.lead, between.above
    up = host_lead[:, host_index]  # (owner, rank): the leader of the rank's host
    # A leader sends where its host's does (`leader_parents`), the others to their leader.
    parents = np.where(up == ranks[None, :], above[:, host_index], up)
    parents[rows, of] = -1
    return np.asarray(parents, dtype=np.int64)


class Leaders(NamedTuple):
    """`leader_parents`: the trees of `all_reduction_parents` (two levels) between hosts."""

    host_index: npt.NDArray[np.int64]  # each rank's host, 0..H-1 in sorted host order
    lead: npt.NDArray[np.int64]  # (owners, H): each host's leader
    above: npt.NDArray[np.int64]  # (owners, H): where it sends (a rank; -1: the owner's)
    leaf_lead: npt.NDArray[np.int64]  # (owners, L): each leaf's lead, leaves in order
    # (owners, H): each host's leader's place among its leaf's (`places`; else None)
    place: npt.NDArray[np.int64] | None


def leader_parents(
    leaves: Sequence[int] | npt.NDArray[np.int64],
    hosts: Sequence[int] | npt.NDArray[np.int64],
    owners: npt.NDArray[np.int64],
    places: bool = False,
) -> Leaders | None:
    """The trees of `all_reduction_parents` (two levels) between hosts, per owner
    (`Leaders`; its ``place`` with `places` only). What a tree puts on host links is all
    here, at an H-th of the ranks' trees' size. None where ranks of one host name
    different leaves.
    """
    leaf = np.asarray(leaves, dtype=np.int64)
    world = len(leaf)
    of = owners
    rows = np.arange(len(of))
    host = np.asarray(hosts, dtype=np.int64)
    _, host_index = np.unique(host, return_inverse=True)
    host_index = host_index.reshape(-1)
    n_hosts = int(host_index.max()) + 1
    host_leaf = np.full(n_hosts, -1, dtype=np.int64)
    host_leaf[host_index] = leaf
    if np.any(host_leaf[host_index] != leaf):
        return None
    host_lead = _lead_matrix(host_index, of)  # (owner, host): the host's leader
    # The leaders' level: each host's leader in its leaf, as `reduction_parents` over the
    # leaders in rank order. Every host has one leader, so a leaf has as many leaders as
    # hosts whatever the owner; sorted by (leaf, rank), each row groups them by leaf.
    _, leaf_of_host = np.unique(host_leaf, return_inverse=True)
    sizes = np.bincount(leaf_of_host)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    by_leaf = np.argsort(leaf_of_host[None, :] * world + host_lead, axis=1)
    grouped = np.take_along_axis(host_lead, by_leaf, axis=1)
    place = None
    if places:  # each host's leader's place among its leaf's leaders
        place = np.empty_like(by_leaf)
        np.put_along_axis(place, by_leaf, np.broadcast_to(np.arange(n_hosts), by_leaf.shape),
                          1)
        place -= first[leaf_of_host][None, :]
    own_leaf = leaf_of_host[host_index]  # each rank's leaf, 0..L-1
    # The owner's position among its leaf's leaders: leaders of its leaf below it.
    position = ((leaf_of_host[None, :] == own_leaf[of][:, None])
                & (host_lead < of[:, None])).sum(axis=1)
    leaf_lead = grouped[rows[:, None], first[None, :] + position[:, None] % sizes[None, :]]
    above = leaf_lead[:, leaf_of_host]  # (owner, host): the lead of the host's leaf ...
    above = np.where(above == host_lead, of[:, None], above)  # ... or, the lead, the owner
    above[rows, host_index[of]] = -1  # the owner leads its host: the root
    return Leaders(np.asarray(host_index, dtype=np.int64), host_lead,
                   np.asarray(above, dtype=np.int64), np.asarray(leaf_lead, dtype=np.int64),
                   place)


def _in_groups(groups: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Each rank's group, 0..G-1 in sorted group order."""
    return np.asarray(np.unique(np.asarray(groups), return_inverse=True)[1],
                      dtype=np.int64).reshape(-1)


def _places_in_groups(index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Each rank's place in its group (`index`: each rank's, 0..G-1), members in rank order."""
    order = np.argsort(index, kind="stable")
    first = np.concatenate([[0], np.cumsum(np.bincount(index))[:-1]])
    place = np.empty(len(index), dtype=np.int64)
    place[order] = np.arange(len(index)) - first[index[order]]
    return place


def _lead_matrix(index: npt.NDArray[np.int64],
                 owners: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``lead[i, g]``: the member of group ``g`` at ``owners[i]``'s position in its own
    group, modulo g's size (members in rank order); `index`: each rank's group, 0..G-1."""
    order = np.argsort(index, kind="stable")  # ranks grouped, rank order within
    sizes = np.bincount(index)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    position = _places_in_groups(index)
    return np.asarray(order[first[None, :] + position[owners][:, None] % sizes[None, :]])
