"""The shim's gradlaned client: it tells the daemon how its job reduces, if the daemon can hear it.

A fake daemon on a Unix socket plays both a current gradlaned (its welcome
lists ``features``) and an older one (no ``features``: it would refuse the
unknown ``exchange`` field and close the connection).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gradlane.daemon import protocol
from gradlane.daemon.config import DaemonConfig
from gradlane.daemon.service import Daemon
from gradlane.shim.client import RETRY_S, ComputeClock, DaemonClient, next_retry
from gradlane.shim.config import ShimConfig
from tests.fakes import FakeBackend, fake_config, status_shown, until


class _Mesh:
    dscp = (46,)

    def flows(self) -> list[dict[str, object]]:
        return []

    def remark(self, dscp: tuple[int, ...]) -> None:
        pass


class _OneShim:
    """A fake gradlaned on `path`: it accepts one shim's connection and serves it on a
    thread of its own (`serve`, which keeps what the shim says in `got`)."""

    def __init__(self, path: Path) -> None:
        self.got: list[dict[str, Any]] = []
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen()
        self._server.settimeout(10)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        conn, _ = self._server.accept()
        conn.settimeout(10)
        with conn:
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._thread.join(10)
        self._server.close()


class _Daemon(_OneShim):
    """Welcomes the shim, and keeps what it says until a timing message."""

    def __init__(self, path: Path, features: list[str] | None, leaf: int | None = None,
                 host: object = None, nics: object = None,
                 plan: dict[str, Any] | None = None) -> None:
        self.timed = threading.Event()
        self.reading = threading.Event()  # cleared: reads nothing after the welcome (busy)
        self.reading.set()
        self._release = threading.Event()  # hold the connection open until `close`
        self._features, self._leaf, self._host, self._nics = features, leaf, host, nics
        self._plan = plan  # sent after the welcome
        super().__init__(path)

    def serve(self, conn: socket.socket) -> None:
        decoder = protocol.FrameDecoder()
        welcomed = False
        while not self.timed.is_set():
            data = conn.recv(65536)
            if not data:
                return
            for message in decoder.feed(data):
                self.got.append(message)
                if message["type"] == "hello" and not welcomed:
                    welcome = {"type": "welcome", "version": protocol.VERSION,
                               "worker": "w1", "bands": [46], "leaf": self._leaf}
                    if self._features is not None:
                        welcome["features"] = self._features
                    if self._host is not None:
                        welcome["host"] = self._host
                    if self._nics is not None:
                        welcome["nics"] = self._nics
                    conn.sendall(protocol.encode(welcome))
                    if self._plan is not None:
                        conn.sendall(protocol.encode(self._plan))
                    welcomed = True
                    self.reading.wait(10)
                if message["type"] == "timing":
                    self.timed.set()
        self._release.wait(10)

    def close(self) -> None:
        self._release.set()
        super().close()


def _wait_for(check: Callable[[], object], told: Callable[[], str] = lambda: "",
              timeout: float = 10.0) -> None:
    """Wait until `check` holds; fail saying `told` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {told()}"
        time.sleep(0.01)


def _said(daemon: _Daemon) -> list[dict[str, object]]:
    return [{k: v for k, v in m.items() if k in ("exchange", "in_leaf", "global_batch")}
            for m in daemon.got if m["type"] == "flows"]


def _agreed(path: Path, before: bool, features: list[str],
            agree: Callable[[DaemonClient], None]) -> tuple[DaemonClient, _Daemon]:
    """A client whose ranks `agree` before its daemon is up (said right after the
    welcome) or after, and that daemon, once it has had the client's messages."""
    if before:
        client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
        agree(client)
    daemon = _Daemon(path, features=features)
    if not before:
        client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.welcomed.wait(10)
        if not before:
            agree(client)
        client.timing(0.1, 0.0)  # queued after the flows messages: the daemon's cue to stop
        assert daemon.timed.wait(10)
    finally:
        client.close()
        daemon.close()
    return client, daemon


