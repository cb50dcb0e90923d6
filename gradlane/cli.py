"""The ``gradlane`` command line. The only place that reads the environment."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gradlane import __version__
from gradlane.errors import ConfigError, GradlaneError
from gradlane.signals import ending_signals, unwind_on_signals
from gradlane.units import first_of, format_rate, parse_rate

# The registered policies (`gradlane.policies.policy_names()`, which a test holds this to),
# named here so that --help does not import the policies (numpy).
POLICIES = "coflow, fair, fifo, gradlane, loadbalance, priority, straggler"
MAX_TTL_S = 1e6  # `control_protocol.MAX_TTL_S`, likewise (a test holds it to it)
MAX_WEIGHED = 1 << 27  # `gradlane.policies.DEFAULT_MAX_WEIGHED`, likewise

__all__ = ["main"]

console = Console(stderr=True)


def _require_root(what: str) -> None:
    from gradlane.testbed.netns import missing_privileges

    missing = missing_privileges()
    if missing == "root":
        raise click.ClickException(
            f"{what} needs root (it creates network namespaces and qdiscs); run it with sudo"
        )
    if missing:
        raise click.ClickException(
            f"{what} needs {missing} (it creates network namespaces and qdiscs), which this "
            "root lacks: in a container, run it privileged"
        )


def _writable(path: Path, option: str) -> Path:
    """`path`, once it is known a file can be written there: checked before a long
    run, not after it, when the results would be lost."""
    from gradlane.daemon.preflight import why_unwritable

    where = path.parent
    if not where.is_dir():
        raise click.BadParameter(f"{where} is not a directory", param_hint=option)
    why = why_unwritable(where)  # tried: root passes by modes, not by /proc or a read-only mount
    if why:
        raise click.BadParameter(why, param_hint=option)
    return path


def _default_result(name: str, option: str) -> Path:
    """Where a result goes without `option`: ``bench/results/`` in a checkout (where the
    shipped results are), else the current directory (gradlane installed elsewhere)."""
    results = Path("bench/results")
    return _writable(results / name if results.is_dir() else Path(name), option)


def _output(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Click callback of the options naming a file to write (`_writable`)."""
    return None if value is None else _writable(value, param.opts[0])


