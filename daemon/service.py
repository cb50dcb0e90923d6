"""gradlaned: the per-host service.

`Daemon.serve()` owns one `asyncio.TaskGroup` with:

1. the Unix-socket API for shims (`gradlane.daemon.protocol`),
2. the reconcile loop: registry + policy -> `QdiscSpec` per interface ->
   `QdiscManager.apply` (a change finding the loop idle is applied at once,
   later ones in a burst are coalesced; every apply is an idempotent diff,
   so a repeated or lost wake-up costs nothing),
3. expiry of workers whose process died without closing its connection,
4. a stats sampler feeding `/status` and `/metrics` (localhost HTTP).

Start-up order: qdisc tree installed (a tree left by a crash is taken over,
or restored first with ``on_start = "restore"``), then the socket bound,
then HTTP, then readiness (`ready` event, sd_notify READY=1). Shutdown:
stop accepting, close clients, restore every interface's original qdisc,
remove the socket; bounded by `SHUTDOWN_TIMEOUT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import json
import logging
import math
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradlane import __version__
from gradlane.daemon import protocol
from gradlane.daemon.config import DaemonConfig, InterfaceConfig
from gradlane.daemon.control import read_token, start_site
from gradlane.daemon.qdisc import (
    ClassStats,
    FlowMatch,
    JobSpec,
    QdiscManager,
    QdiscSpec,
    RootWatch,
)
from gradlane.daemon.registry import Credentials, Registry, Worker
from gradlane.daemon.uplink import ControlLink
from gradlane.errors import (
    ConfigError,
    ForeignQdiscError,
    GradlaneError,
    ProtocolError,
    TcError,
)
from gradlane.openfiles import NoRoom, make_room
from gradlane.policies import JobClassPlan, JobState, Plan, State, get_policy
from gradlane.units import MIN_RATE_BPS

__all__ = ["DSCP_JOB", "RESTART_FIELDS", "Backend", "Daemon", "host_id"]

# What gradlaned sets up once, at start: a reload (SIGHUP) cannot change these.
RESTART_FIELDS = ("interfaces", "socket_path", "socket_group", "socket_mode", "http",
                  "state_dir", "control_url", "control_token_file", "control_host",
                  "control_leaf")

logger = logging.getLogger(__name__)

DSCP_JOB = "_dscp"  # class for DSCP-marked traffic of flows nobody registered
SHUTDOWN_TIMEOUT = 10.0
STATS_EVERY = 1.0
VERIFY_EVERY = 30.0  # re-read the kernel's tree to repair changes made behind our back
# ... and less often when a re-read takes long (thousands of flows registered: about 0.1 ms
# each), so that it takes at most this share of the time.
VERIFY_SHARE = 0.05
EXPIRE_EVERY = 1.0
SEND_TIMEOUT = 5.0


def _room_for_clients(clients: int) -> None:
    """Let `clients` shims connect (a file each): raise the soft open-file limit
    (`gradlane.openfiles.make_room`; the usual 1,024 is below a large max_clients).

    Raises:
        ConfigError: the hard limit leaves no room.
    """
    try:
        make_room(clients, f"{clients} clients")
    except NoRoom as no:
        raise ConfigError(
            f"daemon.max_clients = {clients} needs {no.needed} open files with the "
            f"{no.in_use} open now, over this process's limit of {no.hard}: raise "
            "LimitNOFILE= in gradlaned's unit (or ulimit -n), or lower daemon.max_clients"
        ) from None


def host_id() -> str:
    """An opaque name of the host gradlaned serves, the same for every worker it serves.

    The kernel's boot id and gradlaned's network namespace: workers of one
    daemon share a host even with an address each (pods that mount the
    daemon's socket), and two namespaces of one machine (the testbed's
    hosts) are two hosts. Shims reduce within hosts by it
    (`gradlane.shim.transport.reduction_groups`). A random name when the
    kernel does not say (only cost: co-located workers attached across a
    restart of gradlaned count as two hosts).
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return os.urandom(16).hex()


class Backend(Protocol):
    """What the daemon needs of an interface's qdisc owner (`QdiscManager` is one)."""

    ifname: str

    def open(self) -> None: ...
    def close(self) -> None: ...
    def owned(self) -> bool: ...
    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]: ...
    def restore(self) -> bool: ...
    def class_stats(self) -> list[ClassStats]: ...
    def addresses(self) -> set[str]: ...


