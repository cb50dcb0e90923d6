"""gradlaned's configuration: one frozen object, from a TOML file plus flag overrides.

Example (``systemd/gradlaned.toml`` is the annotated version)::

    [daemon]
    socket = "/run/gradlane/gradlaned.sock"
    socket_group = "gradlane"        # who may connect (mode 0660)
    http = "127.0.0.1:9464"          # /status and /metrics; "" disables
    policy = "fair"
    on_start = "takeover"            # a tree left by a crash: take over or restore first

    [network]
    bands = [46, 34, 26, 18]         # DSCP per band, band 0 first
    other_share = 0.05               # of the shaped rate, kept for other traffic
    shape_fraction = 0.95            # shape this far under the line rate

    [[interface]]
    name = "eth0"
    rate = "25gbit"                  # optional: detected with ethtool when absent

Every error names the key: ``network.other_share: must be in (0, 0.5], got 0.9``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gradlane.daemon.control_protocol import MAX_INTERFACES
from gradlane.daemon.fields import MAX_LEAF, MAX_NAME, MAX_SOCKET_PATH
from gradlane.daemon.qdisc import DEFAULT_BAND_DSCP, MAX_BANDS
from gradlane.errors import ConfigError
from gradlane.units import parse_rate

__all__ = [
    "DEFAULT_SHAPE_FRACTION", "DaemonConfig", "InterfaceConfig", "detect_link_rate", "load_config",
]

DEFAULT_SOCKET = Path("/run/gradlane/gradlaned.sock")
DEFAULT_STATE_DIR = Path("/run/gradlane")
DEFAULT_HTTP = "127.0.0.1:9464"
# gradlane shapes this far under the line rate, so the queue (and the scheduling) sits in
# its tree instead of the NIC (systemd/gradlaned.toml says what the margin covers).
DEFAULT_SHAPE_FRACTION = 0.95
ON_START = ("takeover", "restore")


@dataclass(frozen=True)
class InterfaceConfig:
    name: str
    rate_bps: int  # the line rate; gradlane shapes to shape_fraction of it


@dataclass(frozen=True)
class DaemonConfig:
    """Everything gradlaned needs; built only by `load_config` (or tests)."""

    interfaces: tuple[InterfaceConfig, ...]
    bands: tuple[int, ...] = DEFAULT_BAND_DSCP
    other_share: float = 0.05
    shape_fraction: float = DEFAULT_SHAPE_FRACTION
    socket_path: Path = DEFAULT_SOCKET
    socket_group: str | None = None
    socket_mode: int = 0o660
    http: str = DEFAULT_HTTP
    state_dir: Path = DEFAULT_STATE_DIR
    policy: str = "fair"
    on_start: str = "takeover"
    max_clients: int = 256
    coalesce_s: float = 0.002
    control_url: str | None = None
    control_token_file: Path | None = None
    control_host: str | None = None  # the name this host registers as (default: hostname)
    control_leaf: int = 0  # the leaf switch it hangs off
    source: str = field(default="the command line", compare=False)

    @property
    def http_address(self) -> tuple[str, int] | None:
        return host_port(self.http) if self.http else None


# A key the file leaves out takes the dataclass's default: each default in one place.
_DEFAULT: dict[str, Any] = {f.name: f.default for f in fields(DaemonConfig)}


def host_port(text: str) -> tuple[str, int]:
    """``host:port`` (host default 127.0.0.1; brackets around an IPv6 host dropped).

    Raises:
        ConfigError: no port, or one outside 1..65535.
    """
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f'expected "host:port" with a port in 1..65535, got {text!r}')
    return host.strip("[]") or "127.0.0.1", int(port)


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Read `path` (None: the defaults), apply `overrides` ("section.key" -> value): the
    command line's options.

    Overrides use the file's names: ``{"daemon.socket": "/tmp/s.sock",
    "interface": ["eth0=1gbit"]}``.

    Raises:
        ConfigError: no interface named, an unreadable file, an unknown key, or a bad
            value (named, with where it came from).
    """
    raw: dict[str, Any] = {}
    overrides = overrides or {}
    if path is None and not overrides.get("interface"):
        raise ConfigError("no interface to manage: give --interface IF[=RATE], or a config "
                          "file listing [[interface]] (--config; systemd/gradlaned.toml is an "
                          "example)")
    source = "the command line"
    if path is not None:
        source = f"{path} and the command line" if overrides else str(path)
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    for key, value in overrides.items():
        if key == "interface":
            raw["interface"] = [_interface_flag(v) for v in value]
            continue
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = value
    return _build(raw, source)


