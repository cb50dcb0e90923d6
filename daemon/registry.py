"""What gradlaned knows: jobs, their workers on this host, and their band connections.

A worker exists while its connection is open and its process lives; the
daemon removes it on bye, on disconnect, or when `expire` finds its pid gone.
Every change that matters to traffic control bumps `version`.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gradlane.daemon.control_protocol import MAX_CHUNKS
from gradlane.daemon.fields import RESERVED_PREFIX
from gradlane.daemon.protocol import ChunkEvent, FlowSpec, Hello, Timing
from gradlane.errors import ProtocolError

__all__ = ["Credentials", "Registry", "Worker"]

TIMINGS_KEPT = 64
# Throughput is the median rate of this many latest steps: one step slowed by a busy
# host (a page fault storm, a neighbour's burst) must not move the batch shares.
RATE_WINDOW = 5


@dataclass(frozen=True)
class Credentials:
    """The peer of a Unix socket connection, from SO_PEERCRED."""

    pid: int
    uid: int
    gid: int


@dataclass
class Worker:
    id: str
    job: str
    rank: int
    world_size: int
    cred: Credentials
    flows: tuple[FlowSpec, ...]
    since: float
    exchange: str | None = None  # how its job reduces (`protocol`); None: not agreed yet
    global_batch: int = 0  # its job's samples per step, as its ranks agreed (0: not yet)
    flows_left_out: int = 0  # band connections its shim did not register (too many)
    left_out_from: frozenset[str] = frozenset()  # their source addresses, as it said
    chunk_events: int = 0
    chunk_bytes: list[int] = field(default_factory=list)  # per band
    # The latest iteration's chunks as (layer, bytes, band), in the order they were ready:
    # the job's demand, which the control plane plans owners and rates with. At most as
    # many as a report carries (`MAX_CHUNKS`): a shim that never moves on to another
    # iteration cannot grow it without bound.
    demand: list[tuple[int, int, int]] = field(default_factory=list)
    demand_iteration: int = -1
    iteration: int = -1
    timings: deque[Timing] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))

    def throughput(self) -> float:
        """Samples per second of compute: the median of the latest `RATE_WINDOW` steps (0: none).

        The low median: a rate actually measured, and with an even count the lower of
        the middle two, so a worker counts as faster only once most of its recent
        steps were.
        """
        rates = [t.samples / t.compute_s for t in list(self.timings)[-RATE_WINDOW:]
                 if t.compute_s > 0]
        return statistics.median_low(rates) if rates else 0.0


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Registry:
    """Workers by id, indexed by (job, rank). Not thread-safe: the daemon's loop owns it."""

    def __init__(
        self,
        bands: int,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int], bool] = process_alive,
    ) -> None:
        self.bands = bands
        self.version = 0
        self._clock = clock
        self._alive = alive
        self._ids = itertools.count(1)
        self._workers: dict[str, Worker] = {}
        self._by_rank: dict[tuple[str, int], str] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def workers(self) -> list[Worker]:
        return sorted(self._workers.values(), key=lambda w: (w.job, w.rank))

    def jobs(self) -> dict[str, list[Worker]]:
        out: dict[str, list[Worker]] = {}
        for worker in self.workers():
            out.setdefault(worker.job, []).append(worker)
        return out

    def add(self, hello: Hello, cred: Credentials) -> Worker:
        """Register a worker.

        Raises:
            ProtocolError: reserved job name, or (job, rank) held by a live process.
        """
        if hello.job.startswith(RESERVED_PREFIX):
            raise ProtocolError(
                "bad_message", f"job names starting with {RESERVED_PREFIX!r} are reserved"
            )
        key = (hello.job, hello.rank)
        held = self._by_rank.get(key)
        if held is not None:
            other = self._workers[held]
            if self._alive(other.cred.pid):
                raise ProtocolError(
                    "conflict",
                    f"job {hello.job!r} rank {hello.rank} is registered already "
                    f"by pid {other.cred.pid}",
                )
            self.remove(held)
        worker = Worker(
            id=f"w{next(self._ids)}",
            job=hello.job,
            rank=hello.rank,
            world_size=hello.world_size,
            cred=cred,
            flows=hello.flows,
            since=self._clock(),
            exchange=hello.exchange,
            global_batch=hello.global_batch or 0,
            chunk_bytes=[0] * self.bands,
        )
        self._workers[worker.id] = worker
        self._by_rank[key] = worker.id
        self.version += 1
        return worker

    def set_bands(self, bands: int) -> None:
        """A new number of bands (a reload): every worker's bytes per band follow, those of
        bands past the last counted with it, as their connections now are."""
        self.bands = bands
        for worker in self._workers.values():
            counted = worker.chunk_bytes
            worker.chunk_bytes = counted[:bands] + [0] * (bands - len(counted))
            worker.chunk_bytes[-1] += sum(counted[bands:])

    def set_flows(self, worker_id: str, flows: tuple[FlowSpec, ...],
                  exchange: str | None = None, global_batch: int | None = None,
                  left_out: int = 0, left_out_from: frozenset[str] = frozenset()) -> None:
        """Replace a worker's band connections (and how many it `left_out`, from which
        source addresses); `exchange` and `global_batch`, when given, how its job reduces
        and its samples per step."""
        worker = self._workers[worker_id]
        if worker.flows != flows or worker.left_out_from != left_out_from:
            worker.flows, worker.left_out_from = flows, left_out_from
            self.version += 1
        if bool(worker.flows_left_out) != bool(left_out):  # the DSCP class's priority
            self.version += 1
        worker.flows_left_out = left_out
        if exchange is not None and worker.exchange != exchange:
            worker.exchange = exchange
            self.version += 1
        if global_batch is not None and worker.global_batch != global_batch:
            worker.global_batch = global_batch
            self.version += 1

    def record_chunks(self, worker_id: str, iteration: int, events: tuple[ChunkEvent, ...]) -> None:
        worker = self._workers[worker_id]
        worker.iteration = max(worker.iteration, iteration)
        worker.chunk_events += len(events)
        for event in events:
            worker.chunk_bytes[event.band] += event.nbytes
        if iteration > worker.demand_iteration:
            worker.demand, worker.demand_iteration = [], iteration
        if iteration == worker.demand_iteration:
            room = MAX_CHUNKS - len(worker.demand)
            worker.demand += [(e.layer, e.nbytes, e.band) for e in events[:max(room, 0)]]

    def record_timing(self, worker_id: str, timing: Timing) -> None:
        worker = self._workers[worker_id]
        worker.iteration = max(worker.iteration, timing.iteration)
        worker.timings.append(timing)

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._by_rank.pop((worker.job, worker.rank), None)
            self.version += 1
        return worker

    def expire(self) -> list[Worker]:
        """Remove workers whose process is gone; return them."""
        dead = [w for w in self._workers.values() if not self._alive(w.cred.pid)]
        for worker in dead:
            self.remove(worker.id)
        return dead