@pytest.mark.parametrize("before", [False, True], ids=["agreed-after", "agreed-before"])
@pytest.mark.parametrize(
    ("features", "kind", "said"),
    [
        (list(protocol.FEATURES), "ring", {"exchange": "ring"}),
        (list(protocol.FEATURES), "leaf", {"exchange": "leaf"}),
        (list(protocol.FEATURES), "host", {"exchange": "host"}),
        # A daemon without "host" (older): within hosts first is said as flat.
        (["in_leaf", "exchange"], "host", {"exchange": "flat"}),
        # A daemon that knows only the older flag: the ring is said as flat.
        (["in_leaf"], "ring", {"in_leaf": False}),
        (["in_leaf"], "leaf", {"in_leaf": True}),
    ],
)
def test_the_job_s_exchange_reaches_a_daemon_that_lists_the_feature(
    tmp_path: Path, before: bool, features: list[str], kind: str, said: dict[str, object]
) -> None:
    _, daemon = _agreed(tmp_path / "gl.sock", before, features,
                        lambda client: client.exchange_agreed(kind))
    assert _said(daemon) == [said]


@pytest.mark.parametrize("before", [False, True], ids=["agreed-after", "agreed-before"])
@pytest.mark.parametrize(
    ("features", "said"),
    [
        (list(protocol.FEATURES), {"exchange": "ring", "global_batch": 128}),
        (["in_leaf", "exchange"], {"exchange": "ring"}),  # a daemon without the field
    ],
)
def test_the_job_s_global_batch_reaches_a_daemon_that_lists_the_feature(
    tmp_path: Path, before: bool, features: list[str], said: dict[str, object]
) -> None:
    def agree(client: DaemonClient) -> None:
        client.exchange_agreed("ring")
        client.batch_agreed(128)

    client, daemon = _agreed(tmp_path / "gl.sock", before, features, agree)
    # Each flows message says all that was agreed so far; the last one says it all.
    assert _said(daemon)[-1] == said and client.global_batch == 128


def test_the_job_s_global_batch_alone_is_said_once_agreed(tmp_path: Path) -> None:
    _, daemon = _agreed(tmp_path / "gl.sock", False, list(protocol.FEATURES),
                        lambda client: client.batch_agreed(64))
    assert _said(daemon)[-1] == {"global_batch": 64}


@pytest.mark.parametrize("share, size", [
    (24, 24), (24.7, 24), (1, 1), (0.5, None), (None, None), (float("nan"), None),
    # What `samples` takes at most (a share past it, or a daemon's inf, set as the
    # samples would be refused, or overflow int()).
    (1 << 30, 1 << 24), (float("inf"), None)])
def test_the_advised_batch_size_is_a_whole_share_of_at_least_one_sample(
        tmp_path: Path, share: float | None, size: int | None) -> None:
    client = DaemonClient(ShimConfig(daemon_socket=str(tmp_path / "none.sock"), dscp=(46,)),
                          0, 2, _Mesh())
    try:
        client.advised_batch_share = share
        assert client.advised_batch_size == size
    finally:
        client.close()


@pytest.mark.parametrize("ownership, taken", [
    ([0, 1, 1, 0], (0, 1, 1, 0)),
    ([], None),  # none yet
    ([0, 2], None),  # a rank past the job's two
    ([0, -1], None),
    ([True, 0], None),  # not a rank number
    ("01", None),
])
def test_a_plan_s_chunk_owners_are_taken_when_they_are_ranks_of_the_job(
        tmp_path: Path, ownership: object, taken: tuple[int, ...] | None) -> None:
    path = tmp_path / "gl.sock"
    plan = {"type": "plan", "version": 1, "bands": [46], "batch_share": 24,
            "ownership": ownership}
    daemon = _Daemon(path, features=list(protocol.FEATURES), plan=plan)
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.welcomed.wait(10)
        _wait_for(lambda: client.plan is not None)
        assert client.plan is not None and client.advised_batch_share == 24
        assert client.advised_owners == taken
    finally:
        client.close()
        daemon.close()


