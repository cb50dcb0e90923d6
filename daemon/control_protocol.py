"""The gradlaned <-> control plane protocol, for both sides.

Transport: HTTP on the control plane (default ``127.0.0.1:7800``), every
request with ``Authorization: Bearer <token>``.

- ``GET /api/v1/daemon``: a WebSocket. Text frames are JSON, binary frames
  msgpack; the control plane answers in the encoding of the daemon's last
  message. Conversation::

      daemon                                   control
      register {version, host, leaf,       ->  welcome {version, host, features}
                interfaces, gradlane}
      report {seq, jobs, link_bps, takes}      (whenever its jobs change, and
                                                every few seconds)
                                           <-  plan {version, ttl_s, source,
                                                job_classes, batch_shares,
                                                rank_shares, ownership, leaf,
                                                link_bps, computed_at}

- ``POST /api/v1/report``: the same register and report in one body
  (``{"register": {...}, "report": {...}}``, JSON or, with
  ``Content-Type: application/msgpack``, msgpack); the answer is the
  host's current plan. For daemons that poll instead of holding a socket.

A report lists the jobs with workers on the host: ``{"name", "global_batch",
"layers", "chunk_bytes": [...], "chunk_layers": [...], "band_bps": [...],
"exchange", "world_size", "workers": [{"rank", "throughput", "batch"}]}``: the
job's demand (one iteration's chunks in forward order and each one's layer,
as a shim reported them), how its shims agreed to reduce (``"flat"``, ``"leaf"``:
within leaves first, ``"ring"``, ``"host"``: within hosts first, said only to a
control plane listing ``host_exchange``; absent: not known yet; older daemons say
``in_leaf``, true or false, which is still accepted) and its class's
measured throughput on this host per band. ``global_batch`` is the job's
samples per step as its ranks agreed (0: not said; the control plane then
sums the workers' batches), ``world_size`` its number of ranks (absent or 0:
not said); batch shares are planned only once every rank is reported. A plan
gives the host its job classes (``{job: [rate_bps, ceil_bps, prio]}``), per
job every chunk's owner (the shims take their own) and batch shares, and the
host's leaf when shims should reduce within leaves first. Batch shares come
as ``batch_shares`` (``{job: [share of rank 0, of rank 1, ...]}``, every
rank's), or, to a daemon whose reports say it ``takes`` ``rank_shares``
(`PLAN_FIELDS`), as ``rank_shares`` (``{job: [[rank, share], ...]}``, the
host's ranks only): one job of 8,192 ranks on 1,024 hosts made every push
25.6 MB of JSON and half a second of the event loop, every second.

A host's link, as plans take it, is ``link_bps`` of its report: the rates
of the interfaces that carry its jobs' flows, summed (shims with an address
per NIC spread chunks over them all; `host_link`). A daemon that does not say
it (older, or nothing registered) gets its slowest interface. The plan
names the link its classes are for (``link_bps``), and the daemon scales
them to each interface by its rate over that one.

A control plane refuses fields it does not know, so a daemon sends an
optional field (``exchange``, ``world_size``, ``link_bps``, ``takes``) only when the
welcome's ``features`` lists it (`FEATURES`; an older control plane's welcome has
none). A daemon ignores plan fields it does not know; the control plane sends
one in place of an older field only to a daemon that says it ``takes`` it.

Every message is validated (`parse_register`, `parse_report`); anything
else gets ``error {code, message}`` and, on a WebSocket, the connection is
closed. Sizes are capped (`MAX_MESSAGE`, `MAX_JOBS`, `MAX_WORKERS`,
`MAX_CHUNKS`). A sender keeps within `MAX_MESSAGE` (`fit`): what gives way,
largest first, is a job's chunk list in a report (the control plane keeps what
another host reported of it) or a job's chunk owners in a plan (its shims keep
their own), so that a host with much demand is planned with less of it rather
than refused at every message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgpack

from gradlane.daemon.fields import (
    HOST_EXCHANGE,
    MAX_LEAF,
    exchange,
    integer,
    integers,
    listed,
    number,
    only,
    text,
)
from gradlane.errors import ProtocolError

__all__ = [
    "MAX_BATCH",
    "FEATURES",
    "MAX_MESSAGE",
    "PLAN_FIELDS",
    "VERSION",
    "InterfaceReport",
    "JobReport",
    "Register",
    "Report",
    "WorkerReport",
    "check_plan",
    "decode",
    "encode",
    "fit",
    "host_link",
    "parse_register",
    "parse_report",
]

VERSION = 1
# Optional report fields this control plane accepts beyond VERSION's (its welcome lists them).
FEATURES: tuple[str, ...] = ("in_leaf", "exchange", "world_size", HOST_EXCHANGE, "link_bps",
                             "takes")
# Plan fields beyond VERSION's that a daemon takes in place of older ones (a report's "takes").
PLAN_FIELDS: tuple[str, ...] = ("rank_shares",)
MAX_MESSAGE = 1 << 20
MAX_JOBS = 256
MAX_WORKERS = 4096
MAX_BATCH = 1 << 24  # a worker's samples in a step
MAX_CHUNKS = 65536
MAX_BANDS = 16
MAX_INTERFACES = 16
MAX_TTL_S = 1e6  # a plan's time to live, exclusive: daemons refuse a plan that claims more


@dataclass(frozen=True)
class InterfaceReport:
    name: str
    rate_bps: int


@dataclass(frozen=True)
class Register:
    host: str
    leaf: int
    interfaces: tuple[InterfaceReport, ...]
    gradlane: str


@dataclass(frozen=True)
class WorkerReport:
    rank: int
    throughput: float  # samples/s of compute; 0: not measured yet
    batch: int


@dataclass(frozen=True)
class JobReport:
    name: str
    global_batch: int
    layers: int
    chunk_bytes: tuple[int, ...]  # one iteration's chunks in forward (priority) order
    workers: tuple[WorkerReport, ...]
    chunk_layers: tuple[int, ...] = ()  # the layer of each chunk (empty: not known)
    band_bps: tuple[float, ...] = ()  # measured throughput of the job's class, per band
    exchange: str | None = None  # how its shims reduce (`fields.EXCHANGES`); None: not known
    world_size: int = 0  # the job's ranks, on every host (0: not known)


@dataclass(frozen=True)
class Report:
    seq: int
    jobs: tuple[JobReport, ...]
    # The host's link as the daemon plans with it (`host_link`): its interfaces that carry
    # flows, summed (shims send over several NICs at once). 0: not said.
    link_bps: int = 0
    takes: frozenset[str] = frozenset()  # `PLAN_FIELDS` the daemon takes


def host_link(register: Register, report: Report) -> int:
    """A host's link for planning: what its daemon says it uses, else (an older daemon,
    or nothing said yet) its slowest interface.

    Raises:
        ProtocolError: the report's link is not between the slowest registered
            interface and the sum of them all.
    """
    rates = [i.rate_bps for i in register.interfaces]
    if not report.link_bps:
        return min(rates)
    if not min(rates) <= report.link_bps <= sum(rates):
        raise ProtocolError("bad_message", f"report: link_bps {report.link_bps} is not between "
                                           f"the slowest registered interface ({min(rates)}) "
                                           f"and their sum ({sum(rates)})")
    return report.link_bps


def decode(data: str | bytes) -> dict[str, Any]:
    """A JSON (str) or msgpack (bytes) message as a map with a "type".

    Raises:
        ProtocolError: too big, not JSON/msgpack, or not a map.
    """
    if len(data) > MAX_MESSAGE:
        raise ProtocolError("too_big", f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        if isinstance(data, str):
            value = json.loads(data)
        else:
            value = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, RecursionError) as exc:
        kind = "JSON" if isinstance(data, str) else "msgpack"
        raise ProtocolError("bad_frame", f"not a {kind} message: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", f"a message is a map, got {type(value).__name__}")
    return value


def encode(message: object, binary: bool) -> str | bytes:
    if binary:
        packed: bytes = msgpack.packb(message, use_bin_type=True)
        return packed
    return json.dumps(message, separators=(",", ":"))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_plan(message: dict[str, Any]) -> None:
    """Raise ValueError unless `message` is a plan a daemon can act on: every field it
    reads, of the type it reads (a control plane of another version, or a broken one,
    gets its plan refused and the connection retried, never a daemon that fails later).
    The control plane checks its plans with it before it sends them (a policy's bug)."""
    if not _integer(message["version"]):
        raise ValueError(f"bad plan version {message['version']!r:.80}")
    ttl = message.get("ttl_s")
    if not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool)
            and 0 < ttl < MAX_TTL_S):
        raise ValueError(f"bad plan ttl_s {ttl!r:.80}")
    classes = message.get("job_classes")
    if not isinstance(classes, dict):
        raise ValueError(f"bad plan job_classes {classes!r:.80}")
    for job, c in classes.items():
        if not (isinstance(job, str) and isinstance(c, list) and len(c) == 3
                and integers(c, 0, 1 << 62) and 0 < c[0] <= c[1] and c[2] <= 7):
            raise ValueError(f"bad job class {job!r}: {c!r:.80}")
    for key in ("batch_shares", "ownership"):
        per_job = message.get(key)
        if not (isinstance(per_job, dict) and all(
                isinstance(job, str) and isinstance(v, list) and integers(v, 0, 1 << 62)
                for job, v in per_job.items())):
            raise ValueError(f"bad plan {key} {per_job!r:.80}")
    per_job = message.get("rank_shares", {})  # absent from an older control plane's
    if not (isinstance(per_job, dict) and all(
            isinstance(job, str) and isinstance(pairs, list) and all(
                isinstance(pair, list) and len(pair) == 2 and integers(pair, 0, 1 << 62)
                for pair in pairs)
            for job, pairs in per_job.items())):
        raise ValueError(f"bad plan rank_shares {per_job!r:.80}")
    link = message.get("link_bps")
    if link is not None and not (_integer(link) and link > 0):
        raise ValueError(f"bad link_bps {link!r:.80}")
    leaf = message.get("leaf")  # told to every shim in a welcome: msgpack, 64 bits at most
    if leaf is not None and not (_integer(leaf) and 0 <= leaf < MAX_LEAF):
        raise ValueError(f"bad plan leaf {leaf!r:.80}")


