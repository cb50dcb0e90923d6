"""A DDP communication hook that sends buckets over gradlane's transport.

For users who keep ``DistributedDataParallel``::

    state = gl.HookState(ddp_model)          # after init_process_group
    ddp_model.register_comm_hook(state, gl.comm_hook)
    ...
    state.close()
    del ddp_model                            # before destroy_process_group (README)

What it gives: each parameter's gradient goes as soon as backward has it,
not when DDP's bucket is full. DDP puts most of a model in one large bucket
that is ready only when backward ends (on VGG-19, nine tenths of the bytes);
the hook cuts each bucket into runs of parameters (groups, as `attach` cuts
its layers) and, once DDP's buckets have settled (it rebuilds them after its
first step), sends a group from the gradient hooks of its parameters, so the
first layers' bytes cross the network while backward computes the rest. DDP
still waits for every bucket's future, and each bucket's average is in the
bucket when its future completes, so training goes on as DDP's does (every
replica holding the same averages, bit for bit). Each group is cut into
chunks with balanced owners (with a control plane, its plan's, taken by
every rank at one step as `attach` takes them),
ordered by the forward order of its parameters (first used = first sent)
and sent over the DSCP-marked band connections that gradlaned schedules;
when every rank knows its leaf switch (``leaf=``, `ShimConfig.leaf`, or the
control plane's advice through gradlaned), each chunk is reduced within
each leaf switch first, as the shim does. Like `attach`, it registers its
band connections with gradlaned when a daemon socket exists
(`ShimConfig.daemon_socket`) and reports its chunks each step, the exchange
its ranks took and each step's compute (from the forward's start to the last
bucket, with ``samples``), so the daemon gives the job its own class and the
control plane plans its demand and advises batch sizes
(`HookState.advised_batch_size`).
What it cannot give: cross-iteration overlap. DDP's ``backward()`` waits for every bucket and
the optimizer steps the whole model after it, so the next forward never starts
before the last bucket is in; use `gradlane.shim.attach` for that.

This module must not use ``from __future__ import annotations``: DDP checks
the hook's return annotation object (see NOTES.md).
"""

import logging
import os
import threading
import time
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from gradlane.errors import ConfigError
from gradlane.policies.chunks import Routes, group_consecutive, layout_sizes
from gradlane.shim.client import ComputeClock, DaemonClient
from gradlane.shim.config import SampleCount, ShimConfig, refuse_sparse_gradients
from gradlane.shim.engine import OPEN, Engine, Group, close_at_exit, owned_bytes
from gradlane.shim.layout import OWNERS_EVERY, assign_owners, band_of, split
from gradlane.shim.transport import (
    Mesh,
    agree_batch,
    local_address,
    meeting_prefix,
    rank0_says,
    reduction_groups,
)

