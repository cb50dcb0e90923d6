"""The qdisc manager's pure parts: spec validation, the wanted tree, the filter diff."""

import pytest
from pyroute2.netlink.rtnl import TC_H_ROOT

from gradlane.daemon.qdisc import (
    DSCP_PREF_BASE,
    FlowMatch,
    JobSpec,
    QdiscSpec,
    _diff_filters,
    _wanted_classes,
    _wanted_filters,
)
from gradlane.daemon.tc import U32Filter, dscp_key, u32_bytemap
from gradlane.errors import ConfigError

M = 1_000_000


def spec(**kw: object) -> QdiscSpec:
    base: dict[str, object] = {
        "rate_bps": 100 * M,
        "other_rate_bps": 5 * M,
        "jobs": (JobSpec("a", 40 * M, 100 * M), JobSpec("b", 40 * M, 100 * M, prio=2)),
        "dscp_job": "a",
    }
    base.update(kw)
    return QdiscSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rate_bps": 0}, "rate_bps must be positive"),
        ({"other_rate_bps": 200 * M}, "other_rate_bps"),
        ({"bands": ()}, "bands"),
        ({"bands": (46, 46)}, "must differ"),
        ({"bands": (0, 46)}, "DSCP must be in 1..63"),
        ({"quantum": 100}, "quantum"),
        ({"dscp_job": "zzz"}, "dscp_job 'zzz'"),
        ({"jobs": (JobSpec("a", 1, 1), JobSpec("a", 1, 1))}, "unique"),
        ({"jobs": (JobSpec("a", 50 * M, 10 * M),), "dscp_job": None}, "rate_bps <= ceil_bps"),
        ({"jobs": (JobSpec("a", M, 500 * M),), "dscp_job": None}, "root rate"),
        ({"jobs": (JobSpec("a", M, M, prio=9),), "dscp_job": None}, "prio"),
        ({"jobs": (JobSpec("a", M, M, flows=(FlowMatch(band=4),)),), "dscp_job": None}, "band 4"),
    ],
)
def test_invalid_specs_are_refused_naming_the_problem(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec(**change)


def test_wanted_tree_shape() -> None:
    wanted = _wanted_classes(spec(), {"a": 1, "b": 2})
    ids = list(wanted)
    # every parent is created before its children
    for want in wanted.values():
        if want.parent != TC_H_ROOT:
            assert ids.index(want.parent) < ids.index(want.classid)
    assert wanted[0x474C0001].rate_bps == wanted[0x474C0001].ceil_bps == 100 * M
    assert wanted[0x474C0002].rate_bps == 5 * M and wanted[0x474C0002].prio == 7
    # job a (prio 0): leaves prio 0..3; job b (prio 2): 2, 3, 4, 5
    assert [wanted[0x474C0100 + b + 1].prio for b in range(4)] == [0, 1, 2, 3]
    assert [wanted[0x474C0200 + b + 1].prio for b in range(4)] == [2, 3, 4, 5]
    leaf = wanted[0x474C0104]
    assert leaf.parent == 0x474C0100 and leaf.ceil_bps == 100 * M
    assert leaf.rate_bps <= leaf.ceil_bps // 1000  # leaves live on borrowed bandwidth


def test_filters_existing_in_kernel_are_kept_and_missing_ones_added() -> None:
    s = spec(jobs=(JobSpec("a", M, 100 * M, flows=(FlowMatch(1, dport=5000),)),))
    want = _wanted_filters(s, {"a": 1})
    dscp0 = U32Filter(DSCP_PREF_BASE, 0x474C0101, u32_bytemap([dscp_key(46)]))
    flow = U32Filter(0x100, 0x474C0102, u32_bytemap(FlowMatch(1, dport=5000).keys()))
    stale = U32Filter(0x101, 0x474C0103, u32_bytemap(FlowMatch(2, dport=6000).keys()))
    wrong_dscp = U32Filter(DSCP_PREF_BASE + 1, 0x474C0102, u32_bytemap([dscp_key(10)]))
    keep, add, moved = _diff_filters(want, [dscp0, flow, stale, wrong_dscp])
    assert keep == {DSCP_PREF_BASE, 0x100}  # stale and wrong_dscp get deleted
    assert sorted(kind for kind, _, _ in add) == [1, 2, 3]  # DSCP bands 1..3 re-added
    keep, add, moved = _diff_filters(want, [])
    assert keep == set() and len(add) == 5 and moved == []


def test_a_flow_moved_to_another_band_is_retargeted_in_place() -> None:
    s = spec(jobs=(JobSpec("a", M, 100 * M, flows=(FlowMatch(3, dport=5000),)),))
    want = _wanted_filters(s, {"a": 1})
    node = U32Filter(0x100, 0x474C0102, u32_bytemap(FlowMatch(1, dport=5000).keys()), 0x80000800)
    keep, add, moved = _diff_filters(want, [node])
    assert 0x100 in keep and [item for item in add if item[0] < 0] == []
    assert [(old.pref, target) for old, _, target in moved] == [(0x100, 0x474C0104)]
    unknown = U32Filter(0x100, 0x474C0102, node.bytemap)  # handle not known: delete + add
    keep, add, moved = _diff_filters(want, [unknown])
    assert 0x100 not in keep and moved == [] and [i for i in add if i[0] < 0][0][2] == 0x474C0104
