"""gradlaned with a control plane: plans reach the qdisc spec and the shims, expire, come back.

The real daemon (in-memory qdisc backend, tests/fakes.py) and the real
control plane run in one event loop; a shim is played over the Unix socket.
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from gradlane.daemon import control_protocol as cp
from gradlane.daemon import protocol, uplink
from gradlane.daemon.config import DaemonConfig, InterfaceConfig
from gradlane.daemon.control import ControlConfig, ControlPlane
from gradlane.daemon.fields import MAX_LEAF
from gradlane.daemon.registry import Credentials, Registry
from gradlane.daemon.service import Daemon
from gradlane.errors import ProtocolError
from gradlane.policies import JobClassPlan
from tests import examples, metric_samples
from tests.fakes import FakeBackend, fake_config, status_shown, until
from tests.integration.helpers import port_below_ephemeral
from tests.strategies import json_like

TOKEN = "t0ken-for-tests-0123456789"


async def _start_control(port: int) -> tuple[web.AppRunner, ControlPlane]:
    plane = ControlPlane(ControlConfig(token=TOKEN, cadence_s=0.2, react_s=0.01, ttl_s=1.0))
    runner = web.AppRunner(plane.app(), shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, plane


def _daemon_config(tmp_path: Path, port: int, **changes: Any) -> DaemonConfig:
    """A gradlaned config (`fake_config`) registering as h1 with the control plane on
    `port`."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    return dataclasses.replace(
        fake_config(tmp_path / "gl.sock"), control_url=f"http://127.0.0.1:{port}",
        control_token_file=token_file, control_host="h1", **changes)


class Shim:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = protocol.FrameDecoder()
        self.inbox: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.writer.write(protocol.encode(message))
        await self.writer.drain()

    async def plan_with_share(self) -> dict[str, Any]:
        async with asyncio.timeout(10):
            while True:
                while self.inbox:
                    m = self.inbox.pop(0)
                    if m["type"] == "plan" and m["batch_share"] is not None:
                        return m
                self.inbox += self.decoder.feed(await self.reader.read(65536))


async def _shut(shims: list[Shim], daemon: Daemon, serving: asyncio.Task[None],
               control: web.AppRunner) -> None:
    """Close the played shims, stop the daemon and the control plane."""
    for shim in shims:
        shim.writer.close()
    daemon.stop()
    await asyncio.wait_for(serving, 10)
    await control.cleanup()


def _control_gauges(daemon: Daemon) -> dict[str, float]:
    """gradlaned's /metrics on its link to the control plane."""
    return metric_samples(generate_latest(daemon.metrics).decode(), "gradlane_control_")


