"""`gradlaned --check`'s checks that need no root (the rest run in test_daemon_netns.py)."""

from __future__ import annotations

import socket
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from gradlane.daemon.config import DaemonConfig, InterfaceConfig
from gradlane.daemon.preflight import (
    CAP_NET_ADMIN,
    Finding,
    _control,
    _open_files,
    _socket,
    _state_dir,
    preflight,
)
from gradlane.openfiles import MARGIN, Room, room_for


def _config(tmp_path: Path, **kw: Any) -> DaemonConfig:
    token = tmp_path / "token"
    token.write_text("a" * 32)
    token.chmod(0o600)
    base: dict[str, Any] = {"interfaces": (), "socket_path": tmp_path / "run" / "gl.sock",
                            "state_dir": tmp_path / "state", "http": "",
                            "control_url": "http://control:7800/", "control_token_file": token}
    return DaemonConfig(**{**base, **kw})


class _Answer:
    def __enter__(self) -> _Answer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_control_plane_check_sends_the_token_and_reads_the_answer(tmp_path: Path) -> None:
    asked: list[Any] = []

    def answers(request: Any, timeout: float) -> _Answer:
        asked.append(request)
        return _Answer()

    found = _control(_config(tmp_path), opener=answers)
    assert (found.level, found.check) == ("ok", "control plane http://control:7800")
    config = _config(tmp_path)
    (tmp_path / "token").chmod(0o644)  # others may read it: said, but it works
    found = _control(config, opener=answers)
    assert found.level == "warn" and found.detail.startswith(
        f"answers and takes the token; but the token file {tmp_path}/token is open to its "
        "group or others (mode 0644)")
    (tmp_path / "token").chmod(0o600)
    assert asked[0].full_url == "http://control:7800/api/v1/cluster"
    assert asked[0].get_header("Authorization") == "Bearer " + "a" * 32

    def refuses(request: Any, timeout: float) -> _Answer:
        raise urllib.error.HTTPError(request.full_url, 401, "Unauthorized", {}, None)  # type: ignore[arg-type]

    assert _control(_config(tmp_path), opener=refuses).detail == "refused the token"

    def silent(request: Any, timeout: float) -> _Answer:
        raise urllib.error.URLError("connection refused")

    found = _control(_config(tmp_path), opener=silent)
    assert found.level == "warn" and "runs on its local policy" in found.detail
    short = tmp_path / "short-token"
    short.write_text("short")
    found = _control(_config(tmp_path, control_token_file=short), opener=answers)
    assert found.level == "fail" and "at least 16 characters" in found.detail


def test_the_socket_check_tells_a_stale_socket_from_a_served_one(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert _socket(config).detail == "can be created"
    config.socket_path.parent.mkdir()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(config.socket_path))
        server.listen()
        assert _socket(config).level == "warn"
    assert _socket(config).detail == "a stale socket: gradlaned replaces it"
    assert _socket(_config(tmp_path, socket_group="no-such-group-gl")).level == "fail"


def test_without_cap_net_admin_the_check_fails_and_tries_no_kernel(tmp_path: Path) -> None:
    if not Path("/sys/class/net/lo").exists():
        pytest.skip("no loopback interface to look at")
    findings = preflight(_config(tmp_path, control_url=None,
                                 interfaces=(InterfaceConfig("lo", 10**9),)), capabilities=0)
    levels = {f.check: f.level for f in findings}
    assert levels["privileges"] == "fail"
    assert levels["kernel: HTB and u32"] == "warn"  # not tried
    # Read only (needs no privilege); loopback is no link between hosts.
    lo = next(f for f in findings if f.check == "interface lo")
    assert lo.level == "warn" and "loopback: shaped, it would slow every connection" in lo.detail
    assert not any(f.check.startswith(("http", "control")) for f in findings)  # both off


def test_the_state_dir_check_tells_a_writable_dir_from_one_to_create(tmp_path: Path) -> None:
    assert _state_dir(tmp_path).detail == "writable"
    assert _state_dir(tmp_path / "state" / "gradlane").detail == "can be created"
    assert list(tmp_path.iterdir()) == []  # tried with a scratch directory, and removed


def test_the_socket_and_state_dir_checks_try_their_place_rather_than_read_its_mode(
        tmp_path: Path) -> None:
    """Root passes by modes: a file on the way, or /proc, says no only when tried."""
    (tmp_path / "file").write_text("")
    found = _socket(_config(tmp_path, socket_path=tmp_path / "file" / "gl.sock"))
    assert (found.level, found.detail) == ("fail", f"cannot create it: {tmp_path}/file is "
                                                   "not a directory")
    found = _state_dir(tmp_path / "file")
    assert (found.level, found.detail) == ("fail", f"{tmp_path}/file is not a directory: the "
                                                   "original qdiscs could not be recorded")
    found = _state_dir(Path("/proc/gl-no-such-dir/state"))
    assert found.level == "fail" and found.detail.startswith("/proc is not writable (")
    found = _socket(_config(tmp_path, socket_path=Path("/proc/gl.sock")))
    assert found.level == "fail" and found.detail.startswith("cannot create it: /proc is not ")


def test_every_capability_but_cap_net_admin_is_not_enough(tmp_path: Path) -> None:
    """CAP_NET_ADMIN is bit 12 of the mask: the others (CAP_NET_RAW, bit 13, among them)
    do not let gradlaned change qdiscs."""
    findings = preflight(_config(tmp_path, control_url=None),
                         capabilities=((1 << 64) - 1) & ~(1 << CAP_NET_ADMIN))
    assert findings[0] == Finding("privileges", "fail",
                                  "no CAP_NET_ADMIN: run as root (the systemd unit grants it)")


@pytest.mark.parametrize("under_systemd", [False, True])
def test_the_open_file_check_weighs_max_clients_against_the_hard_limit(
    under_systemd: bool,
) -> None:
    whose = "this unit's" if under_systemd else "this shell's"
    found = _open_files(4096, Room(4180, 20, 1024, 8192), under_systemd)
    assert (found.check, found.level) == ("open files", "ok")  # gradlaned raises its soft one
    assert found.detail.startswith(f"daemon.max_clients = 4,096 needs about 4,180 open "
                                   f"files; {whose} hard limit is 8,192")
    assert _open_files(4096, Room(4180, 20, 1024, -1), under_systemd).level == "ok"  # no limit
    short = _open_files(4096, Room(4180, 20, 1024, 4096), under_systemd)
    # Run by systemd, the limit is gradlaned's own: it would refuse. From a shell it is
    # only the shell's: the service gets its unit's.
    assert short.level == ("fail" if under_systemd else "warn")
    assert "LimitNOFILE=" in short.detail


def test_room_for_exactly_the_limit_fits_it() -> None:
    assert Room(1024, 20, 1024, 1024).fits_soft and Room(1024, 20, 1024, 1024).fits_hard
    assert not Room(1025, 20, 1024, 1024).fits_soft
    assert not Room(1025, 20, 1024, 1024).fits_hard
    assert Room(1 << 40, 20, -1, -1).fits_soft  # -1: RLIM_INFINITY, no limit


def test_the_open_file_check_counts_this_process_s_open_files(tmp_path: Path) -> None:
    room = room_for(100)
    assert room is not None and room.needed == room.in_use + 100 + MARGIN
    found = next(f for f in preflight(_config(tmp_path, control_url=None, max_clients=100),
                                      capabilities=0) if f.check == "open files")
    assert found.level == "ok" and "max_clients = 100 needs about" in found.detail
