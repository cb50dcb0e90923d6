"""``gradlaned --check``: will gradlaned run on this node with this configuration?

What a platform engineer runs before enabling the service on a node (or in a
rollout's first step): every check says what it found, and the command fails
if any would stop gradlaned or leave it without effect. Nothing on the host
changes: the interfaces' qdiscs are read, not touched; the kernel's HTB and
u32 are tried on a scratch veth pair that is never up (``gl-chk<pid>``,
removed on success, failure and Ctrl-C; `gradlane testbed clean` removes
one a killed check left); the HTTP port is bound and released at once, and
where the socket and the state go, a scratch directory is made and removed.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import resource
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from gradlane.daemon.config import DaemonConfig
from gradlane.daemon.qdisc import FlowMatch, JobSpec, QdiscManager, QdiscSpec, claim_holder
from gradlane.errors import GradlaneError
from gradlane.openfiles import Room, room_for
from gradlane.units import format_rate

__all__ = ["CAP_NET_ADMIN", "Finding", "preflight", "scratch_veth", "why_unwritable"]

CAP_NET_ADMIN = 12  # linux/capability.h
SCRATCH_PREFIX = "gl-chk"  # `gradlane testbed clean` removes root-namespace links named gl-*
OK, WARN, FAIL = "ok", "warn", "fail"
IFF_LOOPBACK = 0x8  # a link's flags (<linux/if.h>)


@dataclass(frozen=True)
class Finding:
    """One check: what was checked, how it came out (ok, warn, fail) and what was found."""

    check: str
    level: str
    detail: str


def preflight(config: DaemonConfig, *, capabilities: int | None = None) -> list[Finding]:
    """Every check, in order; a `FAIL` among them means gradlaned would not start, or would
    start without effect. `capabilities`: the effective capability mask (None: this
    process's)."""
    caps = effective_capabilities() if capabilities is None else capabilities
    admin = bool(caps >> CAP_NET_ADMIN & 1)
    findings = [Finding("privileges", OK if admin else FAIL,
                        "CAP_NET_ADMIN held" if admin else
                        "no CAP_NET_ADMIN: run as root (the systemd unit grants it)")]
    findings += [_interface(config, i.name, i.rate_bps) for i in config.interfaces]
    findings.append(_kernel() if admin else Finding(
        "kernel: HTB and u32", WARN, "not tried without CAP_NET_ADMIN"))
    findings += [_socket(config), _open_files(config.max_clients), _state_dir(config.state_dir),
                 _policy(config.policy)]
    if config.http:
        findings.append(_http(config.http_address))
    if config.control_url:
        findings.append(_control(config))
    return findings


def effective_capabilities() -> int:
    """This process's effective capability mask (/proc/self/status CapEff; 0 if unreadable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def _interface(config: DaemonConfig, name: str, rate_bps: int) -> Finding:
    check = f"interface {name}"
    with IPRoute(groups=0) as ipr:
        found = ipr.link_lookup(ifname=name)
        if not found:
            return Finding(check, FAIL, "no such interface")
        link = ipr.get_links(found[0])[0]
        state = str(link.get_attr("IFLA_OPERSTATE"))
        loopback = bool(link["flags"] & IFF_LOOPBACK)
        addresses = [a.get_attr("IFA_ADDRESS")
                     for a in ipr.get_addr(index=found[0], family=socket.AF_INET)]
    shaped = format_rate(int(rate_bps * config.shape_fraction))
    parts = [f"line rate {format_rate(rate_bps)}, shaped to {shaped}",
             f"IPv4 {', '.join(addresses)}" if addresses else
             "no IPv4 address: the shims' flows (IPv4) cannot leave by it"]
    level = OK if addresses else WARN
    if state not in ("UP", "UNKNOWN"):
        level = WARN
        parts.append(f"link {state.lower()}")
    if loopback:  # the shims' flows between hosts never leave by it
        level = WARN
        parts.append("loopback: shaped, it would slow every connection within this host")
    try:
        with QdiscManager(name, state_file=config.state_dir / f"qdisc-{name}.json") as manager:
            root = manager.root()
    except GradlaneError as exc:
        return Finding(check, FAIL, f"reading its qdiscs failed: {exc}")
    if root.foreign is not None:  # gradlaned would run but leave this interface unshaped
        return Finding(check, FAIL, "; ".join([*parts, str(root.foreign)]))
    holder = claim_holder(name)
    if holder is not None:
        who = f"a gradlaned (pid {holder})" if holder else "a gradlaned"
        return Finding(check, WARN, "; ".join(
            [*parts, f"{who} manages it now: a second one would refuse to start"]))
    if root.ours:
        then = "takes it over" if config.on_start == "takeover" else "restores it first"
        parts.append(f"holds a gradlane tree (a running gradlaned's, or one a crash left: "
                     f"gradlaned {then}, daemon.on_start)")
    else:
        parts.append(f"root qdisc {root.kind or '(none)'}: gradlaned replaces it and "
                     "puts it back when it stops")
    return Finding(check, level, "; ".join(parts))


@contextlib.contextmanager
def scratch_veth(name: str) -> Iterator[str]:
    """A veth pair `name` / `name`p in this namespace, never up, deleted on the way out."""
    with IPRoute(groups=0) as ipr:
        ipr.link("add", ifname=name, kind="veth", peer={"ifname": f"{name}p"})
        try:
            yield name
        finally:
            with contextlib.suppress(NetlinkError, IndexError):
                ipr.link("del", index=ipr.link_lookup(ifname=name)[0])


def _kernel() -> Finding:
    """Build and remove the tree gradlaned builds (a job, its bands, a registered flow, the
    DSCP fallbacks) on a scratch veth, with gradlaned's own code."""
    check = "kernel: HTB and u32"
    name = f"{SCRATCH_PREFIX}{os.getpid() % 100_000}"
    spec = QdiscSpec(rate_bps=950_000_000, other_rate_bps=47_500_000, dscp_job="check",
                     jobs=(JobSpec("check", 100_000_000, 950_000_000, flows=(
                         FlowMatch(0, "10.0.0.1", 40000, "10.0.0.2", 29500),)),))
    try:
        with tempfile.TemporaryDirectory(prefix="gradlane-check-") as tmp, \
                scratch_veth(name), \
                QdiscManager(name, state_file=Path(tmp) / "qdisc.json") as manager:
            manager.apply(spec)
            # Read back: a kernel that kept less than it was sent gets the difference again.
            missing = manager.apply(spec, verify=True)
            classes = len(manager.class_stats())
            manager.restore()
    except (GradlaneError, NetlinkError, OSError) as exc:
        hint = (f"a {name} left by a killed check? `gradlane testbed clean` removes it"
                if getattr(exc, "code", None) == errno.EEXIST else
                "kernel modules sch_htb and cls_u32?")
        return Finding(check, FAIL, f"building gradlaned's tree on a scratch veth failed: "
                                    f"{exc} ({hint})")
    if missing:
        return Finding(check, FAIL, f"the kernel did not keep gradlaned's tree: read back, it "
                                    f"lacked {'; '.join(missing)}")
    return Finding(check, OK, f"built {classes} HTB classes with u32 filters on a scratch veth, "
                              "then removed it")


def _socket(config: DaemonConfig) -> Finding:
    path = config.socket_path
    check = f"socket {path}"
    if config.socket_group:
        try:
            grp.getgrnam(config.socket_group)
        except KeyError:
            return Finding(check, FAIL, f"no group {config.socket_group!r} (daemon.socket_group)")
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except OSError:
                return Finding(check, OK, "a stale socket: gradlaned replaces it")
        return Finding(check, WARN, "a gradlaned serves it now: a second one would refuse "
                                    "to start")
    why = why_unwritable(path.parent)
    if why:
        return Finding(check, FAIL, f"cannot create it: {why}")
    return Finding(check, OK, "can be created" + (
        f", for group {config.socket_group}" if config.socket_group else ""))


def _open_files(clients: int, room: Room | None = None,
                under_systemd: bool | None = None) -> Finding:
    """Whether gradlaned could raise its soft open-file limit to take `clients` shims, a
    file each (`gradlane.daemon.service`): by this process's limits, which are gradlaned's
    when systemd runs the check (``ExecStartPre=``), else this shell's (a service has its
    unit's ``LimitNOFILE=``, systemd's default hard limit 524,288)."""
    check = "open files"
    room = room_for(clients) if room is None else room
    if room is None:
        return Finding(check, WARN, "no /proc/self/fd to count open files by: not checked")
    ours = (os.environ.get("INVOCATION_ID") is not None if under_systemd is None
            else under_systemd)  # systemd sets it for a unit's processes
    whose = "this unit's" if ours else "this shell's"
    hard = "unlimited" if room.hard == resource.RLIM_INFINITY else f"{room.hard:,}"
    said = (f"daemon.max_clients = {clients:,} needs about {room.needed:,} open files; "
            f"{whose} hard limit is {hard}")
    if room.fits_hard:
        return Finding(check, OK, said + ("" if ours else
                                          " (a service: its unit's LimitNOFILE= counts)"))
    if ours:
        return Finding(check, FAIL, f"{said}: gradlaned would refuse to start; raise "
                                    "LimitNOFILE= or lower daemon.max_clients")
    return Finding(check, WARN, f"{said}: gradlaned started from it would refuse; as a "
                                "service its unit's LimitNOFILE= counts (systemd's default "
                                "hard limit is 524,288)")


def _state_dir(path: Path) -> Finding:
    check = f"state dir {path}"
    why = why_unwritable(path)
    if why:
        return Finding(check, FAIL, f"{why}: the original qdiscs could not be recorded")
    return Finding(check, OK, "writable" if path.is_dir() else "can be created")


def why_unwritable(directory: Path) -> str | None:
    """Why `directory` could not be made (with its parents) and written in, or None.

    Tried rather than judged from modes, which root passes by (a read-only mount, /proc or
    a file on the way says no only when tried): a scratch directory, made in the deepest
    one that exists and removed at once.
    """
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradlane-check-", dir=existing))
    except OSError as exc:
        return f"{existing} is not writable ({exc.strerror})"
    return None


def _policy(name: str) -> Finding:
    from gradlane.policies import get_policy

    try:
        get_policy(name)
    except GradlaneError as exc:
        return Finding(f"policy {name}", FAIL, str(exc))
    return Finding(f"policy {name}", OK, "found")


def _http(address: tuple[str, int] | None) -> Finding:
    assert address is not None
    host, port = address
    check = f"http {host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = "in use (a running gradlaned's?)" if exc.errno == errno.EADDRINUSE else str(exc)
            return Finding(check, WARN if exc.errno == errno.EADDRINUSE else FAIL, why)
    return Finding(check, OK, "free")


def _control(config: DaemonConfig,
             opener: Callable[..., AbstractContextManager[Any]] = urllib.request.urlopen
             ) -> Finding:
    from gradlane.daemon.control import read_token, token_exposed

    url = str(config.control_url).rstrip("/")
    check = f"control plane {url}"
    headers = {}
    if config.control_token_file is not None:
        try:
            headers["Authorization"] = f"Bearer {read_token(config.control_token_file, warn=False)}"
        except GradlaneError as exc:
            return Finding(check, FAIL, str(exc))
    try:
        with opener(urllib.request.Request(f"{url}/api/v1/cluster", headers=headers),
                    timeout=5):
            pass
    except urllib.error.HTTPError as exc:
        why = "refused the token" if exc.code in (401, 403) else f"answered {exc.code}"
        return Finding(check, FAIL, why)
    except (urllib.error.URLError, OSError) as exc:
        return Finding(check, WARN, f"no answer ({exc}): gradlaned runs on its local policy "
                                    "until the control plane is up")
    exposed = config.control_token_file and token_exposed(config.control_token_file)
    if exposed:
        return Finding(check, WARN, f"answers and takes the token; but {exposed}")
    return Finding(check, OK, "answers and takes the token")
