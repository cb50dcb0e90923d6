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

Cost: as links are independent, an event touches only the links whose
entries changed. Each link keeps its first entry per (job, band) with the
time its bits were last counted; the ones behind wait in a queue of their
own (a deep backlog, as in open loop, costs memory, not time), and a heap
holds every moving entry's finish time until its link's rates change. An
event costs the entries of the links it touches, not of the whole fabric.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np

from gradlane.policies.base import FloatArray

__all__ = ["Network"]

# An entry is done with this fraction of its bits left: the floating-point residue of an
# exact drain, which grows with the bits (a 1 MB chunk: 8e-3 bits). An absolute floor of
# bits dropped the real last bits of small entries, uncounted.
RESIDUE = 1e-9


class _Entry:
    """A collective's bits on one link, first in its queue there."""

    __slots__ = ("cid", "flows", "left", "queue", "rate", "residue", "slot", "token")

    def __init__(self, slot: int, queue: int, cid: int, flows: float, bits: float) -> None:
        self.slot = slot  # the order (link, queue)s came to hold entries: ties break by it
        self.queue, self.cid, self.flows, self.left = queue, cid, flows, bits
        self.residue = bits * RESIDUE  # what may be left when it is done
        self.rate = 0.0
        self.token = 0  # its finish time's in the heap under this token (0: not moving)


