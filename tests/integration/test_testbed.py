"""The emulated cluster: reachability, link rates, switch priority, topologies, clean-up."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradlane.testbed import Cluster, Topology, remove_cluster
from gradlane.testbed import netns as gl_netns
from gradlane.testbed.forked import Forked
from gradlane.testbed.traffic import Flow, run_flows, steady_goodputs
from tests import REPO
from tests.integration.helpers import max_goodput, tc
from tests.terminal import on_a_terminal, read_until

pytestmark = pytest.mark.netns
M = 1_000_000
GRADLANE = [sys.executable, "-m", "gradlane.cli"]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line}


def test_hosts_reach_each_other_and_nothing_else() -> None:
    with Cluster(Topology.build("treach", 3, "200mbit")) as c:
        (r,) = run_flows(c, [Flow("h1", "h3", nbytes=100_000, label="x")])
        assert r.bytes == 100_000
        routes = subprocess.run(
            ["ip", "-n", c.ns("h1"), "-4", "route", "show"], capture_output=True, text=True
        ).stdout
        assert routes.split()[0] == "10.200.0.0/24" and "default" not in routes
        assert len(routes.strip().splitlines()) == 1
        # the switch lives in its own namespace, not the root one
        root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "p0h1" not in root_links and "b00" not in root_links
    assert not {n for n in namespaces() if n.startswith("gl-treach-")}


def test_the_bands_marks_cross_the_switch_both_ways() -> None:
    """`gradlane probe` between two hosts: the emulated switch (which queues by DSCP)
    leaves the marks as they are, as a switch with DSCP priority queues must."""
    with Cluster(Topology.build("tprobe", 2, "200mbit")) as c:
        server = c.popen("h2", [*GRADLANE, "probe", "--serve", "--seconds", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = None
        for _ in range(50):  # until the server has bound its port (bounded: 5 s)
            done = c.run("h1", [*GRADLANE, "probe", c.addr("h2"), "--count", "3"], check=False)
            if done.returncode == 0 or "no answer" not in done.stderr:
                break
            time.sleep(0.1)
        server.terminate()
        server.communicate(timeout=10)
        assert done is not None and done.returncode == 0, done.stdout + done.stderr
        for band, dscp in enumerate((46, 34, 26, 18)):
            assert (f"ok    band {band} (DSCP {dscp}): 3 of 3 answered, there DSCP {dscp} kept, "
                    f"back DSCP {dscp} kept") in done.stdout


def test_host_rate_is_enforced_both_ways_with_heterogeneous_hosts() -> None:
    # h1 at 100 Mbit/s, h2 at 200, h3 at 300: h1's link is the bottleneck both ways,
    # h2's from h2 to h3 (each host its own rate, not a neighbour's).
    with Cluster(Topology.build("trate", 3, "100mbit,200mbit,300mbit")) as c:
        (up,) = steady_goodputs(run_flows(c, [Flow("h1", "h2", seconds=3, label="up")]))
        (down,) = steady_goodputs(run_flows(c, [Flow("h3", "h1", seconds=3, label="down")]))
        (mid,) = steady_goodputs(run_flows(c, [Flow("h2", "h3", seconds=3, label="mid")]))
    assert 85 * M <= up <= 105 * M, up
    assert 85 * M <= down <= 105 * M, down
    assert 170 * M <= mid <= 210 * M, mid


def test_switch_port_serves_dscp_high_first_under_incast() -> None:
    # h1 (EF) and h3 (unmarked AF21-less: DSCP 8, CS1) send to h2 at once.
    with Cluster(Topology.build("tincast", 3, "200mbit")) as c:
        high, low = steady_goodputs(
            run_flows(
                c,
                [
                    Flow("h3", "h2", dscp=8, seconds=5, label="low"),
                    Flow("h1", "h2", dscp=46, seconds=4, label="high", delay=0.5),
                ],
            )
        )[::-1]
    assert high >= 0.85 * 200 * M, (high, low)
    assert low < 0.1 * high


_SEND_BY_CLASS = """
import socket, sys, time
counts = {counts!r}
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.sendto(b"x", (sys.argv[1], 9))  # the address resolved before anything is counted
    time.sleep(0.5)
    for selector, n in counts.items():
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, selector << 5)
        for _ in range(n):
            s.sendto(b"x", (sys.argv[1], 9))
