"""Field validators shared by gradlaned's wire protocols (shim <-> daemon, daemon <-> control).

Each takes a decoded message (a map whose "type" names it in errors) and a
key, and returns the value or raises `ProtocolError("bad_message", ...)`
naming the message and the field.
"""

from __future__ import annotations

from typing import Any

from gradlane.errors import ProtocolError

__all__ = ["MAX_NAME", "features", "flag", "get", "integer", "listed", "number", "only", "text"]

MAX_NAME = 128


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


def flag(raw: dict[str, Any], key: str) -> bool | None:
    """An optional true or false (None: absent)."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError("bad_message", f"{raw.get('type')}: {key} must be true or false")
    return value


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
