"""How the simulator's links serve the collectives queued on them.

A collective (one bucket's reduce-scatter and all-gather) puts ``n_l`` flows
of one chunk each on every link ``l`` it loads; its *entry* on ``l`` holds
the bits it still has to push across ``l``. Each link serves its entries on
its own, as a host's qdisc and a switch port do:

1. Strict priority: only the entries of the most urgent priority on the link
   move (gradlaned's HTB prio, ``min(7, job level + band)``; DSCP queues in
   the switches).
2. Within a priority, each (job, band) serves its collectives in queue
   order: first come, first served, or by a key the caller gives (the shim's
   connections pop their chunks in priority order). The entry being served
   keeps its place whatever arrives (a chunk being written is not
   interrupted).
3. The (job, band)s at the top priority share the link in proportion to the
   flows their current collective has on it (TCP shares per connection).

Links are independent of each other: a collective's bits move on one link
whatever its other links do, and it is done when it has no bits left on
any. So a collective whose flows meet a full link somewhere still moves
everywhere else, as the shim's connections to other peers go on sending;
and a job's collectives of one band proceed on different links at once
(one owner's downlink busy with one bucket, the other links with the next).
What this leaves out: a flow's bits cannot really cross its receiver's link
before its sender's (no buffering in the fabric), so a link may drain a
collective sooner than per-flow max-min with coupled links would let it.
Against that coupled model it is optimistic; the model it replaced (one
rate for all of a collective's flows, one collective at a time per job and
band) was pessimistic, and its results depended on the bucket count
(README, "Policies and the simulator").

Cost: only the first entry of each (link, job and band) is in the arrays a
step works on; the ones behind it wait in a queue of their own. A deep
backlog (open loop) therefore costs memory, not time per step.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from gradlane.policies.base import FloatArray, IntArray

__all__ = ["Network", "Served"]

# Bits left below which an entry is done (floating-point residue of an exact drain).
RESIDUE_BITS = 1e-3


@dataclass(frozen=True)
class Served:
    """The entries moving now: their positions in the network's arrays and rates (bit/s)."""

    at: IntArray
    rate: FloatArray


