"""`loadbalance`: tensor-aware choice of chunk owners so the most loaded link finishes first.

With reduce-scatter and all-gather through per-chunk owners (gradlane's
data path, and BytePS's co-located servers), what each link carries per
iteration depends on the bytes each worker owns (``S`` is the model), and
a link finishes at that over its rate, so:

1. A worker's links are its host's: what its NIC can give this job (the
   NIC rate divided by the number of jobs with workers on that host), each
   way. Ranks of one host share them; what they send each other is
   loopback. (Leaf uplinks are shared by every job of the leaf: their
   order is `coflow`'s business, and reducing within leaves keeps one copy
   per leaf on them whoever owns.)
2. Per owner rank, what one byte it owns puts on each of those links
   follows from how the job's ranks exchange (`Exchange.link_loads`: the
   flat exchange's trees, reduced within leaves first where the plan asks
   or within hosts first where ranks share hosts, or the ring). The owned
   shares are the ones that make the slowest link finish first
   (`owner_shares`), a linear programme solved exactly; among equally fast
   shares, the most even. Examples, S the model:
   - flat, one rank a host: worker i's link carries ``S + (W - 2) * owned``
     each way, so a worker on a slow link owns less. With rates 2, 1, 1 the
     fast worker owns everything: every link then carries ``S`` per rate
     unit, where shares following the rates (1/2, 1/4, 1/4) would leave the
     slow links at ``1.25 S``.
   - the ring: the link from rank i to i+1 carries ``2 S - owned_i -
     owned_i+1`` (each chunk passes every link but one each way, and the
     owner's own links are the ones it skips), so a worker on a slow link
     owns *more*: with one worker of 4 at half the rate, it owns
     everything, and its links carry ``S`` instead of ``1.5 S`` at half the
     rate. Measured on the testbed (`bench/slow_link.py`).
   - the ring with several ranks a host: only the links between hosts
     count, so the ranks at either end of a host's run own the bytes; with
     4 ranks on each of 2 hosts, each host link carries ``1.5 S`` where
     equal shares leave ``1.75 S`` (ring all-reduce's ``2 (W - 1) / W``).
     (Shims take the ring there only when asked to: by default ranks
     sharing hosts reduce within hosts first, ``S`` per host link here,
     `gradlane.policies.chunks.host_groups`.)
   Equal rates and one rank a host give equal shares without solving (they
   are among the best by symmetry, and the most even), and the flat
   exchange with one rank a host, not reduced within leaves, water-filled
   shares (`flat_shares`, the same solution in closed form, for jobs of
   hundreds of ranks where the programme takes 40 ms and more). Ranks of a
   host that load the links alike are weighed as one: always within hosts
   first (shares in closed form there too), and within leaves where their
   trees match (`_alike_by_host`). A job whose weighing would take more
   than `State.max_weighed` loads gets even shares, and its plan a note.
3. Chunks go to owners by list scheduling on uniform machines
   (`assign_owners`): in priority order, each chunk to the worker whose
   owned bytes / share would be smallest after taking it.
4. When the job says which layer each chunk belongs to, each layer is
   balanced on its own first (its chunks are exchanged together, so its
   slowest owner sets its time), overall balance breaking ties.

5. When a leaf's hosts can send more than its uplink carries
   (`fabric.oversubscribed`), the plan asks shims to reduce each chunk
   within each leaf first (`Plan.reduce_in_leaf`): one copy per leaf
   crosses the spine instead of one per rank, hierarchical all-reduce as in
   Horovod and PLink (which finds the locality by probing; here the daemons
   report their leaf).

Departures from TicTac/BytePS-style balancing: ownership is by link rate
and placement, not only bytes, and by how the ranks exchange. The path is
not planned: a host with several NICs is one link of their summed rate
here (what its daemon reports its shims send over,
`gradlane.daemon.control_protocol.host_link`), and its shims put each chunk
on the NIC where its owner's chunks have the fewest bytes for the NIC's
rate (`gradlane.shim.engine.Engine`). Bands and rates are `priority`'s.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, cast

import numpy as np

from gradlane.errors import ConfigError, GradlaneError
from gradlane.policies import fabric
from gradlane.policies.base import (
    DEFAULT_MAX_WEIGHED,
    FloatArray,
    IntArray,
    JobState,
    Plan,
    Policy,
    State,
    Topology,
    Worker,
    register,
)
from gradlane.policies.chunks import Owning, assign_owners_of
from gradlane.policies.demand import Exchange, SparseLoads
from gradlane.policies.priority import PriorityPolicy

__all__ = ["LoadBalancePolicy", "NoSolution", "Shares", "balanced_ownership", "exchange_time",
           "flat_shares", "exchange_of", "host_loads", "job_shares", "load_solver", "one_switch",
           "owner_shares", "placement_shape", "require_solver"]

# `owner_shares` takes shares this small (of 1) as none: below a solver's tolerance.
MIN_SHARE = 1e-5
# HiGHS's interior point method (then crossover to a vertex), not its dual simplex: a
# large job's programmes solve 2 to 10 times faster (8,192 ranks in no order host by
# host, within leaves: 83 -> 8.8 s; 65,536 ranks host by host: a first plan 68 -> 31 s),
# small ones within a millisecond of it (ad hoc, this machine). Where it fails, the
# simplex is tried, then the simplex without presolve, before the job gets even owners
# (or, for the second programme, the first's shares).
LP_METHOD = "highs-ipm"
FALLBACK_LP_METHOD = "highs-ds"


class NoSolution(GradlaneError):
    """HiGHS found no owner shares (numerical trouble: the programmes always have
    some). `job_shares` then gives the job even ones and a note, and the other jobs
    are planned as ever."""


class Shares(NamedTuple):
    """A job's owned shares, per rank, and why they are not weighed (None: they are)."""

    each: tuple[float, ...]
    note: str | None = None

    @classmethod
    def even(cls, world: int, note: str | None = None) -> Shares:
        """The same share for each of `world` ranks."""
        return cls((1 / world,) * world, note)