def fit(message: dict[str, Any], binary: bool) -> tuple[str | bytes, list[str]]:
    """`message` (a report or a plan) encoded (`encode`) within `MAX_MESSAGE`, and the
    jobs whose chunk lists (a report's ``chunk_bytes`` and ``chunk_layers``) or chunk
    owners (a plan's ``ownership``) were left out for it, largest first. Still over
    `MAX_MESSAGE` if the rest is (the receiver refuses it)."""
    data = encode(message, binary)
    if len(data) <= MAX_MESSAGE or message.get("type") not in ("report", "plan"):
        return data, []
    if message["type"] == "report":
        sizes = {job["name"]: len(encode(job["chunk_bytes"], binary))
                 + len(encode(job.get("chunk_layers", []), binary))
                 for job in message["jobs"] if job["chunk_bytes"]}

        def without(names: list[str]) -> dict[str, Any]:
            return {**message, "jobs": [
                {**job, "chunk_bytes": [], **({"chunk_layers": []} if "chunk_layers" in job
                                              else {})}
                if job["name"] in names else job for job in message["jobs"]]}
    else:
        sizes = {name: len(encode(of, binary)) for name, of in message["ownership"].items()}

        def without(names: list[str]) -> dict[str, Any]:
            return {**message, "ownership": {name: of for name, of in message["ownership"].items()
                                             if name not in names}}
    over, left_out = len(data) - MAX_MESSAGE, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if over <= 0:
            break
        left_out.append(name)
        over -= sizes[name] - 4  # two empty lists stay (a plan's key goes with its owners)
    data = encode(without(left_out), binary)
    # Each job's saving was counted a few bytes short (a key, a list's header): the last
    # ones left out may not have been needed.
    while left_out:  # bounded: one fewer each round
        fewer = encode(without(left_out[:-1]), binary)
        if len(fewer) > MAX_MESSAGE:
            break
        data, left_out = fewer, left_out[:-1]
    return data, left_out


