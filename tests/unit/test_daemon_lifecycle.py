"""gradlaned's life as systemd and its host see it: readiness and stopping told to systemd,
a tree left by a crash, workers whose process died, counters read while it serves."""

import asyncio
import dataclasses
import errno
import grp
import os
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gradlane.daemon import service
from gradlane.daemon.config import InterfaceConfig
from gradlane.daemon.protocol import Hello
from gradlane.daemon.qdisc import ClassStats, QdiscSpec
from gradlane.daemon.registry import Credentials
from gradlane.daemon.service import Daemon
from gradlane.errors import GradlaneError, TcError
from tests import REPO
from tests.fakes import FakeBackend, fake_config, until


async def _serving(daemon: Daemon, body: Callable[[], Awaitable[None]],
                   notify_socket: str | None = None) -> None:
    """Run `body` while `daemon` serves, then stop it and wait for `serve` to return."""
    serving = asyncio.create_task(daemon.serve(notify_socket=notify_socket))
    try:
        await asyncio.wait_for(daemon.ready.wait(), 10)
        await body()
    finally:
        daemon.stop()
        await asyncio.wait_for(serving, 20)


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_systemd_hears_ready_once_serving_and_stopping_on_the_way_out(
        tmp_path: Path, abstract: bool) -> None:
    # gradlaned.service is Type=notify: without READY=1 systemd kills it at the start
    # timeout. NOTIFY_SOCKET is a path, or "@name" for an abstract socket (containers').
    name = f"gl-notify-{os.getpid()}-{tmp_path.name}"
    where = "@" + name if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name if abstract else where)
        systemd.setblocking(False)
        daemon = Daemon(fake_config(tmp_path / "gl.sock"), backend_factory=FakeBackend)
        heard: list[bytes] = []

        def read() -> list[bytes]:
            while True:
                try:
                    heard.append(systemd.recv(256))
                except BlockingIOError:
                    return heard

        async def body() -> None:
            await until(lambda: bool(read()))
            assert heard == [b"READY=1"]  # once, and nothing else while serving

        asyncio.run(_serving(daemon, body, where))
        assert read() == [b"READY=1", b"STOPPING=1"]


class LeftBehind(FakeBackend):
    """An interface with a tree of gradlane's own from a run that crashed."""

    calls: list[str]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.spec = QdiscSpec(rate_bps=10**9, other_rate_bps=10**8, bands=(46,))
        self.calls = []

    def restore(self) -> bool:
        self.calls.append("restore")
        return super().restore()

    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]:
        self.calls.append("apply")
        return super().apply(spec, verify=verify)


@pytest.mark.parametrize("on_start", ["takeover", "restore"])
def test_a_tree_left_by_a_crash_is_restored_first_only_when_asked(
        tmp_path: Path, on_start: str, caplog: pytest.LogCaptureFixture) -> None:
    config = dataclasses.replace(fake_config(tmp_path / "gl.sock"), on_start=on_start)
    daemon = Daemon(config, backend_factory=LeftBehind)
    backend = daemon._backends[0]
    assert isinstance(backend, LeftBehind)
    asyncio.run(daemon._start_tc())
    if on_start == "restore":
        assert backend.calls == ["restore", "apply"]
        assert "fake0: restoring a tree left by a previous run" in caplog.text
    else:
        assert backend.calls == ["apply"]
        assert "fake0: taking over a tree left by a previous run" in caplog.text


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_worker_whose_process_died_expires_while_the_daemon_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its connection may outlive it (a child process holding the socket): the daemon looks
    # for dead workers every EXPIRE_EVERY, again and again, and plans without them.
    monkeypatch.setattr(service, "EXPIRE_EVERY", 0.02)
    daemon = Daemon(fake_config(tmp_path / "gl.sock"), backend_factory=FakeBackend)
    backend = daemon._backends[0]
    assert isinstance(backend, FakeBackend)
    me = Credentials(os.getpid(), os.getuid(), os.getgid())

    def jobs() -> set[str]:
        return {j.name for j in backend.spec.jobs} if backend.spec else set()

    async def body() -> None:
        daemon.registry.add(Hello(1, "alive", 0, 1, ()), me)
        for i in range(2):  # the second one dies after the loop has looked a few times
            await asyncio.sleep(0.1)
            daemon.registry.add(Hello(1, f"gone{i}", 0, 1, ()),
                                dataclasses.replace(me, pid=_dead_pid()))
            daemon._dirty.set()
            await until(lambda: daemon.registry.jobs().keys() == {"alive"})
            await until(lambda: jobs() == {service.DSCP_JOB, "alive"})

    asyncio.run(_serving(daemon, body))


