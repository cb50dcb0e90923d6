"""`gradlane probe`: the DSCP marks as they arrive, both ways, over real UDP sockets on
loopback (the emulated cluster's path: test_testbed.py)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from gradlane.probe import _REPLY, _REQUEST, probe, serve, tos_of


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server() -> Iterator[int]:
    port, ready, stop = _free_udp_port(), threading.Event(), threading.Event()
    thread = threading.Thread(target=serve, args=(("127.0.0.1", port), 30.0, ready, stop))
    thread.start()
    assert ready.wait(5)
    yield port
    stop.set()
    thread.join(10)


def test_marks_that_survive_are_reported_kept_both_ways(server: int) -> None:
    results = probe(("127.0.0.1", server), [46, 34, 26, 18], count=3)
    assert [r.dscp for r in results] == [46, 34, 26, 18]
    for r in results:
        assert r.ok, r
        assert r.sent == 3 and r.there == r.back == [r.dscp] * 3
        assert "there DSCP" in r.summary() and "kept" in r.summary()


def _bleaching_peer(port: int, ready: threading.Event, answers: int) -> None:
    """A peer behind a network that re-marks everything to DSCP 0: it says it saw TOS 0 and
    its answers leave unmarked."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.settimeout(5)
        ready.set()
        for _ in range(answers):
            data, peer = sock.recvfrom(64)
            magic, band, dscp, seq, nonce, sent = _REQUEST.unpack(data)
            sock.sendto(_REPLY.pack(b"GLPA", band, dscp, seq, nonce, sent, 0), peer)


def test_a_re_marked_path_is_named_and_fails() -> None:
    port, ready = _free_udp_port(), threading.Event()
    peer = threading.Thread(target=_bleaching_peer, args=(port, ready, 4))
    peer.start()
    assert ready.wait(5)
    results = probe(("127.0.0.1", port), [46, 18], count=2)
    peer.join(10)
    assert not any(r.ok for r in results)
    assert results[0].there == results[0].back == [0, 0]
    assert ("there DSCP 46 arrived as 0 (re-marked), back DSCP 46 arrived as 0 (re-marked)"
            in results[0].summary())


def test_no_answer_is_a_failure_and_garbage_is_ignored(server: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as junk:
        junk.sendto(b"not a probe", ("127.0.0.1", server))
        junk.sendto(struct.pack("<4s", b"GLPQ"), ("127.0.0.1", server))
    results = probe(("127.0.0.1", server), [46], count=1)  # the server still answers
    assert results[0].ok
    silent = probe(("127.0.0.1", _free_udp_port()), [46], count=2, timeout_s=0.3)
    assert not silent[0].ok and silent[0].summary() == "no answer to 2 datagrams"


def test_tos_of_reads_ip_recvtos_ancillary_data() -> None:
    assert tos_of([(socket.IPPROTO_IP, socket.IP_TOS, bytes([0xB8]))]) == 0xB8
    assert tos_of([(socket.SOL_SOCKET, 1, b"x")]) is None


def test_the_command_fails_on_a_silent_peer_and_says_why() -> None:
    done = subprocess.run([sys.executable, "-m", "gradlane.cli", "probe", "127.0.0.1", "--port",
                           str(_free_udp_port()), "--count", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "FAIL  band 0 (DSCP 46): no answer to 1 datagrams" in done.stdout
    assert "is `gradlane probe --serve` running there" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "gradlane.cli", "probe", "127.0.0.1", "--dscp",
                          "46,99"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "DSCP values 0-63" in bad.stderr