def _typed(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    got = raw.get("type")
    if got != kind:
        raise ProtocolError("bad_message", f"expected a {kind!r} message, got type {got!r:.40}")
    return raw


def parse_register(raw: dict[str, Any]) -> Register:
    """Validate a register message.

    Raises:
        ProtocolError: a missing, unknown or badly typed field, or another version.
    """
    raw = _typed(raw, "register")
    only(raw, {"type", "version", "host", "leaf", "interfaces", "gradlane"})
    if integer(raw, "version", 0, 1 << 16) != VERSION:
        raise ProtocolError("version", f"register: protocol version {raw['version']}, "
                                       f"this control plane speaks {VERSION}")
    interfaces = []
    for i, item in enumerate(listed(raw, "interfaces", MAX_INTERFACES)):
        where = _map(item, f"register: interfaces[{i}]")
        only(where, {"type", "name", "rate_bps"})
        interfaces.append(InterfaceReport(text(where, "name"),
                                          integer(where, "rate_bps", 1, 1 << 50)))
    if not interfaces:
        raise ProtocolError("bad_message", "register: at least one interface")
    return Register(text(raw, "host"), integer(raw, "leaf", 0, MAX_LEAF - 1), tuple(interfaces),
                    text(raw, "gradlane"))


def parse_report(raw: dict[str, Any]) -> Report:
    """Validate a report message.

    Raises:
        ProtocolError: a missing, unknown or badly typed field, or too many items.
    """
    raw = _typed(raw, "report")
    only(raw, {"type", "seq", "jobs", "link_bps", "takes"})
    takes = listed(raw, "takes", 16) if "takes" in raw else []
    if not all(isinstance(name, str) and len(name) <= 64 for name in takes):
        raise ProtocolError("bad_message", "report: takes must be names of plan fields")
    jobs, names = [], set()
    for i, item in enumerate(listed(raw, "jobs", MAX_JOBS)):
        where = _map(item, f"report: jobs[{i}]")
        only(where, {"type", "name", "global_batch", "layers", "chunk_bytes", "chunk_layers",
                     "band_bps", "in_leaf", "exchange", "world_size", "workers"})
        name = text(where, "name")
        if name in names:
            raise ProtocolError("bad_message", f"report: job {name!r} listed twice")
        names.add(name)
        chunks = listed(where, "chunk_bytes", MAX_CHUNKS)
        if not integers(chunks, 1, 1 << 40):
            raise ProtocolError("bad_message", f"report: jobs[{i}].chunk_bytes must be sizes > 0")
        layers = integer(where, "layers", 0, 1 << 20)
        of = listed(where, "chunk_layers", MAX_CHUNKS) if "chunk_layers" in where else []
        if of and (len(of) != len(chunks) or not integers(of, 0, max(layers, 1))):
            raise ProtocolError("bad_message", f"report: jobs[{i}].chunk_layers must give each "
                                               "chunk's layer, below layers")
        bps = listed(where, "band_bps", MAX_BANDS) if "band_bps" in where else []
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e15
                   for v in bps):
            raise ProtocolError("bad_message", f"report: jobs[{i}].band_bps must be rates >= 0")
        workers, ranks = [], set()
        for k, w in enumerate(listed(where, "workers", MAX_WORKERS)):
            wmap = _map(w, f"report: jobs[{i}].workers[{k}]")
            only(wmap, {"type", "rank", "throughput", "batch"})
            rank = integer(wmap, "rank", 0, MAX_WORKERS * 16)
            if rank in ranks:
                raise ProtocolError("bad_message", f"report: job {name!r} rank {rank} twice")
            ranks.add(rank)
            workers.append(WorkerReport(rank, number(wmap, "throughput"),
                                        integer(wmap, "batch", 0, MAX_BATCH)))
        jobs.append(JobReport(name, integer(where, "global_batch", 0, 1 << 30), layers,
                              tuple(chunks), tuple(workers),
                              tuple(of), tuple(float(v) for v in bps),
                              exchange(where),
                              integer(where, "world_size", 0, MAX_WORKERS * 16)
                              if "world_size" in where else 0))
    return Report(integer(raw, "seq", 0, 1 << 62), tuple(jobs),
                  integer(raw, "link_bps", 1, 1 << 50) if "link_bps" in raw else 0,
                  frozenset(takes) & frozenset(PLAN_FIELDS))  # others: a later version's


def _map(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ProtocolError("bad_message", f"{where} must be a map")
    return {**item, "type": where}