def qdisc_backend(iface: InterfaceConfig, config: DaemonConfig) -> Backend:
    return QdiscManager(iface.name, state_file=config.state_dir / f"qdisc-{iface.name}.json",
                        exclusive=True)


class Daemon:
    """One gradlaned. `serve()` runs it until `stop()` (or a signal in the CLI)."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        backend_factory: Callable[[InterfaceConfig, DaemonConfig], Backend] = qdisc_backend,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.policy = get_policy(config.policy)
        self.registry = Registry(len(config.bands), clock=clock)
        self._clock = clock
        self._backends = [backend_factory(i, config) for i in config.interfaces]
        self._addresses: dict[str, set[str]] = {}
        self._planned_for: tuple[object, list[Backend]] | None = None  # `_planned`'s last
        # One thread owns every netlink socket: pyroute2's sync API keeps
        # per-thread state, and one worker also serializes the calls.
        self._tc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradlane-tc")
        self._dirty = asyncio.Event()
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()
        self._clients: dict[asyncio.StreamWriter, str | None] = {}
        self._started = time.time()
        self._host = host_id()
        self._plan: Plan | None = None
        self._plan_at = 0.0
        self._plan_version = 0
        self._verified_at = -math.inf  # never: the first reconcile verifies
        self._verify_every = VERIFY_EVERY
        self._stats: dict[str, list[ClassStats]] = {}
        self._reconciles = 0
        self._reconcile_errors = 0
        self._last_changes: list[str] = []
        self._unshaped: dict[str, str] = {}  # interface -> why gradlaned leaves it alone
        self.api_errors: Counter[str] = Counter()
        self.metrics = CollectorRegistry(auto_describe=True)
        self._reconcile_hist = Histogram(
            "gradlane_reconcile_seconds",
            "Time from a registry change being picked up to the kernel having it",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5),
            registry=self.metrics,
        )
        self._api_error_counter = PromCounter(
            "gradlane_api_errors",
            "Connections closed for a protocol error, by kind",
            ["kind"],
            registry=self.metrics,
        )
        self._chunk_counter = PromCounter(
            "gradlane_chunk_events", "Chunk events reported by shims", registry=self.metrics
        )
        self.link: ControlLink | None = None
        # Registering collects once (to describe the metrics), so after self.link exists.
        self.metrics.register(_StateCollector(self))
        if config.control_url:
            if config.control_token_file is None:
                raise ConfigError("control.url needs control.token_file")
            self.link = ControlLink(
                config.control_url,
                read_token(config.control_token_file),
                config.control_host or socket.gethostname(),
                config.control_leaf,
                [(i.name, i.rate_bps) for i in config.interfaces],
                self.registry,
                self._plan_changed,
                clock=clock,
                band_throughput=self._band_throughput,
                link_bps=self.link_bps,
            )

    def _band_throughput(self) -> dict[str, list[float]]:
        """Per job, the measured bit/s of each of its band leaves (summed over interfaces)."""
        out: dict[str, list[float]] = {}
        for stats in self._stats.values():
            for c in stats:
                if c.role == "band" and c.job and c.band is not None and c.throughput_bps:
                    bands = out.setdefault(c.job, [])
                    bands += [0.0] * (c.band + 1 - len(bands))
                    bands[c.band] += c.throughput_bps
        return out

    # -- lifecycle -------------------------------------------------------

    def stop(self) -> None:
        """Ask `serve` to shut down (safe from a signal handler)."""
        self._stopping.set()

    async def serve(self, notify_socket: str | None = None) -> None:
        """Run until `stop()`; restore every interface on the way out, whatever happens."""
        gid = self._socket_gid()  # before anything is touched
        _room_for_clients(self.config.max_clients)
        await self._open_tc()  # raises, nothing touched, if another gradlaned holds one
        watch: RootWatch | None = None
        try:
            await self._start_tc()
            server: asyncio.Server | None = None
            runner: web.AppRunner | None = None
            try:
                watch = self._watch_roots()
                server = await self._start_socket(gid)
                runner = await self._start_http()
                self.ready.set()
                _sd_notify(notify_socket, "READY=1")
                logger.info(
                    "gradlaned %s ready: %s, policy %s",
                    __version__,
                    ", ".join(b.ifname for b in self._backends),
                    self.policy.name,
                )
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self._reconcile_loop())
                    tasks.create_task(self._expire_loop())
                    tasks.create_task(self._stats_loop())
                    if self.link is not None:
                        tasks.create_task(self.link.run())
                    await self._stopping.wait()
                    raise _Stop
            except* _Stop:
                pass
            finally:
                _sd_notify(notify_socket, "STOPPING=1")
                if server is not None:
                    server.close()
                    # Ours only once bound: a gradlaned that refused a served socket
                    # leaves it to the one serving it.
                    with contextlib.suppress(FileNotFoundError):
                        self.config.socket_path.unlink()
                    for writer in list(self._clients):
                        writer.close()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(SHUTDOWN_TIMEOUT):
                            await server.wait_closed()
                if runner is not None:
                    await runner.cleanup()
        finally:
            if watch is not None:  # before restoring: that deletes our roots too
                asyncio.get_running_loop().remove_reader(watch.fileno())
                watch.close()
            await self._restore_tc()
            logger.info("gradlaned stopped; original qdiscs restored")

    async def reload(self, config: DaemonConfig) -> None:
        """Take a new config (SIGHUP): bands, shares, the policy and the limits apply at
        once; a change to what is set up at start (`RESTART_FIELDS`) reloads nothing."""
        changed = [f for f in RESTART_FIELDS if getattr(config, f) != getattr(self.config, f)]
        if changed:
            logger.error("reload: %s changed; restart gradlaned to apply it (nothing reloaded)",
                         ", ".join(changed))
            return
        try:
            policy = get_policy(config.policy)
            _room_for_clients(config.max_clients)
        except ConfigError as exc:  # the file names a policy not here: keep the one running
            logger.error("reload refused: %s (nothing reloaded)", exc)
            return
        self.config, self.policy = config, policy
        self.registry.set_bands(len(config.bands))
        self._plan_changed()  # the shims mark their connections by the new bands
        logger.info("configuration reloaded from %s", config.source)

    # -- traffic control -------------------------------------------------

    async def _tc(self, fn: Callable[..., Any], *args: Any) -> Any:
        # pyroute2's sync socket cannot run inside the event loop.
        return await asyncio.get_running_loop().run_in_executor(self._tc_thread, fn, *args)

    async def _open_tc(self) -> None:
        """Open every interface (each claimed: `QdiscManager`'s ``exclusive``); if one
        cannot be, close those opened and give up before any is read or changed."""
        try:
            for backend in self._backends:
                await self._tc(backend.open)
        except BaseException:
            for backend in self._backends:
                await self._tc(backend.close)
            self._tc_thread.shutdown(wait=True)
            raise

    async def _start_tc(self) -> None:
        for backend in self._backends:
            if await self._tc(backend.owned):
                if self.config.on_start == "restore":
                    logger.warning("%s: restoring a tree left by a previous run", backend.ifname)
                    await self._tc(backend.restore)
                else:
                    logger.warning("%s: taking over a tree left by a previous run", backend.ifname)
        await self._reconcile()

    def _watch_roots(self) -> RootWatch | None:
        """Verify at once when the kernel says a root qdisc of ours was deleted or replaced
        (`tc qdisc del`, another tool's own), not up to `VERIFY_EVERY` later."""
        def unheard(exc: OSError) -> None:
            logger.warning("no netlink word of qdisc changes (%s): gradlaned repairs its "
                           "trees every %.0f s only", exc, self._verify_every)

        try:
            watch = RootWatch()
        except OSError as exc:
            unheard(exc)
            return None

        def heard() -> None:
            try:
                changed = watch.roots_changed()
            except OSError as exc:  # not to be retried at every wake-up
                unheard(exc)
                asyncio.get_running_loop().remove_reader(watch.fileno())
                return
            if not changed:  # a qdisc below a root, or gradlane's own root put in
                return
            ours = set()
            for backend in self._backends:
                with contextlib.suppress(OSError):  # gone: the verification will say so
                    ours.add(socket.if_nametoindex(backend.ifname))
            if changed & ours or watch.ALL in changed:
                self._verified_at = -math.inf
                self._dirty.set()

        asyncio.get_running_loop().add_reader(watch.fileno(), heard)
        return watch

    async def _restore_tc(self) -> None:
        for backend in self._backends:
            try:
                await self._tc(backend.restore)
            except GradlaneError as exc:
                if isinstance(exc, TcError) and exc.errno == errno.ENODEV:
                    logger.warning("%s; nothing to restore", exc)  # gone, or never there
                else:
                    logger.exception("%s: could not restore the original qdisc", backend.ifname)
            finally:
                await self._tc(backend.close)
        self._tc_thread.shutdown(wait=True)

    def state(self) -> State:
        shaped = self._basis()
        jobs = tuple(
            JobState(name=name, workers=len(ws), flows=sum(len(w.flows) for w in ws))
            for name, ws in sorted(self.registry.jobs().items())
        )
        return State(shaped_bps=shaped, other_bps=int(shaped * self.config.other_share), jobs=jobs)

    def _nics(self) -> list[list[Any]]:
        """Every address of the interfaces gradlaned shapes, with the rate it shapes that
        interface to: a shim listening on several (one per NIC) weighs them by it."""
        return [[address, self._shaped(b)] for b in self._backends
                for address in sorted(self._addresses.get(b.ifname, ()))]

    def _planned(self) -> list[Backend]:
        """The interfaces a plan's host link is made of: those whose addresses carry
        registered flows, or the connections a worker left out (a shim with an address
        per NIC spreads its chunks over them all: `gradlane.shim.transport.Mesh`); with
        one interface, or no flow on any yet, the slowest."""
        if len(self._backends) == 1:
            return self._backends
        # Asked for by `state`, every interface's `spec_for` and the reports: one pass
        # over the flows per change of them or of the interfaces' addresses.
        key = (self.registry.version,
               tuple(frozenset(self._addresses.get(b.ifname, ())) for b in self._backends))
        if self._planned_for is None or self._planned_for[0] != key:
            used = {src for ws in self.registry.jobs().values() for w in ws
                    for src in (*(f.src for f in w.flows), *w.left_out_from)}
            carrying = [b for b in self._backends
                        if self._addresses.get(b.ifname, set()) & used]
            self._planned_for = key, carrying or [self._slowest()]
        return self._planned_for[1]

    def _slowest(self) -> Backend:
        return min(self._backends, key=self._shaped)

    def link_bps(self) -> int:
        """This host's link as plans take it, at the interfaces' configured rates
        (`_planned`): what the control plane is told, and plans the classes it sends for."""
        return sum(self._interface(b).rate_bps for b in self._planned())

    def _basis(self) -> int:
        """`link_bps` as shaped: what the local policy's classes are for (`state`)."""
        return sum(self._shaped(b) for b in self._planned())

    def _interface(self, backend: Backend) -> InterfaceConfig:
        return next(i for i in self.config.interfaces if i.name == backend.ifname)

    def _shaped(self, backend: Backend) -> int:
        return int(self._interface(backend).rate_bps * self.config.shape_fraction)

    def spec_for(self, backend: Backend, plan: Plan) -> QdiscSpec:
        """The desired tree of one interface under `plan`.

        A plan's job classes are for the host's link (`state`, `_basis`: the
        interfaces that carry flows, summed; a control plane's are brought to
        it in `_reconcile`): each interface gets them scaled by its rate over
        that link, so a job is neither held to a slower NIC's rate on a faster
        one nor given a whole host's worth on each of several.
        """
        shaped = self._shaped(backend)
        scale = shaped / self._basis()
        other = max(1, int(shaped * self.config.other_share))
        local = self._addresses.get(backend.ifname, set())
        only_one = len(self._backends) == 1
        # Unregistered but DSCP-marked traffic keeps its band order, on borrowed bandwidth.
        trickle = max(shaped // 1000, MIN_RATE_BPS)
        registered = sorted(self.registry.jobs().items())
        jobs = [JobSpec(DSCP_JOB, rate_bps=trickle, ceil_bps=shaped,
                        prio=self._dscp_prio(registered, plan))]
        top = len(self.config.bands) - 1
        for name, workers in registered:
            cls = plan.job_classes[name]
            # A flow registered before a reload to fewer bands goes with the last one, as
            # its shim maps its connections (`DaemonClient._band`) once it hears of them.
            flows = tuple(
                FlowMatch(min(f.band, top), src=f.src, sport=f.sport, dst=f.dst, dport=f.dport)
                for w in workers
                for f in w.flows
                if only_one or f.src in local
            )
            # No class under the trickle: a control plane's rate of a few bit/s would not
            # fit HTB's burst arithmetic (its time per burst overflows 32 bits).
            rate = max(trickle, min(int(cls.rate_bps * scale), shaped))
            jobs.append(
                JobSpec(
                    name,
                    rate_bps=rate,
                    ceil_bps=max(rate, min(int(cls.ceil_bps * scale), shaped)),
                    prio=cls.prio,
                    flows=tuple(dict.fromkeys(flows)),  # one filter per distinct 5-tuple
                )
            )
        return QdiscSpec(
            rate_bps=shaped,
            other_rate_bps=other,
            bands=self.config.bands,
            jobs=tuple(jobs),
            dscp_job=DSCP_JOB,
        )

    @staticmethod
    def _dscp_prio(jobs: list[tuple[str, list[Worker]]], plan: Plan) -> int:
        """The DSCP class's priority: that of the first-served job with workers whose
        connections were left out (too many to register: its packets go by their marks
        alone), so a job the plan put later is not served first where bandwidth is
        borrowed; 0 (first) with none, for marked traffic of shims not registered yet."""
        return min((plan.job_classes[name].prio for name, workers in jobs
                    if any(w.flows_left_out for w in workers)), default=0)

    def _plan_now(self) -> Plan:
        plan = self.policy.plan(self.state())
        control = self.link.job_classes() if self.link is not None else None
        if control:
            # The control plane's classes for the jobs it knows; the local policy's for
            # a job too new to be in its plan yet. The control plane's are for the link it
            # planned with (an older one's: the slowest interface), the local policy's for
            # `link_bps`: brought to one (they differ until it has heard of new flows).
            assert self.link is not None
            basis = (self.link.planned_link_bps()
                     or self._interface(self._slowest()).rate_bps)
            scale = self.link_bps() / basis
            plan = Plan(job_classes={j: _scaled(control[j], scale) if j in control else c
                                     for j, c in plan.job_classes.items()},
                        source="control", version=plan.version)
        return plan

    async def _reconcile(self) -> None:
        started = time.perf_counter()
        try:  # a policy's failure (a third party's, by module path) leaves the tree as it is
            plan = self._plan_now()
        except Exception:
            self._reconcile_errors += 1
            logger.exception("policy %s failed to plan; retrying on the next change",
                             self.policy.name)
            return
        changes: list[str] = []
        verify = self._clock() - self._verified_at >= self._verify_every
        planned, applying = time.perf_counter(), self._clock()
        try:
            for backend in self._backends:
                if verify:  # an address may come or go after the start (DHCP, a late NIC)
                    self._addresses[backend.ifname] = await self._tc(backend.addresses)
                spec = self.spec_for(backend, plan)
                try:
                    changes += await self._tc(partial(backend.apply, spec, verify=verify))
                except ForeignQdiscError as exc:
                    # An operator's own root: left alone, and this interface unshaped until
                    # it goes (every reconcile looks again); the others are shaped.
                    if self._unshaped.get(backend.ifname) != str(exc):
                        logger.warning("%s not shaped: %s", backend.ifname, exc)
                    self._unshaped[backend.ifname] = str(exc)
                else:
                    self._unshaped.pop(backend.ifname, None)
        except Exception as exc:  # netlink's own errors included: the daemon must keep running
            if isinstance(exc, TcError) and exc.errno == errno.EPERM:  # would never succeed
                raise GradlaneError(f"{exc}: gradlaned needs CAP_NET_ADMIN (run it as root, "
                                    "or as systemd/gradlaned.service does)") from None
            self._reconcile_errors += 1
            logger.exception("reconcile failed; retrying on the next change")
            return
        self._plan, self._plan_at = plan, self._clock()
        if verify:
            self._verified_at = self._plan_at
            self._pace_verification(self._plan_at - applying)
        self._reconciles += 1
        self._last_changes = changes
        done = time.perf_counter()
        self._reconcile_hist.observe(done - started)
        logger.debug(
            "reconcile: plan %.2f ms, apply %.2f ms%s: %s",
            (planned - started) * 1000,
            (done - planned) * 1000,
            " (verified)" if verify else "",
            changes,
        )

    def _pace_verification(self, took: float) -> None:
        """The next verification `VERIFY_EVERY` after this one, or later if this one
        took more than `VERIFY_SHARE` of that (said when the pace changes by a quarter)."""
        every = max(VERIFY_EVERY, took / VERIFY_SHARE)
        if abs(every - self._verify_every) > self._verify_every / 4:
            logger.info("verifying the kernel's trees every %.0f s (the last verification "
                        "took %.2f s)", every, took)
        self._verify_every = every

    async def _reconcile_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a
            # cancellation that races with the event, and shutdown would hang.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._verify_every):  # to verify now and then
                    await self._dirty.wait()
            # Leading edge: a change that finds the daemon idle is applied at
            # once; what arrives during a reconcile or within coalesce_s after
            # it is gathered into the next one, so a burst costs few applies.
            self._dirty.clear()
            await self._reconcile()
            await asyncio.sleep(self.config.coalesce_s)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY)
            for worker in self.registry.expire():
                logger.info(
                    "worker %s (job %s, pid %d) expired", worker.id, worker.job, worker.cred.pid
                )
                self._dirty.set()

    async def _stats_loop(self) -> None:
        while True:
            for backend in self._backends:
                try:
                    self._stats[backend.ifname] = await self._tc(backend.class_stats)
                except Exception:  # netlink's own errors too: the counters come back later
                    logger.exception("%s: reading class statistics failed", backend.ifname)
            await asyncio.sleep(STATS_EVERY)

    # -- the local API ---------------------------------------------------

    def _socket_gid(self) -> int:
        """The group to own the socket (-1: the daemon's own)."""
        group = self.config.socket_group
        try:
            return grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise GradlaneError(f"no group {group!r} to own {self.config.socket_path} "
                                f"(daemon.socket_group): create it (groupadd {group}) or name "
                                "another") from None

    async def _start_socket(self, gid: int) -> asyncio.Server:
        path = self.config.socket_path
        server: asyncio.Server | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                if await _someone_listens(path):
                    raise GradlaneError(f"another gradlaned is serving {path}; stop it first")
                path.unlink()
            server = await asyncio.start_unix_server(self._client, path=str(path))
            os.chmod(path, self.config.socket_mode)
            os.chown(path, -1, gid)
        except OSError as exc:
            if server is not None:  # bound, but not as configured: not left half-made
                server.close()
                path.unlink(missing_ok=True)
            where = f"{exc.filename}: " if exc.filename and exc.filename != str(path) else ""
            raise GradlaneError(f"cannot serve shims on {path}: {where}{exc.strerror or exc} "
                                "(`gradlaned --check` checks the socket's place)") from None
        return server

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cred = _peer_credentials(writer)
        worker: Worker | None = None
        self._clients[writer] = None
        try:
            if len(self._clients) > self.config.max_clients:
                raise ProtocolError("limit", f"too many clients (max {self.config.max_clients})")
            decoder = protocol.FrameDecoder()
            while True:
                data = await reader.read(65536)
                if not data:
                    if decoder.pending:
                        raise ProtocolError("bad_frame", "connection closed inside a frame")
                    return
                for raw in decoder.feed(data):
                    message = protocol.parse(raw, len(self.config.bands))
                    if isinstance(message, protocol.Bye):
                        return
                    worker = await self._handle(message, worker, cred, writer)
        except ProtocolError as exc:
            self.api_errors[exc.code] += 1
            self._api_error_counter.labels(exc.code).inc()
            logger.info("client pid %d: %s error: %s", cred.pid, exc.code, exc)
            with contextlib.suppress(ConnectionError, TimeoutError, ProtocolError):
                await self._send(writer, {"type": "error", "code": exc.code, "message": str(exc)})
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self._clients.pop(writer, None)
            if worker is not None and self.registry.remove(worker.id) is not None:
                self._dirty.set()
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(SEND_TIMEOUT):
                    await writer.wait_closed()

    async def _handle(
        self,
        message: protocol.Message,
        worker: Worker | None,
        cred: Credentials,
        writer: asyncio.StreamWriter,
    ) -> Worker:
        if isinstance(message, protocol.Hello):
            if worker is not None:
                raise ProtocolError("order", "hello sent twice on one connection")
            worker = self.registry.add(message, cred)
            self._clients[writer] = worker.id
            self._dirty.set()
            await self._send(
                writer,
                {
                    "type": "welcome",
                    "version": protocol.VERSION,
                    "worker": worker.id,
                    "bands": list(self.config.bands),
                    # Read once at attach: the job's reduction trees never change mid-run.
                    "leaf": self.link.advised_leaf() if self.link is not None else None,
                    "host": self._host,
                    "nics": self._nics(),
                    "features": list(protocol.FEATURES),
                },
            )
            await self._send(writer, self._plan_message(worker))
            return worker
        if worker is None:
            raise ProtocolError("order", f"{type(message).__name__.lower()} before hello")
        if isinstance(message, protocol.SetFlows):
            if message.flows_left_out and not worker.flows_left_out:
                logger.info("worker %s (job %r rank %d): %d band connections, more than a "
                            "worker registers (%d): none registered, its packets go by their "
                            "DSCP marks alone", worker.id, worker.job, worker.rank,
                            message.flows_left_out, protocol.MAX_FLOWS)
            self.registry.set_flows(worker.id, message.flows, message.exchange,
                                    message.global_batch, message.flows_left_out,
                                    message.left_out_from)
            self._dirty.set()
        elif isinstance(message, protocol.Chunks):
            self.registry.record_chunks(worker.id, message.iteration, message.events)
            self._chunk_counter.inc(len(message.events))
        elif isinstance(message, protocol.Timing):
            self.registry.record_timing(worker.id, message)
        return worker

    def _plan_message(self, worker: Worker) -> dict[str, Any]:
        share, owners = (
            self.link.advice(worker.job, worker.rank) if self.link is not None else (None, None)
        )
        return {
            "type": "plan",
            "version": self._plan_version,
            "bands": list(self.config.bands),
            "batch_share": share,  # from the control plane (straggler mitigation)
            "ownership": owners,
        }

    def _plan_changed(self) -> None:
        """A control plan arrived or expired, or a reload: re-plan, and tell every shim
        its part."""
        self._plan_version += 1
        self._dirty.set()
        workers = {w.id: w for w in self.registry.workers()}
        for writer, worker_id in list(self._clients.items()):
            worker = workers.get(worker_id or "")
            if worker is not None:
                asyncio.get_running_loop().create_task(self._send_quietly(writer, worker))

    async def _send_quietly(self, writer: asyncio.StreamWriter, worker: Worker) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError, ProtocolError):
            await self._send(writer, self._plan_message(worker))

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        writer.write(protocol.encode(message))
        async with asyncio.timeout(SEND_TIMEOUT):
            await writer.drain()

    # -- HTTP: /status and /metrics ---------------------------------------

    async def _start_http(self) -> web.AppRunner | None:
        address = self.config.http_address
        if address is None:
            return None
        app = web.Application(client_max_size=1024)
        app.router.add_get("/status", self._status_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2)
        await runner.setup()
        await start_site(runner, *address, "/status and /metrics")
        return runner

    def status(self) -> dict[str, Any]:
        """Everything `gradlane status` shows, as JSON-ready data."""
        plan = self._plan
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self._started, 3),
            "host": self._host,
            "policy": self.policy.name,
            "control": self.link.status() if self.link is not None else None,
            "plan": {
                "source": plan.source if plan else None,
                "age_s": round(self._clock() - self._plan_at, 3) if plan else None,
                "version": self._plan_version,
            },
            "reconcile": {
                "count": self._reconciles,
                "errors": self._reconcile_errors,
                "last_changes": self._last_changes[-20:],
                "verify_every_s": round(self._verify_every, 3),
            },
            "link_bps": self.link_bps(),  # the host's link as plans take it
            "interfaces": [
                {
                    "name": b.ifname,
                    "shaped_bps": self._shaped(b),
                    "not_shaped": self._unshaped.get(b.ifname),
                    "classes": [asdict(c) for c in self._stats.get(b.ifname, [])],
                }
                for b in self._backends
            ],
            "jobs": [
                {
                    "name": name,
                    "workers": [_worker_status(w) for w in workers],
                }
                for name, workers in sorted(self.registry.jobs().items())
            ],
            "clients": len(self._clients),
            "api_errors": dict(self.api_errors),
        }

    async def _status_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.status(), dumps=lambda v: json.dumps(v, indent=1))

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")