def test_reports_go_out_as_fast_as_the_daemon_reads_them(tmp_path: Path) -> None:
    # The session used to wait 0.2 s for the daemon's messages after every report sent
    # (a socket timeout applies before a MSG_DONTWAIT recv too): five reports a second,
    # fewer than a training job makes (two a step), so they queued and were dropped.
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=list(protocol.FEATURES))
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    group, chunk = SimpleNamespace(priority=0, band=0), SimpleNamespace(nbytes=1 << 16)
    try:
        assert client.welcomed.wait(10)
        for step in range(1, 101):
            client.chunk_event(group, chunk, "ready")  # type: ignore[arg-type]
            client.begin(step, 32)
        client.timing(0.1, 0.0)  # the daemon's cue to stop
        # A liveness bound, not a speed target: the old pace needed 20 s for these.
        assert daemon.timed.wait(10)
    finally:
        client.close()
        daemon.close()
    assert [m["iteration"] for m in daemon.got if m["type"] == "chunks"] == list(range(100))


def test_what_the_ranks_agreed_reaches_a_daemon_too_busy_for_reports(tmp_path: Path) -> None:
    # The daemon stops reading after its welcome: the shim's reports fill its socket,
    # then its queue, and the next ones are dropped. What the ranks agreed is not.
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=list(protocol.FEATURES))
    daemon.reading.clear()
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.welcomed.wait(10)
        group, chunk = SimpleNamespace(priority=0, band=0), SimpleNamespace(nbytes=1 << 16)
        step = 0
        while not client._outbox.full() and step < 100_000:
            for _ in range(100):
                client.chunk_event(group, chunk, "ready")  # type: ignore[arg-type]
            step += 1
            client.begin(step, 32)
        assert client._outbox.full() and client._outbox.qsize() == 256  # the cap, in messages
        client.exchange_agreed("ring")
        daemon.reading.set()
        _wait_for(client._outbox.empty)
        client.timing(0.1, 0.0)  # the daemon's cue to stop
        assert daemon.timed.wait(10)
    finally:
        client.close()
        daemon.close()
    assert _said(daemon) == [{"exchange": "ring"}]


def test_an_older_daemon_is_not_sent_a_field_it_would_refuse(tmp_path: Path) -> None:
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=None)
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.welcomed.wait(10)
        client.exchange_agreed("leaf")
        client.timing(0.1, 0.0)
        assert daemon.timed.wait(10)
        assert client.connected  # still the first session: nothing was refused
    finally:
        client.close()
        daemon.close()
    assert _said(daemon) == []


@pytest.mark.parametrize(
    ("configured", "daemon_up", "advised", "expected"),
    [
        (None, True, 1, 1),  # the control plane's advice, through the welcome
        (None, True, None, None),  # no advice: the flat exchange
        (0, True, 1, 0),  # the configured leaf wins
        (None, False, None, None),  # no daemon socket: nothing to wait for
        (None, True, 0, 0),  # the first leaf
        (None, True, -1, None),  # not a leaf: none taken
        (None, True, True, None),
    ],
)
def test_a_worker_s_leaf_is_configured_or_advised(
    tmp_path: Path, configured: int | None, daemon_up: bool, advised: int | None,
    expected: int | None,
) -> None:
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=list(protocol.FEATURES), leaf=advised) if daemon_up else None
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,), leaf=configured),
                          0, 2, _Mesh())
    try:
        assert client.leaf() == expected
        if daemon is not None:
            assert client.welcomed.wait(10)
            client.timing(0.1, 0.0)  # the fake daemon's cue to stop
            assert daemon.timed.wait(10)
    finally:
        client.close()
        if daemon is not None:
            daemon.close()