def _stdout_console() -> Console:
    """Tables on stdout; wide when piped, so that no cell wraps in a log or a test. No
    markup: job and host names are the users' ("a[/]b" would end the command)."""
    return Console(width=None if sys.stdout.isatty() else 160, markup=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gradlane")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """gradlane: priority lanes on the network for data-parallel training."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@cli.group()
def testbed() -> None:
    """An emulated cluster: hosts as network namespaces behind QoS switches.

    Namespaces are named gl-<cluster>-h<i> (hosts) and gl-<cluster>-sw
    (switches); host i has address 10.200.<nic>.<i>/24.
    """


@testbed.command()
@click.argument("name")
@click.option("--hosts", "-n", type=click.IntRange(2, 64), default=2, show_default=True,
              help="Hosts, each a network namespace with its own link.")
@click.option(
    "--rate",
    default="1gbit",
    show_default=True,
    help="Link rate of every host, or one per host: '1gbit,1gbit,500mbit'.",
)
@click.option(
    "--leaves",
    type=click.IntRange(1, 2),
    default=1,
    show_default=True,
    help="2 = two leaf switches joined by an uplink.",
)
@click.option("--uplink", default=None, help="Leaf-to-leaf rate (with --leaves 2), e.g. 1gbit.")
@click.option(
    "--nics",
    type=click.IntRange(1, 2),
    default=1,
    show_default=True,
    help="2 = a second NIC per host on a second switch plane.",
)
@click.option(
    "--queue-packets",
    type=click.IntRange(2, 100_000),
    default=1000,
    show_default=True,
    help="Buffer of every emulated queue, in packets.",
)
def up(
    name: str, hosts: int, rate: str, leaves: int, uplink: str | None, nics: int, queue_packets: int
) -> None:
    """Build cluster NAME and leave it running (remove it with `down`)."""
    from gradlane.testbed import Cluster, Topology

    _require_root("gradlane testbed up")
    topo = Topology.build(
        name, hosts, rate, leaves=leaves, uplink=uplink, nics=nics, queue_packets=queue_packets
    )
    Cluster(topo).up()
    table = Table(title=f"cluster {name}")
    for column in ("host", "namespace", "leaf", "rate", *(f"eth{k}" for k in range(nics))):
        table.add_column(column)
    for h in range(1, topo.hosts + 1):
        addrs = [topo.address(h, k) for k in range(nics)]
        table.add_row(
            f"h{h}", topo.host_ns(h), str(topo.leaf_of(h)), format_rate(topo.rates[h - 1]), *addrs
        )
    Console().print(table)


@testbed.command()
@click.argument("name")
def down(name: str) -> None:
    """Remove cluster NAME and stop everything running in it."""
    from gradlane.testbed import remove_cluster

    _require_root("gradlane testbed down")
    removed = remove_cluster(name)
    if not removed:
        raise click.ClickException(f"no cluster named {name!r} (see: gradlane testbed list)")
    click.echo(f"removed {', '.join(removed)}")


@testbed.command(name="list")
def list_() -> None:
    """List the clusters that exist now."""
    from gradlane.testbed import cluster_names

    for name in cluster_names():
        click.echo(name)


@testbed.command()
def clean() -> None:
    """Remove every gl-* namespace and link, e.g. left by a crashed run."""
    from gradlane.testbed import clean as clean_all

    _require_root("gradlane testbed clean")
    removed = clean_all()
    click.echo(f"removed {', '.join(removed)}" if removed else "nothing to clean")


@testbed.command(context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.argument("host")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def run(name: str, host: str, argv: tuple[str, ...]) -> None:
    """Run ARGV in HOST (h1, h2, ...) of cluster NAME: `run c1 h1 -- cmd args`."""
    from gradlane.testbed import netns

    _require_root("gradlane testbed run")
    index = host[1:] if host.startswith("h") else host
    namespace = f"gl-{name}-h{index}"
    present = netns.list_namespaces(f"gl-{name}-")
    if namespace not in present:
        hosts = sorted((ns.rsplit("-", 1)[1] for ns in present if ns != f"gl-{name}-sw"),
                       key=lambda h: int(h[1:]) if h[1:].isdigit() else 0)
        raise click.ClickException(
            f"cluster {name!r} has no host {host!r} (its hosts: {', '.join(hosts)})" if hosts
            else f"no cluster named {name!r} (see: gradlane testbed list)")
    netns.enter(namespace)
    try:
        os.execvp(argv[0], list(argv))
    except OSError as exc:
        raise click.ClickException(f"cannot run {argv[0]!r}: {exc.strerror}") from exc


@testbed.command()
@click.option("--rate", default="200mbit", show_default=True, help="Link rate of both hosts.")
@click.option(
    "--seconds",
    type=click.FloatRange(2, 60),
    default=4,
    show_default=True,
    help="Length of each measurement.",
)
@click.option("--name", default="smoke", show_default=True, help="Cluster name to use.")
def smoke(rate: str, seconds: float, name: str) -> None:
    """Two hosts, a DSCP-high and a DSCP-low flow at once: FIFO vs gradlane."""
    from gradlane.testbed.smoke import run_smoke

    _require_root("gradlane testbed smoke")
    with console.status("smoke scenario") as status:
        result = run_smoke(
            parse_rate(rate), seconds, name, progress=lambda text: status.update(text)
        )
    table = Table(
        title=f"smoke: 2 hosts at {format_rate(result.rate_bps)}, "
        f"DSCP-low bulk flow h1 -> h2, DSCP-high joins after 1s ({seconds:g}s)"
    )
    table.add_column("sender egress")
    table.add_column("DSCP-high goodput", justify="right")
    table.add_column("DSCP-low goodput", justify="right")
    table.add_column("high share", justify="right")
    for label, hi, lo in (
        ("host default (NIC FIFO)", result.fifo_high_bps, result.fifo_low_bps),
        ("gradlane tree (band 0 / band 3)", result.gradlane_high_bps, result.gradlane_low_bps),
    ):
        table.add_row(
            label, format_rate(hi) + "/s", format_rate(lo) + "/s", f"{hi / (hi + lo):.1%}"
        )
    Console().print(table)


@cli.command()
@click.option(
    "--hosts",
    type=click.IntRange(2, 8),
    default=4,
    show_default=True,
    help="Emulated hosts, one worker each.",
)
@click.option(
    "--rate", default=None, help="Link rate, e.g. 200mbit. Default: where communication ~ compute."
)
@click.option(
    "--steps",
    type=click.IntRange(10, 10_000),
    default=60,
    show_default=True,
    help="Training steps per system.",
)
@click.option(
    "--png",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("gradlane-demo.png"),
    show_default=True,
    callback=_output,
    help="Figure to write.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=_output,
    help="Also write the raw numbers as JSON.",
)
def demo(hosts: int, rate: str | None, steps: int, png: Path, json_path: Path | None) -> None:
    """Train one small CNN under PyTorch DDP and under gradlane, and compare.

    As root: an emulated cluster (one worker per host, torchrun in each),
    gradlaned on every host for the gradlane run; a table of iteration times,
    bytes on the wire, link utilization and final losses, and a PNG of
    per-band link usage and iteration times. Without root: the same two runs
    on loopback, without traffic control.
    """
    from gradlane.demo import run_demo
    from gradlane.provenance import start

    try:
        rate_bps = parse_rate(rate) if rate else None
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--rate") from None
    start()  # the checkout the run's results come from
    run_demo(
        hosts=hosts,
        rate=rate_bps,
        steps=steps,
        png=png,
        json_path=json_path,
        console=_stdout_console(),
    )


@cli.group()
def bench() -> None:
    """Benchmarks: every system measured in the same run, against the physical bound.

    Scenario files live in bench/scenarios/; results are JSON with the
    environment (commit, kernel, CPU, versions) and every raw iteration time.
    """


def _scenario(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    """Click callback of SCENARIO: a TOML file, or the name of one in the checkout's
    ``bench/scenarios/`` (``trace-vgg19``)."""
    from gradlane.provenance import REPO

    given = Path(value)
    if given.is_file():
        return given
    shipped = REPO / "bench" / "scenarios"
    named = shipped / f"{value}.toml"
    if given.name == value and named.is_file():
        return named
    names = sorted(p.stem for p in shipped.glob("*.toml"))
    raise click.BadParameter(
        f"no file {value!r}" + (f", nor a scenario of that name (those in {shipped}: "
                                f"{', '.join(names)})" if names else ""), param=param)


@bench.command(name="run")
@click.argument("scenario", callback=_scenario)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=_output,
    help="Result file (default: bench/results/<name>.json; <name>.json outside a checkout).",
)
@click.option(
    "--system",
    "systems",
    multiple=True,
    help="Run only this one of the scenario's systems (repeatable); `local`, the bound's "
    "compute, always runs. Needs --json: a partial run never replaces the scenario's result.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Rounds instead of the scenario's (needs --json, as --system).",
)
def bench_run(
    scenario: Path, json_path: Path | None, systems: tuple[str, ...], rounds: int | None
) -> None:
    """Run SCENARIO (a TOML file, or the name of one in bench/scenarios/) on an emulated
    cluster (needs root).

    A run that stops early (a system fails, Ctrl-C) keeps the runs it
    measured, raw, in the result's name with .partial.json (which a complete
    run then replaces).

    \b
    sudo gradlane bench run bench/scenarios/trace-vgg19.toml
    sudo gradlane bench run trace-vgg19 --system gradlane \\
        --rounds 1 --json /tmp/vgg19-gradlane.json   # a quick look at one system
    """
    from gradlane.benchmark import CELL_NAMES, cells, load_scenario, narrowed, run_scenario
    from gradlane.provenance import start, write_result

    start()  # the checkout the run's results come from

    if (systems or rounds is not None) and json_path is None:
        raise click.UsageError("--system and --rounds need --json: a partial run must not "
                               "replace the scenario's result in bench/results/")
    spec = load_scenario(scenario)
    try:
        spec = narrowed(spec, systems, rounds)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    path = json_path or _default_result(f"{spec.name}.json", "--json")
    _require_root("gradlane bench run")
    out = _stdout_console()
    partial = path.with_name(f"{path.stem}.partial.json")

    def keep(data: dict[str, Any]) -> None:
        write_result(partial, data)
        count = sum(len(rs) for rs in data["runs"].values())
        out.log(f"{data['stopped_by']}; what it measured before ({count} "
                f"run{'' if count == 1 else 's'}) is in {partial}")

    result = run_scenario(spec, say=lambda text: out.log(text), keep_partial=keep)
    write_result(path, result)
    partial.unlink(missing_ok=True)  # an earlier stopped run's, superseded
    title = f"{spec.name}: lower bound {result['lower_bound_s'] * 1000:.1f} ms"
    if result.get("dependency_bound_s"):
        title += f", with the layers' order {result['dependency_bound_s'] * 1000:.1f} ms"
    table = Table(title=title)
    for col in ("system", "median", "p90", *CELL_NAMES):
        table.add_column(col, justify="left" if col == "system" else "right")
    for system, s in result["summary"].items():
        table.add_row(
            system, f"{s['median_s'] * 1000:.1f} ms", f"{s['p90_s'] * 1000:.1f} ms", *cells(s)
        )
    out.print(table)
    out.print(f"-> {path}")


@bench.command(name="plot")
@click.argument("result", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--png",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=_output,
    help="Figure to write (default: next to RESULT).",
)
def bench_plot(result: Path, png: Path | None) -> None:
    """Draw RESULT's iteration times per system with the lower bound."""
    from gradlane.benchmark import is_bench_result, is_partial, plot, read_result, reading

    data = read_result(result)
    if is_partial(data):
        raise click.ClickException(f"{result}: the runs a stopped run measured "
                                   f"({data.get('stopped_by')}), no summary to plot")
    if not is_bench_result(data):
        raise click.ClickException(f"{result}: not a result of `gradlane bench run` (no "
                                   "per-system summary against a lower bound)")
    target = png or result.with_suffix(".png")
    reading(result, lambda: plot(data, target))
    click.echo(target)


@bench.command(name="table")
@click.argument(
    "results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--readme",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Replace the table between the README's bench markers.",
)
def bench_table(results: tuple[Path, ...], readme: Path | None) -> None:
    """The results table (Markdown) from RESULTS files; never typed by hand.

    Files of other benchmarks (the simulator's, the daemon's) are left out, so
    bench/results/*.json can be given as it is."""
    from gradlane.benchmark import is_bench_result, markdown_table, read_result, reading

    data = [read_result(p) for p in results]
    if not any(map(is_bench_result, data)):
        raise click.ClickException("none of these is a result of `gradlane bench run`")
    for path, result in zip(results, data, strict=True):
        if is_bench_result(result):  # the others are left out
            reading(path, functools.partial(markdown_table, [result]))
    text = markdown_table(data)
    if readme is None:
        click.echo(text)
        return
    begin, end = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"
    body = readme.read_text()
    if begin not in body or end not in body:
        raise click.ClickException(f"{readme} has no {begin} ... {end} markers")
    head, rest = body.split(begin, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
    click.echo(f"updated {readme}")


@cli.command()
@click.argument("experiment", type=click.Choice(["cluster", "coflows", "heterogeneous",
                                                  "validate"]), default="cluster")
@click.option("--policy", "policies", multiple=True,
              help=f"Policy to simulate: {POLICIES} (repeatable; default: all that the "
                   "experiment compares).")
@click.option("--seed", default=0, show_default=True, help="Placement and job-mix seed.")
@click.option("--hosts", default=1024, show_default=True,
              help="Cluster size for 'cluster' (a multiple of 32).")
@click.option("--mixed", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="'cluster': fraction of servers of an older GPU generation (0.68x speed).")
@click.option("--load", default=0.8, show_default=True,
              help="'coflows': how busy the busiest link is on average (0..1, exclusive).")
@click.option("--buckets", type=int, default=None,
              help="'cluster', 'coflows': cut each model into about N DDP-like buckets "
                   "instead of the shim's own layer groups (the default).")
@click.option("--store-forward", is_flag=True,
              help="'cluster', 'coflows': each chunk's reduction tree a stage after the "
                   "other, as the shim stores and forwards it, instead of a bucket's flows "
                   "all at once (about 9 times slower: 10 minutes for fifo and gradlane at "
                   "1,024 hosts, 35 for every policy).")
@click.option("--results", "results_dir", default=Path("bench/results"), show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Testbed results that 'validate' replays.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, callback=_output,
              help="Result file (default: bench/results/sim-EXPERIMENT.json, a suffix per "
                   "option that changes the scenario, e.g. -hosts64; in the current "
                   "directory outside a checkout).")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=_output, help="Figure (default: next to the JSON).")
def sim(experiment: str, policies: tuple[str, ...], seed: int, hosts: int, mixed: float,
        load: float, buckets: int | None, store_forward: bool, results_dir: Path,
        json_path: Path | None, png: Path | None) -> None:
    """Run a flow-level simulation EXPERIMENT (no root, no network needed).

    \b
    cluster        1,024 hosts, 2:1 leaf/spine, 8 jobs; every policy compared
    coflows        the same, open loop: Poisson coflow arrivals; coflow vs fair CCT
    heterogeneous  4 workers at speeds 1, 1, 1, 0.5 against the ideal
    validate       the testbed's trace scenarios replayed, sim vs measured
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gradlane.policies.loadbalance import require_solver
    from gradlane.provenance import start, write_result
    from gradlane.simulation import plot, run_experiment

    start()  # the checkout the run's results come from

    try:
        require_solver()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    suffix = "-mixed" if experiment == "cluster" and mixed else ""
    if experiment == "coflows" and load != 0.8:
        suffix = f"-load{load:g}"
    if experiment in ("cluster", "coflows"):
        # Every variant a file of its own: the shipped results are the defaults'.
        suffix += f"-hosts{hosts}" if hosts != 1024 else ""
        suffix += f"-buckets{buckets}" if buckets is not None else ""
        suffix += "-store-forward" if store_forward else ""
    path = json_path or _default_result(f"sim-{experiment}{suffix}.json", "--json")
    out = _stdout_console()
    # A bar only on a terminal: rich has nothing to draw in a pipe, yet writes an empty line.
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=out, transient=True, disable=not out.is_terminal) as bar:
        tasks: dict[str, Any] = {}

        def progress(policy: str, fraction: float) -> None:
            if policy not in tasks:
                tasks[policy] = bar.add_task(f"{experiment}: {policy}", total=1.0)
            bar.update(tasks[policy], completed=fraction)

        try:
            result = run_experiment(experiment, policies or None, seed, hosts, results_dir,
                                    mixed, progress, load, buckets, store_forward)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        except MemoryError as exc:  # numpy's says how much it asked for
            raise click.ClickException(
                f"not enough memory for the {experiment} experiment at {hosts} hosts ({exc}): "
                "fewer --hosts (a job's reduction trees take memory by the square of its "
                "ranks)") from None
    write_result(path, result)
    figure = png or path.with_suffix(".png")
    plot(result, figure)
    out.print(_sim_table(result))
    for name, r in result.get("results", {}).items():  # 'validate' has scenarios instead
        if r.get("growing"):
            out.print(f"{name}: the backlog grew through the run for {', '.join(r['growing'])} "
                      "(more load than it sustains for them: their CCT depends on the run's "
                      "length)")
    out.print(f"-> {path}, {figure}")


def _sim_table(result: dict[str, Any]) -> Table:
    if result["experiment"] == "validate":
        table = Table(title=f"simulator vs testbed (max error {result['max_abs_error']:.0%})")
        for col in ("scenario", "system", "testbed", "simulated", "error"):
            table.add_column(col)
        for r in result["rows"]:
            table.add_row(r["scenario"], r["system"], f"{r['measured_s'] * 1000:.1f} ms",
                          f"{r['simulated_s'] * 1000:.1f} ms", f"{r['error']:+.1%}")
        return table
    title = f"gradlane sim {result['experiment']}"
    if result.get("gradlane_vs_fifo_iteration"):
        title += f": gradlane vs fifo {result['gradlane_vs_fifo_iteration']:.2f}x iteration"
    if result.get("coflow_vs_fair_cct"):
        title += f", coflow vs fair {result['coflow_vs_fair_cct']:.2f}x CCT"
    if result.get("cct_ceiling"):
        title += f" (no order can beat {result['cct_ceiling']:.2f}x)"
    if "ideal_s" in result:
        title += f": ideal {result['ideal_s'] * 1000:.1f} ms"
    table = Table(title=title)
    for col in ("policy", "mean iteration", "mean CCT", "host util", "uplink util",
                "plan median", "wall"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in result["results"].items():
        util = r["utilization"]
        iteration = r["mean_iteration_s"]
        table.add_row(
            name, f"{iteration * 1000:.1f} ms" if iteration is not None else "-",
            f"{r['mean_cct_s'] * 1000:.1f} ms",
            f"{util['host']:.2f}", f"{util['uplink']:.2f}" if "uplink" in util else "-",
            f"{r['plan_ms_median']:.1f} ms" if r["plan_ms_median"] is not None else "-",
            f"{r['wall_s']:.1f} s",
        )
    return table


DEFAULT_TOKEN = Path("/etc/gradlane/control.token")


@cli.command()
@click.option("--listen", default="127.0.0.1:7800", show_default=True,
              help="host:port to serve daemons and the API on.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              default=DEFAULT_TOKEN, show_default=True,
              help="File holding the bearer token daemons and clients must send (>= 16 chars).")
@click.option("--policy", default="gradlane", show_default=True,
              help=f"Global policy: {POLICIES} (gradlane: priority, loadbalance and "
                   "straggler composed, coflow's order reported), or "
                   "package.module:Class.")
@click.option("--cadence", default=1.0, show_default=True,
              type=click.FloatRange(0, 3600, min_open=True), help="Seconds between plans.")
@click.option("--ttl", default=10.0, show_default=True,
              type=click.FloatRange(0, MAX_TTL_S, min_open=True, max_open=True),
              help="Seconds a daemon may keep a plan without hearing from the control plane "
                   "(more than --cadence).")
@click.option("--uplink", default=None,
              help="Each leaf switch's uplink rate to the spine, e.g. 40gbit; daemons report "
                   "their leaf. Default: a non-blocking fabric.")
@click.option("--max-weighed", default=MAX_WEIGHED, show_default=True,
              type=click.IntRange(min=1),
              help="The most loads (owners weighed x host links) a job's chunk-owner shares "
                   "may weigh, about 10 bytes each at a plan's peak within leaves (the "
                   "default: 1.3 GB), 50 on the ring; past it the job gets even owners and "
                   "its plan a note. Lower it on a host with less memory.")
def control(listen: str, token_file: Path, policy: str, cadence: float, ttl: float,
            uplink: str | None, max_weighed: int) -> None:
    """Run the control plane in the foreground until SIGTERM/SIGINT (or a hang-up).

    Daemons connect to ws://LISTEN/api/v1/daemon; GET /api/v1/cluster shows
    the cluster, /metrics the Prometheus metrics (both need the token).
    """
    import asyncio

    from gradlane.daemon.config import host_port
    from gradlane.daemon.control import ControlConfig, read_token, serve
    from gradlane.policies.loadbalance import require_solver

    try:
        require_solver()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        host, port = host_port(listen)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    if ttl <= cadence:
        raise click.BadParameter(f"{ttl:g} s is not more than --cadence ({cadence:g} s): plans "
                                 "would expire between pushes", param_hint="--ttl")
    try:
        uplink_bps = None if uplink is None else parse_rate(uplink)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--uplink") from None
    try:
        config = ControlConfig(token=read_token(token_file), host=host, port=port,
                               policy=policy, cadence_s=cadence, ttl_s=ttl,
                               max_weighed=max_weighed,
                               # Plans follow a change this soon, at the earliest: never
                               # later than the cadence (a --cadence under 0.05 s).
                               react_s=min(ControlConfig.react_s, cadence),
                               uplink_bps=uplink_bps)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    _log_as_a_service()

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (*ending_signals(), signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(config)

    asyncio.run(main())


# The most `gradlane status` reads of an answer (a control plane's view of 1,024 hosts is
# well under a MiB): something else on the port cannot feed it without end.
MAX_STATUS_BYTES = 64 << 20


def _get_json(url: str, who: str, headers: dict[str, str] | None = None,
              unanswered: str = "", unauthorized: str = "") -> Any:
    """GET `url` as JSON; a refusal or no answer becomes a clear error naming `who` (and
    what to check: for no answer `unanswered`, for a 401 `unauthorized`)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            body = resp.read(MAX_STATUS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        hint = f"\n{unauthorized}" if exc.code == 401 and unauthorized else ""
        raise click.ClickException(f"the {who} at {url} said {exc.code}: "
                                   f"{exc.read().decode(errors='replace').strip()}{hint}"
                                   ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"no {who} answers at {url}: {exc}"
                                   + (f"\n{unanswered}" if unanswered else "")) from None
    try:
        if len(body) > MAX_STATUS_BYTES:
            raise ValueError(f"more than {MAX_STATUS_BYTES:,} bytes")
        return json.loads(body)
    except ValueError as exc:  # not JSON (nor text): another program on the port
        raise click.ClickException(f"what answers at {url} is not a {who}: its answer is "
                                   f"not JSON ({exc})") from None


# How a job reduces, as its shims said ("exchange"; None: not said yet).
_EXCHANGE = {"leaf": "in leaves first", "host": "in hosts first", "flat": "flat", "ring": "ring"}


# `gradlane status --cluster` without --all: more hosts than this are shown a leaf a row,
# more ranks a job than this its shares' range.
WHOLE_HOSTS, WHOLE_RANKS = 32, 8


def _spread(values: list[float], each: str, every: bool, unit: str = "") -> str:
    """A job's per-rank figures: `each` of them for a few ranks (or `every`), else their
    range."""
    if every or len(values) <= WHOLE_RANKS:
        return each
    low, high = min(values), max(values)
    spread = f"{low:g}{unit} each" if low == high else f"{low:g}-{high:g}{unit}"
    return f"{spread} ({len(values)} ranks)"


def _readable(show: Callable[[], None], who: str) -> None:
    """`show()` a status; one of a shape this gradlane does not read (another version's, or
    another program's on that port) is said so, not shown as a traceback."""
    try:
        show()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise click.ClickException(
            f"{who} answered with a status this gradlane ({__version__}) cannot read "
            f"({type(exc).__name__}: {exc}): is it another version? --json shows it as it is"
        ) from None


def _cluster_status(url: str, token_file: Path, as_json: bool, every: bool = False) -> None:
    import json

    from gradlane.daemon.control import read_token

    try:
        token = read_token(token_file)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    data = _get_json(f"{url.rstrip('/')}/api/v1/cluster", "control plane",
                     {"Authorization": f"Bearer {token}"},
                     "Is `gradlane control` running there? Give its --listen address as --url.")
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    _readable(lambda: _print_cluster(data, every), f"the control plane at {url}")


def _print_cluster(data: Any, every: bool) -> None:
    out = _stdout_console()
    plan = data["plan"]
    out.print(f"gradlane control {data['version']}, policy {data['policy']}, "
              + (f"plan v{plan['version']} ({plan['age_s']}s old, ttl {plan['ttl_s']}s)"
                 if plan else "no plan yet"))
    failed = data.get("planning_failed")  # a control plane older than this one does not say
    if failed:
        out.print(Text.assemble(
            (f"planning FAILED {failed['times']} time(s) since the last plan, last "
             f"{failed['last_s_ago']:.1f}s ago: ", "bold red"), failed["error"],
            "; the daemons keep the last plan until its TTL runs out, then use their local "
            "policy (the control plane's log has the traceback)"))
    for note in (plan or {}).get("notes", []):  # an older control plane's plan has none
        out.print(Text.assemble(("plan: ", "bold yellow"), note))
    if every or len(data["hosts"]) <= WHOLE_HOSTS:
        hosts = Table(title="hosts")
        for column in ("host", "leaf", "connected", "last seen", "gradlane", "interfaces",
                       "link (planned)"):
            hosts.add_column(column)
        for h in data["hosts"]:
            hosts.add_row(h["host"], str(h["leaf"]), "yes" if h["connected"] else "LOST",
                          f"{h['seen_s_ago']:.1f}s ago", h["gradlane"],
                          ", ".join(f"{i['name']} {format_rate(i['rate_bps'])}"
                                    for i in h["interfaces"]),
                          format_rate(h["link_bps"]) if h.get("link_bps") else "-")
    else:  # a leaf a row: what a large cluster's operator looks for is what is LOST
        hosts = Table(title=f"hosts: {len(data['hosts'])}, a leaf a row (--all: each host)")
        for column in ("leaf", "hosts", "connected", "LOST", "gradlane", "links (planned)"):
            hosts.add_column(column)
        leaves: dict[int, list[dict[str, Any]]] = {}
        for h in data["hosts"]:
            leaves.setdefault(h["leaf"], []).append(h)
        for leaf, members in sorted(leaves.items()):
            lost = [h["host"] for h in members if not h["connected"]]
            links = sorted({h["link_bps"] for h in members if h.get("link_bps")})
            hosts.add_row(str(leaf), str(len(members)), str(len(members) - len(lost)),
                          first_of(lost, 5) or "-",
                          ", ".join(sorted({h["gradlane"] for h in members})),
                          ", ".join(format_rate(r) for r in links) or "-")
    if data["hosts"]:
        out.print(hosts)
    else:
        out.print("hosts: none has registered yet (each gradlaned does with its [control] url "
                  "and this token)")
    jobs = Table(title="jobs")
    for column in ("job", "workers", "hosts", "state", "exchange", "sending",
                   "demand / iteration", "coflow order", "batch shares", "owned bytes"):
        jobs.add_column(column)
    order = (plan or {}).get("coflow_order", [])
    level = (plan or {}).get("job_level", {})  # `gradlane` reports an order, keeps one level
    for name, j in sorted(data["jobs"].items()):
        shares = (plan or {}).get("batch_shares", {}).get(name)
        owned = (plan or {}).get("owned_shares", {}).get(name)  # by rank, of the model
        percent = [round(share * 100) for share in owned or []]
        sending = sum(j.get("band_bps", []))  # what its classes carry now (gradlaned measures)
        jobs.add_row(name, str(j["workers"]), str(len(j["hosts"])),
                     "DEGRADED" if j["degraded"] else "ok",
                     _EXCHANGE.get(j.get("exchange"), "-"),
                     format_rate(round(sending)) if sending else "-",
                     f"{j['demand_bytes'] / 1e6:.2f} MB" if j.get("demand_bytes") else "-",
                     f"{order.index(name) + 1} (level {level.get(name, 0)})" if name in order
                     else "-",
                     (_spread(shares, str(shares), every)
                      + (f" of {j['global_batch']}" if j.get("global_batch") else ""))
                     if shares else "-",
                     _spread(percent, "/".join(map(str, percent)) + "%", every, "%")
                     if owned else "-")
    out.print(jobs if data["jobs"] else "jobs: none (no host has reported a training job)")


DEFAULT_CONFIG = Path("/etc/gradlane/gradlaned.toml")


def _daemon_options(fn: Any) -> Any:
    options = [
        click.option(
            "--config",
            "config_path",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help=f"TOML config file [default: {DEFAULT_CONFIG} if it exists].",
        ),
        click.option(
            "--interface",
            "-i",
            multiple=True,
            help="Interface to manage, IF or IF=RATE (e.g. eth0=25gbit); repeatable. "
            "Replaces the file's [[interface]] list.",
        ),
        click.option("--socket", "socket_path", default=None, help="Unix socket for shims."),
        click.option("--http", default=None, help="host:port for /status and /metrics; '' = off."),
        click.option("--state-dir", default=None, help="Where original qdiscs are recorded."),
        click.option("--policy", default=None,
                     help=f"Local policy: {POLICIES}, or package.module:Class [default: "
                          "the file's, else fair]."),
        click.option(
            "--on-start",
            type=click.Choice(["takeover", "restore"]),
            default=None,
            help="What to do with a tree a crashed run left behind.",
        ),
        click.option("--control-url", default=None,
                     help="The control plane, e.g. http://10.0.0.5:7800 (default: none)."),
        click.option("--control-token-file", default=None, help="Its bearer token's file."),
        click.option("--control-host", default=None, help="Name to register as (hostname)."),
        click.option("--control-leaf", type=int, default=None, help="This host's leaf switch."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_daemon_config(
    config_path: Path | None,
    interface: tuple[str, ...],
    socket_path: str | None,
    http: str | None,
    state_dir: str | None,
    policy: str | None,
    on_start: str | None,
    control_url: str | None = None,
    control_token_file: str | None = None,
    control_host: str | None = None,
    control_leaf: int | None = None,
) -> tuple[Path | None, dict[str, Any]]:
    if config_path is None and DEFAULT_CONFIG.exists():
        config_path = DEFAULT_CONFIG
    overrides: dict[str, Any] = {}
    if interface:
        overrides["interface"] = list(interface)
    for key, value in (
        ("daemon.socket", socket_path),
        ("daemon.http", http),
        ("daemon.state_dir", state_dir),
        ("daemon.policy", policy),
        ("daemon.on_start", on_start),
        ("control.url", control_url),
        ("control.token_file", control_token_file),
        ("control.host", control_host),
        ("control.leaf", control_leaf),
    ):
        if value is not None:
            overrides[key] = value
    return config_path, overrides


_CHECK = click.option(
    "--check", is_flag=True,
    help="Check this node and the configuration instead of running: privileges, interfaces, "
    "the kernel's HTB and u32 (on a scratch veth), socket, state dir, HTTP port, control "
    "plane. Changes nothing; exits 1 if gradlaned would not start or would have no effect.")


def check_daemon(config_path: Path | None, overrides: dict[str, Any]) -> None:
    """`--check`: every preflight finding as a table; exit 1 on a failed one."""
    from gradlane.daemon.config import load_config
    from gradlane.daemon.preflight import FAIL, preflight

    config = load_config(config_path, overrides)
    findings = preflight(config)
    # One line a check, whole (grep-able, no cell wrapping): "ok    interface eth0: ...".
    out = _stdout_console()
    out.print(f"gradlaned --check, configuration: {config.source}", soft_wrap=True)
    styles = {"ok": "green", "warn": "yellow", FAIL: "bold red"}
    for f in findings:
        out.print(Text.assemble((f"{f.level:<5}", styles[f.level]), f" {f.check}: {f.detail}"),
                  soft_wrap=True)
    failed = [f.check for f in findings if f.level == FAIL]
    if failed:
        console.print("[red]gradlaned would not run as configured:[/red]",
                      escape(", ".join(failed)))
        sys.exit(1)


def run_daemon(config_path: Path | None, overrides: dict[str, Any]) -> None:
    """Run gradlaned in the foreground until SIGTERM/SIGINT; SIGHUP reloads the config."""
    import asyncio

    from gradlane.daemon.config import load_config
    from gradlane.daemon.service import Daemon

    config = load_config(config_path, overrides)

    async def serve() -> None:
        daemon = Daemon(config)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, daemon.stop)
        loop.add_signal_handler(signal.SIGINT, daemon.stop)

        reloads: set[asyncio.Task[None]] = set()  # the loop holds its tasks weakly

        def reload() -> None:
            try:
                new = load_config(config_path, overrides)
            except GradlaneError as exc:
                logging.getLogger("gradlane.daemon").error("reload refused: %s", exc)
                return
            task = loop.create_task(daemon.reload(new))
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, reload)
        await daemon.serve(notify_socket=os.environ.get("NOTIFY_SOCKET"))

    asyncio.run(serve())


@cli.command()
@_daemon_options
@_CHECK
def daemon(check: bool, **kwargs: Any) -> None:
    """Run gradlaned, the per-host daemon, in the foreground (as `gradlaned` does)."""
    if not check:
        _log_as_a_service()
    (check_daemon if check else run_daemon)(*_load_daemon_config(**kwargs))


def _log_as_a_service() -> None:
    """A service in the foreground logs at INFO at least, as `gradlaned` does: when it is
    ready, what it serves, who registers (without -v the commands log warnings only)."""
    root = logging.getLogger()
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)


def _http_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`value` if it is an http(s) URL with a host (and a port, if any, in range)."""
    import urllib.parse

    if value is None:
        return None
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not one
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or \
            any(c.isspace() for c in value):
        raise click.BadParameter(f"{value!r} is not an address such as http://10.0.0.5:9464")
    return value


@cli.command()
@click.option(
    "--url", default=None, callback=_http_url,
    help="The daemon's HTTP address [default: http://127.0.0.1:9464], "
    "or with --cluster the control plane's [default: http://127.0.0.1:7800]."
)
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON (for scripts).")
@click.option("--cluster", is_flag=True, help="Ask the control plane for the whole cluster.")
@click.option("--all", "every", is_flag=True,
              help=f"--cluster: every host and rank (more than {WHOLE_HOSTS} hosts are shown "
              f"a leaf a row, more than {WHOLE_RANKS} ranks' shares as a range).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              default=DEFAULT_TOKEN, show_default=True, help="The control plane's token.")
def status(url: str | None, as_json: bool, cluster: bool, every: bool, token_file: Path
           ) -> None:
    """Show a running gradlaned's jobs, workers and classes (or, --cluster, every host's)."""
    import json

    if cluster:
        _cluster_status(url or "http://127.0.0.1:7800", token_file, as_json, every)
        return
    if every:
        raise click.UsageError("--all goes with --cluster (a daemon shows all it has)")
    url = url or "http://127.0.0.1:9464"
    data = _get_json(f"{url.rstrip('/')}/status", "gradlaned", unanswered=(
        "Is gradlaned running on this host (systemctl status gradlaned)? It serves /status on "
        "its [daemon] http address (default 127.0.0.1:9464; \"\" turns it off): give another "
        "as --url."), unauthorized=(
        "gradlaned asks for no token: what answers there may be the control plane, whose "
        "view is `gradlane status --cluster`."))
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    _readable(lambda: _print_daemon(data), f"the gradlaned at {url}")


def _print_daemon(data: Any) -> None:
    from gradlane.daemon.service import VERIFY_EVERY, VERIFY_SHARE

    # Piped output is not cut to 80 columns: scripts and logs need whole class ids.
    out = _stdout_console()
    plan = data["plan"]
    out.print(
        f"gradlaned {data['version']}, up {data['uptime_s']:.0f}s, policy {data['policy']}, "
        f"plan from {plan['source']} ({plan['age_s']}s old) for a "
        f"{format_rate(data['link_bps'])} link, "
        f"{data['reconcile']['count']} reconciles, {data['reconcile']['errors']} errors, "
        f"{data['clients']} clients, API errors {data['api_errors'] or 'none'}"
    )
    pace = data["reconcile"].get("verify_every_s")  # an older gradlaned: not said
    if pace and pace > VERIFY_EVERY:
        out.print(f"re-reads the kernel's trees every {pace:.0f}s, not every "
                  f"{VERIFY_EVERY:.0f}s: a re-read took over {VERIFY_SHARE:.0%} of that")
    left_out = (data.get("control") or {}).get("left_out")  # an older gradlaned: not said
    if left_out:
        out.print(Text(f"the report to the control plane leaves out {first_of(left_out, 3)}: "
                       "planned without it (the log says why)", "bold yellow"))
    jobs = Table(title="jobs")
    for column in ("job", "rank", "pid", "flows", "exchange", "batch", "iteration",
                   "chunk events", "bytes by band"):
        jobs.add_column(column)
    for job in data["jobs"]:
        for w in job["workers"]:
            # Its latest step's samples, of the job's global batch (what shares split).
            samples = (w.get("last_timing") or {}).get("samples") or "-"
            jobs.add_row(
                job["name"],
                str(w["rank"]),
                str(w["pid"]),
                # Left out by its shim (more than a worker registers): an older gradlaned's
                # status has no such field.
                f"{w['flows']} ({w['flows_left_out']:,} left out)" if w.get("flows_left_out")
                else str(w["flows"]),
                _EXCHANGE.get(w.get("exchange"), "-"),
                f"{samples} of {w['global_batch']}" if w.get("global_batch") else str(samples),
                str(w["iteration"]),
                str(w["chunk_events"]),
                str(w["chunk_bytes"]),
            )
    out.print(jobs if data["jobs"] else "jobs: none (no training process has registered)")
    for iface in data["interfaces"]:
        if iface.get("not_shaped"):  # an operator's own root qdisc, left alone
            out.print(Text(f"{iface['name']}: not shaped: {iface['not_shaped']}", "bold yellow"))
            continue
        classes = Table(title=f"{iface['name']}: shaped to {format_rate(iface['shaped_bps'])}")
        for column in (
            "class",
            "role",
            "job",
            "band",
            "rate",
            "ceil",
            "bytes",
            "drops",
            "backlog",
            "throughput",
        ):
            classes.add_column(column)
        for c in iface["classes"]:
            tput = c["throughput_bps"]
            classes.add_row(
                c["classid"],
                c["role"],
                c["job"] or "",
                "" if c["band"] is None else str(c["band"]),
                format_rate(c["rate_bps"]),
                format_rate(c["ceil_bps"]),
                str(c["bytes"]),
                str(c["drops"]),
                str(c["backlog"]),
                "" if tput is None else format_rate(tput) + "/s",
            )
        out.print(classes)


@cli.command()
@click.argument("peer", required=False)
@click.option("--serve", is_flag=True, help="Answer probes (run this on the other host).")
@click.option("--port", type=click.IntRange(1, 65535), default=7801, show_default=True,
              help="The server's UDP port.")
@click.option("--listen", default="0.0.0.0", show_default=True,
              help="--serve: the address to answer on.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--serve: stop after this long [default: when interrupted].")
@click.option("--count", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="Datagrams per band.")
@click.option("--dscp", "dscp_list", default=None,
              help="The bands' DSCP, band 0 first [default: gradlane's, 46,34,26,18].")
def probe(peer: str | None, serve: bool, port: int, listen: str, seconds: float | None,
          count: int, dscp_list: str | None) -> None:
    """Check that the bands' DSCP marks survive the path to PEER, both ways.

    Switches order gradlane's bands by DSCP only; a network that re-marks it
    takes that away without a sound. Run `gradlane probe --serve` on one host and
    `gradlane probe HOST` on another: a few UDP datagrams per band, each marked
    with the band's DSCP, answered with the mark they arrived with. Exits 1 if a
    mark changed or an answer is missing.
    """
    import socket as socket_

    from gradlane.daemon.protocol import DEFAULT_BAND_DSCP
    from gradlane.probe import probe as run_probe
    from gradlane.probe import serve as run_serve

    if serve == (peer is not None):
        raise click.UsageError("give a PEER to probe, or --serve to answer probes")
    if serve:
        def bound() -> None:
            console.print(f"answering probes on {listen}:{port} (UDP)"
                          + (f" for {seconds:g} s" if seconds else "; Ctrl-C stops"))

        try:
            answered = run_serve((listen, port), seconds, ready=bound)
        except KeyboardInterrupt:
            return
        except OSError as exc:
            raise click.ClickException(f"cannot answer on {listen}:{port}: {exc}") from None
        console.print(f"answered {answered} probes")
        return
    assert peer is not None
    given = (dscp_list or ",".join(map(str, DEFAULT_BAND_DSCP))).split(",")
    if not all(d.strip().isdigit() and int(d) <= 63 for d in given):
        raise click.BadParameter(f"{dscp_list!r}: DSCP values 0-63, comma-separated",
                                 param_hint="--dscp")
    bands = [int(d) for d in given]
    try:
        address = socket_.gethostbyname(peer)
        results = run_probe((address, port), bands, count)
    except OSError as exc:
        raise click.ClickException(f"cannot probe {peer}: {exc}") from None
    out = _stdout_console()
    for r in results:
        out.print(Text.assemble(("ok   " if r.ok else "FAIL ", "green" if r.ok else "bold red"),
                                f" band {r.band} (DSCP {r.dscp}): {r.summary()}"), soft_wrap=True)
    if not all(r.ok for r in results):
        if not any(r.there for r in results):
            console.print(f"no answer from {peer}:{port}: is `gradlane probe --serve` running "
                          "there, and UDP to it allowed?")
        sys.exit(1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gradlaned")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@_daemon_options
@_CHECK
def gradlaned(verbose: int, check: bool, **kwargs: Any) -> None:
    """gradlaned: the gradlane per-host daemon (foreground; run it under systemd)."""
    level = [logging.WARNING if check else logging.INFO, logging.DEBUG][min(verbose, 1)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    (check_daemon if check else run_daemon)(*_load_daemon_config(**kwargs))


def _fail(exc: GradlaneError) -> NoReturn:
    # As click shows its own errors ("Error: ..."), on one line (a journal's, a pipe's) at
    # any width; the message as it is: rich would take "[[interface]]" for markup.
    console.print("[red]Error:[/red]", escape(str(exc)), soft_wrap=True)
    sys.exit(1)


def daemon_main() -> None:
    try:
        gradlaned(standalone_mode=True)
    except GradlaneError as exc:
        _fail(exc)


def main() -> None:
    unwind_on_signals()  # `with Cluster(...)` blocks clean up on SIGTERM or SIGHUP as on Ctrl-C
    try:
        cli(standalone_mode=True)
    except GradlaneError as exc:
        _fail(exc)


if __name__ == "__main__":
    main()
