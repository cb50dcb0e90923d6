"""`gradlane control`: auth, input validation, plans pushed to daemons, isolation of bad peers."""

import asyncio
import contextlib
import http.server
import io
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner
from hypothesis import event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gradlane import cli
from gradlane.daemon import control
from gradlane.daemon import control_protocol as cp
from gradlane.daemon.control import ControlConfig, ControlPlane, read_token, token_exposed
from gradlane.daemon.fields import EXCHANGES, MAX_LEAF
from gradlane.errors import ConfigError, ProtocolError
from gradlane.policies import DEFAULT_MAX_WEIGHED, JobClassPlan, Plan, check_plan
from gradlane.units import first_of
from tests import examples, metric_samples
from tests.fakes import until
from tests.strategies import json_like

TOKEN = "t0ken-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _config(**kw: Any) -> ControlConfig:
    return ControlConfig(**{"token": TOKEN, "cadence_s": 0.2, "react_s": 0.01, "ttl_s": 5.0, **kw})


def _run(test: Callable[[ControlPlane, TestClient], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        plane = ControlPlane(_config(**kw))
        async with TestServer(plane.app()) as server, TestClient(server) as client:
            await test(plane, client)

    asyncio.run(main())


G10 = 10_000_000_000


def _register(host: str, leaf: int = 0, rate_bps: int = 10_000_000_000) -> dict[str, Any]:
    return {"type": "register", "version": 1, "host": host, "leaf": leaf, "gradlane": "0.1.0",
            "interfaces": [{"name": "eth0", "rate_bps": rate_bps}]}


def _report(ranks: list[int], throughput: float, batch: int = 64) -> dict[str, Any]:
    return {"type": "report", "seq": 1, "jobs": [{
        "name": "j", "global_batch": batch, "layers": 4, "chunk_bytes": [1000] * 8,
        "workers": [{"rank": r, "throughput": throughput, "batch": 16} for r in ranks]}]}


def _named(report: dict[str, Any], job: str) -> dict[str, Any]:
    """`report` with its one job named `job`."""
    return {**report, "jobs": [{**report["jobs"][0], "name": job}]}


async def _next_plan(ws: aiohttp.ClientWebSocketResponse, want_shares: bool = True
                     ) -> dict[str, Any]:
    async with asyncio.timeout(10):
        while True:
            msg = await ws.receive()
            assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
            data = json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else \
                msgpack.unpackb(msg.data)
            if data["type"] == "plan" and (data["batch_shares"] or data.get("rank_shares")
                                           or not want_shares):
                return data


def test_missing_or_wrong_token_is_401() -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        assert (await client.get("/api/v1/cluster")).status == 401
        bad = {"Authorization": "Bearer wrong-token-wrong-token"}
        assert (await client.get("/api/v1/cluster", headers=bad)).status == 401
        assert (await client.get("/metrics", headers=bad)).status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await client.ws_connect("/api/v1/daemon")
        assert err.value.status == 401
        ok = await client.get("/api/v1/cluster", headers=AUTH)
        assert ok.status == 200 and (await ok.json())["hosts"] == []

    _run(test)


def test_oversized_body_is_413_and_garbage_is_400() -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        big = await client.post("/api/v1/report", data=io.BytesIO(b"x" * (2 << 20)), headers=AUTH)
        assert big.status == 413
        for body, kind in ((b"{not json", "application/json"), (b"\xc1\xc1", "application/msgpack"),
                           (b"[1, 2]", "application/json")):
            r = await client.post("/api/v1/report", data=body,
                                  headers={**AUTH, "Content-Type": kind})
            assert r.status == 400, body
        wrong = {"register": {**_register("h1"), "extra": 1}, "report": _report([0], 1.0)}
        r = await client.post("/api/v1/report", json=wrong, headers=AUTH)
        assert r.status == 400 and "unknown fields ['extra']" in await r.text()
        for demand in ({"chunk_layers": [0]}, {"chunk_layers": [0] * 7 + [4]},
                       {"band_bps": [-1.0]}):  # 8 chunks need 8 layers below `layers` (4)
            report = _report([0], 1.0)
            report["jobs"][0].update(demand)
            r = await client.post("/api/v1/report", json={"register": _register("h1"),
                                                          "report": report}, headers=AUTH)
            assert r.status == 400, demand
        report = _report([0], 1.0)
        report["jobs"][0].update(chunk_layers=[0, 0, 1, 1, 2, 2, 3, 3], band_bps=[1e6, 0.0])
        r = await client.post("/api/v1/report", json={"register": _register("h1"),
                                                      "report": report}, headers=AUTH)
        assert r.status == 200

    _run(test)


def test_post_report_answers_with_the_hosts_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "POST_SILENT_S", 2.0)

    async def test(plane: ControlPlane, client: TestClient) -> None:
        body = {"register": _register("h1"), "report": _report([0, 1], 10.0, batch=10)}
        for _ in range(50):
            r = await client.post("/api/v1/report", json=body, headers=AUTH)
            assert r.status == 200
            plan = await r.json()
            if plan["version"]:
                break
            await asyncio.sleep(0.05)
        assert plan["batch_shares"] == {"j": [5, 5]}
        assert set(plan["job_classes"]) == {"j"} and plan["ttl_s"] == 5.0
        # Reporting, it is connected: plans made since (the report's, 10 ms later) keep it.
        assert (await client.post("/api/v1/report", json=body, headers=AUTH)).status == 200
        await asyncio.sleep(0.3)
        view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
        assert view["hosts"][0]["connected"] and not view["jobs"]["j"]["degraded"]
        # A daemon that only POSTs and then goes quiet is lost: its job is degraded.
        for _ in range(100):
            view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
            if view["jobs"]["j"]["degraded"]:
                break
            await asyncio.sleep(0.05)
        assert view["jobs"]["j"]["degraded"] and not view["hosts"][0]["connected"]
        # The same in msgpack, answered in msgpack.
        r = await client.post("/api/v1/report", data=msgpack.packb(body), headers={
            **AUTH, "Content-Type": "application/msgpack"})
        assert r.status == 200 and r.content_type == "application/msgpack"
        answer = msgpack.unpackb(await r.read())
        assert answer["type"] == "plan" and answer["batch_shares"] == {"j": [5, 5]}

    _run(test)


def test_daemons_get_their_part_of_the_plan_with_throughput_shares() -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        fast = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        slow = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await fast.send_json(_register("fast"))
        await slow.send_bytes(msgpack.packb(_register("slow")))  # msgpack works too
        assert (await fast.receive_json())["type"] == "welcome"
        await fast.send_json(_report([0, 1], 100.0, batch=60))
        await slow.send_bytes(msgpack.packb(_report([2, 3], 50.0, batch=60)))
        for ws in (fast, slow):
            plan = await _next_plan(ws)
            while plan["batch_shares"]["j"] != [20, 20, 10, 10]:  # until both reports are in
                plan = await _next_plan(ws)
            assert plan["job_classes"]["j"][0] > 0 and plan["ownership"]["j"]
        view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
        assert [h["host"] for h in view["hosts"]] == ["fast", "slow"]
        assert view["jobs"]["j"]["workers"] == 4 and not view["jobs"]["j"]["degraded"]
        # A daemon lost: its job is degraded, the other daemon is still served.
        await slow.close()
        for _ in range(100):
            view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
            if view["jobs"]["j"]["degraded"]:
                break
            await asyncio.sleep(0.02)
        assert view["jobs"]["j"]["degraded"]
        assert (await _next_plan(fast))["type"] == "plan"
        metrics = await (await client.get("/metrics", headers=AUTH)).text()
        assert "gradlane_control_plans_total" in metrics
        await fast.close()

    _run(test)


def test_a_daemon_that_takes_rank_shares_gets_its_own_ranks_and_an_older_one_every_rank_s(
) -> None:
    # One job of four ranks on two hosts. The daemon whose reports say it takes
    # `rank_shares` gets its two ranks' shares (a job of 8,192 ranks sent 8,192 to each
    # host, every second); the older one every rank's, as before. Both plans are valid.
    async def test(plane: ControlPlane, client: TestClient) -> None:
        new = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        old = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        for ws, host in ((new, "new"), (old, "old")):
            await ws.send_json(_register(host))
            assert "takes" in (await ws.receive_json())["features"]
        await new.send_json({**_report([2, 3], 50.0, batch=60), "takes": ["rank_shares"]})
        await old.send_json(_report([0, 1], 100.0, batch=60))
        plan = await _next_plan(new)
        while plan["rank_shares"]["j"] != [[2, 10], [3, 10]]:  # until both reports are in
            plan = await _next_plan(new)
        assert plan["batch_shares"] == {} and plan["ownership"]["j"]
        cp.check_plan(plan)
        plan = await _next_plan(old)
        while plan["batch_shares"]["j"] != [20, 20, 10, 10]:
            plan = await _next_plan(old)
        assert "rank_shares" not in plan
        cp.check_plan(plan)
        for ws in (new, old):
            await ws.close()

    _run(test)


def test_a_report_takes_only_the_plan_fields_it_knows() -> None:
    def takes(names: object) -> frozenset[str]:
        return cp.parse_report({"type": "report", "seq": 1, "jobs": [], "takes": names}).takes

    assert takes(["rank_shares"]) == {"rank_shares"}
    assert takes(["rank_shares", "a_later_field"]) == {"rank_shares"}  # a later daemon's
    assert takes(["x" * 64] * 16) == frozenset()  # at the caps: taken, and not known
    assert cp.parse_report({"type": "report", "seq": 1, "jobs": []}).takes == frozenset()
    for bad in ("rank_shares", [1], ["x" * 65], ["f"] * 17):
        with pytest.raises(ProtocolError, match="takes must be"):
            takes(bad)


def test_a_daemon_lost_for_long_is_forgotten_and_the_others_planned_without_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Degraded for LOST_AFTER_S, then gone from the view and from the state the policy
    # plans (a host taken out of the cluster must not hold its jobs' shares forever).
    monkeypatch.setattr(control, "LOST_AFTER_S", 0.3)

    async def test(plane: ControlPlane, client: TestClient) -> None:
        stay = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await stay.send_json(_register("stay"))
        assert (await stay.receive_json())["type"] == "welcome"
        await stay.send_json(_named(_report([0, 1], 100.0, batch=60), "a"))
        for host, job in (("gone", "j"), ("back", "k")):  # one lost, one that comes back
            ws = await client.ws_connect("/api/v1/daemon", headers=AUTH)
            await ws.send_json(_register(host))
            assert (await ws.receive_json())["type"] == "welcome"
            await ws.send_json(_named(_report([0, 1], 50.0, batch=60), job))
            await _next_plan(ws)
            await ws.close()
        again = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await again.send_json(_register("back"))
        assert (await again.receive_json())["type"] == "welcome"
        await again.send_json(_named(_report([0, 1], 50.0, batch=60), "k"))
        await until(lambda: "gone" not in plane.daemons, timeout=10)
        view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
        assert [h["host"] for h in view["hosts"]] == ["back", "stay"]
        assert set(view["jobs"]) == {"a", "k"}
        await until(lambda: plane.state is not None and {j.name for j in plane.state.jobs}
                    == {"a", "k"}, timeout=10)
        await stay.close()
        await again.close()

    _run(test)


def test_a_daemon_that_does_not_take_its_plan_is_disconnected_and_the_others_served(
        caplog: pytest.LogCaptureFixture) -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        sockets = {}
        for host, ranks in (("good", [0, 1]), ("wedged", [2, 3])):
            ws = sockets[host] = await client.ws_connect("/api/v1/daemon", headers=AUTH)
            await ws.send_json(_register(host))
            assert (await ws.receive_json())["type"] == "welcome"
            await ws.send_json(_report(ranks, 50.0, batch=60))
        await _next_plan(sockets["wedged"])
        send = plane._send

        async def stops_reading(daemon: Any, message: dict[str, Any]) -> None:
            if daemon.register.host == "wedged":  # what SEND_TIMEOUT makes of a full socket
                raise TimeoutError
            await send(daemon, message)

        plane._send = stops_reading  # type: ignore[method-assign]
        async with asyncio.timeout(10):
            while (await sockets["wedged"].receive()).type != aiohttp.WSMsgType.CLOSE:
                pass
        await until(lambda: not plane.daemons["wedged"].connected)
        assert (await _next_plan(sockets["good"], want_shares=False))["type"] == "plan"
        for ws in sockets.values():
            await ws.close()

    _run(test)
    assert "daemon wedged did not take its plan (TimeoutError); disconnecting it" in caplog.text


def test_an_oversubscribed_uplink_makes_shims_reduce_within_leaves() -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        a = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        b = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await a.send_json(_register("a", leaf=0))
        await b.send_json(_register("b", leaf=1))
        for ws in (a, b):
            assert (await ws.receive_json())["type"] == "welcome"
        # No job needed: the advice is about the host, so shims have it at attach.
        leaves = []
        for ws in (a, b):
            plan = await _next_plan(ws, want_shares=False)
            while plan["version"] == 0 or plan["leaf"] is None:
                plan = await _next_plan(ws, want_shares=False)
            leaves.append(plan["leaf"])
        assert leaves == [0, 1]
        view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
        assert view["plan"]["reduce_in_leaf"]
        await a.close()
        await b.close()

    _run(test, uplink_bps=5_000_000_000)  # each leaf: a 10 Gbit/s host over a 5 Gbit/s uplink


def test_states_are_built_off_the_event_loop_and_a_failed_build_keeps_the_planner(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    release = threading.Event()
    builds: list[str] = []

    async def test(plane: ControlPlane, client: TestClient) -> None:
        demand = plane._demand

        def slow_demand(*args: Any) -> Any:
            builds.append(threading.current_thread().name)
            if len(builds) == 1:
                raise RuntimeError("a state bug")
            release.wait(10)  # a slow build: held until the view below has answered
            return demand(*args)

        monkeypatch.setattr(plane, "_demand", slow_demand)
        try:
            ws = await client.ws_connect("/api/v1/daemon", headers=AUTH)
            await ws.send_json(_register("h"))
            assert (await ws.receive_json())["type"] == "welcome"
            await ws.send_json(_report([0], 5.0, batch=8))
            async with asyncio.timeout(5):
                while len(builds) < 2:  # the first build failed, the planner went on
                    await asyncio.sleep(0.01)
                view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
            assert view["jobs"]["j"]["workers"] == 1  # served while a state was being built
            # ... and said the failure, for operators: in the view, `gradlane status` and /metrics.
            assert view["planning_failed"]["times"] == 1
            assert view["planning_failed"]["error"] == "RuntimeError: a state bug"
            assert 0 <= view["planning_failed"]["last_s_ago"] < 5
            assert 0 <= view["hosts"][0]["seen_s_ago"] < 5
            shown = _status_of(tmp_path, monkeypatch, view)
            assert "planning FAILED 1 time(s) since the last plan" in shown
            assert "RuntimeError: a state bug; the daemons keep the last plan" in shown
            metrics = await (await client.get("/metrics", headers=AUTH)).text()
            assert "gradlane_control_plan_failures_total 1.0" in metrics
            assert "gradlane_control_plan_age_seconds NaN" in metrics  # none planned yet
            release.set()
            assert (await _next_plan(ws))["batch_shares"] == {"j": [8]}
            view = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
            assert view["planning_failed"] is None  # planned since
            assert 0 <= view["plan"]["age_s"] < 5
            metrics = await (await client.get("/metrics", headers=AUTH)).text()
            age = metric_samples(metrics, "gradlane_control_plan_age_seconds")
            assert list(age) == [""] and 0 <= age[""] < 5
            for timed in ("plan", "push"):  # each an interval, not a moment
                seconds = metric_samples(metrics, f"gradlane_control_{timed}_seconds")
                assert seconds["_count"] >= 1 and 0 <= seconds["_sum"] < 5 * seconds["_count"]
            assert "FAILED" not in _status_of(tmp_path, monkeypatch, view)
            await ws.close()
        finally:
            release.set()  # a failed assertion must not leave the build held

    with caplog.at_level("ERROR", logger=control.__name__):
        _run(test)
    assert threading.main_thread().name not in builds
    assert "a state bug" in caplog.text


def test_a_plan_that_takes_longer_than_a_ttl_keeps_the_plan_in_force_alive(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Daemons time a plan's TTL from its arrival. A plan that takes longer than a TTL to
    # make (a job of 65,536 ranks, its first: 88 s) left every daemon on its local policy
    # meanwhile; now the plan in force comes again every half TTL, the same plan.
    hold, release = threading.Event(), threading.Event()

    async def test(plane: ControlPlane, client: TestClient) -> None:
        good = plane.policy

        def slow(state: Any) -> Any:
            if hold.is_set():
                release.wait(10)
            return good.plan(state)

        monkeypatch.setattr(plane, "policy", SimpleNamespace(name=good.name, plan=slow))
        ws = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await ws.send_json(_register("h"))
        assert (await ws.receive_json())["type"] == "welcome"
        await ws.send_json(_report([0], 5.0, batch=8))
        await _next_plan(ws)
        hold.set()  # from the next plan on (one being made may still come: `last`)
        try:
            last = await _next_plan(ws)
            started = time.monotonic()
            again = [await _next_plan(ws) for _ in range(3)]  # every half TTL
            took = time.monotonic() - started
        finally:
            release.set()
        assert [(p["version"], p["computed_at"]) for p in again] == \
            [(last["version"], last["computed_at"])] * 3
        assert took < 3 * 1.0  # each within the TTL of the one before
        later = await _next_plan(ws)
        assert later["version"] > last["version"]
        metrics = await (await client.get("/metrics", headers=AUTH)).text()
        assert metric_samples(metrics, "gradlane_control_plan_resends")["_total"] >= 3
        # Timed as pushes are only the new plans' (once each; one may be on its way), not
        # the plan sent again.
        pushes = metric_samples(metrics, "gradlane_control_push_seconds")["_count"]
        plans = metric_samples(metrics, "gradlane_control_plans")["_total"]
        assert plans - 1 <= pushes <= plans, (pushes, plans)
        await ws.close()

    with caplog.at_level("INFO", logger=control.__name__):
        _run(test, ttl_s=1.0)
    said = [r.getMessage() for r in caplog.records if "sending the one in force" in r.getMessage()]
    assert len(said) == 1, said  # once for the slow plan, not at every resend
    assert said[0].endswith("sending the one in force again every 0.5 s meanwhile"), said


def test_hosts_of_one_class_are_checked_once_and_a_bad_one_named_by_its_first_host() -> None:
    # The classes are checked by job and class, not host by host: the first host given a
    # refused one is named. An equal class of NumPy integers (which a daemon refuses: not
    # JSON integers) is not taken for the good one it equals.
    plane = ControlPlane(_config())
    state = SimpleNamespace(topology=SimpleNamespace(
        hosts=[SimpleNamespace(name=f"h{i}") for i in range(4)]))
    good = JobClassPlan(5, 10**9, 3)

    def plan(classes: dict[int, dict[str, JobClassPlan]]) -> Plan:
        return Plan(job_classes={}, source="test", host_classes=classes)

    classes = {0: {"j": good}, 1: {"j": good, "k": JobClassPlan(0, 10**9, 1)},
               2: {"k": JobClassPlan(0, 10**9, 1)}}
    with pytest.raises(ValueError, match=r"\(host h1\): bad job class 'k': \[0, "):
        plane._refused_by_daemons(plan(classes), state)
    numpy = JobClassPlan(np.int64(5), 10**9, 3)
    assert numpy == good
    with pytest.raises(ValueError, match=r"\(host h3\): bad job class 'j': \[np.int64\(5\), "):
        plane._refused_by_daemons(plan({0: {"j": good}, 3: {"j": numpy}}), state)
    plane._refused_by_daemons(plan({0: {"j": good}, 3: {"j": good}}), state)


@pytest.mark.parametrize(("broken", "says"), [
    ({"host_classes": {0: {"j": JobClassPlan(0, 10**9, 3)}}},
     "(host h): bad job class 'j': [0, 1000000000, 3]"),
    ({"ownership": {"j": (-1,)}}, "(every host): bad plan ownership {'j': [-1]}"),
])
def test_a_plan_daemons_would_refuse_is_a_failed_plan_not_sent(
    broken: dict[str, Any], says: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A policy's bug (a third party's, by `--policy module:Class`) planning a class of rate
    # 0: every daemon refused every such plan and dropped its link, over and over. Now the
    # control plane finds it, keeps the plan it had, and says so as a failed plan.
    async def test(plane: ControlPlane, client: TestClient) -> None:
        good = plane.policy
        monkeypatch.setattr(plane, "policy", SimpleNamespace(
            name="broken", plan=lambda state: replace(good.plan(state), **broken)))
        ws = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await ws.send_json(_register("h"))
        assert (await ws.receive_json())["type"] == "welcome"
        await ws.send_json(_report([0], 5.0, batch=8))
        await until(lambda: plane.failing is not None and plane.failing[0] >= 2)
        assert plane.plan is None and not ws.closed
        assert plane.failing[2] == f"ValueError: policy broken planned what daemons refuse {says}"
        monkeypatch.setattr(plane, "policy", good)
        first = await _next_plan(ws)  # the first plan sent: the good policy's
        assert first["batch_shares"] == {"j": [8]} and first["job_classes"]["j"][0] > 0
        assert first["ownership"] == {}  # one rank: none to plan
        assert plane.failing is None
        await ws.close()
        # Said once while it failed alike, not at every try.
        said = [r for r in caplog.records if r.getMessage().startswith("policy broken failed")]
        assert len(said) == 1 and said[0].exc_info is not None

    _run(test)


def _status_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, view: dict[str, Any],
               *more: str) -> str:
    """What `gradlane status --cluster` (with `more` flags) prints of `view`."""
    monkeypatch.setattr(cli, "_get_json", lambda *_a, **_k: view)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    shown = CliRunner().invoke(cli.cli, ["status", "--cluster", "--token-file", str(token),
                                         *more])
    assert shown.exit_code == 0, shown.output
    return shown.output


def test_a_bad_message_closes_only_that_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        good = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await good.send_json(_register("good"))
        await good.receive_json()
        bad = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await bad.send_json({"type": "launch_missiles"})
        error = await bad.receive_json()
        assert error["type"] == "error" and "expected a 'register' message" in error["message"]
        assert (await bad.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        await good.send_json(_report([0], 5.0, batch=8))
        assert (await _next_plan(good))["batch_shares"] == {"j": [8]}
        await good.close()

    _run(test)
    # The refused connection ended as the plane meant it to, not in an error of its own.
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_websocket_that_never_registers_is_closed_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that says nothing (a port scanner, a stuck client) holds no slot past
    HELLO_TIMEOUT; one that closes before its register is a bad message: each counted by
    its reason, and no daemon is registered."""
    monkeypatch.setattr(control, "HELLO_TIMEOUT", 0.2)

    async def test(plane: ControlPlane, client: TestClient) -> None:
        silent = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        async with asyncio.timeout(10):
            assert (await silent.receive()).type in (aiohttp.WSMsgType.CLOSE,
                                                     aiohttp.WSMsgType.CLOSED)
        closing = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await closing.close()

        async def rejected() -> dict[str, float]:
            text = await (await client.get("/metrics", headers=AUTH)).text()
            return {sample.labels["reason"]: sample.value
                    for family in text_string_to_metric_families(text)
                    for sample in family.samples
                    if sample.name == "gradlane_control_rejected_total"}

        async with asyncio.timeout(10):
            while "bad_message" not in await rejected():  # the close reaches it
                await asyncio.sleep(0.05)
        assert await rejected() == {"no_register": 1, "bad_message": 1}
        assert plane.daemons == {}

    _run(test)


def test_a_daemon_past_the_most_the_plane_takes_is_refused_and_one_registered_comes_back(
) -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        first = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await first.send_json(_register("h1"))
        assert (await first.receive_json())["type"] == "welcome"
        extra = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await extra.send_json(_register("h2"))
        refused = await extra.receive_json()
        assert refused == {"type": "error", "code": "full", "message": "already 1 daemons"}
        await first.close()
        again = await client.ws_connect("/api/v1/daemon", headers=AUTH)  # h1, reconnecting
        await again.send_json(_register("h1"))
        assert (await again.receive_json())["type"] == "welcome"
        await again.close()
        await extra.close()
        assert set(plane.daemons) == {"h1"}

    _run(test, max_daemons=1)


def test_a_daemon_connecting_again_gets_the_plan_at_once_and_its_old_session_is_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restarted gradlaned reconnects while its old connection may still be open (its
    host gone quiet, not closed): the newer session wins, the old one is closed and its
    close leaves the daemon connected; the plan there is comes with the welcome, not with
    the plan the register brings about a second later (a new version: no plan comes on
    the 30 s cadence in between)."""
    async def test(plane: ControlPlane, client: TestClient) -> None:
        old = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await old.send_json(_register("h1"))
        assert (await old.receive_json())["type"] == "welcome"
        await old.send_json(_report([0, 1], 1.0, batch=4))
        first = await _next_plan(old)
        new = await client.ws_connect("/api/v1/daemon", headers=AUTH)
        await new.send_json(_register("h1"))
        assert (await new.receive_json())["type"] == "welcome"
        at_once = await new.receive_json()
        assert at_once["type"] == "plan" and at_once["version"] == first["version"]
        assert at_once["batch_shares"] == {"j": [2, 2]}
        async with asyncio.timeout(5):
            while (await old.receive()).type not in (aiohttp.WSMsgType.CLOSE,
                                                     aiohttp.WSMsgType.CLOSED):
                pass
        await new.send_json(_report([0, 1], 1.0, batch=6))
        assert (await _next_plan(new))["batch_shares"] == {"j": [3, 3]}  # a second later
        assert plane.daemons["h1"].connected and plane.daemons["h1"].ws is not None
        assert "disconnected" not in caplog.text  # the old session's end said nothing
        await new.close()

    with caplog.at_level("WARNING", logger=control.__name__):
        _run(test, cadence_s=30.0, react_s=1.0, ttl_s=60.0)
    assert "daemon h1 disconnected; its jobs are degraded" in caplog.text  # the new one's


def test_a_flood_of_bad_connections_does_not_stop_good_daemons() -> None:
    async def test(plane: ControlPlane, client: TestClient) -> None:
        async def attacker(i: int) -> None:
            if i % 3 == 0:
                with pytest.raises(aiohttp.WSServerHandshakeError):
                    await client.ws_connect("/api/v1/daemon")
            elif i % 3 == 1:
                ws = await client.ws_connect("/api/v1/daemon", headers=AUTH)
                await ws.send_bytes(b"\x00garbage")
                await ws.receive()
                await ws.close()
            else:
                r = await client.post("/api/v1/report", data=b"{", headers=AUTH)
                assert r.status == 400

        async def good() -> dict[str, Any]:
            ws = await client.ws_connect("/api/v1/daemon", headers=AUTH)
            await ws.send_json(_register("good"))
            await ws.receive_json()
            await ws.send_json(_report([0, 1], 1.0, batch=4))
            plan = await _next_plan(ws)
            await ws.close()
            return plan

        results = await asyncio.gather(good(), *(attacker(i) for i in range(150)))
        assert results[0]["batch_shares"] == {"j": [2, 2]}
        rejected = await (await client.get("/metrics", headers=AUTH)).text()
        assert 'gradlane_control_rejected_total{reason="auth"}' in rejected

    _run(test)


def test_config_and_token_errors(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        ControlConfig(token="x" * 15)
    assert ControlConfig(token="x" * 16).token == "x" * 16
    with pytest.raises(ConfigError, match="unknown policy"):
        ControlConfig(token=TOKEN, policy="nope")
    with pytest.raises(ConfigError, match="ttl_s must exceed"):
        ControlConfig(token=TOKEN, cadence_s=5, ttl_s=1)
    with pytest.raises(ConfigError, match="ttl_s must exceed"):  # it would lapse at each push
        ControlConfig(token=TOKEN, cadence_s=5, ttl_s=5)
    for timing in ({"cadence_s": 0}, {"cadence_s": 3601, "ttl_s": 4000},
                   {"react_s": 2.0}, {"react_s": -0.1}):
        with pytest.raises(ConfigError, match=r"^cadence_s must be in \(0, 3600\] and react_s "
                                              r"in \[0, cadence_s\]"):
            ControlConfig(token=TOKEN, **timing)
    with pytest.raises(ConfigError, match="^the uplink rate must be positive"):
        ControlConfig(token=TOKEN, uplink_bps=0)
    # Daemons refuse a plan that claims to live 1e6 s or more: the plane never sends one.
    for ttl in (1e6, float("inf")):
        with pytest.raises(ConfigError, match=r"^ttl_s must be under 1e\+06 s \(daemons "
                                              r"refuse a plan that lives longer\), got "):
            ControlConfig(token=TOKEN, ttl_s=ttl)
    assert ControlConfig(token=TOKEN, ttl_s=999_999).ttl_s == 999_999
    assert cli.MAX_TTL_S == cp.MAX_TTL_S  # the CLI's bound, named without the import
    assert cli.MAX_WEIGHED == DEFAULT_MAX_WEIGHED == ControlConfig(token=TOKEN).max_weighed
    with pytest.raises(ConfigError, match="^max_weighed must be at least 1, got 0"):
        ControlConfig(token=TOKEN, max_weighed=0)
    assert ControlConfig(token=TOKEN, cadence_s=3600, react_s=3600, ttl_s=3601).react_s == 3600
    path = tmp_path / "token"
    with pytest.raises(ConfigError, match="cannot read"):
        read_token(path)
    path.write_bytes(b"\xff" * 20)  # a key file, say
    with pytest.raises(ConfigError, match="^cannot read the token file .*: not UTF-8 text$"):
        read_token(path)
    path.write_text(f"  {'x' * 15}\n")  # 18 characters, 15 of them the token's
    with pytest.raises(ConfigError, match=f"^{path}: the token must be at least 16 characters$"):
        read_token(path)
    path.write_text(TOKEN + "\n")
    assert read_token(path) == TOKEN
    path.write_text("x" * 16)
    assert read_token(path) == "x" * 16
    # It goes in an HTTP header: a second line there failed every daemon's connection
    # ("Forbidden control character"), and the control plane took the file as it was.
    for bad in (f"{TOKEN}\n{TOKEN}\n", f"{TOKEN} {TOKEN}", f"{TOKEN}\u00e9", f"{TOKEN}\x07"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=f"^{path}: the token must be one word of "
                                              r"printable ASCII \(no spaces, one line\)"):
            read_token(path)
    path.write_text("Zm9vYmFyYmF6cXV4Zm9vYmFy+/==\n")  # base64's alphabet
    assert read_token(path) == "Zm9vYmFyYmF6cXV4Zm9vYmFy+/=="


def test_a_token_file_others_may_read_is_warned_of_and_still_taken(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # As ssh says of a key: a token readable by others lets them command the cluster.
    path = tmp_path / "token"
    path.write_text(TOKEN)
    for mode in (0o600, 0o400, 0o700):
        path.chmod(mode)
        assert read_token(path) == TOKEN and token_exposed(path) is None
    assert caplog.records == []
    for mode in (0o640, 0o604):
        path.chmod(mode)
        assert read_token(path) == TOKEN
        assert caplog.records[-1].levelname == "WARNING"
        assert caplog.records[-1].getMessage() == (
            f"the token file {path} is open to its group or others (mode {mode:04o}): whoever "
            f"reads it can command the control plane; chmod 600 {path}")
    count = len(caplog.records)
    assert read_token(path, warn=False) == TOKEN and len(caplog.records) == count


def test_a_systemd_credential_readable_by_the_service_s_user_alone_is_not_warned_of(
        tmp_path: Any) -> None:
    """systemd writes a credential 0400 and gives the service's (dynamic) user read access
    through a POSIX ACL, whose mask shows as the group bits: 0440, and nobody else reads it."""
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o400)
    everyone = 0xFFFFFFFF  # the id field of entries that name no one
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in [
        (0x01, 4, everyone),  # the owner: r
        (0x02, 4, 65534),     # the service's user: r
        (0x04, 0, everyone),  # the owning group: nothing
        (0x10, 4, everyone),  # the mask: r (shown as the group bits)
        (0x20, 0, everyone),  # others: nothing
    ])
    try:
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"{tmp_path} takes no POSIX ACL ({exc.strerror})")
    assert path.stat().st_mode & 0o777 == 0o440
    assert token_exposed(path) is None
    path.chmod(0o444)  # others too, ACL or not
    assert token_exposed(path) is not None


def _reported(plane: ControlPlane, host: str, leaf: int, jobs: list[dict[str, Any]],
              rate_bps: int = 10_000_000_000) -> None:
    """`host`'s daemon registered and reported `jobs`, as if over its socket."""
    register = cp.parse_register(_register(host, leaf, rate_bps))
    plane.daemons[host] = control._Daemon(
        register, cp.parse_report({"type": "report", "seq": 1, "jobs": jobs}), ws=None)


def _plan_now(plane: ControlPlane) -> None:
    """The state of what the daemons reported and its plan, as the planner would make them."""
    plane.state = plane.build_state()
    plane.plan = plane.policy.plan(plane.state)


def _job(name: str, ranks: list[int], chunk_bytes: list[int]) -> dict[str, Any]:
    return {"name": name, "global_batch": 64, "layers": len(chunk_bytes),
            "chunk_bytes": chunk_bytes, "chunk_layers": list(range(len(chunk_bytes))),
            "workers": [{"rank": r, "throughput": 100.0, "batch": 16} for r in ranks]}


def test_reports_become_demand_flows_and_the_coflow_policy_orders_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Jobs a (4 MB) and b (32 MB) each have a worker on both leaves: both cross the uplink.
    plane = ControlPlane(_config(policy="coflow", uplink_bps=5_000_000_000))
    small, big = [1_000_000] * 4, [8_000_000] * 4
    _reported(plane, "h0", 0, [{**_job("a", [0], small), "band_bps": [2e6, 1.5e6]},
                               _job("b", [0], big)])
    _reported(plane, "h1", 1, [{**_job("a", [1], small), "band_bps": [1e6, 0.0, 0.5e6]},
                               _job("b", [1], big)])
    state = plane.build_state()
    assert [c.job for c in state.coflows] == ["a", "b"]
    # Two workers, flat: each sends every chunk it does not own up, and those it owns down.
    for k, total in enumerate((sum(small), sum(big))):
        mine = state.flows.coflow == k
        assert state.flows.bytes[mine].sum() == 2 * total
        assert (state.flows.src[mine] != state.flows.dst[mine]).all()
    plan = plane.policy.plan(state)
    assert check_plan(state, plan) == []
    assert plan.coflow_order == ("a", "b") and plan.job_level["a"] < plan.job_level["b"]
    plane.state, plane.plan = state, plan
    view = plane.view()
    assert view["plan"]["coflow_order"] == ["a", "b"]
    assert view["jobs"]["b"]["demand_bytes"] == 2 * sum(big)
    assert view["jobs"]["a"]["band_bps"] == [3e6, 1.5e6, 0.5e6]  # per band, both hosts'
    # `gradlane status --cluster` shows them (the view as the control plane would serve it).
    monkeypatch.setattr(cli, "_get_json", lambda *_a, **_k: json.loads(json.dumps(view)))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    shown = CliRunner().invoke(cli.cli, ["status", "--cluster", "--token-file", str(token)])
    assert shown.exit_code == 0, shown.output
    a, b = (line for line in shown.output.splitlines() if "(level" in line)  # jobs a, b
    assert "8.00 MB" in a and "1 (level 0)" in a and "│ 5Mbit " in a  # sending now
    assert "64.00 MB" in b and "2 (level 1)" in b
    assert view["jobs"]["a"]["global_batch"] == 64 and "[32, 32] of 64" in a  # its shares
    assert view["plan"]["owned_shares"]["a"] == [0.5, 0.5] and "50/50%" in a  # owned bytes


def test_a_job_too_large_to_weigh_gets_even_owners_and_the_plan_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Four hosts of two ranks under two leaves, the first at 25 Gbit/s, one job reducing
    # within leaves: its owner shares weigh its hosts' loads (4 owners, ranks numbered
    # host by host, on 8 host links), unless there are more than the control plane
    # should hold: then even owners, said in the log (once), the view and `gradlane
    # status --cluster`.
    def plan(max_weighed: int) -> tuple[ControlPlane, Plan]:
        plane = ControlPlane(_config(uplink_bps=10_000_000_000, max_weighed=max_weighed))
        for h in range(4):
            _reported(plane, f"h{h}", h // 2,
                      [{**_job("j", [2 * h, 2 * h + 1], [1000] * 40), "exchange": "leaf"}],
                      rate_bps=25_000_000_000 if h == 0 else 10_000_000_000)
        state = plane.build_state()
        made = plane.policy.plan(state)
        assert check_plan(state, made) == []
        return plane, made

    _, weighed = plan(4 * 8)  # at the limit: weighed
    plane, even = plan(4 * 8 - 1)  # past it (the same placement, cached: by its limit too)
    assert weighed.notes == ()
    assert [weighed.ownership["j"].count(r) for r in range(8)] != [5] * 8
    assert [even.ownership["j"].count(r) for r in range(8)] == [5] * 8
    assert even.notes == ("job 'j': even chunk owners: weighing 4 owners on 8 host links is "
                          "past 31 loads (gradlane control --max-weighed)",)
    caplog.set_level(logging.WARNING, logger="gradlane.daemon.control")
    for _ in range(2):  # logged when it comes, not again while plans keep it
        plane._log_notes(even)
        plane.state, plane.plan = plane.build_state(), even
    assert [r.getMessage() for r in caplog.records] == [f"plan: {even.notes[0]}"]
    view = plane.view()
    assert view["plan"]["notes"] == list(even.notes)
    monkeypatch.setattr(cli, "_get_json", lambda *_a, **_k: json.loads(json.dumps(view)))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    shown = CliRunner().invoke(cli.cli, ["status", "--cluster", "--token-file", str(token)])
    assert shown.exit_code == 0 and "plan: job 'j': even chunk owners" in shown.output


def test_gradlane_status_sums_up_a_large_cluster_a_leaf_a_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 40 hosts on two leaves, one job of 40 ranks, two daemons gone: a leaf a row names the
    # lost hosts, the job's shares are a range; --all lists every host and every share.
    plane = ControlPlane(_config())
    for h in range(40):
        _reported(plane, f"h{h:02d}", h // 20, [{**_job("j", [h], [1000] * 80),
                                                  "global_batch": 40 * 16}])
    _plan_now(plane)
    for lost in ("h03", "h27"):
        plane.daemons[lost].connected = False
    view = json.loads(json.dumps(plane.view()))
    summed = _status_of(tmp_path, monkeypatch, view)
    rows = {line.split()[1]: line.split() for line in summed.splitlines()
            if line.startswith("│") and "0.1.0" in line}
    assert rows["0"][1:9:2] == ["0", "20", "19", "h03"] and rows["1"][7] == "h27"
    assert "h05" not in summed
    assert "16 each (40 ranks) of 640" in summed  # equal throughput
    assert "2% each (40 ranks)" in summed  # owned bytes: 80 chunks over 40 ranks
    every = _status_of(tmp_path, monkeypatch, view, "--all")
    assert all(f"h{h:02d}" in every for h in range(40))
    assert "[16, 16," in every and "(40 ranks)" not in every
    alone = CliRunner().invoke(cli.cli, ["status", "--all"])
    assert alone.exit_code == 2 and "--all goes with --cluster" in alone.output


