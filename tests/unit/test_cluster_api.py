"""The emulated cluster's bookkeeping, none of which needs a namespace (no root):
hosts and NICs by name, commands run in a host, the daemons' command lines and the
wait for them, stopping what runs, and which clusters exist."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from pyroute2.netlink.exceptions import NetlinkError

import gradlane.testbed.cluster as cluster_module
from gradlane.errors import ConfigError, TestbedError
from gradlane.testbed import Cluster, Topology
from gradlane.testbed.links import line_rate

M = 1_000_000


class Unbuilt(Cluster):
    """A cluster whose commands run here, not in a namespace, and that removes nothing."""

    def popen(self, host: str | int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        self.host_index(host)
        proc = subprocess.Popen(argv, **kwargs)
        self._procs.append(proc)
        return proc


@pytest.fixture
def removed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    monkeypatch.setattr(cluster_module, "remove_cluster", lambda name: names.append(name) or [])
    return names


def test_a_host_is_h1_to_hn_or_its_number_and_anything_else_is_refused(
    removed: list[str],
) -> None:
    c = Cluster(Topology.build("tapi", 3, "1gbit", nics=2))
    assert [c.host_index(h) for h in ("h1", "h3", 1, 3)] == [1, 3, 1, 3]
    assert c.ns("h2") == "gl-tapi-h2" and c.addr(3, 1) == "10.200.1.3" and c.addr("h1") == (
        "10.200.0.1"
    )
    for bad in ("h0", "h4", 0, 4, -1, "3", "hx", "h", "x1", "h1.5", True, 2.0):
        with pytest.raises(TestbedError, match=r"cluster 'tapi' \(hosts are h1..h3\)"):
            c.host_index(bad)  # type: ignore[arg-type]
    for nic in (-1, 2):
        with pytest.raises(TestbedError, match=f"NICs 0..1, not {nic}"):
            c.addr("h1", nic)
        with pytest.raises(TestbedError, match=f"NICs 0..1, not {nic}"):
            c.set_port("h1", False, nic)  # refused before the switch is looked at


def test_run_gives_the_output_and_names_a_failure_or_a_hang(removed: list[str]) -> None:
    c = Unbuilt(Topology.build("tapi", 2, "1gbit"))
    done = c.run("h1", [sys.executable, "-c", "print('out'); import sys; sys.exit(0)"])
    assert (done.returncode, done.stdout) == (0, "out\n")
    fail = [sys.executable, "-c", "import sys; print('last words', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(TestbedError, match="in h2 exited with 3: last words"):
        c.run("h2", fail)
    assert c.run("h2", fail, check=False).returncode == 3
    with pytest.raises(TestbedError, match=r"in h1 did not finish in 0.3s"):
        c.run("h1", [sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.3)
    assert not c._procs  # each finished (or killed) and forgotten


def test_down_stops_what_still_runs_and_kills_what_ignores_it(removed: list[str]) -> None:
    c = Unbuilt(Topology.build("tapi", 2, "1gbit"))
    ignores = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', "
        "flush=True)\nfor _ in range(300): time.sleep(0.1)"
    )
    stubborn = c.popen("h1", [sys.executable, "-c", ignores], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    sleeper = c.popen("h2", [sys.executable, "-c", "import time; time.sleep(30)"])
    finished = c.popen("h2", [sys.executable, "-c", "import sys; sys.exit(5)"])
    finished.wait(timeout=30)
    c.down()
    assert sleeper.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert finished.returncode == 5 and removed == ["tapi"] and not c._procs
    stubborn.stdout.close()


def test_down_in_another_process_leaves_the_cluster_alone(removed: list[str]) -> None:
    c = Cluster(Topology.build("tapi", 2, "1gbit"))
    c._owner = os.getpid() + 1  # as in a child forked from the one that built it
    c.down()
    assert removed == []
    c._owner = os.getpid()
    c.down()
    assert removed == ["tapi"]


@pytest.mark.parametrize(
    ("raised", "reported"),
    [
        (NetlinkError(17, "File exists"), TestbedError),
        (OSError(1, "Operation not permitted"), TestbedError),
        (ConfigError("bad value"), TestbedError),
        (TestbedError("link p0h1 vanished"), TestbedError),
        (KeyboardInterrupt(), KeyboardInterrupt),
        (RuntimeError("a bug"), RuntimeError),
    ],
)
def test_a_failed_build_is_removed_and_reported_as_the_testbed_s(
    monkeypatch: pytest.MonkeyPatch, removed: list[str], raised: BaseException,
    reported: type[BaseException],
) -> None:
    def build(self: Cluster) -> None:
        raise raised

    monkeypatch.setattr(cluster_module.gl_netns, "exists", lambda name: False)
    monkeypatch.setattr(Cluster, "_build", build)
    with pytest.raises(reported) as info:
        Cluster(Topology.build("tapi", 2, "1gbit")).up()
    assert removed == ["tapi"]
    if reported is TestbedError and not isinstance(raised, TestbedError):
        assert str(info.value).startswith("building cluster 'tapi' failed: ")
        assert info.value.__cause__ is raised
    else:
        assert info.value is raised


def test_a_cluster_that_exists_is_not_built_again(
    monkeypatch: pytest.MonkeyPatch, removed: list[str]
) -> None:
    monkeypatch.setattr(cluster_module.gl_netns, "exists", lambda name: name.endswith("-h2"))
    monkeypatch.setattr(Cluster, "_build", lambda self: pytest.fail("built over it"))
    # A run of the same name may be using it: removing it is advised only if none is.
    with pytest.raises(TestbedError, match=r"exists already \(gl-tapi-h2\): another run's, or "
                       "left by one that was killed; if none is running, remove it with: "
                       "gradlane testbed down tapi$"):
        Cluster(Topology.build("tapi", 2, "1gbit")).up()
    assert removed == []


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Any]:
    """Serve a daemon's socket at a path, now or after a delay, as gradlaned would."""
    sockets: list[socket.socket] = []
    timers: list[threading.Timer] = []

    def listen(path: Path, after: float = 0.0) -> None:
        def bind() -> None:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(path))
            sock.listen()
            sockets.append(sock)

        if after:
            timers.append(threading.Timer(after, bind))
            timers[-1].start()
        else:
            bind()

    yield listen
    for timer in timers:
        timer.join()
    for sock in sockets:
        sock.close()