class Network:
    """The collectives queued on the links, and the rates at which links serve them.

    The arrays hold one entry per (link, queue) with bits to send, the
    queue's first; a queue is a job's band (any int the caller chooses).

    Args:
        capacity_bps: per link, what it carries.
    """

    def __init__(self, capacity_bps: FloatArray) -> None:
        self.cap = np.asarray(capacity_bps, dtype=np.float64)
        self.busy_bits = np.zeros(len(self.cap))  # per link, bits carried so far
        self.link = np.zeros(0, np.int64)
        self.queue = np.zeros(0, np.int64)
        self.prio = np.zeros(0, np.int64)
        self.owner = np.zeros(0, np.int64)  # the collective's id
        self.flows = np.zeros(0)
        self.left = np.zeros(0)  # bits
        # Behind each entry in the arrays, by (link, queue), a heap:
        # (key, arrival, collective, flows, bits).
        self._behind: dict[tuple[int, int], list[tuple[tuple[int, ...], int, int, float, float]]]
        self._behind = {}
        self._arrivals = itertools.count()
        # Per collective with entries behind others: how many, and their bits.
        self._waiting: dict[int, tuple[int, float]] = {}
        self._prio: dict[int, int] = {}  # per queue
        self.live: dict[int, int] = {}  # per collective id, its links with bits left
        self._served: Served | None = None

    def __len__(self) -> int:
        return len(self.live)

    def add(self, cid: int, links: IntArray, flows: FloatArray, bits_per_flow: float,
            prio: int, queue: int, key: tuple[int, ...] = ()) -> None:
        """Queue collective `cid` in `queue`: `flows` flows of `bits_per_flow` on
        `links`, at priority `prio` (the queue's from now on). It waits behind the
        entry being served and the waiting ones of a smaller `key`, then of the
        same key that came earlier (all keys equal: first come, first served)."""
        self.set_priorities({queue: prio})
        first: list[int] = []
        waiting, waiting_bits = 0, 0.0
        arrival = next(self._arrivals)
        for i, link in enumerate(links.tolist()):
            behind = self._behind.get((link, queue))
            if behind is None:
                self._behind[link, queue] = []
                first.append(i)
            else:
                bits = float(flows[i]) * bits_per_flow
                heapq.heappush(behind, (key, arrival, cid, float(flows[i]), bits))
                waiting, waiting_bits = waiting + 1, waiting_bits + bits
        if waiting:
            self._waiting[cid] = (waiting, waiting_bits)
        self.live[cid] = len(links)
        if first:
            at = np.array(first, np.int64)
            n = len(at)
            self.link = np.concatenate([self.link, links[at]])
            self.queue = np.concatenate([self.queue, np.full(n, queue, np.int64)])
            self.prio = np.concatenate([self.prio, np.full(n, prio, np.int64)])
            self.owner = np.concatenate([self.owner, np.full(n, cid, np.int64)])
            self.flows = np.concatenate([self.flows, flows[at]])
            self.left = np.concatenate([self.left, flows[at] * bits_per_flow])
            self._served = None

    def set_priorities(self, prio_of: dict[int, int]) -> None:
        """New priorities by queue (a plan changed job levels)."""
        changed = {q: p for q, p in prio_of.items() if self._prio.get(q) != p}
        if not changed:
            return
        self._prio.update(changed)
        for q, p in changed.items():
            self.prio[self.queue == q] = p
        self._served = None

    def bits_left(self) -> dict[int, float]:
        """Per queued collective id, the bits it has left on all its links."""
        ids, where = np.unique(self.owner, return_inverse=True)
        moving = np.bincount(where, weights=self.left, minlength=len(ids))
        out = {cid: bits for cid, (_, bits) in self._waiting.items()}
        for cid, bits in zip(ids.tolist(), moving.tolist(), strict=True):
            out[cid] = out.get(cid, 0.0) + bits
        return out

    def served(self) -> Served:
        """Which entries move and how fast (rules 1-3 of the module docstring)."""
        if self._served is None:
            top = np.full(len(self.cap), np.iinfo(np.int64).max)
            np.minimum.at(top, self.link, self.prio)
            at = np.flatnonzero(self.prio == top[self.link])
            on = self.link[at]
            weight = np.bincount(on, weights=self.flows[at], minlength=len(self.cap))
            self._served = Served(at, self.cap[on] * self.flows[at] / weight[on])
        return self._served

    def next_drain(self) -> float:
        """Seconds until the first served entry has no bits left (inf: nothing moves)."""
        s = self.served()
        if not len(s.at):
            return float("inf")
        return float((self.left[s.at] / s.rate).min())

    def advance(self, dt: float) -> list[int]:
        """Move `dt` seconds; returns the ids of collectives left with no bits anywhere."""
        s = self.served()
        if not len(s.at) or dt <= 0:
            return []
        moved = np.minimum(s.rate * dt, self.left[s.at])
        self.left[s.at] -= moved
        self.busy_bits += np.bincount(self.link[s.at], weights=moved, minlength=len(self.cap))
        drained = s.at[self.left[s.at] <= RESIDUE_BITS]
        if not len(drained):
            return []
        self._served = None
        done = []
        gone = []
        for i, link, queue, cid in zip(drained.tolist(), self.link[drained].tolist(),
                                       self.queue[drained].tolist(),
                                       self.owner[drained].tolist(), strict=True):
            self.live[cid] -= 1
            if not self.live[cid]:
                del self.live[cid]
                done.append(cid)
            behind = self._behind[link, queue]
            if not behind:  # the queue has nothing more on this link
                del self._behind[link, queue]
                gone.append(i)
                continue
            _, _, nxt, flows, bits = heapq.heappop(behind)  # next in line takes its place
            self.owner[i], self.flows[i], self.left[i] = nxt, flows, bits
            count, waiting = self._waiting.pop(nxt)
            if count > 1:
                self._waiting[nxt] = (count - 1, waiting - bits)
        if gone:
            keep = np.ones(len(self.link), dtype=bool)
            keep[gone] = False
            for name in ("link", "queue", "prio", "owner", "flows", "left"):
                setattr(self, name, getattr(self, name)[keep])
        return done