def test_gradlane_status_with_nothing_answering_says_what_to_check(tmp_path: Path) -> None:
    held = socket.socket()  # bound, never listening: connections to it are refused
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    with held:
        _status_unanswered(tmp_path, port)


def _status_unanswered(tmp_path: Path, port: int) -> None:
    shown = CliRunner().invoke(cli.cli, ["status", "--url", f"http://127.0.0.1:{port}"])
    assert shown.exit_code == 1 and f"no gradlaned answers at http://127.0.0.1:{port}/status" \
        in shown.output and "Is gradlaned running on this host" in shown.output, shown.output
    token = tmp_path / "token"
    token.write_text(TOKEN)
    shown = CliRunner().invoke(cli.cli, ["status", "--cluster", "--token-file", str(token),
                                         "--url", f"http://127.0.0.1:{port}"])
    assert shown.exit_code == 1 and "no control plane answers" in shown.output and \
        "Is `gradlane control` running there?" in shown.output, shown.output


@contextlib.contextmanager
def _answering(body: bytes, code: int = 200) -> Iterator[str]:
    """An HTTP server on loopback answering every GET with `body` (and `code`); yields its
    URL."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _both_statuses(tmp_path: Path) -> list[tuple[list[str], str]]:
    """`gradlane status`'s two kinds, each with who it says answered."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    return [(["status"], "gradlaned"),
            (["status", "--cluster", "--token-file", str(token)], "control plane")]