NO_SOLVER = "planning chunk owners for unequal links needs SciPy: pip install 'gradlane[control]'"


def _linprog() -> Callable[..., Any]:
    # SciPy is the `control` extra (some 110 MB): gradlaned's local plans never solve.
    try:
        from scipy.optimize import linprog
    except ImportError:
        raise ConfigError(NO_SOLVER) from None
    return cast("Callable[..., Any]", linprog)


def require_solver() -> None:
    """Fail now, not at the first plan that needs it, if SciPy (`control` extra) is not
    installed. Importing it takes about a second: `load_solver` does, when it suits."""
    try:
        found = importlib.util.find_spec("scipy.optimize") is not None
    except ImportError:  # its package missing
        found = False
    if not found:
        raise ConfigError(NO_SOLVER)


def load_solver() -> None:
    """Import the solver now, not in the first plan that needs it.

    Raises:
        ConfigError: SciPy cannot be imported.
    """
    _linprog()


def exchange_time(loads: FloatArray, rates: FloatArray, shares: Sequence[float]) -> float:
    """The slowest link's time per byte of model when each rank owns `shares` of it:
    `loads` per owner rank and link (`Exchange.link_loads`), links at `rates`."""
    return float(np.max(np.asarray(shares, dtype=np.float64) @ loads / rates))


