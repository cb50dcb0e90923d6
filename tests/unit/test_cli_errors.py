"""Bad input to the CLI: a clear message naming what is wrong, a non-zero exit, nothing
started (none of these ever ran before)."""

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradlane import cli
from gradlane.daemon import control as control_module
from gradlane.daemon.control import ControlConfig
from gradlane.errors import ConfigError
from gradlane.policies.loadbalance import load_solver
from tests import REPO

TOKEN = "t0ken-for-tests-0123456789"


@pytest.fixture
def token(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return str(path)


@pytest.mark.parametrize("args, says", [
    (["control", "--listen", "nohost", "--token-file", "{token}"],
     "Invalid value for --listen: expected \"host:port\" with a port in 1..65535, got "
     "'nohost'"),
    (["control", "--token-file", "{token}", "--cadence", "5", "--ttl", "2"],
     "Invalid value for --ttl: 2 s is not more than --cadence (5 s): plans would expire "
     "between pushes"),
    (["control", "--token-file", "{token}", "--cadence", "0"],
     "Invalid value for '--cadence': 0.0 is not in the range 0<x<=3600."),
    (["control", "--token-file", "{token}", "--uplink", "fast"],
     "Invalid value for --uplink: bad rate 'fast': expected a number with a unit such as "
     "'100mbit'"),
    (["control", "--token-file", "{token}", "--max-weighed", "0"],
     "Invalid value for '--max-weighed': 0 is not in the range x>=1."),
    (["demo", "--rate", "fast"], "Invalid value for --rate: bad rate 'fast'"),
    (["probe"], "give a PEER to probe, or --serve to answer probes"),
    (["probe", "--serve", "10.0.0.1"], "give a PEER to probe, or --serve to answer probes"),
    (["probe", "127.0.0.1", "--dscp", "46,64"],
     "Invalid value for --dscp: '46,64': DSCP values 0-63, comma-separated"),
    (["probe", "127.0.0.1", "--dscp", "ef"],
     "Invalid value for --dscp: 'ef': DSCP values 0-63, comma-separated"),
    (["status", "--cluster", "--token-file", str(REPO / "no-such-token")],
     f"cannot read the token file {REPO / 'no-such-token'}: No such file or directory"),
    (["status", "--cluster", "--token-file", "{empty}"],
     "README.md: the token must be at least 16 characters"),
    (["bench", "table", str(REPO / "bench" / "results" / "trace-vgg19.json"),
      "--readme", "{empty}"], "has no <!-- bench-table:begin --> ... <!-- bench-table:end -->"
                             " markers"),
], ids=["listen", "ttl-under-cadence", "cadence-zero", "uplink", "max-weighed-zero",
        "demo-rate", "probe-nothing", "probe-both", "probe-dscp-over-63", "probe-dscp-by-name",
        "cluster-status-no-token", "cluster-status-short-token", "readme-without-markers"])
def test_bad_input_is_refused_saying_what(args: list[str], says: str, token: str,
                                           tmp_path: Path) -> None:
    empty = tmp_path / "README.md"
    empty.write_text("# no table here\n")
    shown = CliRunner().invoke(cli.cli, [a.format(token=token, empty=empty) for a in args])
    assert shown.exit_code in (1, 2), shown.output
    assert says in " ".join(shown.output.split()), shown.output
    assert "Traceback" not in shown.output
    assert empty.read_text() == "# no table here\n"  # left as it was


@pytest.mark.parametrize("args", [["control", "--token-file", "{token}"], ["sim", "cluster"]],
                         ids=["control", "sim"])
def test_without_scipy_the_planners_say_which_extra(args: list[str], token: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Daemon-only installs have no SciPy: what plans unequal links refuses at start, naming
    # the extra, before serving or simulating anything.
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # as if not installed
    shown = CliRunner().invoke(cli.cli, [a.format(token=token) for a in args])
    assert shown.exit_code == 1, shown.output
    assert "needs SciPy: pip install 'gradlane[control]'" in shown.output
    assert "Traceback" not in shown.output
    with pytest.raises(ConfigError, match=r"needs SciPy"):
        load_solver()


def test_a_cadence_under_the_reaction_time_is_taken(token: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Plans follow a change after react_s (0.05 s) at the earliest; a shorter cadence
    # shortens it too, rather than failing on a setting no flag sets.
    served: list[ControlConfig] = []

    async def serve(config: ControlConfig) -> None:
        served.append(config)

    monkeypatch.setattr(control_module, "serve", serve)
    monkeypatch.setattr(cli, "_log_as_a_service", lambda: None)
    shown = CliRunner().invoke(cli.cli, ["control", "--token-file", token, "--cadence", "0.01",
                                         "--ttl", "1", "--max-weighed", "1000"])
    assert shown.exit_code == 0, shown.output
    assert [(c.cadence_s, c.react_s, c.ttl_s) for c in served] == [(0.01, 0.01, 1.0)]
    assert [c.max_weighed for c in served] == [1000]  # and the other flags are taken


@pytest.mark.parametrize("args", [
    ["testbed", "up", "glnoroot"], ["testbed", "down", "glnoroot"], ["testbed", "clean"],
    ["testbed", "run", "glnoroot", "h1", "true"], ["testbed", "smoke", "--name", "glnoroot"],
    ["bench", "run", "trace-vgg19"],
], ids=["up", "down", "clean", "run", "smoke", "bench-run"])
def test_the_commands_that_need_root_say_what_is_missing_before_anything(
        args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import gradlane.benchmark
    import gradlane.daemon.preflight
    import gradlane.testbed
    import gradlane.testbed.smoke

    class WentOn(Exception):
        pass

    def went_on(*args: object, **kwargs: object) -> None:
        raise WentOn  # what the command does next: here, nothing

    for module, name in [(gradlane.testbed.Cluster, "up"), (gradlane.testbed, "remove_cluster"),
                         (gradlane.testbed, "clean"), (gradlane.testbed.netns, "enter"),
                         (gradlane.testbed.smoke, "run_smoke"),
                         (gradlane.benchmark, "run_scenario")]:
        monkeypatch.setattr(module, name, went_on)
    monkeypatch.setattr(gradlane.testbed.netns, "list_namespaces", lambda prefix: [f"{prefix}h1"])
    monkeypatch.setattr(cli.os, "geteuid", lambda: 1000)
    shown = CliRunner().invoke(cli.cli, args)
    assert shown.exit_code == 1, shown.output
    command = "gradlane " + " ".join(args[:2])
    assert f"{command} needs root" in shown.output and "run it with sudo" in shown.output
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    # A container's root, without the capabilities to make namespaces and qdiscs: said
    # before anything (was "mount rundir failed", from deep in the build).
    monkeypatch.setattr(gradlane.daemon.preflight, "effective_capabilities",
                        lambda: ((1 << 64) - 1) & ~(1 << 21))  # all but CAP_SYS_ADMIN
    shown = CliRunner().invoke(cli.cli, args)
    assert shown.exit_code == 1, shown.output
    assert (f"{command} needs CAP_SYS_ADMIN (it creates network namespaces and qdiscs), "
            "which this root lacks: in a container, run it privileged") in shown.output
    monkeypatch.setattr(gradlane.daemon.preflight, "effective_capabilities", lambda: 0)
    assert "needs CAP_SYS_ADMIN and CAP_NET_ADMIN (" in CliRunner().invoke(cli.cli, args).output
    monkeypatch.setattr(gradlane.daemon.preflight, "effective_capabilities",
                        lambda: (1 << 64) - 1)  # root with its capabilities goes on
    assert isinstance(CliRunner().invoke(cli.cli, args).exception, WentOn)


@pytest.mark.parametrize(("flags", "level"), [
    ([], "WARNING"), (["-v"], "INFO"), (["-vv"], "DEBUG"), (["-vvv"], "DEBUG")])
def test_each_v_gives_more_log_output_down_to_debug(flags: list[str], level: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    levels: list[int] = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    shown = CliRunner().invoke(cli.cli, [*flags, "testbed", "list"])
    assert shown.exit_code == 0, shown.output
    assert levels == [getattr(logging, level)]


def test_tables_on_stdout_show_users_names_as_written() -> None:
    # Job, host and scenario names are the users': "[/]" in one is text, not markup.
    console = cli._stdout_console()
    with console.capture() as captured:
        console.print("job a[/]b on [bold]h1")
    assert captured.get() == "job a[/]b on [bold]h1\n"