def test_after_a_session_that_held_the_next_outage_backs_off_from_the_least(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused twice, a session that held, refused, a session that ended at once, refused:
    the waits grow to the cap while refused and start over after the session that held
    (not after the one that did not: a control plane that drops daemons at once is not
    hammered)."""
    clock = [0.0]
    waits: list[float] = []
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              Registry(bands=4), on_change=lambda: None, clock=lambda: clock[0])
    script = iter(["refused", "refused", "held", "refused", "brief", "refused"])
    real_sleep = asyncio.sleep

    async def session(http: Any) -> None:
        what = next(script, "done")
        if what == "done":
            raise asyncio.CancelledError
        if what != "refused":  # registered, then the connection ended
            link.sessions += 1
            clock[0] += 5.0 if what == "held" else 0.1
            raise ConnectionResetError("the control plane closed the connection")
        raise ConnectionRefusedError("refused")

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(link, "_session", session)
    monkeypatch.setattr(uplink.asyncio, "sleep", sleep)
    monkeypatch.setattr(uplink.random, "uniform", lambda low, high: high)  # no jitter
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(link.run())
    low, cap = uplink.MIN_BACKOFF, uplink.MAX_BACKOFF
    assert [w for w in waits if w] == [low, cap, low, cap, cap, cap]


def test_a_failure_is_logged_once_while_it_repeats_and_only_a_bug_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A control plane down for hours is one warning, not one every second; a failure
    that is no network's or protocol's (a bug) comes with its traceback."""
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              Registry(bands=4), on_change=lambda: None)
    script = iter(["refused"] * 3 + ["bug"] * 2 + ["refused"])
    real_sleep = asyncio.sleep

    async def session(http: Any) -> None:
        what = next(script, "done")
        if what == "done":
            raise asyncio.CancelledError
        if what == "bug":
            raise KeyError("version")
        raise ConnectionRefusedError("refused")

    async def sleep(seconds: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(link, "_session", session)
    monkeypatch.setattr(uplink.asyncio, "sleep", sleep)
    with caplog.at_level(logging.WARNING, logger=uplink.__name__), \
            pytest.raises(asyncio.CancelledError):
        asyncio.run(link.run())
    logged = [(r.getMessage().split(": ", 1)[1], bool(r.exc_info)) for r in caplog.records]
    assert logged == [("ConnectionRefusedError: refused; retrying", False),
                      ("KeyError: 'version'; retrying", True),
                      ("ConnectionRefusedError: refused; retrying", False)]
    assert link.last_error == "ConnectionRefusedError: refused"


def test_a_daemon_without_a_control_plane_has_no_metrics_of_one(tmp_path: Path) -> None:
    daemon = Daemon(fake_config(tmp_path / "gl.sock", state_dir=tmp_path),
                    backend_factory=FakeBackend)
    assert _control_gauges(daemon) == {}
    assert "gradlane_workers" in generate_latest(daemon.metrics).decode()  # the rest is there


def test_control_plans_reach_daemon_and_shims_expire_and_return(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uplink, "REPORT_EVERY", 3600.0)

    async def main() -> None:
        port = port_below_ephemeral()
        config = _daemon_config(tmp_path, port)
        daemon = Daemon(config, backend_factory=FakeBackend)
        backend = daemon._backends[0]
        assert isinstance(backend, FakeBackend)
        control, plane = await _start_control(port)
        serving = asyncio.create_task(daemon.serve())
        await asyncio.wait_for(daemon.ready.wait(), 10)
        shims = []
        for rank, compute_s in ((0, 0.1), (1, 0.3)):  # rank 1 computes 3x slower
            shim = Shim(*await asyncio.open_unix_connection(str(config.socket_path)))
            await shim.send({"type": "hello", "version": 1, "job": "j", "rank": rank,
                             "world_size": 2, "flows": []})
            # Iteration 0's chunks, ready in backward order: layer 1 (two chunks), then 0.
            await shim.send({"type": "chunks", "iteration": 0, "events": [
                [1, 3000, 1, 0.1], [1, 2000, 1, 0.1], [0, 500, 0, 0.2]]})
            await shim.send({"type": "timing", "iteration": 1, "compute_s": compute_s,
                             "comm_s": 0.0, "samples": 16})
            shims.append(shim)
        # 1. The control plan reaches the shims (batch shares by throughput) and the qdiscs.
        fast = await shims[0].plan_with_share()
        slow = await shims[1].plan_with_share()
        while (fast["batch_share"], slow["batch_share"]) != (24, 8):
            fast, slow = await shims[0].plan_with_share(), await shims[1].plan_with_share()
        await until(lambda: daemon.status()["control"]["state"].startswith("following"))
        await until(lambda: daemon._plan is not None and daemon._plan.source == "control")
        assert _control_gauges(daemon) == {"connected": 1.0, "plan_fresh": 1.0}
        # The job's demand reached the control plane, in forward order, and it plans owners.
        await until(lambda: plane.state is not None and plane.state.jobs[0].chunk_bytes)
        assert plane.state is not None and plane.plan is not None
        job = plane.state.jobs[0]
        assert (job.chunk_bytes, job.chunk_layers, job.layers) == ((500, 3000, 2000), (0, 1, 1), 2)
        assert len(plane.plan.ownership["j"]) == 3
        # How the job reduces reaches the control plane once every rank here has said.
        assert plane.view()["jobs"]["j"]["exchange"] is None
        for shim in shims:
            await shim.send({"type": "flows", "flows": [], "exchange": "ring"})
        await until(lambda: plane.view()["jobs"]["j"]["exchange"] == "ring")
        said = [w["exchange"] for j in daemon.status()["jobs"] for w in j["workers"]]
        assert said == ["ring"] * 2
        # The slow worker recovers (its next steps' timings; the daemon takes the median of
        # the latest five): the shares follow, and shift back when it slows down again.
        # Periodic reports are off (REPORT_EVERY is an hour here): the daemon reports
        # because the throughput moved.
        iteration = 2
        for compute_s, want in ((0.1, (16, 16)), (0.3, (24, 8))):
            for _ in range(3):
                await shims[1].send({"type": "timing", "iteration": iteration,
                                     "compute_s": compute_s, "comm_s": 0.0, "samples": 16})
                iteration += 1
            while (fast["batch_share"], slow["batch_share"]) != want:
                fast, slow = await shims[0].plan_with_share(), await shims[1].plan_with_share()
        # 2. The control plane dies: the plan expires after its TTL, the daemon goes local.
        await control.cleanup()
        await until(lambda: "expired" in daemon.status()["control"]["state"], timeout=5)
        await until(lambda: daemon._plan is not None and daemon._plan.source == "fair")
        assert backend.spec is not None and any(j.name == "j" for j in backend.spec.jobs)
        assert _control_gauges(daemon) == {"connected": 0.0, "plan_fresh": 0.0}
        # 3. It comes back: the daemon re-registers and plans flow again within 5 s.
        restarted = time.monotonic()
        control, plane = await _start_control(port)
        await until(lambda: daemon.status()["control"]["state"].startswith("following"),
                     timeout=10)
        assert time.monotonic() - restarted < 5.0
        for shim in shims:
            shim.writer.close()
        daemon.stop()
        await asyncio.wait_for(serving, 10)
        await control.cleanup()
        assert backend.restored

    asyncio.run(main())


def _reported(hellos: list[protocol.Hello], features: tuple[str, ...]) -> dict[str, Any]:
    """What a daemon whose shims said `hellos` reports of their job to a control plane
    accepting `features`."""
    registry = Registry(bands=4)
    for hello in hellos:
        registry.add(hello, Credentials(100 + hello.rank, 0, 0))
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              registry, on_change=lambda: None)
    link.features = frozenset(features)
    report = link.report(1)
    cp.parse_report(report)  # what the control plane accepts
    job: dict[str, Any] = report["jobs"][0]
    return job


