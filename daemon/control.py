"""`gradlane control`: the cluster-wide control plane (aiohttp).

1. Daemons register (host, leaf, interfaces) and report their jobs and
   workers over a WebSocket (or by POST); see `control_protocol`.
2. A planner task runs the global policy on a cadence and soon after every
   change (a register, a report, a lost daemon). It takes a snapshot of the
   reports on the event loop and builds the state and the plan off it.
3. Each connected daemon gets only its part of the plan (its job classes,
   and batch shares and chunk owners of its jobs), versioned, with a
   time-to-live. A daemon that does not take it within `SEND_TIMEOUT` is
   disconnected; nobody else waits for it.
4. Views: ``/api/v1/cluster`` (hosts, jobs, plan, version), ``/metrics``.

Security: every request needs the bearer token (read from a file, compared
in constant time); the default address is 127.0.0.1; bodies and messages
are size-capped; a connection that breaks the protocol is closed with an
error and affects no other. State lives only in memory: after a restart it
is rebuilt from the daemons' re-registration (they reconnect by themselves),
and training never waits for the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gradlane import __version__
from gradlane.daemon import control_protocol as cp
from gradlane.daemon.fields import agreed_exchange
from gradlane.errors import ConfigError, GradlaneError, ProtocolError
from gradlane.policies import (
    DEFAULT_MAX_WEIGHED,
    Coflow,
    FlowTable,
    Host,
    JobClassPlan,
    JobState,
    Plan,
    State,
    Topology,
    Worker,
    get_policy,
)
from gradlane.policies.chunks import assign_owners, exchange_kind, host_groups
from gradlane.policies.demand import Exchange, bucket_starts
from gradlane.policies.loadbalance import load_solver
from gradlane.units import first_of

__all__ = ["ControlConfig", "ControlPlane", "read_token", "serve"]

logger = logging.getLogger(__name__)

SEND_TIMEOUT = 2.0
HELLO_TIMEOUT = 5.0
MAX_BODY = 1 << 20
LOST_AFTER_S = 30.0  # a disconnected daemon's jobs stay "degraded" this long
POST_SILENT_S = 10.0  # a daemon that reports by POST is lost after this long without one
# A job's demand flows merge consecutive layers into at most this many buckets: enough
# for the policies' bands (4-8 by forward order), few flows for a 1,024-host plan.
DEMAND_BUCKETS = 32


@dataclass(frozen=True)
class ControlConfig:
    token: str = field(repr=False)
    host: str = "127.0.0.1"
    port: int = 7800
    policy: str = "gradlane"
    cadence_s: float = 1.0
    react_s: float = 0.05  # plan this soon after a change, at the earliest
    ttl_s: float = 10.0
    max_daemons: int = 4096
    # Each leaf switch's uplink to the spine; None: a non-blocking fabric (plan as one switch).
    uplink_bps: int | None = None
    # A job's owner shares weigh at most so many loads (about 10 bytes each at a plan's
    # peak within leaves, 50 on the ring), else even owners and a note
    # (`gradlane.policies.base.DEFAULT_MAX_WEIGHED`).
    max_weighed: int = DEFAULT_MAX_WEIGHED

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ConfigError("the control token must be at least 16 characters")
        get_policy(self.policy)  # unknown names fail here, at start
        if not (0 < self.cadence_s <= 3600 and 0 <= self.react_s <= self.cadence_s):
            raise ConfigError("cadence_s must be in (0, 3600] and react_s in [0, cadence_s]")
        if not self.ttl_s > self.cadence_s:
            raise ConfigError("ttl_s must exceed cadence_s, or plans expire between pushes")
        if not self.ttl_s < cp.MAX_TTL_S:
            raise ConfigError(f"ttl_s must be under {cp.MAX_TTL_S:g} s (daemons refuse a plan "
                              f"that lives longer), got {self.ttl_s:g}")
        if self.uplink_bps is not None and self.uplink_bps <= 0:
            raise ConfigError("the uplink rate must be positive")
        if self.max_weighed < 1:
            raise ConfigError(f"max_weighed must be at least 1, got {self.max_weighed}")


async def start_site(runner: web.AppRunner, host: str, port: int, what: str) -> None:
    """Serve `runner` on host:port (`what` it serves, for the error).

    Raises:
        GradlaneError: the address is not this host's, or the port is taken.
    """
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise GradlaneError(f"cannot listen on {host}:{port} for {what}: "
                            f"{exc.strerror or exc}") from None


def read_token(path: Path, *, warn: bool = True) -> str:
    """The bearer token in `path` (surrounding whitespace ignored); with `warn`, a warning
    logged if others may read it too (`token_exposed`).

    Raises:
        ConfigError: unreadable, shorter than 16 characters, or not one word of printable
            ASCII (it goes in an HTTP header: a second line there failed every daemon's
            connection, as a "header injection").
    """
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read the token file {path}: not UTF-8 text") from None
    if len(token) < 16:
        raise ConfigError(f"{path}: the token must be at least 16 characters")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"{path}: the token must be one word of printable ASCII (no spaces, "
                          "one line), as `head -c 32 /dev/urandom | base64` writes")
    exposed = warn and token_exposed(path)
    if exposed:
        logger.warning("%s", exposed)
    return token


def token_exposed(path: Path) -> str | None:
    """What is wrong when the token file at `path` can be read by more than its owner
    (as ssh says of a key), or None.

    With a POSIX ACL the group bits are the ACL's mask, not a group's right: systemd's
    credentials (`LoadCredential=`, 0440 so) give the service's user alone read access
    that way. Then only what others may do is judged.
    """
    mode = path.stat().st_mode & 0o777
    if not mode & (0o007 if _has_acl(path) else 0o077):
        return None
    return (f"the token file {path} is open to its group or others (mode {mode:04o}): whoever "
            f"reads it can command the control plane; chmod 600 {path}")


def _has_acl(path: Path) -> bool:
    try:
        os.getxattr(path, "system.posix_acl_access")
    except OSError:  # none (ENODATA), or a file system without ACLs
        return False
    return True


@dataclass(frozen=True)
class _Snapshot:
    daemons: tuple[tuple[str, cp.Register, cp.Report], ...]  # by host name
    plan: Plan | None
    version: int


@dataclass
class _Daemon:
    register: cp.Register
    report: cp.Report = field(default_factory=lambda: cp.Report(0, ()))
    ws: web.WebSocketResponse | None = None
    binary: bool = False
    connected: bool = True
    seen: float = field(default_factory=time.monotonic)
    plan_version: int = 0
    remote: str | None = None  # the peer's address, as the control plane sees it
    left_out: list[str] = field(default_factory=list)  # jobs its plans leave owners out of


# A job's ranks' hosts, their leaves, whether leaves have uplinks, how the ranks exchange.
_ExchangeKey = tuple[tuple[int, ...], tuple[int, ...], bool, str]


@dataclass(frozen=True)
class _Where:
    """Of one state: each host name's index, the ranks of each job on each host, the
    jobs with demand."""

    state: State
    index: dict[str, int]
    ranks_on: dict[int, dict[str, list[int]]]
    complete: set[str]


class ControlPlane:
    """The cluster view and the planner; `app()` serves it."""

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.policy = get_policy(config.policy)
        self.daemons: dict[str, _Daemon] = {}
        self.plan: Plan | None = None
        self.state: State | None = None
        self.version = 0
        self.planned_at = 0.0
        # The exchanges of the last state's jobs (`_exchange`): so many, no more.
        self._exchanges: dict[_ExchangeKey, Exchange] = {}
        self._placement: _Where | None = None
        self._changed = asyncio.Event()
        self.metrics = CollectorRegistry(auto_describe=True)
        self._plans = Counter("gradlane_control_plans", "Plans computed", registry=self.metrics)
        self._plan_s = Histogram(
            "gradlane_control_plan_seconds",
            "Time to compute a plan (state from the reports, then the policy)",
            registry=self.metrics)
        self._push_s = Histogram("gradlane_control_push_seconds",
                                 "From plan computed to the last daemon's copy sent",
                                 registry=self.metrics)
        self._resent = Counter("gradlane_control_plan_resends",
                               "Pushes of the plan in force again while a new plan took over "
                               "half the TTL to make", registry=self.metrics)
        self._failed = Counter("gradlane_control_plan_failures",
                               "Plans that failed (a state or policy error): the daemons keep "
                               "the last plan until its TTL runs out", registry=self.metrics)
        # The planner's failures since its last plan: (how many, when the last was, what).
        self.failing: tuple[int, float, str] | None = None
        self._rejected = Counter("gradlane_control_rejected", "Requests or messages refused",
                                 ["reason"], registry=self.metrics)
        self._connected = Gauge("gradlane_control_daemons", "Daemons connected",
                                registry=self.metrics)
        self._connected.set_function(lambda: sum(d.connected for d in self.daemons.values()))
        age = Gauge("gradlane_control_plan_age_seconds",
                    "Since the last plan was computed (NaN: none yet); past the TTL the "
                    "daemons are on their local policy", registry=self.metrics)
        age.set_function(lambda: time.time() - self.planned_at if self.plan else math.nan)

    # -- HTTP ----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._auth])
        app.router.add_get("/api/v1/cluster", self._cluster)
        app.router.add_get("/api/v1/daemon", self._websocket)
        app.router.add_post("/api/v1/report", self._post_report)
        app.router.add_get("/metrics", self._metrics)
        app.cleanup_ctx.append(self._planner_ctx)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {self.config.token}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            self._rejected.labels("auth").inc()
            raise web.HTTPUnauthorized(text="missing or wrong bearer token\n",
                                       headers={"WWW-Authenticate": "Bearer"})
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            self._rejected.labels("too_big").inc()
            raise
        return response

    async def _cluster(self, request: web.Request) -> web.Response:
        return web.json_response(self.view())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics),
                            content_type="text/plain", charset="utf-8")

    async def _post_report(self, request: web.Request) -> web.Response:
        binary = request.content_type == "application/msgpack"
        body = await request.read()
        try:
            raw = cp.decode(body if binary else body.decode("utf-8", "replace"))
            register = cp.parse_register(_field(raw, "register"))
            report = cp.parse_report(_field(raw, "report"))
            cp.host_link(register, report)
        except ProtocolError as exc:
            self._rejected.labels(exc.code).inc()
            raise web.HTTPBadRequest(text=f"{exc.code}: {exc}\n") from None
        self._accept(register, None, binary, request.remote).report = report
        self._changed.set()
        data, _ = cp.fit(self.message_for(register.host), binary)
        if isinstance(data, bytes):
            return web.Response(body=data, content_type="application/msgpack")
        return web.Response(text=data, content_type="application/json")

    # -- WebSocket -------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=cp.MAX_MESSAGE, heartbeat=10.0)
        await ws.prepare(request)
        daemon: _Daemon | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                first = await ws.receive()
            daemon = self._register(first, ws, request.remote)
            await self._send(daemon, {"type": "welcome", "version": cp.VERSION,
                                      "host": daemon.register.host,
                                      "features": list(cp.FEATURES)})
            if self.plan is not None:
                await self._send(daemon, self.message_for(daemon.register.host))
            async for msg in ws:
                daemon.binary = msg.type == WSMsgType.BINARY
                report = cp.parse_report(cp.decode(_payload(msg)))
                cp.host_link(daemon.register, report)  # a link its interfaces can carry
                daemon.report = report
                daemon.seen = time.monotonic()
                self._changed.set()
        except ProtocolError as exc:
            self._rejected.labels(exc.code).inc()
            logger.warning("daemon %s: %s: %s; closing its connection",
                           daemon.register.host if daemon else request.remote, exc.code, exc)
            with contextlib.suppress(Exception):
                await ws.send_json({"type": "error", "code": exc.code, "message": str(exc)})
        except TimeoutError:
            self._rejected.labels("no_register").inc()
        finally:
            await ws.close()
            # Not when a newer session of the host replaced this one (`_accept`): that
            # daemon is connected.
            if daemon is not None and self.daemons.get(daemon.register.host) is daemon:
                daemon.connected, daemon.ws = False, None
                daemon.seen = time.monotonic()
                self._changed.set()
                logger.warning("daemon %s disconnected; its jobs are degraded",
                               daemon.register.host)
        return ws

    def _register(self, msg: Any, ws: web.WebSocketResponse, remote: str | None) -> _Daemon:
        if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            raise ProtocolError("bad_message", "the first message must be a register")
        register = cp.parse_register(cp.decode(_payload(msg)))
        daemon = self._accept(register, ws, msg.type == WSMsgType.BINARY, remote)
        self._changed.set()
        logger.info("daemon %s registered (%s)", register.host, register.gradlane)
        return daemon

    def _accept(self, register: cp.Register, ws: web.WebSocketResponse | None,
                binary: bool, remote: str | None) -> _Daemon:
        old = self.daemons.get(register.host)
        if old is None and len(self.daemons) >= self.config.max_daemons:
            raise ProtocolError("full", f"already {self.config.max_daemons} daemons")
        if (old is not None and old.ws is not None and not old.ws.closed
                and None not in (old.remote, remote) and old.remote != remote):
            # Two hosts with one name (a cloned image's hostname) would take the name from
            # each other at every reconnect; the daemon that came first keeps it.
            raise ProtocolError(
                "conflict",
                f"host name {register.host!r} is taken by the daemon connected from "
                f"{old.remote}; give each daemon its own name (control.host in gradlaned.toml)",
            )
        report = old.report if old else cp.Report(0, ())
        try:
            cp.host_link(register, report)
        except ProtocolError:  # registered again with other interfaces: its link is unknown
            report = replace(report, link_bps=0)
        daemon = _Daemon(register, report, ws, binary, remote=remote)
        if old is not None and old.ws is not None and old.ws is not ws:
            asyncio.get_running_loop().create_task(old.ws.close())  # a newer session wins
        self.daemons[register.host] = daemon
        return daemon

    async def _send(self, daemon: _Daemon, message: dict[str, Any]) -> None:
        ws = daemon.ws
        if ws is None or ws.closed:
            return
        data, left_out = cp.fit(message, daemon.binary)
        if left_out != daemon.left_out:
            daemon.left_out = left_out
            if left_out:
                logger.warning("daemon %s: its plan would be over %d bytes: it leaves out the "
                               "chunk owners of the largest jobs (%s), whose shims there keep "
                               "their own", daemon.register.host, cp.MAX_MESSAGE,
                               first_of(left_out, 3))
        async with asyncio.timeout(SEND_TIMEOUT):
            if isinstance(data, bytes):
                await ws.send_bytes(data)
            else:
                await ws.send_str(data)

    # -- planning --------------------------------------------------------------

    async def _planner_ctx(self, app: web.Application) -> Any:
        task = asyncio.create_task(self._planner())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _planner(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.cadence_s):
                    await self._changed.wait()
            await asyncio.sleep(self.config.react_s)  # let a burst of reports land
            self._changed.clear()
            self._forget_lost()
            started = time.perf_counter()
            # Only the snapshot is taken on the loop: the state and the plan, which take
            # tens of ms at 1,024 hosts, are built off it while handlers keep serving.
            snapshot = self.snapshot()
            try:
                state, plan = await self._made(loop, snapshot)
            except Exception as exc:  # a policy (or state) bug must not stop the control plane
                error = f"{type(exc).__name__}: {exc}"[:300]
                if self.failing is None or self.failing[2] != error:  # once while it recurs
                    logger.exception("policy %s failed; no new plan: the daemons keep the last "
                                     "one until its TTL runs out", self.policy.name)
                self._failed.inc()
                count = self.failing[0] if self.failing else 0
                self.failing = (count + 1, time.time(), error)
                continue
            self.failing = None
            self._plan_s.observe(time.perf_counter() - started)
            self._plans.inc()
            self._log_notes(plan)
            self.state, self.plan, self.planned_at = state, plan, time.time()
            await self.push()

    async def _made(self, loop: asyncio.AbstractEventLoop, snapshot: _Snapshot
                    ) -> tuple[State, Plan]:
        """The state and plan of `snapshot`, made off the loop. Meanwhile, every half TTL,
        the plan in force is sent again: daemons measure a plan's TTL from its arrival, and
        a plan taking longer to make (a job of tens of thousands of ranks, its first plan:
        88 s at 65,536 within leaves) would have left every daemon on its local policy."""
        making = loop.run_in_executor(None, self._state_and_plan, snapshot)
        started, said = time.monotonic(), False
        while True:  # bounded: the plan is made or fails
            done, _ = await asyncio.wait({making}, timeout=self.config.ttl_s / 2)
            if done:
                return making.result()
            if self.plan is None:
                continue
            if not said:
                logger.info("a plan has taken %.0f s so far: sending the one in force again "
                            "every %.1f s meanwhile", time.monotonic() - started,
                            self.config.ttl_s / 2)
                said = True
            self._resent.inc()
            await self.push(resent=True)

    def _log_notes(self, plan: Plan) -> None:
        """Log what `plan` does otherwise than its policy would (`Plan.notes`), each note
        once while plans keep it."""
        for note in plan.notes:
            if self.plan is None or note not in self.plan.notes:
                logger.warning("plan: %s", note)

    async def push(self, resent: bool = False) -> None:
        """Send every connected daemon its part of the current plan, concurrently (again,
        `resent`: not timed as a new plan's push)."""
        targets = [d for d in self.daemons.values() if d.ws is not None]
        results = await asyncio.gather(
            *(self._send(d, self.message_for(d.register.host)) for d in targets),
            return_exceptions=True,
        )
        for daemon, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("daemon %s did not take its plan (%s); disconnecting it",
                               daemon.register.host, type(result).__name__)
                if daemon.ws is not None:
                    await daemon.ws.close()
        if not resent:
            self._push_s.observe(time.time() - self.planned_at)

    def _forget_lost(self) -> None:
        now = time.monotonic()
        for host, d in self.daemons.items():
            # A WebSocket says when it closes; a daemon that POSTs only goes quiet.
            if d.ws is None and d.connected and now - d.seen > POST_SILENT_S:
                d.connected = False
                logger.warning("daemon %s has not reported for %.0f s; its jobs are degraded",
                               host, now - d.seen)
        for host in [h for h, d in self.daemons.items()
                     if not d.connected and now - d.seen > LOST_AFTER_S]:
            del self.daemons[host]

    def hosts(self) -> list[str]:
        return sorted(self.daemons)

    def snapshot(self) -> _Snapshot:
        """What the next state is built from: the daemons' latest messages (immutable,
        so the snapshot holds them by reference) and the plan in force."""
        self.version += 1
        return _Snapshot(
            tuple((h, self.daemons[h].register, self.daemons[h].report) for h in self.hosts()),
            self.plan, self.version)

    def build_state(self, snapshot: _Snapshot | None = None) -> State:
        """The cluster as the daemons reported it (connected or recently lost).

        Touches nothing the event loop changes, given a `snapshot`: the planner
        builds it on a worker thread.
        """
        seen = self.snapshot() if snapshot is None else snapshot
        names = [h for h, _, _ in seen.daemons]
        index = {h: i for i, h in enumerate(names)}
        hosts = tuple(Host(h, reg.leaf, cp.host_link(reg, report))
                      for h, reg, report in seen.daemons)
        jobs: dict[str, JobState] = {}
        workers: list[Worker] = []
        stated: dict[str, int] = {}  # global batch as a report states it
        world: dict[str, int] = {}  # the job's ranks as a report states it (0: not said)
        for h, _, report in seen.daemons:
            for job in report.jobs:
                known = jobs.get(job.name)
                stated[job.name] = max(stated.get(job.name, 0), job.global_batch)
                world[job.name] = max(world.get(job.name, 0), job.world_size)
                jobs[job.name] = JobState(
                    job.name,
                    (known.workers if known else 0) + len(job.workers),
                    chunk_bytes=job.chunk_bytes or (known.chunk_bytes if known else ()),
                    layers=job.layers or (known.layers if known else 0),
                    chunk_layers=(job.chunk_layers if job.chunk_bytes
                                  else known.chunk_layers if known else ()),
                )
                workers += [Worker(job.name, w.rank, index[h], w.throughput, w.batch)
                            for w in job.workers]
        of_job: dict[str, list[Worker]] = {}
        for w in workers:
            of_job.setdefault(w.job, []).append(w)
        jobs = {n: replace(j, global_batch=_global_batch(stated[n], world[n], of_job.get(n, [])))
                for n, j in jobs.items()}
        if self.config.uplink_bps is None or not hosts:
            # A non-blocking fabric: plan as one switch, leaves kept in the view.
            topology = Topology(tuple(Host(h.name, 0, h.nic_bps) for h in hosts) or (Host("-"),))
        else:
            leaves = max(h.leaf for h in hosts) + 1
            topology = Topology(hosts, (self.config.uplink_bps,) * leaves)
        by_name = tuple(sorted(jobs.values(), key=lambda j: j.name))
        ordered = tuple(sorted(workers, key=lambda w: (w.job, w.rank)))
        agreed = _agreed_exchanges(report for _, _, report in seen.daemons)
        coflows, flows, kinds = self._demand(by_name, ordered, topology, seen.plan, agreed,
                                             world)
        return State(
            jobs=tuple(replace(j, ring=kinds.get(j.name) == "ring",
                               by_host=kinds.get(j.name) == "host") for j in by_name),
            topology=topology,
            workers=ordered,
            coflows=coflows,
            flows=flows,
            version=seen.version,
            max_weighed=self.config.max_weighed,
        )

    def _state_and_plan(self, snapshot: _Snapshot) -> tuple[State, Plan]:
        state = self.build_state(snapshot)
        plan = self.policy.plan(state)
        self._refused_by_daemons(plan, state)
        return state, plan

    def _refused_by_daemons(self, plan: Plan, state: State) -> None:
        """Raise ValueError if daemons would refuse their parts of `plan`
        (`cp.check_plan`): a policy's bug (a class of rate 0, a priority past 7), said
        here as a failed plan rather than by every daemon at every plan, each one dropping
        its link."""
        parts = [("every host", {"job_classes": {},
                                 "batch_shares": {j: list(v) for j, v in plan.batch_shares.items()},
                                 "ownership": {j: list(v) for j, v in plan.ownership.items()}})]
        assert state.topology is not None
        hosts = state.topology.hosts
        # Each job's class once, named by the first host given it: hosts share a few (1.7
        # ms a plan at 1,024 hosts of 128 jobs, 4.1 host by host). Keyed by its values'
        # types too: an equal class of NumPy integers is checked, and refused, apart.
        first: dict[tuple[Any, ...], int] = {}
        for i, classes in sorted(plan.host_classes.items()):
            for job, c in classes.items():
                key = (job, c, type(c.rate_bps), type(c.ceil_bps), type(c.prio))
                first.setdefault(key, i)
        parts += [(f"host {hosts[i].name}", {"job_classes": _class_fields({key[0]: key[1]}),
                                             "batch_shares": {}, "ownership": {}})
                  for key, i in first.items()]
        for where, part in parts:
            try:
                cp.check_plan({"version": 1, "ttl_s": self.config.ttl_s, **part})
            except ValueError as exc:
                raise ValueError(f"policy {self.policy.name} planned what daemons refuse "
                                 f"({where}): {exc}") from None

    def _demand(
        self, jobs: tuple[JobState, ...], workers: tuple[Worker, ...], topology: Topology,
        plan: Plan | None, agreed: dict[str, str], world: dict[str, int],
    ) -> tuple[tuple[Coflow, ...], FlowTable, dict[str, str]]:
        """Per job, its next iteration's exchange as one coflow of demand flows, and
        how its ranks exchange (`gradlane.daemon.fields.EXCHANGES`).

        Built from what the shims reported (each chunk's bytes and layer) and
        what they enforce: the current plan's chunk owners, and the exchange
        the shims say they agreed (`agreed`: flat, within leaves first or the
        ring; a job whose shims have not said yet: what shims left at their
        default agree on, `_expected_exchange`), see
        `gradlane.policies.demand`. Consecutive layers share a
        bucket, at most `DEMAND_BUCKETS` per job, so a state holds at most
        ``2 * DEMAND_BUCKETS`` flows per worker however many layers a model
        has. A job is left out until its reports give every rank once
        (`_every_rank`, of `world` ranks when its daemons said; at least 2) and
        its chunks.
        """
        coflows: list[Coflow] = []
        tables: list[FlowTable] = []
        kinds: dict[str, str] = {}
        kept: dict[_ExchangeKey, Exchange] = {}
        advised = bool(plan is not None and plan.reduce_in_leaf)
        by_job: dict[str, list[Worker]] = {}
        for w in workers:
            by_job.setdefault(w.job, []).append(w)
        for job in jobs:
            mine = by_job.get(job.name, [])
            if (len(mine) < 2 or not _every_rank([w.rank for w in mine], world.get(job.name, 0))
                    or not job.chunk_bytes):
                continue
            hosts = [w.host for w in mine]
            owners = plan.ownership.get(job.name, ()) if plan is not None else ()
            if len(owners) != len(job.chunk_bytes) or max(owners, default=0) >= len(mine):
                owners = tuple(assign_owners(job.chunk_bytes, len(mine)))
            layer = np.asarray(job.chunk_layers if len(job.chunk_layers) == len(job.chunk_bytes)
                               else range(len(job.chunk_bytes)), dtype=np.int64)
            n_layers = max(job.layers, int(layer.max()) + 1)
            starts = bucket_starts(layer * DEMAND_BUCKETS // n_layers)
            kind = kinds[job.name] = agreed.get(job.name) or _expected_exchange(
                hosts, len({topology.hosts[h].leaf for h in hosts}), advised)
            exchange = self._exchange(topology, hosts, kind, kept)
            local, remote = exchange.loads(
                exchange.owned(owners, starts, job.chunk_bytes), kind in ("leaf", "host"))
            tables.append(exchange.demand_flows(hosts, local, remote, len(coflows), starts,
                                                priority=layer[starts[:-1]]))
            coflows.append(Coflow(job.name, job.name))
        self._exchanges = kept
        return tuple(coflows), FlowTable.concat(tables), kinds

    def _exchange(self, topology: Topology, hosts: list[int], kind: str,
                  kept: dict[_ExchangeKey, Exchange]) -> Exchange:
        """The reduction trees (or the ring) of ranks on `hosts` exchanging as `kind`:
        the last state's if it had them (placements rarely change), put in `kept`."""
        leaf = tuple(topology.hosts[h].leaf for h in hosts)
        key = (tuple(hosts), leaf, bool(topology.uplink_bps), kind)
        exchange = self._exchanges.get(key)
        if exchange is None:
            exchange = Exchange(leaf, uplinks=key[2], host=hosts, ring=kind == "ring",
                                by_host=kind == "host")
        kept[key] = exchange
        return exchange

    def message_for(self, host: str) -> dict[str, Any]:
        """`host`'s part of the current plan, as a plan message."""
        plan, state = self.plan, self.state
        if plan is None or state is None or host not in self.daemons:
            return {"type": "plan", "version": 0, "ttl_s": 0.0, "source": None,
                    "job_classes": {}, "batch_shares": {}, "ownership": {}, "leaf": None,
                    "link_bps": None,
                    "computed_at": None}
        assert state.topology is not None
        where = self._where(state)
        mine = where.index.get(host, -1)
        classes = plan.host_classes.get(mine, {})
        ranks_of = where.ranks_on.get(mine, {})
        jobs = sorted(j for j in ranks_of if j in plan.batch_shares)
        complete = where.complete
        own_ranks = "rank_shares" in self.daemons[host].report.takes
        return {
            "type": "plan",
            "version": plan.version,
            "ttl_s": self.config.ttl_s,
            "source": plan.source,
            "job_classes": _class_fields(classes),
            # Every rank's to an older daemon; the host's own ranks' to one that takes them.
            "batch_shares": {} if own_ranks else {j: list(plan.batch_shares[j]) for j in jobs},
            **({"rank_shares": {j: [[r, plan.batch_shares[j][r]] for r in ranks_of[j]
                                    if r < len(plan.batch_shares[j])]
                                for j in jobs}} if own_ranks else {}),
            # Owners only for jobs whose every rank is reported (those with demand): the
            # shims take them, and a plan over some of the ranks would be taken and then
            # replaced.
            "ownership": {j: list(plan.ownership[j]) for j in sorted(ranks_of)
                          if j in plan.ownership and j in complete},
            # The host's leaf switch when shims should reduce within leaves first.
            "leaf": state.topology.hosts[mine].leaf if plan.reduce_in_leaf and mine >= 0 else None,
            # The link the classes are for: the daemon scales them to each interface.
            "link_bps": state.topology.hosts[mine].nic_bps if mine >= 0 else None,
            "computed_at": self.planned_at,
        }

    def _where(self, state: State) -> _Where:
        """`state`'s hosts by name and jobs' ranks by host, worked out once per state: a
        push asks them for every daemon (a scan of every worker for each daemon took
        0.2-0.3 s of the event loop a push, at 1,024 hosts of 4 ranks)."""
        if self._placement is None or self._placement.state is not state:
            assert state.topology is not None
            index: dict[str, int] = {}
            for i, h in enumerate(state.topology.hosts):
                index.setdefault(h.name, i)
            ranks_on: dict[int, dict[str, list[int]]] = {}
            for w in state.workers:
                ranks_on.setdefault(w.host, {}).setdefault(w.job, []).append(w.rank)
            # Every rank reported: the jobs with demand.
            self._placement = _Where(state, index, ranks_on, {c.job for c in state.coflows})
        return self._placement

    def view(self) -> dict[str, Any]:
        """What ``/api/v1/cluster`` and ``gradlane status --cluster`` show."""
        now = time.monotonic()
        lost = {h for h, d in self.daemons.items() if not d.connected}
        agreed = _agreed_exchanges(self.daemons[h].report for h in self.hosts())
        jobs: dict[str, dict[str, Any]] = {}
        for h in self.hosts():
            for job in self.daemons[h].report.jobs:
                j = jobs.setdefault(job.name, {"hosts": [], "workers": 0, "degraded": False,
                                               "chunks": 0, "band_bps": [], "demand_bytes": 0,
                                               "exchange": agreed.get(job.name)})
                j["hosts"].append(h)
                j["workers"] += len(job.workers)
                j["chunks"] = max(j["chunks"], len(job.chunk_bytes))
                for band, bps in enumerate(job.band_bps):  # summed over the job's hosts
                    j["band_bps"] += [0.0] * (band + 1 - len(j["band_bps"]))
                    j["band_bps"][band] += bps
                j["degraded"] |= h in lost
        plan, state = self.plan, self.state
        owned: dict[str, list[float]] = {}  # per job, each rank's share of the bytes it owns
        if state is not None:  # what each job's next exchange puts on the network
            for job_state in state.jobs:  # what its batch shares split (0: none planned yet)
                if job_state.name in jobs:
                    jobs[job_state.name]["global_batch"] = job_state.global_batch
                owners = plan.ownership.get(job_state.name, ()) if plan is not None else ()
                if owners and len(owners) == len(job_state.chunk_bytes):
                    per_rank = np.bincount(owners, job_state.chunk_bytes, job_state.workers)
                    owned[job_state.name] = [round(float(b), 3)
                                             for b in per_rank / per_rank.sum()]
            sent = np.bincount(state.flows.coflow, state.flows.bytes, len(state.coflows))
            for coflow, total in zip(state.coflows, sent.tolist(), strict=True):
                if coflow.job in jobs:
                    jobs[coflow.job]["demand_bytes"] = int(total)
        return {
            "version": __version__,
            "policy": self.policy.name,
            "hosts": [
                {"host": h, "leaf": d.register.leaf, "connected": d.connected,
                 "seen_s_ago": round(now - d.seen, 3), "gradlane": d.register.gradlane,
                 "interfaces": [{"name": i.name, "rate_bps": i.rate_bps}
                                for i in d.register.interfaces],
                 "link_bps": cp.host_link(d.register, d.report)}
                for h, d in sorted(self.daemons.items())
            ],
            "jobs": jobs,
            "plan": None if plan is None else {
                "version": plan.version, "source": plan.source, "ttl_s": self.config.ttl_s,
                "age_s": round(time.time() - self.planned_at, 3),
                "batch_shares": {j: list(s) for j, s in plan.batch_shares.items()},
                "owned_shares": owned,  # the chunk owners', as the shims take them
                "job_level": plan.job_level,
                "coflow_order": list(plan.coflow_order),
                "reduce_in_leaf": plan.reduce_in_leaf,
                "notes": list(plan.notes),  # what it does otherwise than its policy would
            },
            # Planning that failed since the last plan (None: the last one planned).
            "planning_failed": None if self.failing is None else {
                "times": self.failing[0], "last_s_ago": round(time.time() - self.failing[1], 3),
                "error": self.failing[2]},
        }


def _every_rank(ranks: list[int], world: int) -> bool:
    """Whether `ranks` are every rank of a job once: 0..world-1, or 0..n-1 for n ranks
    when the daemons do not say the world size (0)."""
    return sorted(ranks) == list(range(world or len(ranks)))


def _global_batch(stated: int, world: int, workers: list[Worker]) -> int:
    """A job's global batch for planning its batch shares (0: plan none yet).

    Shares go to ranks by position, so none are planned until every rank is
    reported (`_every_rank`). The batch is the one the job's ranks agreed
    (`stated`). From older shims, which do not state it, it is the sum of the
    workers' batches, once each has measured one: a sum that drifts while
    ranks take a new plan at different steps, which is why shims state it.
    """
    if not _every_rank([w.rank for w in workers], world):
        return 0
    if stated:
        return stated
    return sum(w.batch for w in workers) if all(w.batch > 0 for w in workers) else 0


def _agreed_exchanges(reports: Iterable[cp.Report]) -> dict[str, str]:
    """Per job whose shims have said on some host: how it reduces (`agreed_exchange` of
    what its hosts said; hosts not heard from yet are left out)."""
    said: dict[str, set[str]] = {}
    for report in reports:
        for job in report.jobs:
            if job.exchange is not None:
                said.setdefault(job.name, set()).add(job.exchange)
    return {name: agreed_exchange(kinds) or "flat" for name, kinds in said.items()}


def _expected_exchange(hosts: Sequence[int], leaves: int, advised: bool) -> str:
    """What a job's shims agree on by default (``exchange="auto"``) before they say it,
    its ranks on `hosts` (rank order).

    They learn their leaves only from a plan advising reduction within
    leaves (`advised`); until then they count as under one leaf, and ranks
    sharing hosts reduce within hosts first (`host_groups`).
    """
    if advised and leaves > 1:
        return exchange_kind("auto", len(hosts), leaves)
    groups = host_groups([str(h) for h in hosts], "auto")
    return exchange_kind("auto", len(hosts), 1 if groups is None else len(set(groups)),
                         by_host=groups is not None)


def _payload(msg: Any) -> str | bytes:
    if msg.type == WSMsgType.TEXT:
        return str(msg.data)
    if msg.type == WSMsgType.BINARY:
        return bytes(msg.data)
    raise ProtocolError("bad_message", f"unexpected WebSocket frame {msg.type.name}")


def _field(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", f"the body needs a {key!r} map")
    return {"type": key, **{k: v for k, v in value.items() if k != "type"}}


def _load_solver() -> None:
    try:
        load_solver()
    except Exception as exc:  # `gradlane control` found it installed: a broken install
        logger.error("the solver did not import (%s); plans that need it will fail", exc)


async def serve(config: ControlConfig) -> None:
    """Serve until cancelled."""
    plane = ControlPlane(config)
    runner = web.AppRunner(plane.app(), access_log=None, shutdown_timeout=2)
    await runner.setup()
    try:
        await start_site(runner, config.host, config.port, "daemons and the API")
        logger.info("gradlane control %s listening on %s:%d, policy %s",
                    __version__, config.host, config.port, plane.policy.name)
        # The solver's import (about a second) while the daemons reconnect: not before
        # listening, which a restart's daemons wait for, nor in the first plan needing it.
        asyncio.get_running_loop().run_in_executor(None, _load_solver)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _class_fields(classes: dict[str, JobClassPlan]) -> dict[str, list[int]]:
    """A plan message's ``job_classes``: per job ``[rate_bps, ceil_bps, prio]``."""
    return {j: [c.rate_bps, c.ceil_bps, c.prio] for j, c in classes.items()}