def test_class_counters_are_read_again_and_again_while_the_daemon_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "STATS_EVERY", 0.01)
    reads: list[None] = []  # one per read, from the daemon's tc thread

    class Counted(FakeBackend):
        def class_stats(self) -> list[ClassStats]:
            reads.append(None)
            return super().class_stats()

    daemon = Daemon(fake_config(tmp_path / "gl.sock"), backend_factory=Counted)

    async def body() -> None:
        await until(lambda: len(reads) >= 5)

    asyncio.run(_serving(daemon, body))


def _another_group() -> grp.struct_group:
    """A group the socket can be given: root may give any; others their own groups."""
    if os.geteuid() == 0:
        for group in grp.getgrall():
            if group.gr_gid != os.getegid():
                return group
    return grp.getgrgid(os.getegid())


def test_the_socket_has_the_mode_and_group_configured_and_the_daemon_s_owner(
        tmp_path: Path) -> None:
    # Who may register workers: socket_group's members with the default 0660, say. The
    # socket's directories are made (a tmpfs /run is empty at boot).
    group = _another_group()
    config = dataclasses.replace(fake_config(tmp_path / "run" / "gradlane" / "gl.sock"),
                                 socket_mode=0o660, socket_group=group.gr_name)
    daemon = Daemon(config, backend_factory=FakeBackend)

    async def body() -> None:
        seen = config.socket_path.stat()
        assert stat.S_ISSOCK(seen.st_mode) and stat.S_IMODE(seen.st_mode) == 0o660
        assert (seen.st_uid, seen.st_gid) == (os.geteuid(), group.gr_gid)

    asyncio.run(_serving(daemon, body))
    assert not config.socket_path.exists()


def test_a_socket_that_cannot_be_made_is_an_error_naming_it_and_the_tree_is_restored(
        tmp_path: Path) -> None:
    # /etc/hostname/gl.sock, say: a file where the socket's directory would be.
    (tmp_path / "file").write_text("")
    config = fake_config(tmp_path / "file" / "gl.sock")
    daemon = Daemon(config, backend_factory=FakeBackend)
    with pytest.raises(GradlaneError, match=rf"cannot serve shims on {tmp_path}/file/gl.sock: "
                                            rf"{tmp_path}/file: File exists"):
        asyncio.run(daemon.serve())
    [backend] = daemon._backends
    assert isinstance(backend, FakeBackend) and backend.restored


def test_a_socket_group_that_does_not_exist_stops_gradlaned_before_it_touches_anything(
        tmp_path: Path) -> None:
    opened: list[str] = []

    class Counted(FakeBackend):
        def open(self) -> None:  # claims the interface, on a real one
            opened.append(self.ifname)

    config = dataclasses.replace(fake_config(tmp_path / "run" / "gl.sock"),
                                 socket_group="no-such-group-gl")
    daemon = Daemon(config, backend_factory=Counted)
    with pytest.raises(GradlaneError, match=r"^no group 'no-such-group-gl' to own .*/gl.sock "
                                            r"\(daemon.socket_group\): create it \(groupadd "
                                            r"no-such-group-gl\) or name another$"):
        asyncio.run(daemon.serve())
    [backend] = daemon._backends
    assert isinstance(backend, FakeBackend) and backend.applied == 0 and opened == []
    assert not (tmp_path / "run").exists()