def test_gradlane_status_asking_a_control_plane_without_cluster_says_to_add_it() -> None:
    # The control plane asks for its token on every path, /status too; gradlaned never does.
    with _answering(b"missing or wrong bearer token", code=401) as url:
        shown = CliRunner().invoke(cli.cli, ["status", "--url", url])
    assert shown.exit_code == 1, shown.output
    assert shown.output.splitlines()[-2:] == [
        f"Error: the gradlaned at {url}/status said 401: missing or wrong bearer token",
        "gradlaned asks for no token: what answers there may be the control plane, whose "
        "view is `gradlane status --cluster`."]


def test_gradlane_status_of_an_empty_cluster_says_none_rather_than_empty_tables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    view = json.loads(json.dumps(ControlPlane(_config()).view()))
    shown = _status_of(tmp_path, monkeypatch, view).splitlines()
    assert shown[1:] == [
        "hosts: none has registered yet (each gradlaned does with its [control] url and "
        "this token)", "jobs: none (no host has reported a training job)"]


@pytest.mark.parametrize("status", [{"version": "0.0.1"}, [1, 2], {"plan": 5, "version": "x"}])
def test_gradlane_status_of_a_shape_it_cannot_read_says_so_not_a_traceback(
        tmp_path: Path, status: Any) -> None:
    """Another version's status, or another program's JSON on that port."""
    with _answering(json.dumps(status).encode()) as url:
        for argv, who in _both_statuses(tmp_path):
            shown = CliRunner().invoke(cli.cli, [*argv, "--url", url])
            assert shown.exit_code == 1 and shown.exception is not None, shown.output
            said = " ".join(shown.output.split())
            assert said.startswith(f"Error: the {who} at {url} answered with a status this "
                                   "gradlane"), said
            assert "--json shows it as it is" in said
            shown = CliRunner().invoke(cli.cli, [*argv, "--url", url, "--json"])
            assert shown.exit_code == 0 and json.loads(shown.output) == status


