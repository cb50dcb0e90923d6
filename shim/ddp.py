"""A DDP communication hook that sends buckets over gradlane's transport.

For users who keep ``DistributedDataParallel``::

    state = gl.HookState(ddp_model)          # after init_process_group
    ddp_model.register_comm_hook(state, gl.comm_hook)
    ...
    state.close()
    del ddp_model                            # before destroy_process_group (README)

What it gives: each bucket is cut into chunks with balanced owners (with a
control plane, its plan's, taken by every rank at one step as `attach` takes
them), ordered by
the forward order of its parameters (first used = first sent) and sent over
the DSCP-marked band connections that gradlaned schedules; when every rank
knows its leaf switch (``leaf=``, `ShimConfig.leaf`, or the control plane's
advice through gradlaned), each chunk is reduced within each leaf switch
first, as the shim does. Like `attach`, it registers its band connections
with gradlaned when a daemon socket exists (`ShimConfig.daemon_socket`) and
reports its chunks each step, the exchange its ranks took and each step's
compute (from the forward's start to the last bucket, with ``samples``), so
the daemon gives the job its own class and the control plane plans its
demand and advises batch sizes (`HookState.advised_batch_size`).
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
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]

from gradlane.errors import ConfigError, PeerLost, TransportError
from gradlane.policies.chunks import Routes, layout_sizes
from gradlane.shim.client import DaemonClient
from gradlane.shim.config import ShimConfig
from gradlane.shim.engine import Engine, Group, owned_bytes
from gradlane.shim.layout import OWNERS_EVERY, assign_owners, band_of, split
from gradlane.shim.transport import (
    Mesh,
    agree_batch,
    local_address,
    rank0_says,
    reduction_groups,
)

__all__ = ["HookState", "comm_hook"]

logger = logging.getLogger(__name__)


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
    """

    def __init__(self, model: nn.Module, *, address: str | Sequence[str] | None = None,
                 **options: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("HookState needs torch.distributed.init_process_group() first")
        self.config = ShimConfig.of(options)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store = store = dist.distributed_c10d._get_default_store()
        self._prefix = f"gradlane/{self.config.job}/ddp"
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
            self.mesh.connect(Routes.agreed(self.config.exchange, self.world, self.leaves,
                                            self.hosts).peers(self.rank))
            self.client.flows_changed()
            self.engine = Engine(
                self.mesh, self.config.timeout_s, on_event=self.client.chunk_event,
                leaves=self.leaves, exchange=self.config.exchange, hosts=self.hosts,
                plane_rates=self.client.plane_rates(self.mesh.addresses),
            )
        except BaseException:
            self.client.close()
            self.mesh.close()
            raise
        self.client.exchange_agreed(self.engine.kind)
        self.engine.on_failure = self._fail_pending
        self._pending: dict[int, torch.futures.Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="gl-ddp-watchdog", daemon=True)
        self._watchdog.start()
        self.samples: int | None = None
        # The job's samples per step, all ranks, as agreed at the first step (None: a rank
        # did not set `samples`).
        self.global_batch: int | None = None
        self._batch_agreed = False
        self.step = 0
        self._in_step = False
        self._groups: dict[int, Group] = {}
        self._keys: dict[int, str] = {}  # each group's bucket key: index, size, dtype
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
        # Buckets are cut as `attach` cuts its fine groups (`layout_sizes`): at most a
        # quarter of a rank's share of the model, W-1 times smaller on the ring, whose
        # hops store and forward whole chunks (1 MiB chunks left the last bucket's hops a
        # tail: on the VGG-19 trace on four hosts 23 ms a step behind plain DDP, 13 ms
        # with 256 KiB ones).
        grads = sum(p.numel() * p.element_size() for p in inner.parameters() if p.requires_grad)
        self.chunk_bytes = layout_sizes(grads, self.world, self.config.chunk_bytes, "fine",
                                        ring=self.engine.ring)[1]
        self._modules = [m for m in inner.modules() if any(True for _ in m.parameters(False))]
        self._handles = [m.register_forward_pre_hook(self._record) for m in self._modules]
        self._handles.append(inner.register_forward_pre_hook(self._forward_starts))
        # A step's compute: from its (first training) forward's start to its last bucket.
        self._t_forward: float | None = None
        self._t_backward = 0.0  # the last bucket of the step before
        self._t_averaged = 0.0  # its last average in
        self._compute_s: float | None = None  # the step before's, not yet reported

    def _record(self, module: nn.Module, args: Any) -> None:
        for p in module.parameters(recurse=False):
            self._order.setdefault(p, len(self._order))

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        # Forwards without grad (evaluation) are not steps; with accumulation
        # (DDP's no_sync) the step starts at the first of its forwards.
        if self._t_forward is None and torch.is_grad_enabled():
            self._t_forward = time.perf_counter()

    def _backward_ended(self) -> None:
        if self._t_forward is not None:
            self._t_backward = time.perf_counter()
            self._compute_s, self._t_forward = self._t_backward - self._t_forward, None

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

    def _group(self, bucket: GradBucket) -> Group:
        buffer = bucket.buffer()
        key = f"{bucket.index()}:{buffer.numel()}:{buffer.dtype}"
        gid = zlib.crc32(f"{self._generation}:{key}".encode()) & 0x7FFFFFFF
        group = self._groups.get(gid)
        if group is None:
            order = min(
                (self._order.get(p, len(self._order)) for p in bucket.parameters()), default=0
            )
            ranges = split(buffer.numel(), buffer.element_size(), self.chunk_bytes)
            sizes = [(b - a) * buffer.element_size() for a, b in ranges]
            owners = self._planned.get(key)
            if owners is None or len(owners) != len(ranges):
                owners = [(o + bucket.index()) % self.world
                          for o in assign_owners(sizes, self.world)]
            band = band_of(order, max(1, len(self._order)), self.config.bands)
            group = self.engine.add_group(
                gid,
                f"bucket {key}",
                torch.empty(buffer.numel(), dtype=buffer.dtype),
                ranges,
                owners,
                priority=order,
                band=band,
            )
            self._groups[gid] = group
            self._keys[gid] = key
        return group

    def _follow_plan_owners(self) -> None:
        """Take the chunk owners the control plan advises, on every rank at this step
        (as `gradlane.shim.Sync` does; called as the step's first bucket arrives, when
        DDP has every average of the step before).

        The plan's owners are one per chunk gradlaned heard of in the last step,
        by forward order and then the order they were ready; rank 0 maps them
        onto its buckets and says, through the store, which owners each bucket's
        chunks take. Groups are made anew, under new ids, as buckets arrive.
        """
        said = None
        advised = self.client.advised_owners if self.rank == 0 else None
        if advised is not None:
            # As gradlaned orders a step's chunk events: by priority, then as they came.
            ordered = sorted(self._last_ready, key=lambda gid: self._groups[gid].priority)
            current = [c.owner for gid in ordered for c in self._groups[gid].chunks]
            if len(advised) == len(current) and list(advised) != current:
                said, at = {}, 0
                for gid in ordered:
                    n = len(self._groups[gid].chunks)
                    said[self._keys[gid]] = list(advised[at : at + n])
                    at += n
        posted = rank0_says(self._store, f"{self._prefix}/owners/{self.step}", self.rank,
                            said, f"{self._prefix}/owners/{self.step - OWNERS_EVERY}")
        if not isinstance(posted, dict):
            return
        if not self.engine.drain(self.config.timeout_s):  # an owner's results still queued
            self.engine.raise_error()
            raise TransportError(f"rank {self.rank}: sends did not drain before regrouping")
        self.engine.retire(list(self._groups.values()))
        self._groups, self._keys = {}, {}
        self._planned = {str(k): [int(o) for o in v] for k, v in posted.items()}
        self._generation += 1
        self.owners_taken_at = self.step
        if self.rank == 0:
            logger.info("gradlane: the control plan's chunk owners from step %d", self.step)

    def owned_bytes(self) -> list[int]:
        """The gradient bytes each rank owns in the last step's buckets, by rank."""
        return owned_bytes((self._groups[gid] for gid in self._last_ready if gid in self._groups),
                           self.world)

    def _fail_pending(self, error: Exception) -> None:
        """Fail every bucket DDP waits on, so backward() raises instead of hanging."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)  # type: ignore[arg-type]

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            idle = time.monotonic() - self.engine.last_rx
            if self._pending and idle > self.config.timeout_s:
                waiting = [g.label for gid, g in self._groups.items() if gid in self._pending]
                self._fail_pending(
                    PeerLost(
                        None,
                        self.engine.step,
                        f"nothing received for {idle:.0f} s while waiting for {waiting[:3]}",
                    )
                )

    def close(self) -> None:
        self._stop.set()
        self._watchdog.join(2.0)
        for handle in self._handles:
            handle.remove()
        self.engine.close(linger_s=min(10.0, self.config.timeout_s))
        self.client.close()


def comm_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket` across workers over gradlane's transport (see the module docstring)."""
    if not state._in_step:
        state._report_timing()  # before `begin` moves the client to this step
        if not state._batch_agreed:  # the first step: what the control plane splits
            state._batch_agreed = True
            state.global_batch = agree_batch(state._store, state._prefix, state.rank,
                                             state.world, state.samples)
            if state.global_batch is not None:
                state.client.batch_agreed(state.global_batch)
        if state.world > 1 and state.step and state.step % OWNERS_EVERY == 0:
            state._follow_plan_owners()
        # Without `samples`, the plain mean; gradlaned is told 0 (not known), so no batch
        # shares are planned from step rates taken for sample rates.
        state.engine.begin(state.step, state.samples if state.samples is not None else 1)
        state.client.begin(state.step, state.samples or 0)  # ships the last step's chunk events
        state._in_step = True
    group = state._group(bucket)
    state._ready.append(group.gid)
    group.grad.copy_(bucket.buffer().reshape(-1))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    buffer = bucket.buffer()

    def done(g: Group) -> None:
        with state._lock:
            state._pending.pop(g.gid, None)
            state._t_averaged = time.perf_counter()
        if not future.done():
            future.set_result(g.out.view_as(buffer))

    group.on_done = done
    with state._lock:
        state._pending[group.gid] = future
    if bucket.is_last():
        state._backward_ended()
        state._in_step = False
        state.step += 1
        state._last_ready, state._ready = state._ready, []
    try:
        state.engine.ready(group)
    except Exception as exc:  # surfaces in backward() as DDP's error
        future.set_exception(exc)  # type: ignore[arg-type]
    return future