def _interface_flag(text: str) -> dict[str, str]:
    name, _, rate = text.partition("=")
    return {"name": name, "rate": rate} if rate else {"name": name}


_KNOWN = {
    "daemon": {
        "socket",
        "socket_group",
        "socket_mode",
        "http",
        "state_dir",
        "policy",
        "on_start",
        "max_clients",
        "coalesce_ms",
    },
    "network": {"bands", "other_share", "shape_fraction"},
    "control": {"url", "token_file", "host", "leaf"},
}


def _build(raw: dict[str, Any], source: str) -> DaemonConfig:
    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {problem}")

    for section, value in raw.items():
        if section == "interface":
            continue
        if section not in _KNOWN:
            raise fail(section, f"unknown section (known: {', '.join([*_KNOWN, 'interface'])})")
        if not isinstance(value, dict):
            raise fail(section, "must be a table")
        for key in value:
            if key not in _KNOWN[section]:
                raise fail(f"{section}.{key}", f"unknown key (known: {sorted(_KNOWN[section])})")
    daemon = raw.get("daemon", {})
    network = raw.get("network", {})
    control = raw.get("control", {})

    interfaces = raw.get("interface", [])
    if not isinstance(interfaces, list) or not interfaces:
        raise fail("interface", "at least one [[interface]] with a name is needed")
    ifaces = []
    for i, item in enumerate(interfaces):
        where = f"interface[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise fail(where, 'needs a name, e.g. name = "eth0"')
        extra = set(item) - {"name", "rate"}
        if extra:
            raise fail(where, f"unknown keys {sorted(extra)} (known: name, rate)")
        name = item["name"]
        if "rate" in item:
            try:
                rate = parse_rate(item["rate"])
            except ConfigError as exc:
                raise fail(f"{where}.rate", str(exc)) from None
        else:
            detected = detect_link_rate(name)
            if detected is None:
                try:
                    socket.if_nametoindex(name)
                except OSError:
                    raise fail(f"{where}.name", f"no interface {name!r} here (`ip link` "
                               "lists them)") from None
                raise fail(
                    f"{where}.rate",
                    f"cannot detect the line rate of {name} (down, or virtual: lo, a tunnel, a "
                    f'bond of unknown speed); set it, e.g. rate = "10gbit"',
                )
            rate = detected
        ifaces.append(InterfaceConfig(name, rate))
    if len({i.name for i in ifaces}) != len(ifaces):
        raise fail("interface", "an interface is listed twice")

    bands = network.get("bands", list(_DEFAULT["bands"]))
    if (
        not isinstance(bands, list)
        or not 1 <= len(bands) <= MAX_BANDS
        or not all(isinstance(b, int) and 0 < b < 64 for b in bands)
        or len(set(bands)) != len(bands)
    ):
        raise fail("network.bands", f"must be 1..{MAX_BANDS} distinct DSCP values in 1..63")
    other = _number(network, "other_share", _DEFAULT["other_share"], 0.0, 0.5, fail, "network")
    fraction = _number(network, "shape_fraction", _DEFAULT["shape_fraction"], 0.5, 1.0, fail,
                       "network")

    mode_text = daemon.get("socket_mode", f"{_DEFAULT['socket_mode']:04o}")
    try:
        mode = int(str(mode_text), 8)
        assert 0 <= mode <= 0o777
    except (ValueError, AssertionError):
        raise fail("daemon.socket_mode", f'must be octal like "0660", got {mode_text!r}') from None
    on_start = daemon.get("on_start", _DEFAULT["on_start"])
    if on_start not in ON_START:
        raise fail("daemon.on_start", f"must be one of {ON_START}, got {on_start!r}")
    http = daemon.get("http", _DEFAULT["http"])
    try:
        ok = isinstance(http, str) and (not http or bool(host_port(http)))
    except ConfigError:
        ok = False
    if not ok:
        raise fail("daemon.http", f'must be "host:port" (a port in 1..65535) or "" (off), '
                                  f"got {http!r}")
    max_clients = daemon.get("max_clients", _DEFAULT["max_clients"])
    if not isinstance(max_clients, int) or not 1 <= max_clients <= 65536:
        raise fail("daemon.max_clients", f"must be an integer in 1..65536, got {max_clients!r}")
    coalesce_ms = _number(daemon, "coalesce_ms", _DEFAULT["coalesce_s"] * 1000, 0.0, 1000.0,
                          fail, "daemon")
    for key in ("socket", "state_dir", "policy", "socket_group"):
        if key in daemon and (not isinstance(daemon[key], str) or not daemon[key]):
            raise fail(f"daemon.{key}", "must be non-empty text")
    socket_path = str(daemon.get("socket", _DEFAULT["socket_path"]))
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise fail("daemon.socket", f"must be at most {MAX_SOCKET_PATH} bytes long (the "
                                    f"kernel's limit for a Unix socket), got "
                                    f"{len(os.fsencode(socket_path))}: {socket_path!r}")
    url = control.get("url")
    token = control.get("token_file")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://",
                                                                           "https://"))):
        raise fail("control.url", f'must be like "http://10.0.0.5:7800", got {url!r}')
    if url is not None and not token:
        raise fail("control.token_file", "is needed with control.url")
    leaf = control.get("leaf", _DEFAULT["control_leaf"])
    if isinstance(leaf, bool) or not isinstance(leaf, int) or not 0 <= leaf < MAX_LEAF:
        raise fail("control.leaf", f"must be an integer in 0..{MAX_LEAF - 1}, got {leaf!r}")
    # What a control plane registers (`control_protocol.parse_register`): refused there,
    # the daemon would register again every second and never be planned.
    host = control.get("host")
    if host is not None and (not isinstance(host, str) or not 0 < len(host) <= MAX_NAME
                             or not host.isprintable()):
        raise fail("control.host", f"must be 1..{MAX_NAME} printable characters, got {host!r}")
    if url is not None and len(ifaces) > MAX_INTERFACES:
        raise fail("interface", f"at most {MAX_INTERFACES} with a control plane (what it "
                                f"registers of a host), got {len(ifaces)}")
    return DaemonConfig(
        interfaces=tuple(ifaces),
        bands=tuple(bands),
        other_share=other,
        shape_fraction=fraction,
        socket_path=Path(socket_path),
        socket_group=daemon.get("socket_group"),
        socket_mode=mode,
        http=http,
        state_dir=Path(daemon.get("state_dir", _DEFAULT["state_dir"])),
        policy=daemon.get("policy", _DEFAULT["policy"]),
        on_start=on_start,
        max_clients=max_clients,
        coalesce_s=coalesce_ms / 1000,
        control_url=url,
        control_token_file=Path(token) if token else None,
        control_host=host,
        control_leaf=leaf,
        source=source,
    )