"""


def htb_classes(namespace: str, dev: str) -> dict[str, tuple[int | None, int]]:
    """Each HTB class of `dev`: its prio (None for an inner class) and packets sent."""
    classes = {}
    for block in tc(namespace, "-s", "class", "show", "dev", dev).split("class htb ")[1:]:
        prio = re.search(r" prio (\d+) ", block)
        sent = re.search(r"Sent \d+ bytes (\d+) pkt", block)
        assert sent is not None, block
        classes[block.split()[0]] = (prio and int(prio.group(1)), int(sent.group(1)))
    return classes


def test_a_switch_port_has_a_queue_per_class_selector_served_from_cs7_down() -> None:
    """Packets of each DSCP class selector go to a queue of their own on the switch
    port (CS0's also takes what is not IPv4, such as ARP), and HTB serves the queues
    in strict order, CS7 first; the incast test above shows that order in action.

    Each class's packets are told apart by their number, 4 apart. CS0's queue carries
    whatever else the hosts send (ARP, IPv6); another may carry up to 3 more of the
    hosts' own (CS6: IGMP reports)."""
    counts = {selector: 4 * (selector + 1) for selector in range(8)}
    with Cluster(Topology.build("tqueue", 2, "100mbit")) as c:
        c.run("h1", [sys.executable, "-c", _SEND_BY_CLASS.format(counts=counts), c.addr("h2")])
        classes = htb_classes(c.topology.switch_ns, "p0h2")
    queues = [classes[f"1:{0x10 + selector:x}"] for selector in range(8)]
    assert queues[0][1] >= counts[0], classes  # the default queue: anything else too
    for selector, (_, sent) in enumerate(queues[1:], start=1):
        assert counts[selector] <= sent <= counts[selector] + 3, (selector, classes)
    prios = [prio for prio, _ in queues]
    assert prios == sorted(prios, reverse=True) and len(set(prios)) == 8, classes


def test_two_tier_cross_leaf_goodput_is_bounded_by_the_uplink() -> None:
    topo = Topology.build("ttier", 4, "200mbit", leaves=2, uplink="100mbit")
    with Cluster(topo) as c:
        (same_leaf,) = steady_goodputs(run_flows(c, [Flow("h1", "h2", seconds=3, label="s")]))
        (cross,) = steady_goodputs(run_flows(c, [Flow("h1", "h3", seconds=3, label="x")]))
    assert same_leaf >= 0.9 * max_goodput(200 * M), same_leaf
    assert 85 * M <= cross <= 105 * M, cross


def test_second_nic_is_an_independent_path() -> None:
    with Cluster(Topology.build("tnic", 2, "100mbit", nics=2)) as c:
        nic0, nic1 = steady_goodputs(
            run_flows(
                c,
                [
                    Flow("h1", "h2", seconds=3, label="nic0", nic=0),
                    Flow("h1", "h2", seconds=3, label="nic1", nic=1),
                ],
            )
        )
    # each gets a whole 100 Mbit/s link: together more than one link could carry
    assert nic0 >= 85 * M and nic1 >= 85 * M, (nic0, nic1)


_KNOCK = """
import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    try:
        s.connect((sys.argv[1], 9))
    except ConnectionRefusedError:
        sys.exit(0)  # the host answered (nothing listens there)
    except OSError:
        sys.exit(1)
"""


def answers(c: Cluster, host: str, nic: int) -> bool:
    """Whether h1 hears back from NIC `nic` of `host` (a refused connection is an answer)."""
    argv = [sys.executable, "-c", _KNOCK, c.addr(host, nic)]
    return c.run("h1", argv, check=False).returncode == 0


def test_a_cut_cable_parts_a_host_on_that_nic_until_its_port_is_back() -> None:
    with Cluster(Topology.build("tport", 2, "100mbit", nics=2)) as c:
        assert answers(c, "h2", 0) and answers(c, "h2", 1)
        c.set_port("h2", up=False, nic=1)
        assert answers(c, "h2", 0) and not answers(c, "h2", 1)
        c.set_port(2, up=True, nic=1)
        assert any(answers(c, "h2", 1) for _ in range(5))  # in a moment, or 5 s at most
        c.set_port("h1", up=False)  # NIC 0 unless told
        assert not answers(c, "h2", 0) and answers(c, "h2", 1)


def forked_main(argv: list[str]) -> None:
    """Run forked in a host by the next test: says where it runs and with what environment,
    then does as `argv[1]` asks."""
    with socket.socket() as s:
        try:
            s.bind((argv[2], 0))  # only this host has its address
            bound = True
        except OSError:
            bound = False
    Path(argv[0]).write_text(json.dumps({"bound": bound, "env": dict(os.environ)}))
    print(f"asked to {argv[1]}", flush=True)  # to the log, as what goes to stderr
    if argv[1] == "raise":
        raise RuntimeError("asked to fail")
    if argv[1] == "sleep":
        time.sleep(60)


def test_a_forked_worker_runs_in_its_host_with_its_environment_and_goes_with_the_cluster(
    tmp_path: Path,
) -> None:
    with Cluster(Topology.build("tfork", 2, "100mbit")) as c:
        def fork(host: str, what: str) -> Forked:
            return c.fork(host, forked_main, [str(tmp_path / f"{what}.json"), what, c.addr("h2")],
                          env={"ONLY": what}, log=tmp_path / f"{what}.log")

        there, elsewhere = fork("h2", "return"), fork("h1", "raise")
        sleeper = c.fork("h2", "tests.integration.test_testbed:forked_main",
                         [str(tmp_path / "sleep.json"), "sleep", c.addr("h2")],
                         env={}, log=tmp_path / "sleep.log")
        assert there.wait(timeout=60) == 0, there.output()
        assert there.output() == "asked to return\n"
        assert json.loads((tmp_path / "return.json").read_text()) == {
            "bound": True, "env": {"ONLY": "return"}}
        assert elsewhere.wait(timeout=60) == 1
        assert "RuntimeError: asked to fail" in elsewhere.communicate()[1]
        assert json.loads((tmp_path / "raise.json").read_text())["bound"] is False
        deadline = time.monotonic() + 60
        while not (tmp_path / "sleep.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.poll() is None
    assert sleeper.returncode == -signal.SIGTERM


def test_cli_up_run_down() -> None:
    up = subprocess.run([*GRADLANE, "testbed", "up", "tcli", "--hosts", "2", "--rate",
                         "1gbit,500mbit"], capture_output=True, text=True, timeout=30, check=True)
    try:
        rows = [line.replace("│", " ").split() for line in up.stdout.splitlines()
                if line.startswith("│")]
        assert rows == [["h1", "gl-tcli-h1", "0", "1Gbit", "10.200.0.1"],
                        ["h2", "gl-tcli-h2", "0", "500Mbit", "10.200.0.2"]]
        listed = subprocess.run(
            [*GRADLANE, "testbed", "list"], capture_output=True, text=True, check=True
        ).stdout
        assert "tcli" in listed.split()
        out = subprocess.run(
            [*GRADLANE, "testbed", "run", "tcli", "h2", "--", "ip", "-o", "-4", "addr", "show"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        assert "10.200.0.2/24" in out and "10.200.0.1/" not in out
        for cluster, host, said in (("tcli", "h3", "cluster 'tcli' has no host 'h3' (its "
                                     "hosts: h1, h2)"),
                                    ("nosuch", "h1", "no cluster named 'nosuch'")):
            out = subprocess.run([*GRADLANE, "testbed", "run", cluster, host, "--", "true"],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 1 and said in out.stderr, out.stderr
        out = subprocess.run([*GRADLANE, "testbed", "run", "tcli", "h1", "--", "/nonexistent/x"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 1
        assert "cannot run '/nonexistent/x': No such file or directory" in out.stderr
    finally:
        subprocess.run([*GRADLANE, "testbed", "down", "tcli"], check=True, timeout=30)
    assert not {n for n in namespaces() if n.startswith("gl-tcli-")}


def test_down_of_unknown_cluster_is_a_clear_error() -> None:
    out = subprocess.run(
        [*GRADLANE, "testbed", "down", "nosuch"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0 and "no cluster named 'nosuch'" in out.stderr


def test_smoke_shows_band_0_taking_the_link_under_gradlane_s_tree_and_leaves_nothing(
) -> None:
    # The command a new user runs to see the mechanism: a DSCP-high flow joins a bulk
    # DSCP-low one, through the NIC's FIFO and then through gradlane's tree (HTB band 0
    # over band 3, as gradlaned builds it).
    done = subprocess.run([*GRADLANE, "testbed", "smoke", "--name", "tsmk", "--seconds", "2"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"}, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:5]]
            for line in done.stdout.splitlines() if line.count("│") == 5}
    assert set(rows) == {"host default (NIC FIFO)", "gradlane tree (band 0 / band 3)"}, rows
    high, low, share = rows["gradlane tree (band 0 / band 3)"]
    assert high.endswith("bit/s") and low.endswith("bit/s")
    assert float(share.rstrip("%")) >= 90, rows  # strict priority, not a fair share
    assert not {n for n in namespaces() if n.startswith("gl-tsmk-")}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_a_run_cleans_up(sig: signal.Signals) -> None:
    name = f"tsig{sig.value}"
    proc = subprocess.Popen(
        [*GRADLANE, "testbed", "smoke", "--name", name, "--seconds", "10"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Ctrl-C as from a terminal: a suite started in the background (`make test &`)
        # has SIGINT ignored, and a child that inherits that rightly keeps ignoring it.
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 20
        while not any(n.startswith(f"gl-{name}-") for n in namespaces()):
            assert time.monotonic() < deadline and proc.poll() is None, "cluster never came up"
            time.sleep(0.05)
        time.sleep(1.5)  # let the traffic processes start
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not {n for n in namespaces() if n.startswith(f"gl-{name}-")}
    leftover = subprocess.run(
        ["pgrep", "-f", "gradlane.testbed.traffic"], capture_output=True, text=True
    ).stdout
    assert leftover == "", "traffic processes survived the clean-up"


def test_a_hang_up_during_a_run_cleans_up() -> None:
    """The run's terminal goes away (an ssh connection drops) while its cluster carries
    traffic and its spinner writes to the terminal: it unwinds as on Ctrl-C and leaves
    nothing behind."""
    name = "thup"
    proc, master = on_a_terminal(
        [*GRADLANE, "testbed", "smoke", "--name", name, "--seconds", "10"])
    try:
        read_until(master, proc, lambda _: any(n.startswith(f"gl-{name}-")
                                               for n in namespaces()), timeout=20)
        settled = time.monotonic() + 1.5  # the traffic processes start meanwhile
        read_until(master, proc, lambda _: time.monotonic() > settled, timeout=5)
    finally:
        os.close(master)  # the hang-up
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            left = remove_cluster(name)
    assert proc.returncode == 128 + signal.SIGHUP  # unwound, not killed by the signal
    assert not left
    leftover = subprocess.run(
        ["pgrep", "-f", "gradlane.testbed.traffic"], capture_output=True, text=True
    ).stdout
    assert leftover == "", "traffic processes survived the clean-up"


_SLEEPING_TEST = """
import time
from gradlane.testbed import Cluster, Topology

def test_holds_a_cluster():
    with Cluster(Topology.build("tterm", 2, "100mbit")) as c:
        c.popen("h1", ["sleep", "61.5"])
        time.sleep(60)
"""


def test_sigterm_to_the_test_suite_cleans_up(tmp_path: Path) -> None:
    """A CI timeout's SIGTERM to pytest: the running test's cluster goes, and its processes."""
    (tmp_path / "test_sleeper.py").write_text(_SLEEPING_TEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-c", "/dev/null",
         "--rootdir", str(tmp_path), str(tmp_path / "test_sleeper.py")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith("gl-tterm-") for n in namespaces()):
            assert time.monotonic() < deadline and proc.poll() is None, "cluster never came up"
            time.sleep(0.05)
        time.sleep(0.5)  # the sleeper starts in h1
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = remove_cluster("tterm")  # what the run left, removed even when this test fails
    assert proc.returncode != 0, out
    assert not left, out
    assert "KeyboardInterrupt" in out, out
    leftover = subprocess.run(["pgrep", "-f", "sleep 61.5"], capture_output=True, text=True)
    assert leftover.stdout == "", "the test's process in h1 survived"


_KILLED_CALLER = """
import json, sys, time
from pathlib import Path
from gradlane.testbed import Cluster, Topology
from gradlane.testbed import forked

def sleeper(argv):
    time.sleep(60)

if __name__ == "__main__":
    forked._SERVER.set_forkserver_preload([])  # no torch to import: seconds sooner
    with Cluster(Topology.build("tkill", 2, "100mbit")) as c:
        started = c.popen("h1", ["sleep", "60"])
        forked = c.fork("h2", sleeper, [], env={}, log=Path(sys.argv[1]))
        print(json.dumps([started.pid, forked.pid]), flush=True)
        time.sleep(60)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigkilled_caller_takes_the_processes_it_started_in_hosts_with_it(
        tmp_path: Path) -> None:
    """SIGKILL cannot be caught: the namespaces stay (for `gradlane testbed clean`), but
    what the caller started in them, through `popen` or `fork`, does not run on."""
    (tmp_path / "caller.py").write_text(_KILLED_CALLER)
    # Its temporary files in the test's directory: a SIGKILL leaves multiprocessing's (the
    # fork server's socket) behind, which pytest removes there and nobody would in /tmp.
    proc = subprocess.Popen([sys.executable, str(tmp_path / "caller.py"), str(tmp_path / "f.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the script sleeps 60 s at most
        assert line, proc.stdout.read()
        pids = json.loads(line)
        assert all(_running(pid) for pid in pids)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = [pid for pid in pids if _running(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        left = remove_cluster("tkill")  # the namespaces a SIGKILL leaves (and their processes)
    assert not running, f"still running after their caller was killed: {running}"
    assert left == ["gl-tkill-h1", "gl-tkill-h2", "gl-tkill-sw"]


def test_nothing_enters_a_namespace_while_it_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process entering a namespace just after `remove` looked for the processes in it
    (a worker starting the moment a run is interrupted) finds the namespace gone, rather
    than running on in it unseen."""
    name = "gl-tlate-h1"
    subprocess.run(["ip", "netns", "add", name], check=True)
    late: list[subprocess.Popen[bytes]] = []
    scan = gl_netns._pids_in

    def scan_then_a_late_entrant(identity: tuple[int, int]) -> list[int]:
        pids = scan(identity)
        if not late:
            late.append(subprocess.Popen(["ip", "netns", "exec", name, "sleep", "61.7"],
                                         stderr=subprocess.DEVNULL))
            time.sleep(0.5)  # it is in by now, if it could enter
        return pids

    monkeypatch.setattr(gl_netns, "_pids_in", scan_then_a_late_entrant)
    try:
        gl_netns.remove(name)
        assert late, "remove did not look for the namespace's processes"
        assert late[0].wait(timeout=10) != 0  # could not enter
    finally:
        for proc in late:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if name in namespaces():
            subprocess.run(["ip", "netns", "del", name])
    assert name not in namespaces()


_GRACEFUL = """
import pathlib, signal, sys, time
def finish(*_):
    time.sleep(0.3)  # finishing up, as a gradlaned restores its qdiscs
    pathlib.Path(sys.argv[1]).write_text("finished")
    sys.exit(0)
signal.signal(signal.SIGTERM, finish)
print("ready", flush=True)
time.sleep(60)
"""
_STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def test_removing_a_namespace_lets_its_processes_finish_then_kills_the_rest(
        tmp_path: Path) -> None:
    """SIGTERM first, and a grace to finish in (a gradlaned restores its qdiscs then),
    nothing else meanwhile; then SIGKILL to what still runs."""
    name = "gl-tgrace-h1"
    subprocess.run(["ip", "netns", "add", name], check=True)
    procs: list[subprocess.Popen[str]] = []
    try:
        for script in (_GRACEFUL, _STUBBORN):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, "-c", script,
                 str(tmp_path / "finished")], stdout=subprocess.PIPE, text=True))
            assert procs[-1].stdout is not None
            assert procs[-1].stdout.readline() == "ready\n"  # bounded: each sleeps 60 s
        gl_netns.remove(name)
        codes = [proc.wait(timeout=10) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        if name in namespaces():
            subprocess.run(["ip", "netns", "del", name])
    assert (tmp_path / "finished").read_text() == "finished"
    assert codes == [0, -signal.SIGKILL]


def test_clean_removes_stale_namespaces_and_their_processes() -> None:
    subprocess.run(["ip", "netns", "add", "gl-tstale-h1"], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", "gl-tstale-h1", "sleep", "60"])
    try:
        out = subprocess.run(
            [*GRADLANE, "testbed", "clean"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert "gl-tstale-h1" in out
        assert sleeper.wait(timeout=10) != 0  # killed
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        if "gl-tstale-h1" in namespaces():
            subprocess.run(["ip", "netns", "del", "gl-tstale-h1"])
    assert "gl-tstale-h1" not in namespaces()
    assert os.path.exists("/run/netns/gl-tstale-h1") is False
