"""A gradlaned with an in-memory qdisc backend: the real service, no kernel, no root.

``python -m tests.fakes SOCKET [HTTP]`` runs one in the foreground until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradlane.daemon.config import DaemonConfig, InterfaceConfig
from gradlane.daemon.qdisc import ClassStats, QdiscSpec
from gradlane.daemon.service import Daemon


class FakeBackend:
    """Remembers the last spec instead of changing the kernel."""

    def __init__(self, iface: InterfaceConfig, config: DaemonConfig) -> None:
        self.ifname = iface.name
        self.spec: QdiscSpec | None = None
        self.applied = 0
        self.restored = False

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def owned(self) -> bool:
        return self.spec is not None

    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]:
        changed = spec != self.spec
        self.spec = spec
        self.applied += 1
        return ["changed"] if changed else []

    def restore(self) -> bool:
        self.restored = True
        self.spec = None
        return True

    def class_stats(self) -> list[ClassStats]:
        if self.spec is None:
            return []
        return [
            ClassStats(
                classid=f"474c:{i + 3:x}",
                role="job",
                job=job.name,
                band=None,
                rate_bps=job.rate_bps,
                ceil_bps=job.ceil_bps,
                bytes=0,
                packets=0,
                drops=0,
                backlog=0,
                qlen=0,
                throughput_bps=0.0,
            )
            for i, job in enumerate(self.spec.jobs)
        ]

    def addresses(self) -> set[str]:
        return {"10.0.0.1"}


async def until(check: Callable[[], object], timeout: float = 10.0) -> float:
    """Wait until `check()` holds (failing the test after `timeout` s); the time it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, "timed out"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def status_shown(daemon: Daemon, monkeypatch: Any) -> str:
    """What `gradlane status` prints of `daemon`'s status (`monkeypatch`: pytest's),
    each run of whitespace as one space."""
    from click.testing import CliRunner

    from gradlane import cli

    status = daemon.status()
    monkeypatch.setattr(cli, "_get_json", lambda *_a, **_k: status)
    shown = CliRunner().invoke(cli.cli, ["status"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    return " ".join(shown.output.split())


def fake_config(socket_path: Path, http: str = "", state_dir: Path | None = None) -> DaemonConfig:
    """A daemon of one fake interface on `socket_path`, its state directory beside it by
    default (in the test's own directory, which pytest removes: not one more left in /tmp;
    made when a real qdisc manager first writes there)."""
    return DaemonConfig(
        interfaces=(InterfaceConfig("fake0", 1_000_000_000),),
        socket_path=socket_path,
        http=http,
        state_dir=state_dir or socket_path.with_name(f"{socket_path.name}.state"),
        max_clients=64,
    )


def main() -> None:
    config = fake_config(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")

    async def serve() -> None:
        daemon = Daemon(config, backend_factory=FakeBackend)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, daemon.stop)
        await daemon.serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