def test_a_socket_that_cannot_be_given_its_group_is_not_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Bound, but chown fails (a filesystem without owners, say): no half-made socket
    # stays for shims to find, and the tree is restored.
    def refuse(*args: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(service.os, "chown", refuse)
    config = fake_config(tmp_path / "gl.sock")
    daemon = Daemon(config, backend_factory=FakeBackend)
    with pytest.raises(GradlaneError, match=r"cannot serve shims on .*/gl.sock: Operation not "
                                            r"permitted"):
        asyncio.run(daemon.serve())
    assert not config.socket_path.exists()
    [backend] = daemon._backends
    assert isinstance(backend, FakeBackend) and backend.restored


def test_an_interface_that_cannot_be_restored_is_logged_and_the_others_still_are(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # One interface's failure (here EBUSY; anything but "gone") must not leave the next
    # one shaped after gradlaned exits, nor any claim held.
    closed: list[str] = []

    class Stuck(FakeBackend):
        def restore(self) -> bool:
            if self.ifname == "fake0":
                raise TcError(errno.EBUSY, self.ifname, "restore root qdisc", "busy")
            return super().restore()

        def close(self) -> None:
            closed.append(self.ifname)

    config = dataclasses.replace(
        fake_config(tmp_path / "gl.sock"),
        interfaces=(InterfaceConfig("fake0", 10**9), InterfaceConfig("fake1", 10**9)))
    daemon = Daemon(config, backend_factory=Stuck)
    asyncio.run(daemon._restore_tc())
    _, other = daemon._backends
    assert isinstance(other, Stuck) and other.restored and closed == ["fake0", "fake1"]
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == "fake0: could not restore the original qdisc"
    assert record.exc_info is not None and record.exc_info[0] is TcError


def test_a_max_clients_past_the_soft_open_file_limit_raises_it_and_the_clients_connect(
        tmp_path: Path) -> None:
    # systemd gives services a soft limit of 1,024 files: with daemon.max_clients set
    # above it, accept() failed (EMFILE) past that many shims, each left waiting. Here
    # the soft limit is this process's files and 50, for 150 shims.
    import resource

    from gradlane.daemon import protocol

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    if hard != resource.RLIM_INFINITY and hard < in_use + 1000:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to raise the soft one")
    config = dataclasses.replace(fake_config(tmp_path / "gl.sock"), max_clients=400)
    daemon = Daemon(config, backend_factory=FakeBackend)
    shims: list[socket.socket] = []

    def connect() -> None:  # off the loop, which accepts meanwhile
        deadline = time.monotonic() + 60
        for rank in range(150):
            sock = socket.socket(socket.AF_UNIX)
            shims.append(sock)
            sock.settimeout(10)
            while True:  # a full backlog (a loop slow to accept, on a busy machine): again
                try:
                    sock.connect(str(config.socket_path))
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the daemon stopped accepting"
                    time.sleep(0.01)
            sock.sendall(protocol.encode({"type": "hello", "version": 1, "job": "many",
                                          "rank": rank, "world_size": 150, "flows": []}))

    async def body() -> None:
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= in_use + 400
        await asyncio.to_thread(connect)
        await until(lambda: len(daemon.registry.workers()) == 150)

    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 50, hard))
    try:
        asyncio.run(_serving(daemon, body))
    finally:
        for sock in shims:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_max_clients_past_the_hard_open_file_limit_is_refused_naming_it(
        tmp_path: Path) -> None:
    # At start: nothing touched. At a reload (SIGHUP): nothing reloaded. The hard limit
    # cannot be raised again without privileges: in a process of its own.
    script = (
        "import asyncio, dataclasses, logging, os, resource, sys\n"
        "from pathlib import Path\n"
        "from gradlane.daemon.service import Daemon\n"
        "from gradlane.errors import ConfigError\n"
        "from tests.fakes import FakeBackend, fake_config\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "config = dataclasses.replace(fake_config(Path(sys.argv[1])), max_clients=10)\n"
        "n = len(os.listdir('/proc/self/fd')) + 100\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
        "async def main():\n"
        "    daemon = Daemon(config, backend_factory=FakeBackend)\n"
        "    serving = asyncio.create_task(daemon.serve())\n"
        "    await asyncio.wait_for(daemon.ready.wait(), 10)\n"
        "    await daemon.reload(dataclasses.replace(config, max_clients=1000))\n"
        "    print('kept', daemon.config.max_clients)\n"
        "    daemon.stop()\n"
        "    await serving\n"
        "    big = Daemon(dataclasses.replace(config, max_clients=1000),\n"
        "                 backend_factory=FakeBackend)\n"
        "    try:\n"
        "        await big.serve()\n"
        "    except ConfigError as exc:\n"
        "        print(exc)\n"
        "    print('untouched', big._backends[0].applied == 0, config.socket_path.exists())\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "gl.sock")],
                          capture_output=True, text=True, timeout=120, check=True, cwd=REPO)
    said = (r"daemon.max_clients = 1000 needs \d+ open files with the \d+ open now, over this "
            r"process's limit of \d+: raise LimitNOFILE= in gradlaned's unit \(or ulimit -n\), "
            r"or lower daemon.max_clients")
    assert re.search(f"^{said}$", done.stdout, re.M), done.stdout
    assert re.search(f"reload refused: {said} \\(nothing reloaded\\)", done.stderr), done.stderr
    assert "kept 10" in done.stdout and "untouched True False" in done.stdout, done.stdout