@pytest.mark.parametrize(
    ("said", "features", "reported"),
    [
        (("leaf", "leaf"), cp.FEATURES, {"exchange": "leaf"}),
        (("ring", "ring"), cp.FEATURES, {"exchange": "ring"}),
        (("host", "host"), cp.FEATURES, {"exchange": "host"}),
        (("host", "host"), ("in_leaf", "exchange"), {"exchange": "flat"}),  # an older one
        (("ring", None), cp.FEATURES, {}),  # not every rank here has said
        (("ring", "leaf"), cp.FEATURES, {"exchange": "flat"}),  # ranks disagree: flat
        # A control plane of the last version knows only the flag; the oldest, neither.
        (("leaf", "leaf"), ("in_leaf",), {"in_leaf": True}),
        (("ring", "ring"), ("in_leaf",), {"in_leaf": False}),
        (("leaf", "leaf"), (), {}),
    ],
)
def test_the_exchange_is_reported_as_the_control_plane_understands_it(
    said: tuple[str | None, ...], features: tuple[str, ...], reported: dict[str, object]
) -> None:
    job = _reported([protocol.Hello(version=1, job="j", rank=rank, world_size=2, flows=(),
                                    exchange=kind) for rank, kind in enumerate(said)], features)
    assert {k: v for k, v in job.items() if k in ("exchange", "in_leaf")} == reported


@pytest.mark.parametrize("features", [cp.FEATURES, ("in_leaf", "exchange")])
def test_the_job_s_agreed_batch_and_world_size_are_reported(features: tuple[str, ...]) -> None:
    job = _reported([protocol.Hello(version=1, job="j", rank=rank, world_size=4, flows=(),
                                    global_batch=said)
                     for rank, said in enumerate((96, None))],  # rank 1 has not said yet
                    features)
    assert job["global_batch"] == 96
    assert [w["batch"] for w in job["workers"]] == [0, 0]  # no step timed yet: none known
    # Ranks 2 and 3 are on other hosts: the control plane plans no shares until it has
    # heard of all 4 (an older one, without the field, is not sent it).
    assert job.get("world_size") == (4 if "world_size" in features else None)


@pytest.mark.parametrize("features", [cp.FEATURES, ("in_leaf", "exchange", "world_size")])
def test_the_report_says_the_plan_fields_taken_to_a_control_plane_that_asks(
        features: tuple[str, ...]) -> None:
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              Registry(bands=4), on_change=lambda: None)
    link.features = frozenset(features)
    report = link.report(1)
    assert cp.parse_report(report).takes == (
        frozenset(cp.PLAN_FIELDS) if "takes" in features else frozenset())
    assert ("takes" in report) == ("takes" in features)  # an older one refuses the field


