"""The flow-level simulator: discrete events, priority-aware max-min sharing of links.

Model (what is simulated, and what is not):

1. Network. Links are the topology's host and leaf links with their
   capacities; no queues in the fabric, no propagation delay (fluid flows).
   A bucket's gradient exchange is one *collective*: the reduce-scatter and
   all-gather flows of all its chunks, each chunk's owner as the plan says.
   It loads link ``l`` with ``n_l`` flows of a chunk each, from the
   ownership and each chunk's reduction tree
   (`gradlane.policies.chunks.reduction_parents`, the shim's own): flat,
   host ``h`` sends ``S + (W - 2) * owned(h)`` bytes of a bucket of ``S``;
   when the plan says `reduce_in_leaf`, one copy of each chunk per leaf
   crosses the spine each way. Ranks sharing some hosts (`SimJob.hosts`
   naming one several times) reduce within each host first, as the shim's
   `host_groups` has them (within hosts, then leaves, when the plan asks for
   leaves), and what ranks of one host send each other takes no link and no
   time (loopback). With `SimJob.store_forward`, each chunk's tree is
   taken a stage after the other instead, as the shim stores and forwards
   a chunk whole (`Exchange.stages`: a rank sends its sum up once its
   subtree's are in, a result goes down once it came down the level
   above): a one-chunk bucket on two hosts then takes two chunk times, its
   contribution and then its average, where as fluid flows it takes one.
   The testbed replays use it (`gradlane sim validate`: at its slow links a
   chunk takes tens of ms). It costs an entry per chunk and stage: `cluster`
   stays fluid by default, and the two models disagree there (bench/README.md,
   "A band's order and a chunk's round trip").
   A job with `SimJob.ring` (the shim's ring
   exchange) has every rank send a bucket's chunks to its successor, store
   and forward as the shim does: each chunk's 2(W-1) hops (the partial sum
   from the owner's successor to the owner, then the average on to the
   owner's predecessor) are entries of their own, the next queued when the
   last has crossed both its links (the sender's egress and the receiver's
   ingress), and a connection takes its waiting chunks in the shim's order
   (the bucket's forward position, averages before partial sums, chunk).
2. Sharing, as gradlaned and DSCP switches enforce it
   (`gradlane.policies.sim.network`): each link on its own serves strict
   priority by (the job's coflow level, the bucket's band), both from the
   plan; within a priority each (job, band) its collectives in the shim's
   order (the bucket's forward position; a ring job's chunk hops and stored
   and forwarded stages: averages before partial sums, then chunk), one
   iteration's before the next's, and (job, band)s share a link by their
   flows on it. A collective is done when it has no
   bits left on any of its links. Per-flow rate caps in the plan are not
   enforced (priority and work conservation decide the rates).
3. Compute. Each worker runs forward bucket by bucket, then backward in
   reverse; its time per bucket scales with its batch share over its speed.
   A bucket's forward in iteration ``k + 1`` waits for that bucket's
   collective of iteration ``k`` (per-layer optimizer steps: cross-iteration
   overlap), or with ``SimJob.overlap`` off for every collective of
   iteration ``k`` (one optimizer step for the whole model). A bucket's
   collective starts when every worker has its gradient.
4. Open loop (`Scenario.arrivals`): no compute; each arrival releases a
   whole iteration's collectives at once, and a job may have several
   coflows in flight (its connection serves them in arrival order). This is
   the setting coflow schedulers were designed and evaluated in; a training
   job's next coflow, by contrast, waits for its last one (closed loop).
5. Planning. The policy plans at time 0, every `replan_s`, and after a
   coflow arrives or completes (no sooner than `react_s` after the last
   plan, the control plane's reaction time), from a state
   built like a control plane's: measured worker throughput, each job's
   chunks, and per iteration in flight one coflow of load-equivalent demand
   flows (per worker and bucket, one flow to a worker of its own leaf and
   one to the next leaf, carrying what the ownership puts on its links).

Deterministic: same scenario, same policy, same result (ties break by
job and bucket index; no randomness inside).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from gradlane.policies.base import (
    LEVELS,
    Coflow,
    FlowTable,
    JobState,
    Plan,
    Policy,
    State,
    Worker,
)
from gradlane.policies.chunks import assign_owners
from gradlane.policies.demand import Exchange
from gradlane.policies.sim.network import Network
from gradlane.policies.sim.scenario import Scenario, SimJob

# Per owner: how many stages go up, and each stage's (links, flows on each, their sum).
_Stages = tuple[int, list[tuple[list[int], list[float], float]]]

__all__ = ["Result", "coflow_load", "full_demand_state", "simulate"]

EPS = 1e-9


@dataclass
class Result:
    """What one run measured; `to_json` is what `gradlane sim` writes."""

    policy: str
    iteration_s: dict[str, list[float]]  # per job, measured iterations
    cct_s: dict[str, list[float]]  # per job, coflow (iteration's gradients) completion times
    utilization: dict[str, float]  # mean busy fraction by link kind
    sim_s: float
    wall_s: float
    plan_ms: list[float] = field(default_factory=list)

    @property
    def mean_iteration_s(self) -> float:
        """Mean over jobs of their mean iteration; NaN in open loop (nothing iterates)."""
        means = [np.mean(v) for v in self.iteration_s.values() if v]
        return float(np.mean(means)) if means else float("nan")

    @property
    def mean_cct_s(self) -> float:
        return float(np.mean([x for v in self.cct_s.values() for x in v]))

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "mean_iteration_s": self.mean_iteration_s if self.iteration_s else None,
            "mean_cct_s": self.mean_cct_s,
            "iteration_s": self.iteration_s,
            "cct_s": self.cct_s,
            "utilization": self.utilization,
            "simulated_s": self.sim_s,
            "wall_s": self.wall_s,
            "plan_ms_median": float(np.median(self.plan_ms)) if self.plan_ms else None,
            "plans": len(self.plan_ms),
        }


class _Job:
    def __init__(self, index: int, spec: SimJob, scenario: Scenario) -> None:
        self.index, self.spec = index, spec
        topo = scenario.topology
        self.w = spec.workers
        self.hosts = np.array(spec.hosts, dtype=np.int64)
        self.leaf = topo.host_leaf[self.hosts]
        self.n_hosts, self.n_leaves = len(topo.hosts), len(topo.uplink_bps)
        self.forward = np.array([b.forward_s for b in spec.buckets])
        self.backward = np.array([b.backward_s for b in spec.buckets])
        self.nb = len(spec.buckets)
        # Equal chunks per bucket.
        self.n_chunks = [max(1, -(-int(b.bytes) // spec.chunk_bytes)) for b in spec.buckets]
        self.chunk_size = [b.bytes / n for b, n in zip(spec.buckets, self.n_chunks, strict=True)]
        self.first_chunk = np.concatenate([[0], np.cumsum(self.n_chunks)]).astype(np.int64)
        self.chunk_bytes = tuple(
            int(s) for s, n in zip(self.chunk_size, self.n_chunks, strict=True) for _ in range(n)
        )
        self.chunk_layer = tuple(b for b, n in enumerate(self.n_chunks) for _ in range(n))
        self.speed = np.array(spec.speed)
        self.shares = np.full(self.w, spec.global_batch / self.w)
        self.iteration_shares = self.shares.copy()
        self.band = np.zeros(self.nb, dtype=np.int64)
        self.level = 0
        uplinks = self.n_leaves > 0
        self.tree = Exchange(self.leaf, uplinks=uplinks, host=self.hosts, ring=spec.ring)
        # Each chunk's tree stages one after the other (`SimJob.store_forward`).
        self.staged = spec.store_forward and not spec.ring
        # Ranks sharing some hosts (not all one) reduce within hosts first, as the shim's
        # `host_groups` has them, unless on the ring or told their several leaves.
        shares_hosts = not spec.ring and 1 < len(set(spec.hosts)) < self.w
        self.within_hosts = Exchange(self.leaf, uplinks=uplinks, host=self.hosts,
                                     by_host=True) if shares_hosts else None
        self.set_ownership(tuple(assign_owners(self.chunk_bytes, self.w)), in_leaf=False)
        self.ready_at = np.zeros(self.nb)  # when each bucket's gradient is (or will be) ready
        # Timeline.
        self.iteration = 0
        self.fwd_pos = 0
        self.clock = np.zeros(self.w)
        self.synced = np.full(self.nb, np.nan)  # last iteration's collectives: done times
        self.outstanding: dict[int, int] = {}  # per iteration in flight, collectives not done
        self.starts: list[float] = []
        self.busy = np.zeros(self.w)  # compute seconds so far in this iteration, per worker
        self.last_busy = np.zeros(self.w)  # ... in the last full iteration
        self.last_shares = self.shares.copy()  # the batch shares that iteration ran with
        self.first_ready: dict[int, float] = {}
        self.ccts: dict[int, float] = {}  # per iteration, its coflow's completion time

    @property
    def factor(self) -> np.ndarray:
        """Per worker, its compute time relative to an even share at speed 1."""
        return np.asarray((self.shares / (self.spec.global_batch / self.w)) / self.speed)

    def set_ownership(self, owners: tuple[int, ...], in_leaf: bool) -> None:
        """Per bucket, the links its collective loads and with how many flows; `in_leaf`:
        the plan asks for reduction within leaves first (ranks under several take it)."""
        self.owners, self.in_leaf = owners, in_leaf
        # The exchange, as the shims tell gradlaned (`gradlane.daemon.fields.EXCHANGES`).
        self.exchange, self.kind = self.tree, "flat"
        if self.spec.ring:
            self.kind = "ring"
        elif in_leaf and len(set(self.leaf.tolist())) > 1:
            self.kind = "leaf"  # within hosts too, when ranks share some (`Exchange.trees`)
        elif self.within_hosts is not None:
            self.exchange, self.kind = self.within_hosts, "host"
        self.grouped = self.kind in ("leaf", "host")  # `Exchange.trees`' in_leaf
        self.owned_chunks = self.exchange.owned(owners, self.first_chunk)
        self._loads: tuple[np.ndarray, np.ndarray] | None = None
        per_owner, _ = self.exchange.trees(self.grouped)
        counts = self.owned_chunks @ per_owner  # (buckets, columns)
        leaves = self.exchange.leaves
        base = 2 * self.n_hosts
        links = np.concatenate([self.hosts, self.n_hosts + self.hosts, base + leaves,
                                base + self.n_leaves + leaves])
        if len(set(self.hosts.tolist())) < self.w:  # ranks of one host: one link, summed
            self.links, column = np.unique(links, return_inverse=True)
            self.counts = np.zeros((len(counts), len(self.links)))
            np.add.at(self.counts.T, column, counts.T)
        else:
            self.links, self.counts = links, counts
        if self.staged:
            self.stage_flows = self._stage_flows(links, set(owners))

    def _stage_flows(self, column_link: np.ndarray, owners: set[int]) -> dict[int, _Stages]:
        """Per owner of some chunk: how many of its chunks' stages go up, and each
        stage's links with the flows one chunk puts on them and their sum
        (`Exchange.stages`; a stage with no links is all loopback). Lists: the
        network takes them one by one."""
        n_stages, counts = self.exchange.stages(self.grouped)
        out = {}
        for o in sorted(owners):
            stages = []
            for k in range(int(n_stages[o])):
                cols = np.flatnonzero(counts[o, k])
                links, where = np.unique(column_link[cols], return_inverse=True)
                flows = np.bincount(where, counts[o, k, cols], len(links))
                stages.append((links.tolist(), flows.tolist(), float(flows.sum())))
            out[o] = (int(n_stages[o]) // 2, stages)
        return out

    def loads(self) -> tuple[np.ndarray, np.ndarray]:
        """Per worker and bucket: bytes to its own leaf and to other leaves (the same until
        the owners change: every plan asks)."""
        if self._loads is None:
            self._loads = self.exchange.loads(self.owned_chunks, self.grouped, self.chunk_size)
        return self._loads


@dataclass
class _Collective:
    job: _Job
    iteration: int
    bucket: int
    band: int
    bits: float  # on all its links, at the start
    # On the ring: its chunks' hops not yet in the network (bits), and chunks not done.
    unqueued_bits: float = 0.0
    chunks_left: int = 0
    # Stored and forwarded tree stages: its owners' stages (`_Job.stage_flows` when it
    # started: a later plan's owners do not move what is in flight).
    stages: dict[int, _Stages] | None = None


class _Hop(NamedTuple):
    """One hop of a ring job's chunk (its sender to its successor, the `stage`-th of
    2(W-1)), or one stage of a tree job's chunk stored and forwarded
    (`SimJob.store_forward`). A tuple: millions are made in a run."""

    collective: int
    chunk: int  # the job's chunk index
    owner: int
    stage: int

    def at(self, stage: int) -> _Hop:
        """The same chunk's `stage`-th hop or stage."""
        return _Hop(self.collective, self.chunk, self.owner, stage)