@pytest.mark.parametrize(
    ("said", "expected"),
    [
        ("8d2c/4026531840", "8d2c/4026531840"),  # gradlaned's name for its host
        (None, None),  # an older daemon names none: the shim goes by its address
        (42, None),  # not text
        ("", None),
        ("x" * 257, None),  # longer than any name gradlaned gives
        ("h", "h"),
        ("x" * 256, "x" * 256),
    ],
)
def test_a_worker_s_host_is_the_one_its_daemon_names(
    tmp_path: Path, said: object, expected: str | None
) -> None:
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=list(protocol.FEATURES), host=said)
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.host() == expected
        assert client.welcomed.is_set()  # it waited for the welcome
        client.timing(0.1, 0.0)  # the fake daemon's cue to stop
        assert daemon.timed.wait(10)
    finally:
        client.close()
        daemon.close()


@pytest.mark.parametrize(
    ("said", "addresses", "expected"),
    [
        ([["10.0.0.5", 100], ["10.1.0.5", 50]], ["10.0.0.5", "10.1.0.5"], [100, 50]),
        ([["10.0.0.5", 100]], ["10.0.0.5", "10.1.0.5"], None),  # one not named: equal
        (None, ["10.0.0.5"], None),  # an older daemon
        ([["10.0.0.5", 0], ["10.1.0.5", 50], "x", [1, 2]], ["10.0.0.5", "10.1.0.5"],
         None),  # what is not an address and a positive rate is left out
    ],
)
def test_the_planes_rates_are_the_ones_gradlaned_shapes_their_nics_to(
    tmp_path: Path, said: object, addresses: list[str], expected: list[int] | None,
) -> None:
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=list(protocol.FEATURES), nics=said)
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.plane_rates(addresses) == expected
        client.timing(0.1, 0.0)  # the fake daemon's cue to stop
        assert daemon.timed.wait(10)
    finally:
        client.close()
        daemon.close()


class _Scripted(_OneShim):
    """Welcomes the shim, then answers its n-th timing report with ``answers[n]``:
    messages to send, or None to close the connection."""

    def __init__(self, path: Path, answers: list[list[dict[str, Any]] | None]) -> None:
        self._answers = answers
        super().__init__(path)

    def serve(self, conn: socket.socket) -> None:
        decoder = protocol.FrameDecoder()
        answers = iter(self._answers)
        while data := conn.recv(65536):
            for message in decoder.feed(data):
                self.got.append(message)
                if message["type"] == "hello":
                    said = [{"type": "welcome", "version": protocol.VERSION,
                             "worker": "w1", "bands": [46]}]
                elif message["type"] == "timing":
                    said = next(answers)
                else:
                    continue
                if said is None:
                    return
                for out in said:
                    conn.sendall(protocol.encode(out))

    def said(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.got if m["type"] == kind]


class _Silent(_OneShim):
    """Accepts the shim and says nothing (wedged, or busy) until closed."""

    def __init__(self, path: Path) -> None:
        self._release = threading.Event()
        super().__init__(path)

    def serve(self, conn: socket.socket) -> None:
        self._release.wait(10)

    def close(self) -> None:
        self._release.set()  # the session ends as the connection closes
        super().close()


def test_a_plan_sent_between_reports_is_taken_and_a_daemon_that_closes_is_noticed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # After the welcome the session reads what the daemon says between reports: a plan
    # it takes in the same session, and the end of the connection, after which training
    # goes on without the daemon, saying so again (it said so before the daemon came).
    monkeypatch.setattr("gradlane.shim.client.RETRY_S", 0.05)
    path = tmp_path / "gl.sock"
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    plan = {"type": "plan", "version": 2, "bands": [46], "batch_share": 24}
    daemon = None
    try:
        _wait_for(lambda: "no gradlaned socket" in caplog.text, lambda: caplog.text)
        daemon = _Scripted(path, [[plan], None])
        assert client.welcomed.wait(10)
        client.timing(0.1, 0.0)  # answered with the plan
        _wait_for(lambda: client.plan is not None)
        assert client.plan == plan and client.advised_batch_share == 24 and client.connected
        client.timing(0.2, 0.0)  # answered by closing
        daemon.close()
        _wait_for(lambda: not client.connected)
        _wait_for(lambda: "gradlaned closed the connection; training goes on" in caplog.text,
                  lambda: caplog.text)
    finally:
        client.close()
        if daemon is not None:
            daemon.close()
    assert [m["type"] for m in daemon.got] == ["hello", "timing", "timing"]  # one session
    assert daemon.got[1]["samples"] == 0  # no step began: no samples counted