@pytest.mark.parametrize("body", [b"<html>a web server</html>", b"\xff\xfe\x00garbage", b""])
def test_gradlane_status_of_an_answer_that_is_not_json_says_so_not_a_traceback(
        tmp_path: Path, body: bytes) -> None:
    """Another program (a web server, a metrics exporter) on the port asked."""
    with _answering(body) as url:
        for argv, who in _both_statuses(tmp_path):
            for json_flag in ([], ["--json"]):
                shown = CliRunner().invoke(cli.cli, [*argv, "--url", url, *json_flag])
                said = " ".join(shown.output.split())
                assert shown.exit_code == 1 and isinstance(shown.exception, SystemExit), said
                assert said.startswith(f"Error: what answers at {url}/") and \
                    f"is not a {who}: its answer is not JSON" in said, said


def test_gradlane_status_of_an_endless_answer_stops_reading_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "MAX_STATUS_BYTES", 64)
    with _answering(json.dumps({"pad": "x" * 65}).encode()) as url:
        for argv, who in _both_statuses(tmp_path):
            shown = CliRunner().invoke(cli.cli, [*argv, "--url", url])
            said = " ".join(shown.output.split())
            assert shown.exit_code == 1 and f"is not a {who}: its answer is not JSON (more " \
                "than 64 bytes)" in said, said