class _Sim:
    def __init__(self, scenario: Scenario, policy: Policy,
                 on_progress: Callable[[float], None] | None) -> None:
        self.sc, self.policy, self.on_progress = scenario, policy, on_progress
        self.cap = scenario.topology.capacity_bps
        self.jobs = [_Job(i, j, scenario) for i, j in enumerate(scenario.jobs)]
        self.now = 0.0
        self.ready: list[tuple[float, int, int, int, int]] = []  # (t, seq, job, iteration, bucket)
        self.net = Network(self.cap)
        self.queued: dict[int, _Collective] = {}  # by id, what the network holds
        self.hops: dict[int, _Hop] = {}  # by network id: ring jobs' chunk hops
        self.seq = 0
        self.plan_ms: list[float] = []
        self.version = 0
        self.replan_due = False
        self.progressed = True  # since `finished` was last asked

    # -- compute -----------------------------------------------------------

    def advance(self, job: _Job) -> None:
        """Run forwards whose gradients are in, and the backward once the forward is done."""
        while job.fwd_pos < job.nb:
            b = job.fwd_pos
            if job.iteration == 0:
                synced = 0.0
            elif job.spec.overlap:
                synced = job.synced[b]
            else:  # one step for the whole model, after the last average (nan: one pending)
                synced = job.synced.max()
            if np.isnan(synced):
                return  # waiting for last iteration's collective of this bucket
            if b == 0:
                job.starts.append(float(max(job.clock.max(), synced)))
                job.busy = np.zeros(job.w)
                job.iteration_shares = job.shares.copy()
            start = np.maximum(job.clock, synced)
            step = job.forward[b] * job.factor
            job.clock, job.busy = start + step, job.busy + step
            job.fwd_pos += 1
        # Backward, last bucket first: each bucket's gradient is ready when every worker has it.
        # (The forward waited for every collective of the last iteration: none is pending.)
        job.synced = np.full(job.nb, np.nan)
        for b in range(job.nb - 1, -1, -1):
            step = job.backward[b] * job.factor
            job.clock, job.busy = job.clock + step, job.busy + step
            self.seq += 1
            job.ready_at[b] = float(job.clock.max())
            heapq.heappush(self.ready, (job.ready_at[b], self.seq, job.index, job.iteration, b))
        job.outstanding[job.iteration] = job.nb
        job.last_busy = job.busy.copy()
        job.last_shares = job.iteration_shares
        job.fwd_pos = 0
        job.iteration += 1

    def collective_ready(self, job: _Job, iteration: int, bucket: int) -> None:
        if iteration not in job.first_ready:  # a coflow arrives: plan again (as Sincronia does)
            job.first_ready[iteration] = self.now
            self.replan_due = True
        per_flow = job.chunk_size[bucket] * 8.0
        mask = job.counts[bucket] > 0
        flows = job.counts[bucket][mask]
        c = _Collective(job, iteration, bucket, int(job.band[bucket]),
                        float(flows.sum()) * per_flow)
        if c.bits <= 0:
            self.collective_done(c)
            return
        self.seq += 1
        cid = self.seq
        self.queued[cid] = c
        if not job.spec.ring and not job.staged:
            # In the shim's order: the bucket's forward position (open loop: coflows first
            # come, first served).
            self.net.add(cid, job.links[mask].tolist(), flows.tolist(), per_flow,
                         *self.queue(job, c.band),
                         key=(iteration, bucket))
            return
        chunks = range(job.first_chunk[bucket], job.first_chunk[bucket + 1])
        c.unqueued_bits, c.chunks_left = c.bits, len(chunks)
        c.stages = job.stage_flows if job.staged else None
        for chunk in chunks:
            self.send_hop(_Hop(cid, chunk, job.owners[chunk], 0))

    def send_hop(self, hop: _Hop) -> None:
        """Queue a ring chunk's hop: its sender's egress and its receiver's ingress. Hops
        between ranks of one host take no link and no time (loopback)."""
        c = self.queued[hop.collective]
        job = c.job
        if job.staged:
            self.send_stage(hop)
            return
        last = 2 * (job.w - 1) - 1
        while True:
            sender = (hop.owner + 1 + hop.stage) % job.w
            receiver = (sender + 1) % job.w
            if job.hosts[sender] != job.hosts[receiver]:
                break
            if hop.stage == last:
                self.chunk_done(hop.collective)
                return
            hop = hop.at(hop.stage + 1)
        links = [int(job.hosts[sender]), job.n_hosts + int(job.hosts[receiver])]
        self._queue_hop(c, hop, links, [1.0, 1.0], 2.0, averaging=hop.stage >= job.w - 1)

    def send_stage(self, hop: _Hop) -> None:
        """Queue a tree job's chunk's next stage with links (`_Job._stage_flows`)."""
        c = self.queued[hop.collective]
        assert c.stages is not None
        up, stages = c.stages[hop.owner]
        stage = hop.stage
        while stage < len(stages) and not len(stages[stage][0]):
            stage += 1
        if stage == len(stages):
            self.chunk_done(hop.collective)
            return
        links, flows, total = stages[stage]
        self._queue_hop(c, hop.at(stage), links, flows, total, averaging=stage >= up)

    def _queue_hop(self, c: _Collective, hop: _Hop, links: list[int], flows: list[float],
                   total: float, averaging: bool) -> None:
        """Put a hop or stage of a chunk of `c` in the network: `flows` of a chunk each on
        `links` (`total` of them), in the shim's order (the bucket, averages before
        partial sums, chunk)."""
        bits = c.job.chunk_size[c.bucket] * 8.0
        c.unqueued_bits -= total * bits
        self.seq += 1
        self.hops[self.seq] = hop
        key = (c.iteration, c.bucket, 0 if averaging else 1, hop.chunk)
        self.net.add(self.seq, links, flows, bits, *self.queue(c.job, c.band), key=key)

    def hop_done(self, hop: _Hop) -> None:
        if self.queued[hop.collective].job.staged:
            self.send_stage(hop.at(hop.stage + 1))
        elif hop.stage + 1 < 2 * (self.queued[hop.collective].job.w - 1):
            self.send_hop(hop.at(hop.stage + 1))
        else:
            self.chunk_done(hop.collective)

    def chunk_done(self, cid: int) -> None:
        c = self.queued[cid]
        c.chunks_left -= 1
        if not c.chunks_left:
            self.collective_done(self.queued.pop(cid))

    def queue(self, job: _Job, band: int) -> tuple[int, int]:
        """(priority, queue) of a job's band: gradlaned's HTB leaves carry prio =
        min(7, job level + band) (daemon/qdisc.py); each band is a queue of its own."""
        return min(LEVELS - 1, job.level + band), job.index * self.sc.bands + band

    def collective_done(self, c: _Collective) -> None:
        self.progressed = True
        job = c.job
        job.synced[c.bucket] = self.now
        job.outstanding[c.iteration] -= 1
        if not job.outstanding[c.iteration]:  # a coflow departs: plan again
            del job.outstanding[c.iteration]
            job.ccts[c.iteration] = self.now - job.first_ready.pop(c.iteration, self.now)
            self.replan_due = True
        if not self.sc.arrivals:
            self.advance(job)

    def release(self) -> None:
        """Open loop: every coflow's collectives, ready at its arrival (last bucket first)."""
        for job, times in zip(self.jobs, self.sc.arrivals, strict=True):
            for it, t in enumerate(times):
                job.outstanding[it] = job.nb
                for b in range(job.nb - 1, -1, -1):
                    self.seq += 1
                    heapq.heappush(self.ready, (t, self.seq, job.index, it, b))

    def finished(self) -> float:
        """How far the run is, 0..1 (1: every job has what `result` measures)."""
        sc = self.sc
        if sc.arrivals:
            total = sum(len(a) for a in sc.arrivals)
            return sum(len(j.ccts) for j in self.jobs) / max(1, total)
        need = sc.warmup + sc.iterations + 1  # +1: an iteration's time is start to next start
        return min(min(len(j.starts) for j in self.jobs) / need, 1.0)

    # -- planning ----------------------------------------------------------

    def remaining(self, job: _Job, queued: list[tuple[_Collective, float]]
                  ) -> dict[int, np.ndarray]:
        """Per coflow in flight (by iteration), per bucket the fraction of its collective
        still to send (`queued`: the job's collectives in the network, with their bits
        left); coflows with nothing left are left out."""
        left = {it: np.zeros(job.nb) for it in sorted(job.outstanding)}
        if not self.sc.arrivals:  # closed loop: one iteration in flight at most
            for part in left.values():
                part[np.isnan(job.synced)] = 1.0  # not computed yet, or queued (set below)
        for c, bits in queued:
            left[c.iteration][c.bucket] = bits / c.bits
        return {it: part for it, part in left.items() if part.any()}

    def state(self) -> State:
        """The cluster as a control plane sees it: workers, chunks and current demands.

        One coflow per iteration in flight (open loop: a job's backlog is several
        coflows, each with its own age, not one big young one; a job between
        coflows shows its next one, whole): what is left of that iteration's
        exchange, as load-equivalent flows per worker and bucket
        (`_Job.loads`), at the bucket's forward-order priority (buckets are
        the job's `layers`), tagged with the bucket's first chunk.
        """
        workers: list[Worker] = []
        tables: list[FlowTable] = []
        coflows: list[Coflow] = []
        jobs: list[JobState] = []
        topo = self.sc.topology
        in_network: dict[int, float] = {}  # by collective, its bits queued on links
        for nid, bits in self.net.bits_left().items():
            cid = self.hops[nid].collective if nid in self.hops else nid
            in_network[cid] = in_network.get(cid, 0.0) + bits
        queued: dict[int, list[tuple[_Collective, float]]] = {}  # by job index
        for cid, c in self.queued.items():
            bits = in_network.get(cid, 0.0) + c.unqueued_bits
            queued.setdefault(c.job.index, []).append((c, bits))
        for job in self.jobs:
            spec = job.spec
            jobs.append(JobState(spec.name, job.w, global_batch=spec.global_batch,
                                 chunk_bytes=job.chunk_bytes, layers=job.nb,
                                 chunk_layers=job.chunk_layer, ring=spec.ring,
                                 by_host=job.kind == "host"))
            busy = job.last_busy
            for r in range(job.w):
                # Samples per second of compute, as the shim measures it: what the last
                # iteration processed over how long it computed.
                thr = float(job.last_shares[r] / busy[r]) if busy[r] > 0 else 0.0
                workers.append(Worker(spec.name, r, int(job.hosts[r]), thr, int(job.shares[r])))
            if job.w < 2:
                continue
            # Between coflows: its next one, whole (what its demand report says).
            in_flight = (self.remaining(job, queued.get(job.index, []))
                         or {job.iteration: np.ones(job.nb)})
            local, remote = job.loads()
            ready = np.maximum(0.0, job.ready_at - self.now)
            for it, left in in_flight.items():
                age = self.now - job.first_ready.get(it, self.now)
                tables.append(job.exchange.demand_flows(job.hosts, local, remote, len(coflows),
                                                        job.first_chunk, left=left, ready_s=ready))
                coflows.append(Coflow(f"{spec.name}/{it}", spec.name, age))
        self.version += 1
        return State(jobs=tuple(jobs), topology=topo, workers=tuple(workers),
                     coflows=tuple(coflows), flows=FlowTable.concat(tables), bands=self.sc.bands,
                     version=self.version)

    def replan(self) -> None:
        state = self.state()
        started = time.perf_counter()
        plan = self.policy.plan(state)
        self.plan_ms.append((time.perf_counter() - started) * 1000)
        self.apply(state, plan)

    def apply(self, state: State, plan: Plan) -> None:
        """Bands and levels, ownership and batch shares, as daemons and shims would take them."""
        index = {job.spec.name: job.index for job in self.jobs}
        coflow_job = np.array([index[c.job] for c in state.coflows], dtype=np.int64)
        flow_job = coflow_job[state.flows.coflow]
        unset = np.iinfo(np.int64).max
        for job in self.jobs:
            name = job.spec.name
            job.level = plan.job_level.get(name, 0)
            # A bucket's band: its flows' most urgent (they carry its first chunk).
            mine = flow_job == job.index
            if mine.any():
                least = np.full(len(job.chunk_bytes), unset)
                np.minimum.at(least, state.flows.chunk[mine], plan.flow_band[mine])
                first = least[job.first_chunk[:-1]]
                job.band[first != unset] = first[first != unset]
            owners = plan.ownership.get(name, job.owners)
            if owners != job.owners or plan.reduce_in_leaf != job.in_leaf:
                job.set_ownership(owners, plan.reduce_in_leaf)
            if name in plan.batch_shares:
                job.shares = np.array(plan.batch_shares[name], dtype=np.float64)
        prio_of = {}
        for job in self.jobs:
            for band in range(self.sc.bands):
                prio, queue = self.queue(job, band)
                prio_of[queue] = prio
        self.net.set_priorities(prio_of)

    # -- the loop ----------------------------------------------------------

    def run(self) -> Result:
        started = time.perf_counter()
        sc = self.sc
        self.replan()
        last_plan, next_plan = 0.0, sc.replan_s
        if sc.arrivals:
            self.release()
        else:
            for job in self.jobs:
                self.advance(job)
        limit = self.event_limit()
        for _ in range(limit):
            if self.progressed:  # only a collective done may finish the run
                self.progressed = False
                if self.finished() >= 1.0:
                    break
            t_ready = self.ready[0][0] if self.ready else np.inf
            t_next = min(self.net.next_finish(), t_ready, next_plan)
            if not np.isfinite(t_next):
                raise RuntimeError("simulation stalled: nothing to send or compute")
            done = self.net.advance_to(t_next)
            self.now = t_next
            for nid in done:
                if nid in self.hops:
                    self.hop_done(self.hops.pop(nid))
                else:
                    self.collective_done(self.queued.pop(nid))
            while self.ready and self.ready[0][0] <= self.now:
                _, _, j, it, b = heapq.heappop(self.ready)
                self.collective_ready(self.jobs[j], it, b)
            if self.replan_due:  # an event: plan again, but not sooner than the reaction time
                next_plan = min(next_plan, last_plan + sc.react_s)
                self.replan_due = False
            if self.now >= next_plan:
                self.replan()
                last_plan, next_plan = self.now, self.now + sc.replan_s
                if self.on_progress:
                    self.on_progress(self.finished())
        else:
            raise RuntimeError(f"simulation did not finish in {limit} events")
        return self.result(time.perf_counter() - started)

    def event_limit(self) -> int:
        """A bound on the run's events (so a stall cannot loop forever): 2 million, and
        per iteration of a job whose chunks move one by one (the ring, `store_forward`)
        room for each chunk's every hop or stage to end on each of its links apart."""
        sc = self.sc
        per_iteration = sum(len(j.chunk_bytes) * 4 * j.w for j in self.jobs
                            if j.spec.ring or j.staged)
        iterations = (sum(len(a) for a in sc.arrivals) if sc.arrivals
                      else sc.warmup + sc.iterations + 2)
        return 2_000_000 + per_iteration * iterations

    def result(self, wall: float) -> Result:
        sc = self.sc
        iters, ccts = {}, {}
        for job in self.jobs:
            done = [job.ccts[i] for i in sorted(job.ccts)]
            if sc.arrivals:  # every coflow after the warm-up ones
                ccts[job.spec.name] = done[sc.warmup:]
                continue
            s = np.array(job.starts[sc.warmup:sc.warmup + sc.iterations + 1])
            iters[job.spec.name] = np.diff(s).tolist()
            ccts[job.spec.name] = done[sc.warmup:sc.warmup + sc.iterations]
        h = len(sc.topology.hosts)
        used = self.net.carried_bits() / (self.cap * max(self.now, EPS))
        util = {"host": float(used[:h].mean())}
        if sc.topology.uplink_bps:
            util["uplink"] = float(used[2 * h:].mean())
        return Result(self.policy.name, iters, ccts, util, self.now, wall, self.plan_ms)


