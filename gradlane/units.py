"""Parsing and printing of link rates ("200mbit", "1gbit") as tc writes them; lists
shortened for a line of text."""

from __future__ import annotations

import re
from collections.abc import Sequence

from gradlane.errors import ConfigError

__all__ = ["MIN_RATE_BPS", "first_of", "format_rate", "parse_rate"]

_SUFFIXES = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,  # tc's "bps" means bytes per second
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
# The slowest rate gradlane shapes at: slower, HTB's time per burst overflows the
# 32 bits netlink carries it in.
MIN_RATE_BPS = 8_000


def parse_rate(text: str | int) -> int:
    """Return a rate in bits per second from tc-style text or an int (bit/s).

    Units follow tc: ``kbit``/``mbit``/``gbit`` are bits (powers of 1000),
    ``kbps``/``mbps``/``gbps`` are *bytes* per second. A bare number is bit/s.

    Raises:
        ConfigError: the text is not a rate with a known unit, of at least
            `MIN_RATE_BPS`.
    """
    if isinstance(text, bool):
        raise ConfigError(f"rate must be a number or text like '1gbit', not {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _RATE.match(text.lower())
        if match is None or match.group(2) not in _SUFFIXES:
            raise ConfigError(
                f"bad rate {text!r}: expected a number with a unit such as "
                f"'100mbit' or '10gbit' (units: {', '.join(s for s in _SUFFIXES if s)})"
            )
        value = round(float(match.group(1)) * _SUFFIXES[match.group(2)])
    if value < MIN_RATE_BPS:
        raise ConfigError(f"rate must be at least {format_rate(MIN_RATE_BPS)} (HTB shapes "
                          f"nothing slower), got {text!r}")
    return value


def format_rate(bps: float) -> str:
    """Return a short human form of a rate in bit/s, e.g. ``'192.5Mbit'``."""
    for unit, scale in (("Gbit", 10**9), ("Mbit", 10**6), ("Kbit", 10**3)):
        if abs(bps) >= scale:
            return f"{bps / scale:.4g}{unit}"
    return f"{bps:.4g}bit"


def first_of(items: Sequence[str], most: int) -> str:
    """`items` for a line of text: the first `most`, comma-separated, and how many more
    ("a, b, c and 4 more")."""
    more = len(items) - most
    return ", ".join(items[:most]) + (f" and {more} more" if more > 0 else "")