@pytest.mark.parametrize("url, says", [
    ("10.0.0.5:9464", "is not an address such as http://10.0.0.5:9464"),
    ("file:///etc/passwd", "is not an address such as"),
    ("http://", "is not an address such as"),
    ("http://a b:9464", "is not an address such as"),
    ("http://10.0.0.5:port", "Port could not be cast to integer"),
    ("http://10.0.0.5:70000", "Port out of range"),
    ("http://[::1", "Invalid IPv6 URL"),
])
def test_gradlane_status_refuses_an_address_it_cannot_ask(url: str, says: str) -> None:
    """Not a traceback from urllib ('unknown url type'), nor a file read (file://)."""
    for cluster in ([], ["--cluster"]):
        shown = CliRunner().invoke(cli.cli, ["status", *cluster, "--url", url])
        said = " ".join(shown.output.split())
        assert shown.exit_code == 2 and "Invalid value for '--url'" in said and says in said, \
            said


def test_gradlane_status_names_every_exchange_a_job_can_say() -> None:
    assert set(cli._EXCHANGE) == set(EXCHANGES)


def test_ranks_sharing_a_host_put_only_what_crosses_hosts_in_the_demand() -> None:
    plane = ControlPlane(_config())
    flat = {"exchange": "flat"}
    _reported(plane, "h0", 0, [{**_job("j", [0, 1], [1000] * 4), **flat}])
    _reported(plane, "h1", 0, [{**_job("j", [2, 3], [1000] * 4), **flat}])
    _reported(plane, "h2", 0, [_job("lone", [0], [1000])])  # one worker: nothing to exchange
    state = plane.build_state()
    assert [c.job for c in state.coflows] == ["j"]
    # Each chunk's owner gets the two copies of the other host and sends it two results:
    # 4 chunks x 4 crossings x 1000 bytes, half leaving each host (owners alternate hosts).
    assert state.flows.bytes.sum() == 16_000
    assert set(state.flows.src.tolist()) == {0, 1} and (state.flows.src != state.flows.dst).all()