def test_batch_shares_are_taken_from_this_host_s_ranks_or_from_every_rank_s() -> None:
    async def main() -> None:
        link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4), on_change=lambda: None)
        link._take({**_PLAN, "batch_shares": {}, "rank_shares": {"j": [[1, 24], [3, 8]]}})
        assert link.advice("j", 1) == (24, [0, 1]) and link.advice("j", 3)[0] == 8
        assert link.advice("j", 0)[0] is None and link.advice("k", 1) == (None, None)
        link._take({**_PLAN, "version": 2})  # an older control plane's: every rank's
        assert link.advice("j", 1) == (16, [0, 1]) and link.advice("j", 0)[0] == 16
        assert link.advice("j", 3)[0] is None and link.advice("j", -1)[0] is None

    asyncio.run(main())


def test_only_a_plan_that_changes_this_host_s_part_re_plans_it() -> None:
    told: list[float] = []

    async def main() -> None:
        link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4),
                                  on_change=lambda: told.append(time.monotonic()))
        plan = {"type": "plan", "version": 1, "ttl_s": 0.3, "source": "gradlane",
                "job_classes": {"j": [10**6, 10**7, 1]}, "batch_shares": {"j": [16, 16]},
                "ownership": {}, "leaf": None, "computed_at": 1.0}
        link._take(plan)
        assert len(told) == 1
        # The next re-plan, the same for this host: nothing to do.
        link._take({**plan, "version": 2, "computed_at": 2.0})
        assert len(told) == 1
        # The shares moved (news for the shims), then the job's class.
        link._take({**plan, "version": 3, "batch_shares": {"j": [24, 8]}})
        assert len(told) == 2
        link._take({**plan, "version": 4, "job_classes": {"j": [10**6, 2 * 10**7, 1]}})
        assert len(told) == 3
        assert link.job_classes() == {"j": JobClassPlan(10**6, 2 * 10**7, 1)}
        # No more plans: told once when the last one runs out (not by the earlier
        # plans' timers), and the daemon falls back.
        started = time.monotonic()
        await until(lambda: len(told) == 4, timeout=5)
        await asyncio.sleep(0.2)
        assert len(told) == 4 and link.job_classes() is None
        assert told[-1] - started >= 0.25
        # A plan after the expiry is news even when it is the same as the last one.
        link._take({**plan, "version": 5, "job_classes": {"j": [10**6, 2 * 10**7, 1]}})
        assert len(told) == 5

    asyncio.run(main())


_PLAN = {"type": "plan", "version": 1, "ttl_s": 5.0, "source": "gradlane",
         "job_classes": {"j": [10**6, 10**7, 1]}, "batch_shares": {"j": [16, 16]},
         "ownership": {"j": [0, 1]}, "leaf": None, "link_bps": 10**9, "computed_at": 1.0}


def test_a_plan_is_in_force_for_its_time_to_live_and_not_a_moment_longer() -> None:
    clock = [100.0]

    async def main() -> None:
        link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4), on_change=lambda: None,
                                  clock=lambda: clock[0])
        link._take(dict(_PLAN))  # a time-to-live of 5 s
        clock[0] = 104.999
        assert link.fresh() and link.job_classes() == {"j": JobClassPlan(10**6, 10**7, 1)}
        clock[0] = 105.0
        assert not link.fresh() and link.job_classes() is None

    asyncio.run(main())


