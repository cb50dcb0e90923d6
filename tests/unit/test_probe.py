"""`gradlane probe`: the DSCP marks as they arrive, both ways, over real UDP sockets on
loopback (the emulated cluster's path: test_testbed.py)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gradlane.probe import _REPLY, _REQUEST, BandResult, probe, serve, tos_of


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server() -> Iterator[int]:
    port, ready, stop = _free_udp_port(), threading.Event(), threading.Event()
    thread = threading.Thread(target=serve, args=(("127.0.0.1", port), None, ready.set, stop))
    thread.start()
    assert ready.wait(5)
    yield port
    stop.set()
    thread.join(10)


def test_marks_that_survive_are_reported_kept_both_ways(server: int) -> None:
    started = time.monotonic()
    results = probe(("127.0.0.1", server), [46, 34, 26, 18], count=3, timeout_s=20)
    # Every answer in: no waiting out the timeout (a loopback answer takes microseconds).
    assert time.monotonic() - started < 10
    assert [r.dscp for r in results] == [46, 34, 26, 18]
    for r in results:
        assert r.ok, r
        assert r.sent == 3 and r.there == r.back == [r.dscp] * 3
        assert all(0 < rtt < 10 for rtt in r.rtt_s), r.rtt_s
        assert "there DSCP" in r.summary() and "kept" in r.summary()


def test_a_band_s_summary_and_verdict() -> None:
    kept = BandResult(0, 46, sent=2, there=[46, 46], back=[46, 46], rtt_s=[0.002, 0.003])
    assert kept.ok
    assert kept.summary() == ("2 of 2 answered, there DSCP 46 kept, back DSCP 46 kept, "
                              "round trip 2.50 ms")
    assert not BandResult(0, 46).ok  # nothing sent is nothing shown
    assert not BandResult(0, 46, sent=2, there=[46], back=[46], rtt_s=[0.001]).ok  # one lost


def test_serve_ends_after_its_seconds_and_counts_what_it_answered() -> None:
    port, ready, answered = _free_udp_port(), threading.Event(), []
    thread = threading.Thread(target=lambda: answered.append(
        serve(("127.0.0.1", port), seconds=2.0, ready=ready.set)))
    thread.start()
    assert ready.wait(5)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as junk:
        # The size of a request, but not one: another magic, or a DSCP past 63.
        junk.sendto(_REQUEST.pack(b"XXXX", 0, 46, 0, 1, 0.0), ("127.0.0.1", port))
        junk.sendto(_REQUEST.pack(b"GLPQ", 0, 64, 0, 1, 0.0), ("127.0.0.1", port))
    assert all(r.ok for r in probe(("127.0.0.1", port), [46, 63], count=2))  # 63: the last
    thread.join(10)
    assert not thread.is_alive() and answered == [4]


def _probe_a_hand_made_peer(replies: Callable[[tuple[Any, ...]], list[bytes]],
                            mark: bool) -> list[BandResult]:
    """Probe bands 46 and 18, twice each, at a peer that answers each request (its fields)
    with `replies(request)`, marked with the request's DSCP if `mark`, else unmarked."""
    port, ready = _free_udp_port(), threading.Event()

    def peer() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", port))
            sock.settimeout(5)
            ready.set()
            for _ in range(4):
                data, prober = sock.recvfrom(64)
                request = _REQUEST.unpack(data)
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, request[2] << 2 if mark else 0)
                for reply in replies(request):
                    sock.sendto(reply, prober)

    thread = threading.Thread(target=peer)
    thread.start()
    assert ready.wait(5)
    results = probe(("127.0.0.1", port), [46, 18], count=2)
    thread.join(10)
    return results


def test_answers_that_are_not_to_this_probe_are_ignored() -> None:
    """Before each right answer, three the prober must ignore (another magic, another
    nonce, a band it did not send), each claiming the request arrived as DSCP 0."""
    def replies(request: tuple[Any, ...]) -> list[bytes]:
        _, band, dscp, seq, nonce, sent = request
        return [_REPLY.pack(b"GLPX", band, dscp, seq, nonce, sent, 0),
                _REPLY.pack(b"GLPA", band, dscp, seq, nonce ^ 1, sent, 0),
                _REPLY.pack(b"GLPA", 2, dscp, seq, nonce, sent, 0),
                _REPLY.pack(b"GLPA", band, dscp, seq, nonce, sent, dscp << 2)]

    results = _probe_a_hand_made_peer(replies, mark=True)
    assert [(r.there, r.back) for r in results] == [([46, 46], [46, 46]), ([18, 18], [18, 18])]
    assert all(r.ok for r in results)


def test_a_re_marked_path_is_named_and_fails() -> None:
    """A peer behind a network that re-marks everything to DSCP 0: it says it saw TOS 0 and
    its answers leave unmarked."""
    results = _probe_a_hand_made_peer(
        lambda request: [_REPLY.pack(b"GLPA", *request[1:], 0)], mark=False)
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


def _probe_command(*args: str) -> subprocess.CompletedProcess[str]:
    """`gradlane probe ARGS` run as a user would, its output captured."""
    return subprocess.run([sys.executable, "-m", "gradlane.cli", "probe", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_command_fails_on_a_silent_peer_and_says_why() -> None:
    done = _probe_command("127.0.0.1", "--port", str(_free_udp_port()), "--count", "1")
    assert done.returncode == 1
    assert "FAIL  band 0 (DSCP 46): no answer to 1 datagrams" in done.stdout
    assert "is `gradlane probe --serve` running there" in done.stderr
    bad = _probe_command("127.0.0.1", "--dscp", "46,99")
    assert bad.returncode == 2 and "DSCP values 0-63" in bad.stderr


def test_the_server_says_it_answers_only_once_it_is_bound() -> None:
    port = _free_udp_port()
    done = _probe_command("--serve", "--listen", "127.0.0.1", "--port", str(port),
                          "--seconds", "0.3")
    assert done.returncode == 0, done.stderr
    assert f"answering probes on 127.0.0.1:{port} (UDP) for 0.3 s" in done.stderr
    assert "answered 0 probes" in done.stderr
    # 192.0.2.1 (TEST-NET-1) is no address of this host: nothing was ever answered there.
    taken = _probe_command("--serve", "--listen", "192.0.2.1", "--seconds", "0.3")
    assert taken.returncode == 1
    assert "cannot answer on 192.0.2.1:7801: [Errno 99]" in taken.stderr
    assert "answering" not in taken.stderr + taken.stdout
