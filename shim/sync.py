"""`attach`: layer-wise gradient synchronization with cross-iteration overlap.

What happens to a training loop after ``sync = attach(model, optimizer)``:

1. The first forward pass records the order in which modules run; a module's
   parameters form a *layer* whose priority is that order (first used =
   highest; rank 0's order, which every rank takes). Layers are cut into
   chunks (`layout.split`) with balanced owners (`layout.assign_owners`; the
   control plan's, weighed by link rate, once it advises them:
   `Sync._follow_plan_owners`) and bands by forward order (`layout.band_of`).
2. During backward, a hook per parameter copies its gradient into the layer's
   flat buffer; a complete layer goes to the `Engine` at once, so
   communication starts while backward still runs, highest priority first.
3. ``optimizer.step()`` returns immediately (``overlap=True``). Each layer's
   update runs with the optimizer's own ``step`` restricted to that layer's
   parameters and with the hyperparameters as they were at ``step()`` (so LR
   schedulers keep their exact schedule), as soon as the next forward pass
   reaches the layer: a forward pre-hook waits for that layer's average only.
4. Where a per-layer step would change the math, the step is one whole-model
   step after all averages are in, still received in priority order:
   ``overlap=False``; optimizers not known to be per-parameter (everything in
   torch.optim except LBFGS and SparseAdam is); `clip_grad_norm_` (global
   norm); and closures (LBFGS).

Layers are grouped before chunking (`ShimConfig.layout`): fine groups by
default; after a few steps of warm-up the shim tries coarse groups (about as
few messages as DDP's buckets) and keeps whichever was faster, so a job whose
communication hides behind backward anyway stops paying per-message CPU for
an order that gains nothing.

Gradients are weighted by each worker's sample count (the first dimension of
the model's first tensor input, or keyword if it has none, summed over forwards
with gradients since the last step, those in eval mode only without any in
training mode, or `Sync.samples` set by hand), so unequal batches average
exactly.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import statistics
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import torch
from torch import nn

from gradlane.errors import ConfigError, ModelMismatch, TransportError
from gradlane.policies.chunks import (
    MIN_CHUNK_BYTES,
    TRIAL_BLOCK,
    TRIAL_START,
    Routes,
    group_consecutive,
    layout_sizes,
    trial_schedule,
)
from gradlane.shim.chain import Chain
from gradlane.shim.client import ComputeClock, DaemonClient
from gradlane.shim.config import SampleCount, ShimConfig, refuse_sparse_gradients
from gradlane.shim.engine import OPEN, Engine, Group, close_at_exit, owned_bytes
from gradlane.shim.layout import OWNERS_EVERY, assign_owners, band_of, split
from gradlane.shim.transport import (
    Mesh,
    Store,
    agree_batch,
    gather,
    get_all,
    local_address,
    meeting_prefix,
    rank0_says,
    reduction_groups,
    relay_planes,
    tensor_bytes,
    tree_neighbours,
)

__all__ = [
    "MIN_CHUNK_BYTES",
    "PER_PARAMETER_OPTIMIZERS",
    "TRIAL_BLOCK",
    "TRIAL_P",
    "TRIAL_START",
    "Sync",
    "attach",
    "p_faster",
    "pick_layout",
    "trial_schedule",
]


logger = logging.getLogger(__name__)

# Per parameter, how many of its gradient's elements step() compares with what backward
# left (`Sync._refuse_changed_grads`).
CHECKED_ELEMENTS = 1 << 16


# Coarse replaces fine only when the trial's timings make it faster at this confidence.
TRIAL_P = 0.05


def p_faster(xs: Sequence[float], ys: Sequence[float]) -> float:
    """How likely timings `xs` would look this much faster than `ys` by chance.

    The one-sided exact Mann-Whitney U test: U counts the pairs in which x
    is the slower (ties count half), and the result is the chance of a U at
    most as small were both samples drawn from one distribution. It asks
    only which sample tends to be faster: a step that stalled (on a busy
    machine) counts as one slow timing however long it stalled, and six
    against six are enough to tell a steady few percent from noise.
    """
    u = sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in xs for y in ys)
    n, m = len(xs), len(ys)
    # ways[k]: orderings of n x's and m y's with U = k, built one element at a time
    # (`_u_counts`); the U of a random ordering is what chance alone gives.
    ways = _u_counts(n, m)
    return sum(ways[: int(u) + 1]) / math.comb(n + m, n)


@functools.cache
def _u_counts(n: int, m: int) -> list[int]:
    """Number of orderings of n x's and m y's per U (pairs with x after y), U = 0..n*m."""
    if n == 0 or m == 0:
        return [1]
    # The largest element is an x (after all m y's: U gains m) or a y (U gains nothing).
    counts = [0] * (n * m + 1)
    for k, c in enumerate(_u_counts(n - 1, m)):
        counts[k + m] += c
    for k, c in enumerate(_u_counts(n, m - 1)):
        counts[k] += c
    return counts


def _slowest(posts: list[list[float | None]]) -> list[float]:
    """Per step, the slowest rank's period; steps some rank could not time are left out."""
    return [max(x for x in step if x is not None) for step in zip(*posts, strict=True)
            if None not in step]


def pick_layout(fine: Sequence[float], coarse: Sequence[float]) -> str:
    """The trial's verdict from the job's iterations under each layout.

    Fine is the default: it never costs the overlap, while coarse groups
    start exchanging later and can cost far more than the few per-message
    costs they save. So coarse is kept only when it is faster beyond
    reasonable doubt (`p_faster` below `TRIAL_P`), not on a median that
    noise happened to tip.
    """
    return "coarse" if coarse and fine and p_faster(coarse, fine) < TRIAL_P else "fine"

# torch.optim classes whose update of a parameter reads only that parameter,
# its gradient and its own state: stepping a subset is exactly the same math.
PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "NAdam",
        "RAdam",
        "ASGD",
        "Adafactor",
        "Muon",
    )
    if hasattr(torch.optim, name)
)


# The models and optimizers of open Syncs: a second Sync on one would hook its
# gradients and patch its step twice.
_ATTACHED: weakref.WeakSet[Any] = weakref.WeakSet()


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: Store | None = None,
    address: str | Sequence[str] | None = None,
    **options: Any,
) -> Sync:
    """Synchronize `model`'s gradients across workers and step `optimizer` layer by layer.

    Rank, world size and the rendezvous store follow torchrun: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or an initialized default process
    group's store); a process alone (``rank=0, world_size=1``, say to debug a
    script without torchrun) needs no MASTER_PORT. `address` is the one peers
    connect to (default: the local address that routes to MASTER_ADDR);
    several, one per NIC, spread the chunks over the NICs, bytes evenly (every
    rank gives as many, and its k-th must reach the others' k-th: one switch
    plane per NIC, as rail-optimized clusters have;
    `gradlane.shim.transport.Mesh`). Other keyword arguments are `ShimConfig`
    fields (chunk_bytes, dscp, overlap, timeout_s, job, ...).

    Raises:
        ConfigError: bad options or environment.
        ModelMismatch: workers built different models or passed different options.
        TransportError: rendezvous or connections failed.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"attach's model must be a torch.nn.Module, got "
                          f"{type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"attach's optimizer must be a torch.optim.Optimizer (gl.chain "
                          f"makes one of several), got {type(optimizer).__name__}: build one "
                          "over the model's parameters, e.g. "
                          "torch.optim.AdamW(model.parameters())")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    config = ShimConfig.of(options)
    _refuse_wrapped(model)
    for thing in (model, optimizer):
        if thing in _ATTACHED:
            raise ConfigError(f"this {type(thing).__name__} is attached already: close() its "
                              "Sync (or leave its `with` block) before attaching it again")
    _refuse_attached_parameters(model, optimizer)
    env = os.environ
    try:
        rank = int(env["RANK"] if rank is None else rank)
        world_size = int(env["WORLD_SIZE"] if world_size is None else world_size)
    except KeyError as exc:
        raise ConfigError(f"{exc.args[0]} is not set: run under torchrun, or pass rank= and "
                          "world_size=") from None
    except ValueError as exc:
        raise ConfigError(f"RANK and WORLD_SIZE must be integers: {exc}") from None
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..{world_size - 1}")
    # Open here as this rank (ranks may be threads of one process, as in the tests).
    open_jobs = {s.config.job for s in OPEN if isinstance(s, Sync) and s.rank == rank}
    if "job" not in options:
        config = dataclasses.replace(config, job=_own_job(config.job, open_jobs))
    elif config.job in open_jobs:
        raise ConfigError(f"job {config.job!r} has an open Sync as rank {rank} in this process "
                          "already (another model): give each model a job= of its own")
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if store is None:
        store = _default_store(rank, world_size, master, config.timeout_s)
    if address is None:
        address = local_address(master)
    return Sync(model, optimizer, config, rank, world_size, store, address)


def _refuse_attached_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise `ConfigError` for a parameter an open Sync of this process already averages:
    a model holding an attached one, or a weight shared with one. Its gradient would be
    averaged by both and the parameter stepped by both optimizers."""
    held = [s for s in OPEN if isinstance(s, Sync) and not s._closed]
    if not held:
        return
    named = [*model.named_parameters(),
             *(("a parameter the optimizer holds outside the model", p)
               for p in _outside(model, optimizer))]
    for name, p in named:
        for other in held:
            if p in other._layer_of:
                raise ConfigError(
                    f"{name} is attached already, in the open Sync of a "
                    f"{type(other.model).__name__} (a model inside an attached one, or a "
                    "weight shared with one): each parameter is averaged by one Sync; attach "
                    "the outer model alone, or close() the other first")