def owner_shares(loads: FloatArray | SparseLoads, rates: FloatArray,
                 members: Sequence[int] | IntArray | None = None) -> list[float]:
    """Each rank's share of the owned bytes (summing to 1), ranks' loads per owned byte on
    each link `loads` (`Exchange.link_loads`, or `Exchange.sparse_link_loads`: a large
    job's), links at `rates`.

    Two linear programmes (HiGHS, through SciPy): the least time ``T`` of the
    slowest link, ``max_l (shares @ loads)_l / rate_l``, over shares summing to
    1; then, of the shares that reach ``T``, those whose largest share is
    least, so equally good owners share the bytes instead of one taking all.

    Ranks whose loads are the same (ranks of one host, when the exchange
    reduces within hosts first) are one variable of the programmes, their
    summed share, split evenly among them after. That is exact: averaging the
    shares of such ranks loads no link more and makes no share larger, so
    among the best shares some split each class evenly. It makes the
    programmes as large as the hosts are many, not the ranks: 1,024 hosts of 8
    ranks solve 1,024 variables, not 8,192. With `members`, each row of
    `loads` stands for that many ranks loading alike, and the share returned
    for it is each one's.
    """
    rates = np.asarray(rates, dtype=np.float64)
    if not isinstance(loads, SparseLoads):
        loads = np.asarray(loads, dtype=np.float64)
    shape = (loads.rows, loads.base.size) if isinstance(loads, SparseLoads) else loads.shape
    if len(shape) != 2 or shape[1] != rates.size or not np.all(rates > 0):
        raise ConfigError(f"need positive rates, one per link: {shape} loads, "
                          f"{rates.size} rates")
    each = (np.ones(shape[0]) if members is None
            else np.asarray(members, dtype=np.float64).reshape(-1))
    if each.shape != (shape[0],) or not np.all(each >= 1):
        raise ConfigError(f"need a count of at least 1 ranks per row of loads, got {members}")
    w = each.sum()
    # The shares sum to 1, so a link's time is a load per share common to the rows plus
    # the shares' mix of what the rows put on it beyond that: mostly nothing (a rank
    # sends most owners one copy), so the programmes are sparse. Rows of the same loads
    # (classes) are one variable.
    split = (_split_sparse(loads, each, rates) if isinstance(loads, SparseLoads)
             else _split_dense(loads, each, rates))
    if split is None:
        return [float(1 / w)] * shape[0]
    used, common, (cls, link, value), of_class = split
    n = int(of_class.max()) + 1
    in_class = np.bincount(of_class, weights=each, minlength=n)
    scale = rates[used] / rates[used].max()
    n_links = used.size
    solver = _linprog()
    from scipy import sparse  # with linprog (the `control` extra)

    def linprog(*args: Any, **kwargs: Any) -> Any:
        result = solver(*args, method=LP_METHOD, **kwargs)
        if not result.success:  # the interior point's trouble need not be the simplex's
            result = solver(*args, method=FALLBACK_LP_METHOD, **kwargs)
        if not result.success:
            # Nor presolve's: HiGHS's calls some barely feasible programmes infeasible
            # (ERGO-Code/HiGHS#2511), as the second one is, a hair over the first's
            # optimum, where several links are tight at once.
            result = solver(*args, method=FALLBACK_LP_METHOD, options={"presolve": False},
                            **kwargs)
        return result

    beyond = sparse.csr_array((value / scale[link], (link, cls)), shape=(n_links, n))
    common = common / scale
    minimise_last = np.append(np.zeros(n), 1.0)
    one = (np.append(np.ones(n), 0.0)[None, :], [1.0])
    slowest = linprog(minimise_last, A_ub=sparse.hstack([beyond, -np.ones((n_links, 1))]),
                      b_ub=-common, A_eq=one[0], b_eq=one[1])
    if not slowest.success:
        raise NoSolution(f"owner shares: {slowest.message}")
    spread = linprog(  # a class's share over its members: each member's, at most the last
        minimise_last,
        A_ub=sparse.vstack([sparse.hstack([beyond, sparse.csr_array((n_links, 1))]),
                            sparse.hstack([sparse.diags_array(1.0 / in_class),
                                           -np.ones((n, 1))])]),
        b_ub=np.concatenate([slowest.fun * (1 + 1e-8) + 1e-9 - common, np.zeros(n)]),
        A_eq=one[0], b_eq=one[1])
    x = (spread.x[:n] if spread.success else slowest.x[:n])[of_class] / in_class[of_class]
    return [float(v) for v in _without_tiny(x, each)]


