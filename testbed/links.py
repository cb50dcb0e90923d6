"""Emulated links: rate limits and queues on the switch side of each host.

A host's own egress root qdisc is left alone (gradlane's daemon owns it).
Both directions of a host's link are emulated in the switch namespace:

* host -> switch (uplink): the switch port's ingress redirects every packet
  (u32 match-all + mirred) to an IFB device whose egress is an HTB class at
  the host's rate with a FIFO: the host NIC's transmit queue.
* switch -> host (downlink): the switch port's egress is a QoS switch port,
  HTB at the host's rate with eight strict-priority queues, one per DSCP
  class selector (the top three DSCP bits), CS7 first. It runs
  `PORT_HEADROOM` (1%) faster than the host's rate: on real hardware both ends
  of a link clock the same line rate, so one sender's queue builds in its own
  NIC and the switch port queues only when several senders converge (incast).
  With identical emulated rates the queue would land wherever HTB happens to
  be a little slower.

The leaf-to-leaf uplink is shaped like a switch port in each direction.

A link's rate counts what HTB counts: each frame from its Ethernet header on.
A real NIC also spends 24 bytes' time around every frame (preamble, gap,
FCS), so one whose line rate is L carries L x 1514/1538 of those bytes in
full-size frames: a link emulated at R is a NIC of line rate `line_rate`
(R), and that is the rate gradlaned, which shapes under a NIC's line rate,
is told (`gradlane.testbed.Cluster.start_daemon`).
"""

from __future__ import annotations

from typing import Any

from gradlane.daemon.tc import (
    ETH_P_ALL,
    ETH_P_IP,
    handle,
    htb_class_kwargs,
    tos_class_key,
    translated,
    u32_key_strings,
)

__all__ = ["FRAME_BYTES", "line_rate", "redirect_ingress", "shape_fifo", "shape_priority_port"]

_MAJOR = 1
_ROOT = handle(_MAJOR, 0)
_ROOT_CLASS = handle(_MAJOR, 1)
_QUANTUM = 3028
PORT_HEADROOM = 1.01
FRAME_BYTES, WIRE_BYTES = 1514, 1538  # a full frame as HTB counts it, and on the wire


def line_rate(rate_bps: int) -> int:
    """The line rate of a real NIC that carries an emulated link's `rate_bps` (full frames)."""
    return round(rate_bps * WIRE_BYTES / FRAME_BYTES)


def _queue_class(selector: int) -> int:
    return handle(_MAJOR, 0x10 + selector)


def _add_class(ipr: Any, index: int, ifname: str, classid: int, parent: int, **kw: Any) -> None:
    with translated(ifname, f"testbed class {classid:#x}"):
        ipr.tc("add-class", "htb", index, classid, parent=parent, **kw)


def _add_fifo(ipr: Any, index: int, ifname: str, parent: int, queue_packets: int) -> None:
    with translated(ifname, f"testbed pfifo under {parent:#x}"):
        ipr.tc(
            "add", "pfifo", index, handle(parent & 0xFFFF, 0), parent=parent, limit=queue_packets
        )


def shape_fifo(ipr: Any, index: int, ifname: str, rate_bps: int, queue_packets: int) -> None:
    """One FIFO at `rate_bps` on the egress of `ifname` (a NIC's transmit queue)."""
    with translated(ifname, "testbed root htb"):
        ipr.tc("add", "htb", index, _ROOT, default=0x10)
    leaf = handle(_MAJOR, 0x10)
    _add_class(
        ipr, index, ifname, _ROOT_CLASS, _ROOT, **htb_class_kwargs(rate_bps, rate_bps, 0, _QUANTUM)
    )
    _add_class(
        ipr, index, ifname, leaf, _ROOT_CLASS, **htb_class_kwargs(rate_bps, rate_bps, 0, _QUANTUM)
    )
    _add_fifo(ipr, index, ifname, leaf, queue_packets)


def shape_priority_port(
    ipr: Any, index: int, ifname: str, rate_bps: int, queue_packets: int
) -> None:
    """A QoS switch port: `rate_bps` shared by 8 strict-priority DSCP queues.

    Each queue has a tiny guaranteed rate and may borrow the whole port;
    borrowing goes by HTB prio = 7 - class selector, so CS7 is served first
    and unmarked traffic (CS0, also the default for non-IP) last.
    """
    with translated(ifname, "testbed root htb"):
        ipr.tc("add", "htb", index, _ROOT, default=0x10)
    _add_class(
        ipr, index, ifname, _ROOT_CLASS, _ROOT, **htb_class_kwargs(rate_bps, rate_bps, 0, _QUANTUM)
    )
    floor = max(rate_bps // 1000, 8_000)
    for selector in range(8):
        classid = _queue_class(selector)
        kwargs = htb_class_kwargs(floor, rate_bps, 7 - selector, _QUANTUM)
        _add_class(ipr, index, ifname, classid, _ROOT_CLASS, **kwargs)
        _add_fifo(ipr, index, ifname, classid, queue_packets)
        if selector == 0:
            continue  # the default class
        with translated(ifname, f"testbed DSCP filter CS{selector}"):
            ipr.tc(
                "add-filter",
                "u32",
                index,
                parent=_ROOT,
                prio=selector,
                protocol=ETH_P_IP,
                target=classid,
                keys=u32_key_strings([tos_class_key(selector)]),
            )


def redirect_ingress(ipr: Any, index: int, ifname: str, ifb_index: int) -> None:
    """Send everything arriving on `ifname` through the IFB device `ifb_index` first."""
    ingress = handle(0xFFFF, 0)
    with translated(ifname, "testbed ingress qdisc"):
        ipr.tc("add", "ingress", index, ingress)
    with translated(ifname, "testbed ingress redirect"):
        ipr.tc(
            "add-filter",
            "u32",
            index,
            parent=ingress,
            prio=1,
            protocol=ETH_P_ALL,
            target=handle(1, 1),
            keys=["0x0/0x0+0"],
            action={
                "kind": "mirred",
                "direction": "egress",
                "action": "redirect",
                "ifindex": ifb_index,
            },
        )
