"""The chunk engine: priority queues, reduce-scatter and all-gather per chunk.

A *group* is a flat gradient buffer that is synchronized as a unit (one
layer's gradients of one dtype, or a run of one DDP bucket's parameters). It
is cut into chunks; each chunk has one owner rank and a reduction tree towards it
(`gradlane.policies.chunks.reduction_parents`): with every rank on one leaf
(the default) all ranks send straight to the owner; with the ranks' leaf
switches known, ranks send to their leaf's leader, which forwards the leaf's
partial sum, so one copy per leaf crosses the spine; with ranks sharing hosts,
the same within each host first (one copy per host on its NIC), under the leaves
when both are known. With the ring exchange
(`Engine` ``routes`` of kind ``ring``: `gradlane.policies.chunks.uses_ring`) the tree
is a path around the ring of ranks, starting at the owner's successor, and the
result goes on around the ring (`gradlane.policies.chunks.ring_routes`): every
rank sends only to its successor. For every step:

1. When a group's local gradient is complete (`Engine.ready`), each chunk goes
   to its parent in the tree (reduce-scatter, RS) through the sender queue of
   that peer.
2. A leaf leader, once it holds its leaf's contributions, sends their
   sample-weighted sum ``sum(n_r * g_r)`` and ``sum(n_r)`` to the owner
   (a partial sum, PS).
3. The owner, once it holds all contributions, computes the sample-weighted
   mean ``sum(n_r * g_r) / sum(n_r)`` in float32 (float64 for float64
   gradients), adding its children in rank order, and writes it to the
   group's output buffer.
4. The owner sends that result down the tree (all-gather, AG; leaders
   forward it to their leaf; on the ring, each rank to its successor); every
   replica therefore holds the exact same bytes.
5. A group is done for the step when all its chunks are; waiters wake and the
   group's callback runs.

Scheduling: a chunk rides its group's band. Every connection (peer, band)
has a priority queue and a sender thread that pops it in priority order
(smaller group priority first, AG before RS, chunk order), so a chunk that
becomes ready while lower-priority chunks of its band are queued goes first,
after at most the one chunk being written. (RS before AG was no faster on the
testbed's traces: `bench/README.md`.) Across bands the kernel decides:
gradlaned's HTB leaves (and DSCP-priority switches) send band 0 before band
3, and TCP_NOTSENT_LOWAT keeps what a band has committed but not sent small.
Without a daemon the bands share the link like any TCP flows. One receiver thread per
connection reads straight into preallocated tensors (no copies), and senders
write straight from tensor memory.

Failure: EOF, a reset or a malformed frame on any connection, or no message
from anyone for `timeout_s` while a caller waits, makes every wait raise
`PeerLost` naming the rank the missing data was expected from. Before that
last, the wait asks those ranks (PING): one that answers (its receiver thread
lives; it waits on a rank of its own) is waited on `timeout_s` more, and its
goodbye, as it gives up, names the rank it lost; one that does not answer
within `PING_GRACE_S` (a hung process) is the rank lost. The closing rank's
goodbyes name that rank for the others.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import heapq
import itertools
import logging
import multiprocessing
import multiprocessing.util
import os
import socket
import struct
import sys
import termios
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradlane.errors import PeerLost, TransportError
from gradlane.policies.chunks import Routes
from gradlane.shim.transport import Link, Mesh, tensor_bytes, tree_neighbours

__all__ = ["OPEN", "Chunk", "Engine", "Group", "close_at_exit", "owned_bytes"]

logger = logging.getLogger(__name__)


class _Closable(Protocol):
    rank: int

    def close(self) -> Any: ...


# What holds an Engine and was not closed yet (`Sync`, `HookState`): each is held here
# (`close_at_exit`) and leaves at its close; the exit closes those left (`_close_at_exit`).
# A forked child (a DataLoader worker) starts with none: closing its copies would shut
# down the parent's connections, which it shares.
OPEN: weakref.WeakSet[_Closable] = weakref.WeakSet()
os.register_at_fork(after_in_child=OPEN.clear)
_finalized_in: int | None = None  # the process whose multiprocessing finalizer closes them


def close_at_exit(owner: _Closable) -> None:
    """Have `owner` closed as the process ends, unless closed before.

    A multiprocessing child started by fork (``mp.Process``, ``torch.multiprocessing``
    with ``start_method="fork"``, as in notebooks) ends with ``os._exit``, past the
    interpreter's exit handlers; multiprocessing runs its own finalizers first, so one
    of those closes them there.
    """
    global _finalized_in
    OPEN.add(owner)
    if multiprocessing.parent_process() is not None and _finalized_in != os.getpid():
        multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=100)
        _finalized_in = os.getpid()


@atexit.register
def _close_at_exit() -> None:
    """Close what a script left open (no ``with``, no ``close()``) as it ends.

    Its peers may still need this rank: the averages of the chunks it owns are
    computed and sent by its engine's threads once every rank's gradients are
    in, and the interpreter stops those threads after the exit handlers. A
    script ending right after its last step would otherwise take them along,
    and its peers' last step would fail ("a peer is gone").
    """
    for owner in list(OPEN):
        try:
            owner.close()
        except Exception as exc:  # the exit goes on; say why this one failed
            logger.warning("gradlane: rank %d: closing at exit failed: %s", owner.rank, exc)

RS, AG, BYE, PS = 1, 2, 3, 4
# "Are you there?" and its answer, from the peer's receiver thread: a rank its training
# keeps waiting (on a peer of its own) still answers; a hung one (stopped) cannot.
PING, PONG = 5, 6
_HDR = struct.Struct("<BxxxIQIII")  # kind, group, step, chunk, nbytes, samples
_FIRST, _LAST = (-1,), (1 << 62,)
_EMPTY = memoryview(b"")
# How long a rank that has waited timeout_s waits for the answer to its PING.
PING_GRACE_S = 1.0


@dataclass(eq=False)
class Chunk:
    group: Group
    index: int
    start: int
    stop: int
    owner: int
    plane: int = 0  # the plane (NIC) whose connections carry it, at every rank
    parent: int = -1  # where this rank's contribution goes (-1: this rank owns the chunk)
    children: tuple[int, ...] = ()  # whose contributions come here
    source: int = -1  # who sends this rank the result (-1: this rank owns the chunk)
    sinks: tuple[int, ...] = ()  # whom this rank sends the result to
    done_step: int = -1
    # Ranks with children: one receive buffer per child, this step's arrivals, their
    # sample counts and multipliers (n for a gradient, 1 for a partial sum), and (leaders)
    # the partial sum sent up.
    inbox: dict[int, torch.Tensor] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    mult: dict[int, int] = field(default_factory=dict)
    have: set[int] = field(default_factory=set)
    partial: torch.Tensor | None = None
    partial_bytes: memoryview | None = None
    # Byte views made once (sockets read and write tensor memory through them).
    nbytes: int = 0
    grad_bytes: memoryview = field(init=False)
    out_bytes: memoryview = field(init=False)
    inbox_bytes: dict[int, memoryview] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = self.group
        self.nbytes = (self.stop - self.start) * g.grad.element_size()
        self.grad_bytes = tensor_bytes(g.grad[self.start : self.stop])
        self.out_bytes = tensor_bytes(g.out[self.start : self.stop])


@dataclass(eq=False)
class Group:
    """A flat gradient buffer synchronized as a unit.

    `grad` holds this worker's contribution, `out` receives the average.
    `priority`: smaller goes first. `band`: the connection it rides.
    """

    gid: int
    label: str
    grad: torch.Tensor
    out: torch.Tensor
    priority: int
    band: int
    chunks: list[Chunk] = field(default_factory=list)
    remaining: int = 0
    done_step: int = -1
    step: int = -1
    on_done: Callable[[Group], None] | None = None


class Engine:
    """Runs the per-chunk collective over a `Mesh` (see the module docstring).

    Args:
        mesh: established connections.
        timeout_s: see `ShimConfig.timeout_s`.
        on_event: called ``(group, chunk, kind)`` when a chunk is queued
            ("ready") and when it is averaged ("done"); for the daemon client.
        routes: the paths every rank agreed on (`gradlane.policies.chunks.Routes.agreed`
            from `ShimConfig.exchange`, the ranks' leaves and hosts; the mesh
            connected to its `peers`); default: the flat exchange, straight to
            each chunk's owner. See the module docstring.
        plane_rates: with several planes (`Mesh.addresses`), each one's rate:
            chunks spread over them in proportion (default: equally).
    """

    def __init__(
        self,
        mesh: Mesh,
        timeout_s: float,
        on_event: Callable[[Group, Chunk, str], None] | None = None,
        routes: Routes | None = None,
        plane_rates: Sequence[float] | None = None,
    ) -> None:
        self.mesh = mesh
        if plane_rates is not None and (len(plane_rates) != mesh.planes
                                        or min(plane_rates) <= 0):
            raise TransportError(f"need one positive rate per plane ({mesh.planes}), "
                                 f"got {list(plane_rates)}")
        self.plane_rates = tuple(plane_rates or (1.0,) * mesh.planes)
        self.rank, self.world = mesh.rank, mesh.world
        self.routes = routes or Routes.agreed("flat", self.world)
        if self.routes.world != self.world:
            raise TransportError(f"routes for {self.routes.world} ranks on a mesh of {self.world}")
        self.kind = self.routes.kind  # what gradlaned and the control plane are told
        self.ring = self.kind == "ring"
        unlinked = set(self.routes.peers(self.rank)) - set(mesh.peers())
        if unlinked:
            raise TransportError(
                f"rank {self.rank} has no connections to ranks {sorted(unlinked)}, which "
                f"its {self.kind} exchange sends chunks to: connect the mesh to "
                "`Routes.peers` of the same routes")
        self._route_cache: dict[int, tuple[list[int], list[int]]] = {}
        # Per owner rank, its registered chunks' bytes on each plane.
        self._plane_bytes = [[0] * mesh.planes for _ in range(mesh.world)]
        self.timeout_s = timeout_s
        self.on_event = on_event
        self.on_failure: Callable[[TransportError], None] | None = None
        self.groups: dict[int, Group] = {}
        self.step = 0
        self.samples = 1
        self.error: TransportError | None = None
        self.last_rx = time.monotonic()
        self.left: dict[int, str] = {}
        self._vanished: set[int] = set()
        # Peers that stopped because they lost a rank, and that rank (their goodbye says
        # it): with connections to its routes' peers only, most ranks hear of a lost rank
        # from the ranks between.
        self._blame: dict[int, int] = {}
        self._silent: PeerLost | None = None  # what this worker gave up waiting on (`give_up`)
        self._byes: dict[int, int] = {}
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # chunk and group progress, failures
        self._sent = threading.Condition(lock)  # send queues drained
        self._seq = itertools.count()
        # One priority queue and one sender thread per connection (peer, band, plane).
        self._queues: dict[
            tuple[int, int, int], list[tuple[tuple[int, ...], int, bytes, memoryview | None]]
        ]
        self._queues = {key: [] for key in mesh.links}
        self._qcond = {key: threading.Condition() for key in mesh.links}
        self._queued: dict[int, int] = dict.fromkeys(mesh.peers(), 0)  # bytes, by peer
        self._closing = False
        self._senders: list[threading.Thread] = []
        self._receivers: list[threading.Thread] = []
        for link in mesh.links.values():
            name = f"{link.peer}.{link.band}" + (f".{link.plane}" if mesh.planes > 1 else "")
            self._senders.append(self._spawn(self._send_loop, f"gl-send-{name}", link))
            self._receivers.append(self._spawn(self._recv_loop, f"gl-recv-{name}", link))

    def _spawn(self, target: Callable[..., None], name: str, arg: object) -> threading.Thread:
        def run() -> None:
            try:
                target(arg)
            except Exception as exc:  # a bug, not the network: every wait raises it now
                logger.exception("gradlane: rank %d: %s failed", self.rank, name)
                self._fail(TransportError(
                    f"rank {self.rank}: {name} failed: {type(exc).__name__}: {exc}"))

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    # -- groups ------------------------------------------------------------

    def add_group(
        self,
        gid: int,
        label: str,
        grad: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        owners: Sequence[int],
        priority: int,
        band: int,
        on_done: Callable[[Group], None] | None = None,
    ) -> Group:
        """Register a group; every worker must register the same ones."""
        if gid in self.groups:
            raise TransportError(f"group {gid} ({label}) registered twice")
        if not (grad.dim() == 1 and grad.is_contiguous() and grad.device.type == "cpu"):
            raise TransportError(f"group {label}: need a flat contiguous CPU tensor")
        group = Group(
            gid,
            label,
            grad,
            torch.empty_like(grad),
            priority,
            band,
            on_done=on_done,
            step=self.step - 1,
            done_step=self.step - 1,
        )
        for i, ((start, stop), owner) in enumerate(zip(ranges, owners, strict=True)):
            parents, sources = self._routes(owner)
            parent, children = tree_neighbours(parents, self.rank)
            source, sinks = tree_neighbours(sources, self.rank)
            # Several planes (NICs): each chunk on the one where its owner's chunks have the
            # fewest bytes so far for the plane's rate. So every owner's chunks spread over
            # every plane, and each NIC carries contributions out while averages come in:
            # owners and planes in step (all of rank 0's chunks on plane 0, ...) would
            # leave each plane's one direction idle until the other had sent. On the
            # testbed (bench/two_nics.py, 2 ranks, two NICs each): 197-223 ms a step this
            # way (five runs); 241-245 ms with planes by bytes alone, which put owners and
            # planes in step; 206-221 ms by turns.
            on, rates = self._plane_bytes[owner], self.plane_rates
            plane = min(range(self.mesh.planes), key=lambda k: on[k] / rates[k])
            on[plane] += (stop - start) * grad.element_size()
            chunk = Chunk(
                group,
                i,
                start,
                stop,
                owner,
                plane=plane,
                parent=parent,
                children=tuple(children),
                source=source,
                sinks=tuple(sinks),
                done_step=self.step - 1,
            )
            if chunk.children:
                chunk.inbox = {
                    p: torch.empty(stop - start, dtype=grad.dtype) for p in chunk.children
                }
                chunk.inbox_bytes = {p: tensor_bytes(t) for p, t in chunk.inbox.items()}
                if chunk.parent >= 0:
                    chunk.partial = torch.empty(stop - start, dtype=grad.dtype)
                    chunk.partial_bytes = tensor_bytes(chunk.partial)
            group.chunks.append(chunk)
        group.remaining = len(group.chunks)
        with self._cond:
            self.groups[gid] = group
            self._cond.notify_all()
        return group

    def _routes(self, owner: int) -> tuple[list[int], list[int]]:
        """(reduce parents, result parents) of the chunks `owner` owns (they depend on it only)."""
        if owner not in self._route_cache:
            self._route_cache[owner] = self.routes.of(owner)
        return self._route_cache[owner]

    def retire(self, groups: Sequence[Group]) -> None:
        """Forget `groups` (every average of theirs is in, nothing of theirs is queued)."""
        with self._cond:
            for group in groups:
                if self.groups.get(group.gid) is group:
                    del self.groups[group.gid]
                    for chunk in group.chunks:
                        self._plane_bytes[chunk.owner][chunk.plane] -= chunk.nbytes

    # -- the caller's side -------------------------------------------------

    def begin(self, step: int, samples: int) -> None:
        """Start `step`, in which this worker averages over `samples` samples."""
        if samples < 0:
            raise TransportError(f"sample count must be >= 0, got {samples}")
        self.step, self.samples = step, samples

    def ready(self, group: Group) -> None:
        """`group.grad` holds this step's local gradient: send it on its way."""
        self.raise_error()
        if group.step == self.step:
            raise TransportError(f"group {group.label} was made ready twice in step {self.step}")
        group.step = self.step
        if not group.chunks:
            self._group_done(group, self.step)
            return
        for chunk in group.chunks:
            if self.on_event:
                self.on_event(group, chunk, "ready")
            if chunk.children or chunk.parent < 0:
                self._contribute(chunk, self.rank, self.samples, self.samples, self.step)
            else:
                header = _HDR.pack(
                    RS, group.gid, self.step, chunk.index, chunk.nbytes, self.samples
                )
                self._enqueue(
                    chunk.parent,
                    (group.priority, 1, chunk.index),
                    header,
                    chunk.grad_bytes,
                    group.band,
                    chunk.plane,
                )

    def wait(self, groups: Sequence[Group], step: int | None = None) -> None:
        """Block until every group in `groups` is averaged for `step` (default: current)."""
        step = self.step if step is None else step
        started = time.monotonic()
        asked: float | None = None  # when it asked the ranks it waits on (`ping`)
        while True:
            with self._cond:
                while True:
                    self.raise_error()
                    pending = [g for g in groups if g.done_step < step]
                    if not pending:
                        return
                    lost = self._lost_for(pending, step)
                    if lost is not None:
                        raise lost
                    now = time.monotonic()
                    idle = now - max(self.last_rx, started)
                    verdict = self.silence(idle, asked, now)
                    if verdict != "wait":
                        break
                    self._cond.wait(min(1.0, max(self.next_look(idle, asked, now), 0.001)))
            if verdict == "lost":
                raise self.give_up(pending, step, idle)
            asked = time.monotonic()
            self.ping(self.missing(pending, step))

    @property
    def ping_grace(self) -> float:
        """How long a wait that asked (`ping`) waits for an answer."""
        return min(PING_GRACE_S, self.timeout_s)

    def silence(self, idle: float, asked: float | None, now: float) -> str:
        """What a wait does after `idle` seconds without word, having asked (`ping`) at
        `asked` (None: not yet): "wait", "ask", or "lost" (`give_up`).

        Asked once it has waited timeout_s; lost if no word came within
        `PING_GRACE_S` of asking, or, if some came, after timeout_s more without.
        A rank whose peer waits on a hung rank itself so hears that peer give up (its
        goodbye names the hung rank) before giving up on it.
        """
        if asked is not None and self.last_rx < asked:
            return "lost" if now - asked >= self.ping_grace else "wait"
        if idle < self.timeout_s:
            return "wait"
        return "ask" if asked is None else "lost"

    def next_look(self, idle: float, asked: float | None, now: float) -> float:
        """Seconds until `silence` may say otherwise: until the answer's grace runs out,
        while an answer is awaited, else until timeout_s without word."""
        if asked is not None and self.last_rx < asked:
            return asked + self.ping_grace - now
        return self.timeout_s - idle

    def ping(self, ranks: Iterable[int]) -> None:
        """Ask `ranks` whether they are there (`PING`): a live one's answer counts as word
        from it (`last_rx`)."""
        for peer in sorted(set(ranks)):
            if (peer, 0, 0) in self._queues:
                self._enqueue(peer, _FIRST, _HDR.pack(PING, 0, self.step, 0, 0, 0), _EMPTY, 0, 0)

    def missing(self, groups: Sequence[Group], step: int) -> list[int]:
        """The ranks `groups` wait on for `step` (`_missing`, under the engine's lock)."""
        with self._cond:
            return self._missing(groups, step)

    def give_up(self, pending: Sequence[Group], step: int, idle: float) -> PeerLost:
        """The error of `idle` seconds of silence while `pending` waited for `step`: the
        rank they wait on lost, when it is one (else the peers).

        A peer that hangs (stopped, wedged) says nothing, and its connections stay
        open: this worker's goodbyes, as it closes, name the rank it gave up on (and
        drop what is queued), for the other ranks, who would otherwise blame this one
        for leaving. Waits on groups already averaged still return (`Sync.flush` as
        a checkpoint is saved).
        """
        with self._cond:
            missing = sorted(set(self._missing(pending, step)))
            return self._mark_lost(
                missing, step, f"nothing received for {idle:.0f} s while waiting for "
                f"{pending[0].label if pending else 'its groups'}; waiting on ranks {missing}")

    def _mark_lost(self, ranks: list[int], step: int, detail: str) -> PeerLost:
        """The error naming `ranks` lost (the one, or "peers"), kept for close: its
        goodbyes name the rank, and what is queued is dropped. Under the engine's lock."""
        self._silent = PeerLost(ranks[0] if len(ranks) == 1 else None, step, detail)
        return self._silent

    def lost(self, groups: Sequence[Group], step: int | None = None) -> PeerLost | None:
        """Why `groups` cannot be averaged for `step` (default: current), if a peer they
        need is gone; None while they may still be (`wait` raises it)."""
        step = self.step if step is None else step
        with self._cond:
            return self._lost_for([g for g in groups if g.done_step < step], step)

    def _lost_for(self, pending: Sequence[Group], step: int) -> PeerLost | None:
        if not (pending and self.left):
            return None
        # A peer that vanished breaks the job; one that said goodbye only matters if we
        # still wait on it.
        missing = self._missing(pending, step)
        gone = [p for p in self.left if p in self._vanished]
        gone += [p for p in self.left if p in missing]
        if not gone:
            return None
        return PeerLost(self._blame.get(gone[0], gone[0]), step, self.left[gone[0]])

    def _missing(self, groups: Sequence[Group], step: int) -> list[int]:
        ranks = []
        for group in groups:
            for chunk in group.chunks:
                if chunk.done_step >= step:
                    continue
                waiting = [p for p in chunk.children if p not in chunk.have]
                ranks.extend(waiting or [chunk.source])
        return ranks or [p for p in self.mesh.peers()]

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def drain(self, timeout_s: float) -> bool:
        """Wait until the send queues are empty; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(self._queued.values()) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._sent.wait(min(left, 0.5))
        return self.error is None

    def drain_before(self, before: str, timeout_s: float) -> None:
        """`drain` before `before` (what must not start until every queued send left).

        Raises:
            TransportError: the engine failed meanwhile.
            PeerLost: sends are still queued after `timeout_s`: it names the rank (or
                ranks) they wait to be taken by, marked as `give_up` marks a silent one
                (goodbyes name it, what is queued is dropped at close).
        """
        if self.drain(timeout_s):
            return
        self.raise_error()
        with self._cond:
            stuck = sorted(p for p, n in self._queued.items() if n > 0)
            if not stuck:  # the last went just now
                return
            queued = sum(self._queued.values())
            raise self._mark_lost(
                stuck, self.step, f"sends to ranks {stuck} did not drain within {timeout_s:g} s "
                f"before {before} ({queued / 1e6:.1f} MB still queued)")

    @property
    def healthy(self) -> bool:
        """No error and no peer gone: the job can go on."""
        return self.error is None and not self.left

    def close(self, linger_s: float = 10.0) -> None:
        """Send what is queued, say goodbye on every connection, stop threads.

        Unless the job is failing, it waits up to `linger_s` for queued chunks to
        go out and to be delivered: until the peers' kernels have acknowledged
        every byte, or the peers said goodbye too (closing earlier could reset data
        still in flight; a peer reads what it received before a reset). A rank that
        ends while its peers go on (rank 0 saving a checkpoint) need not wait for
        them. Failing (an error, or a rank lost), it drops what is queued, and its
        goodbyes name the rank lost, for the peers to report.
        """
        if self._closing:
            return
        lost = self._lost()
        failing = self.error is not None or self._silent is not None or lost is not None
        drained = self.drain(0.0 if failing else linger_s)
        self._closing = True
        bye = _HDR.pack(BYE, 0, self.step, 0 if lost is None else lost + 1, 0, 0)
        for (peer, band, plane), queue in self._queues.items():
            cond = self._qcond[peer, band, plane]
            if failing:  # drop what is queued: the goodbye, naming the rank lost, goes next
                with cond:
                    dropped = sum(len(item[3]) for item in queue if item[3] is not None)
                    queue.clear()
                with self._cond:
                    self._queued[peer] -= dropped
            elif not drained:  # its sender goes on until the sockets shut
                with cond:
                    cond.notify_all()
                continue
            self._enqueue(peer, _LAST, bye, None, band, plane)
        deadline = time.monotonic() + (0.5 if failing else linger_s)
        while not self._delivered() and time.monotonic() < deadline:
            time.sleep(0.005)
        for link in self.mesh.links.values():
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)  # wakes threads blocked in recv/send
        for thread in self._senders + self._receivers:
            thread.join(1.0)
        self.mesh.close()

    def _delivered(self) -> bool:
        """Every goodbye sent, and every byte in the kernels of the peers still there
        (acknowledged); those that said goodbye had all they needed, and may be gone."""
        if any(t.is_alive() for t in self._senders):
            return False
        with self._cond:
            left = set(self.left)
        return all(_unacknowledged(link.sock) == 0 for link in self.mesh.links.values()
                   if link.peer not in left)

    def _lost(self) -> int | None:
        """The rank whose loss stops this worker, as far as it knows (None: none)."""
        for error in (self.error, self._silent):
            if isinstance(error, PeerLost) and error.rank is not None:
                return error.rank
        with self._cond:
            for peer in self.left:
                if peer in self._vanished or peer in self._blame:
                    return self._blame.get(peer, peer)
        return None

    # -- sending ----------------------------------------------------------

    def _enqueue(
        self,
        peer: int,
        key: tuple[int, ...],
        header: bytes,
        payload: memoryview | None,
        band: int,
        plane: int,
    ) -> None:
        size = len(payload) if payload is not None else 0
        with self._cond:
            self._queued[peer] += size
        link = (peer, band, plane)
        with self._qcond[link]:
            heapq.heappush(self._queues[link], (key, next(self._seq), header, payload))
            self._qcond[link].notify()

    def _send_loop(self, link: Link) -> None:
        peer = link.peer
        queue, cond = (self._queues[peer, link.band, link.plane],
                       self._qcond[peer, link.band, link.plane])
        try:
            while True:
                with cond:
                    while not queue and not self._closing:
                        cond.wait()
                    if not queue:
                        return
                    _, _, header, payload = heapq.heappop(queue)
                if payload is None:  # BYE, then FIN
                    link.sock.sendall(header)
                    link.sock.shutdown(socket.SHUT_WR)
                    return
                _send_all(link.sock, header, payload)
                with self._cond:
                    self._queued[peer] -= len(payload)
                    if not any(self._queued.values()):
                        self._sent.notify_all()
        except OSError as exc:
            self._fail(PeerLost(peer, self.step, f"sending failed: {exc}"), quiet=self._closing)

    # -- receiving ----------------------------------------------------------

    def _recv_loop(self, link: Link) -> None:
        peer, sock = link.peer, link.sock
        head = bytearray(_HDR.size)
        try:
            while True:
                if not _recv_into(sock, memoryview(head)):
                    if not self._closing:
                        self._vanished.add(peer)
                        self._peer_left(peer, "closed its connections without saying goodbye")
                    return
                kind, gid, step, index, nbytes, samples = _HDR.unpack(head)
                if kind == PING:  # answered first, ahead of any chunk queued to it
                    # Not word for this rank's waits: a peer asks because it waits too.
                    self._enqueue(peer, _FIRST, _HDR.pack(PONG, 0, step, 0, 0, 0), _EMPTY,
                                  link.band, link.plane)
                    continue
                self.last_rx = time.monotonic()
                if kind == PONG:  # word from it (last_rx): it is there
                    continue
                if kind == BYE:  # data before it on this connection is all processed
                    with self._cond:
                        self._byes[peer] = self._byes.get(peer, 0) + 1
                        last = self._byes[peer] == len(self.mesh.dscp) * self.mesh.planes
                        if index:  # it stopped because it lost rank index - 1
                            self._blame[peer] = index - 1
                    if last and index:
                        self._peer_left(peer, f"rank {peer} stopped at step {step}, having lost "
                                              f"rank {index - 1}")
                    elif last:
                        self._peer_left(peer, f"left (closed its shim at step {step})")
                    return
                chunk = self._chunk(peer, gid, index, nbytes)
                if kind in (RS, PS):
                    self._check_step(peer, step, (self.step, self.step + 1), "contribution")
                    if peer not in chunk.children:
                        raise TransportError(
                            f"rank {peer} sent chunk {index} of {chunk.group.label} to a rank "
                            "that does not reduce it for them"
                        )
                    if not _recv_into(sock, chunk.inbox_bytes[peer]):
                        raise ConnectionError("closed mid-chunk")
                    self.last_rx = time.monotonic()
                    self._contribute(chunk, peer, samples, samples if kind == RS else 1, step)
                elif kind == AG:
                    self._check_step(peer, step, (self.step,), "result")
                    if peer != chunk.source:
                        raise TransportError(
                            f"rank {peer} sent a result of chunk {index} of {chunk.group.label} "
                            "it does not send"
                        )
                    if not _recv_into(sock, chunk.out_bytes):
                        raise ConnectionError("closed mid-chunk")
                    self.last_rx = time.monotonic()
                    self._send_down(chunk, step)
                    self._chunk_done(chunk, step)
                else:
                    raise TransportError(f"rank {peer} sent an unknown frame kind {kind}")
        except (OSError, ConnectionError) as exc:
            self._vanished.add(peer)
            self._fail(PeerLost(peer, self.step, f"connection broke: {exc}"), quiet=self._closing)
        except TransportError as exc:
            self._fail(PeerLost(peer, self.step, f"protocol violation: {exc}"))

    def _check_step(self, peer: int, step: int, allowed: tuple[int, ...], what: str) -> None:
        if step not in allowed:
            raise TransportError(
                f"rank {peer} sent a {what} for step {step} during step "
                f"{self.step}: workers are out of step"
            )

    def _chunk(self, peer: int, gid: int, index: int, nbytes: int) -> Chunk:
        group = self.groups.get(gid)
        if group is None:  # a peer got ahead of us to a group we register lazily
            deadline = time.monotonic() + self.timeout_s
            with self._cond:
                while gid not in self.groups and not self._closing:
                    if time.monotonic() >= deadline:
                        raise TransportError(f"rank {peer} sent data for unknown group {gid}")
                    self._cond.wait(0.5)
                group = self.groups.get(gid)
            if group is None:
                raise ConnectionError("closing")
        if not 0 <= index < len(group.chunks) or group.chunks[index].nbytes != nbytes:
            raise TransportError(f"rank {peer} sent a bad chunk header for {group.label}")
        return group.chunks[index]

    # -- reduction and completion ------------------------------------------

    def _contribute(self, chunk: Chunk, rank: int, samples: int, mult: int, step: int) -> None:
        """`rank`'s part arrived: `samples` samples, to be weighted by `mult` (n or 1)."""
        with self._cond:
            chunk.samples[rank], chunk.mult[rank] = samples, mult
            chunk.have.add(rank)
            complete = len(chunk.have) == len(chunk.children) + 1
        if not complete:
            return
        group = chunk.group
        root = chunk.parent < 0
        result = group.out[chunk.start : chunk.stop] if root else chunk.partial
        assert result is not None
        total = sum(chunk.samples.values())
        ranks = sorted(chunk.have)
        # The owner averages; a leader sums the weighted gradients of its leaf.
        if root:
            weights = [chunk.mult[r] / total if total else 0.0 for r in ranks]
        else:
            weights = [float(chunk.mult[r]) for r in ranks]
        parts = [
            group.grad[chunk.start : chunk.stop] if r == self.rank else chunk.inbox[r]
            for r in ranks
        ]
        if group.grad.dtype in (torch.float32, torch.float64):
            # Accumulate in place in the result: no temporary, one pass per rank.
            torch.mul(parts[0], weights[0], out=result)
            for part, weight in zip(parts[1:], weights[1:], strict=True):
                result.add_(part, alpha=weight)
        else:  # half precision: accumulate in float32, round once
            acc = parts[0].to(torch.float32).mul_(weights[0])
            for part, weight in zip(parts[1:], weights[1:], strict=True):
                acc.add_(part.to(torch.float32), alpha=weight)
            result.copy_(acc)
        with self._cond:
            chunk.have.clear()
            chunk.samples.clear()
            chunk.mult.clear()
        if not root:
            header = _HDR.pack(PS, group.gid, step, chunk.index, chunk.nbytes, total)
            self._enqueue(
                chunk.parent,
                (group.priority, 1, chunk.index),
                header,
                chunk.partial_bytes,
                group.band,
                chunk.plane,
            )
            return  # done when the result comes back down
        self._send_down(chunk, step)
        self._chunk_done(chunk, step)

    def _send_down(self, chunk: Chunk, step: int) -> None:
        """Send this step's result of `chunk` (in the group's output) to its sinks."""
        group = chunk.group
        header = _HDR.pack(AG, group.gid, step, chunk.index, chunk.nbytes, 0)
        for peer in chunk.sinks:
            self._enqueue(peer, (group.priority, 0, chunk.index), header, chunk.out_bytes,
                          group.band, chunk.plane)

    def _chunk_done(self, chunk: Chunk, step: int) -> None:
        group = chunk.group
        if self.on_event:
            self.on_event(group, chunk, "done")
        with self._cond:
            chunk.done_step = step
            group.remaining -= 1
            if group.remaining:
                return
        self._group_done(group, step)

    def _group_done(self, group: Group, step: int) -> None:
        with self._cond:
            group.remaining = len(group.chunks)
            group.done_step = step
            self._cond.notify_all()
        if group.on_done is not None:
            group.on_done(group)

    # -- failures ------------------------------------------------------------

    def _peer_left(self, peer: int, why: str) -> None:
        with self._cond:
            self.left[peer] = why
            self._cond.notify_all()
        if peer in self._vanished and self.on_failure is not None:
            self.on_failure(PeerLost(peer, self.step, why))

    def _fail(self, error: TransportError, quiet: bool = False) -> None:
        with self._cond:
            first = self.error is None and not quiet
            if first:
                logger.error("%s", error)
                self.error = error
            self._cond.notify_all()
            self._sent.notify_all()
        if first and self.on_failure is not None:
            self.on_failure(error)


def owned_bytes(groups: Iterable[Group], world: int) -> list[int]:
    """The gradient bytes each rank owns (reduces and sends back) in `groups`, by rank."""
    owned = [0] * world
    for group in groups:
        for chunk in group.chunks:
            owned[chunk.owner] += chunk.nbytes
    return owned


def _unacknowledged(sock: socket.socket) -> int:
    """Bytes (and FIN) `sock` sent that the peer's kernel has not acknowledged yet: TCP's
    SIOCOUTQ, which Linux numbers as TIOCOUTQ. A socket past use has nothing more to
    deliver (0)."""
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)),
                              sys.byteorder, signed=True)
    except (OSError, ValueError):
        return 0


def _send_all(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    parts: list[bytes | memoryview] = [header, payload]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = memoryview(parts[0])[sent:]


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False if the peer closed before the first byte.

    MSG_WAITALL lets the kernel fill the whole buffer in one call (a signal or
    a closed connection can still end it early, hence the loop).
    """
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"closed after {got} of {n} bytes")
        got += k
    return True
