"""What the simulator runs: a topology and jobs made of layers, chunks and workers.

A job is data-parallel training of one model profile: per iteration each
worker runs the forward pass layer by layer, then the backward pass in
reverse, and every layer's gradient is reduced through per-chunk owners
(reduce-scatter then all-gather, gradlane's data path). Layers are grouped
into `buckets` as gradlane's shim groups them (consecutive layers of one band
until a group holds 64 KiB: tens of collectives per iteration, not one per
layer); each bucket is cut into equal chunks of at most `chunk_bytes`,
which the plan gives owners.

Compute calibration (`V100_FP32_FLOPS`): a V100 sustaining half its
15.7 TFLOP/s FP32 peak, 32 samples per worker (GPT-2: 8 sequences of 1,024
tokens, what fits a V100's memory), backward = 2x forward. That puts
ResNet-50 at 100 ms per iteration (320 images/s), VGG-19 at 480 ms,
BERT-base (seq 128) at 340 ms and GPT-2 small at 890 ms: an assumption
stated here, not a measurement.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from gradlane.errors import ConfigError
from gradlane.policies.base import DEFAULT_BANDS, Host, Topology
from gradlane.policies.chunks import (
    DEFAULT_CHUNK_BYTES,
    band_of,
    group_consecutive,
    layout_sizes,
    uses_ring,
)
from gradlane.policies.profiles import BACKWARD_TO_FORWARD, NAMES, load_profile
from gradlane.policies.straggler import proportional_shares

__all__ = [
    "BATCH_PER_WORKER",
    "SAMPLES_PER_WORKER",
    "V100_FP32_FLOPS",
    "Bucket",
    "Scenario",
    "SimJob",
    "buckets_of",
    "cluster",
    "heterogeneous",
    "job_buckets",
    "one_switch",
    "profile_layers",
    "shim_buckets",
]

V100_FP32_FLOPS = 0.5 * 15.7e12
P100_SPEED = 10.6 / 15.7  # a P100's FP32 peak over a V100's
BATCH_PER_WORKER = 32
# GPT-2's 1,024-token sequences: 32 of them per V100 would not fit its memory; 8 do.
SAMPLES_PER_WORKER = {"gpt2": 8}
DEFAULT_BUCKETS = 16
MAX_CHUNK = 4 << 20


@dataclass(frozen=True)
class Bucket:
    bytes: float
    forward_s: float  # at speed 1 with the even share of the batch
    backward_s: float


@dataclass(frozen=True)
class SimJob:
    name: str
    model: str  # a profile name
    hosts: tuple[int, ...]  # where its workers run, rank order (several on one: co-located)
    buckets: tuple[Bucket, ...]
    global_batch: int
    speeds: tuple[float, ...] = ()  # relative compute speed per worker (default all 1)
    chunk_bytes: int = MAX_CHUNK
    ring: bool = False  # each chunk around the ring of ranks (`gradlane.policies.demand`)
    # Per-layer optimizer steps: a bucket's next forward waits for its own average only.
    # False: for every average of the iteration (one whole-model step, the `fifo` system).
    overlap: bool = True
    # Each chunk's reduction tree a stage after the other, as the shim stores and forwards
    # a chunk whole (`gradlane.policies.demand.Exchange.stages`), rather than a bucket's
    # flows all at once (fluid). The ring's hops are always stored and forwarded.
    store_forward: bool = False

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError(f"job {self.name}: needs a host per worker")
        if self.speeds and (len(self.speeds) != len(self.hosts) or min(self.speeds) <= 0):
            raise ConfigError(f"job {self.name}: one positive speed per worker")
        if self.global_batch < len(self.hosts):
            raise ConfigError(f"job {self.name}: global batch below one sample per worker")

    @property
    def workers(self) -> int:
        return len(self.hosts)

    @property
    def speed(self) -> tuple[float, ...]:
        return self.speeds or (1.0,) * len(self.hosts)

    @property
    def compute_s(self) -> float:
        return sum(b.forward_s + b.backward_s for b in self.buckets)

    @property
    def bytes(self) -> float:
        return sum(b.bytes for b in self.buckets)


@dataclass(frozen=True)
class Scenario:
    name: str
    topology: Topology
    jobs: tuple[SimJob, ...]
    iterations: int = 12  # measured per job, after `warmup`
    warmup: int = 2
    bands: int = DEFAULT_BANDS
    replan_s: float = 1.0  # the control plane's cadence, in simulated seconds
    react_s: float = 0.05  # its reaction time to a coflow arriving or completing
    seed: int = 0
    notes: dict[str, object] = field(default_factory=dict)
    # Open loop: per job, the times its coflows arrive. Each arrival releases one whole
    # iteration's gradient exchange at once, whatever the network does (no compute, no
    # feedback: Varys' and Sincronia's setting). Empty: the jobs train (closed loop).
    arrivals: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.topology.hosts)
        for job in self.jobs:
            if max(job.hosts) >= n or min(job.hosts) < 0:
                raise ConfigError(f"job {job.name}: a host outside 0..{n - 1}")
        if self.arrivals and (
            len(self.arrivals) != len(self.jobs)
            or any(list(a) != sorted(a) or (a and a[0] < 0) for a in self.arrivals)
        ):
            raise ConfigError("arrivals: one sorted list of times >= 0 per job")
        if self.iterations < 1 or self.warmup < 0 or not self.replan_s > 0 or self.react_s < 0:
            raise ConfigError("need iterations >= 1, warmup >= 0, replan_s > 0, react_s >= 0")


def buckets_of(
    layers: list[tuple[float, float, float]], count: int = DEFAULT_BUCKETS
) -> tuple[Bucket, ...]:
    """Consecutive `layers` (bytes, forward s, backward s) grouped into about `count` buckets.

    A bucket closes once it holds ``total / count`` bytes, so a huge layer is a
    bucket of its own and compute-only layers join their neighbours.
    """
    total = sum(b for b, _, _ in layers)
    target = total / max(1, count)
    out: list[Bucket] = []
    acc = [0.0, 0.0, 0.0]
    for b, f, k in layers:
        acc = [acc[0] + b, acc[1] + f, acc[2] + k]
        if acc[0] >= target:
            out.append(Bucket(*acc))
            acc = [0.0, 0.0, 0.0]
    if any(acc):
        if out and acc[0] == 0:  # trailing compute only: fold into the last bucket
            last = out.pop()
            out.append(Bucket(last.bytes, last.forward_s + acc[1], last.backward_s + acc[2]))
        else:
            out.append(Bucket(*acc))
    return tuple(out)


def profile_layers(
    model: str, batch: int, flops: float = V100_FP32_FLOPS
) -> list[tuple[float, float, float]]:
    """(bytes, forward s, backward s) per module of a shipped profile under the calibration."""
    profile = load_profile(model)
    return [
        (m.bytes, m.forward_flops * batch / flops,
         BACKWARD_TO_FORWARD * m.forward_flops * batch / flops)
        for m in profile.modules
    ]


def shim_buckets(
    layers: list[tuple[float, float, float]],
    workers: int,
    bands: int = DEFAULT_BANDS,
    layout: str = "fine",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ring: bool = False,
) -> tuple[tuple[Bucket, ...], int]:
    """`layers` (bytes, forward s, backward s) grouped as the shim groups them, and its chunk
    size: consecutive layers of one band by forward order until a group holds the
    `layout`'s least bytes (`gradlane.policies.chunks.layout_sizes`, `group_consecutive`;
    `ring`: the job takes the ring).
    """
    least, chunk = layout_sizes(int(sum(b for b, _, _ in layers)), workers, chunk_bytes, layout,
                                ring=ring)
    n = len(layers)
    groups = group_consecutive([int(b) for b, _, _ in layers],
                               [band_of(i, n, bands) for i in range(n)], least)
    buckets = tuple(Bucket(*(float(sum(layers[i][k] for i in g)) for k in range(3)))
                    for g in groups)
    return buckets, chunk


def job_buckets(
    layers: list[tuple[float, float, float]], workers: int, buckets: int | None = None,
    ring: bool = False,
) -> tuple[tuple[Bucket, ...], int]:
    """A job's buckets and chunk size: by default the shim's own groups and chunks
    (`shim_buckets`, its "fine" layout, the one it starts with); with `buckets`, about
    that many DDP-like buckets (`buckets_of`) cut into the shim's fine chunks (up to
    MAX_CHUNK). `ring`: the job takes the ring (its chunks are smaller)."""
    if buckets is None:
        return shim_buckets(layers, workers, ring=ring)
    out = buckets_of(layers, buckets)
    model = int(sum(b.bytes for b in out))
    return out, layout_sizes(model, workers, MAX_CHUNK, "fine", ring=ring)[1]


def one_switch(
    name: str,
    jobs: list[tuple[str, list[tuple[float, float, float]], list[float]]],
    hosts: int,
    nic_bps: float,
    exchange: str = "flat",
    buckets: int | None = None,
    **kwargs: object,
) -> Scenario:
    """Hosts on one switch; each job given as (model name, layers, per-worker speeds).

    Jobs take consecutive hosts, and the ring where `uses_ring` says so for
    `exchange` (`gradlane.shim.ShimConfig.exchange`: "auto" is the shim's
    default; "flat", this function's, keeps every job on its reduction tree).
    Layers are grouped as `job_buckets` says for `buckets`.
    """
    topo = Topology(tuple(Host(f"h{i}", 0, int(nic_bps)) for i in range(hosts)))
    out, next_host = [], 0
    for i, (model, layers, speeds) in enumerate(jobs):
        placed = tuple(range(next_host, next_host + len(speeds)))
        next_host += len(speeds)
        ring = uses_ring(exchange, len(placed), 1)
        grouped, chunk = job_buckets(layers, len(placed), buckets, ring=ring)
        out.append(SimJob(f"job{i}-{model}", model, placed, grouped,
                          BATCH_PER_WORKER * len(placed), tuple(speeds), chunk, ring=ring))
    return Scenario(name, topo, tuple(out), **kwargs)  # type: ignore[arg-type]


def heterogeneous(model: str = "resnet50", nic_bps: float = 10e9) -> Scenario:
    """4 workers at relative speeds 1, 1, 1, 0.5 on one switch (the issue's scenario)."""
    layers = profile_layers(model, BATCH_PER_WORKER)
    # The shim's default exchange: four ranks under one switch take the ring.
    return one_switch("heterogeneous", [(model, layers, [1, 1, 1, 0.5])], 4, nic_bps,
                      exchange="auto", notes={"model": model, "nic_bps": nic_bps})


def cluster(
    hosts: int = 1024,
    hosts_per_leaf: int = 32,
    jobs: int = 8,
    nic_bps: float = 25e9,
    oversubscription: float = 2.0,
    group: int = 8,
    seed: int = 0,
    iterations: int = 12,
    slow_fraction: float = 0.0,
    slow_speed: float = P100_SPEED,
    buckets: int | None = None,
    store_forward: bool = False,
) -> Scenario:
    """A leaf/spine cluster shared by `jobs` jobs mixing the shipped profiles.

    1. `hosts` under leaves of `hosts_per_leaf`; each leaf's uplink carries
       ``hosts_per_leaf * nic / oversubscription``.
    2. Hosts are handed out in groups of `group` consecutive hosts (a group
       never spans two leaves), shuffled with `seed` as a busy scheduler
       leaves them, so jobs span leaves and share uplinks.
    3. Job sizes: random weights (seeded), rounded to whole groups, each job
       at least one group; models cycle through the profiles in seeded order.
    4. Mixed generations: a `slow_fraction` of the groups (seeded; a group is
       one server) computes at `slow_speed` (default: a P100 next to V100s,
       the ratio of their FP32 peaks, 10.6 / 15.7).
    5. Layers are grouped and chunked as gradlane's shim does, whatever the
       policy (`job_buckets`; `buckets` for about that many DDP-like ones).
    6. Buckets' flows are fluid, unless `store_forward` (`SimJob.store_forward`).
    """
    if hosts % hosts_per_leaf or hosts_per_leaf % group or hosts // group < jobs:
        raise ConfigError(
            f"hosts must fill whole leaves of {hosts_per_leaf}, leaves whole groups of "
            f"{group}, and give each of the {jobs} jobs a group: got {hosts} hosts")
    rng = random.Random(seed)
    leaves = hosts // hosts_per_leaf
    uplink = int(hosts_per_leaf * nic_bps / oversubscription)
    topo = Topology(
        tuple(Host(f"h{i}", i // hosts_per_leaf, int(nic_bps)) for i in range(hosts)),
        (uplink,) * leaves if leaves > 1 else (),
    )
    groups = list(range(hosts // group))
    rng.shuffle(groups)
    if not 0 <= slow_fraction <= 1 or not slow_speed > 0:
        raise ConfigError("slow_fraction must be in 0..1 and slow_speed positive")
    slow = set(rng.sample(groups, round(slow_fraction * len(groups))))
    weights = [rng.uniform(0.5, 2.0) for _ in range(jobs)]
    counts = proportional_shares(len(groups), weights)  # groups per job, each >= 1
    models = list(NAMES)
    rng.shuffle(models)
    out, at = [], 0
    for j in range(jobs):
        mine = groups[at:at + counts[j]]
        at += counts[j]
        placed = tuple(int(h) for g in sorted(mine) for h in np.arange(g * group, (g + 1) * group))
        model = models[j % len(models)]
        batch = SAMPLES_PER_WORKER.get(model, BATCH_PER_WORKER)
        grouped, chunk = job_buckets(profile_layers(model, batch), len(placed), buckets)
        speeds = tuple(slow_speed if h // group in slow else 1.0 for h in placed)
        out.append(SimJob(f"job{j}-{model}", model, placed, grouped,
                          batch * len(placed), speeds if slow else (), chunk,
                          store_forward=store_forward))
    notes: dict[str, object] = {
        "hosts": hosts, "hosts_per_leaf": hosts_per_leaf, "nic_bps": nic_bps,
        "oversubscription": oversubscription, "group": group,
        "grouping": "the shim's (fine)" if buckets is None else f"{buckets} DDP-like buckets",
        "chunks": "stored and forwarded" if store_forward else "fluid",
        "slow_fraction": slow_fraction, "slow_speed": slow_speed,
        "calibration": f"V100 FP32 at {V100_FP32_FLOPS / 1e12:.2f} TFLOP/s sustained, "
                       f"{BATCH_PER_WORKER} samples per worker (GPT-2: "
                       f"{SAMPLES_PER_WORKER['gpt2']} sequences of 1,024 tokens)",
    }
    name = "cluster-mixed" if slow else "cluster"
    return Scenario(name, topo, tuple(out), iterations=iterations, seed=seed, notes=notes)