# What `owner_shares` solves for: the links used, a load per share common to all rows on
# each, what each class of rows puts there beyond it (class, link, value: links numbered
# among those used), and each row's class. None: even shares are the answer.
_Split = tuple[IntArray, FloatArray, tuple[IntArray, IntArray, FloatArray], IntArray]


def _split_dense(loads: FloatArray, each: FloatArray, rates: FloatArray) -> _Split | None:
    used = np.flatnonzero(loads.any(axis=0))
    # In row order (loads[:, used] is not: 10x slower), and not copied when all are used.
    on_used = loads if used.size == loads.shape[1] else np.take(loads, used, axis=1)
    if len(loads) == 1 or not used.size or _even_is_best(
            on_used.sum(axis=1), each @ on_used / each.sum() / rates[used]):
        return None
    rows, of_class = _distinct_rows(on_used)
    if len(rows) == 1:
        return None
    common = _most_common(rows.T)
    cls, link = np.nonzero(rows != common)
    return used, common, (cls, link, rows[cls, link] - common[link]), of_class


def _split_sparse(loads: SparseLoads, each: FloatArray, rates: FloatArray) -> _Split | None:
    n_cols = loads.base.size
    listed = np.bincount(loads.col, minlength=n_cols) > 0
    used = np.flatnonzero((loads.base != 0) | listed)
    if loads.rows == 1 or not used.size:
        return None
    sums = loads.base.sum() + np.bincount(loads.row, loads.extra, minlength=loads.rows)
    mixed = each.sum() * loads.base + np.bincount(loads.col, each[loads.row] * loads.extra,
                                                  minlength=n_cols)
    if _even_is_best(sums, mixed[used] / each.sum() / rates[used]):
        return None
    column = np.full(n_cols, -1, dtype=np.int64)
    column[used] = np.arange(used.size)
    (cls, link, value), of_class = _distinct_sparse_rows(
        loads.row, column[loads.col], loads.extra, loads.rows)
    if of_class.max() == 0:
        return None
    return used, loads.base[used], (cls, link, value), of_class


def _distinct_sparse_rows(row: IntArray, col: IntArray, value: FloatArray, rows: int
                          ) -> tuple[tuple[IntArray, IntArray, FloatArray], IntArray]:
    """The distinct rows of a sparse matrix (`row`, `col`, `value`: each cell once) in
    the order they first come, as (class, col, value), and each row's class."""
    order = np.lexsort((col, row))
    row, col, value = row[order], col[order], value[order]
    bounds = np.searchsorted(row, np.arange(rows + 1))
    classes: dict[bytes, int] = {}
    of_class = np.empty(rows, dtype=np.int64)
    firsts: list[int] = []
    for r in range(rows):
        cells = slice(bounds[r], bounds[r + 1])
        key = col[cells].tobytes() + b"|" + value[cells].tobytes()
        of_class[r] = classes.setdefault(key, len(classes))
        if of_class[r] == len(firsts):
            firsts.append(r)
    kept = np.concatenate([np.arange(bounds[r], bounds[r + 1]) for r in firsts])
    cls = np.repeat(np.arange(len(firsts)), [bounds[r + 1] - bounds[r] for r in firsts])
    return (cls.astype(np.int64), col[kept], value[kept]), of_class


def _distinct_rows(a: FloatArray) -> tuple[FloatArray, IntArray]:
    """`a`'s distinct rows in the order they first come, and each row's index among them.

    Rows are told apart by a hash of their bytes, checked against the first
    row of the same hash (`np.unique` by rows, if two rows ever shared one):
    sorting 8,192 rows of 2,048 loads took 1.7 s, hashing them 0.1 s.
    """
    keys = np.fromiter((hash(row.tobytes()) for row in a),
                       dtype=np.int64, count=len(a))
    _, first, of_key = np.unique(keys, return_index=True, return_inverse=True)
    of_key = of_key.reshape(-1)
    if not np.array_equal(a, a[first[of_key]]):
        _, first, of_key = np.unique(a, axis=0, return_index=True, return_inverse=True)
        of_key = of_key.reshape(-1)
    order = np.argsort(first)  # the keys' order is the hashes': by first row instead
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return a[first[order]], np.asarray(rank[of_key], dtype=np.int64)