def _refuse_ddp_around(layer_of: Mapping[nn.Parameter, object],
                       allowed: weakref.WeakSet[nn.Module]) -> None:
    """Raise `ConfigError` when the running forward is that of a DistributedDataParallel
    (wrapped after attach, which `_refuse_wrapped` cannot see) that averages an attached
    parameter: its gradient would be averaged twice, by DDP and by gradlane. A DDP found
    to average none is added to `allowed`, and not walked again at every forward."""
    # Set by DDP's forward (its C++ reducer's; torch's own, private: read with care).
    active = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if active is None or active in allowed:
        return
    ignored = getattr(active, "parameters_to_ignore", ())
    for name, p in active.module.named_parameters():
        if p.requires_grad and name not in ignored and p in layer_of:
            raise ConfigError(
                f"{name} is attached and also averaged by the DistributedDataParallel "
                "wrapped around its model after attach: each gradient would be averaged "
                "twice. Train the attached model without DDP, or keep DDP with gradlane's "
                "comm hook instead of attach: ddp_model.register_comm_hook("
                "gl.HookState(ddp_model), gl.comm_hook)")
    allowed.add(active)


def _chained(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers `optimizer` steps: those of a `chain`, or itself."""
    return optimizer.optimizers if isinstance(optimizer, Chain) else [optimizer]


# The layer of the parameters the optimizer holds outside the model: updated as the
# model's forward starts (`Sync._place_unseen`), before a loss can use them.
OUTSIDE = "<outside the model>"


def _outside(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters the model does not have, in the optimizer's order."""
    mine = set(model.parameters())
    found = (p for group in optimizer.param_groups for p in group["params"] if p not in mine)
    return list(dict.fromkeys(found))


def _refuse_unsupported(where: str, p: nn.Parameter) -> None:
    if p.is_sparse or p.device.type != "cpu":
        raise ConfigError(f"{where}: only dense CPU parameters are supported")


def _refuse_wrapped(model: nn.Module) -> None:
    """Raise `ConfigError` for a model in a data-parallel wrapper, which would average the
    gradients itself: every gradient sent twice, once outside gradlane's lanes."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: not used (seconds to)
    sharded = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule")
                    if hasattr(fsdp, name))
    for name, module in model.named_modules():
        where = name or "the model"
        if isinstance(module, sharded):
            raise ConfigError(
                f"{where} is sharded by FSDP: gradlane averages whole replicas, one per worker")
        if isinstance(module, (DataParallel, DistributedDataParallel)):
            hint = ("; or keep DDP with gradlane's comm hook: ddp_model.register_comm_hook("
                    "gl.HookState(ddp_model), gl.comm_hook)"
                    if isinstance(module, DistributedDataParallel) else "")
            raise ConfigError(
                f"{where} is a {type(module).__name__}, which averages the gradients itself: "
                f"attach the module it wraps ({name or 'model'}.module){hint}")


def _own_job(job: str, open_jobs: set[str]) -> str:
    """The default `job`, or with ``#2``, ``#3``... the first such name no open Sync of
    this process has: a GAN's generator and discriminator, each attached, are two jobs.
    Every rank attaches and closes its models in the same order (as DDP asks of its
    modules), so every rank names each the same."""
    n = 1
    name = job
    while name in open_jobs:
        n += 1
        name = f"{job}#{n}"
    return name


def _default_store(rank: int, world: int, master: str, timeout_s: float) -> Store:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    text = os.environ.get("MASTER_PORT")
    if text is None:
        if world == 1:  # a process alone meets no one: a store of its own will do
            return dist.HashStore()  # type: ignore[attr-defined]
        raise ConfigError("MASTER_PORT is not set: run under torchrun, or pass store=")
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 1 << 16:
        raise ConfigError(f"MASTER_PORT must be a TCP port 1..65535, got {text}")
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    key = (master, port, hosts)
    if key not in _STORES:
        _STORES[key] = dist.TCPStore(  # type: ignore[attr-defined]
            master, port, world, is_master=hosts, timeout=datetime.timedelta(seconds=timeout_s))
    return _STORES[key]


# The store `_default_store` made in this process, by address, port and whether this
# process hosts it: a job attached again meets there (under new keys, `meeting_prefix`),
# as it would at a process group's. A second server could not bind the port while the
# first lives (the Sync holds it), and the peers' clients would lose the first.
_STORES: dict[tuple[str, int, bool], Store] = {}


@dataclass(eq=False)
class _Layer:
    name: str
    params: list[nn.Parameter]
    order: int = 1 << 30
    groups: list[Group] = field(default_factory=list)
    # (param group index, params) for a per-layer optimizer step
    by_opt_group: list[tuple[int, list[nn.Parameter]]] = field(default_factory=list)
    updated: bool = True


@dataclass(frozen=True)
class _Slot:
    group: Group
    offset: int
    numel: int
    flag: int  # where in the group's buffer this rank says whether it gave a gradient


class Sync:
    """The handle `attach` returns. Use as a context manager or call `close`."""

    # This worker's sample count for the coming step, set by hand to override the one
    # counted from the forward's input (None: counted); a whole number, checked as set.
    samples = SampleCount()

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ShimConfig,
        rank: int,
        world: int,
        store: Store,
        address: str | Sequence[str],
    ) -> None:
        if any(isinstance(opt, torch.optim.SparseAdam) for opt in _chained(optimizer)):
            raise ConfigError("SparseAdam needs sparse gradients; gradlane averages dense ones")
        refuse_sparse_gradients(model)
        self.model, self.optimizer, self.config = model, optimizer, config
        self.rank, self.world = rank, world
        self.step = 0
        self._samples: int | None = None  # `samples`
        # The job's samples per step, all ranks, as agreed at the first backward (None: a
        # rank could not count its samples).
        self.global_batch: int | None = None
        self._batch_agreed = False
        # Seconds training waited for averages since the last backward began
        # (communication not hidden behind compute).
        self.exposed_comm_s = 0.0
        self.last_exposed_comm_s = 0.0
        self._prefix = meeting_prefix(config.job, rank)
        self._store = store  # rank 0 may host it: keep it alive while others rendezvous
        outside = _outside(model, optimizer)
        self._layers = self._find_layers(model, optimizer, outside)
        self._check_same_model(store)
        self.mesh = Mesh(
            rank,
            world,
            store,
            address,
            config.dscp,
            credit_bytes=config.credit_bytes,
            sndbuf_bytes=config.sndbuf_bytes,
            timeout_s=config.timeout_s,
            prefix=self._prefix,
            connect=False,
        )
        client: DaemonClient | None = None
        try:
            self.client = client = DaemonClient(config, rank, world, self.mesh)
            self.leaves, self.hosts = self._agree_groups(store)
            routes = Routes.agreed(config.exchange, world, self.leaves, self.hosts)
            self.mesh.connect(routes.peers(rank))
            self.client.flows_changed()
            self._broadcast_state(routes)
            self.engine = Engine(
                self.mesh,
                config.timeout_s,
                on_event=self.client.chunk_event,
                routes=routes,
                plane_rates=self.client.plane_rates(self.mesh.addresses),
            )
            self.client.exchange_agreed(self.engine.kind)
        except BaseException:
            if client is not None:
                client.close()  # its thread would otherwise retry the daemon until exit
            self.mesh.close()
            raise
        self._by_module: dict[nn.Module, list[_Layer]] = {}  # the layers each gate updates
        self._at_forward_start: list[_Layer] = []  # those no gate updates (`_place_unseen`)
        self._slots: dict[nn.Parameter, _Slot] = {}
        self._averages: dict[nn.Parameter, torch.Tensor] = {}  # views of the groups' output
        self._flags: list[torch.Tensor] = []  # per group, its flags (views of its input)
        self._groups: list[Group] = []
        self._next_gid = 0
        # The layout in use; "auto" starts fine and tries coarse (`_try_layouts`).
        self.layout = "coarse" if config.layout == "coarse" else "fine"
        self._trying = config.layout == "auto"
        # The trial: step -> (when its backward began, this rank's samples in it).
        self._began: dict[int, tuple[float, int]] = {}
        # What the trial measured (each layout's median iteration, the job's slowest rank
        # per step; how likely coarse looked this much faster by chance) and chose.
        self.layout_trial: dict[str, Any] | None = None
        # The control plan's chunk owners the ranks took, and the layout they are for.
        self._planned: tuple[str, tuple[int, ...]] | None = None
        # The step the ranks last took the control plan's chunk owners (None: never).
        self.owners_taken_at: int | None = None
        self._order: list[_Layer] = []
        self._laid_out = False
        self._state = "idle"  # idle -> backward -> reduced -> (step) idle
        self._end_queued = False  # `_end_backward` will run as the backward ends
        self._no_sync = False
        self._seen: set[nn.Parameter] = set()
        # The parameters frozen at attach: each step checks that none was unfrozen since.
        self._frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
        self._frozen += [(f"{OUTSIDE}[{i}]", p) for i, p in enumerate(outside)
                         if not p.requires_grad]
        self._group_sizes = [len(group["params"]) for group in optimizer.param_groups]
        self._members: dict[int, list[nn.Parameter]] = {}
        self._left: dict[int, int] = {}
        # Per mode (the model's `training`), the samples its forwards with gradients took
        # since the last step. Training mode's count if any: a forward in eval mode then is
        # an evaluation that left gradients on. The clock times the step alike.
        self._counted: dict[bool, int] = {}
        self._clock = ComputeClock()
        self._pending: tuple[int, list[dict[str, Any]]] | None = None
        self._clipped = False
        # Elementwise bounds on the averages (`clip_grad_value_`): this step's, and the
        # pending step's, which its layers' updates apply as they run.
        self._clip_value: float | None = None
        self._pending_clip: float | None = None
        self._closed = False
        self.per_parameter = all(isinstance(opt, PER_PARAMETER_OPTIMIZERS)
                                 for opt in _chained(optimizer))
        self.layerwise = config.overlap and self.per_parameter
        if config.overlap and not self.per_parameter:
            logger.warning(
                "gradlane: %s is not known to update parameters independently; "
                "stepping the whole model after all averages arrive",
                type(optimizer).__name__,
            )
        self._hooks: list[Any] = []
        self._gates: list[Any] = []  # the per-module forward hooks (order, then gating)
        self._layer_of = {p: layer for layer in self._layers for p in layer.params}
        self._ddp_allowed: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._quiet_reads = False
        self._told_read = False  # the log said once what a read after the step costs
        self._install_hooks()
        self._patch_optimizer()
        self._patch_model()
        _ATTACHED.update((model, optimizer))
        close_at_exit(self)

    # -- set-up -------------------------------------------------------------

    @staticmethod
    def _find_layers(model: nn.Module, optimizer: torch.optim.Optimizer,
                     outside: list[nn.Parameter]) -> list[_Layer]:
        """Each module's parameters that train, a layer; those of `outside` (the
        optimizer's not in the model: a learned loss weight or temperature) one more,
        `OUTSIDE`."""
        in_optimizer = {p for g in optimizer.param_groups for p in g["params"]}
        layers, owned = [], set()
        for name, module in model.named_modules():
            params = [
                p for p in module.parameters(recurse=False) if p.requires_grad and p not in owned
            ]
            if not params:
                continue
            for p in params:
                if p not in in_optimizer:
                    own = next(n for n, q in module.named_parameters(recurse=False) if q is p)
                    raise ConfigError(
                        f"{name + '.' if name else ''}{own} requires grad but is not in the "
                        "optimizer: gradlane steps every parameter that trains with the one "
                        "optimizer attach is given (add it there, or freeze it)")
                _refuse_unsupported(name, p)
            owned.update(params)
            layers.append(_Layer(name or "<root>", params))
        outside = [p for p in outside if p.requires_grad]
        for p in outside:
            _refuse_unsupported(OUTSIDE, p)
        if outside:
            layers.append(_Layer(OUTSIDE, outside))
        if not layers:
            raise ConfigError("the model has no parameters that require grad")
        for layer in layers:
            for gi, group in enumerate(optimizer.param_groups):
                members = set(group["params"])
                chosen = [p for p in layer.params if p in members]
                if chosen:
                    layer.by_opt_group.append((gi, chosen))
        return layers

    def _describe(self) -> dict[str, Any]:
        params = [
            [layer.name, i, list(p.shape), str(p.dtype)]
            for layer in self._layers
            for i, p in enumerate(layer.params)
        ]
        return {"params": params, "options": self.config.signature(), "world": self.world}

    def _check_same_model(self, store: Store) -> None:
        """Every rank compares itself with rank 0, and every rank learns every verdict.

        Rank 0 may host the store, so it waits until all ranks have read the
        verdicts before it goes on (or raises and exits).
        """
        mine = self._describe()
        key = f"{self._prefix}/model"
        try:
            if self.rank == 0:
                store.set(key, json.dumps(mine))
            reference = json.loads(store.get(key))
            verdict = "ok" if reference == mine else _first_difference(reference, mine, self.rank)
            verdicts = gather(store, key, self.rank, self.world, verdict)
            store.set(f"{key}/read/{self.rank}", "1")
            if self.rank == 0:
                get_all(store, [f"{key}/read/{r}" for r in range(self.world)])
        except RuntimeError as exc:  # torch's DistStoreError: a rank or the store is gone
            raise TransportError(f"rank {self.rank}: rendezvous failed: {exc}") from exc
        for verdict in verdicts:
            if verdict != "ok":
                raise ModelMismatch(verdict)

    def _agree_groups(self, store: Store) -> tuple[tuple[int, ...] | None,
                                                   tuple[int, ...] | None]:
        """The leaves (`DaemonClient.leaf`) and hosts chunks are reduced within first
        (`reduction_groups`; None: no such groups)."""
        leaves, hosts = reduction_groups(store, self._prefix, self.rank, self.world,
                                         self.client.leaf(), self.client.host(),
                                         self.mesh.address, self.config.exchange)
        if (leaves or hosts) and self.rank == 0:
            logger.info("gradlane: reducing within hosts %s, then leaves %s", hosts, leaves)
        return leaves, hosts

    def _broadcast_state(self, routes: Routes) -> None:
        """Copy rank 0's parameters and buffers to every rank along `Routes.copy_parents`
        (band-0 connections), in pieces of a chunk (`relay`: each rank passes each piece
        on once it holds it), spread over the planes when there are several
        (`relay_planes`)."""
        tensors = [
            t for t in self.model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)
        ] + [p for layer in self._layers if layer.name == OUTSIDE for p in layer.params]
        parents = routes.copy_parents()
        source, sinks = tree_neighbours(parents, self.rank)
        with torch.no_grad():
            flats = [t.detach().contiguous() for t in tensors]
            try:
                relay_planes([tensor_bytes(f) for f in flats], self.mesh.tree(parents),
                             self.config.chunk_bytes, self.config.timeout_s)
            except OSError as exc:  # ConnectionError and TimeoutError too
                raise TransportError(
                    f"rank {self.rank}: copying rank 0's model failed (from rank {source}, "
                    f"to ranks {sinks}): {exc}") from exc
            if source >= 0:
                for t, flat in zip(tensors, flats, strict=True):
                    if flat.data_ptr() != t.data_ptr():
                        t.detach().copy_(flat)

    def _patch_optimizer(self) -> None:
        """Route ``optimizer.step()`` through `Sync._step`, and ``optimizer.zero_grad()``
        in its place through `Sync.skip_step`.

        The optimizer's class is swapped for a subclass whose ``step`` is ours,
        so ``isinstance`` still holds and a bound method stays a bound method
        (LR schedulers rebind ``optimizer.step.__func__``). Our ``step`` also
        does the schedulers' bookkeeping, so they do not wrap it again. A copy
        or a pickle of it is of the optimizer's own class.
        """
        optimizer, sync = self.optimizer, self
        base = type(optimizer)

        def step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            if getattr(opt, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step
                raise ConfigError(
                    "torch.amp.GradScaler does not work with gradlane.shim.attach: it unscales "
                    "and checks each worker's own gradients, the shim steps with the averages"
                )
            for stepped in (opt, *_chained(opt)):  # as LR schedulers track (a chain's too)
                stepped._opt_called = True  # type: ignore[attr-defined]
            # A chain's optimizers step layer by layer later without their step hooks
            # (`Chain.step`): those run here, once, as the chain's own do around this.
            later = sync.layerwise and not sync._clipped and closure is None
            chained = _chained(opt) if later and isinstance(opt, Chain) else []
            sync._stepping = True
            try:
                for each in chained:
                    for pre in each._optimizer_step_pre_hooks.values():
                        pre(each, (), {})
                result = sync._step(closure)
                for each in chained:
                    for post in each._optimizer_step_post_hooks.values():
                        post(each, (), {})
            finally:
                sync._stepping = False
            return result

        def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            sync._skip_unstepped()
            base.zero_grad(opt, set_to_none)

        def __reduce_ex__(opt: torch.optim.Optimizer, protocol: Any) -> Any:
            sync._flush_what_can_be("this copy")  # its state holds the step, as state_dict's
            return _reduced_as(opt, base, protocol)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        # The optimizer's step hooks (register_step_pre_hook, ..._post_hook) run around
        # each step() called, once, as without the shim; the per-layer steps are the
        # optimizer's step without them (they ran at each, after the next forward began).
        hooked = torch.optim.Optimizer.profile_hook_step(step)
        hooked.hooked = True  # type: ignore[attr-defined]  # Optimizer wraps it no more
        raw = base.step.__wrapped__ if getattr(base.step, "hooked", False) else base.step  # type: ignore[attr-defined]
        optimizer.__dict__.pop("step", None)  # a scheduler's wrapper from before attach
        # GradScaler.step hands an optimizer that says so `found_inf` instead of unscaling
        # it silently: the way to refuse it (above) rather than step with scaled averages.
        optimizer.__class__ = type(
            base.__name__, (base,),
            {"step": hooked, "zero_grad": zero_grad, "__reduce_ex__": __reduce_ex__,
             "__module__": base.__module__, "_step_supports_amp_scaling": True},
        )
        self._base_class = base
        self._stepping = False  # in a step() of the optimizer attached
        if isinstance(optimizer, Chain):
            self._hooks += [child.register_step_pre_hook(self._refuse_chained_step)
                            for child in optimizer.optimizers]

        def original(*args: Any) -> Any:
            return raw(optimizer, *args)

        self._original_step = original

    def _refuse_chained_step(self, child: torch.optim.Optimizer, *_: Any) -> None:
        """A step pre-hook of each optimizer of an attached chain: its own ``step()`` would
        step its layers with this worker's gradients, outside the chain's averages."""
        if not self._stepping:
            raise ConfigError(
                f"{type(child).__name__}.step() called on an optimizer of the chain attached: "
                "call the chain's step() instead (it steps each of them with the averages)")

    def _patch_model(self) -> None:
        """Swap the model's class for a subclass (``isinstance`` holds) whose
        ``zero_grad()`` in place of the step skips it (`Sync.skip_step`), whose
        parameters are updated as ``parameters()`` or ``named_parameters()`` hands them
        out (not as ``zero_grad()`` or ``requires_grad_()`` walks them), and whose
        copies and pickles are the model without gradlane.

        Code that reads the weights after ``optimizer.step()`` goes through those
        iterators: an average of the weights (``AveragedModel``, an EMA) gets them
        updated, as without the shim. ``copy.deepcopy(model)`` (how those averages
        start) and ``torch.save(model)`` get the model's own class, its parameters
        updated and none of the shim's hooks: those hold this `Sync` (its sockets and
        threads cannot be copied) and, copied, would update a model not attached.
        """
        sync, base = self, type(self.model)

        def quiet(method: Callable[..., Any]) -> Callable[..., Any]:
            """`method`, which walks the parameters but reads no weight: the step it finds
            pending stays so, to overlap the next forward (a GAN's discriminator frozen
            for the generator's step keeps its update for the generator's forward)."""
            def walk(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                previous, sync._quiet_reads = sync._quiet_reads, True
                try:
                    return method(module, *args, **kwargs)
                finally:
                    sync._quiet_reads = previous
            return walk

        zero_grads = quiet(base.zero_grad)

        def zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
            sync._skip_unstepped()
            zero_grads(module, set_to_none)

        # Within a compiled forward (one asking its parameters' dtype), the update runs as
        # plain Python, as the gates do: torch.compile compiled it, once per parameter.
        update = torch.compiler.disable(self._update_before_read)  # type: ignore[no-untyped-call]

        def named_parameters(module: nn.Module, prefix: str = "", recurse: bool = True,
                             remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
            for name, p in base.named_parameters(module, prefix, recurse, remove_duplicate):
                if sync._pending is not None and not sync._quiet_reads:
                    update(p)
                yield name, p

        def __reduce_ex__(module: nn.Module, protocol: Any) -> Any:
            sync._flush_what_can_be("this copy")
            return _reduced_as(sync._plain(module), base, protocol)

        self.model.__class__ = type(
            base.__name__, (base,),
            {"zero_grad": zero_grad, "requires_grad_": quiet(base.requires_grad_),
             "named_parameters": named_parameters, "__reduce_ex__": __reduce_ex__,
             "__module__": base.__module__, "__qualname__": base.__qualname__},
        )
        self._model_class = base

    def _update_before_read(self, p: nn.Parameter) -> None:
        """Apply the pending update of `p`'s layer (and of those whose averages are in);
        `named_parameters` calls it only with a step pending, out of quiet walks."""
        layer = self._layer_of.get(p)
        if layer is not None and not layer.updated:
            if not self._told_read:
                self._told_read = True
                logger.info("gradlane: rank %d: the model's parameters read after "
                            "optimizer.step() get its update first, there: that step's "
                            "overlap with the next forward is lost (to zero gradients, "
                            "model.zero_grad() keeps it)", self.rank)
            self._step_layer(layer)

    def _plain(self, root: nn.Module) -> nn.Module:
        """A shallow copy of `root` (the attached model) and its modules as without
        gradlane: the same parameters, buffers and other hooks, the model's own class."""
        ours = {handle.id for handle in self._hooks + self._gates}
        copies: dict[int, nn.Module] = {}

        def plain(module: nn.Module) -> nn.Module:
            if id(module) in copies:  # a module at two places stays one
                return copies[id(module)]
            cls = self._model_class if module is root else type(module)
            copy = copies[id(module)] = cls.__new__(cls)
            state = dict(module.__dict__)
            for key, value in state.items():
                if isinstance(value, dict) and (key.endswith("hooks") or "_hooks_" in key):
                    state[key] = type(value)(
                        (k, v) for k, v in value.items() if k not in ours)
            state["_modules"] = type(module._modules)(
                (name, None if m is None else plain(m)) for name, m in module._modules.items())
            copy.__dict__.update(state)
            return copy

        return plain(root)

    def _install_hooks(self) -> None:
        # Under torch.compile the forward hooks run as plain Python, not traced (they
        # wait, time and step the optimizer): each breaks the graph, as a gate must.
        before_module = torch.compiler.disable(self._before_module)  # type: ignore[no-untyped-call]
        for name, module in self.model.named_modules():
            layers = []
            for p in module.parameters(recurse=False):
                for layer in self._layers:
                    if any(p is q for q in layer.params) and layer not in layers:
                        layers.append(layer)
            if layers:
                self._by_module[module] = layers
                self._gates.append(module.register_forward_pre_hook(before_module))
            del name
        before_forward = torch.compiler.disable(self._before_forward)  # type: ignore[no-untyped-call]
        self._hooks.append(self.model.register_forward_pre_hook(before_forward, with_kwargs=True))
        # A checkpoint saved or loaded right after ``optimizer.step()`` sees the step's
        # update, as without the shim: the pending one is applied first.
        self._hooks += [
            self.model.register_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                self._before_state_dict),
            self.model.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                self._before_state_dict),
            self.optimizer.register_state_dict_pre_hook(self._before_state_dict),
            self.optimizer.register_load_state_dict_pre_hook(self._before_state_dict),
        ]
        for layer in self._layers:
            for p in layer.params:
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                )

    def _lay_out(self) -> None:
        """Freeze priorities, groups, chunks and owners (at the first backward)."""
        rest = [layer for layer in self._layers if layer not in self._order]
        if not self._laid_out:
            order = self._agree_order(self._place_unseen(self._order, rest))
        else:
            order = self._order + rest
        for i, layer in enumerate(order):
            layer.order = i
        model = sum(p.numel() * p.element_size() for layer in self._layers for p in layer.params)
        least, chunk_bytes = layout_sizes(
            model, self.world, self.config.chunk_bytes, self.layout, ring=self.engine.ring
        )
        specs = self._group_specs(order, least)
        # Each group's buffer: its parameters' gradients, then one flag per parameter
        # (1: this rank gave it a gradient this step). Averaged like the gradients, a flag
        # is 0 only where no rank did: the optimizer then skips the parameter, as plain
        # PyTorch and DDP do. They ride in the group's last chunk (`split`'s tail): cut
        # as if they were not there, a group keeps its chunks and their owners.
        ranges_of = [
            split(numel, torch.empty(0, dtype=dtype).element_size(), chunk_bytes, len(params))
            for _, dtype, params, numel, _ in specs
        ]
        sizes = [
            (stop - start) * torch.empty(0, dtype=dtype).element_size()
            for (_, dtype, _, _, _), ranges in zip(specs, ranges_of, strict=True)
            for start, stop in ranges
        ]
        planned = self._planned
        if planned is not None and planned[0] == self.layout and len(planned[1]) == len(sizes):
            owners = iter(planned[1])
        else:
            owners = iter(assign_owners(sizes, self.world))
        for gid, ((layers, dtype, params, numel, band), ranges) in enumerate(
            zip(specs, ranges_of, strict=True), start=self._next_gid
        ):
            first, last = layers[0], layers[-1]
            name = first.name if first is last else f"{first.name}..{last.name}"
            group = self.engine.add_group(
                gid,
                f"{name}[{str(dtype).removeprefix('torch.')}]",
                torch.zeros(numel + len(params), dtype=dtype),
                ranges,
                [next(owners) for _ in ranges],
                priority=first.order,
                band=band,
            )
            offset = 0
            for i, p in enumerate(params):
                self._slots[p] = _Slot(group, offset, p.numel(), numel + i)
                self._averages[p] = group.out[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self._flags.append(group.grad[numel:])
            for layer in layers:
                layer.groups.append(group)
            self._groups.append(group)
            self._members[gid] = params
        self._order = order
        self._next_gid += len(specs)
        self._laid_out = True
        if not self.layerwise:  # the order is known and nothing will gate: a compiled
            self._remove_gates()  # model's forward then runs as one graph again

    def _place_unseen(self, seen: list[_Layer], unseen: list[_Layer]) -> list[_Layer]:
        """The forward order, with the layers whose modules the first forward did not run.

        A layer's parameters can be used without its module running:
        ``nn.MultiheadAttention`` hands ``out_proj``'s to
        ``F.multi_head_attention_forward`` and never calls ``out_proj``. Its own gate
        never opens, so its update must come from another: each such layer goes right
        after the nearest module around it whose gate opened (its parameters are used
        inside that module's forward), and that gate updates it too. One with no such
        module (used by the model's own forward, or not at all) is updated as the
        model's forward starts, and goes first. A layer that did not run because its
        branch was not taken is placed the same way: updated early, never late.
        """
        modules = dict(self.model.named_modules())
        opened = {m for m, layers in self._by_module.items() if any(x in seen for x in layers)}
        order, first = list(seen), []
        for layer in unseen:
            path = [] if layer.name == "<root>" else layer.name.split(".")
            around = (modules.get(".".join(path[:k])) for k in range(len(path) - 1, -1, -1))
            host = next((m for m in around if m in opened), None)
            if host is None:
                first.append(layer)
                self._at_forward_start.append(layer)
                continue
            gated = self._by_module[host]
            at = max(order.index(x) for x in gated if x in order) + 1
            gated.append(layer)
            order.insert(at, layer)
        if unseen:
            logger.info("gradlane: %d layers' modules did not run in the first forward; %d "
                        "are updated by a module around them, %d as the forward starts",
                        len(unseen), len(unseen) - len(first), len(first))
        return first + order

    def _remove_gates(self) -> None:
        for hook in self._gates:
            hook.remove()
        self._gates.clear()

    def _agree_order(self, order: list[_Layer]) -> list[_Layer]:
        """Rank 0's forward order, which every rank lays out by.

        Ranks whose first forward ran different modules (data-dependent
        branches, experts) saw different orders; laid out by their own, they
        would cut and own different chunks.
        """
        key = f"{self._prefix}/order"
        try:
            if self.rank == 0:  # layers compare by identity
                self._store.set(key, json.dumps([self._layers.index(x) for x in order]))
            agreed = [self._layers[i] for i in json.loads(self._store.get(key))]
        except RuntimeError as exc:  # torch's DistStoreError: a rank or the store is gone
            raise TransportError(f"rank {self.rank}: rendezvous failed: {exc}") from exc
        if agreed != order:
            logger.info("gradlane: rank %d laid out by rank 0's forward order, not its own",
                        self.rank)
        return agreed

    def _relayout(self, layout: str) -> None:
        """Regroup every gradient as `layout` says, between two steps.

        Called once this worker has every average of the previous step. Its
        queued sends go out first: a peer must read them before any message
        for the new groups, which it may not have made yet (the engine holds
        such a message until the group exists; TCP keeps each connection's
        order). New groups get new ids on every rank alike.
        """
        self._drain("regrouping")
        self.engine.retire(self._groups)
        for layer in self._layers:
            layer.groups = []
        self._slots.clear()
        self._averages.clear()
        self._flags.clear()
        self._groups, self._members = [], {}
        self.layout = layout
        self._lay_out()
        if self.rank == 0:
            logger.info("gradlane: %s layout from step %d: %d groups", layout, self.step,
                        len(self._groups))

    def _follow_plan_owners(self) -> None:
        """Take the chunk owners the control plan advises, on every rank at this step.

        The `loadbalance` policy weighs owners by link rate, for the exchange
        the ranks agreed (a slow link owns less on the flat exchange, more on
        the ring). Owners must be the same on every rank,
        and plans reach the hosts at different times, so rank 0 says which:
        the owners its daemon passed on, when they cover this layout's chunks
        (one per chunk reported, in priority order) and differ from the ones
        in use; else none, and nothing changes. A plan that expires leaves
        the owners taken. The regrouping costs one step's overlap.
        """
        said = None
        if self.rank == 0:
            advised = self.client.advised_owners
            current = tuple(chunk.owner for group in self._groups for chunk in group.chunks)
            if advised is not None and len(advised) == len(current) and advised != current:
                said = list(advised)
        # Every rank read the last check's key: each gave its gradients of a later step.
        posted = rank0_says(self._store, f"{self._prefix}/owners/{self.step}", self.rank, said,
                            f"{self._prefix}/owners/{self.step - OWNERS_EVERY}")
        if not isinstance(posted, list):
            return
        self._planned = (self.layout, tuple(int(o) for o in posted))
        self.owners_taken_at = self.step
        if self.rank == 0:
            logger.info("gradlane: the control plan's chunk owners from step %d", self.step)
        self._relayout(self.layout)

    def owned_bytes(self) -> list[int]:
        """The gradient bytes each rank owns (reduces and sends back), by rank."""
        return owned_bytes(self._groups, self.world)

    def _try_layouts(self, samples: int) -> None:
        """`ShimConfig.layout` "auto": measure fine and coarse groups, keep the faster.

        An iteration is the time between two backward passes' starts. The
        blocks run fine, coarse, coarse, fine (`trial_schedule`), so a load
        that drifts steadily weighs on both alike; the steps that pay a
        regrouping are not measured. The ranks post their timings, and each
        step counts as long as its slowest rank's (the job waits for it);
        `pick_layout` decides. If a rank's batch changed meanwhile
        (the control plane's batch shares arrived), the two timings measured
        different work: fine stays. The trial does not start over: while a
        control plane is still balancing batches, regrouping again would
        disturb the throughput it balances by.
        """
        now = self.step
        self._began[now] = (time.perf_counter(), samples)
        fine1, to_coarse, coarse, to_fine, fine2, decide = trial_schedule()
        if now == to_coarse:
            self._relayout("coarse")
        elif now == to_fine:
            self._relayout("fine")
        if now < decide:
            return

        def periods(steps: list[int]) -> list[float | None]:
            return [self._began[s + 1][0] - self._began[s][0]
                    if s in self._began and s + 1 in self._began else None for s in steps]

        batches = {self._began[s][1] for s in range(fine1.start, decide + 1) if s in self._began}
        mine = (periods([*fine1, *fine2]), periods(list(coarse)), len(batches) == 1)
        self._trying = False
        posts = [json.loads(p) for p in gather(self._store, f"{self._prefix}/layout-trial",
                                                self.rank, self.world, json.dumps(mine))]
        # Each step took as long as its slowest rank's: the job waits for it.
        fine_t, coarse_t = (_slowest([p[i] for p in posts]) for i in (0, 1))
        steady = all(p[2] for p in posts)
        chosen = pick_layout(fine_t, coarse_t) if steady else "fine"
        self.layout_trial = {
            "fine_s": statistics.median(fine_t) if fine_t else None,
            "coarse_s": statistics.median(coarse_t) if coarse_t else None,
            "p_coarse_faster": p_faster(coarse_t, fine_t) if fine_t and coarse_t else None,
            "chosen": chosen, "step": now, "steady": steady,
        }
        if self.rank == 0:
            logger.info("gradlane: layout trial: %s (%s)", chosen, self.layout_trial)
        if chosen != self.layout:
            self._relayout(chosen)

    def _group_specs(
        self, order: list[_Layer], least: int
    ) -> list[tuple[list[_Layer], torch.dtype, list[nn.Parameter], int, int]]:
        """(layers, dtype, params, elements, band) of each group, in priority order.

        Per dtype, consecutive layers of one band share a group until it
        holds `least` bytes (`gradlane.policies.chunks.group_consecutive`).
        """
        # Per dtype, its layers in forward order: (layer, its params of the dtype, bytes, band).
        per_dtype: dict[torch.dtype, list[tuple[_Layer, list[nn.Parameter], int, int]]] = {}
        for layer in order:
            band = band_of(layer.order, len(order), self.config.bands)
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in layer.params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, params in by_dtype.items():
                size = sum(p.numel() for p in params) * params[0].element_size()
                per_dtype.setdefault(dtype, []).append((layer, params, size, band))
        specs = []
        for dtype, items in per_dtype.items():
            for group in group_consecutive([i[2] for i in items], [i[3] for i in items], least):
                members = [items[k] for k in group]
                params = [p for _, ps, _, _ in members for p in ps]
                specs.append(([m[0] for m in members], dtype, params,
                              sum(p.numel() for p in params), members[0][3]))
        specs.sort(key=lambda spec: spec[0][0].order)
        return specs

    # -- hooks ----------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
        """The model's forward starts: count its samples, start the step's compute timer,
        and update the layers no gate of their own updates (`_place_unseen`). A forward
        without gradients (an evaluation between steps) neither counts nor times, nor does
        one in eval mode when the step has one in training mode (an evaluation that left
        gradients on, which would weigh this rank's gradients by its samples): what the
        averages weigh and what gradlaned and the control plane learn is training's."""
        if self._pending is not None:
            for layer in self._at_forward_start:
                if not layer.updated:
                    self._step_layer(layer)
        if torch.is_grad_enabled():
            _refuse_ddp_around(self._layer_of, self._ddp_allowed)
            mode = module.training
            self._clock.forward(mode, time.perf_counter())
            for a in (*args, *kwargs.values()):  # model(input_ids=...) passes only keywords
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    self._counted[mode] = self._counted.get(mode, 0) + a.shape[0]
                    break

    def _before_state_dict(self, *_: Any) -> None:
        """Hook of the model's and optimizer's ``state_dict`` and ``load_state_dict``."""
        self._flush_what_can_be("this state")

    def _flush_what_can_be(self, where: str) -> None:
        """`flush`, as far as the averages can still come: with a peer they need gone,
        the layers whose averages are in are updated, and the log says how many lack
        the step in `where`. (A peer that left after sending them takes nothing.)"""
        if self._pending is None:
            return
        step = self._pending_step()
        try:
            self.flush()
        except TransportError as exc:
            behind = sum(not layer.updated for layer in self._layers)
            logger.warning("gradlane: rank %d: %d of %d layers lack step %d's update in %s: %s",
                           self.rank, behind, len(self._layers), step, where, exc)

    def _before_module(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        layers = self._by_module.get(module)
        if layers is None:  # a copy of one of the model's modules (copy.deepcopy)
            return
        if not self._laid_out:
            for layer in layers:
                if layer not in self._order:
                    self._order.append(layer)
        if self._pending is not None:
            for layer in layers:
                if not layer.updated:
                    self._step_layer(layer)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._no_sync:
            return
        if self._state == "backward" and p in self._seen and not self._end_queued:
            self._end_backward()  # the last backward ran all inside reentrant ones
        if self._state != "backward":
            self._begin_backward()
        if not self._end_queued:
            self._queue_end()
        assert isinstance(p, nn.Parameter) and p.grad is not None
        slot = self._slots[p]
        slot.group.grad[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
        self._seen.add(p)
        self._left[slot.group.gid] -= 1
        if self._left[slot.group.gid] == 0:
            self.engine.ready(slot.group)

    def _begin_backward(self) -> None:
        if self._closed:
            raise TransportError("backward() after sync.close()")
        if self._state == "reduced":
            raise ConfigError(
                "backward() reached this model twice without its optimizer.step(): to "
                "accumulate, wrap the backward passes before the last in sync.no_sync(); if "
                "another model's loss reaches it (a GAN's generator step), freeze it for that "
                "backward (requires_grad_(False)); to skip a step, optimizer.zero_grad() or "
                "sync.skip_step() in its place"
            )
        self._refuse_unfrozen()
        if not self._laid_out:
            self._lay_out()
        self.flush()
        counted = self._counted.get(True) or self._counted.get(False, 0)  # 0: not counted
        known = self.samples if self.samples is not None else counted
        samples = self.samples if self.samples is not None else (counted or 1)
        if not self._batch_agreed:  # the first step: what the control plane splits
            self._batch_agreed = True
            self.global_batch = agree_batch(self._store, self._prefix, self.rank, self.world,
                                            known)
            if self.global_batch is not None:
                self.client.batch_agreed(self.global_batch)
        if self._trying:
            self._try_layouts(samples)
        elif self.world > 1 and self.step and self.step % OWNERS_EVERY == 0:
            self._follow_plan_owners()
        self._counted, self._samples = {}, None
        self.engine.begin(self.step, samples)
        self.client.begin(self.step, known)  # 0: gradlaned is told the count is not known
        self._seen = set()
        for flags in self._flags:  # the last step's averages are all in (flush)
            flags.fill_(1)
        self._left = {gid: len(members) for gid, members in self._members.items()}
        self._clipped = False
        self._state = "backward"
        self._end_queued = False

    def _queue_end(self) -> None:
        """Have `_end_backward` run as this backward ends, if this gradient came in the
        outermost backward: ``torch.utils.checkpoint(use_reentrant=True)`` runs a
        backward inside it per segment, whose end is not this backward's (ended there,
        the layers still to come were sent as unused). A backward whose gradients all
        come inside those ends at the step, a skip, a clip or the next backward
        (`_reduced`)."""
        if _backward_depth() <= 1:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._end_queued = True

    def _reduced(self) -> bool:
        """Whether a backward's gradients are all with the engine (ending one `_queue_end`
        could not)."""
        if self._state == "backward" and not self._end_queued:
            self._end_backward()
        return self._state == "reduced"

    def _refuse_unfrozen(self) -> None:
        """Raise `ConfigError` if a parameter frozen at `attach` trains now, or the
        optimizer's parameter groups changed (``add_param_group``): no hook takes such a
        parameter's gradient, so it would be neither averaged nor, stepping layer by
        layer, applied, and the ranks would part silently. (Walking the whole model each
        step to find parameters added to it costs about 0.4 ms for a BERT-base here; one
        the optimizer does not have does not train.)"""
        again = "sync.close() and attach again"
        new = [name for name, p in self._frozen if p.requires_grad]
        if new:
            more = f" and {len(new) - 3} more" if len(new) > 3 else ""
            raise ConfigError(
                f"{', '.join(new[:3])}{more} require grad now but did not when "
                "gradlane.shim.attach ran, so gradlane would not average their gradients: "
                f"after changing which parameters train, {again}")
        sizes = [len(group["params"]) for group in self.optimizer.param_groups]
        if sizes != self._group_sizes:
            raise ConfigError(
                f"the optimizer's parameter groups hold {sizes} parameters, "
                f"{self._group_sizes} when gradlane.shim.attach ran (add_param_group?): "
                "gradlane would not average the gradients of parameters added since; "
                f"after changing what the optimizer trains, {again}")

    def _end_backward(self) -> None:
        """After the last gradient, the parameters this backward did not reach: a
        gradient they hold (from backwards under `no_sync`, or zeros that
        ``zero_grad(set_to_none=False)`` left) goes as it is, as the optimizer would
        see it in one process; none counts as zero, flagged unused (`_lay_out`)."""
        for group in self._groups:
            if group.step == self.step:
                continue
            for p in self._members[group.gid]:
                if p not in self._seen:
                    slot = self._slots[p]
                    part = slot.group.grad[slot.offset : slot.offset + slot.numel]
                    if p.grad is not None:
                        part.copy_(p.grad.reshape(-1))
                    else:
                        part.zero_()
                        slot.group.grad[slot.flag] = 0
                    self._seen.add(p)
            self.engine.ready(group)
        self._state = "reduced"
        elapsed = self._clock.stop(time.perf_counter())
        if elapsed is not None:
            self.client.timing(elapsed - self.exposed_comm_s, self.exposed_comm_s)
        self.last_exposed_comm_s, self.exposed_comm_s = self.exposed_comm_s, 0.0

    # -- stepping ----------------------------------------------------------

    def _hyper(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            return self._step_with_closure(closure)
        if not self._reduced():
            raise ConfigError("optimizer.step() without a synchronized backward() before it")
        self._refuse_changed_grads()
        if self.layerwise and not self._clipped:
            self._pending = (self.step, self._hyper())
            self._pending_clip = self._clip_value
            for layer in self._layers:
                layer.updated = False
            result = None
        else:
            with self._averaged_grads():
                # torch.optim's optimizers never write their gradients; others might.
                if not self.per_parameter:
                    self._drain("stepping")
                result = self._original_step()
        self._finish_step()
        return result

    def _refuse_changed_grads(self) -> None:
        """Raise `ConfigError` if a layer's local gradients changed after backward took
        them (``torch.nn.utils.clip_grad_norm_`` where DDP users clip): the averages are of
        what backward left, so the change would be lost without a word. One layer a step,
        in turn, and `CHECKED_ELEMENTS` of each of its parameters, the next ones each time
        the layer's turn comes round (the whole model would be one more pass over all
        gradients, an embedding's alone tens of ms here). A clip of the norm scales every
        element, so it is found in one round of the layers; one of values, changing a few,
        within as many rounds as the largest parameter has such windows."""
        turn, at = divmod(self.step, len(self._layers))
        layer = self._layers[at]
        for p in layer.params:
            if p.grad is None or p not in self._seen:
                continue
            slot = self._slots[p]
            windows = -(-slot.numel // CHECKED_ELEMENTS)
            start = turn % windows * CHECKED_ELEMENTS
            stop = min(slot.numel, start + CHECKED_ELEMENTS)
            took = slot.group.grad[slot.offset + start : slot.offset + stop]
            now = p.grad.reshape(-1)[start:stop]
            # Bit for bit: a NaN gradient equals itself.
            if not torch.equal(now.view(torch.uint8), took.view(torch.uint8)):
                raise ConfigError(
                    f"rank {self.rank}: the gradients of layer {layer.name!r} changed between "
                    "backward() and optimizer.step() (torch.nn.utils.clip_grad_norm_?); "
                    "gradlane averages them as backward() left them, so the change would "
                    "be lost: clip with sync.clip_grad_norm_ or sync.clip_grad_value_")

    def _drain(self, before: str) -> None:
        """Wait until this rank's queued sends have left.

        An average counts as in when it is computed, but an owner's result or a
        ring hop's forward may still be queued for a peer: anything that changes
        averages in place (clipping, an optimizer outside torch.optim, whose
        step may write its gradients) must wait, or the peer gets other bytes.
        """
        self.engine.drain_before(before, self.config.timeout_s)

    def _finish_step(self) -> None:
        self._state = "idle"
        self._clip_value = None
        self.step += 1

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        """Whole-model step for optimizers that re-evaluate the loss (LBFGS)."""
        self.flush()

        def synchronized() -> Any:
            loss = closure()
            if self._reduced():
                self.engine.wait(self._groups)
                for p in self._averages:
                    p.grad = self._average_or_none(p, self._clip_value)
                self._finish_step()
            return loss

        return self._original_step(synchronized)

    @contextlib.contextmanager
    def _averaged_grads(self, layers: list[_Layer] | None = None) -> Iterator[None]:
        """Temporarily put the averaged gradients in ``p.grad``; the local ones come back.

        `layers` None: every layer, for the current step. Otherwise those
        layers, for the step whose update is pending.
        """
        if layers is None:
            layers, step, clip = self._layers, self.step, self._clip_value
        else:
            step, clip = self._pending_step(), self._pending_clip
        self._wait_for_averages(layers, step)
        chosen = [p for layer in layers for p in layer.params]
        saved = [p.grad for p in chosen]
        try:
            for p in chosen:
                p.grad = self._average_or_none(p, clip)
            yield
        finally:
            for p, grad in zip(chosen, saved, strict=True):
                p.grad = grad

    def _wait_for_averages(self, layers: list[_Layer], step: int) -> None:
        """Until `layers`' averages of `step` are in, counted as communication not hidden."""
        waited = time.perf_counter()
        self.engine.wait([g for layer in layers for g in layer.groups], step)
        self.exposed_comm_s += time.perf_counter() - waited

    def _average_or_none(self, p: nn.Parameter, clip: float | None = None
                         ) -> torch.Tensor | None:
        """`p`'s averaged gradient, bounded by `clip` (`_bounded`); None if no rank gave it
        one (optimizers skip it)."""
        slot = self._slots[p]  # its averaged flag: the share of samples whose rank gave one
        if not bool(slot.group.out[slot.flag]):
            return None
        return _bounded(self._averages[p], clip)

    def _pending_step(self) -> int:
        assert self._pending is not None
        return self._pending[0]

    def _step_layer(self, layer: _Layer) -> None:
        """Update `layer`, and with it every later layer whose average is already in.

        One optimizer call for all of them: its fixed cost is paid once.
        """
        assert self._pending is not None
        step, hyper = self._pending
        layers = [layer] + [
            x
            for x in self._order
            if x is not layer and not x.updated and all(g.done_step >= step for g in x.groups)
        ]
        params_by_group: dict[int, list[nn.Parameter]] = {}
        for x in layers:
            for gi, params in x.by_opt_group:
                params_by_group.setdefault(gi, []).extend(params)
        saved_groups = self.optimizer.param_groups
        with self._averaged_grads(layers):
            self.optimizer.param_groups = [
                {**hyper[gi], "params": params} for gi, params in sorted(params_by_group.items())
            ]
            try:
                self._original_step()
            finally:
                self.optimizer.param_groups = saved_groups
        for x in layers:
            x.updated = True
        if all(x.updated for x in self._layers):
            self._pending = None

    # -- public --------------------------------------------------------------

    @property
    def advised_batch_size(self) -> int | None:
        """The local batch size the control plane advises (`DaemonClient.advised_batch_size`)."""
        return self.client.advised_batch_size

    def flush(self) -> None:
        """Apply every pending per-layer update now (before reading the parameters;
        the model's and the optimizer's ``state_dict`` and ``load_state_dict`` do it)."""
        if self._pending is None:
            return
        for layer in self._order or self._layers:
            if not layer.updated:
                self._step_layer(layer)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next one outside synchronizes."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def skip_step(self) -> None:
        """Drop this step's update, in place of ``optimizer.step()`` (which
        ``optimizer.zero_grad()`` there does by itself, as under DDP): a step whose
        gradient norm is not finite, as `clip_grad_norm_` returns it alike on every rank.
        Waits for this step's averages, whose buffers the next backward fills; the
        parameters and the optimizer's state stay as they are."""
        if not self._reduced():
            raise ConfigError("skip_step belongs between backward() and optimizer.step()")
        self._wait_for_averages(self._layers, self.step)
        self._finish_step()

    def _skip_unstepped(self) -> None:
        """Gradients zeroed between backward and step: the step is skipped, as under DDP."""
        if self._reduced():
            self.skip_step()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the *averaged* gradients by their global norm; returns that norm.

        Call it between ``backward()`` and ``optimizer.step()`` instead of
        ``torch.nn.utils.clip_grad_norm_`` (which would see only local
        gradients). It waits for every average, so this step is a whole-model
        step: the overlap is lost for this iteration, the priority order is not.
        """
        if not self._reduced():
            raise ConfigError("clip_grad_norm_ belongs between backward() and optimizer.step()")
        self._clipped = True
        value, self._clip_value = self._clip_value, None  # a clip of values before, first
        with self._averaged_grads():  # clips the averages in place, where step() reads them
            self._drain("clipping")  # it changes the averages in place
            if value is not None:
                torch.nn.utils.clip_grad_value_(list(self._averages), value)
            return torch.nn.utils.clip_grad_norm_(list(self._averages), max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip the *averaged* gradients elementwise to [-clip_value, clip_value].

        Call it between ``backward()`` and ``optimizer.step()`` instead of
        ``torch.nn.utils.clip_grad_value_`` (which would see only local gradients).
        Element by element, it needs no other layer's average: each layer's is
        clipped as its update runs, and the step stays layer by layer. (After
        `clip_grad_norm_` in the same step, the averages are clipped at once.)
        """
        if not self._reduced():
            raise ConfigError("clip_grad_value_ belongs between backward() and optimizer.step()")
        value = float(clip_value)
        if not value >= 0:
            raise ConfigError(f"clip_value must be >= 0, got {clip_value}")
        if self._clipped:  # every average is in, and sent on (`clip_grad_norm_`)
            with self._averaged_grads():
                torch.nn.utils.clip_grad_value_(list(self._averages), value)
        else:
            held = self._clip_value
            self._clip_value = value if held is None else min(value, held)

    def averaged_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The averaged gradient of `p` for the current step (waits for it), clipped as
        the step will take it."""
        self.engine.wait([self._slots[p].group])
        return _bounded(self._averages[p], self._clip_value)

    def close(self, flush: bool = True) -> None:
        """Apply pending updates, finish sending, close connections, remove hooks.

        With ``flush=False`` (used when an exception leaves the ``with`` block)
        pending updates are dropped and the connections close at once; so are
        those whose averages a peer gone would have had to send (the log says
        how many layers lack the step). A peer that closed after sending them
        (it ended first) takes nothing.
        """
        if self._closed:
            return
        self._closed = True
        OPEN.discard(self)
        try:
            if flush:
                self._flush_what_can_be("the model")
        finally:
            self.optimizer.__class__ = self._base_class
            if self.model.__class__.__bases__ == (self._model_class,):
                self.model.__class__ = self._model_class
            _ATTACHED.difference_update((self.model, self.optimizer))
            for hook in self._hooks:
                hook.remove()
            self._remove_gates()
            self.engine.close(linger_s=min(10.0, self.config.timeout_s))
            self.client.close()

    def __enter__(self) -> Sync:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(flush=kind is None)


def _bounded(average: torch.Tensor, clip: float | None) -> torch.Tensor:
    """`average`, or a copy of it within [-clip, clip] (it may still be on its way to a
    peer: never clipped in place before the sends drained)."""
    return average if clip is None else average.clamp(-clip, clip)


_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _backward_depth() -> int:
    """How many backward passes this thread runs inside: more than one in a reentrant
    backward. (Without torch's function every backward takes, 1: the outermost.)"""
    if _RUN_BACKWARD is None:
        return 1
    code, depth = _RUN_BACKWARD.__code__, 0
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        depth += frame.f_code is code
        frame = frame.f_back
    return depth


def _reduced_as(obj: object, cls: type, protocol: Any) -> Any:
    """How pickle and copy rebuild `obj` (gradlane's subclass, which holds a `Sync`), as
    an instance of `cls`, its class before: whoever loads it needs only that class."""
    reduced: Any = cls.__reduce_ex__(obj, protocol)  # type: ignore[arg-type,call-arg]
    rebuild, args, *rest = reduced
    if rebuild is copyreg.__newobj__ and args == (type(obj),):  # type: ignore[attr-defined]
        # pickle refuses __newobj__ of another class than the object's own
        return (copyreg._reconstructor, (cls, object, None), *rest)  # type: ignore[attr-defined]
    if rebuild is copyreg._reconstructor and args[0] is type(obj):  # type: ignore[attr-defined]
        return (rebuild, (cls, *args[1:]), *rest)  # protocols 0 and 1
    return reduced


def _first_difference(reference: dict[str, Any], mine: dict[str, Any], rank: int) -> str:
    if reference["options"] != mine["options"] or reference["world"] != mine["world"]:
        return (
            f"rank {rank} was attached with options {mine['options']} (world "
            f"{mine['world']}), rank 0 with {reference['options']} (world "
            f"{reference['world']})"
        )
    ref, own = reference["params"], mine["params"]
    for a, b in zip(ref, own, strict=False):
        if a != b:
            return (
                f"rank {rank}'s model differs from rank 0's: {b[0]} parameter {b[1]} is "
                f"{b[2]} {b[3]}, rank 0 has {a[0]} parameter {a[1]} {a[2]} {a[3]}"
            )
    return f"rank {rank}'s model has {len(own)} trainable parameters, rank 0's has {len(ref)}"