@pytest.mark.parametrize("bands", [[46], None, [], ["46"], 46])
def test_a_plan_whose_bands_are_the_same_or_no_table_leaves_the_marks_and_the_flows_alone(
        tmp_path: Path, bands: object) -> None:
    # Only a new table is adopted (a reload) and makes the shim say its flows again.
    path = tmp_path / "gl.sock"
    mesh = _FourBands()
    daemon = _Scripted(path, [[{"type": "plan", "version": 2, "bands": bands}], []])
    client = DaemonClient(ShimConfig(daemon_socket=str(path)), 0, 2, mesh)
    try:
        assert client.welcomed.wait(10)
        client.timing(0.1, 0.0)  # answered with the plan
        _wait_for(lambda: client.plan is not None)
        client.timing(0.2, 0.0)  # after the plan: a flows message said by now is in first
        _wait_for(lambda: len(daemon.said("timing")) == 2)
    finally:
        client.close()
        daemon.close()
    assert mesh.marks == [(46, 46, 46, 46)] and client.daemon_bands == (46,)  # the welcome's
    # Its four bands said once, as the welcome's one band: not again after the plan.
    assert [m["type"] for m in daemon.got] == ["hello", "flows", "timing", "timing", "bye"]


def test_a_step_s_events_go_out_all_in_messages_of_at_most_max_events(tmp_path: Path) -> None:
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=list(protocol.FEATURES))
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    try:
        assert client.welcomed.wait(10)
        for n in range(protocol.MAX_EVENTS + 1):
            client.chunk_event(SimpleNamespace(priority=n, band=0),  # type: ignore[arg-type]
                               SimpleNamespace(nbytes=1024), "ready")  # type: ignore[arg-type]
        client.begin(1, 32)
        client.timing(0.1, 0.0)  # the daemon's cue to stop
        assert daemon.timed.wait(10)
    finally:
        client.close()
        daemon.close()
    sent = [m["events"] for m in daemon.got if m["type"] == "chunks"]
    assert [len(events) for events in sent] == [protocol.MAX_EVENTS, 1]
    assert [e[0] for events in sent for e in events] == list(range(protocol.MAX_EVENTS + 1))


def test_a_daemon_that_does_not_welcome_is_waited_for_once_and_not_taken_as_connected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A gradlaned that accepts and says nothing (wedged, or busy): the first of `leaf`,
    # `host` and `plane_rates` waits WELCOME_WAIT_S for its welcome, the others do not
    # wait again (each would hold up the attach), and the shim does not count it as a
    # daemon that listens.
    monkeypatch.setattr("gradlane.shim.client.WELCOME_WAIT_S", 0.1)
    path = tmp_path / "gl.sock"
    daemon = _Silent(path)
    client = DaemonClient(ShimConfig(daemon_socket=str(path), dscp=(46,)), 0, 2, _Mesh())
    waits: list[float | None] = []
    wait = client.welcomed.wait
    monkeypatch.setattr(client.welcomed, "wait",
                        lambda timeout=None: waits.append(timeout) or wait(timeout))
    try:
        assert client.leaf() is None and client.host() is None
        assert client.plane_rates(["10.0.0.5"]) is None
        assert waits == [0.1]
        assert not client.connected
    finally:
        daemon.close()
        client.close()


def test_no_daemon_no_host(tmp_path: Path) -> None:
    client = DaemonClient(ShimConfig(daemon_socket=str(tmp_path / "none.sock"), dscp=(46,)),
                          0, 2, _Mesh())
    try:
        assert client.host() is None and client.leaf() is None
    finally:
        client.close()


