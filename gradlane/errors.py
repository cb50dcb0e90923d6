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
    ├── TestbedError         the emulated cluster could not be built, a command
    │                        in a host failed, or a measurement did not finish.
    └── TransportError       the shim's worker-to-worker transport failed:
        │                    rendezvous, a connection, or a malformed frame.
        ├── ModelMismatch    workers attached different models or settings.
        │                    Nothing was sent; make every rank build the same
        │                    model and pass the same options.
        └── PeerLost         a peer worker died, closed its connections or
                             sent nothing within the timeout. Says which
                             rank and which step. The job cannot go on:
                             restart it (e.g. torchrun's --max-restarts).
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
    "ModelMismatch",
    "PeerLost",
    "TestbedError",
    "TransportError",
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
        head = f"{obj} on {ifname}" if obj and ifname else obj or ifname  # no obj: the interface
        super().__init__(f"{head}: {text} ({name})")


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


class TransportError(GradlaneError):
    """Raised when the shim's transport between workers fails.

    The message says which peer and which step when known. Training cannot
    continue on this worker; the other workers raise too.
    """


class ModelMismatch(TransportError):
    """Raised by `attach` when workers do not agree on the model or options.

    The message names the first parameter (or option) that differs and the
    two ranks compared. Nothing was exchanged yet.
    """


class PeerLost(TransportError):
    """Raised when a peer worker is gone or silent past the timeout.

    Attributes:
        rank: the peer's rank (None when several were silent).
        step: the optimizer step that was being synchronized.
    """

    def __init__(self, rank: int | None, step: int, detail: str) -> None:
        self.rank = rank
        self.step = step
        who = f"rank {rank}" if rank is not None else "peers"
        super().__init__(f"step {step}: {who} lost: {detail}")
