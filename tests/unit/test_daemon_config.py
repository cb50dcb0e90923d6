import asyncio
import dataclasses
from pathlib import Path

import pytest

from gradlane.daemon.config import load_config
from gradlane.daemon.fields import MAX_LEAF, MAX_NAME
from gradlane.daemon.service import Daemon
from gradlane.errors import ConfigError, GradlaneError
from tests.fakes import FakeBackend, fake_config

GOOD = """
[daemon]
socket = "/tmp/x.sock"
socket_mode = "0600"
http = "127.0.0.1:9999"
policy = "fair"
on_start = "restore"

[network]
bands = [46, 26]
other_share = 0.1

[[interface]]
name = "eth0"
rate = "25gbit"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gradlaned.toml"
    path.write_text(text)
    return path


def test_file_values_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    config = load_config(path)
    assert config.interfaces[0].rate_bps == 25 * 10**9
    assert config.bands == (46, 26) and config.other_share == 0.1
    assert config.socket_mode == 0o600 and config.on_start == "restore"
    assert config.http_address == ("127.0.0.1", 9999)
    flags = load_config(path, {"interface": ["eth1=1gbit"], "daemon.http": ""})
    assert [i.name for i in flags.interfaces] == ["eth1"] and flags.http_address is None


def test_values_at_their_limits_and_defaults(tmp_path: Path) -> None:
    def bands(value: object) -> str:
        return GOOD.replace("bands = [46, 26]", f"bands = {value}")

    def mode(value: str) -> str:
        return GOOD.replace('socket_mode = "0600"', f'socket_mode = "{value}"')

    assert load_config(write(tmp_path, bands([1, 63]))).bands == (1, 63)
    assert len(load_config(write(tmp_path, bands(list(range(1, 16))))).bands) == 15
    for bad in ("[]", "[0]", "[64]", '["46"]', str(list(range(1, 17)))):
        with pytest.raises(ConfigError, match=r"network.bands: must be 1..15 distinct DSCP "):
            load_config(write(tmp_path, bands(bad)))
    assert load_config(write(tmp_path, mode("0000"))).socket_mode == 0
    assert load_config(write(tmp_path, mode("0777"))).socket_mode == 0o777
    with pytest.raises(ConfigError, match="daemon.socket_mode: must be octal"):
        load_config(write(tmp_path, mode("1000")))
    # A Unix socket's path: 107 bytes at most (bind says only "AF_UNIX path too long").
    longest = "/tmp/" + "s" * 97 + ".sock"
    assert len(longest) == 107
    socket = GOOD.replace('socket = "/tmp/x.sock"', f'socket = "{longest}"')
    assert str(load_config(write(tmp_path, socket)).socket_path) == longest
    with pytest.raises(ConfigError, match=r"daemon.socket: must be at most 107 bytes long "
                                          r"\(the kernel's limit for a Unix socket\), got 108"):
        load_config(write(tmp_path, socket.replace(".sock", "s.sock")))
    with pytest.raises(ConfigError, match=r"and the command line: daemon.socket: .* got 108"):
        load_config(write(tmp_path, GOOD), {"daemon.socket": "/" + "s" * 107})
    config = load_config(write(tmp_path, GOOD.replace("[daemon]", "[daemon]\ncoalesce_ms = 5")))
    assert config.coalesce_s == 0.005
    assert config.control_leaf == 0 and config.control_url is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("other_share = 0.1", "other_share = 0.9"), "network.other_share"),
        (GOOD.replace('rate = "25gbit"', 'rate = "fast"'), r"interface\[0\].rate"),
        (GOOD.replace("bands = [46, 26]", "bands = [46, 46]"), "network.bands"),
        (GOOD.replace('on_start = "restore"', 'on_start = "maybe"'), "daemon.on_start"),
        (GOOD.replace('socket_mode = "0600"', 'socket_mode = "rw"'), "daemon.socket_mode"),
        (GOOD.replace('http = "127.0.0.1:9999"', 'http = "localhost"'), "daemon.http"),
        (GOOD.replace('http = "127.0.0.1:9999"', 'http = "127.0.0.1:99999"'), "daemon.http"),
        (GOOD.replace('http = "127.0.0.1:9999"', 'http = "127.0.0.1:0"'), "daemon.http"),
        (GOOD + "\n[extra]\n", "extra: unknown section"),
        (GOOD.replace("[daemon]", "[daemon]\nsokcet = 1"), "daemon.sokcet: unknown key"),
        (GOOD.replace('name = "eth0"', 'name = "eth0"\nspeed = 1'), "unknown keys"),
        ("[daemon]\n", "at least one"),
        ("this is not toml", "gradlaned.toml"),
        (GOOD + '\n[control]\nurl = "10.0.0.5:7800"\ntoken_file = "/t"\n', "control.url"),
        (GOOD + '\n[control]\nurl = "http://10.0.0.5:7800"\n', "control.token_file"),
        (GOOD + '\n[control]\nurl = "http://a:1"\ntoken_file = "/t"\nleaf = -1\n',
         r"control.leaf: must be an integer in 0..65535, got -1"),
        (GOOD + '\n[control]\nurl = "http://a:1"\ntoken_file = "/t"\nhost = ""\n',
         "control.host: must be 1..128 printable characters, got ''"),
        # What a control plane would refuse at every registration, the host never planned.
        (GOOD + '\n[control]\nurl = "http://a:1"\ntoken_file = "/t"\nhost = "h\\t1"\n',
         r"control.host: must be 1..128 printable characters, got 'h\\t1'"),
        (GOOD + '\n[control]\nurl = "http://a:1"\ntoken_file = "/t"\nhost = "' + "h" * 129
         + '"\n', "control.host: must be 1..128 printable characters"),
        (GOOD + "".join(f'\n[[interface]]\nname = "e{i}"\nrate = "1gbit"\n' for i in range(16))
         + '\n[control]\nurl = "http://a:1"\ntoken_file = "/t"\n',
         "interface: at most 16 with a control plane \\(what it registers of a host\\), got 17"),
        ('daemon = 1\n[[interface]]\nname = "eth0"\nrate = "1gbit"\n',
         "daemon: must be a table"),
        ('[[interface]]\nrate = "1gbit"\n', r'interface\[0\]: needs a name, e.g. name = "eth0"'),
        (GOOD + '\n[[interface]]\nname = "eth0"\nrate = "1gbit"\n',
         "interface: an interface is listed twice"),
        (GOOD.replace("[daemon]", "[daemon]\nmax_clients = 0"),
         "daemon.max_clients: must be an integer in 1..65536, got 0"),
        (GOOD.replace('policy = "fair"', 'policy = ""'), "daemon.policy: must be non-empty text"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_missing_file_and_undetectable_rate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[daemon]")  # saved as UTF-16, say
    with pytest.raises(ConfigError, match=r"^config file .*binary\.toml: 'utf-8' codec"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"^the command line: interface\[0\].name: no "
                                          r"interface 'nosuch0' here"):
        load_config(None, {"interface": ["nosuch0"]})
    with pytest.raises(ConfigError, match=r"^no interface to manage: give --interface "
                                          r"IF\[=RATE\], or a config file"):
        load_config(None, {"daemon.http": ""})  # neither a file nor --interface
    # Loopback is there, and has no line rate to read.
    with pytest.raises(ConfigError, match=r"interface\[0\].rate: cannot detect the line rate "
                       r"of lo \(down, or virtual"):
        load_config(None, {"interface": ["lo"]})


def test_the_command_line_shows_a_config_error_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradlane import cli

    config = write(tmp_path, "[network]\nbands = [46]\n")  # no [[interface]]
    monkeypatch.setattr("sys.argv", ["gradlaned", "--config", str(config)])
    with pytest.raises(SystemExit) as exit_:
        cli.daemon_main()
    assert exit_.value.code == 1
    # Not "at least one [] with a name": rich took the table's name for markup. As click
    # shows its errors, and on one line whatever the width.
    shown = capsys.readouterr().err
    assert shown.startswith("Error: ") and shown.count("\n") == 1, shown
    assert "at least one [[interface]] with a name" in shown


def test_an_address_not_of_this_host_is_refused_by_name(tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is no interface's here: binding fails, the tree is restored.
    config = dataclasses.replace(fake_config(tmp_path / "gl.sock"), http="192.0.2.1:9464")
    daemon = Daemon(config, backend_factory=FakeBackend)
    backend = daemon._backends[0]
    assert isinstance(backend, FakeBackend)
    with pytest.raises(GradlaneError, match="cannot listen on 192.0.2.1:9464 for /status"):
        asyncio.run(daemon.serve())
    assert backend.restored and not config.socket_path.exists()


def test_what_a_control_plane_registers_is_taken_to_its_edges(tmp_path: Path) -> None:
    nics = "".join(f'\n[[interface]]\nname = "e{i}"\nrate = "1gbit"\n' for i in range(16))
    control = '\n[control]\nurl = "http://a:1"\ntoken_file = "/t"\nhost = "' + "h" * 128 + '"\n'
    config = load_config(write(tmp_path, GOOD + nics[:nics.rindex("[[")] + control))
    assert len(config.interfaces) == 16 and config.control_host == "h" * 128
    assert len(load_config(write(tmp_path, GOOD + nics)).interfaces) == 17  # no control plane


@pytest.mark.parametrize(("key", "attribute", "taken", "refused"), [
    ("daemon.http", "http", {"127.0.0.1:1": "127.0.0.1:1", "[::1]:65535": "[::1]:65535"},
     ["127.0.0.1:0", "127.0.0.1:65536"]),
    ("daemon.max_clients", "max_clients", {1: 1, 65536: 65536}, [0, 65537]),
    ("daemon.coalesce_ms", "coalesce_s", {0.001: 1e-6, 1000: 1.0}, [0, 1000.001]),
    ("network.other_share", "other_share", {0.001: 0.001, 0.5: 0.5}, [0, 0.501]),
    ("network.shape_fraction", "shape_fraction", {0.501: 0.501, 1: 1.0}, [0.5, 1.001]),
    ("network.bands", "bands", {(46,): (46,), tuple(range(1, 16)): tuple(range(1, 16))},
     [[], list(range(1, 17))]),
    ("control.leaf", "control_leaf", {0: 0, MAX_LEAF - 1: MAX_LEAF - 1}, [-1, MAX_LEAF]),
    ("control.host", "control_host", {"h": "h", "h" * MAX_NAME: "h" * MAX_NAME},
     ["", "h" * (MAX_NAME + 1)]),
])
def test_each_bound_is_taken_and_the_value_past_it_refused(
        tmp_path: Path, key: str, attribute: str, taken: dict[object, object],
        refused: list[object]) -> None:
    path = write(tmp_path, GOOD)
    extra = {"control.url": "http://a:1", "control.token_file": "/t"} if "control" in key else {}
    for value, want in taken.items():
        given = list(value) if isinstance(value, tuple) else value  # TOML has arrays
        assert getattr(load_config(path, {**extra, key: given}), attribute) == want
    for value in refused:
        with pytest.raises(ConfigError, match=rf"{key}: must"):
            load_config(path, {**extra, key: value})
