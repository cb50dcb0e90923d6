"""The shim's options, validated once, and what it refuses in a model."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

from gradlane.daemon.control_protocol import MAX_BATCH
from gradlane.daemon.fields import MAX_LEAF, MAX_NAME, MAX_SOCKET_PATH, RESERVED_PREFIX
from gradlane.daemon.protocol import DEFAULT_BAND_DSCP
from gradlane.errors import ConfigError
from gradlane.policies.chunks import DEFAULT_CHUNK_BYTES, EXCHANGE_OPTIONS, LAYOUTS, OPTION_BYTES

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DEFAULT_DSCP", "EXCHANGES", "LAYOUTS", "SampleCount", "ShimConfig",
           "checked_samples", "default_job", "refuse_sparse_gradients"]

# Band 0 first: gradlaned's default table. The daemon's welcome overrides it.
DEFAULT_DSCP = DEFAULT_BAND_DSCP
EXCHANGES = EXCHANGE_OPTIONS  # `gradlane.policies.chunks.uses_ring`


def refuse_sparse_gradients(model: nn.Module) -> None:
    """Raise `ConfigError` naming the modules of `model` whose gradients are sparse
    (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``): chunks are cut from dense
    gradients, and a sparse one would fail in backward with torch's own error."""
    sparse = [name or "the model" for name, module in model.named_modules()
              if getattr(module, "sparse", False) is True
              and any(p.requires_grad for p in module.parameters(recurse=False))]
    if sparse:
        raise ConfigError(f"{', '.join(sparse[:3])}: sparse gradients (sparse=True); "
                          "gradlane averages dense ones, so build these with sparse=False")


def default_job() -> str:
    """The job name when none is given: the job's rendezvous address, MASTER_ADDR:MASTER_PORT
    as torchrun sets them for every rank ("default" without them).

    Two jobs cannot rendezvous at one address at once, so jobs sharing a
    cluster get names of their own: under one name, a daemon would refuse the
    second job's ranks as duplicates and the control plane would plan the two
    as one.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else "default"


MAX_TIMEOUT_S = 86400.0


def checked_samples(value: object) -> int | None:
    """`Sync.samples` or `HookState.samples` as set by hand: None, or a whole number of
    samples up to what a control plane plans by (`control_protocol.MAX_BATCH`).

    Raises:
        ConfigError: anything else (a float, a tensor, a negative count), at the line that
            set it rather than in a backward hook.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or not \
            0 <= int(value) <= MAX_BATCH:
        raise ConfigError(f"samples must be a whole number 0..{MAX_BATCH} or None, "
                          f"got {value!r:.80}")
    return int(value)


class SampleCount:
    """The ``samples`` attribute of `Sync` and `HookState`: kept as ``_samples``, checked
    as it is set (`checked_samples`)."""

    def __get__(self, obj: object, owner: type | None = None) -> int | None:
        return None if obj is None else obj.__dict__.get("_samples")

    def __set__(self, obj: object, value: object) -> None:
        obj.__dict__["_samples"] = checked_samples(value)


# What each option must be, in its error's words, and the plain Python value it is kept as
# (numpy's integers are integers, a list of DSCP values a tuple; a bool is no number here).
_KINDS: dict[str, tuple[type | tuple[type, ...], Callable[[Any], object], str]] = {
    "chunk_bytes": (Integral, int, "a whole number of bytes"),
    "dscp": ((tuple, list), tuple, "a tuple (or list) of DSCP values"),
    "credit_bytes": (Integral, int, "a whole number of bytes"),
    "timeout_s": (Real, float, "a number of seconds"),
    "overlap": (bool, bool, "True or False"),
    "daemon_socket": ((str, os.PathLike), os.fspath, "a path"),
    "job": (str, str, "text"),
    "sndbuf_bytes": (Integral, int, "a whole number of bytes"),
    "leaf": ((Integral, type(None)), lambda v: v if v is None else int(v),
             "an integer 0..65535 or None"),
    "layout": (str, str, "text"),
    "exchange": (str, str, "text"),
}