def full_demand_state(scenario: Scenario, policy: Policy) -> State:
    """The planner's largest input: every job with a whole iteration's gradients to send.

    What a control plane sees when all jobs are in their exchange at once;
    the plan-time benchmark times policies on it.
    """
    sim = _Sim(scenario, policy, None)
    for job in sim.jobs:
        job.outstanding = {0: job.nb}
        job.synced = np.full(job.nb, np.nan)
        job.ready_at = job.forward.sum() + np.cumsum(job.backward[::-1])[::-1]
        job.first_ready[0] = 0.0
    return sim.state()


def coflow_load(scenario: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """One coflow (iteration exchange) of each job alone on the fabric, chunks owned as at
    the start: a ``(jobs, links)`` matrix of the seconds it keeps each link busy, and per
    job how long it takes when all its collectives are released at once (open loop): its
    busiest link's time, as every link serves its share on its own (model, point 2)."""
    cap = scenario.topology.capacity_bps
    load = np.zeros((len(scenario.jobs), len(cap)))
    for i, spec in enumerate(scenario.jobs):
        job = _Job(i, spec, scenario)
        busy = job.counts * (np.array(job.chunk_size)[:, None] * 8.0) / cap[job.links][None, :]
        np.add.at(load[i], job.links, busy.sum(axis=0))
    return load, load.max(axis=1)


def simulate(scenario: Scenario, policy: Policy,
             on_progress: Callable[[float], None] | None = None) -> Result:
    """Run `scenario` under `policy` until every job has its measured iterations."""
    return _Sim(scenario, policy, on_progress).run()