def test_a_socket_this_user_may_not_use_is_said_with_the_way_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As root the socket's mode cannot refuse: the refusal a user not in its group gets.
    def refused(self: DaemonClient, path: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(DaemonClient, "_session", refused)
    there = tmp_path / "gl.sock"
    there.touch()
    client = DaemonClient(ShimConfig(daemon_socket=str(there), dscp=(46,)), 0, 2, _Mesh())
    try:
        _wait_for(lambda: "Permission denied" in caplog.text, lambda: caplog.text)
    finally:
        client.close()
    assert "daemon.socket_group names: add this user to it" in caplog.text
    assert "training goes on with the local priority order" in caplog.text


def test_a_session_that_fails_in_a_way_not_foreseen_is_retried_not_the_end_of_the_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tries: list[float] = []

    def broken(self: DaemonClient, path: str) -> None:
        tries.append(time.monotonic())
        raise KeyError("a field of a daemon of another version")

    monkeypatch.setattr(DaemonClient, "_session", broken)
    monkeypatch.setattr("gradlane.shim.client.RETRY_S", 0.05)
    there = tmp_path / "gl.sock"
    there.touch()
    client = DaemonClient(ShimConfig(daemon_socket=str(there), dscp=(46,)), 0, 2, _Mesh())
    try:
        _wait_for(lambda: len(tries) >= 3, lambda: caplog.text)
    finally:
        client.close()
    assert ("KeyError: 'a field of a daemon of another version'; training goes on with the "
            "local priority order") in caplog.text
    assert caplog.text.count("training goes on") == 1  # said once, not at every retry


class _Gradlaned:
    """A gradlaned of in-memory qdiscs serving `config` while in ``async with``; its
    `client`s (rank 0 of 2) are closed, then it stops, on the way out."""

    def __init__(self, config: DaemonConfig) -> None:
        self.daemon = Daemon(config, backend_factory=FakeBackend)
        self._clients: list[DaemonClient] = []

    def client(self, shim: ShimConfig, mesh: Any) -> DaemonClient:
        client = DaemonClient(shim, 0, 2, mesh)
        self._clients.append(client)
        return client

    async def __aenter__(self) -> _Gradlaned:
        self._serving = asyncio.create_task(self.daemon.serve())
        try:
            await asyncio.wait_for(self.daemon.ready.wait(), 10)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self._clients:
            await asyncio.to_thread(client.close)
        self.daemon.stop()
        await asyncio.wait_for(self._serving, 10)


class _FourBands:
    """A worker's four band connections to one peer; the marks it was given."""

    dscp = (46, 34, 26, 18)

    def __init__(self) -> None:
        self.marks: list[tuple[int, ...]] = []

    def flows(self) -> list[dict[str, object]]:
        return [{"band": b, "src": "10.0.0.1", "sport": 40000 + b, "dst": "10.0.0.2",
                 "dport": 5201} for b in range(4)]

    def remark(self, dscp: tuple[int, ...]) -> None:
        self.marks.append(dscp)


class _TwoNics(_FourBands):
    """The four connections, two of them from a second NIC's address."""

    def flows(self) -> list[dict[str, object]]:
        return [{**f, "src": "10.1.0.1"} if f["band"] in (0, 1) else f
                for f in super().flows()]


def test_a_shim_with_more_bands_than_gradlaned_registers_and_follows_a_reload(
    tmp_path: Path,
) -> None:
    # A gradlaned with two bands: the shim's hello (before the welcome says so) names
    # four. Then the daemon is reloaded with four: the shim re-marks and re-registers.
    config = dataclasses.replace(fake_config(tmp_path / "gl.sock"), bands=(46, 10))
    mesh = _FourBands()

    def registered(daemon: Daemon) -> list[int]:
        return [f.band for w in daemon.registry.workers() for f in w.flows]

    async def main() -> None:
        async with _Gradlaned(config) as gl:
            daemon = gl.daemon
            client = gl.client(ShimConfig(daemon_socket=str(config.socket_path)), mesh)
            # Registered at the hello; marked once the shim has read the welcome.
            await until(lambda: registered(daemon) == [0, 1, 1, 1] and client.connected)
            assert mesh.marks == [(46, 10, 10, 10)]
            await daemon.reload(dataclasses.replace(config, bands=(46, 34, 26, 18)))
            await until(lambda: registered(daemon) == [0, 1, 2, 3])
            assert mesh.marks[-1] == (46, 34, 26, 18)
            assert daemon._reconcile_errors == 0

    asyncio.run(main())


def test_a_shim_the_daemon_refuses_says_the_daemon_s_reason_and_trains_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Two processes claiming one job's rank 0 (a job name given twice by hand): gradlaned
    # answers the second hello with an error; the user must read why, not only that no
    # welcome came.
    config = fake_config(tmp_path / "gl.sock")

    async def main() -> None:
        async with _Gradlaned(config) as gl:
            shim = ShimConfig(daemon_socket=str(config.socket_path), job="twice")
            first = gl.client(shim, _Mesh())
            await until(lambda: first.connected)
            second = gl.client(shim, _Mesh())
            await until(lambda: "training goes on" in caplog.text)
            assert not second.connected and first.connected

    asyncio.run(main())
    assert (f"gradlane: gradlaned at {config.socket_path}: job 'twice' rank 0 is registered "
            f"already by pid {os.getpid()}; training goes on") in caplog.text


def test_a_daemon_that_refuses_the_worker_is_asked_ever_less_often(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A rank another process holds (a job started twice): every hello is refused, and
    # logged by the daemon. Asked at the pace of an absent daemon's, it would be refused
    # and log from each such worker for as long as the job runs. Once the daemon takes
    # the worker (the other process is gone), it registers.
    monkeypatch.setattr("gradlane.shim.client.RETRY_S", 0.05)
    monkeypatch.setattr("gradlane.shim.client.MAX_RETRY_S", 0.4)
    caplog.set_level(logging.INFO)
    config = fake_config(tmp_path / "gl.sock")
    shim = ShimConfig(daemon_socket=str(config.socket_path), job="twice")

    def refusals() -> list[float]:
        return [r.created for r in caplog.records
                if r.name == "gradlane.daemon.service" and "conflict error" in r.getMessage()]

    async def main() -> None:
        async with _Gradlaned(config) as gl:
            first = gl.client(shim, _Mesh())
            await until(lambda: first.connected)
            second = gl.client(shim, _FourBands())
            await until(lambda: len(refusals()) >= 6)
            assert not second.connected
            await asyncio.to_thread(first.close)
            await until(lambda: second.connected)

    asyncio.run(main())
    times = refusals()[:6]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    for i, gap in enumerate(gaps):  # at least the wait (a clock's grain below it)
        assert gap >= 0.9 * min(0.05 * 2 ** (i + 1), 0.4), gaps
    assert (f"gradlane: gradlaned at {config.socket_path}: job 'twice' rank 0 is registered "
            f"already by pid {os.getpid()}; training goes on with the local priority order "
            "(asking again ever less often, up to every 0.4 s)") in caplog.text
    assert caplog.text.count("training goes on") == 1


def test_a_worker_of_more_connections_than_gradlaned_registers_is_registered_with_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A job of more hosts than gradlaned registers flows for (past 1,018 hosts of 8 ranks
    # reducing within hosts first): refused, the worker would be unknown to its daemon and
    # the control plane, its job unplanned. Registered with none of its connections, it
    # is known, its connections scheduled by their DSCP marks; so is a later flows
    # message. It says why once. One connection fewer, and they are registered.
    config = fake_config(tmp_path / "gl.sock")
    monkeypatch.setattr(protocol, "MAX_FLOWS", 3)  # the mesh has four
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with _Gradlaned(config) as gl:
            client = gl.client(ShimConfig(daemon_socket=str(config.socket_path), job="big"),
                               _FourBands())
            await until(lambda: client.connected)
            workers = gl.daemon.registry.workers()
            assert [(w.job, w.rank, w.flows) for w in workers] == [("big", 0, ())]
            # ... and how many it left out, for the daemon's status and log.
            await until(lambda: gl.daemon.registry.workers()[0].flows_left_out == 4)
            assert gl.daemon.registry.workers()[0].left_out_from == {"10.0.0.1"}
            assert "0 (4 left out)" in status_shown(gl.daemon, monkeypatch)
            client.flows_changed()  # said again, still none
            await until(lambda: not client._restate.is_set())
            monkeypatch.setattr(protocol, "MAX_FLOWS", 4)
            client.flows_changed()
            await until(lambda: [len(w.flows) for w in gl.daemon.registry.workers()] == [4])
            assert gl.daemon.registry.workers()[0].flows_left_out == 0
            assert gl.daemon.registry.workers()[0].left_out_from == frozenset()
            assert "left out" not in status_shown(gl.daemon, monkeypatch)

    asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if r.name == "gradlane.shim.client"
            and "band connections" in r.getMessage()]
    assert said == ["gradlane: rank 0 has 4 band connections, more than gradlaned registers "
                    "(3): it registers none, and they are scheduled by their DSCP marks alone "
                    "(band order and its job's priority kept, not the job's rate)"]
    assert "training goes on" not in caplog.text
    logged = [r.getMessage() for r in caplog.records if r.name == "gradlane.daemon.service"
              and "band connections" in r.getMessage()]
    assert len(logged) == 1 and logged[0].endswith(
        "(job 'big' rank 0): 4 band connections, more than a worker registers (3): none "
        "registered, its packets go by their DSCP marks alone"), logged


@pytest.mark.parametrize("features", [[], ["flows_left_out"],
                                      ["flows_left_out", "left_out_from"]])
def test_how_many_connections_were_left_out_goes_only_to_a_daemon_that_takes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, features: list[str]) -> None:
    monkeypatch.setattr(protocol, "MAX_FLOWS", 3)  # the mesh has four
    path = tmp_path / "gl.sock"
    daemon = _Daemon(path, features=features)
    client = DaemonClient(ShimConfig(daemon_socket=str(path)), 0, 2, _TwoNics())
    try:
        assert client.welcomed.wait(10)
        client.timing(0.1, 0.0)
        assert daemon.timed.wait(10)
        assert client.connected  # an older daemon refused nothing
    finally:
        client.close()
        daemon.close()
    (hello,) = [m for m in daemon.got if m["type"] == "hello"]
    assert hello["flows"] == [] and "flows_left_out" not in hello  # before the welcome
    assert "left_out_from" not in hello
    said = [(m.get("flows_left_out"), m.get("left_out_from"))
            for m in daemon.got if m["type"] == "flows"]
    # From where: the addresses they leave by (the NICs of a multi-NIC host), each once.
    assert said == [(4 if features else None,
                     ["10.0.0.1", "10.1.0.1"] if "left_out_from" in features else None)]


def test_a_session_that_was_not_refused_is_followed_by_the_shortest_wait() -> None:
    assert next_retry(RETRY_S, refused=True) == 2 * RETRY_S
    assert next_retry(8 * RETRY_S, refused=False) == RETRY_S  # the daemon went away
    waits = [RETRY_S]
    for _ in range(12):
        waits.append(next_retry(waits[-1], refused=True))
    assert waits[-1] == max(waits) == 32.0


def test_a_step_s_compute_starts_at_its_first_forward_in_training_mode() -> None:
    """What `timing` reports as a step's compute: an evaluation with gradients left on in
    eval mode before the step's training forward is not in it; a step in eval mode all
    through is timed from its first forward; the clock restarts at each stop."""
    clock = ComputeClock()
    assert clock.stop(1.0) is None  # no forward with gradients: nothing to report
    clock.forward(False, 10.0)  # the evaluation
    clock.forward(True, 12.0)
    clock.forward(True, 13.0)  # a second micro-batch
    clock.forward(False, 14.0)
    assert clock.stop(15.0) == 3.0
    clock.forward(False, 20.0)
    clock.forward(False, 21.0)
    assert clock.stop(22.0) == 2.0
    assert clock.stop(23.0) is None
