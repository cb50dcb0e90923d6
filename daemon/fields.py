"""Field validators shared by gradlaned's wire protocols (shim <-> daemon, daemon <-> control).

Each takes a decoded message (a map whose "type" names it in errors) and a
key, and returns the value or raises `ProtocolError("bad_message", ...)`
naming the message and the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gradlane.errors import ProtocolError

__all__ = [
    "EXCHANGES",
    "HOST_EXCHANGE",
    "MAX_LEAF",
    "MAX_NAME",
    "MAX_SOCKET_PATH",
    "RESERVED_PREFIX",
    "agreed_exchange",
    "exchange",
    "exchange_fields",
    "features",
    "flag",
    "get",
    "integer",
    "integers",
    "listed",
    "number",
    "only",
    "text",
]

MAX_NAME = 128
RESERVED_PREFIX = "_"  # job names the daemon uses itself (its registry refuses them)
MAX_SOCKET_PATH = 107  # bytes of gradlaned's socket path: sun_path's 108, less the ending NUL
# Leaf switches are numbered below this (a host's, in its config, register and plans).
MAX_LEAF = 1 << 16
# How a job's ranks agreed to exchange gradients (`gradlane.policies.demand.Exchange`):
# the flat reduction tree, within leaves first, around the ring of ranks, or within hosts
# first (ranks sharing hosts).
EXCHANGES: tuple[str, ...] = ("flat", "leaf", "ring", "host")
# The feature a peer lists when it accepts "host" (newer than ``exchange`` itself).
HOST_EXCHANGE = "host_exchange"


def only(raw: dict[str, Any], allowed: set[str]) -> None:
    extra = set(raw) - allowed
    if extra:
        raise ProtocolError("bad_message", f"{raw['type']}: unknown fields {sorted(extra)}")


def get(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ProtocolError("bad_message", f"{raw.get('type')}: missing field {key!r}")
    return raw[key]


def integer(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    value = get(raw, key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(
            "bad_message", f"{raw.get('type')}: {key} must be an integer in {low}..{high}"
        )
    return value


def integers(values: list[Any], low: int, high: int) -> bool:
    """Whether `values` are all integers (not bools) in ``[low, high)``, checked in C: a
    report lists a job's every chunk, and a control plane takes a report a second from
    each daemon (checked one by one in Python, they took half of a report's parsing)."""
    return not values or (set(map(type, values)) <= {int}
                          and low <= min(values) and max(values) < high)


def flag(raw: dict[str, Any], key: str) -> bool | None:
    """An optional true or false (None: absent)."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError("bad_message", f"{raw.get('type')}: {key} must be true or false")
    return value


def exchange(raw: dict[str, Any]) -> str | None:
    """The optional agreed exchange, one of `EXCHANGES` (None: not said yet).

    Read from ``exchange``, or from an older peer's ``in_leaf`` flag (true:
    "leaf", false: "flat").
    """
    value = raw.get("exchange")
    if value is None:
        in_leaf = flag(raw, "in_leaf")
        return None if in_leaf is None else "leaf" if in_leaf else "flat"
    if value not in EXCHANGES:
        raise ProtocolError(
            "bad_message", f"{raw.get('type')}: exchange must be one of {', '.join(EXCHANGES)}"
        )
    return str(value)


def agreed_exchange(said: Iterable[str | None]) -> str | None:
    """What several ranks (or hosts) of one job said together: None while one has not
    said; their exchange, or "flat" if they differ (a job's ranks build the same trees,
    and flat is what a rank falls back to)."""
    kinds = set(said)
    if None in kinds or not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "flat"


def exchange_fields(kind: str | None, accepted: frozenset[str]) -> dict[str, Any]:
    """The fields that say `kind` to a peer accepting the optional fields `accepted`.

    ``exchange`` when the peer lists it; to an older one that knows only
    ``in_leaf``, the ring is said as flat (the nearest exchange it can plan
    for), and within hosts first as flat to one that does not list
    `HOST_EXCHANGE`; nothing when `kind` is None or the peer knows neither.
    """
    if kind is None:
        return {}
    if kind == "host" and HOST_EXCHANGE not in accepted:
        kind = "flat"
    if "exchange" in accepted:
        return {"exchange": kind}
    if "in_leaf" in accepted:
        return {"in_leaf": kind == "leaf"}
    return {}


def features(welcome: dict[str, Any]) -> frozenset[str]:
    """The optional fields a welcome says its side accepts (none from an older one)."""
    listed = welcome.get("features")
    if not isinstance(listed, list):
        return frozenset()
    return frozenset(f for f in listed if isinstance(f, str))


def number(raw: dict[str, Any], key: str) -> float:
    value = get(raw, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        raise ProtocolError("bad_message", f"{raw.get('type')}: {key} must be a number >= 0")
    return float(value)


def text(raw: dict[str, Any], key: str) -> str:
    value = get(raw, key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise ProtocolError(
            "bad_message", f"{raw.get('type')}: {key} must be printable text of 1..{MAX_NAME} chars"
        )
    return value


def listed(raw: dict[str, Any], key: str, most: int) -> list[Any]:
    value = get(raw, key)
    if not isinstance(value, list) or len(value) > most:
        raise ProtocolError("bad_message", f"{raw.get('type')}: {key} must be a list of <= {most}")
    return value
