"""gradlaned's link to the control plane: register, report, take plans, fall back on expiry.

1. Connect to ``<url>/api/v1/daemon`` with the bearer token, register (host,
   leaf, interfaces, version), then report this host's jobs and workers
   every `REPORT_EVERY` seconds, whenever the registry changes, and as soon
   as a worker's measured throughput moves by more than `THROUGHPUT_CHANGE`
   (a worker's throughput is the median of its latest steps, so one that slows
   down or recovers is seen within three iterations and one noisy step moves nothing).
2. Each plan received is kept with the time it arrived; `job_classes()`
   returns its classes only while it is younger than its time-to-live.
   When it expires the daemon is told (`on_change`) and goes back to its
   local policy; `status()` says which one is in force.
3. Any failure (refused, lost, a bad message) closes the connection and
   retries with jittered backoff from `MIN_BACKOFF` up to `MAX_BACKOFF`
   (from the least again once a session held); training never waits
   for it. The cap is short so that plans flow again within a few seconds of
   a control-plane restart; the jitter spreads a cluster's reconnections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from gradlane import __version__
from gradlane.daemon import control_protocol as cp
from gradlane.daemon.fields import (
    agreed_exchange,
    exchange_fields,
    features,
)
from gradlane.daemon.registry import Registry
from gradlane.errors import ProtocolError
from gradlane.policies import JobClassPlan
from gradlane.units import first_of

__all__ = ["ControlLink"]

logger = logging.getLogger(__name__)

REPORT_EVERY = 2.0
THROUGHPUT_CHANGE = 0.15  # relative
MIN_BACKOFF, MAX_BACKOFF = 0.5, 1.0  # seconds, before jitter (x0.5..1)


class ControlLink:
    def __init__(
        self,
        url: str,
        token: str,
        host: str,
        leaf: int,
        interfaces: list[tuple[str, int]],
        registry: Registry,
        on_change: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        band_throughput: Callable[[], dict[str, list[float]]] = dict,
        link_bps: Callable[[], int] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.host, self.leaf, self.interfaces = host, leaf, interfaces
        self.registry = registry
        self.on_change = on_change
        self.band_throughput = band_throughput  # job -> measured bit/s per band, this host
        self.link_bps = link_bps  # this host's link as it plans (`Daemon.link_bps`)
        self._clock = clock
        self.connected = False
        self.plan: dict[str, Any] | None = None
        self.plan_at = 0.0
        self._rank_shares: dict[tuple[str, int], int] = {}  # the plan's, by (job, rank)
        self.last_error: str | None = None
        self.left_out: dict[str, str] = {}  # job -> what of it the reports leave out
        self._unreported: dict[str, str] = {}  # the same, beyond the protocol's counts
        self.sessions = 0
        # Optional report fields the control plane accepts (its welcome's "features"):
        # an older one refuses fields it does not know.
        self.features: frozenset[str] = frozenset()

    # -- what the daemon asks ------------------------------------------------

    def fresh(self) -> bool:
        return self.plan is not None and self._clock() - self.plan_at < float(self.plan["ttl_s"])

    def job_classes(self) -> dict[str, JobClassPlan] | None:
        """The control plane's classes for this host, or None when there is no fresh plan."""
        if not self.fresh():
            return None
        assert self.plan is not None
        return {job: JobClassPlan(int(c[0]), int(c[1]), int(c[2]))
                for job, c in self.plan["job_classes"].items()}

    def planned_link_bps(self) -> int | None:
        """The host link a fresh plan's classes are for (None: none fresh, or a control
        plane too old to say: it took the slowest interface)."""
        if not self.fresh():
            return None
        assert self.plan is not None
        return self.plan.get("link_bps")

    def advice(self, job: str, rank: int) -> tuple[int | None, list[int] | None]:
        """(batch share, chunk owners) for one worker, from a fresh plan."""
        if not self.fresh():
            return None, None
        assert self.plan is not None
        if "rank_shares" in self.plan:  # this host's ranks' (`cp.PLAN_FIELDS`)
            share = self._rank_shares.get((job, rank))
        else:  # every rank's, from a control plane that does not send them so
            shares = self.plan["batch_shares"].get(job)
            share = shares[rank] if shares and 0 <= rank < len(shares) else None
        return share, self.plan["ownership"].get(job)

    def advised_leaf(self) -> int | None:
        """This host's leaf when a fresh plan says shims should reduce within leaves first."""
        if not self.fresh():
            return None
        assert self.plan is not None
        leaf: int | None = self.plan.get("leaf")  # checked as the plan came
        return leaf

    def status(self) -> dict[str, Any]:
        if self.fresh():
            assert self.plan is not None
            state = f"following control plan v{self.plan['version']}"
        elif self.plan is not None:
            state = "control plan expired: local policy"
        else:
            state = "no control plan: local policy"
        return {
            "url": self.url,
            "connected": self.connected,
            "state": state,
            "plan_version": self.plan["version"] if self.plan else None,
            "plan_age_s": round(self._clock() - self.plan_at, 3) if self.plan else None,
            "last_error": self.last_error,
            "sessions": self.sessions,
            "left_out": list(self.left_out.values()),  # of the reports, beyond the caps
        }

    # -- the connection ------------------------------------------------------

    async def run(self) -> None:
        """Stay connected until cancelled."""
        backoff = MIN_BACKOFF
        async with aiohttp.ClientSession() as http:
            while True:
                sessions, began = self.sessions, self._clock()
                try:
                    await self._session(http)  # ends by raising, when the connection does
                except Exception as exc:  # whatever it is, gradlaned goes on: retry
                    error = f"{type(exc).__name__}: {exc}"[:300]
                    if error != self.last_error:
                        expected = (aiohttp.ClientError, OSError, TimeoutError, ValueError,
                                    ProtocolError)
                        logger.warning("control plane %s: %s; retrying", self.url, error,
                                       exc_info=not isinstance(exc, expected))
                    self.last_error = error
                finally:
                    self.connected = False
                if self.sessions != sessions and self._clock() - began >= MAX_BACKOFF:
                    backoff = MIN_BACKOFF  # a session held: this outage backs off afresh
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(MAX_BACKOFF, backoff * 2)

    async def _session(self, http: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {self._token}"}
        async with http.ws_connect(f"{self.url}/api/v1/daemon", headers=headers,
                                   heartbeat=10.0, max_msg_size=cp.MAX_MESSAGE,
                                   timeout=aiohttp.ClientWSTimeout(ws_close=2.0)) as ws:
            await ws.send_json({
                "type": "register", "version": cp.VERSION, "host": self.host, "leaf": self.leaf,
                "gradlane": __version__,
                "interfaces": [{"name": n, "rate_bps": r} for n, r in self.interfaces],
            })
            async with asyncio.timeout(5):
                welcome = await ws.receive_json()
            if not isinstance(welcome, dict) or welcome.get("type") != "welcome":
                raise ValueError(f"expected welcome, got {welcome!r:.200}")
            self.features = features(welcome)
            self.connected, self.last_error = True, None
            self.sessions += 1
            logger.info("control plane %s: registered as %s", self.url, self.host)
            reporter = asyncio.create_task(self._report_loop(ws))
            try:
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    self._take(cp.decode(str(msg.data)))
            finally:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
        raise ConnectionResetError("the control plane closed the connection")

    def _take(self, message: dict[str, Any]) -> None:
        if message.get("type") == "error":
            raise ValueError(f"control plane error: {message.get('message')!r:.300}")
        if message.get("type") != "plan" or not message.get("version"):
            return
        cp.check_plan(message)
        before = self.plan if self.fresh() else None
        self.plan, self.plan_at = message, self._clock()
        self._rank_shares = {(job, rank): share for job, pairs in
                             message.get("rank_shares", {}).items() for rank, share in pairs}
        # The control plane re-plans every second or so; most plans change nothing
        # for this host, and each change costs a reconcile and a message to every shim.
        if before is None or _host_part(before) != _host_part(message):
            self.on_change()
        # Tell the daemon again when this plan runs out, so it falls back by itself.
        asyncio.get_running_loop().call_later(
            float(message["ttl_s"]) + 0.01, self._expire, message
        )

    def _expire(self, plan: dict[str, Any]) -> None:
        if plan is self.plan and not self.fresh():  # not superseded by a later plan
            self.on_change()

    async def _report_loop(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        seq, seen = 0, -1
        next_at = 0.0
        sent: dict[tuple[str, int], float] = {}
        while True:
            now = {(w.job, w.rank): w.throughput() for w in self.registry.workers()}
            moved = any(abs(thr - sent.get(key, 0.0)) > THROUGHPUT_CHANGE * max(thr, 1e-9)
                        for key, thr in now.items())
            if self.registry.version != seen or self._clock() >= next_at or moved:
                seen, seq, sent = self.registry.version, seq + 1, now
                report = self.report(seq)
                data, cut = cp.fit(report, binary=False)
                self._say_left_out({**self._unreported, **{
                    job: f"the chunk list of job {job!r} (the report would be over "
                         f"{cp.MAX_MESSAGE} bytes)" for job in cut}}, len(data))
                await ws.send_str(str(data))
                next_at = self._clock() + REPORT_EVERY
            await asyncio.sleep(0.1)

    def _say_left_out(self, left_out: dict[str, str], size: int) -> None:
        """Log what of which jobs a report leaves out (beyond the protocol's caps), when
        that changes."""
        if left_out == self.left_out:
            return
        self.left_out = left_out
        if left_out:
            logger.warning(
                "control plane %s: this host's report leaves out %s, and the control plane "
                "plans without it%s", self.url, first_of(list(left_out.values()), 3),
                "" if size <= cp.MAX_MESSAGE else f"; at {size} bytes it is still over the cap")
        else:
            logger.info("control plane %s: this host's report leaves nothing out again", self.url)

    def report(self, seq: int) -> dict[str, Any]:
        """This host's jobs and workers, with their measured throughput and the jobs' demand,
        within the protocol's counts (what is left out: `_unreported`)."""
        jobs: list[dict[str, Any]] = []
        measured = self.band_throughput()
        self._unreported = {}
        for name, workers in sorted(self.registry.jobs().items()):
            if len(jobs) == cp.MAX_JOBS:
                self._unreported[name] = f"job {name!r} (a report holds {cp.MAX_JOBS} jobs)"
                continue
            if len(workers) > cp.MAX_WORKERS:
                self._unreported[name] = (f"the ranks of job {name!r} past the first "
                                          f"{cp.MAX_WORKERS} on this host")
                workers = sorted(workers, key=lambda w: w.rank)[:cp.MAX_WORKERS]
            entries = []
            for w in workers:
                entries.append({"rank": w.rank, "throughput": round(w.throughput(), 3),
                                "batch": w.timings[-1].samples if w.timings else 0})
            # Every worker reports every chunk of the model: one worker's latest iteration
            # is the job's demand. Forward order (layer), then the order they were ready.
            demand = next((w.demand for w in sorted(workers, key=lambda w: w.rank) if w.demand),
                          [])
            chunks = sorted(range(len(demand)), key=lambda i: (demand[i][0], i))
            layers = sorted({demand[i][0] for i in chunks})
            index = {layer: k for k, layer in enumerate(layers)}  # dense: layers that sent
            job: dict[str, Any] = {
                # As the job's ranks agreed (every one says the same; 0: not yet).
                "name": name, "global_batch": max(w.global_batch for w in workers),
                "layers": len(layers),
                "chunk_bytes": [demand[i][1] for i in chunks],
                "chunk_layers": [index[demand[i][0]] for i in chunks],
                "band_bps": [round(b, 1) for b in measured.get(name, [])],
                "workers": entries}
            # How the job reduces, once its workers here have said (and if understood).
            job.update(exchange_fields(agreed_exchange(w.exchange for w in workers),
                                       self.features))
            if "world_size" in self.features:
                job["world_size"] = max(w.world_size for w in workers)
            # What the shims may say and what a control plane takes differ (a world of
            # more ranks than it plans, a batch too large): such a job, not the report.
            try:
                cp.parse_report({"type": "report", "seq": seq, "jobs": [job]})
            except ProtocolError as exc:
                self._unreported[name] = f"job {name!r} ({exc})"
                continue
            jobs.append(job)
        report: dict[str, Any] = {"type": "report", "seq": seq, "jobs": jobs}
        if self.link_bps is not None and "link_bps" in self.features:
            report["link_bps"] = self.link_bps()
        if "takes" in self.features:
            report["takes"] = list(cp.PLAN_FIELDS)
        return report


def _host_part(plan: dict[str, Any]) -> dict[str, Any]:
    """What of a plan message acts on this host: all but when and which version it is."""
    return {k: v for k, v in plan.items() if k not in ("version", "computed_at")}

