"""The shipped systemd unit passes systemd's own checks (no systemd as PID 1 needed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradlane.daemon.config import DaemonConfig, InterfaceConfig, load_config
from tests import REPO

SYSTEMD = REPO / "systemd"


def installed_gradlaned() -> str:
    found = shutil.which("gradlaned") or str(Path(sys.executable).parent / "gradlaned")
    assert Path(found).exists(), "gradlaned is not installed (pip install -e .)"
    return found


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("name", ["gradlaned.service", "gradlane-control.service"])
def test_unit_verifies_cleanly(tmp_path: Path, name: str) -> None:
    # Point ExecStart at the commands this checkout installed; any warning fails.
    unit = (SYSTEMD / name).read_text()
    unit = unit.replace("/usr/local/bin/gradlaned", installed_gradlaned())
    unit = unit.replace("/usr/local/bin/gradlane ", str(Path(installed_gradlaned()).parent /
                                                       "gradlane") + " ")
    path = tmp_path / name
    path.write_text(unit)
    out = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    security = subprocess.run(
        # --threshold is on the 0-100 scale: 30 is an exposure of 3.0 ("OK")
        ["systemd-analyze", "security", "--offline=true", "--threshold=30", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert security.returncode == 0, security.stdout[-2000:]


def test_unit_keeps_privileges_minimal() -> None:
    unit = (SYSTEMD / "gradlaned.service").read_text()
    assert "CapabilityBoundingSet=CAP_NET_ADMIN CAP_CHOWN\n" in unit
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "RuntimeDirectory=gradlane"):
        assert line in unit


def test_example_config_loads(tmp_path: Path) -> None:
    text = (SYSTEMD / "gradlaned.toml").read_text().replace('# rate = "25gbit"', 'rate = "25gbit"')
    path = tmp_path / "gradlaned.toml"
    path.write_text(text)
    config = load_config(path)
    assert config.interfaces[0].rate_bps == 25 * 10**9 and config.policy == "fair"


def test_the_example_s_values_are_the_defaults_of_a_file_that_names_only_interfaces(
        tmp_path: Path) -> None:
    """systemd/gradlaned.toml is the annotated version of the defaults: a file naming only
    the interface, and the config built in code, are the same config."""
    example = (SYSTEMD / "gradlaned.toml").read_text().replace('# rate = "25gbit"',
                                                                'rate = "25gbit"')
    (tmp_path / "example.toml").write_text(example)
    (tmp_path / "least.toml").write_text('[[interface]]\nname = "eth0"\nrate = "25gbit"\n')
    eth0 = (InterfaceConfig("eth0", 25 * 10**9),)
    assert (load_config(tmp_path / "example.toml") == load_config(tmp_path / "least.toml")
            == DaemonConfig(interfaces=eth0))


def test_example_control_section_loads(tmp_path: Path) -> None:
    text = (SYSTEMD / "gradlaned.toml").read_text().replace('# rate = "25gbit"', 'rate = "25gbit"')
    for key in ("[control]", "url =", "token_file =", "host =", "leaf ="):
        text = text.replace(f"# {key}", key)
    path = tmp_path / "gradlaned.toml"
    path.write_text(text)
    config = load_config(path)
    assert config.control_url == "http://10.0.0.5:7800" and config.control_leaf == 0
    assert config.control_host == "node17"
    assert config.control_token_file == Path("/etc/gradlane/control.token")