class _Stop(Exception):
    pass


class _StateCollector:
    """Prometheus metrics read from the daemon's latest samples at scrape time."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterable[Metric]:
        labels = ["interface", "classid", "role", "job", "band"]
        counters = {
            name: CounterMetricFamily(f"gradlane_class_{name}", f"HTB class {name}", labels=labels)
            for name in ("bytes", "packets", "drops")
        }
        backlog = GaugeMetricFamily("gradlane_class_backlog_bytes", "Bytes queued", labels=labels)
        throughput = GaugeMetricFamily(
            "gradlane_job_throughput_bps", "Job class throughput", labels=["interface", "job"]
        )
        for ifname, stats in self.daemon._stats.items():
            for c in stats:
                values = [
                    ifname,
                    c.classid,
                    c.role,
                    c.job or "",
                    "" if c.band is None else str(c.band),
                ]
                counters["bytes"].add_metric(values, c.bytes)
                counters["packets"].add_metric(values, c.packets)
                counters["drops"].add_metric(values, c.drops)
                backlog.add_metric(values, c.backlog)
                if c.role == "job" and c.job is not None and c.throughput_bps is not None:
                    throughput.add_metric([ifname, c.job], c.throughput_bps)
        workers = GaugeMetricFamily("gradlane_workers", "Registered workers", labels=["job"])
        for name, ws in self.daemon.registry.jobs().items():
            workers.add_metric([name], len(ws))
        shaped = GaugeMetricFamily(
            "gradlane_interface_shaped",
            "1 while gradlane's tree shapes the interface, 0 while a root qdisc of someone "
            "else's keeps it out (see /status)", labels=["interface"])
        for backend in self.daemon._backends:
            shaped.add_metric([backend.ifname], 0 if backend.ifname in self.daemon._unshaped else 1)
        yield from counters.values()
        yield backlog
        yield throughput
        yield workers
        yield shaped
        link = self.daemon.link
        if link is not None:  # a [control] section: how many daemons follow it, summed
            yield GaugeMetricFamily("gradlane_control_connected",
                                    "1 while connected to the control plane", value=link.connected)
            yield GaugeMetricFamily(
                "gradlane_control_plan_fresh",
                "1 while a control plan is in force (within its TTL), 0 on the local policy",
                value=link.fresh())


def _scaled(cls: JobClassPlan, scale: float) -> JobClassPlan:
    """`cls` for a link `scale` times the one it was planned for."""
    if scale == 1:
        return cls
    rate = max(1, round(cls.rate_bps * scale))
    return JobClassPlan(rate, max(rate, round(cls.ceil_bps * scale)), cls.prio)


def _worker_status(worker: Worker) -> dict[str, Any]:
    last = worker.timings[-1] if worker.timings else None
    return {
        "id": worker.id,
        "rank": worker.rank,
        "world_size": worker.world_size,
        "pid": worker.cred.pid,
        "uid": worker.cred.uid,
        "flows": len(worker.flows),
        "flows_left_out": worker.flows_left_out,  # not registered: more than MAX_FLOWS
        "exchange": worker.exchange,  # how its job reduces, as its shim said (None: not yet)
        "global_batch": worker.global_batch or None,  # its job's samples per step (None: not yet)
        "iteration": worker.iteration,
        "chunk_events": worker.chunk_events,
        "chunk_bytes": worker.chunk_bytes,
        "last_timing": asdict(last) if last else None,
    }


_PEERCRED = struct.Struct("3i")


def _peer_credentials(writer: asyncio.StreamWriter) -> Credentials:
    sock = writer.get_extra_info("socket")
    pid, uid, gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return Credentials(pid, uid, gid)


async def _someone_listens(path: Path) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def _sd_notify(notify_socket: str | None, state: str) -> None:
    """Tell systemd (Type=notify) about readiness; a no-op outside systemd."""
    if not notify_socket:
        return
    address = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
        sock.sendto(state.encode(), address)