class Network:
    """The collectives queued on the links, and the rates at which links serve them.

    A queue is a job's band (any int the caller chooses); each link serves
    the first entry of each of its queues (rules 1-3 of the module docstring).

    Args:
        capacity_bps: per link, what it carries.
    """

    def __init__(self, capacity_bps: FloatArray) -> None:
        self.cap = np.asarray(capacity_bps, dtype=np.float64)
        self._cap = self.cap.tolist()
        self._carried = np.zeros(len(self.cap))  # per link, bits carried (counted so far)
        self.t = 0.0  # the network's clock: `advance_to` moves it
        # Per link, its queues' first entries and when their bits were last counted.
        self._first: list[dict[int, _Entry]] = [{} for _ in self._cap]
        self._counted = [0.0] * len(self._cap)
        # Behind each first entry, by (link, queue), a heap:
        # (key, arrival, collective, flows, bits).
        self._behind: dict[tuple[int, int], list[tuple[tuple[int, ...], int, int, float, float]]]
        self._behind = {}
        self._links_of: dict[int, set[int]] = {}  # per queue, the links it has entries on
        self._finish: list[tuple[float, int, int, int, int]] = []  # (t, slot, link, queue, token)
        self._arrivals = itertools.count()
        self._slots = itertools.count()
        self._tokens = itertools.count(1)
        # Per collective with entries behind others: how many, and their bits.
        self._waiting: dict[int, tuple[int, float]] = {}
        self._prio: dict[int, int] = {}  # per queue
        self.live: dict[int, int] = {}  # per collective id, its links with bits left

    def __len__(self) -> int:
        return len(self.live)

    def add(self, cid: int, links: Sequence[int], flows: Sequence[float],
            bits_per_flow: float, prio: int, queue: int, key: tuple[int, ...] = ()) -> None:
        """Queue collective `cid` in `queue`: `flows` flows of `bits_per_flow` on
        `links`, at priority `prio` (the queue's from now on). It waits behind the
        entry being served and the waiting ones of a smaller `key`, then of the
        same key that came earlier (all keys equal: first come, first served).
        `links` and `flows` are lists: the network takes them one by one."""
        if self._prio.get(queue) != prio:
            self.set_priorities({queue: prio})
        waiting, waiting_bits = 0, 0.0
        arrival = next(self._arrivals)
        touched = []
        behind_of, first_of = self._behind, self._first
        for link, n in zip(links, flows, strict=True):
            bits = n * bits_per_flow
            behind = behind_of.get((link, queue))
            if behind is None:
                behind_of[link, queue] = []
                self._links_of.setdefault(queue, set()).add(link)
                self._count(link)
                first_of[link][queue] = _Entry(next(self._slots), queue, cid, n, bits)
                touched.append(link)
            else:
                heapq.heappush(behind, (key, arrival, cid, n, bits))
                waiting, waiting_bits = waiting + 1, waiting_bits + bits
        if waiting:
            self._waiting[cid] = (waiting, waiting_bits)
        self.live[cid] = len(links)
        for link in touched:
            self._rate(link)

    def set_priorities(self, prio_of: dict[int, int]) -> None:
        """New priorities by queue (a plan changed job levels)."""
        changed = {q: p for q, p in prio_of.items() if self._prio.get(q) != p}
        if not changed:
            return
        self._prio.update(changed)
        links = sorted(set().union(*(self._links_of.get(q, ()) for q in changed)))
        for link in links:
            self._count(link)
        for link in links:
            self._rate(link)

    def carried_bits(self) -> FloatArray:
        """Per link, the bits it carried until now."""
        self._count_all()
        return self._carried.copy()

    def rates(self) -> dict[tuple[int, int], float]:
        """(collective, link) -> bit/s, for the entries moving now."""
        return {(e.cid, link): e.rate for link, first in enumerate(self._first)
                for e in first.values() if e.rate}

    def bits_left(self) -> dict[int, float]:
        """Per queued collective id, the bits it has left on all its links."""
        self._count_all()
        out = {cid: bits for cid, (_, bits) in self._waiting.items()}
        for first in self._first:
            for e in first.values():
                out[e.cid] = out.get(e.cid, 0.0) + e.left
        return out

    def next_finish(self) -> float:
        """When the first moving entry will have no bits left (inf: nothing moves)."""
        heap = self._finish
        while heap:
            t, _, link, queue, token = heap[0]
            e = self._first[link].get(queue)
            if e is not None and e.token == token:
                return max(t, self.t)
            heapq.heappop(heap)  # its link's rates changed since
        return float("inf")

    def advance_to(self, t: float) -> list[int]:
        """Move the clock on to `t` (at most `next_finish()`: entries that finished before
        drain at `t`); returns the ids of collectives left with no bits anywhere."""
        self.t = max(self.t, t)
        heap, first_of = self._finish, self._first
        drained, later = [], []
        # Entries that finish up to a residue's time after `t` drain with the ones at `t`.
        while heap and heap[0][0] <= self.t * (1 + RESIDUE):
            item = heapq.heappop(heap)
            finish, slot, link, queue, token = item
            e = first_of[link].get(queue)
            if e is None or e.token != token:
                continue  # its link's rates changed since
            if (finish - self.t) * e.rate <= e.residue:
                drained.append((slot, link, queue))
            else:
                later.append(item)
        for item in later:
            heapq.heappush(heap, item)
        if not drained:
            return []
        drained.sort()  # in the order the (link, queue)s came to hold entries
        links = sorted({link for _, link, _ in drained})
        for link in links:
            self._count(link)
        done = []
        for _, link, queue in drained:
            e = first_of[link][queue]
            self.live[e.cid] -= 1
            if not self.live[e.cid]:
                del self.live[e.cid]
                done.append(e.cid)
            behind = self._behind[link, queue]
            if not behind:  # the queue has nothing more on this link
                del self._behind[link, queue], first_of[link][queue]
                self._links_of[queue].discard(link)
                continue
            _, _, nxt, flows, bits = heapq.heappop(behind)  # next in line takes its place
            first_of[link][queue] = _Entry(e.slot, queue, nxt, flows, bits)
            count, waiting = self._waiting.pop(nxt)
            if count > 1:
                self._waiting[nxt] = (count - 1, waiting - bits)
        for link in links:
            self._rate(link)
        return done

    def _count(self, link: int) -> None:
        """Take the bits `link` moved since they were last counted off its entries."""
        dt = self.t - self._counted[link]
        self._counted[link] = self.t
        first = self._first[link]
        if dt <= 0 or not first:
            return
        for e in first.values():
            if e.rate:
                e.left = max(0.0, e.left - e.rate * dt)
        self._carried[link] += self._cap[link] * dt  # work-conserving: all of it, shared

    def _count_all(self) -> None:
        for link, first in enumerate(self._first):
            if first:
                self._count(link)

    def _rate(self, link: int) -> None:
        """Share `link` among its entries anew (rules 1-3); call `_count` first."""
        first = self._first[link]
        if not first:
            return
        if len(first) == 1:  # alone: all of it
            (e,) = first.values()
            self._set_rate(link, e, self._cap[link])
            return
        prio = self._prio
        top = min([prio[q] for q in first])
        weight: float = 0  # summed in the entries' order, as sum() would
        for q, e in first.items():
            if prio[q] == top:
                weight += e.flows
        cap = self._cap[link]
        for q, e in first.items():
            self._set_rate(link, e, cap * e.flows / weight if prio[q] == top else 0.0)

    def _set_rate(self, link: int, e: _Entry, rate: float) -> None:
        """`e` moves at `rate` from now: its finish time goes in the heap."""
        if rate == e.rate and (e.token or not rate):
            return  # its finish time in the heap still holds
        e.rate = rate
        e.token = next(self._tokens) if rate else 0
        if rate:
            heapq.heappush(self._finish, (self.t + e.left / rate, e.slot, link, e.queue, e.token))