def _most_common(a: FloatArray) -> FloatArray:
    """Each row's most common value (the least of those as common)."""
    ordered = np.sort(a, axis=1)
    at = np.arange(a.shape[1])
    starts = np.ones(a.shape, dtype=bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run = at - np.maximum.accumulate(np.where(starts, at, 0), axis=1)  # place in its run
    return np.asarray(ordered[np.arange(len(a)), run.argmax(axis=1)], dtype=np.float64)


def _without_tiny(shares: FloatArray, members: FloatArray) -> FloatArray:
    """Each rank's `shares` (a row's for its `members` ranks) with those below
    `MIN_SHARE` taken as none, summing to 1 again."""
    kept = np.where(shares < MIN_SHARE, 0.0, shares)
    return np.asarray(kept / (kept @ members), dtype=np.float64)


def _even_is_best(sums: FloatArray, times: FloatArray) -> bool:
    """Whether even shares are `owner_shares`' answer, seen without solving: `sums`, each
    row's loads summed; `times`, each link's time with even shares (rows standing for
    their ranks).

    Whatever the shares, the links' loads sum to the shares' mix of the rows'
    sums, and the slowest link takes at least that over the links' summed
    rates. When every row sums the same, no shares do better than that; even
    shares reach it when they load every link for the same time, and they
    are then the most even. So it is with equal links and placements alike
    on every host (one job of 1,024 hosts of 8 ranks: two programmes of some
    1,024 variables not solved, about 6 s).
    """
    if not np.allclose(sums, sums[0], rtol=1e-9, atol=0):
        return False
    return bool(np.allclose(times, times[0], rtol=1e-9, atol=0))


def flat_shares(rates: Sequence[float]) -> list[float]:
    """`owner_shares` of the flat exchange, ranks each on a host of its own under one
    switch at `rates`, in closed form.

    Worker i's link carries ``S + (W - 2) * o_i`` bytes each way (its gradient
    of the chunks others own, the others' gradients of its own chunks, and the
    results back), ``S`` the model. The shares minimise the slowest link's
    time ``T``: ``o_i = max(0, (T r_i - S) / (W - 2))`` with the ``o_i``
    summing to ``S``, found by dropping the slowest workers until every share
    left is positive. Two workers load their links with ``S`` whoever owns
    what: shares follow the rates.
    """
    r = np.asarray(rates, dtype=np.float64)
    if r.size == 0 or not np.all(r > 0):
        raise ConfigError(f"need positive rates, got {list(rates)}")
    world = r.size
    if world <= 2:
        return [float(x) for x in r / r.sum()]
    return [float(x) for x in _water_fill(np.ones(world), np.full(world, world - 2.0), r)]


def _water_fill(base: FloatArray, slope: FloatArray, rates: FloatArray,
                members: FloatArray | None = None) -> FloatArray:
    """Shares ``o`` (summing to 1) whose slowest link finishes first, link i carrying
    ``base[i] + slope[i] * o[i]`` (in models; every slope positive) at ``rates[i]``.

    Water-filling: at the least time ``T`` every link with a share is at ``T``,
    ``o_i = max(0, (T r_i - base_i) / slope_i)``, found by dropping the links too
    slow for any share until every share left is positive. A link may be slower
    than ``T`` with no share at all (its base alone): then the slowest finishes at
    ``T* = base_i / r_i``, and many shares do as well. With `members` (link i's
    share is split among that many ranks) they are then, as `owner_shares`'
    second programme takes them, those whose largest share a rank is least:
    ``o_i = min(cap_i, lam * members_i)``, ``cap_i`` the most link i takes by
    ``T*``. Without, the water-filled shares.
    """
    active = np.ones(len(rates), dtype=bool)
    while True:  # at most one round a link: each drops one or ends
        t = (1 + (base / slope)[active].sum()) / (rates / slope)[active].sum()
        keep = active & (t * rates > base)
        if keep.sum() == active.sum():
            break
        active = keep
    shares = np.where(active, (t * rates - base) / slope, 0.0)
    slowest = float((base / rates).max())
    if members is None or slowest <= t:
        return np.asarray(shares / shares.sum(), dtype=np.float64)
    cap = np.maximum(0.0, (slowest * rates - base) / slope)  # sums to more than 1
    # The least lam with sum(min(cap, lam * members)) = 1: between two of the caps'
    # levels cap / members, the sum grows by the members of the links not capped yet.
    order = np.argsort(cap / members)
    level, m = (cap / members)[order], members[order]
    before = np.concatenate([[0.0], np.cumsum(cap[order])[:-1]])  # the capped links'
    after = np.cumsum(m[::-1])[::-1]  # the members not capped yet
    reach = np.flatnonzero(before + level * after >= 1)
    lam = (1 - before[reach[0]]) / after[reach[0]] if len(reach) else level[-1]
    shares = np.minimum(cap, lam * members)
    return np.asarray(shares / shares.sum(), dtype=np.float64)


def one_switch(rates: Sequence[float], ring: bool) -> tuple[FloatArray, FloatArray]:
    """`owner_shares`' loads and link rates for ranks each on a host of its own under one
    switch, host i's link at ``rates[i]`` each way."""
    r = np.asarray(rates, dtype=np.float64)
    exchange = Exchange(np.zeros(r.size, dtype=np.int64), uplinks=False, ring=ring)
    return exchange.link_loads(in_leaf=False), np.concatenate([r, r])


@functools.lru_cache(maxsize=256)
def _shares(hosts: tuple[int, ...], leaves: tuple[int, ...], uplinks: bool, kind: str,
            host_bps: tuple[float, ...], max_weighed: int = DEFAULT_MAX_WEIGHED) -> Shares:
    """`owner_shares` for ranks on `hosts` (in `leaves`) exchanging as `kind`
    (`gradlane.daemon.fields.EXCHANGES`), the hosts' links (sorted host order) at
    `host_bps` (cached: plans see the same placement and rates again and again); even
    ones and a note past `max_weighed` loads (`State.max_weighed`)."""
    world = len(hosts)
    if len(set(hosts)) == world:
        if len(set(host_bps)) == 1:
            return Shares.even(world)
        if kind == "flat" or (kind == "leaf" and not (uplinks and len(set(leaves)) > 1)):
            order = np.argsort(hosts)  # host_bps is in host order, shares in rank order
            rates = np.empty(world)
            rates[order] = host_bps
            return Shares(tuple(flat_shares(rates.tolist())))
    link_bps = np.array(host_bps + host_bps, dtype=np.float64)
    _, of_host, count = np.unique(hosts, return_inverse=True, return_counts=True)
    of_host, n = of_host.reshape(-1), len(count)
    if kind not in ("flat", "host"):
        # Within leaves, ranks of a host often load the links alike: then its first rank
        # is weighed for them all (`_alike_by_host`). 65,536 ranks of 8 a host: 179 s and
        # 17.7 GB with every rank weighed (dense, at fc5838c), 25 s and 1.3 GB by host.
        firsts = _alike_by_host(of_host, count, leaves) if kind == "leaf" else None
        weighed = world if firsts is None else n
        if weighed * link_bps.size > max_weighed:
            return Shares.even(world, (
                f"even chunk owners: weighing {weighed:,} owners on {link_bps.size:,} host "
                f"links is past {max_weighed:,} loads (gradlane control --max-weighed)"))
        exchange = Exchange(leaves, uplinks=uplinks, host=hosts, ring=kind == "ring")
        if kind == "ring":  # a chunk crosses most links: nothing sparse
            return Shares(tuple(owner_shares(exchange.link_loads(False), link_bps)))
        if firsts is None:
            return Shares(tuple(owner_shares(exchange.sparse_link_loads(True), link_bps)))
        return _by_host(exchange.sparse_link_loads(True, firsts), link_bps, count, of_host)
    if len(set(host_bps)) == 1 and len(set(count.tolist())) == 1:
        # Even shares are best (`_even_is_best` of `host_loads`: every row sums the same,
        # and even shares load every host's links alike): not worth the H x 2H loads.
        return Shares.even(world)
    # `host_loads` of a host owning o of the model: each of its links carries
    # 1 + (H - 2) o within hosts first, k + (W - 2k) o flat (k its ranks): water.
    base = np.ones(n) if kind == "host" else count.astype(np.float64)
    slope = np.asarray(np.full(n, n - 2.0) if kind == "host" else world - 2.0 * count,
                       dtype=np.float64)
    if np.all(slope > 0):
        members = count.astype(np.float64)
        per_rank = _water_fill(base, slope, np.asarray(host_bps, dtype=np.float64),
                               members) / members
        return Shares(tuple(float(v) for v in _without_tiny(per_rank, members)[of_host]))
    return _by_host(host_loads(kind, count), link_bps, count, of_host)


def _by_host(loads: FloatArray | SparseLoads, link_bps: FloatArray, count: IntArray,
             of_host: IntArray) -> Shares:
    """Each rank's `owner_shares`, `loads` a row per host standing for its `count` ranks
    (`of_host`: each rank's host)."""
    shares = owner_shares(loads, link_bps, count)
    return Shares(tuple(shares[h] for h in of_host))


def _alike_by_host(of_host: IntArray, count: IntArray,
                   leaves: Sequence[int]) -> IntArray | None:
    """Each host's first rank, when within leaves every rank of a host loads the links as
    it does; else None. `of_host`: each rank's host (0..H-1), `count`: each host's ranks.

    An owner's tree between hosts (`gradlane.policies.chunks.all_reduction_parents`)
    hangs on each leaf's leader: the host at the owner's place among its leaf's
    hosts, the hosts ordered by their ranks at the owner's place within its own
    host (modulo each one's ranks). Where that order is the same at every place,
    the tree depends on the owner's host alone. So it is with ranks numbered host
    by host (torchrun's way) or round hosts of as many ranks each (a cyclic
    launcher's); a property test holds every rank's loads to its host's first
    rank's.
    """
    leaf = np.asarray(leaves, dtype=np.int64)
    host_leaf = np.zeros(len(count), dtype=np.int64)
    host_leaf[of_host] = leaf
    if np.any(host_leaf[of_host] != leaf):  # a host under several leaves
        return None
    ranks = np.argsort(of_host, kind="stable")  # grouped by host, in rank order within
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    order = np.lexsort((ranks[start], host_leaf))
    for place in range(1, int(count.max())):  # bounded: the most ranks a host has
        if not np.array_equal(np.lexsort((ranks[start + place % count], host_leaf)), order):
            return None
    return np.asarray(ranks[start], dtype=np.int64)


def host_loads(kind: str, ranks: Sequence[int] | IntArray) -> FloatArray:
    """`Exchange.link_loads` of a job exchanging flat or within hosts first (`kind`),
    `ranks` on each of its hosts, per owning host: what a chunk puts on each host's
    links depends on the host that owns it, not on which of its ranks.

    Flat, every rank sends its part to the owner and takes the result back: a host
    of k ranks sends and takes k copies of a chunk another host owns, and the owner's
    host all the other ranks' (W - k). Within hosts first, only each host's leader
    does: one copy each way, and the owner's host one per other host. Rows: owning
    hosts; columns: each host's egress, then each one's ingress (sorted host order).
    """
    k = np.asarray(ranks, dtype=np.float64)
    n = len(k)
    each = np.ones((n, n)) if kind == "host" else np.tile(k, (n, 1))
    np.fill_diagonal(each, n - 1 if kind == "host" else k.sum() - k)
    return np.concatenate([each, each], axis=1)


def job_shares(topology: Topology, workers: Sequence[Worker], kind: str,
               jobs_on_host: dict[int, int], max_weighed: int) -> Shares:
    """The owned shares of a job's `workers` (rank order) exchanging as `kind`, each
    host's NIC divided among the jobs on it (`jobs_on_host`): even ones and a note
    where the solver finds none (`NoSolution`, not cached: the next plan tries again)
    or weighing them would take more than `max_weighed` loads."""
    hosts = tuple(w.host for w in workers)
    host_bps = tuple(topology.hosts[h].nic_bps / jobs_on_host[h] for h in sorted(set(hosts)))
    leaves = (topology.hosts[h].leaf for h in hosts)
    try:
        return _shares(placement_shape(hosts), placement_shape(leaves),
                       bool(topology.uplink_bps), kind, host_bps, max_weighed)
    except NoSolution as exc:
        return Shares.even(len(hosts), f"even chunk owners: {exc}")


def placement_shape(ids: Iterable[int]) -> tuple[int, ...]:
    """Hosts (or leaves) of a job's ranks numbered 0, 1, ... in their own order: the
    shares depend on which ranks share a host or leaf and in what order, not on the
    numbers, so jobs placed alike (1,024 hosts: 128 jobs of 8 hosts of 4 ranks) solve
    one linear programme, not one each (1.5 s of a control plane's first plan)."""
    ids = tuple(ids)
    number = {v: i for i, v in enumerate(sorted(set(ids)))}
    return tuple(number[v] for v in ids)


def exchange_of(job: JobState, reduce_in_leaf: bool) -> str:
    """How `job`'s ranks exchange, as far as a state says: the ring, within hosts first,
    within leaves first where the plan asks (`reduce_in_leaf`), else flat."""
    if job.ring:
        return "ring"
    if job.by_host:
        return "host"
    return "leaf" if reduce_in_leaf else "flat"


def balanced_ownership(state: State) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """Per job with known chunks, an owner rank per chunk weighted by link rate; and notes
    on the jobs whose shares are not weighed (`Plan.notes`)."""
    out: dict[str, tuple[int, ...]] = {}
    notes: list[str] = []
    topology = state.topology
    if topology is None:
        return out, ()
    on_host: dict[int, set[str]] = {}
    for w in state.workers:
        on_host.setdefault(w.host, set()).add(w.job)
    jobs_on_host = {h: len(jobs) for h, jobs in on_host.items()}
    reduce_in_leaf = fabric.oversubscribed(topology)
    owning: dict[str, list[Worker]] = {}
    jobs: list[Owning] = []
    for job in state.jobs:
        workers = state.workers_of(job.name)
        if workers and job.chunk_bytes:
            shares, note = job_shares(topology, workers, exchange_of(job, reduce_in_leaf),
                                      jobs_on_host, state.max_weighed)
            if note is not None:
                notes.append(f"job {job.name!r}: {note}")
            owning[job.name] = [w for w, share in zip(workers, shares, strict=True) if share > 0]
            layers = job.chunk_layers if len(job.chunk_layers) == len(job.chunk_bytes) else None
            jobs.append((job.chunk_bytes, len(owning[job.name]), [s for s in shares if s > 0],
                         layers))
    for name, owners in zip(owning, assign_owners_of(jobs), strict=True):  # all jobs at once
        out[name] = tuple(owning[name][o].rank for o in owners)
    return out, tuple(notes)


@register("loadbalance")
class LoadBalancePolicy(Policy):
    def plan(self, state: State) -> Plan:
        base = PriorityPolicy().plan(state)
        ownership, notes = balanced_ownership(state)
        return replace(base, source=self.name, ownership=ownership, notes=notes,
                       reduce_in_leaf=fabric.oversubscribed(state.topology))
