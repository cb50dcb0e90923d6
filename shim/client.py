"""The shim's side of the gradlaned protocol (`gradlane.daemon.protocol`).

One background thread owns the Unix socket. The training thread only appends
to an in-memory batch (`chunk_event`, `begin`, `timing`), so a slow or
dead daemon never slows training. When the socket is missing or the daemon
goes away, one log line says so; training goes on with the local order and
the thread reconnects every `RETRY_S` seconds, replaying hello with the
current flows (none if there are more than gradlaned registers,
`gradlane.daemon.protocol.MAX_FLOWS`: their DSCP marks alone schedule them).
A daemon that refuses the worker (its error reply: a rank claimed twice, a
version it lacks) is asked again ever less often, up to every `MAX_RETRY_S`
seconds: it would most often refuse again, and log each refusal.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gradlane.daemon import protocol
from gradlane.daemon.control_protocol import MAX_BATCH
from gradlane.daemon.fields import exchange_fields, features
from gradlane.errors import ProtocolError

if TYPE_CHECKING:
    from gradlane.shim.config import ShimConfig
    from gradlane.shim.engine import Chunk, Group
    from gradlane.shim.transport import Mesh

__all__ = ["DaemonClient", "Refused", "next_retry"]

logger = logging.getLogger(__name__)

RETRY_S = 2.0
MAX_RETRY_S = 32.0  # the longest wait after refusals in a row
WELCOME_WAIT_S = 2.0  # how long `leaf` and `host` wait for a daemon's welcome
MAX_NICS = 64  # addresses a welcome's nics may list
_MAX_QUEUED = 256  # messages; older batches are dropped past this (the daemon is behind)


class Refused(ProtocolError):
    """gradlaned answered with an error: it will not serve this worker as it is."""


def next_retry(wait: float, refused: bool) -> float:
    """The wait before the next session, after one that waited `wait` before it and
    ended `refused` by the daemon (doubled, up to `MAX_RETRY_S`) or otherwise
    (`RETRY_S`: the daemon was absent, or went away)."""
    return min(2 * wait, MAX_RETRY_S) if refused else RETRY_S


class ComputeClock:
    """A step's compute, as `DaemonClient.timing` reports it: from the step's first
    forward with gradients in training mode (with none, in eval mode) to its backward's
    end. A forward in eval mode before one in training mode is an evaluation that left
    gradients on, not training's pace."""

    def __init__(self) -> None:
        self._began: dict[bool, float] = {}  # per the model's training mode

    def forward(self, training: bool, now: float) -> None:
        """A forward with gradients begins, the model in training mode or not."""
        self._began.setdefault(training, now)

    def stop(self, now: float) -> float | None:
        """Seconds since the step's compute began (None: no forward with gradients since
        the last stop)."""
        began = self._began.get(True, self._began.get(False))
        self._began = {}
        return None if began is None else now - began


