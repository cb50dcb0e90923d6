"""What an emulated cluster looks like: hosts, link rates, switches, NICs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gradlane.errors import ConfigError
from gradlane.units import MIN_RATE_BPS, parse_rate

__all__ = ["NS_PREFIX", "Topology"]

NS_PREFIX = "gl-"
_NAME = re.compile(r"^[a-z0-9]{1,12}$")
MAX_HOSTS = 64


@dataclass(frozen=True)
class Topology:
    """An emulated cluster.

    Attributes:
        name: short cluster name (lowercase letters and digits); namespaces are
            ``gl-<name>-h<i>`` for host i (1-based) and ``gl-<name>-sw`` for
            the switches.
        rates: each host's link rate in bit/s, both directions (len = hosts).
        leaves: 1 (one switch) or 2 (two leaf switches joined by an uplink;
            hosts 1..ceil(N/2) on the first, the rest on the second).
        uplink_bps: the rate between the two leaves, both directions (needed
            when leaves == 2; lower than the hosts' sum = oversubscription).
        nics: NICs per host, 1 or 2. NIC k of every host sits on its own
            switch plane (its own bridges, subnet 10.200.k.0/24), so two hosts
            have one path per plane.
        queue_packets: buffer of every emulated queue (switch port priority
            queue and host NIC), in packets.
    """

    name: str
    rates: tuple[int, ...]
    leaves: int = 1
    uplink_bps: int | None = None
    nics: int = 1
    queue_packets: int = 1000

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(
                f"cluster name {self.name!r} must be 1-12 lowercase letters or digits "
                "(it becomes part of namespace names)"
            )
        if not 2 <= len(self.rates) <= MAX_HOSTS:
            raise ConfigError(f"a cluster needs 2..{MAX_HOSTS} hosts, got {len(self.rates)}")
        if any(rate < MIN_RATE_BPS for rate in self.rates):
            raise ConfigError(f"host rates must be at least {MIN_RATE_BPS} bit/s, got {self.rates}")
        if self.leaves not in (1, 2):
            raise ConfigError(f"leaves must be 1 or 2, got {self.leaves}")
        if self.leaves == 2 and self.uplink_bps is None:
            raise ConfigError("two leaves need the rate of the uplink between them (--uplink, "
                              "e.g. 1gbit)")
        if self.leaves == 2 and self.uplink_bps is not None and self.uplink_bps < MIN_RATE_BPS:
            raise ConfigError(f"a two-leaf topology needs an uplink rate of at least "
                              f"{MIN_RATE_BPS} bit/s")
        if self.leaves == 1 and self.uplink_bps is not None:
            raise ConfigError("an uplink rate only applies with two leaves (--leaves 2)")
        if self.nics not in (1, 2):
            raise ConfigError(f"nics must be 1 or 2, got {self.nics}")
        if not 2 <= self.queue_packets <= 100_000:
            raise ConfigError(f"queue_packets must be in 2..100000, got {self.queue_packets}")

    @classmethod
    def build(
        cls,
        name: str,
        hosts: int,
        rate: str | int | Sequence[str | int],
        *,
        leaves: int = 1,
        uplink: str | int | None = None,
        nics: int = 1,
        queue_packets: int = 1000,
    ) -> Topology:
        """Build from user-facing values: one rate for all hosts or one per host.

        ``rate`` may be ``"1gbit"``, ``"1gbit,1gbit,500mbit"`` or a sequence.
        """
        if isinstance(rate, str) and "," in rate:
            rate = [part for part in rate.split(",")]
        if isinstance(rate, str | int):
            rates = (parse_rate(rate),) * hosts
        else:
            rates = tuple(parse_rate(r) for r in rate)
            if len(rates) != hosts:
                raise ConfigError(f"got {len(rates)} rates for {hosts} hosts: give one or {hosts}")
        return cls(
            name=name,
            rates=rates,
            leaves=leaves,
            uplink_bps=None if uplink is None else parse_rate(uplink),
            nics=nics,
            queue_packets=queue_packets,
        )

    @property
    def hosts(self) -> int:
        return len(self.rates)

    @property
    def switch_ns(self) -> str:
        return f"{NS_PREFIX}{self.name}-sw"

    def host_ns(self, host: int) -> str:
        return f"{NS_PREFIX}{self.name}-h{host}"

    def leaf_of(self, host: int) -> int:
        """The leaf switch (0 or 1) that host `host` (1-based) hangs off."""
        if self.leaves == 1:
            return 0
        return 0 if host <= (self.hosts + 1) // 2 else 1

    @staticmethod
    def address(host: int, nic: int = 0) -> str:
        """IPv4 address of NIC `nic` of host `host` (1-based)."""
        return f"10.200.{nic}.{host}"

    def namespaces(self) -> list[str]:
        return [self.switch_ns] + [self.host_ns(h) for h in range(1, self.hosts + 1)]
