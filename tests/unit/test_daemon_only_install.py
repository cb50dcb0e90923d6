"""A node that runs only gradlaned (and perhaps the control plane, or the simulator) has no
torch.

torch is the ``shim`` extra, SciPy the ``control`` one and matplotlib the
``bench`` one (pyproject.toml); a daemon-only install has none of them, the
control plane's host SciPy. Each check runs in a fresh interpreter whose
imports of the missing ones fail, as they would there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import port_below_ephemeral

DAEMON_ONLY = ("torch", "matplotlib", "scipy")
CONTROL_HOST = ("torch", "matplotlib")  # the control extra installed


def without(missing: tuple[str, ...]) -> str:
    """Code to put first in a child: importing `missing` fails as if not installed."""
    return f"""
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""

DAEMON_SIDE = [
    "gradlane.cli", "gradlane.daemon.service", "gradlane.daemon.control",
    "gradlane.daemon.uplink", "gradlane.daemon.qdisc", "gradlane.daemon.config",
    "gradlane.policies", "gradlane.policies.sim", "gradlane.testbed", "gradlane.simulation",
]


def _python(code: str, missing: tuple[str, ...] = DAEMON_ONLY,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", without(missing) + code], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("module", DAEMON_ONLY)
def test_the_extras_really_are_missing_in_the_child(module: str) -> None:
    out = _python(f"import {module}")
    assert out.returncode != 0 and f"No module named '{module}'" in out.stderr


@pytest.mark.parametrize("command", [["control", "--token-file", "/nonexistent"],
                                     ["sim", "heterogeneous", "--json", "/tmp/unwritten.json"]])
def test_the_control_plane_and_simulator_say_they_need_the_control_extra(
        command: list[str]) -> None:
    code = f"""
from click.testing import CliRunner
from gradlane.cli import cli
result = CliRunner().invoke(cli, {command!r})
print(result.exit_code, result.output)
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("1 ") and "pip install 'gradlane[control]'" in out.stdout


def test_the_daemon_side_imports_and_its_commands_answer_without_torch() -> None:
    code = f"""
import importlib
for name in {DAEMON_SIDE!r}:
    importlib.import_module(name)
from click.testing import CliRunner
from gradlane.cli import cli
for command in ("daemon", "control", "status", "testbed", "sim"):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, (command, result.output, result.exception)
assert not any(m.split(".")[0] in {DAEMON_ONLY!r} for m in sys.modules)
print("fine")
"""
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "fine", out.stderr[-3000:]


@pytest.mark.timeout(60)
def test_the_control_plane_serves_without_torch(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-sixteen-or-more\n")
    port = port_below_ephemeral()
    argv = ["gradlane", "control", "--listen", f"127.0.0.1:{port}", "--token-file", str(token)]
    code = f"sys.argv = {argv!r}\nfrom gradlane.cli import main\nmain()"
    proc = subprocess.Popen([sys.executable, "-c", without(CONTROL_HOST) + code],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/v1/cluster",
            headers={"Authorization": "Bearer a-token-of-sixteen-or-more"})
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    assert response.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the control plane never answered"
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            log = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
    assert proc.returncode == 0, log[-3000:]
    # A service in the foreground says it is up, without -v (as gradlaned does).
    assert f"listening on 127.0.0.1:{port}" in log, log[-3000:]