@pytest.mark.parametrize("change, says", [
    ({"version": "2"}, "bad plan version '2'"),
    ({"ttl_s": None}, "bad plan ttl_s None"),
    ({"ttl_s": 0}, "bad plan ttl_s 0"),
    ({"ttl_s": cp.MAX_TTL_S}, "bad plan ttl_s 1000000.0"),
    ({"job_classes": [["j", 1, 2, 3]]}, "bad plan job_classes"),
    ({"job_classes": {"j": 5}}, "bad job class 'j': 5"),
    ({"job_classes": {"j": [10**7, 10**6, 1]}}, "bad job class 'j'"),
    ({"job_classes": {"j": [10**6, 10**7, 8]}}, "bad job class 'j'"),
    ({"job_classes": {"j": [0, 10**7, 1]}}, "bad job class 'j'"),
    ({"job_classes": {"j": [1, 1 << 62, 1]}}, "bad job class 'j'"),
    ({"batch_shares": {"j": [16, 1 << 62]}}, "bad plan batch_shares"),
    ({"batch_shares": None}, "bad plan batch_shares None"),
    ({"batch_shares": {"j": [16, "16"]}}, "bad plan batch_shares"),
    ({"ownership": {"j": [0, -1]}}, "bad plan ownership"),
    ({"rank_shares": [[1, 16]]}, "bad plan rank_shares"),
    ({"rank_shares": {"j": [1, 16]}}, "bad plan rank_shares"),
    ({"rank_shares": {"j": [[1, 16, 2]]}}, "bad plan rank_shares"),
    ({"rank_shares": {"j": [[1, -16]]}}, "bad plan rank_shares"),
    ({"rank_shares": {"j": [[1, 1 << 62]]}}, "bad plan rank_shares"),
    ({"ownership": {"j": 0}}, "bad plan ownership"),
    ({"link_bps": 0}, "bad link_bps 0"),
    ({"link_bps": True}, "bad link_bps True"),
    ({"leaf": -1}, "bad plan leaf -1"),
    ({"leaf": "0"}, "bad plan leaf '0'"),
    ({"leaf": 1 << 16}, "bad plan leaf 65536"),
    ({"leaf": 2**70}, "bad plan leaf 1180591620717411303424"),  # not for msgpack to the shims
])
def test_a_plan_the_daemon_could_not_act_on_is_refused_and_the_last_one_kept(
        change: dict[str, Any], says: str) -> None:
    async def main() -> None:
        link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4), on_change=lambda: None)
        link._take(_PLAN)
        with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
            link._take({**_PLAN, "version": 2, **change})
        assert link.plan is not None and link.plan["version"] == 1
        assert link.advice("j", 1) == (16, [0, 1])
        assert link.job_classes() == {"j": JobClassPlan(10**6, 10**7, 1)}

    asyncio.run(main())


def test_a_plan_at_the_edges_of_valid_is_taken_and_other_messages_are_not_plans() -> None:
    told: list[int] = []

    async def main() -> None:
        link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4), on_change=lambda: told.append(1))
        for version, change in enumerate([
                {"job_classes": {"j": [1, 1, 7]}, "leaf": MAX_LEAF - 1, "link_bps": 1,
                 "ttl_s": 0.5},
                {"leaf": 0, "ttl_s": 1e6 - 1, "job_classes": {"j": [1, (1 << 62) - 1, 0]},
                 "batch_shares": {"j": [0, (1 << 62) - 1]},
                 "rank_shares": {"j": [[0, 0], [1, (1 << 62) - 1]]}}], start=1):
            link._take({**_PLAN, "version": version, **change})
            assert link.plan is not None and link.plan["version"] == version
        assert link.job_classes() is not None and link.advised_leaf() == 0
        for other in ({"type": "note", "version": 3}, {**_PLAN, "version": 0}):
            link._take(other)  # not a plan (a later version's message), or no version
            assert link.plan["version"] == 2 and len(told) == 2

    asyncio.run(main())


def test_reports_go_when_the_workers_or_their_speed_change_and_every_period_else() -> None:
    clock = [0.0]
    registry = Registry(bands=4)
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              registry, on_change=lambda: None, clock=lambda: clock[0])
    sent: list[int] = []
    batches: list[list[int]] = []

    class Socket:
        async def send_str(self, text: str) -> None:
            data = json.loads(text)
            sent.append(data["seq"])
            batches.append([w["batch"] for j in data["jobs"] for w in j["workers"]])

    async def main() -> None:
        task = asyncio.create_task(link._report_loop(Socket()))  # type: ignore[arg-type]
        try:
            await asyncio.sleep(0.35)  # three ticks of the loop: one report, at the start
            assert sent == [1]
            clock[0] = uplink.REPORT_EVERY  # the period is up
            await until(lambda: len(sent) == 2)
            worker = registry.add(protocol.Hello(1, "j", 0, 2, ()), Credentials(1, 0, 0))
            await until(lambda: len(sent) == 3)  # a worker came: at once, not in a period
            await asyncio.sleep(0.35)
            assert sent == [1, 2, 3]
            # Its throughput moves past THROUGHPUT_CHANGE: at once too (the median of its
            # latest steps: 0, then 320 samples/s, then 3,200 once most steps were).
            registry.record_timing(worker.id, protocol.Timing(1, 0.1, 0.0, 32))
            await until(lambda: len(sent) == 4)
            registry.record_timing(worker.id, protocol.Timing(2, 0.01, 0.0, 32))
            await asyncio.sleep(0.35)
            assert len(sent) == 4  # the low median is still 320
            registry.record_timing(worker.id, protocol.Timing(3, 0.01, 0.0, 30))
            await until(lambda: len(sent) == 5)
            assert batches[3:] == [[32], [30]]  # each worker's latest step's samples
            for step, samples in enumerate((31, 29, 31), start=4):  # 3,000 -> 3,100: 3%
                registry.record_timing(worker.id, protocol.Timing(step, 0.01, 0.0, samples))
            assert worker.throughput() == 3100
            await asyncio.sleep(0.35)
            assert len(sent) == 5
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(main())