def test_demand_of_a_deep_model_comes_in_at_most_demand_buckets_a_job() -> None:
    """200 layers, a chunk each, on two hosts: consecutive layers share a bucket, so the
    state has at most 2 x DEMAND_BUCKETS flows a worker, every byte still in them, and
    each bucket's priority is its first layer's."""
    plane = ControlPlane(_config())
    chunks = [1000 + i for i in range(200)]
    _reported(plane, "h0", 0, [_job("j", [0], chunks)])
    _reported(plane, "h1", 0, [_job("j", [1], chunks)])
    state = plane.build_state()
    for host in (0, 1):
        assert 0 < (state.flows.src == host).sum() <= 2 * control.DEMAND_BUCKETS
    assert state.flows.bytes.sum() == 2 * sum(chunks)  # flat, two ranks: each chunk twice
    firsts = sorted(set(state.flows.priority.tolist()))
    assert len(firsts) == control.DEMAND_BUCKETS and firsts[0] == 0
    assert firsts == [-(-b * 200 // control.DEMAND_BUCKETS) for b in range(len(firsts))]


def test_a_job_back_with_fewer_ranks_gets_owners_among_them() -> None:
    """A plan's chunk owners of a job of three ranks, the job then restarted on two (its
    chunks the same): owners of rank 2 are no rank of it, so the demand assigns afresh."""
    plane = ControlPlane(_config())
    chunks = [1000] * 6
    for h in range(3):
        _reported(plane, f"h{h}", 0, [_job("j", [h], chunks)])
    _plan_now(plane)
    assert max(plane.plan.ownership["j"]) == 2
    del plane.daemons["h2"]
    for h in range(2):
        _reported(plane, f"h{h}", 0, [_job("j", [h], chunks)])
    state = plane.build_state()
    assert state.flows.bytes.sum() == 2 * sum(chunks)
    assert set(state.flows.src.tolist()) == set(state.flows.dst.tolist()) == {0, 1}
    assert check_plan(state, plane.policy.plan(state)) == []


def test_the_view_of_a_job_that_regrouped_its_chunks_since_the_plan() -> None:
    """The shims' layout trial regroups (8 chunks, then 4): until the next plan its owners
    are for chunks no longer there, so the view shows no owned shares, not an error."""
    plane = ControlPlane(_config())
    for h in range(2):
        _reported(plane, f"h{h}", 0, [_job("j", [h], [1000] * 8)])
    _plan_now(plane)
    assert plane.view()["plan"]["owned_shares"] == {"j": [0.5, 0.5]}
    for h in range(2):
        _reported(plane, f"h{h}", 0, [_job("j", [h], [2000] * 4)])
    plane.state = plane.build_state()
    assert plane.view()["plan"]["owned_shares"] == {}


def test_a_daemon_new_since_the_plan_gets_no_other_host_s_part_of_it() -> None:
    plane = ControlPlane(_config())
    for h in range(2):
        _reported(plane, f"h{h}", 0, [_job("j", [h], [1000] * 8)])
    _plan_now(plane)
    known = plane.message_for("h0")
    assert known["job_classes"] and known["link_bps"] and known["leaf"] is None  # no advice
    _reported(plane, "h2", 0, [_job("k", [0], [1000] * 8)])  # after the state was built
    message = plane.message_for("h2")
    assert message["version"] == plane.plan.version
    assert (message["job_classes"], message["link_bps"], message["leaf"]) == ({}, None, None)
    assert message["batch_shares"] == message["ownership"] == {}


def test_demand_follows_how_the_shims_say_they_reduce() -> None:
    # Ranks 0, 1 on leaf 0 and 2, 3 on leaf 1; the plan advises reduction within leaves.
    def uplink_bytes(said: dict[str, object]) -> tuple[float, str | None]:
        plane = ControlPlane(_config(uplink_bps=5_000_000_000))
        for host, leaf, ranks in (("h0", 0, [0]), ("h1", 0, [1]), ("h2", 1, [2]),
                                  ("h3", 1, [3])):
            _reported(plane, host, leaf, [{**_job("j", ranks, [1000] * 8), **said}])
        _plan_now(plane)
        assert plane.plan.reduce_in_leaf
        state = plane.build_state()
        leaf = np.array([h.leaf for h in state.topology.hosts])
        crossing = leaf[state.flows.src] != leaf[state.flows.dst]
        return float(state.flows.bytes[crossing].sum()), plane.view()["jobs"]["j"]["exchange"]

    # Flat, each chunk crosses the spine from the other leaf's two ranks to its owner and
    # back to both; within leaves first, once each way: half as much.
    flat, leaf = uplink_bytes({"exchange": "flat"}), uplink_bytes({"exchange": "leaf"})
    assert flat[0] == 2 * leaf[0] and (flat[1], leaf[1]) == ("flat", "leaf")
    # Not said yet: as the plan advises. Daemons of the last version say it as a flag.
    assert uplink_bytes({}) == (leaf[0], None)
    assert uplink_bytes({"in_leaf": False}) == flat
    assert uplink_bytes({"in_leaf": True}) == leaf


def test_shims_not_told_their_leaves_are_expected_on_the_ring_until_a_plan_advises() -> None:
    """Four ranks, a host each, two on each leaf, not said how they reduce: with no plan
    advising reduction within leaves, their shims (at "auto") know no leaves and take the
    ring; once one does, within leaves first."""
    plane = ControlPlane(_config(uplink_bps=5_000_000_000))
    for rank in range(4):
        _reported(plane, f"h{rank}", rank // 2, [_job("j", [rank], [1000] * 8)])
    _plan_now(plane)
    assert (plane.state.jobs[0].ring, plane.state.jobs[0].by_host) == (True, False)
    assert plane.plan.reduce_in_leaf
    assert plane.build_state().jobs[0].ring is False


@pytest.mark.parametrize(("said", "busiest"), [("ring", 2000), ("flat", 3000), (None, 2000)])
def test_demand_of_a_job_on_the_ring(said: str | None, busiest: int) -> None:
    # Four ranks under one leaf, one chunk of 1000 bytes. Flat, its owner sends the
    # average to the three others; on the ring every rank sends at most twice (the partial
    # sum on, the average on). Not said yet: shims at their default take the ring here.
    plane = ControlPlane(_config())
    for rank in range(4):
        job = {**_job("j", [rank], [1000]), **({"exchange": said} if said else {})}
        _reported(plane, f"h{rank}", 0, [job])
    state = plane.build_state()
    sent = np.bincount(state.flows.src, state.flows.bytes, minlength=4)
    assert sent.sum() == 6000 and sent.max() == busiest
    assert plane.view()["jobs"]["j"]["exchange"] == said


@pytest.mark.parametrize(("said", "owned"), [("ring", [0, 0, 0, 8]), (None, [0, 0, 0, 8]),
                                             ("flat", [3, 3, 2, 0])])
def test_chunk_owners_follow_the_exchange_the_shims_say(said: str | None,
                                                        owned: list[int]) -> None:
    # Four ranks under one leaf, the last on a link half as fast. On the ring a rank's own
    # chunks skip its links: the slow one owns them all. Flat, its link would carry S plus
    # twice what it owns: it owns none. Not said yet: shims at their default take the ring.
    plane = ControlPlane(_config())
    for rank in range(4):
        job = {**_job("j", [rank], [1000] * 8), **({"exchange": said} if said else {})}
        _reported(plane, f"h{rank}", 0, [job], rate_bps=5_000_000_000 if rank == 3 else G10)
    state = plane.build_state()
    assert state.jobs[0].ring == (said != "flat")
    plane.state, plane.plan = state, plane.policy.plan(state)
    owners = plane.plan.ownership["j"]
    assert [owners.count(r) for r in range(4)] == owned
    assert plane.view()["plan"]["owned_shares"]["j"] == [n / 8 for n in owned]


def test_chunk_owners_of_ranks_sharing_a_host_sit_where_the_ring_crosses_a_nic() -> None:
    # Eight ranks, 0-3 reported by h0's daemon and 4-7 by h1's, on the ring (the shims'
    # default): of its eight links only 3 -> 4 and 7 -> 0 cross a NIC, and a chunk owned
    # at either end of one skips it one way. The control plane sends those owners.
    plane = ControlPlane(_config())
    _reported(plane, "h0", 0, [{**_job("j", [0, 1, 2, 3], [1000] * 8), "exchange": "ring"}])
    _reported(plane, "h1", 0, [{**_job("j", [4, 5, 6, 7], [1000] * 8), "exchange": "ring"}])
    _plan_now(plane)
    assert plane.state.jobs[0].ring and [w.host for w in plane.state.workers] == [0] * 4 + [1] * 4
    owners = plane.plan.ownership["j"]
    assert [owners.count(r) for r in range(8)] == [2, 0, 0, 2, 2, 0, 0, 2]
    assert plane.message_for("h1")["ownership"]["j"] == list(owners)


@pytest.mark.parametrize("said", ["host", None])
def test_ranks_sharing_hosts_reduce_within_them_first(said: str | None) -> None:
    # Eight ranks, four on each of two hosts, one chunk of 1000 bytes. Within hosts first,
    # one copy crosses each host's NIC each way, whoever owns it: 1000 bytes out of the
    # owner's host (the result) and 1000 out of the other (its host's partial sum). Not
    # said yet: what shims at their default do with ranks sharing hosts.
    plane = ControlPlane(_config())
    for host, ranks in (("h0", [0, 1, 2, 3]), ("h1", [4, 5, 6, 7])):
        job = {**_job("j", ranks, [1000]), **({"exchange": said} if said else {})}
        _reported(plane, host, 0, [job])
    state = plane.build_state()
    assert state.jobs[0].by_host and not state.jobs[0].ring
    sent = np.bincount(state.flows.src, state.flows.bytes, minlength=2)
    assert sent.tolist() == [1000, 1000]
    assert plane.view()["jobs"]["j"]["exchange"] == said
    assert check_plan(state, plane.policy.plan(state)) == []


def test_ranks_sharing_hosts_under_leaves_reduce_within_hosts_then_leaves() -> None:
    # Two leaves of two hosts, two ranks a host, one chunk of 1000 bytes owned by rank 0
    # (host h0), within leaves first. Up: h1's leader sends to rank 0; in leaf 1, h3's
    # leader to h2's, which sends leaf 1's sum across the spine. The averages come back
    # the same way. A leaf leader alone would take a copy from each of 3 other ranks.
    plane = ControlPlane(_config(uplink_bps=5_000_000_000))
    for host, leaf, ranks in (("h0", 0, [0, 1]), ("h1", 0, [2, 3]), ("h2", 1, [4, 5]),
                              ("h3", 1, [6, 7])):
        _reported(plane, host, leaf, [{**_job("j", ranks, [1000]), "exchange": "leaf"}])
    _plan_now(plane)
    plane.plan = replace(plane.plan, ownership={"j": (0,)})
    state = plane.build_state()
    sent = np.bincount(state.flows.src, state.flows.bytes, minlength=4)
    assert sent.tolist() == [2000, 1000, 2000, 1000]
    leaf = np.array([h.leaf for h in state.topology.hosts])
    assert state.flows.bytes[leaf[state.flows.src] != leaf[state.flows.dst]].sum() == 2000


def test_the_shims_are_told_owners_only_once_every_rank_is_reported() -> None:
    # Owners over ranks 0 and 1 of a job of 3 would be taken, then replaced.
    plane = ControlPlane(_config())
    _reported(plane, "h0", 0, [{**_job("j", [0], [1000] * 6), "world_size": 3}])
    _reported(plane, "h1", 0, [{**_job("j", [1], [1000] * 6), "world_size": 3}])
    _plan_now(plane)
    assert plane.plan.ownership["j"] and plane.message_for("h0")["ownership"] == {}
    _reported(plane, "h2", 0, [{**_job("j", [2], [1000] * 6), "world_size": 3}])
    _plan_now(plane)
    assert plane.message_for("h0")["ownership"]["j"] == list(plane.plan.ownership["j"])
    assert sorted(set(plane.plan.ownership["j"])) == [0, 1, 2]


def test_a_job_missing_ranks_has_no_demand_yet() -> None:
    plane = ControlPlane(_config())
    _reported(plane, "h0", 0, [_job("j", [0], [1000] * 4)])
    _reported(plane, "h1", 0, [_job("j", [2], [1000] * 4)])  # rank 1 not reported yet
    state = plane.build_state()
    assert state.coflows == () and len(state.flows) == 0
    assert check_plan(state, plane.policy.plan(state)) == []
    # Ranks 0 and 1 of a job of 3, as the daemons say: not a job of two.
    _reported(plane, "h1", 0, [{**_job("j", [1], [1000] * 4), "world_size": 3}])
    assert plane.build_state().coflows == ()
    _reported(plane, "h2", 0, [{**_job("j", [2], [1000] * 4), "world_size": 3}])
    assert [c.job for c in plane.build_state().coflows] == ["j"]


@pytest.mark.parametrize("field, values, ok", [
    ("chunk_bytes", [1000, 2000], True),
    ("chunk_bytes", [1, (1 << 40) - 1], True),
    *[("chunk_bytes", [1000, bad], False)
      for bad in (True, 0, -5, 1 << 40, 2.0, "2", None)],
    ("chunk_layers", [0, 1], True),
    ("chunk_layers", [1, 1], True),
    *[("chunk_layers", bad, False)
      for bad in ([0, 2], [0, -1], [0, False], [0, 1.0], [0], [0, 1, 1])],
])
def test_a_report_s_chunks_are_sizes_and_their_layers_below_its_layers(
        field: str, values: list[Any], ok: bool) -> None:
    job = {**_job("j", [0], [1000, 2000]), field: values}  # layers: 2
    report = {"type": "report", "seq": 1, "jobs": [job]}
    if not ok:
        with pytest.raises(ProtocolError, match=f"jobs\\[0\\].{field} must"):
            cp.parse_report(report)
        return
    parsed = getattr(cp.parse_report(report).jobs[0], field)
    assert parsed == tuple(values) and all(type(v) is int for v in parsed)


def _two_jobs_report(**change: Any) -> dict[str, Any]:
    return {"type": "report", "seq": 1,
            "jobs": [_job("a", [0, 1], [1000]), _job("b", [0], [1000])], **change}


@pytest.mark.parametrize("message, code, says", [
    ({**_register("h"), "version": 2}, "version", "register: protocol version 2, "),
    # Before versions were counted from 1: another version too, not a malformed field.
    ({**_register("h"), "version": 0}, "version", "register: protocol version 0, "),
    ({**_register("h"), "version": 1 << 16}, "version", "register: protocol version 65536, "),
    ({**_register("h"), "version": (1 << 16) + 1}, "bad_message",
     r"register: version must be an integer in 0\.\.65536"),
    ({**_register("h"), "interfaces": []}, "bad_message", "register: at least one interface"),
    ({**_register("h"), "interfaces": ["eth0"]}, "bad_message",
     r"register: interfaces\[0\] must be a map"),
    (_two_jobs_report(jobs=[_job("a", [0], [1000]), _job("a", [1], [1000])]), "bad_message",
     "report: job 'a' listed twice"),
    (_two_jobs_report(jobs=[_job("a", [0, 1, 0], [1000])]), "bad_message",
     "report: job 'a' rank 0 twice"),
    (_two_jobs_report(jobs=[_job("a", [0], [1000]), "b"]), "bad_message",
     r"report: jobs\[1\] must be a map"),
    (_two_jobs_report(jobs=[{**_job("a", [0], [1000]), "workers": [0]}]), "bad_message",
     r"report: jobs\[0\].workers\[0\] must be a map"),
])
def test_a_register_or_report_that_breaks_the_protocol_is_refused_saying_how(
        message: dict[str, Any], code: str, says: str) -> None:
    assert cp.parse_report(_two_jobs_report()).jobs[1].name == "b"
    parse = cp.parse_register if message["type"] == "register" else cp.parse_report
    with pytest.raises(ProtocolError, match=f"^{says}") as refused:
        parse(message)
    assert refused.value.code == code


def test_a_message_over_the_size_cap_is_refused_before_it_is_read() -> None:
    empty = json.dumps({"type": "report", "pad": ""})
    fits = json.dumps({"type": "report", "pad": "x" * (cp.MAX_MESSAGE - len(empty))})
    assert len(fits) == cp.MAX_MESSAGE and cp.decode(fits)["type"] == "report"
    with pytest.raises(ProtocolError, match=f"^message of {cp.MAX_MESSAGE + 1} bytes exceeds"
                       ) as refused:
        cp.decode(b"x" * (cp.MAX_MESSAGE + 1))
    assert refused.value.code == "too_big"


def _fits_leaving_out_the_largest_fewest(message: dict[str, Any], binary: bool,
                                         sizes: dict[str, int],
                                         without: Callable[[dict[str, Any], list[str]],
                                                           dict[str, Any]]) -> list[str]:
    """`cp.fit(message, binary)`'s jobs left out, once checked: the encoding is `message`
    without them (`without`), within the cap; they are the largest (`sizes`) first, and
    one fewer would not fit."""
    data, left_out = cp.fit(message, binary)
    assert len(data) <= cp.MAX_MESSAGE
    assert cp.decode(data) == cp.decode(cp.encode(without(message, left_out), binary))
    assert left_out == sorted(sizes, key=lambda n: -sizes[n])[:len(left_out)]
    if left_out:
        assert len(cp.encode(without(message, left_out[:-1]), binary)) > cp.MAX_MESSAGE
    else:
        assert data == cp.encode(message, binary)
    return left_out


def _without_lists(report: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`report` with the chunk lists of the jobs `names` left out, as `cp.fit` leaves them."""
    return {**report, "jobs": [{**job, "chunk_bytes": [], "chunk_layers": []}
                               if job["name"] in names else job for job in report["jobs"]]}


def _at_the_cap_either_side(message: dict[str, Any], binary: bool, sizes: dict[str, int],
                            without: Callable[[dict[str, Any], list[str]], dict[str, Any]],
                            pad: str) -> None:
    """`message` padded (its key `pad`) so that without "big" it is exactly at the cap, then
    that many bytes under and over it: "big" alone is left out while the rest fits, and
    "small" too once it does not (`_fits_leaving_out_the_largest_fewest`)."""
    def padded(n: int) -> dict[str, Any]:
        return {**message, pad: "p" * n}

    def rest(n: int) -> int:  # bytes of the message padded by n, "big" left out
        return len(cp.encode(without(padded(n), ["big"]), binary))

    n = cp.MAX_MESSAGE - rest(0)
    n -= rest(n) - cp.MAX_MESSAGE  # the rest exactly at the cap (the pad's header counted)
    assert rest(n) == cp.MAX_MESSAGE
    for slack in range(-20, 21):  # the rest that many bytes under the cap
        left_out = _fits_leaving_out_the_largest_fewest(padded(n - slack), binary, sizes,
                                                        without)
        assert left_out == (["big"] if slack >= 0 else ["big", "small"]), slack


@pytest.mark.parametrize("binary", [False, True])
def test_a_report_over_the_size_cap_leaves_out_the_largest_jobs_chunk_lists(
        binary: bool) -> None:
    # A host whose jobs were cut into many small chunks (4 KiB, 65,536 a job at most):
    # refused whole, the report would be refused at every try and the host never planned.
    chunks = {"a": 65536, "b": 60000, "c": 50000, "d": 100}
    report = {"type": "report", "seq": 7, "jobs": [
        {**_job(name, [0, 1], [4096] * n), "layers": n} for name, n in chunks.items()]}

    left_out = _fits_leaving_out_the_largest_fewest(report, binary, chunks, _without_lists)
    assert left_out == (["a"] if binary else ["a", "b"])
    parsed = cp.parse_report(cp.decode(cp.fit(report, binary)[0]))
    assert [len(j.chunk_bytes) for j in parsed.jobs] == [0 if j in left_out else n
                                                       for j, n in chunks.items()]
    assert all(len(j.workers) == 2 for j in parsed.jobs)  # only the chunk lists go
    small = {**report, "jobs": report["jobs"][2:]}
    assert _fits_leaving_out_the_largest_fewest(small, binary, chunks, _without_lists) == []
    other = {"type": "welcome", "pad": "x" * cp.MAX_MESSAGE}  # nothing in it can give way
    assert cp.fit(other, binary) == (cp.encode(other, binary), [])


@pytest.mark.parametrize("binary", [False, True])
def test_a_plan_just_over_the_size_cap_leaves_out_no_more_than_it_must(binary: bool) -> None:
    # A plan that fits once its largest job's owners are left out, to the byte and a few
    # bytes either side: what leaving a job out saves is first counted without its key,
    # a few bytes short, which would leave out the next job too.
    plan = control.ControlPlane(_config()).message_for("h1")
    plan.update(version=3, ownership={"big": [1] * 300_000, "small": [2] * 50})
    sizes = {j: len(cp.encode(owners, binary)) for j, owners in plan["ownership"].items()}

    def without(plan: dict[str, Any], names: list[str]) -> dict[str, Any]:
        return {**plan, "ownership": {j: o for j, o in plan["ownership"].items()
                                      if j not in names}}

    _at_the_cap_either_side(plan, binary, sizes, without, "source")


@pytest.mark.parametrize("binary", [False, True])
def test_a_report_just_over_the_size_cap_leaves_out_no_more_than_it_must(
        binary: bool) -> None:
    # As the plan's above, for a report, whose chunk lists give way to empty ones: what
    # that saves is counted to the byte in JSON and a little short in msgpack.
    chunks = {"big": 60000, "small": 50}
    report = {"type": "report", "seq": 7, "jobs": [
        {**_job(name, [0, 1], [4096] * n), "layers": n} for name, n in chunks.items()]}

    _at_the_cap_either_side(report, binary, chunks, _without_lists, "pad")


@pytest.mark.parametrize("binary", [False, True])
def test_a_plan_over_the_size_cap_leaves_out_the_largest_jobs_chunk_owners(
        binary: bool, caplog: pytest.LogCaptureFixture) -> None:
    ranks = {f"j{k}": 4096 - 500 * k for k in range(8)}  # more ranks: longer numbers
    plan = control.ControlPlane(_config()).message_for("h1")
    plan.update(version=3, job_classes={j: [1, 2, 3] for j in ranks},
                batch_shares={j: [16] * n for j, n in ranks.items()},
                ownership={j: [i % n for i in range(65536)] for j, n in ranks.items()})
    sizes = {j: len(cp.encode(owners, binary)) for j, owners in plan["ownership"].items()}

    def without(plan: dict[str, Any], names: list[str]) -> dict[str, Any]:
        return {**plan, "ownership": {j: o for j, o in plan["ownership"].items()
                                      if j not in names}}

    left_out = _fits_leaving_out_the_largest_fewest(plan, binary, sizes, without)
    assert left_out[:1] == ["j0"]
    kept = cp.decode(cp.fit(plan, binary)[0])
    assert kept["batch_shares"] == plan["batch_shares"]  # only owners go
    assert kept["job_classes"] == plan["job_classes"]
    # The control plane sends the plan so fitted, in the daemon's encoding, and says so
    # once for as long as the same jobs are left out.
    sent: list[str | bytes] = []

    class Socket:
        closed = False

        async def send_str(self, text: str) -> None:
            sent.append(text)

        async def send_bytes(self, data: bytes) -> None:
            sent.append(data)

    daemon = control._Daemon(cp.parse_register(_register("h1")), ws=Socket(),  # type: ignore[arg-type]
                             binary=binary)
    sender = control.ControlPlane(_config())
    for _ in range(2):
        asyncio.run(sender._send(daemon, plan))
    assert sent == [cp.fit(plan, binary)[0]] * 2
    said = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert said == [f"daemon h1: its plan would be over {cp.MAX_MESSAGE} bytes: it leaves out "
                    f"the chunk owners of the largest jobs ({first_of(left_out, 3)}), whose "
                    "shims there keep their own"]


def test_the_control_protocol_s_limits_take_their_last_value_and_refuse_the_next() -> None:
    top_rank = cp.MAX_WORKERS * 16

    def register(**change: Any) -> cp.Register:
        return cp.parse_register({**_register("h"), **change})

    def job(**change: Any) -> cp.JobReport:
        return cp.parse_report({"type": "report", "seq": 0, "jobs": [
            {**_job("a", [0, top_rank], [1000, 2000]), **change}]}).jobs[0]

    assert register(leaf=MAX_LEAF - 1).leaf == MAX_LEAF - 1
    assert register(interfaces=[{"name": "e", "rate_bps": 1}]).interfaces[0].rate_bps == 1
    assert register(interfaces=[{"name": "e", "rate_bps": 1 << 50}]).interfaces[0].rate_bps \
        == 1 << 50
    assert job().workers[1].rank == top_rank
    assert job(world_size=0).world_size == 0  # not said
    assert job(world_size=top_rank).world_size == top_rank
    assert job(chunk_layers=[0, 0]).chunk_layers == (0, 0)
    assert job(band_bps=[0, 1e15 - 1]).band_bps == (0.0, 1e15 - 1)
    assert cp.parse_report({"type": "report", "seq": 0, "jobs": [], "link_bps": 1}).link_bps == 1
    assert job(layers=(1 << 20)).layers == 1 << 20
    assert job(global_batch=(1 << 30)).global_batch == 1 << 30
    assert job(workers=[{"rank": 0, "throughput": 1.0, "batch": cp.MAX_BATCH}]
               ).workers[0].batch == cp.MAX_BATCH
    assert cp.parse_report({"type": "report", "seq": (1 << 62), "jobs": []}).seq == 1 << 62
    assert cp.parse_report({"type": "report", "seq": 0, "jobs": [],
                            "link_bps": 1 << 50}).link_bps == 1 << 50
    for refused, says in [
        (lambda: job(layers=(1 << 20) + 1), r"report: jobs\[0\]: layers must be an integer in"),
        (lambda: job(global_batch=(1 << 30) + 1), r"report: jobs\[0\]: global_batch must be"),
        (lambda: job(workers=[{"rank": 0, "throughput": 1.0, "batch": cp.MAX_BATCH + 1}]),
         r"report: jobs\[0\].workers\[0\]: batch must be an integer in 0.."),
        (lambda: cp.parse_report({"type": "report", "seq": (1 << 62) + 1, "jobs": []}),
         "report: seq must be an integer in 0.."),
        (lambda: register(leaf=MAX_LEAF), "register: leaf must be an integer in 0.."),
        (lambda: register(interfaces=[{"name": "e", "rate_bps": 0}]), "register: interfaces"),
        (lambda: register(interfaces=[{"name": "e", "rate_bps": (1 << 50) + 1}]),
         "register: interfaces"),
        (lambda: job(workers=[{"rank": top_rank + 1, "throughput": 1.0, "batch": 1}]),
         r"report: jobs\[0\].workers\[0\]: rank must be an integer in 0.."),
        (lambda: job(world_size=top_rank + 1), "report: jobs\\[0\\]: world_size must be"),
        (lambda: job(band_bps=[1e15]), r"report: jobs\[0\].band_bps must be rates >= 0"),
        (lambda: cp.parse_report({"type": "report", "seq": 0, "jobs": [], "link_bps": 0}),
         "report: link_bps must be an integer in 1.."),
        (lambda: cp.parse_report({"type": "report", "seq": 0, "jobs": [],
                                  "link_bps": (1 << 50) + 1}),
         "report: link_bps must be an integer in 1.."),
        (lambda: cp.decode(msgpack.packb({"type": msgpack.ExtType(1, b"x")})),
         "not a msgpack message: 2 exceeds max_ext_len"),
    ]:
        with pytest.raises(ProtocolError, match=f"^{says}"):
            refused()


def test_each_state_reuses_the_last_one_s_exchanges_and_keeps_only_its_own() -> None:
    # Trees are worked out once per placement (at 1,024 hosts, 128 jobs' trees took most
    # of a state's time when a cache of 64 was emptied every state), and a job gone takes
    # its placement's with it: the cache holds the current jobs', however many come and go.
    plane = ControlPlane(_config())
    _reported(plane, "h0", 0, [_job("a", [0], [1000] * 4), _job("b", [0], [1000] * 4)])
    _reported(plane, "h1", 0, [_job("a", [1], [1000] * 4)])
    _reported(plane, "h2", 0, [_job("b", [1], [1000] * 4)])
    plane.build_state()
    first = dict(plane._exchanges)
    assert len(first) == 2
    plane.build_state()
    assert all(plane._exchanges[k] is e for k, e in first.items())
    _reported(plane, "h2", 0, [])  # job b ended
    assert [c.job for c in plane.build_state().coflows] == ["a"]
    assert len(plane._exchanges) == 1


def _batches(plane: ControlPlane, stated: int, world: int, batches: dict[int, int]
             ) -> tuple[int, tuple[int, ...] | None]:
    """(global batch, batch shares) planned for job j whose ranks report `batches` (rank:
    batch, two ranks per host) and state `stated` and `world` (0: an older daemon or shim)."""
    plane.daemons.clear()
    ranks = sorted(batches)
    for h in range(0, len(ranks), 2):
        job = {**_job("j", [], [1000] * 4), "global_batch": stated,
               "workers": [{"rank": r, "throughput": 10.0 * (r + 1), "batch": batches[r]}
                           for r in ranks[h:h + 2]]}
        if world:
            job["world_size"] = world
        _reported(plane, f"h{h}", 0, [job])
    state = plane.build_state()
    plan = plane.policy.plan(state)
    assert check_plan(state, plan) == []
    return state.jobs[0].global_batch, plan.batch_shares.get("j")


def test_the_global_batch_is_the_one_the_ranks_agreed_and_shares_wait_for_every_rank() -> None:
    plane = ControlPlane(_config())
    # Ranks took a new plan at different steps: their batches sum to 120, not 128. The
    # agreed 128 is what is split, in proportion to throughput (10, 20, 30, 40 samples/s).
    assert _batches(plane, 128, 4, {0: 40, 1: 40, 2: 24, 3: 16}) == (128, (13, 26, 38, 51))
    # Rank 3 not reported yet: shares go to ranks by position, so none are planned.
    assert _batches(plane, 128, 4, {0: 32, 1: 32, 2: 32}) == (0, None)
    assert _batches(plane, 128, 0, {0: 32, 1: 32, 3: 32}) == (0, None)  # rank 2 missing
    # Older shims state no global batch: the sum of the batches, once each measured one.
    assert _batches(plane, 0, 4, {0: 32, 1: 32, 2: 32, 3: 0}) == (0, None)
    assert _batches(plane, 0, 0, {0: 32, 1: 32, 2: 32, 3: 32})[0] == 128


_GOOD_JOB = {"name": "j", "global_batch": 64, "layers": 2, "chunk_bytes": [1000, 2000],
             "chunk_layers": [0, 1], "band_bps": [1.0e6], "exchange": "flat", "world_size": 4,
             "workers": [{"rank": 2, "throughput": 50.0, "batch": 16},
                         {"rank": 3, "throughput": 40.0, "batch": 16}]}


# Each field of the right type, at its edges (a rank past the world, a batch of none,
# chunks without layers, a throughput of 0), or anything at all (refused).
_JOB_FIELDS = {
    "name": st.sampled_from(["j", "k", "a job's name"]),  # h0's job or others
    "global_batch": st.integers(0, 1 << 30),
    "layers": st.integers(0, 4),
    "chunk_bytes": st.lists(st.integers(1, 1 << 40), max_size=2),
    "chunk_layers": st.lists(st.integers(0, 4), max_size=2),
    "band_bps": st.lists(st.floats(0, 1e14), max_size=3),
    "exchange": st.sampled_from([*EXCHANGES, None]),
    "world_size": st.integers(0, 70_000),
    "workers": st.lists(st.fixed_dictionaries({"rank": st.integers(0, 8),
                                               "throughput": st.floats(0, 1e9, exclude_max=True),
                                               "batch": st.integers(0, 1 << 24)}),
                        max_size=3),
}
_WORKER_FIELDS = {"rank": st.integers(0, 70_000), "throughput": st.floats(0, 1e9),
                  "batch": st.integers(0, 1 << 24)}


def _fields(typed: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Some of `typed`'s fields, each of its type, and at times one of anything at all."""
    return st.tuples(
        st.fixed_dictionaries({}, optional=typed),
        st.none() | st.tuples(st.sampled_from(sorted(typed)), json_like),
    ).map(lambda drawn: {**drawn[0], **dict([drawn[1]] if drawn[1] else [])})


@settings(max_examples=examples(300), deadline=None)
@given(_fields(_JOB_FIELDS), _fields(_WORKER_FIELDS),
       st.sampled_from([{}, {"link_bps": 10_000_000_000}]))
def test_a_report_is_refused_or_planned_with_the_others(
        job: dict[str, Any], worker: dict[str, Any], extra: dict[str, Any]) -> None:
    """Whatever a daemon of another version (or a broken one) puts in a job's fields or a
    worker's: the report is refused (ProtocolError, that daemon alone), or the cluster is
    planned with it: the state, the plan, every host's message and the cluster view."""
    fuzzed = {**_GOOD_JOB, **job}
    workers = fuzzed.get("workers")
    if isinstance(workers, list) and workers and isinstance(workers[0], dict):
        fuzzed["workers"] = [{**workers[0], **worker}, *workers[1:]]
    try:
        report = cp.parse_report(json.loads(json.dumps(
            {"type": "report", "seq": 1, "jobs": [fuzzed], **extra})))
    except ProtocolError as exc:
        event(f"refused: {str(exc)[:45]}")
        return
    event("planned")
    plane = ControlPlane(_config())
    _reported(plane, "h0", 0, [{**_GOOD_JOB, "workers": [
        {"rank": 0, "throughput": 50.0, "batch": 16},
        {"rank": 1, "throughput": 50.0, "batch": 16}]}])
    plane.daemons["h1"] = control._Daemon(cp.parse_register(_register("h1", 1)), report,
                                          ws=None)
    plane.state, plane.plan = plane._state_and_plan(plane.snapshot())
    assert check_plan(plane.state, plane.plan) == []
    for host in ("h0", "h1"):
        cp.encode(plane.message_for(host), True)
        cp.encode(plane.message_for(host), False)
    json.dumps(plane.view())


def test_two_hosts_with_one_name_do_not_take_it_from_each_other() -> None:
    def connected() -> Any:  # a daemon's open WebSocket, as far as `_accept` looks
        return SimpleNamespace(closed=False, close=lambda: asyncio.sleep(0))

    async def main() -> None:
        plane = ControlPlane(_config())
        register = cp.parse_register(_register("ubuntu"))
        first = connected()
        plane._accept(register, first, False, "10.0.0.1")
        # A second machine by the same name (a cloned image) is refused, saying why ...
        with pytest.raises(ProtocolError, match=r"'ubuntu' is taken by the daemon connected "
                                                r"from 10\.0\.0\.1.*control\.host") as refused:
            plane._accept(register, connected(), False, "10.0.0.2")
        assert refused.value.code == "conflict" and plane.daemons["ubuntu"].ws is first
        # ... the first one's next session (a restart) takes over, as before ...
        again = connected()
        plane._accept(register, again, False, "10.0.0.1")
        assert plane.daemons["ubuntu"].ws is again
        # ... and once it is gone, the name is free for another machine.
        again.closed = True
        plane._accept(register, connected(), False, "10.0.0.2")
        assert plane.daemons["ubuntu"].remote == "10.0.0.2"

    asyncio.run(main())
