"""`loadbalance`: tensor-aware choice of chunk owners so the most loaded link finishes first.

With reduce-scatter and all-gather through per-chunk owners (gradlane's
data path, and BytePS's co-located servers), what each link carries per
iteration depends on the bytes each worker owns (``S`` is the model), and
a link finishes at that over its rate, so:

1. Each worker's rate ``r`` is what its NIC can give this job: the NIC
   rate divided by the number of jobs with workers on that host.
2. Each worker's share of the bytes makes the most loaded link finish
   first. Equal rates give equal shares; otherwise it depends on how the
   job's ranks exchange:
   - flat (`flat_shares`): worker i's link carries ``S + (W - 2) * owned``
     each way; the least ``T`` with that ``<= T * r`` for every worker,
     filled like water (a worker whose link needs more than ``T`` just for
     its own gradient and the results owns nothing). With rates 2, 1, 1
     the fast worker owns everything: every link then carries ``S`` per
     rate unit, where shares following the rates (1/2, 1/4, 1/4) would
     leave the slow links at ``1.25 S``.
   - the ring (`ring_shares`): the link from rank i to i+1 carries
     ``2 S - owned_i - owned_i+1`` (each chunk passes every link but one
     each way, and the owner's own links are the ones it skips), so a
     worker on a slow link should own *more*: with one worker of 4 at half
     the rate, it owns everything, and its links carry ``S`` instead of
     ``1.5 S`` at half the rate. Measured on the testbed (`bench/slow_link.py`).
3. Chunks go to owners by list scheduling on uniform machines
   (`assign_owners`): in priority order, each chunk to the worker whose
   owned bytes / share would be smallest after taking it.
4. When the job says which layer each chunk belongs to, each layer is
   balanced on its own first (its chunks are exchanged together, so its
   slowest owner sets its time), overall balance breaking ties.

5. When a leaf's hosts can send more than its uplink carries
   (`fabric.oversubscribed`), the plan asks shims to reduce each chunk
   within each leaf first (`Plan.reduce_in_leaf`): one copy per leaf
   crosses the spine instead of one per rank, hierarchical all-reduce as in
   Horovod and PLink (which finds the locality by probing; here the daemons
   report their leaf).

Departures from TicTac/BytePS-style balancing: ownership is by link rate,
not only bytes, and by how the ranks exchange (reducing within leaves first
takes the flat exchange's shares); hosts have one NIC here, so there is no
path to choose (with several NICs the weight would be their sum and the
path the least loaded one). Ranks sharing a host count as if each had a
link of its own. Bands and rates are `priority`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gradlane.errors import ConfigError
from gradlane.policies import fabric
from gradlane.policies.base import Plan, Policy, State, register
from gradlane.policies.chunks import assign_owners
from gradlane.policies.priority import PriorityPolicy

__all__ = ["LoadBalancePolicy", "balanced_ownership", "exchange_time", "flat_shares",
           "ring_shares"]

# `ring_shares` hands the bytes out in this many equal parts.
RING_SHARE_UNITS = 1000


def exchange_time(rates: Sequence[float], shares: Sequence[float], ring: bool) -> float:
    """The slowest link's time per byte of model when each worker owns `shares` of
    it, workers at `rates`: flat, worker i's link carries ``1 + (W - 2) * share_i``
    each way; on the ring, the link from rank i to i+1 (the slower of their two)
    carries ``2 - share_i - share_i+1``."""
    r = np.asarray(rates, dtype=np.float64)
    o = np.asarray(shares, dtype=np.float64)
    if ring:
        return float(np.max((2 - o - np.roll(o, -1)) / np.minimum(r, np.roll(r, -1))))
    return float(np.max((1 + (r.size - 2) * o) / r))


def _positive(rates: Sequence[float]) -> np.ndarray:
    r = np.asarray(rates, dtype=np.float64)
    if r.size == 0 or not np.all(r > 0):
        raise ConfigError(f"need positive rates, got {list(rates)}")
    return r


def flat_shares(rates: Sequence[float]) -> list[float]:
    """Each worker's share of the owned bytes (summing to 1) for workers at `rates`.

    The flat exchange loads worker i's link with ``S + (W - 2) * o_i`` bytes
    each way (its gradient of the chunks others own, the others' gradients
    of its own chunks, and the results back), ``S`` the model. The shares
    minimise the slowest link's time ``T``: ``o_i = max(0, (T r_i - S) / (W - 2))``
    with the ``o_i`` summing to ``S``, found by dropping the slowest workers
    until every share left is positive. Two workers load their links with
    ``S`` whoever owns what: shares follow the rates.
    """
    r = _positive(rates)
    world = r.size
    if world <= 2:
        return [float(x) for x in r / r.sum()]
    active = np.ones(world, dtype=bool)
    while True:  # at most `world` rounds: each drops a worker or ends
        # In units of S: T from sum over active of (T r_i - 1) = W - 2.
        t = (world - 2 + active.sum()) / r[active].sum()
        keep = active & (t * r > 1)
        if keep.sum() == active.sum():
            break
        active = keep
    shares = np.where(active, (t * r - 1) / (world - 2), 0.0)
    return [float(x) for x in shares / shares.sum()]


def ring_shares(rates: Sequence[float]) -> list[float]:
    """Each rank's share of the owned bytes (summing to 1) for ranks at `rates`
    exchanging around the ring (rank i sends to rank i+1, over the slower of their
    two links).

    The link from i to i+1 carries ``2 S - o_i - o_i+1`` (`ring_routes`: a
    chunk's partial sum skips the link out of its owner, its average the link
    into it). The shares are handed out `RING_SHARE_UNITS` parts at a time,
    each to relieve the link that would finish last: to whichever of its two
    ends also relieves the slower other link. Equal rates give equal shares
    (every link then carries ``2 (W - 1) / W S``, ring all-reduce's figure).
    Greedy, not a solved linear programme: the property tests bound it
    against a fine grid of all shares for up to 4 ranks. About 2 ms for
    unequal rates, so plans, which see the same rates again and again,
    reuse it (cached).
    """
    return list(_ring_shares(tuple(float(x) for x in rates)))


@functools.lru_cache(maxsize=256)
def _ring_shares(rates: tuple[float, ...]) -> tuple[float, ...]:
    r = _positive(rates)
    world = r.size
    if world <= 2 or np.all(r == r[0]):  # two ranks: each link carries S whoever owns
        return (1 / world,) * world
    link = np.minimum(r, np.roll(r, -1))  # link i: rank i -> rank i+1
    load = np.full(world, 2.0)  # in units of S
    owned = np.zeros(world)
    unit = 1 / RING_SHARE_UNITS
    for _ in range(RING_SHARE_UNITS):
        times = load / link
        i = int(np.argmax(times))
        before, after = (i - 1) % world, (i + 1) % world
        owner = i if times[before] >= times[after] else after  # relieves i and that one
        owned[owner] += unit
        load[owner] -= unit
        load[(owner - 1) % world] -= unit
    return tuple(float(x) for x in owned / owned.sum())


def balanced_ownership(state: State) -> dict[str, tuple[int, ...]]:
    """Per job with known chunks, an owner rank per chunk weighted by link rate."""
    out: dict[str, tuple[int, ...]] = {}
    if state.topology is None:
        return out
    jobs_on_host: dict[int, set[str]] = {}
    for w in state.workers:
        jobs_on_host.setdefault(w.host, set()).add(w.job)
    nic = [h.nic_bps for h in state.topology.hosts]
    for job in state.jobs:
        workers = state.workers_of(job.name)
        if workers and job.chunk_bytes:
            rates = [nic[w.host] / len(jobs_on_host[w.host]) for w in workers]
            shares = ring_shares(rates) if job.ring else flat_shares(rates)
            owning = [w for w, share in zip(workers, shares, strict=True) if share > 0]
            layers = job.chunk_layers if len(job.chunk_layers) == len(job.chunk_bytes) else None
            owners = assign_owners(job.chunk_bytes, len(owning),
                                   [s for s in shares if s > 0], layers)
            out[job.name] = tuple(owning[o].rank for o in owners)
    return out


@register("loadbalance")
class LoadBalancePolicy(Policy):
    def plan(self, state: State) -> Plan:
        base = PriorityPolicy().plan(state)
        return replace(base, source=self.name, ownership=balanced_ownership(state),
                       reduce_in_leaf=fabric.oversubscribed(state.topology))
