"""Network namespaces: enter, find the processes inside, remove, clean up stale ones."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import signal
import time
from pathlib import Path

from pyroute2 import IPRoute, netns

from gradlane.errors import TestbedError
from gradlane.testbed.topology import NS_PREFIX

__all__ = ["clean", "enter", "exists", "list_namespaces", "missing_privileges", "remove"]

logger = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
CAP_SYS_ADMIN = 21  # linux/capability.h


def missing_privileges() -> str | None:
    """What this process lacks to build an emulated cluster, or None: "root", or the
    capabilities a root without them (a container's, say) lacks to make network
    namespaces (CAP_SYS_ADMIN) and their links and qdiscs (CAP_NET_ADMIN)."""
    from gradlane.daemon.preflight import CAP_NET_ADMIN, effective_capabilities

    if os.geteuid() != 0:
        return "root"
    caps = effective_capabilities()
    lacked = [name for name, bit in (("CAP_SYS_ADMIN", CAP_SYS_ADMIN),
                                     ("CAP_NET_ADMIN", CAP_NET_ADMIN)) if not caps >> bit & 1]
    return " and ".join(lacked) or None


def list_namespaces(prefix: str = NS_PREFIX) -> list[str]:
    """Named namespaces (as `ip netns` sees them) whose name starts with `prefix`."""
    return sorted(n for n in netns.listnetns() if n.startswith(prefix))


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def enter(name: str) -> None:
    """Move the calling thread (use only before exec) into namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TestbedError(f"network namespace {name!r} does not exist") from None
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise TestbedError(f"cannot enter network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _identity(name: str) -> tuple[int, int] | None:
    """Namespace `name`'s identity (device, inode), which its processes' /proc/PID/ns/net
    share; None if there is no such namespace."""
    try:
        st = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _pids_in(identity: tuple[int, int]) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue  # gone, or a kernel thread
        if (st.st_dev, st.st_ino) == identity:
            pids.append(int(entry))
    return pids


def _kill_in(identity: tuple[int, int], grace: float = 2.0) -> None:
    """SIGTERM every process in the namespace of `identity`, SIGKILL what remains after
    `grace` s."""
    pids = [p for p in _pids_in(identity) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            break


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove(name: str) -> None:
    """Remove namespace `name`, then kill what runs in it (its links go with the last).

    The name goes first, so that nothing enters by it while its processes are
    looked for (a worker starting at the moment a run is interrupted): what
    entered before is found by the namespace's identity and killed.
    """
    identity = _identity(name)
    if identity is None:
        return
    try:
        netns.remove(name)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise TestbedError(f"cannot remove network namespace {name!r}: {exc}") from exc
    _kill_in(identity)


def clean(prefix: str = NS_PREFIX) -> list[str]:
    """Remove every namespace and root-namespace link named ``gl-*``; return their names."""
    removed = []
    for name in list_namespaces(prefix):
        remove(name)
        removed.append(name)
    with IPRoute(groups=0) as ipr:
        for link in ipr.get_links():
            ifname = link.get_attr("IFLA_IFNAME") or ""
            if ifname.startswith(prefix):
                ipr.link("del", index=link["index"])
                removed.append(f"link {ifname}")
    if removed:
        logger.info("removed %s", ", ".join(removed))
    return removed
