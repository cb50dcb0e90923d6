"""An emulated cluster on one Linux machine, always cleaned up.

Layout (all in namespaces; nothing is created in the root namespace)::

    gl-<name>-h1 .. gl-<name>-hN       hosts: lo, eth0 10.200.0.i/24 (eth1 10.200.1.i/24)
    gl-<name>-sw                        the fabric: per NIC plane k, bridges b<k>0 (and
                                        b<k>1 for a second leaf), the ports p<k>h<i>
                                        (veth peers of the hosts' eth<k>), IFBs i<k>h<i>
                                        and the leaf uplink u<k>a <-> u<k>b

See `gradlane.testbed.links` for how the link rates and the switch's DSCP
priority queues are emulated.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

from gradlane.errors import GradlaneError, TestbedError
from gradlane.testbed import links
from gradlane.testbed import netns as gl_netns
from gradlane.testbed.forked import Forked, Main, Proc
from gradlane.testbed.topology import Topology

__all__ = ["Cluster", "ns_argv"]

logger = logging.getLogger(__name__)

PREFIX_LEN = 24


def ns_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """An argv that runs `argv` inside `namespace`, ending with this process
    (`gradlane.testbed.nsexec`)."""
    return [sys.executable, "-m", "gradlane.testbed.nsexec", namespace,
            "--parent", str(os.getpid()), "--", *argv]


HostT = TypeVar("HostT", bound=str | int)  # a host as "h3" or 3

DOWN_ATTEMPTS = 5  # how many interruptions `Cluster.down` rides out before giving up


class Cluster:
    """An emulated cluster; a context manager that builds it and always removes it.

    ``with Cluster(Topology.build("demo", 4, "1gbit")) as c: c.run("h1", [...])``

    Hosts are named ``"h1"``..``"hN"`` (or given as 1..N). Processes started
    with `popen` or `fork` are stopped when the cluster goes down, and so is anything
    else still running in its namespaces.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._procs: list[Proc] = []
        # A forked child (pyroute2 forks to enter a namespace) that unwinds
        # this stack must not tear down the parent's cluster.
        self._owner = os.getpid()

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- lifecycle -------------------------------------------------------

    def up(self) -> None:
        """Build the namespaces, links and queues.

        Raises:
            TestbedError: the cluster exists already, or building failed (what
                was built is removed before this is raised).
        """
        taken = [n for n in self.topology.namespaces() if gl_netns.exists(n)]
        if taken:
            raise TestbedError(
                f"cluster {self.topology.name!r} exists already ({', '.join(taken)}): "
                "another run's, or left by one that was killed; if none is running, remove "
                f"it with: gradlane testbed down {self.topology.name}"
            )
        try:
            self._build()
        except BaseException as exc:
            self.down()
            if isinstance(exc, NetlinkError | OSError):
                raise TestbedError(
                    f"building cluster {self.topology.name!r} failed: {exc}"
                ) from exc
            if isinstance(exc, GradlaneError) and not isinstance(exc, TestbedError):
                raise TestbedError(
                    f"building cluster {self.topology.name!r} failed: {exc}"
                ) from exc
            raise
        logger.info("cluster %s is up: %d hosts", self.topology.name, self.topology.hosts)

    def down(self) -> None:
        """Stop every process in the cluster and remove its namespaces. Idempotent.

        Does nothing in a process other than the one that created the cluster.
        A second Ctrl-C (or SIGTERM) that lands while it runs, as when a
        supervisor forwards the signal again, does not stop it half-way: it
        finishes, then the interruption goes on.
        """
        if os.getpid() != self._owner:
            return
        interrupted: BaseException | None = None
        for _ in range(DOWN_ATTEMPTS):
            try:
                self._down_once()
                break
            except (KeyboardInterrupt, SystemExit) as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted

    def _down_once(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        remove_cluster(self.topology.name)

    # -- hosts -----------------------------------------------------------

    def host_index(self, host: str | int) -> int:
        """1-based index of a host given as ``"h3"`` or ``3``."""
        index: object = host
        if isinstance(host, str) and host.startswith("h") and host[1:].isdecimal():
            index = int(host[1:])
        if type(index) is not int or not 1 <= index <= self.topology.hosts:
            raise TestbedError(
                f"no host {host!r} in cluster {self.topology.name!r} "
                f"(hosts are h1..h{self.topology.hosts})"
            )
        return index

    def ns(self, host: str | int) -> str:
        """The namespace of `host`."""
        return self.topology.host_ns(self.host_index(host))

    def addr(self, host: str | int, nic: int = 0) -> str:
        """The address of NIC `nic` of `host`."""
        if not 0 <= nic < self.topology.nics:
            raise TestbedError(f"host {host} has NICs 0..{self.topology.nics - 1}, not {nic}")
        return self.topology.address(self.host_index(host), nic)

    def popen(self, host: str | int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in `host`; it is stopped at the latest when the cluster goes down,
        or when this process ends without taking the cluster down (SIGKILL): start it
        from a thread that outlives it (`gradlane.signals.end_with_parent`)."""
        proc = subprocess.Popen(ns_argv(self.ns(host), argv), **kwargs)
        self._procs.append(proc)
        return proc

    def fork(self, host: str | int, main: Main, argv: Sequence[str], *, env: dict[str, str],
             log: Path) -> Forked:
        """Run ``main(argv)`` in `host` (`main`: a function or its "module:name"), forked
        with torch already imported (`gradlane.testbed.forked`: a script calling this
        keeps its work under ``if __name__ == "__main__":``), `env` its whole
        environment, its output in `log`; stopped as `popen`'s."""
        proc = Forked(main, argv, env, log, namespace=self.ns(host))
        self._procs.append(proc)
        return proc

    def run(
        self,
        host: str | int,
        argv: Sequence[str],
        *,
        timeout: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host` to completion (bounded by `timeout`), capturing text output.

        Raises:
            TestbedError: the command timed out, or failed while `check` is set.
        """
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise TestbedError(f"{list(argv)} in {host} did not finish in {timeout}s") from None
        finally:
            self._procs.remove(proc)
        if check and proc.returncode != 0:
            raise TestbedError(
                f"{list(argv)} in {host} exited with {proc.returncode}: {err.strip()[-2000:]}"
            )
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def start_daemon(
        self,
        host: str | int,
        workdir: Path,
        *,
        rate: str | Sequence[str] | None = None,
        args: Sequence[str] = (),
        timeout: float = 20,
        **popen: Any,
    ) -> tuple[subprocess.Popen[Any], Path]:
        """Run gradlaned on `host`'s NICs (eth0, and eth1 with two) and wait until its
        socket accepts.

        Its socket and state live under `workdir`; `rate`, the line rate it
        shapes under (or one per NIC), defaults to that of the NIC the host's
        link emulates (`links.line_rate`: a little above the emulated rate,
        which counts no framing). It is stopped with the cluster at the latest (SIGTERM,
        so it restores the host's qdisc).

        Raises:
            TestbedError: it exited or did not serve within `timeout`.
        """
        return self.start_daemons([host], workdir, rate=rate, args=args, timeout=timeout,
                                  **popen)[host]

    def start_daemons(
        self,
        hosts: Sequence[HostT],
        workdir: Path,
        *,
        rate: str | Sequence[str] | None = None,
        args: Sequence[str] | Callable[[str], Sequence[str]] = (),
        timeout: float = 20,
        **popen: Any,
    ) -> dict[HostT, tuple[subprocess.Popen[Any], Path]]:
        """`start_daemon` on each of `hosts`, all started before any is waited for; `args`
        the same for every host, or a function of the host's name ("h3").

        Raises:
            TestbedError: one exited or did not serve within `timeout` (those started are
                stopped with the cluster).
        """
        popen.setdefault("stderr", subprocess.PIPE)
        popen.setdefault("text", True)
        started, names = {}, {}
        for host in hosts:
            name = names[host] = f"h{self.host_index(host)}"
            line = str(links.line_rate(self.topology.rates[self.host_index(host) - 1]))
            rates = [rate or line] * self.topology.nics if isinstance(rate, str | None) \
                else list(rate)
            if len(rates) != self.topology.nics:
                raise TestbedError(f"{len(rates)} rates for {self.topology.nics} NICs")
            sock = workdir / f"{name}.sock"
            nics = [arg for k, r in enumerate(rates) for arg in ("-i", f"eth{k}={r}")]
            argv = [sys.executable, "-m", "gradlane.cli", "daemon", *nics,
                    "--socket", str(sock), "--state-dir", str(workdir / f"state-{name}"),
                    "--http", "127.0.0.1:9464",
                    *(args(name) if callable(args) else args)]  # fmt: skip
            started[host] = (self.popen(host, argv, **popen), sock)
        deadline = time.monotonic() + timeout
        waiting = dict(started)
        while waiting:
            for host, (proc, sock) in list(waiting.items()):
                name = names[host]
                try:
                    with socket.socket(socket.AF_UNIX) as probe:
                        probe.connect(str(sock))
                    del waiting[host]
                except OSError:
                    if proc.poll() is not None:
                        _, err = proc.communicate()
                        raise TestbedError(f"gradlaned on {name} exited: {err or ''}"[-2000:]) \
                            from None
                    if time.monotonic() > deadline:
                        raise TestbedError(f"gradlaned on {name} did not serve in {timeout}s") \
                            from None
            if waiting:
                time.sleep(0.05)
        return started

    def set_port(self, host: str | int, up: bool, nic: int = 0) -> None:
        """Take the switch port of `host`'s NIC `nic` down (a cut cable) or bring it back.

        Raises:
            TestbedError: no such host, NIC or port.
        """
        name = f"p{nic}h{self.host_index(host)}"
        if not 0 <= nic < self.topology.nics:
            raise TestbedError(f"hosts have NICs 0..{self.topology.nics - 1}, not {nic}")
        try:
            with IPRoute(netns=self.topology.switch_ns, flags=0, groups=0) as sw:
                sw.link("set", index=_index(sw, name), state="up" if up else "down")
        except NetlinkError as exc:
            raise TestbedError(f"setting port {name} {'up' if up else 'down'}: {exc}") from exc

    # -- building --------------------------------------------------------

    def _build(self) -> None:
        topo = self.topology
        for name in topo.namespaces():
            netns.create(name)
        with IPRoute(netns=topo.switch_ns, flags=0, groups=0) as sw:
            _set_up(sw, "lo")
            for nic in range(topo.nics):
                self._build_plane(sw, nic)
        for host in range(1, topo.hosts + 1):
            with IPRoute(netns=topo.host_ns(host), flags=0, groups=0) as ipr:
                _set_up(ipr, "lo")
                for nic in range(topo.nics):
                    index = _set_up(ipr, f"eth{nic}")
                    ipr.addr(
                        "add", index=index, address=topo.address(host, nic), prefixlen=PREFIX_LEN
                    )

    def _build_plane(self, sw: IPRoute, nic: int) -> None:
        topo = self.topology
        bridges = []
        for leaf in range(topo.leaves):
            name = f"b{nic}{leaf}"
            sw.link("add", ifname=name, kind="bridge")
            bridges.append(_set_up(sw, name))
        if topo.leaves == 2:
            assert topo.uplink_bps is not None
            a, b = f"u{nic}a", f"u{nic}b"
            sw.link("add", ifname=a, kind="veth", peer={"ifname": b})
            for ifname, bridge in ((a, bridges[0]), (b, bridges[1])):
                index = _index(sw, ifname)
                sw.link("set", index=index, master=bridge)
                links.shape_priority_port(sw, index, ifname, topo.uplink_bps, topo.queue_packets)
                _set_up(sw, ifname)
        for host in range(1, topo.hosts + 1):
            rate = topo.rates[host - 1]
            port, ifb = f"p{nic}h{host}", f"i{nic}h{host}"
            sw.link(
                "add",
                ifname=port,
                kind="veth",
                peer={"ifname": f"eth{nic}", "net_ns_fd": topo.host_ns(host)},
            )
            index = _index(sw, port)
            sw.link("set", index=index, master=bridges[topo.leaf_of(host)])
            downlink = int(rate * links.PORT_HEADROOM)
            links.shape_priority_port(sw, index, port, downlink, topo.queue_packets)
            sw.link("add", ifname=ifb, kind="ifb")
            ifb_index = _set_up(sw, ifb)
            links.shape_fifo(sw, ifb_index, ifb, rate, topo.queue_packets)
            links.redirect_ingress(sw, index, port, ifb_index)
            _set_up(sw, port)


def _index(ipr: IPRoute, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise TestbedError(f"link {ifname} vanished while building the cluster")
    return int(found[0])


def _set_up(ipr: IPRoute, ifname: str) -> int:
    index = _index(ipr, ifname)
    ipr.link("set", index=index, state="up")
    return index


def cluster_names() -> list[str]:
    """Names of the clusters whose namespaces exist now."""
    names = set()
    for ns in gl_netns.list_namespaces():
        rest = ns[len("gl-") :]
        if "-" in rest:
            names.add(rest.rsplit("-", 1)[0])
    return sorted(names)


def remove_cluster(name: str) -> list[str]:
    """Remove every namespace of cluster `name` (and what runs there); return them."""
    removed = gl_netns.list_namespaces(f"gl-{name}-")
    # Hosts first: their processes stop before the fabric disappears under them.
    for ns in sorted(removed, key=lambda n: n.endswith("-sw")):
        gl_netns.remove(ns)
    return removed