def _number(
    table: dict[str, Any],
    key: str,
    default: float,
    low: float,
    high: float,
    fail: Any,
    section: str,
) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
        raise fail(f"{section}.{key}", f"must be a number in ({low}, {high}], got {value!r}")
    return float(value)


# -- link rate detection -------------------------------------------------

_SIOCETHTOOL = 0x8946
_ETHTOOL_GSET = 0x1
_SPEED_UNKNOWN = (0, 0xFFFF, 0xFFFFFFFF)


def detect_link_rate(ifname: str) -> int | None:
    """The interface's line rate in bit/s from ethtool, or None if unknown.

    Uses the ETHTOOL_GSET ioctl on a socket, which (unlike /sys/class/net)
    answers for the caller's network namespace.
    """
    cmd = ctypes.create_string_buffer(struct.pack("I", _ETHTOOL_GSET) + b"\0" * 40)
    ifreq = struct.pack("16sP", ifname.encode()[:15], ctypes.addressof(cmd))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
        except OSError:
            return None
    speed_lo = struct.unpack_from("H", cmd.raw, 12)[0]
    speed_hi = struct.unpack_from("H", cmd.raw, 28)[0]
    speed = int((speed_hi << 16) | speed_lo)
    if speed in _SPEED_UNKNOWN:
        return None
    return speed * 1_000_000