@settings(max_examples=examples(300), deadline=None)
@example({"leaf": 2**70}, {})  # it drew none past 64 bits there in 300 examples
@given(st.dictionaries(st.sampled_from([*sorted(_PLAN), "rank_shares"]), json_like, max_size=3),
       st.dictionaries(st.sampled_from(["job_classes", "batch_shares", "rank_shares",
                                        "ownership"]), json_like, max_size=2))
def test_a_plan_is_refused_or_every_use_of_it_works(top: dict[str, Any],
                                                   of_job: dict[str, Any]) -> None:
    """Whatever a control plane of another version (or a broken one) puts in a plan's
    fields, or in a job's entry: the daemon refuses it (ValueError), or everything the
    daemon does with a plan works: its classes, each worker's advice and the welcome's
    leaf, encoded for the shims, and its status."""
    plan = {**_PLAN, "version": 2, **top}
    for key, value in of_job.items():
        if isinstance(plan.get(key), dict):
            plan[key] = {**plan[key], "j": value}

    async def main() -> None:
        link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4), on_change=lambda: None)
        try:
            link._take(json.loads(json.dumps(plan)))  # as it comes: JSON over the socket
        except ValueError:
            return
        link.job_classes()
        link.planned_link_bps()
        for rank in (0, 1, 2):
            share, owners = link.advice("j", rank)
            protocol.encode({"type": "plan", "batch_share": share, "ownership": owners})
        protocol.encode({"type": "welcome", "leaf": link.advised_leaf()})
        json.dumps(link.status())

    asyncio.run(main())


_SESSIONS = ["a list for a welcome", "a plan for a welcome", "a list for a plan", "a plan"]


def test_a_control_plane_that_breaks_the_protocol_never_stops_the_link() -> None:
    """A welcome that is not a map, one of another type, then a message that is not a map,
    then a plan: the link drops each broken session, retries, and takes the plan; the
    sessions that registered are counted, and the status says so."""
    sessions: list[str] = []

    async def daemon_socket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive_json()  # the register
        script = _SESSIONS[len(sessions)]
        sessions.append(script)
        if script == "a list for a welcome":
            await ws.send_str("[1]")
        elif script == "a plan for a welcome":
            await ws.send_json({**_PLAN, "version": 6})
        else:
            await ws.send_json({"type": "welcome", "version": 1, "host": "h1", "features": []})
            await ws.send_str("[1]" if script == "a list for a plan"
                              else json.dumps({**_PLAN, "version": 7}))
        # Until the link closes it, or the test ends. Not one receive(): that returns with
        # the link's first report, and the close that followed raced the link's read of
        # the plan (lost once in a slow run under coverage: the test waited for version 7
        # until its timeout).
        async for _ in ws:
            pass
        return ws

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/api/v1/daemon", daemon_socket)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        port = port_below_ephemeral()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        link = uplink.ControlLink(f"http://127.0.0.1:{port}", TOKEN, "h1", 0, [("eth0", 10**9)],
                                  Registry(bands=4), on_change=lambda: None)
        task = asyncio.create_task(link.run())
        try:
            await until(lambda: link.plan is not None or task.done())
            assert not task.done(), task.exception()
            assert link.plan is not None and link.plan["version"] == 7
            assert sessions == _SESSIONS
            status = link.status()
            assert status["sessions"] == 2 and status["plan_version"] == 7
            assert 0 <= status["plan_age_s"] < 5
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await runner.cleanup()

    asyncio.run(main())


class TwoNics(FakeBackend):
    """fake0 (2 Gbit/s) and fake1 (1 Gbit/s), an address each."""

    def addresses(self) -> set[str]:
        return {"fake0": {"10.0.0.1"}, "fake1": {"10.1.0.1"}}[self.ifname]