class Recording(Cluster):
    """Records each command instead of running it; the 'process' runs until told."""

    def __init__(self, topology: Topology, exit_code: int | None = None) -> None:
        super().__init__(topology)
        self.started: list[tuple[list[str], dict[str, Any]]] = []
        self.exit_code = exit_code

    def popen(self, host: str | int, argv: Sequence[str], **kwargs: Any) -> Any:
        self.started.append((list(argv), kwargs))
        return FakeDaemon(self.exit_code)


class FakeDaemon:
    def __init__(self, exit_code: int | None) -> None:
        self.exit_code = exit_code

    def poll(self) -> int | None:
        return self.exit_code

    def communicate(self) -> tuple[str, str]:
        return "", "cannot open eth0: no such device"


def nic_args(argv: list[str]) -> list[str]:
    return [argv[k + 1] for k, arg in enumerate(argv) if arg == "-i"]


def test_each_daemon_shapes_under_the_nic_its_link_stands_for_unless_told(
    tmp_path: Path, listening: Any
) -> None:
    c = Recording(Topology.build("tapi", 3, "100mbit,200mbit,300mbit", nics=2))
    for name in ("h2", "h3"):
        listening(tmp_path / f"{name}.sock")
    started = c.start_daemons(["h2", 3], tmp_path, args=lambda name: ["--tag", name])
    assert set(started) == {"h2", 3} and started["h2"][1] == tmp_path / "h2.sock"
    (h2, kwargs), (h3, _) = c.started
    assert nic_args(h2) == [f"eth0={line_rate(200 * M)}", f"eth1={line_rate(200 * M)}"]
    assert nic_args(h3) == [f"eth0={line_rate(300 * M)}", f"eth1={line_rate(300 * M)}"]
    assert h2[h2.index("--socket") + 1] == str(tmp_path / "h2.sock")
    assert h2[h2.index("--state-dir") + 1] == str(tmp_path / "state-h2")
    assert h2[-2:] == ["--tag", "h2"] and h3[-2:] == ["--tag", "h3"]
    assert kwargs == {"stderr": subprocess.PIPE, "text": True}

    c.started.clear()
    c.start_daemon("h2", tmp_path, rate="1gbit", args=["--log-level", "debug"], stderr=None)
    ((argv, kwargs),) = c.started
    assert nic_args(argv) == ["eth0=1gbit", "eth1=1gbit"] and argv[-2:] == [
        "--log-level", "debug"
    ]
    assert kwargs == {"stderr": None, "text": True}  # the caller's choice kept
    c.started.clear()
    c.start_daemon("h3", tmp_path, rate=["1gbit", "500mbit"])
    assert nic_args(c.started[0][0]) == ["eth0=1gbit", "eth1=500mbit"]
    with pytest.raises(TestbedError, match="1 rates for 2 NICs"):
        c.start_daemon("h3", tmp_path, rate=["1gbit"])


