"""The exceptions gradlane raises.

Every error gradlane raises on purpose is a `GradlaneError`; lower layers'
errors (netlink, sockets, subprocesses) are translated at one boundary and
chained (``raise TcError(...) from exc``) so the original stays visible.

    GradlaneError
    ├── ConfigError          bad input: a rate string, a topology, a desired
    │                        qdisc state. Fix the input; nothing was changed.
    ├── ProtocolError        a peer sent a frame or message that breaks the
    │                        shim <-> daemon protocol. Carries a short `code`;
    │                        the daemon answers with it and closes that one
    │                        connection.
    ├── TcError              the kernel refused a traffic-control or link
    │   │                    operation. Carries errno, interface and object.
    │   └── ForeignQdiscError  the interface has a root qdisc that gradlane did
    │                        not install and cannot restore exactly. Remove it
    │                        or pick another interface; gradlane left it alone.
    └── TestbedError         the emulated cluster could not be built, a command
                             in a host failed, or a measurement did not finish.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "ConfigError",
    "ProtocolError",
    "ForeignQdiscError",
    "GradlaneError",
    "TcError",
    "TestbedError",
]


class GradlaneError(Exception):
    """Root of every error gradlane raises on purpose."""


class ConfigError(GradlaneError, ValueError):
    """Raised when an input value is invalid; the message names the value.

    Nothing was changed on the system. Correct the value and try again.
    """


class ProtocolError(GradlaneError):
    """Raised when a frame or message breaks the shim <-> daemon protocol.

    Attributes:
        code: a short machine-readable kind ("bad_frame", "bad_message",
            "version", "order", "too_big", "limit"), used in error replies and
            the daemon's error metrics.

    The peer is at fault: fix the sender. The daemon closes only that
    connection; a shim reconnects with a fresh hello.
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class TcError(GradlaneError):
    """Raised when the kernel refuses a traffic-control or link operation.

    Attributes:
        errno: the kernel's error number (branch on this, never on text).
        ifname: the interface concerned ("" when none).
        obj: what was being changed, e.g. "class 474c:101" or "root qdisc".
        detail: the kernel's extended-ack text, when it sent one.

    What to do depends on `errno`: EPERM means CAP_NET_ADMIN is missing,
    ENODEV that the interface vanished, ENOENT/EINVAL usually a kernel without
    the needed qdisc or classifier (see README, "Kernel requirements").
    """

    def __init__(self, errno: int, ifname: str, obj: str, detail: str = "") -> None:
        self.errno = errno
        self.ifname = ifname
        self.obj = obj
        self.detail = detail
        name = _errno.errorcode.get(errno, str(errno))
        text = detail or os.strerror(errno)
        where = f" on {ifname}" if ifname else ""
        super().__init__(f"{obj}{where}: {text} ({name})")


class ForeignQdiscError(TcError):
    """Raised when an interface's root qdisc is not one gradlane can restore.

    gradlane restores the kernel's default root qdisc, and pfifo/bfifo roots,
    exactly. Anything else (an operator's own HTB tree, tbf, ...) is left
    untouched: remove it first (``tc qdisc del dev IF root``) if gradlane should
    own the interface.
    """


class TestbedError(GradlaneError):
    """Raised when the emulated cluster cannot be built or used.

    The message says which namespace, link or command failed. The testbed has
    already removed what it had created when this reaches you.
    """

    __test__ = False  # not a pytest test class despite the name
