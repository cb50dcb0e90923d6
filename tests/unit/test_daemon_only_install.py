"""A node that runs only gradlaned (and perhaps the control plane, or the simulator) has no
torch.

torch is the ``shim`` extra and matplotlib the ``bench`` one (pyproject.toml);
a daemon-only install has neither. Each check runs in a fresh interpreter
whose imports of them fail, as they would there.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# Put first in a child's sys.meta_path: importing the extras fails as if not installed.
WITHOUT_EXTRAS = """
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""

DAEMON_SIDE = [
    "gradlane.cli", "gradlane.daemon.service", "gradlane.daemon.control",
    "gradlane.daemon.uplink", "gradlane.daemon.qdisc", "gradlane.daemon.config",
    "gradlane.policies", "gradlane.policies.sim", "gradlane.testbed", "gradlane.simulation",
]


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS + code], capture_output=True,
                          text=True, timeout=timeout)


def test_the_extras_really_are_missing_in_the_child() -> None:
    out = _python("import torch")
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr


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
assert not any(m.split(".")[0] in ("torch", "matplotlib") for m in sys.modules)
print("fine")
"""
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "fine", out.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_the_control_plane_serves_without_torch(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-sixteen-or-more\n")
    port = _free_port()
    argv = ["gradlane", "control", "--listen", f"127.0.0.1:{port}", "--token-file", str(token)]
    code = f"sys.argv = {argv!r}\nfrom gradlane.cli import main\nmain()"
    proc = subprocess.Popen([sys.executable, "-c", WITHOUT_EXTRAS + code],
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