__all__ = ["HookState", "comm_hook"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Segment:
    """A run of consecutive parameters of one DDP bucket, exchanged as one group."""

    group: Group
    key: str  # the same on every rank: the planned owners' and the group id's
    params: list[torch.Tensor]  # in the bucket's order
    offsets: list[int]  # each parameter's first element in the group
    first: int  # the bucket's index of its first parameter
    given: list[bool] = field(init=False)  # which gradients this step gave it
    left: int = field(init=False)  # how many it has not

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.given = [False] * len(self.params)
        self.left = len(self.params)


@dataclass(eq=False)
class _Bucket:
    """What the hook knows of one of DDP's buckets, and the segments it is cut into."""

    index: int
    params: list[torch.Tensor]
    numel: int
    dtype: torch.dtype
    version: int  # how many buckets the hook had seen before, this one included
    segments: list[_Segment] = field(default_factory=list)
    # DDP's bucket held these parameters at two steps in a row: from then on, a segment
    # goes as soon as its parameters' gradients are in, before DDP calls the hook.
    armed: bool = False

    def same(self, params: list[torch.Tensor], buffer: torch.Tensor) -> bool:
        return (len(params) == len(self.params) and buffer.numel() == self.numel
                and buffer.dtype == self.dtype
                and all(a is b for a, b in zip(params, self.params, strict=True)))


@dataclass(eq=False)
class _Waiter:
    """One bucket DDP waits on: its future and the segments whose averages it needs."""

    future: torch.futures.Future[torch.Tensor]
    index: int  # DDP's bucket index
    buffer: torch.Tensor
    gradients: list[torch.Tensor]  # the bucket's views, one per parameter
    left: int  # segments not yet copied into the bucket


class HookState:
    """The state `comm_hook` needs: connections, the engine, forward order.

    Args:
        model: the DDP-wrapped model (its process group must be initialized;
            its store is used for rendezvous).
        address: the address peers connect to (default: the one that routes
            to MASTER_ADDR), or one per NIC (`gradlane.shim.attach`).
        options: `ShimConfig` fields (chunk_bytes, dscp, timeout_s, job, ...).

    Attributes:
        samples: this worker's sample count for the coming step, if batches
            differ across workers (None: plain mean, as DDP does). Set it every
            step for the control plane to see each worker's throughput.
        chunk_bytes: the size buckets are cut into: `attach`'s fine chunks for
            this model (`gradlane.policies.chunks.layout_sizes`), at most the
            configured `chunk_bytes`.
        early_sends: how many groups went before DDP called the hook for their
            bucket (sent from their parameters' gradient hooks), all steps.
    """

    samples = SampleCount()  # checked as set (the docstring above says what it is)

    def __init__(self, model: nn.Module, *, address: str | Sequence[str] | None = None,
                 **options: Any) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"HookState's model must be the DistributedDataParallel (a "
                              f"torch.nn.Module), got {type(model).__name__}")
        refuse_sparse_gradients(model)
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("HookState needs torch.distributed.init_process_group() first")
        self.config = ShimConfig.of(options)
        # Weakly: DDP holds this state (its comm hook's), and a cycle would keep DDP alive
        # past `destroy_process_group()`, where freeing it may hang (README, "Keeping DDP").
        self._model = weakref.ref(model)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store = store = dist.distributed_c10d._get_default_store()
        self._prefix = meeting_prefix(f"{self.config.job}/ddp", self.rank)
        if address is None:
            address = local_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self.mesh = Mesh(
            self.rank,
            self.world,
            store,
            address,
            self.config.dscp,
            credit_bytes=self.config.credit_bytes,
            sndbuf_bytes=self.config.sndbuf_bytes,
            timeout_s=self.config.timeout_s,
            prefix=self._prefix,
            connect=False,
        )
        self.client = DaemonClient(self.config, self.rank, self.world, self.mesh)
        try:
            # Reduction within hosts first when ranks share some, and within leaves when
            # every rank knows its leaf; connections to the ranks that takes.
            self.leaves, self.hosts = reduction_groups(
                store, self._prefix, self.rank, self.world, self.client.leaf(),
                self.client.host(), self.mesh.address, self.config.exchange)
            routes = Routes.agreed(self.config.exchange, self.world, self.leaves, self.hosts)
            self.mesh.connect(routes.peers(self.rank))
            self.client.flows_changed()
            self.engine = Engine(
                self.mesh, self.config.timeout_s, on_event=self.client.chunk_event,
                routes=routes, plane_rates=self.client.plane_rates(self.mesh.addresses),
            )
        except BaseException:
            self.client.close()
            self.mesh.close()
            raise
        self.client.exchange_agreed(self.engine.kind)
        self.engine.on_failure = self._fail_pending
        self._pending: dict[int, torch.futures.Future[torch.Tensor]] = {}  # by bucket
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="gl-ddp-watchdog", daemon=True)
        self._watchdog.start()
        self._samples: int | None = None
        # The job's samples per step, all ranks, as agreed at the first step (None: a rank
        # did not set `samples`).
        self.global_batch: int | None = None
        self._batch_agreed = False
        self.step = 0
        self._in_step = False
        self._buckets: dict[int, _Bucket] = {}  # by DDP's bucket index
        self._versions = 0  # buckets seen (made anew when DDP rebuilds them)
        # The groups of buckets DDP rebuilt away, until the engine may forget them.
        self._stale: list[Group] = []
        # The parameters of armed buckets: (segment, place in it), by id.
        self._slots: dict[int, tuple[_Segment, int]] = {}
        # By group id: the bucket (and the segment of it) its average goes to.
        self._waiting: dict[int, tuple[_Waiter, _Segment]] = {}
        self._syncing = False  # the last forward was one whose backward DDP synchronizes
        self.early_sends = 0
        # The groups in the order this step made them ready, and the last step's.
        self._ready: list[int] = []
        self._last_ready: list[int] = []
        # The control plan's owners the ranks took, by bucket; groups made since use them.
        self._planned: dict[str, list[int]] = {}
        self._generation = 0  # new groups (new ids) each time the ranks take owners
        # The step the ranks last took the control plan's chunk owners (None: never).
        self.owners_taken_at: int | None = None
        self._order: dict[torch.Tensor, int] = {}
        inner = getattr(model, "module", model)
        assert isinstance(inner, nn.Module)
        # Buckets are cut as `attach` cuts its fine groups (`layout_sizes`): at parameters
        # into groups of at least its least size, and those into chunks of at most a
        # quarter of a rank's share of the model, W-1 times smaller on the ring, whose
        # hops store and forward whole chunks (1 MiB chunks left the last bucket's hops a
        # tail: on the VGG-19 trace on four hosts 23 ms a step behind plain DDP, 13 ms
        # with 256 KiB ones).
        grads = sum(p.numel() * p.element_size() for p in inner.parameters() if p.requires_grad)
        self._least, self.chunk_bytes = layout_sizes(grads, self.world, self.config.chunk_bytes,
                                                     "fine", ring=self.engine.ring)
        self._modules = [m for m in inner.modules() if any(True for _ in m.parameters(False))]
        self._handles: list[Any] = [m.register_forward_pre_hook(self._record)
                                    for m in self._modules]
        self._handles.append(inner.register_forward_pre_hook(self._forward_starts))
        # DDP decides at its forward whether the backward synchronizes (not under no_sync,
        # nor without grad); so does the hook, before DDP's own forward runs.
        self._handles.append(model.register_forward_pre_hook(self._forward_syncs))
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                          for p in inner.parameters() if p.requires_grad]
        # A step's compute: from its (first training) forward's start to its last bucket.
        self._clock = ComputeClock()
        self._t_backward = 0.0  # the last bucket of the step before
        self._t_averaged = 0.0  # its last average in
        self._compute_s: float | None = None  # the step before's, not yet reported
        self._closed = False
        close_at_exit(self)

    def _record(self, module: nn.Module, args: Any) -> None:
        for p in module.parameters(recurse=False):
            self._order.setdefault(p, len(self._order))

    def _forward_syncs(self, module: nn.Module, args: Any) -> None:
        self._syncing = torch.is_grad_enabled() and bool(
            getattr(module, "require_backward_grad_sync", True))

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        # Forwards without grad (evaluation) are not steps; with accumulation
        # (DDP's no_sync) the step starts at the first of its forwards.
        if torch.is_grad_enabled():
            self._clock.forward(module.training, time.perf_counter())

    def _backward_ended(self) -> None:
        now = time.perf_counter()
        elapsed = self._clock.stop(now)
        if elapsed is not None:
            self._t_backward, self._compute_s = now, elapsed

    def _report_timing(self) -> None:
        """Tell gradlaned the step before's compute and how long DDP then waited for averages."""
        if self._compute_s is not None:
            with self._lock:
                waited = max(0.0, self._t_averaged - self._t_backward)
            self.client.timing(self._compute_s, waited)
            self._compute_s = None

    @property
    def advised_batch_size(self) -> int | None:
        """The local batch size the control plane advises (`DaemonClient.advised_batch_size`)."""
        return self.client.advised_batch_size

    def _begin_step(self) -> None:
        """The step's first gradient (or bucket): what the step before left to do."""
        self._report_timing()  # before `begin` moves the client to this step
        if not self._batch_agreed:  # the first step: what the control plane splits
            self._batch_agreed = True
            self.global_batch = agree_batch(self._store, self._prefix, self.rank, self.world,
                                            self.samples)
            if self.global_batch is not None:
                self.client.batch_agreed(self.global_batch)
        if self.world > 1 and self.step and self.step % OWNERS_EVERY == 0:
            self._follow_plan_owners()
        self._retire_stale()
        # Without `samples`, the plain mean; gradlaned is told 0 (not known), so no batch
        # shares are planned from step rates taken for sample rates.
        self.engine.begin(self.step, self.samples if self.samples is not None else 1)
        self.client.begin(self.step, self.samples or 0)  # ships the last step's chunk events
        for bucket in self._buckets.values():
            for segment in bucket.segments:
                segment.restart()
        self._in_step = True

    def _on_grad(self, p: torch.Tensor) -> None:
        """A parameter's gradient is in: into its segment, which goes once it is complete."""
        if not self._syncing or id(p) not in self._slots:
            return
        if not self._in_step:
            self._begin_step()
        slot = self._slots.get(id(p))  # (gone if the ranks just took new owners)
        if slot is not None and not slot[0].given[slot[1]]:
            assert p.grad is not None
            self._fill(*slot, p.grad, early=True)

    def _fill(self, segment: _Segment, i: int, grad: torch.Tensor, early: bool = False) -> None:
        p = segment.params[i]
        offset = segment.offsets[i]
        segment.group.grad[offset : offset + p.numel()].copy_(grad.reshape(-1))
        segment.given[i] = True
        segment.left -= 1
        if segment.left == 0:
            self._ready.append(segment.group.gid)
            self.early_sends += early
            self.engine.ready(segment.group)

    def _segments(self, bucket: GradBucket) -> list[_Segment]:
        """`bucket`'s segments: those of the step before if DDP kept the bucket (armed from
        now on, unless DDP will still rebuild its buckets), else new ones."""
        params, buffer = bucket.parameters(), bucket.buffer()
        known = self._buckets.get(bucket.index())
        if known is not None and known.same(params, buffer):
            if not known.armed and not self._rebuild_pending():
                known.armed = True
                self._arm(known)
            return known.segments
        # New (the first step), or DDP rebuilt its buckets: what held these parameters
        # before goes. If it was armed, its groups that this step's gradients completed
        # are averaged anyway, on every rank alike, and nobody waits for them; the engine
        # forgets its groups once none is under way (`_retire_stale`).
        mine = {id(p) for p in params}
        for index, old in list(self._buckets.items()):
            if index == bucket.index() or any(id(p) in mine for p in old.params):
                for segment in old.segments:
                    for p in segment.params:
                        self._slots.pop(id(p), None)
                    self._stale.append(segment.group)
                del self._buckets[index]
        self._retire_stale()
        self._versions += 1
        new = _Bucket(bucket.index(), list(params), buffer.numel(), buffer.dtype, self._versions)
        self._cut(new)
        self._buckets[new.index] = new
        return new.segments

    def _retire_stale(self) -> None:
        """Let the engine forget the groups of buckets DDP rebuilt away (their gradient and
        average buffers, each a copy of the bucket), once none is under way: those made ready
        in the step DDP rebuilt in are averaged first, on every rank alike."""
        idle: list[Group] = []
        busy: list[Group] = []
        for group in self._stale:  # one look at each: an engine thread may finish one
            (idle if group.done_step == group.step else busy).append(group)
        if idle:
            self.engine.retire(idle)
        self._stale = busy

    def _rebuild_pending(self) -> bool:
        """Whether DDP will rebuild its buckets at a coming forward: it does once, in
        gradient-ready order, unless it looks for unused parameters in a dynamic graph
        (DDP's own attributes; without them, no: a rebuild is then seen, in `_segments`)."""
        ddp = self._model()
        rebuilds = bool(getattr(ddp, "static_graph", False)
                        or not getattr(ddp, "find_unused_parameters", True))
        return rebuilds and not getattr(ddp, "_has_rebuilt_buckets", True)

    def _cut(self, bucket: _Bucket) -> None:
        """Cut `bucket` into segments (and their groups): runs of consecutive parameters of
        one band of at least `attach`'s least group size, chunks of `chunk_bytes`, owners
        balanced over the whole bucket (or the control plan's, taken by the ranks)."""
        size = torch.empty(0, dtype=bucket.dtype).element_size()
        n = max(1, len(self._order))
        orders = [self._order.get(p, len(self._order)) for p in bucket.params]
        bands = [band_of(order, n, self.config.bands) for order in orders]
        runs = group_consecutive([p.numel() * size for p in bucket.params], bands, self._least)
        numels = [sum(bucket.params[i].numel() for i in run) for run in runs]
        ranges = [split(numel, size, self.chunk_bytes) for numel in numels]
        balanced = iter((o + bucket.index) % self.world for o in assign_owners(
            [(b - a) * size for cut in ranges for a, b in cut], self.world))
        bucket.segments = []
        for k, (run, numel, cut) in enumerate(zip(runs, numels, ranges, strict=True)):
            key = f"{bucket.index}.{bucket.version}:{bucket.numel}:{bucket.dtype}/{k}"
            spread = [next(balanced) for _ in cut]
            owners = self._planned.get(key)
            if owners is None or len(owners) != len(cut):
                owners = spread
            gid = zlib.crc32(f"{self._generation}:{key}".encode()) & 0x7FFFFFFF
            group = self.engine.add_group(
                gid, f"bucket {key}", torch.empty(numel, dtype=bucket.dtype), cut, owners,
                priority=min(orders[i] for i in run), band=bands[run[0]],
                on_done=self._segment_done)
            members = [bucket.params[i] for i in run]
            offsets = [sum(p.numel() for p in members[:j]) for j in range(len(members))]
            bucket.segments.append(_Segment(group, key, members, offsets, run[0]))
        if bucket.armed:
            self._arm(bucket)

    def _arm(self, bucket: _Bucket) -> None:
        """From now on, `bucket`'s parameters give their gradients to its segments as soon as
        backward has them (`_on_grad`)."""
        self._slots.update((id(p), (segment, i)) for segment in bucket.segments
                           for i, p in enumerate(segment.params))

    def _by_gid(self) -> dict[int, _Segment]:
        """The segments of DDP's current buckets, by group id."""
        return {s.group.gid: s for bucket in self._buckets.values() for s in bucket.segments}

    @property
    def _groups(self) -> dict[int, Group]:
        return {gid: segment.group for gid, segment in self._by_gid().items()}

    def _segment_done(self, group: Group) -> None:
        """A group's average is in (an engine thread): into its bucket, if DDP asked for it."""
        with self._lock:
            self._t_averaged = time.perf_counter()
            waiting = self._waiting.pop(group.gid, None)
        if waiting is not None:
            self._deliver(*waiting)

    def _deliver(self, waiter: _Waiter, segment: _Segment) -> None:
        """Copy `segment`'s average into the bucket; the bucket's last completes its future."""
        out = segment.group.out
        for i, p in enumerate(segment.params):
            offset = segment.offsets[i]
            waiter.gradients[segment.first + i].view(-1).copy_(out[offset : offset + p.numel()])
        with self._lock:
            waiter.left -= 1
            last = waiter.left == 0
            if last and self._pending.get(waiter.index) is waiter.future:
                del self._pending[waiter.index]
        if last and not waiter.future.done():
            waiter.future.set_result(waiter.buffer)

    def _follow_plan_owners(self) -> None:
        """Take the chunk owners the control plan advises, on every rank at this step
        (as `gradlane.shim.Sync` does; called at the step's first gradient, when DDP
        has every average of the step before).

        The plan's owners are one per chunk gradlaned heard of in the last step,
        by forward order and then the order they were ready; rank 0 maps them
        onto its groups and says, through the store, which owners each group's
        chunks take. Every bucket's groups are made anew, under new ids.
        """
        said = None
        advised = self.client.advised_owners if self.rank == 0 else None
        if advised is not None:
            # As gradlaned orders a step's chunk events: by priority, then as they came.
            by_gid = self._by_gid()
            ordered = sorted((by_gid[gid] for gid in self._last_ready if gid in by_gid),
                             key=lambda segment: segment.group.priority)
            current = [c.owner for segment in ordered for c in segment.group.chunks]
            if len(advised) == len(current) and list(advised) != current:
                said, at = {}, 0
                for segment in ordered:
                    n = len(segment.group.chunks)
                    said[segment.key] = list(advised[at : at + n])
                    at += n
        posted = rank0_says(self._store, f"{self._prefix}/owners/{self.step}", self.rank,
                            said, f"{self._prefix}/owners/{self.step - OWNERS_EVERY}")
        if not isinstance(posted, dict):
            return
        self.engine.drain_before("regrouping", self.config.timeout_s)  # owners' results
        self.engine.retire(list(self._groups.values()))
        self._slots = {}
        self._planned = {str(k): [int(o) for o in v] for k, v in posted.items()}
        self._generation += 1
        for bucket in sorted(self._buckets.values(), key=lambda b: b.index):
            self._cut(bucket)  # the same runs, new groups: the plan's owners
        self.owners_taken_at = self.step
        if self.rank == 0:
            logger.info("gradlane: the control plan's chunk owners from step %d", self.step)

    def owned_bytes(self) -> list[int]:
        """The gradient bytes each rank owns in the last step's groups, by rank."""
        groups = self._groups
        return owned_bytes((groups[gid] for gid in self._last_ready if gid in groups),
                           self.world)

    def _fail_pending(self, error: Exception) -> None:
        """Fail every bucket DDP waits on, so backward() raises instead of hanging."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._waiting.clear()
        for future in pending.values():
            if not future.done():
                future.set_exception(error)  # type: ignore[arg-type]

    def _check_peers(self) -> None:
        """Fail the buckets DDP waits on if a peer their groups need is gone (the engine
        says so at once only when one vanishes before anything waits)."""
        with self._lock:
            groups = [segment.group for _, segment in self._waiting.values()]
        lost = self.engine.error or self.engine.lost(groups)
        if lost is not None:
            self._fail_pending(lost)

    def _watch(self) -> None:
        """Fail what DDP waits on when a peer is gone or silent: as `Engine.wait` does,
        after timeout_s without word it asks the ranks it waits on, and gives up on them
        only if they do not answer (or, having answered, stay silent timeout_s more)."""
        wake, asked = 1.0, None
        while not self._stop.wait(wake):
            wake = 1.0
            if not self._pending:
                asked = None
                continue
            self._check_peers()
            now = time.monotonic()
            idle = now - self.engine.last_rx
            verdict = self.engine.silence(idle, asked, now) if self._pending else "wait"
            if verdict == "wait":
                # Wake when the timeout (or the wait for an answer) runs out, not up to a
                # second after it.
                wake = min(1.0, max(0.01, self.engine.next_look(idle, asked, now)))
                continue
            with self._lock:
                groups = [segment.group for _, segment in self._waiting.values()]
            if verdict == "ask":
                asked = time.monotonic()
                self.engine.ping(self.engine.missing(groups, self.engine.step))
                wake = 0.01
                continue
            # The engine's error names the rank they wait on, as `Engine.wait`'s does.
            self._fail_pending(self.engine.give_up(groups, self.engine.step, idle))
            asked = None

    def close(self) -> None:
        """Stop the watchdog, remove the gradient hooks, send what is queued and close the
        connections (`Engine.close`); at the interpreter's exit if not before."""
        if self._closed:
            return
        self._closed = True
        OPEN.discard(self)
        self._stop.set()
        self._watchdog.join(2.0)
        for handle in self._handles:
            handle.remove()
        self.engine.close(linger_s=min(10.0, self.config.timeout_s))
        self.client.close()