class DaemonClient:
    """Registers this worker's band connections with gradlaned and reports to it.

    Attributes:
        connected: whether a daemon accepted our hello.
        plan: the last plan message, or None.
        advised_batch_share: the batch share the plan advises (None: keep yours).
        advised_owners: the owner rank of each of the job's chunks (in priority
            order, as reported) the plan advises; None: none. Ranks take it
            together (`Sync`, the DDP hook): owners must agree on every rank.
        advised_leaf: this host's leaf switch when, at the welcome, the
            control plane advised reducing within leaves first (None: the flat
            exchange). Read once at attach: reduction trees never change mid-run.
        daemon_host: the opaque name of this worker's host the welcome gave
            (None: no daemon, or an older one).
        nic_rates: the rate gradlaned shapes each of its interfaces' addresses to,
            by address, as the welcome gave them (empty: none).
        exchange: how the job's ranks agreed to reduce (`exchange_agreed`),
            which gradlaned passes on to the control plane; None: not yet.
        global_batch: the job's samples per step as its ranks agreed
            (`batch_agreed`), which the control plane splits into batch
            shares; None: not yet.
    """

    def __init__(self, config: ShimConfig, rank: int, world: int, mesh: Mesh) -> None:
        self.config, self.rank, self.world, self.mesh = config, rank, world, mesh
        self.connected = False
        self.plan: dict[str, Any] | None = None
        self.advised_batch_share: float | None = None
        self.advised_owners: tuple[int, ...] | None = None
        self.advised_leaf: int | None = None
        self.daemon_host: str | None = None
        self.nic_rates: dict[str, int] = {}
        self.exchange: str | None = None
        self.global_batch: int | None = None
        self.welcomed = threading.Event()
        self._waited = False
        self._features: frozenset[str] = frozenset()  # the daemon's optional fields
        self.daemon_bands: tuple[int, ...] | None = None
        self._events: list[list[float | int]] = []
        self._step = 0
        self._samples = 0
        self._outbox: queue.Queue[dict[str, Any]] = queue.Queue(_MAX_QUEUED)
        # What the daemon must hold (the flows message: connections, their bands, what the
        # ranks agreed) changed: never dropped as reports are; a new session says it anyway.
        self._restate = threading.Event()
        self._stop = threading.Event()
        self._said_absent = False
        self._said_unregistered = False  # said once: too many connections to register
        self._left_out = 0  # connections not registered (too many), as the last flows said
        self._left_out_from: list[str] = []  # ... and their source addresses
        self._thread = threading.Thread(target=self._run, name="gl-daemon-client", daemon=True)
        self._thread.start()

    # -- called from the training thread (cheap, never blocks) ---------------

    def chunk_event(self, group: Group, chunk: Chunk, kind: str) -> None:
        if kind == "ready":
            self._events.append(
                [group.priority, chunk.nbytes, self._band(group.band), round(time.monotonic(), 6)]
            )

    def begin(self, step: int, samples: int) -> None:
        """A new step starts: ship the previous step's batch of events."""
        events, self._events = self._events, []
        for i in range(0, len(events), protocol.MAX_EVENTS):
            self._post(
                {
                    "type": "chunks",
                    "iteration": self._step,
                    "events": events[i : i + protocol.MAX_EVENTS],
                }
            )
        self._step, self._samples = step, samples

    def timing(self, compute_s: float, comm_s: float) -> None:
        """This step's compute time and the time it waited on communication."""
        self._post(
            {
                "type": "timing",
                "iteration": self._step,
                "compute_s": max(0.0, compute_s),
                "comm_s": max(0.0, comm_s),
                "samples": self._samples,
            }
        )

    def leaf(self) -> int | None:
        """This worker's leaf switch for reducing within leaves first, or None (flat).

        `ShimConfig.leaf` when set; else the leaf gradlaned's welcome says the
        control plane advises, waited for up to `WELCOME_WAIT_S` when a daemon
        socket exists. Ranks then agree on it (`gradlane.shim.transport.reduction_groups`).
        """
        if self.config.leaf is not None:
            return self.config.leaf
        self._await_welcome()
        return self.advised_leaf

    def host(self) -> str | None:
        """The name gradlaned gives this worker's host (`daemon_host`), waited for as
        `leaf` waits; None without a daemon. Ranks reduce within hosts by it
        (`gradlane.shim.transport.reduction_groups`)."""
        self._await_welcome()
        return self.daemon_host

    def plane_rates(self, addresses: Sequence[str]) -> list[int] | None:
        """The rates gradlaned shapes the NICs of `addresses` (this rank's, one per plane)
        to, waited for as `leaf` waits; None unless it named them all (then the planes
        count as equal)."""
        self._await_welcome()
        rates = [self.nic_rates.get(a) for a in addresses]
        return None if None in rates else [r for r in rates if r is not None]

    def _await_welcome(self) -> None:
        """Wait for the welcome, once (a daemon that did not answer in time is not waited
        for again)."""
        if not self._waited and os.path.exists(self.config.daemon_socket):
            self.welcomed.wait(WELCOME_WAIT_S)
        self._waited = True

    @property
    def advised_batch_size(self) -> int | None:
        """The local batch size the control plane advises for this worker, or None.

        Straggler mitigation: slower workers are advised fewer samples. Take it
        at any step (``batch = sync.advised_batch_size or batch``); no agreement
        between workers is needed, because averages are weighted by each
        worker's actual sample count, so any mix of batch sizes gives the exact
        average of that step's samples. At most what `Sync.samples` takes
        (`control_protocol.MAX_BATCH`).
        """
        share = self.advised_batch_share
        if share is None or not 1 <= share < math.inf:
            return None
        return min(int(share), MAX_BATCH)

    def flows_changed(self) -> None:
        """The mesh's connections changed (`Mesh.connect`): register them anew."""
        self._restate.set()

    def exchange_agreed(self, kind: str) -> None:
        """The job's ranks agreed how to reduce (`gradlane.daemon.fields.EXCHANGES`): tell
        gradlaned."""
        self.exchange = kind  # before the flag: a session starting now says it itself
        if exchange_fields(kind, self._features):
            self._restate.set()

    def batch_agreed(self, samples: int) -> None:
        """The job's ranks agreed on its global batch (samples per step, all ranks): tell
        gradlaned, which passes it on to the control plane."""
        self.global_batch = samples  # before the flag, as in `exchange_agreed`
        if "global_batch" in self._features:
            self._restate.set()

    def _agreed_fields(self) -> dict[str, Any]:
        """What the ranks agreed, in the optional fields the daemon accepts."""
        said = exchange_fields(self.exchange, self._features)
        if self.global_batch is not None and "global_batch" in self._features:
            said["global_batch"] = self.global_batch
        return said

    def _flows_message(self) -> dict[str, Any]:
        flows = self._flows()  # first: it counts those it leaves out
        left_out: dict[str, Any] = {}
        if self._left_out and "flows_left_out" in self._features:
            left_out["flows_left_out"] = self._left_out
        if self._left_out and "left_out_from" in self._features:
            left_out["left_out_from"] = self._left_out_from  # the NICs its traffic leaves by
        return {"type": "flows", "flows": flows, **left_out, **self._agreed_fields()}

    def _post(self, message: dict[str, Any]) -> None:
        """Queue a report (advisory: dropped while no daemon listens, or when it is behind)."""
        if not self.connected:
            return
        with contextlib.suppress(queue.Full):
            self._outbox.put_nowait(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # -- the background thread ------------------------------------------------

    def _band(self, band: int) -> int:
        if self.daemon_bands is None:
            return band
        return min(band, len(self.daemon_bands) - 1)

    def _run(self) -> None:
        wait = RETRY_S
        while not self._stop.is_set():
            path = self.config.daemon_socket
            refused = False
            if not os.path.exists(path):
                self._absent(f"no gradlaned socket at {path}")
            else:
                try:
                    self._session(path)
                except Refused as exc:
                    refused = True
                    self._absent(f"gradlaned at {path}: {exc}",
                                 f"asking again ever less often, up to every {MAX_RETRY_S:g} s")
                except PermissionError as exc:
                    self._absent(f"gradlaned at {path}: {exc} (the socket is for root and the "
                                 "group its daemon.socket_group names: add this user to it)")
                except (OSError, ProtocolError, ValueError) as exc:
                    self._absent(f"gradlaned at {path}: {exc}")
                except Exception as exc:  # whatever a daemon says, this thread goes on
                    logger.debug("gradlane: session with gradlaned failed", exc_info=True)
                    self._absent(f"gradlaned at {path}: {type(exc).__name__}: {exc}")
            self.connected = False
            wait = next_retry(wait, refused)
            self._stop.wait(wait)

    def _absent(self, why: str, retry: str | None = None) -> None:
        if not self._said_absent:
            logger.warning("gradlane: %s; training goes on with the local priority order (%s)",
                           why, retry or f"retrying every {RETRY_S:g} s")
            self._said_absent = True

    def _session(self, path: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            sock.connect(path)
            decoder = protocol.FrameDecoder()
            said = self._flows()
            sock.sendall(
                protocol.encode(
                    {
                        "type": "hello",
                        "version": protocol.VERSION,
                        "job": self.config.job,
                        "rank": self.rank,
                        "world_size": self.world,
                        "flows": said,
                    }
                )
            )
            welcome = self._read(sock, decoder)
            if welcome.get("type") == "error":  # refused: the daemon's reason, not "no welcome"
                self._handle(welcome)
            if welcome.get("type") != "welcome":
                raise ProtocolError("order", f"expected welcome, got {welcome.get('type')!r}")
            self._adopt_bands(welcome.get("bands"))
            self.advised_leaf = _leaf(welcome.get("leaf"))
            host = welcome.get("host")
            self.daemon_host = host if isinstance(host, str) and 0 < len(host) <= 256 else None
            self.nic_rates = _nic_rates(welcome.get("nics"))
            self._features = features(welcome)  # an older daemon refuses fields it lacks
            self.connected, self._said_absent = True, False
            # Agreed before this session (or while it began): say it now. So too the
            # connections' bands, if the welcome's table maps them otherwise than the
            # hello did (the daemon gained bands since the last session).
            self._restate.clear()  # what follows says it all
            if self._agreed_fields() or self._left_out or self._flows() != said:
                sock.sendall(protocol.encode(self._flows_message()))
            self.welcomed.set()
            logger.info("gradlane: registered with gradlaned as %s", welcome.get("worker"))
            while not self._stop.is_set():
                try:
                    message = self._outbox.get(timeout=0.2)
                except queue.Empty:
                    message = None
                # The state first: a report queued after a change follows it.
                restate = None
                if self._restate.is_set():
                    self._restate.clear()  # before reading the state: a later change resends
                    restate = self._flows_message()
                for out in (restate, message):
                    if out is not None:
                        sock.sendall(protocol.encode(out))
                self._poll(sock, decoder)
            sock.settimeout(1.0)
            sock.sendall(protocol.encode({"type": "bye"}))

    def _poll(self, sock: socket.socket, decoder: protocol.FrameDecoder) -> None:
        """Take what the daemon sent, without waiting. (A socket with a timeout waits
        for it before every recv, MSG_DONTWAIT or not: the reports queued behind,
        one per 0.2 s.)"""
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("gradlaned closed the connection")
        for message in decoder.feed(data):
            self._handle(message)

    def _read(self, sock: socket.socket, decoder: protocol.FrameDecoder) -> dict[str, Any]:
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("gradlaned closed the connection")
            messages = list(decoder.feed(data))
            for extra in messages[1:]:
                self._handle(extra)
            if messages:
                return messages[0]

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "plan":
            self.plan = message
            if self._adopt_bands(message.get("bands")):  # a reload: the daemon's bands changed
                self._restate.set()
            share = message.get("batch_share")
            self.advised_batch_share = float(share) if isinstance(share, int | float) else None
            self.advised_owners = _owners(message.get("ownership"), self.world)
        elif kind == "error":
            raise Refused(str(message.get("code")), str(message.get("message")))

    def _adopt_bands(self, bands: object) -> bool:
        """Mark the connections with the daemon's DSCP table; True if it changed."""
        if not (isinstance(bands, list) and bands and all(isinstance(b, int) for b in bands)):
            return False
        table = tuple(bands)
        if table == self.daemon_bands:
            return False
        self.daemon_bands = table
        ours = tuple(table[self._band(b)] for b in range(len(self.mesh.dscp)))
        self.mesh.remark(ours)
        return True

    def _flows(self) -> list[dict[str, object]]:
        flows = self.mesh.flows()
        self._left_out = len(flows) if len(flows) > protocol.MAX_FLOWS else 0
        if self._left_out:
            self._left_out_from = sorted({str(f["src"]) for f in flows})[:protocol.MAX_SOURCES]
            # gradlaned refuses a worker of more connections than it registers, and the
            # worker's job, timings, batch shares and chunk owners would go with them.
            # Registered with none, the connections keep their DSCP marks, which the daemon
            # classifies by band (`gradlane.daemon.service.DSCP_JOB`).
            if not self._said_unregistered:
                logger.warning(
                    "gradlane: rank %d has %d band connections, more than gradlaned "
                    "registers (%d): it registers none, and they are scheduled by their "
                    "DSCP marks alone (band order and its job's priority kept, not the "
                    "job's rate)",
                    self.rank, len(flows), protocol.MAX_FLOWS)
                self._said_unregistered = True
            return []
        for flow in flows:
            flow["band"] = self._band(int(flow["band"]))  # type: ignore[call-overload]
        return flows


def _nic_rates(value: object) -> dict[str, int]:
    """A welcome's ``nics`` (``[address, bit/s]`` pairs) by address; what is not such a
    pair is left out."""
    if not isinstance(value, list):
        return {}
    return {pair[0]: pair[1] for pair in value[:MAX_NICS]
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
            and type(pair[1]) is int and pair[1] > 0}


def _leaf(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _owners(value: object, world: int) -> tuple[int, ...] | None:
    """A plan's chunk owners for this job, if they are ranks of it (else None)."""
    if not (isinstance(value, list) and value):
        return None
    if all(type(o) is int and 0 <= o < world for o in value):
        return tuple(value)
    return None