@dataclass(frozen=True)
class ShimConfig:
    """How a worker cuts, orders and sends its gradients.

    Attributes:
        chunk_bytes: the largest unit of ownership, ordering and preemption.
            A newly ready high-priority chunk waits for at most one chunk
            already being written on its connection. The default comes from
            ``bench/shim_transport.py`` (see the README): the smallest size
            reaching 75% of the best loopback throughput. A small model gets
            smaller chunks (a quarter of each worker's share of the model, at
            least 64 KiB), or owners could not be balanced.
        dscp: the DSCP code point of each band, band 0 (highest priority)
            first; its length is the number of band connections per peer.
        credit_bytes: at most this many bytes of one band connection are
            written to the kernel but not yet sent (TCP_NOTSENT_LOWAT), so
            little low-priority data is committed when high-priority data
            arrives. The kernel's HTB bands preempt what is already sent.
        timeout_s: a peer that delivers nothing for this long while we wait
            on it is declared lost (`PeerLost`), unless it answers a PING
            (alive, waiting on a peer of its own): then after as long again,
            or as soon as its goodbye names the rank it lost. At most a day.
        overlap: step each layer's optimizer as soon as its averaged gradient
            is in and let the next forward start layer by layer. False: one
            whole-model step at ``optimizer.step()`` (still priority-ordered).
        daemon_socket: gradlaned's Unix socket; used when it exists.
        job: the job name the daemon and control plane see (default: the
            rendezvous address, `default_job`).
        sndbuf_bytes: SO_SNDBUF of band connections (0 = kernel autotuning).
        leaf: the leaf switch this worker's host hangs off, when the fabric's
            uplinks are oversubscribed: when every rank has one, each chunk
            is reduced within each leaf first and only one copy per leaf
            crosses the spine (`gradlane.policies.chunks.reduction_parents`).
            None (the default): the control plane's advice through gradlaned,
            if any; else the flat exchange.
        layout: how gradients are grouped. "fine": small groups (from 64 KiB)
            and chunks, so the first layers' gradients go first and the next
            forward starts layer by layer: what wins when communication is
            about as long as compute. "coarse": groups of 4 MiB or more and
            fewer, larger chunks, about as few messages as DDP's buckets: what
            costs least CPU when communication hides behind backward anyway.
            "auto" (the default): each runs for a few steps after warm-up
            (`gradlane.policies.chunks.trial_schedule`: decided at step 17), and
            the job keeps coarse only if its iterations (each step's slowest
            rank) were faster beyond chance (`gradlane.shim.sync.pick_layout`),
            fine otherwise; every rank takes the same decision. (`attach` only: the DDP comm hook
            reduces DDP's own buckets.)
        exchange: the path of each chunk when every rank hangs off one leaf.
            "flat": every rank sends its part straight to the chunk's owner,
            which sends the average straight back (two hops). "ring": the
            part travels around the ring of ranks to the owner, summed on
            the way, and the average on around the ring
            (`gradlane.policies.chunks.ring_routes`): the same bytes per
            link, but no rank ever receives from several at once, so no
            switch port queues (incast) and only the senders' own queues,
            where the priority order holds; W-1 hops each way instead.
            "auto" (the default): the ring for 3..8 ranks under one leaf,
            flat otherwise (`gradlane.policies.chunks.uses_ring`). On the
            4-host testbed the ring was 0-12% faster than flat on every
            trace and the CNN, and as fast on ResNet-50 (compute-bound).
            With "auto" or "flat", ranks sharing some hosts (not all on
            one; ranks whose gradlaned names one host in its welcome, or
            that listen on one address) reduce each chunk within each host
            first, and one copy per host crosses its NIC each way
            (`gradlane.policies.chunks.host_groups`); with leaves known,
            within hosts, then within leaves (one copy per host on its NIC,
            one per leaf on the spine). "ring" keeps the ring whatever the
            placement. Each rank holds band connections to the ranks its
            exchange sends to only (`gradlane.policies.chunks.Routes.peers`):
            its two neighbours on the ring, its groups' members and the ranks
            at its place in the other groups on a tree, every rank when flat.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    dscp: tuple[int, ...] = DEFAULT_DSCP
    credit_bytes: int = 128 << 10
    timeout_s: float = 60.0
    overlap: bool = True
    daemon_socket: str = "/run/gradlane/gradlaned.sock"
    job: str = field(default_factory=default_job)
    sndbuf_bytes: int = 0
    leaf: int | None = None
    layout: str = "auto"
    exchange: str = "auto"

    def __post_init__(self) -> None:
        for name, (kind, plain, words) in _KINDS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (isinstance(value, bool) and plain is not bool):
                raise ConfigError(f"{name} must be {words}, got {value!r}")
            object.__setattr__(self, name, plain(value))
        for name, (least, most) in OPTION_BYTES.items():
            if not least <= getattr(self, name) <= most:
                raise ConfigError(f"{name} must be {_size(least)}..{_size(most)}, got "
                                  f"{getattr(self, name)}")
        if not 0 < len(os.fsencode(self.daemon_socket)) <= MAX_SOCKET_PATH:  # as gradlaned's
            raise ConfigError(f"daemon_socket must be a path of 1..{MAX_SOCKET_PATH} bytes (the "
                              f"kernel's limit for a Unix socket), got {self.daemon_socket!r}")
        if not 1 <= len(self.dscp) <= 8:
            raise ConfigError(f"dscp must list 1..8 bands, got {len(self.dscp)}")
        if not all(isinstance(d, int) and 0 <= d < 64 for d in self.dscp):
            raise ConfigError(f"dscp values must be integers 0..63, got {self.dscp}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # inf overflows the sockets' timeouts
            raise ConfigError(f"timeout_s must be positive, at most {MAX_TIMEOUT_S:g} (a "
                              f"day), got {self.timeout_s}")
        if (not 0 < len(self.job) <= MAX_NAME or not self.job.isprintable()
                or self.job.startswith(RESERVED_PREFIX)):  # as gradlaned takes it
            raise ConfigError(f"job must be 1..{MAX_NAME} printable characters, not starting "
                              f"with {RESERVED_PREFIX!r}: {self.job!r}")
        if self.leaf is not None and not 0 <= self.leaf < MAX_LEAF:
            raise ConfigError(f"leaf must be an integer 0..{MAX_LEAF - 1} or None, "
                              f"got {self.leaf!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.exchange not in EXCHANGES:
            raise ConfigError(
                f"exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}"
            )

    @classmethod
    def of(cls, options: dict[str, object]) -> ShimConfig:
        """The config of `attach`'s (or the DDP hook's) keyword options.

        Raises:
            ConfigError: an unknown option (the closest known one named), or a bad value.
        """
        known = [f.name for f in fields(cls)]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"unknown option {name!r}: {hint}known: {', '.join(known)}")
        return cls(**options)  # type: ignore[arg-type]

    @property
    def bands(self) -> int:
        return len(self.dscp)

    def signature(self) -> dict[str, object]:
        """The options every worker of a job must share (checked at attach)."""
        return {"chunk_bytes": self.chunk_bytes, "bands": self.bands, "overlap": self.overlap,
                "layout": self.layout, "exchange": self.exchange}


def _size(n: int) -> str:
    """A byte size as the bounds are said: 4 KiB, 1 GiB, 0."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)