def comm_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket` across workers over gradlane's transport (see the module docstring)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    try:
        if not state._in_step:
            state._begin_step()
        step = state.step
        segments = state._segments(bucket)
        gradients = bucket.gradients()
        # The gradients no hook gave (the bucket's first steps, unused parameters) go from
        # the bucket, as DDP filled it.
        for segment in segments:
            for i, given in enumerate(segment.given):
                if not given:
                    state._fill(segment, i, gradients[segment.first + i])
    except Exception as exc:  # surfaces in backward() as DDP's error
        future.set_exception(exc)  # type: ignore[arg-type]
        return _for_ddp(future)
    finally:
        if bucket.is_last():
            state._backward_ended()
            state._in_step = False
            state._syncing = False
            state.step += 1
            state._last_ready, state._ready = state._ready, []
    waiter = _Waiter(future, bucket.index(), bucket.buffer(), gradients, len(segments))
    with state._lock:  # (the engine marks a group done before `_segment_done` takes it)
        done = [s for s in segments if s.group.done_step >= step]
        for segment in segments:
            if segment not in done:
                state._waiting[segment.group.gid] = (waiter, segment)
        if len(done) < len(segments):
            state._pending[bucket.index()] = future
    for segment in done:  # averaged before DDP asked (sent early)
        state._deliver(waiter, segment)
    if not future.done():
        state._check_peers()  # a peer lost before this bucket was asked for
    return _for_ddp(future)


def _for_ddp(future: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """`future` as DDP's reducer reads it. A Python future's exception is its value, raised
    only by Python's ``value()``: read in C++, DDP said "Unable to cast <the error> to
    Tensor". Through a callback that reads it in Python, the error is the future's own,
    and backward() raises it as "... PeerLost: step N: rank R lost: ...".
    """
    return future.then(lambda done: done.value())
