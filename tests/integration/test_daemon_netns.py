"""gradlaned against the real kernel, in emulated hosts (root only)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradlane.daemon import QdiscManager, QdiscSpec, protocol
from gradlane.testbed import Cluster, Topology
from tests.integration.helpers import hello, register, status, stop, tc, wait_for
from tests.integration.helpers import start_netns_daemon as start_daemon

pytestmark = pytest.mark.netns
BASE_CLASSES = {"474c:1", "474c:2", "474c:3",
                "474c:100", "474c:101", "474c:102", "474c:103", "474c:104"}
ACKS = list(range(0x85, 0x90))  # the ACKs' filters, one per TCP header length
JOB_CLASSES = {"474c:200", "474c:201", "474c:202", "474c:203", "474c:204"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(Topology.build("tdmn", 2, "200mbit")) as c:
        yield c


def classes(cluster: Cluster, host: str = "h1") -> list[str]:
    return re.findall(r"class htb (\S+)", tc(cluster.ns(host), "class", "show", "dev", "eth0"))


def filter_prefs(cluster: Cluster, host: str = "h1") -> list[int]:
    """The priorities of the filters that classify, one per filter (registered flows
    share one priority, the ACKs' filters and each DSCP fallback have their own)."""
    shown = tc(cluster.ns(host), "filter", "show", "dev", "eth0")
    return sorted(int(p) for p in re.findall(r"pref (\d+) u32 .*flowid", shown))


# A training process's stand-in: four unmarked band connections, registered
# with the daemon by 5-tuple, band b sending (b + 1) MB.
WORKER = textwrap.dedent(
    """
    import json, socket, sys, time
    from gradlane.daemon import protocol
    dst, sock_path = sys.argv[1], sys.argv[2]
    conns = [socket.create_connection((dst, 5201)) for _ in range(4)]
    flows = []
    for band, c in enumerate(conns):
        src, sport = c.getsockname()
        flows.append({"band": band, "src": src, "sport": sport, "dst": dst, "dport": 5201})
    d = socket.socket(socket.AF_UNIX)
    d.connect(sock_path)
    d.sendall(protocol.encode({"type": "hello", "version": 1, "job": "train", "rank": 0,
                               "world_size": 2, "flows": flows}))
    dec, got = protocol.FrameDecoder(), []
    while len(got) < 2:
        got += dec.feed(d.recv(65536))
    print("registered", flush=True)
    sys.stdin.readline()  # the test has checked the tree
    for band, c in enumerate(conns):
        c.sendall(json.dumps({"label": f"band{band}", "dscp": 0}).encode() + b"\\n")
        c.sendall(b"x" * ((band + 1) * 1_000_000))
        c.shutdown(socket.SHUT_WR)
    for c in conns:
        c.recv(1)
    print("sent", flush=True)
    sys.stdin.readline()  # hold the registration until told
    """
)


def leaf_bytes(cluster: Cluster) -> dict[str, int]:
    shown = tc(cluster.ns("h1"), "-s", "class", "show", "dev", "eth0")
    return {m[0]: int(m[1]) for m in re.findall(r"class htb (\S+) .*?\n Sent (\d+) bytes", shown)}


def test_bands_land_in_their_leaves_and_sigterm_restores(cluster: Cluster, tmp_path: Path) -> None:
    original = tc(cluster.ns("h1"), "qdisc", "show", "dev", "eth0")
    d1, sock1 = start_daemon(cluster, "h1", tmp_path)
    d2, _ = start_daemon(cluster, "h2", tmp_path)
    receiver = cluster.popen(
        "h2",
        [sys.executable, "-m", "gradlane.testbed.traffic", "recv", "--flows", "4",
         "--timeout", "60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert receiver.stdout is not None and receiver.stdout.readline().strip() == "READY"
    worker = cluster.popen(
        "h1", [sys.executable, "-c", WORKER, cluster.addr("h2"), str(sock1)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert worker.stdout is not None and worker.stdin is not None
    try:
        assert worker.stdout.readline().strip() == "registered"
        wait_for(lambda: set(classes(cluster)) >= JOB_CLASSES, "the job's classes")
        # One reconcile adds the classes, then the filters: look once they are in (a fresh
        # clone's run once looked in between and saw only the DSCP fallbacks).
        wait_for(lambda: filter_prefs(cluster).count(0x100) == 4, "the flows' filters")
        # one per band connection, in the flow hash table, + the DSCP fallbacks
        assert filter_prefs(cluster) == ACKS + [0x100] * 4 + [0x8000, 0x8001, 0x8002, 0x8003]
        before = leaf_bytes(cluster)
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "sent"
        after = leaf_bytes(cluster)
        for band in range(4):
            leaf = f"474c:20{band + 1}"
            assert after[leaf] - before[leaf] >= (band + 1) * 1_000_000, (leaf, after)
        assert after["474c:2"] - before["474c:2"] < 500_000  # not counted as other traffic
        assert status(cluster)["jobs"][0]["name"] == "train"
        worker.stdin.write("\n")
        worker.stdin.flush()
        worker.wait(timeout=10)
        wait_for(lambda: not JOB_CLASSES & set(classes(cluster)), "the job's classes to go")
    finally:
        for proc in (worker, receiver):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        assert stop(d1) == 0 and stop(d2) == 0
    assert tc(cluster.ns("h1"), "qdisc", "show", "dev", "eth0") == original
    assert not sock1.exists()


def test_sigkill_then_restart_recovers_without_leftovers(cluster: Cluster, tmp_path: Path) -> None:
    original = tc(cluster.ns("h1"), "qdisc", "show", "dev", "eth0")
    daemon, sock = start_daemon(cluster, "h1", tmp_path)
    flows = [
        {"band": b, "src": cluster.addr("h1"), "sport": 41000 + b, "dst": cluster.addr("h2"),
         "dport": 5201}
        for b in range(4)
    ]  # fmt: skip
    client = register(sock, hello(flows))
    wait_for(lambda: set(classes(cluster)) >= JOB_CLASSES, "the job's classes")
    assert stop(daemon, signal.SIGKILL) != 0
    client.close()
    assert set(classes(cluster)) >= JOB_CLASSES  # the crash left the tree behind
    daemon, sock = start_daemon(cluster, "h1", tmp_path)
    try:
        wait_for(lambda: set(classes(cluster)) == BASE_CLASSES, "leftover classes to go")
        shown = classes(cluster)
        assert len(shown) == len(set(shown))  # no duplicates
        assert filter_prefs(cluster) == ACKS + [0x8000, 0x8001, 0x8002, 0x8003]
        client = register(sock, hello(flows))  # and it works again
        wait_for(lambda: set(classes(cluster)) >= JOB_CLASSES, "the job's classes")
        client.close()
    finally:
        assert stop(daemon) == 0
    assert tc(cluster.ns("h1"), "qdisc", "show", "dev", "eth0") == original


@pytest.mark.timeout(300)
def test_thousand_register_cycles_leave_nothing_behind(cluster: Cluster, tmp_path: Path) -> None:
    daemon, sock = start_daemon(cluster, "h1", tmp_path)
    try:
        for i in range(1000):
            flows = [
                {"band": b, "src": cluster.addr("h1"), "sport": 20000 + 4 * i + b,
                 "dst": cluster.addr("h2"), "dport": 5201}
                for b in range(4)
            ]  # fmt: skip
            client = register(sock, hello(flows, job=f"job{i % 7}", rank=i % 3))
            client.sendall(protocol.encode({"type": "bye"}))
            client.close()
        wait_for(lambda: status(cluster)["jobs"] == [], "an empty registry", timeout=30)
        wait_for(lambda: set(classes(cluster)) == BASE_CLASSES, "base classes only", timeout=30)
        assert filter_prefs(cluster) == ACKS + [0x8000, 0x8001, 0x8002, 0x8003]
        assert status(cluster)["reconcile"]["errors"] == 0
    finally:
        assert stop(daemon) == 0


def dscp_filters(cluster: Cluster) -> set[str]:
    shown = tc(cluster.ns("h1"), "filter", "show", "dev", "eth0")
    return set(re.findall(r"match ([0-9a-f]{2})000000/fc000000 at 1", shown))


def test_sighup_reloads_bands(cluster: Cluster, tmp_path: Path) -> None:
    config = tmp_path / "gradlaned.toml"
    config.write_text("[network]\nbands = [46, 34, 26, 18]\n")
    daemon, sock = start_daemon(cluster, "h1", tmp_path, config)
    try:
        wait_for(lambda: dscp_filters(cluster) == {"b8", "88", "68", "48"}, "four DSCP filters")
        config.write_text("[network]\nbands = [46, 10]\n")
        daemon.send_signal(signal.SIGHUP)
        wait_for(lambda: dscp_filters(cluster) == {"b8", "28"}, "the reloaded bands")
        client = socket.socket(socket.AF_UNIX)
        client.settimeout(10)
        client.connect(str(sock))
        client.sendall(protocol.encode(hello([])))
        decoder, got = protocol.FrameDecoder(), []
        while len(got) < 2:
            got += decoder.feed(client.recv(65536))
        assert got[0]["bands"] == [46, 10] and got[1]["version"] == 1
        client.close()
        config.write_text("[network]\nbands = [46, 46]\n")  # invalid: refused, kept
        daemon.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert daemon.poll() is None and dscp_filters(cluster) == {"b8", "28"}
    finally:
        assert stop(daemon) == 0


def _check(cluster: Cluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gradlane daemon --check` in h1, its files under `tmp_path`."""
    return cluster.run("h1", [sys.executable, "-m", "gradlane.cli", "daemon", "--check",
                              "--state-dir", str(tmp_path / "state"),
                              "--socket", str(tmp_path / "gradlaned.sock"), *args],
                       check=False)


def _found(out: str, check: str) -> str:
    """The level and detail `--check` printed for `check` ("ok    check: detail")."""
    line = re.search(rf"^(ok|warn|fail) +{re.escape(check)}: (.*)$", out, re.MULTILINE)
    assert line, out
    return f"{line[1]} {line[2]}"


def test_an_interface_without_a_rate_gets_the_kernel_s_or_a_clear_error(
        cluster: Cluster, tmp_path: Path) -> None:
    # The ethtool ioctl's answer for the host's eth0, a veth (which the kernel says is
    # 10 Gbit/s, whatever the testbed shapes it to); lo has no speed: the error says to
    # set one.
    done = _check(cluster, tmp_path, "-i", "eth0")
    assert _found(done.stdout, "interface eth0").startswith("ok line rate 10Gbit, shaped to "
                                                            "9.5Gbit"), done.stdout
    done = _check(cluster, tmp_path, "-i", "lo")
    assert done.returncode != 0
    shown = " ".join((done.stdout + done.stderr).split())
    assert "cannot detect the line rate of lo" in shown and 'rate = "10gbit"' in shown, shown


def test_check_passes_on_a_host_and_changes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    before = tc(cluster.ns("h1"), "qdisc", "show", "dev", "eth0")
    done = _check(cluster, tmp_path, "-i", "eth0=200mbit")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _found(done.stdout, "privileges").startswith("ok")
    assert _found(done.stdout, "interface eth0").startswith(f"ok line rate 200Mbit, shaped to "
                                                            f"190Mbit; IPv4 {cluster.addr('h1')}")
    root = before.split()[1]  # "qdisc <kind> <handle>: root ..."
    assert _found(done.stdout, "interface eth0").endswith(
        f"; root qdisc {root}: gradlaned replaces it and puts it back when it stops")
    assert _found(done.stdout, "kernel: HTB and u32").startswith("ok built 8 HTB classes")
    assert _found(done.stdout, "open files").startswith("ok daemon.max_clients = ")
    # Read, not touched: the host's qdiscs as they were, the scratch veth gone, no files.
    assert tc(cluster.ns("h1"), "qdisc", "show", "dev", "eth0") == before
    links = subprocess.run(["ip", "-n", cluster.ns("h1"), "-o", "link"], capture_output=True,
                           text=True, check=True, timeout=10).stdout
    assert "gl-chk" not in links, links
    assert not list(tmp_path.iterdir())


def test_check_names_a_scratch_veth_a_killed_check_left(cluster: Cluster) -> None:
    """The check's scratch veth is named for its pid: one a killed check left under that
    name fails the kernel check, which says how to remove it (not "kernel modules?")."""
    script = textwrap.dedent("""
        import os
        from gradlane.daemon.preflight import SCRATCH_PREFIX, _kernel, scratch_veth
        with scratch_veth(f"{SCRATCH_PREFIX}{os.getpid() % 100_000}") as name:
            found = _kernel()
            print(found.level, name, found.detail)
    """)
    done = cluster.run("h1", [sys.executable, "-c", script], check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    level, name, detail = done.stdout.strip().split(" ", 2)
    assert level == "fail" and name.startswith("gl-chk"), done.stdout
    assert detail.endswith(f"(a {name} left by a killed check? `gradlane testbed clean` "
                           "removes it)"), detail


def test_check_warns_of_a_link_down_loopback_and_a_tree_a_crash_left(
        cluster: Cluster, tmp_path: Path) -> None:
    ns = cluster.ns("h1")
    # A NIC not up (and without an address), and lo: gradlaned would run, but not as meant.
    subprocess.run(["ip", "-n", ns, "link", "add", "gl-tv0", "type", "veth", "peer", "name",
                    "gl-tv1"], check=True, timeout=10)
    try:
        done = _check(cluster, tmp_path, "-i", "gl-tv0=1gbit", "-i", "lo=1gbit")
        assert done.returncode == 0, done.stdout + done.stderr  # warnings only
        assert _found(done.stdout, "interface gl-tv0").startswith(
            "warn line rate 1Gbit, shaped to 950Mbit; no IPv4 address: the shims' flows (IPv4) "
            "cannot leave by it; link down; ")
        assert _found(done.stdout, "interface lo").startswith(
            "warn line rate 1Gbit, shaped to 950Mbit; IPv4 127.0.0.1; loopback: shaped, it "
            "would slow every connection within this host; ")
    finally:
        subprocess.run(["ip", "-n", ns, "link", "del", "gl-tv0"], check=True, timeout=10)
    # A tree left by a crashed gradlaned: taken over (the default) or restored first.
    crashed = QdiscManager("eth0", netns=ns, state_file=tmp_path / "left.json")
    crashed.apply(QdiscSpec(rate_bps=190_000_000, other_rate_bps=9_500_000))
    crashed.close()
    try:
        done = _check(cluster, tmp_path, "-i", "eth0=200mbit")
        assert done.returncode == 0, done.stdout + done.stderr
        assert _found(done.stdout, "interface eth0").startswith("ok line rate 200Mbit")
        assert _found(done.stdout, "interface eth0").endswith(
            "holds a gradlane tree (a running gradlaned's, or one a crash left: gradlaned "
            "takes it over, daemon.on_start)")
    finally:
        with QdiscManager("eth0", netns=ns, state_file=tmp_path / "left.json") as left:
            assert left.restore()


def test_check_names_what_would_stop_gradlaned(cluster: Cluster, tmp_path: Path) -> None:
    done = _check(cluster, tmp_path, "-i", "eth0=200mbit", "-i", "nosuch0=1gbit",
                  "--policy", "nosuch")
    assert done.returncode == 1
    assert _found(done.stdout, "interface nosuch0") == "fail no such interface"
    assert _found(done.stdout, "policy nosuch").startswith("fail unknown policy 'nosuch'")
    assert "would not run as configured: interface nosuch0, policy nosuch" in done.stderr + \
        done.stdout


def test_check_beside_a_running_gradlaned_warns_and_passes(cluster: Cluster,
                                                            tmp_path: Path) -> None:
    daemon, sock = start_daemon(cluster, "h1", tmp_path)
    try:
        done = cluster.run("h1", [sys.executable, "-m", "gradlane.cli", "daemon", "--check",
                                  "-i", "eth0=200mbit", "--socket", str(sock),
                                  "--state-dir", str(tmp_path / "state-h1")], check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _found(done.stdout, "interface eth0").endswith(
            f"a gradlaned (pid {daemon.pid}) manages it now: a second one would refuse to start")
        assert _found(done.stdout, f"socket {sock}").startswith("warn a gradlaned serves it")
        assert _found(done.stdout, "http 127.0.0.1:9464").startswith("warn in use")
    finally:
        assert stop(daemon) == 0


def test_a_second_gradlaned_on_an_interface_refuses_and_leaves_the_first_s_tree(
        cluster: Cluster, tmp_path: Path) -> None:
    """One started by hand beside the service, with a socket, an HTTP port and a state dir
    of its own: it took the running one's tree over as if a crash had left it, the two then
    undid each other's classes, and the one stopping first restored the interface under
    the other. Now it refuses before reading anything; once the first is gone, it starts."""
    daemon, _ = start_daemon(cluster, "h1", tmp_path)
    try:
        before = tc(cluster.ns("h1"), "class", "show", "dev", "eth0")
        second = ["daemon", "-i", "eth0=200mbit", "--socket", str(tmp_path / "second.sock"),
                  "--http", "127.0.0.1:9465", "--state-dir", str(tmp_path / "second-state")]
        done = cluster.run("h1", [sys.executable, "-m", "gradlane.cli", *second], check=False,
                           timeout=30)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"root qdisc on eth0: gradlaned (pid {daemon.pid}) manages it already" in \
            " ".join(done.stderr.split()), done.stderr
        assert tc(cluster.ns("h1"), "class", "show", "dev", "eth0") == before
        assert daemon.poll() is None
    finally:
        assert stop(daemon) == 0
    after, _ = start_daemon(cluster, "h1", tmp_path)  # the claim went with the first
    assert stop(after) == 0


def _metrics(cluster: Cluster) -> str:
    """h1's gradlaned's /metrics."""
    fetch = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9464/metrics').read()" \
            ".decode())"
    return cluster.run("h1", [sys.executable, "-c", fetch]).stdout


def test_an_operators_own_root_is_left_alone_said_and_taken_once_gone(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A root qdisc gradlaned could not put back (a tbf): `--check` fails naming it; the
    daemon serves shims, leaves the interface alone, says so once in its log, in
    `gradlane status` and in /metrics; once the operator removes it, the tree goes in."""
    ns = cluster.ns("h1")
    tc(ns, "qdisc", "add", "dev", "eth0", "root", "handle", "9:", "tbf",
       "rate", "50mbit", "burst", "32kb", "latency", "50ms")  # fmt: skip
    removed = False
    try:
        done = _check(cluster, tmp_path, "-i", "eth0=200mbit")
        assert done.returncode == 1
        assert _found(done.stdout, "interface eth0").startswith("fail line rate 200Mbit")
        assert "root qdisc tbf 9:0 on eth0: installed by someone else" in done.stdout
        daemon, sock = start_daemon(cluster, "h1", tmp_path)
        try:
            client = register(sock, hello([]))  # served: the shims train on, marked
            flows = [{"band": 0, "src": cluster.addr("h1"), "sport": 40100,
                      "dst": cluster.addr("h2"), "dport": 5201}]
            why = status(cluster)["interfaces"][0]["not_shaped"]
            assert why.startswith("root qdisc tbf 9:0 on eth0: installed by someone else"), why
            shown = cluster.run("h1", [sys.executable, "-m", "gradlane.cli", "status"]).stdout
            assert "eth0: not shaped: root qdisc tbf 9:0" in " ".join(shown.split()), shown
            assert 'gradlane_interface_shaped{interface="eth0"} 0.0' in _metrics(cluster)
            assert "tbf 9: root" in tc(ns, "qdisc", "show", "dev", "eth0")
            tc(ns, "qdisc", "del", "dev", "eth0", "root")
            removed = True
            wait_for(lambda: "htb 474c: root" in tc(ns, "qdisc", "show", "dev", "eth0"),
                     "the tree, once the kernel said the tbf went")  # not at 30 s
            client.close()
            client = register(sock, hello(flows))
            wait_for(lambda: "474c:200" in classes(cluster), "the tree and the job's classes")
            assert status(cluster)["interfaces"][0]["not_shaped"] is None
            assert 'gradlane_interface_shaped{interface="eth0"} 1.0' in _metrics(cluster)
            client.close()
        finally:
            daemon.send_signal(signal.SIGTERM)
            log = daemon.communicate(timeout=20)[1]
        assert daemon.returncode == 0
    finally:
        if not removed:
            tc(ns, "qdisc", "del", "dev", "eth0", "root")
    assert "noqueue 0: root" in tc(ns, "qdisc", "show", "dev", "eth0")  # what it found
    assert log.count("eth0 not shaped") == 1 and "Traceback" not in log, log


def test_a_tree_deleted_under_gradlaned_is_rebuilt_at_once_and_the_original_restored(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`tc qdisc del dev eth0 root` under a running gradlaned: the kernel's word of it makes
    gradlaned verify at once (not at its next 30 s verification), rebuilding the tree with
    the job's classes and filters; SIGTERM still restores the operator's pfifo it found."""
    ns = cluster.ns("h1")
    tc(ns, "qdisc", "replace", "dev", "eth0", "root", "handle", "8127:", "pfifo", "limit", "321")
    try:
        original = tc(ns, "qdisc", "show", "dev", "eth0")
        daemon, sock = start_daemon(cluster, "h1", tmp_path)
        try:
            flows = [{"band": b, "src": cluster.addr("h1"), "sport": 40200 + b,
                      "dst": cluster.addr("h2"), "dport": 5201} for b in range(4)]
            client = register(sock, hello(flows))
            wait_for(lambda: filter_prefs(cluster).count(0x100) == 4, "the flows' filters")
            built = (classes(cluster), filter_prefs(cluster))
            tc(ns, "qdisc", "del", "dev", "eth0", "root")
            deleted = time.monotonic()
            wait_for(lambda: (classes(cluster), filter_prefs(cluster)) == built, "the tree again")
            print(f"rebuilt in {time.monotonic() - deleted:.2f} s")
            assert time.monotonic() - deleted < 10  # the periodic verification: 30 s
            client.close()
        finally:
            assert stop(daemon) == 0
        assert tc(ns, "qdisc", "show", "dev", "eth0") == original
    finally:
        tc(ns, "qdisc", "del", "dev", "eth0", "root")