def test_the_daemons_are_waited_for_until_they_serve(tmp_path: Path, listening: Any) -> None:
    c = Recording(Topology.build("tapi", 2, "1gbit"))
    listening(tmp_path / "h1.sock")
    listening(tmp_path / "h2.sock", after=0.3)
    assert set(c.start_daemons(["h1", "h2"], tmp_path, timeout=30)) == {"h1", "h2"}


def test_a_daemon_that_exits_or_never_serves_is_named(tmp_path: Path) -> None:
    with pytest.raises(TestbedError, match="gradlaned on h2 exited: cannot open eth0"):
        Recording(Topology.build("tapi", 2, "1gbit"), exit_code=1).start_daemon(2, tmp_path)
    with pytest.raises(TestbedError, match=r"gradlaned on h1 did not serve in 0.2s"):
        Recording(Topology.build("tapi", 2, "1gbit")).start_daemon("h1", tmp_path, timeout=0.2)


def test_the_clusters_are_read_from_the_namespaces_and_removed_hosts_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    existing = ["gl-a-h1", "gl-a-sw", "gl-big-2-h10", "gl-big-2-sw", "gl-stray"]
    gone: list[str] = []

    def list_namespaces(prefix: str = "gl-") -> list[str]:
        return sorted(n for n in existing if n.startswith(prefix))

    monkeypatch.setattr(cluster_module.gl_netns, "list_namespaces", list_namespaces)
    monkeypatch.setattr(cluster_module.gl_netns, "remove", gone.append)
    assert cluster_module.cluster_names() == ["a", "big-2"]
    existing += ["gl-a-h2"]
    assert cluster_module.remove_cluster("a") == ["gl-a-h1", "gl-a-h2", "gl-a-sw"]
    assert gone == ["gl-a-h1", "gl-a-h2", "gl-a-sw"]


@pytest.fixture
def nsexec(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[str, Any]]]:
    """`gradlane.testbed.nsexec.main` with what it would do to this process recorded."""
    from gradlane.testbed import nsexec as module

    done: list[tuple[str, Any]] = []
    monkeypatch.setattr(module, "enter", lambda ns: done.append(("enter", ns)))
    monkeypatch.setattr(module, "end_with_parent", lambda pid: done.append(("parent", pid)))

    def execvp(file: str, args: list[str]) -> None:
        done.append(("exec", (file, args)))
        if file == "missing":
            raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(module.os, "execvp", execvp)
    return module.main, done


def test_a_process_enters_its_host_then_becomes_the_command(nsexec: Any) -> None:
    main, done = nsexec
    main(["gl-c-h1", "--parent", "4321", "--", "python3", "-c", "pass"])
    assert done == [("parent", 4321), ("enter", "gl-c-h1"),
                    ("exec", ("python3", ["python3", "-c", "pass"]))]
    done.clear()
    main(["gl-c-h2", "--", "true"])  # no parent to end with
    assert done == [("enter", "gl-c-h2"), ("exec", ("true", ["true"]))]
    done.clear()
    with pytest.raises(SystemExit, match="cannot run 'missing' in gl-c-h1: No such file"):
        main(["gl-c-h1", "--", "missing", "arg"])


@pytest.mark.parametrize(
    "args",
    [[], ["gl-c-h1"], ["gl-c-h1", "--"], ["gl-c-h1", "true"], ["gl-c-h1", "-x", "true"],
     ["gl-c-h1", "--parent", "12"], ["gl-c-h1", "--parent", "12", "--"],
     ["gl-c-h1", "--parent", "me", "--", "true"], ["gl-c-h1", "--parent", "12", "true"]],
)
def test_a_malformed_command_line_gets_the_usage_and_does_nothing(
    nsexec: Any, args: list[str]
) -> None:
    main, done = nsexec
    with pytest.raises(SystemExit, match="^usage: python -m gradlane.testbed.nsexec NAMESPACE"):
        main(args)
    assert done == []  # not even bound to end with a parent
