"""The ``gradlane`` command line. The only place that reads the environment."""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

import click
from rich.console import Console
from rich.table import Table

from gradlane import __version__
from gradlane.errors import GradlaneError
from gradlane.units import format_rate, parse_rate

__all__ = ["main"]

console = Console(stderr=True)


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise click.ClickException(
            f"{what} needs root (it creates network namespaces and qdiscs); run it with sudo"
        )


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so `with Cluster(...)` blocks clean up.
    raise SystemExit(128 + signum)


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
@click.option("--hosts", "-n", type=click.IntRange(2, 64), default=2, show_default=True)
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
    from gradlane.testbed.netns import enter

    _require_root("gradlane testbed run")
    index = host[1:] if host.startswith("h") else host
    enter(f"gl-{name}-h{index}")
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


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cli(standalone_mode=True)
    except GradlaneError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