def test_a_host_whose_shims_use_both_nics_is_planned_with_their_sum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uplink, "REPORT_EVERY", 3600.0)

    def flows(*sources: str) -> list[dict[str, Any]]:
        return [{"band": 0, "src": src, "sport": 40000 + i, "dst": "10.9.0.1", "dport": 5000}
                for i, src in enumerate(sources)]

    async def main() -> None:
        port = port_below_ephemeral()
        config = _daemon_config(tmp_path, port, interfaces=(
            InterfaceConfig("fake0", 2 * 10**9), InterfaceConfig("fake1", 10**9)))
        daemon = Daemon(config, backend_factory=TwoNics)
        control, plane = await _start_control(port)
        serving = asyncio.create_task(daemon.serve())
        await asyncio.wait_for(daemon.ready.wait(), 10)

        def host_link() -> int | None:
            if plane.state is None or plane.state.topology is None:
                return None
            return plane.state.topology.hosts[0].nic_bps

        shims = []
        try:
            # Nothing registered yet: the host's link is its slowest NIC.
            await until(lambda: host_link() == 10**9)
            # Two jobs of two ranks, an address per NIC as `attach(address=[...])` gives:
            # each job's class is half the host.
            for job, rank in ((j, r) for j in "jk" for r in range(2)):
                shim = Shim(*await asyncio.open_unix_connection(str(config.socket_path)))
                await shim.send({"type": "hello", "version": 1, "job": job, "rank": rank,
                                 "world_size": 2, "flows": flows("10.0.0.1", "10.1.0.1")})
                shims.append(shim)
            await until(lambda: host_link() == 3 * 10**9)
            assert plane.message_for("h1")["link_bps"] == 3 * 10**9
            assert daemon.status()["link_bps"] == 3 * 10**9
            # The daemon splits the control plane's class by each NIC's share of that link.
            await until(lambda: daemon._plan is not None and daemon._plan.source == "control")
            assert plane.plan is not None
            planned = plane.plan.host_classes[0]["j"]
            specs = [next(j for j in b.spec.jobs if j.name == "j")  # type: ignore[attr-defined]
                     for b in daemon._backends]
            shaped = [daemon._shaped(b) for b in daemon._backends]
            assert planned.rate_bps == pytest.approx(1.5 * 10**9, rel=0.01)
            for spec, share in zip(specs, (2 / 3, 1 / 3), strict=True):
                assert spec.rate_bps == pytest.approx(planned.rate_bps * share, rel=1e-6)
            assert [s.ceil_bps for s in specs] == shaped  # the whole of each NIC
            # The shims move to fake0 alone: the host's link is fake0's.
            for shim in shims:
                await shim.send({"type": "flows", "flows": flows("10.0.0.1")})
            await until(lambda: host_link() == 2 * 10**9)
        finally:
            await _shut(shims, daemon, serving, control)

    asyncio.run(main())


def test_a_report_cannot_claim_more_link_than_its_interfaces() -> None:
    register = cp.Register("h1", 0, (cp.InterfaceReport("eth0", 10**9),
                                     cp.InterfaceReport("eth1", 10**9)), "0")
    assert cp.host_link(register, cp.Report(1, ())) == 10**9  # not said: the slowest
    assert cp.host_link(register, cp.Report(1, (), link_bps=2 * 10**9)) == 2 * 10**9
    for wrong in (3 * 10**9, 10**8):
        with pytest.raises(ProtocolError, match="link_bps"):
            cp.host_link(register, cp.Report(1, (), link_bps=wrong))


