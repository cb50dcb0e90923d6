"""The policy interface: ``plan(state) -> Plan``, pure and deterministic.

One `State` serves two callers:

- a daemon fills only the host-local part (`shaped_bps`, `other_bps`,
  `jobs`) and enforces `Plan.job_classes`, one HTB class per job;
- the control plane and the simulator also fill the cluster part
  (`topology`, `workers`, `coflows`, `flows`) and get back everything a
  cluster plan holds: a band per flow, per-flow rates, the coflow order and
  its priority levels, per-host job classes, chunk ownership and batch
  shares, with a version and a time-to-live.

Flows are many (a 1,024-host cluster has tens of thousands), so they travel
as one `FlowTable` of numpy columns rather than one object each, and the
per-flow parts of a plan are arrays aligned with it. `check_plan`
(in `gradlane.policies.check`) states what a valid plan is.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from gradlane.errors import ConfigError

__all__ = [
    "DEFAULT_BANDS",
    "DEFAULT_MAX_WEIGHED",
    "DEFAULT_TTL_S",
    "LEVELS",
    "Coflow",
    "FlowTable",
    "Host",
    "JobClassPlan",
    "JobState",
    "Plan",
    "Policy",
    "State",
    "Topology",
    "Worker",
    "get_policy",
    "policy_names",
    "register",
]

LEVELS = 8  # priority levels real switches have (and HTB's prio range)
DEFAULT_BANDS = 4  # gradlaned's default bands per job
DEFAULT_TTL_S = 10.0
# The most loads (owners weighed x host links, each way) a job's chunk-owner shares weigh
# (`gradlane.policies.loadbalance`): at it, 65,536 ranks of 8 a host within leaves, mixed
# links, peak at 1.3 GB and take 25 s (`bench/control_big_job.py`): about 10 bytes a load,
# the loads kept sparse, most of it the solver's (dense, as the ring's still are, they took
# about 50). Past it, even owners and a note: a control plane killed for memory at every
# plan would plan no job at all (8,192 hosts of one rank within leaves are at it; every
# rank of 65,536 weighed, as ranks in no order host by host are, is 8 times past it).
# `gradlane control --max-weighed`.
DEFAULT_MAX_WEIGHED = 1 << 27

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class JobState:
    """A job. A daemon fills the first three fields; a cluster state all of them."""

    name: str
    workers: int  # its workers (on this host, for a daemon)
    flows: int = 0  # their registered band connections (daemon)
    global_batch: int = 0  # samples per iteration over all workers; 0: unknown
    chunk_bytes: tuple[int, ...] = ()  # gradient chunks in forward order (ownership plans these)
    layers: int = 0  # distinct flow priorities (layers in forward order); 0: one per chunk
    chunk_layers: tuple[int, ...] = ()  # the layer of each chunk, when known
    ring: bool = False  # its chunks go around the ring of ranks (`chunks.ring_routes`)
    by_host: bool = False  # its chunks are reduced within each host first (`chunks.host_groups`)


@dataclass(frozen=True)
class Worker:
    """One worker of a job: where it runs and how fast it computes."""

    job: str
    rank: int
    host: int  # index into `Topology.hosts`
    throughput: float = 0.0  # measured samples/s; 0: not measured yet
    batch: int = 0  # its current local batch size


@dataclass(frozen=True)
class Host:
    name: str
    leaf: int = 0
    nic_bps: int = 10_000_000_000


@dataclass(frozen=True)
class Topology:
    """Hosts under leaf switches; leaves joined by a spine.

    Every host has one NIC (an egress and an ingress link). Leaf ``l`` has an
    uplink to the spine and a downlink from it of ``uplink_bps[l]`` each; a
    one-switch cluster has one leaf and no uplink traffic. Links are numbered:
    host egress ``0..H-1``, host ingress ``H..2H-1``, leaf up ``2H..2H+L-1``,
    leaf down ``2H+L..2H+2L-1``.
    """

    hosts: tuple[Host, ...]
    uplink_bps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError("a topology needs at least one host")
        lowest = min(h.leaf for h in self.hosts)
        if lowest < 0:
            raise ConfigError(f"leaves are numbered from 0, got {lowest}")
        leaves = max(h.leaf for h in self.hosts) + 1
        if len(self.uplink_bps) not in (0, leaves):
            raise ConfigError(
                f"need one uplink rate per leaf ({leaves}), got {len(self.uplink_bps)}"
            )
        if any(h.nic_bps <= 0 for h in self.hosts) or any(r <= 0 for r in self.uplink_bps):
            raise ConfigError("link rates must be positive")

    @property
    def leaves(self) -> int:
        return len(self.uplink_bps) or 1

    @cached_property
    def host_leaf(self) -> IntArray:
        return np.array([h.leaf for h in self.hosts], dtype=np.int64)

    @cached_property
    def capacity_bps(self) -> FloatArray:
        """Capacity of every link, in the numbering above."""
        nic = np.array([h.nic_bps for h in self.hosts], dtype=np.float64)
        up = np.array(self.uplink_bps, dtype=np.float64)
        return np.concatenate([nic, nic, up, up])

    def links(self, src: IntArray, dst: IntArray) -> IntArray:
        """The links of each (src, dst) host pair: an ``(n, 4)`` array, -1 where unused.

        Columns: src egress, dst ingress, src leaf up, dst leaf down (the last
        two only when the leaves differ).
        """
        h, n_leaves = len(self.hosts), len(self.uplink_bps)
        out = np.full((len(src), 4), -1, dtype=np.int64)
        out[:, 0] = src
        out[:, 1] = h + dst
        if n_leaves:
            ls, ld = self.host_leaf[src], self.host_leaf[dst]
            cross = ls != ld
            out[cross, 2] = 2 * h + ls[cross]
            out[cross, 3] = 2 * h + n_leaves + ld[cross]
        return out


@dataclass(frozen=True, eq=False)
class FlowTable:
    """Flows as columns: flow ``i`` is ``(src[i], dst[i], bytes[i], ...)``.

    `src`/`dst` index `Topology.hosts`; `coflow` indexes `State.coflows`;
    `priority` is the forward-order position of the flow's layer (or chunk,
    when the job does not give `layers`): 0 is needed first by the next
    forward pass; `chunk` indexes the job's `chunk_bytes` (-1: not a chunk of
    a job, e.g. background traffic).
    """

    src: IntArray
    dst: IntArray
    bytes: FloatArray
    ready_s: FloatArray
    priority: IntArray
    coflow: IntArray
    chunk: IntArray

    @staticmethod
    def empty() -> FlowTable:
        i, f = np.zeros(0, np.int64), np.zeros(0, np.float64)
        return FlowTable(i, i, f, f, i, i, i)

    @staticmethod
    def build(rows: list[tuple[int, int, float, float, int, int, int]]) -> FlowTable:
        """From rows ``(src, dst, bytes, ready_s, priority, coflow, chunk)``."""
        if not rows:
            return FlowTable.empty()
        cols = list(zip(*rows, strict=True))
        i, f = np.int64, np.float64
        return FlowTable(
            np.array(cols[0], i), np.array(cols[1], i), np.array(cols[2], f),
            np.array(cols[3], f), np.array(cols[4], i), np.array(cols[5], i), np.array(cols[6], i),
        )

    @staticmethod
    def concat(tables: list[FlowTable]) -> FlowTable:
        """One table of the flows of `tables`, in order."""
        if not tables:
            return FlowTable.empty()
        return FlowTable(*(np.concatenate([getattr(t, k) for t in tables]) for k in _COLUMNS))

    def __len__(self) -> int:
        return len(self.src)

    def equals(self, other: FlowTable) -> bool:
        return all(np.array_equal(getattr(self, k), getattr(other, k)) for k in _COLUMNS)


_COLUMNS = ("src", "dst", "bytes", "ready_s", "priority", "coflow", "chunk")


@dataclass(frozen=True)
class Coflow:
    """The flows of one job that only matter together (one iteration's gradients)."""

    id: str
    job: str
    age_s: float = 0.0  # how long since its first flow became ready


@dataclass(frozen=True, eq=False)
class State:
    """What a policy plans from. See the module docstring for who fills what."""

    shaped_bps: int = 0  # a daemon's root class rate
    other_bps: int = 0  # kept for non-gradlane traffic on that host
    jobs: tuple[JobState, ...] = ()  # sorted by name
    topology: Topology | None = None
    workers: tuple[Worker, ...] = ()  # sorted by (job, rank)
    coflows: tuple[Coflow, ...] = ()
    flows: FlowTable = field(default_factory=FlowTable.empty)
    bands: int = DEFAULT_BANDS
    version: int = 0
    max_weighed: int = DEFAULT_MAX_WEIGHED  # a job's owner shares weigh at most so many loads

    @property
    def cluster(self) -> bool:
        return self.topology is not None

    def workers_of(self, job: str) -> list[Worker]:
        return self._by_job.get(job, [])

    @cached_property
    def flow_links(self) -> IntArray:
        """The ``(n, 4)`` links of the flows (`Topology.links`), read-only, once per state.

        An unused column holds ``n_links``: a null link past the real ones, so
        per-link sums are one `np.bincount` with no masking (its entry is
        dropped) and per-link lookups pad one value (+inf capacity, never full).
        """
        assert self.topology is not None
        links = self.topology.links(self.flows.src, self.flows.dst)
        links[links < 0] = len(self.topology.capacity_bps)
        links.flags.writeable = False
        return links

    @cached_property
    def _by_job(self) -> dict[str, list[Worker]]:
        out: dict[str, list[Worker]] = {}
        for w in self.workers:
            out.setdefault(w.job, []).append(w)
        return out


@dataclass(frozen=True)
class JobClassPlan:
    rate_bps: int
    ceil_bps: int
    prio: int  # 0 (first) .. 7


def _no_flows() -> FloatArray:
    return np.zeros(0, np.float64)


@dataclass(frozen=True, eq=False)
class Plan:
    """What the daemons and shims enforce.

    `job_classes` is the host-local part a daemon applies (one HTB class per
    job). The rest is filled for a cluster state: `host_classes` gives every
    host its job classes; `flow_band` (level 0 first) and `flow_rate_bps`
    are aligned with `State.flows`; `coflow_order` lists coflow ids, first
    served first, and `job_level` maps each job to the priority level its
    coflow got; `ownership[job][i]` is the rank owning chunk ``i``;
    `batch_shares[job][rank]` the local batch size of that rank;
    `reduce_in_leaf` tells shims to reduce each chunk within each leaf switch
    before it crosses the spine (`gradlane.policies.chunks.reduction_parents`).
    """

    job_classes: dict[str, JobClassPlan]
    source: str  # the policy's name, or "control" for a control-plane plan
    host_classes: dict[int, dict[str, JobClassPlan]] = field(default_factory=dict)
    flow_band: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    flow_rate_bps: FloatArray = field(default_factory=_no_flows)
    coflow_order: tuple[str, ...] = ()
    job_level: dict[str, int] = field(default_factory=dict)
    ownership: dict[str, tuple[int, ...]] = field(default_factory=dict)
    batch_shares: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reduce_in_leaf: bool = False
    version: int = 0
    ttl_s: float = DEFAULT_TTL_S
    # What the plan does otherwise than its policy would, one line each, for operators
    # (the control plane logs each new one and shows them): policies do no I/O.
    notes: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """Plain lists and dicts (msgpack and JSON safe); equal plans give equal dicts."""

        def classes(c: Mapping[str, JobClassPlan]) -> dict[str, list[int]]:
            return {job: [p.rate_bps, p.ceil_bps, p.prio] for job, p in sorted(c.items())}

        return {
            "source": self.source,
            "version": self.version,
            "ttl_s": self.ttl_s,
            "job_classes": classes(self.job_classes),
            "host_classes": {str(h): classes(c) for h, c in sorted(self.host_classes.items())},
            "flow_band": self.flow_band.tolist(),
            "flow_rate_bps": self.flow_rate_bps.tolist(),
            "coflow_order": list(self.coflow_order),
            "job_level": dict(sorted(self.job_level.items())),
            "ownership": {j: list(o) for j, o in sorted(self.ownership.items())},
            "batch_shares": {j: list(s) for j, s in sorted(self.batch_shares.items())},
            "reduce_in_leaf": self.reduce_in_leaf,
            "notes": list(self.notes),
        }


class Policy(ABC):
    """A scheduling policy. Subclasses set `name` (by `register`) and implement `plan`.

    `plan` must be pure (no I/O, no clock, no randomness without a seed in
    the state), deterministic and total: for a daemon's state it returns a
    class for every job with 0 < rate <= ceil <= state.shaped_bps and prio
    in 0..7; for a cluster state, a plan that `check_plan` accepts.
    """

    name: str = ""

    @abstractmethod
    def plan(self, state: State) -> Plan:
        """Return the plan for `state`."""


_REGISTRY: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make a policy available by `name`."""

    def add(cls: type[Policy]) -> type[Policy]:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # package.module, nothing relative


def get_policy(name: str) -> Policy:
    """A policy by registered name, or ``"package.module:Class"`` for a third-party one.

    Raises:
        ConfigError: no such policy (never a silent default).
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        if not (_DOTTED.fullmatch(module_name) and attr.isidentifier()):
            raise ConfigError(f"policy {name!r}: a third-party one is named "
                              "'package.module:Class'")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"policy {name!r} cannot be loaded: {exc}") from None
        except Exception as exc:  # the module's own code failed as it was imported
            raise ConfigError(f"policy {name!r} cannot be loaded: importing {module_name} "
                              f"raised {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise ConfigError(f"policy {name!r} is not a gradlane.policies.Policy subclass")
        try:
            return cls()
        except Exception as exc:
            raise ConfigError(f"policy {name!r} cannot be made without arguments: "
                              f"{type(exc).__name__}: {exc}") from exc
    try:
        return _REGISTRY[name]()
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown policy {name!r} (known: {known}, or 'module:Class')") from None