def test_a_host_whose_demand_is_over_a_message_is_planned_with_what_fits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Two jobs cut into 4 KiB chunks (65,536 and 50,000 of them): their chunk lists alone
    # are over the control plane's message cap. Sent whole, the report was refused, the
    # link dropped and tried again, and the host never planned. The largest job's list is
    # left out (said once in the log); the link holds and the other job's demand is planned.
    monkeypatch.setattr(uplink, "REPORT_EVERY", 0.2)
    chunks = {"big": cp.MAX_CHUNKS, "bigger-named-smaller": 50_000}

    async def main() -> None:
        port = port_below_ephemeral()
        config = _daemon_config(tmp_path, port)
        daemon = Daemon(config, backend_factory=FakeBackend)
        control, plane = await _start_control(port)
        serving = asyncio.create_task(daemon.serve())
        await asyncio.wait_for(daemon.ready.wait(), 10)
        shims = []
        try:
            for job, n in chunks.items():
                shim = Shim(*await asyncio.open_unix_connection(str(config.socket_path)))
                await shim.send({"type": "hello", "version": 1, "job": job, "rank": 0,
                                 "world_size": 1, "flows": []})
                events = [[i // 8, 4096, 0, 0.1] for i in range(n)]
                for at in range(0, n, protocol.MAX_EVENTS):
                    await shim.send({"type": "chunks", "iteration": 0,
                                     "events": events[at:at + protocol.MAX_EVENTS]})
                shims.append(shim)

            def planned() -> dict[str, int]:
                state = plane.state
                return {} if state is None else {j.name: len(j.chunk_bytes) for j in state.jobs}

            await until(lambda: planned() == {"big": 0, "bigger-named-smaller": 50_000})
            assert daemon.link is not None
            sessions = daemon.link.sessions
            await asyncio.sleep(1.0)  # five reports more, each left as it was
            assert daemon.link.sessions == sessions == 1 and daemon.link.connected
            assert list(daemon.link.left_out) == ["big"]
            shown = status_shown(daemon, monkeypatch)  # what `gradlane status` shows of it
            assert ("the report to the control plane leaves out the chunk list of job 'big' "
                    f"(the report would be over {cp.MAX_MESSAGE} bytes): planned without it"
                    ) in shown, shown
        finally:
            await _shut(shims, daemon, serving, control)

    asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        ": this host's report leaves out the chunk list of job 'big' (the report would be "
        f"over {cp.MAX_MESSAGE} bytes), and the control plane plans without it"), said


def test_a_report_leaves_out_what_a_control_plane_would_refuse_not_the_whole_host() -> None:
    # What shims may tell gradlaned and what a control plane takes differ: a job of more
    # ranks than it plans, a step of more samples than a report's batch. One such job made
    # the whole report refused, at every try: the host's other jobs were never planned.
    registry = Registry(bands=4)
    huge = protocol.Hello(version=1, job="huge", rank=69_999, world_size=70_000, flows=())
    registry.add(huge, Credentials(1, 0, 0))
    registry.add(protocol.Hello(1, "tokens", 0, 2, ()), Credentials(2, 0, 0))
    ok = registry.add(protocol.Hello(1, "ok", 0, 2, ()), Credentials(3, 0, 0))
    registry.record_timing(ok.id, protocol.Timing(1, 0.1, 0.0, 64))
    [tokens] = registry.jobs()["tokens"]
    registry.record_timing(tokens.id, protocol.Timing(1, 0.5, 0.0, 1 << 25))
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              registry, on_change=lambda: None)
    link.features = frozenset(cp.FEATURES)
    report = link.report(1)
    assert [j.name for j in cp.parse_report(report).jobs] == ["ok"]
    assert link._unreported == {
        "huge": "job 'huge' (report: jobs[0].workers[0]: rank must be an integer in 0..65536)",
        "tokens": "job 'tokens' (report: jobs[0].workers[0]: batch must be an integer in "
                  "0..16777216)"}


def test_a_report_holds_the_jobs_and_ranks_the_protocol_counts() -> None:
    registry = Registry(bands=4)
    pid = iter(range(1, 1 << 20))
    for k in range(cp.MAX_JOBS):
        registry.add(protocol.Hello(1, f"j{k:03}", 0, 1, ()), Credentials(next(pid), 0, 0))
    for rank in range(cp.MAX_WORKERS + 1):
        registry.add(protocol.Hello(1, "wide", rank, cp.MAX_WORKERS + 1, ()),
                     Credentials(next(pid), 0, 0))
    link = uplink.ControlLink("http://127.0.0.1:1", TOKEN, "h1", 0, [("eth0", 10**9)],
                              registry, on_change=lambda: None)
    link.features = frozenset(cp.FEATURES)
    jobs = cp.parse_report(link.report(1)).jobs
    assert [j.name for j in jobs] == [f"j{k:03}" for k in range(cp.MAX_JOBS)]
    assert link._unreported == {"wide": f"job 'wide' (a report holds {cp.MAX_JOBS} jobs)"}
    for k in range(1, cp.MAX_JOBS):  # the jobs go; the wide one is reported, in part
        registry.remove(registry.jobs()[f"j{k:03}"][0].id)
    jobs = cp.parse_report(link.report(2)).jobs
    assert [w.rank for w in jobs[-1].workers] == list(range(cp.MAX_WORKERS))
    assert link._unreported == {
        "wide": f"the ranks of job 'wide' past the first {cp.MAX_WORKERS} on this host"}
    registry.remove(registry.jobs()["wide"][-1].id)  # as many ranks as a report holds
    jobs = cp.parse_report(link.report(3)).jobs
    assert [w.rank for w in jobs[-1].workers] == list(range(cp.MAX_WORKERS))
    assert link._unreported == {}  # all of them in: nothing said to be left out
