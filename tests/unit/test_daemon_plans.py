"""gradlaned takes whatever it is given without falling over: plans (floors, tc errors), reloads
and addresses that change while it runs."""

import asyncio
import contextlib
import dataclasses
import errno
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from gradlane.daemon import service
from gradlane.daemon.config import InterfaceConfig
from gradlane.daemon.protocol import ChunkEvent, FlowSpec, Hello, Timing
from gradlane.daemon.qdisc import (
    Claim,
    ClassStats,
    FlowMatch,
    QdiscManager,
    QdiscSpec,
    RootWatch,
    claim_holder,
)
from gradlane.daemon.registry import Credentials
from gradlane.daemon.service import RESTART_FIELDS, VERIFY_EVERY, Daemon
from gradlane.errors import GradlaneError, TcError
from gradlane.policies import JobClassPlan, Plan, Policy, State
from tests.fakes import FakeBackend, fake_config, status_shown


def _daemon(tmp_path: Path, backend: type[FakeBackend] = FakeBackend, jobs: str = "j",
            **config: Any) -> Daemon:
    """A daemon on a fake interface (its config changed as `config` says) with a worker of
    each of `jobs` registered."""
    daemon = Daemon(dataclasses.replace(fake_config(tmp_path / "gl.sock"), **config),
                    backend_factory=backend)
    me = Credentials(os.getpid(), os.getuid(), os.getgid())
    for job in jobs:
        daemon.registry.add(Hello(1, job, 0, 2, ()), me)
    return daemon


def test_a_control_plane_rate_of_a_few_bits_is_raised_to_the_trickle(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)
    backend = daemon._backends[0]
    plan = Plan(job_classes={"j": JobClassPlan(rate_bps=3, ceil_bps=3, prio=0)}, source="control")
    job = next(j for j in daemon.spec_for(backend, plan).jobs if j.name == "j")
    # 1 Gbit/s interface: the trickle is a thousandth of what is shaped, at least 8 kbit/s.
    assert job.rate_bps == job.ceil_bps == max(daemon._shaped(backend) // 1000, 8_000)


def test_each_interface_gets_the_plan_s_classes_scaled_to_its_rate(tmp_path: Path) -> None:
    # A plan is for the slowest NIC (here 1 Gbit/s, the host's link for a control plane
    # too); on a 4 Gbit/s one the job's class must not stay at 1 Gbit/s.
    daemon = _daemon(tmp_path, interfaces=(InterfaceConfig("fake0", 1_000_000_000),
                                           InterfaceConfig("fake1", 4_000_000_000)))
    plan = daemon.policy.plan(daemon.state())  # the local policy's, for 1 Gbit/s
    slow, fast = (next(j for j in daemon.spec_for(b, plan).jobs if j.name == "j")
                  for b in daemon._backends)
    shaped = [daemon._shaped(b) for b in daemon._backends]
    assert slow.ceil_bps == shaped[0] and fast.ceil_bps == shaped[1]
    assert fast.rate_bps == pytest.approx(4 * slow.rate_bps, rel=1e-6)


def test_the_local_plan_splits_what_other_traffic_leaves_evenly_between_the_jobs(
        tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, jobs="jk", other_share=0.1)
    backend = daemon._backends[0]
    shaped = daemon._shaped(backend)
    spec = daemon.spec_for(backend, daemon.policy.plan(daemon.state()))
    assert spec.rate_bps == shaped and spec.other_rate_bps == int(shaped * 0.1)
    jobs = {j.name: j for j in spec.jobs}
    for name in ("j", "k"):  # each guaranteed half of the other 90%, borrowing up to it all
        assert jobs[name].rate_bps == (shaped - int(shaped * 0.1)) // 2
        assert jobs[name].ceil_bps == shaped


class FailingBackend(FakeBackend):
    """Fails as pyroute2 does when a value does not fit its netlink field."""

    fail = True

    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]:
        if self.fail:
            raise struct.error("'I' format requires 0 <= number <= 4294967295")
        return super().apply(spec, verify=verify)


def test_a_tc_error_of_any_kind_is_counted_and_the_next_change_retried(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, FailingBackend)
    backend = daemon._backends[0]
    assert isinstance(backend, FailingBackend)

    async def main() -> None:
        await daemon._reconcile()  # must not raise
        assert daemon._reconcile_errors == 1 and backend.spec is None
        backend.fail = False
        await daemon._reconcile()
        assert backend.spec is not None and any(j.name == "j" for j in backend.spec.jobs)
        assert daemon._reconcile_errors == 1

    asyncio.run(main())


class _Broken(Policy):
    name = "broken"

    def plan(self, state: State) -> Plan:
        raise ZeroDivisionError("a third party's bug")


def test_a_policy_that_fails_to_plan_is_counted_and_the_daemon_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    daemon = _daemon(tmp_path)
    backend = daemon._backends[0]
    working, daemon.policy = daemon.policy, _Broken()

    async def main() -> None:
        await daemon._reconcile()  # must not raise
        assert daemon._reconcile_errors == 1 and backend.spec is None
        assert "policy broken failed to plan; retrying on the next change" in caplog.text
        daemon.policy = working
        await daemon._reconcile()
        assert backend.spec is not None and daemon._reconcile_errors == 1

    asyncio.run(main())


def test_counters_that_cannot_be_read_are_logged_and_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reads: list[int] = []

    class Unreadable(FakeBackend):
        def class_stats(self) -> list[Any]:
            reads.append(1)
            raise OSError(105, "No buffer space available")  # netlink's, not a TcError

    monkeypatch.setattr(service, "STATS_EVERY", 0.01)
    daemon = _daemon(tmp_path, Unreadable)

    async def main() -> None:
        task = asyncio.create_task(daemon._stats_loop())
        try:
            async with asyncio.timeout(10):
                while len(reads) < 3:
                    assert not task.done(), task.exception()
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert "fake0: reading class statistics failed" in caplog.text


def test_a_reload_to_another_number_of_bands_keeps_registered_workers_working(
    tmp_path: Path,
) -> None:
    daemon = _daemon(tmp_path)
    backend = daemon._backends[0]
    me = Credentials(os.getpid(), os.getuid(), os.getgid())
    flows = tuple(FlowSpec(b, "10.0.0.1", 40000 + b, "10.0.0.2", 5000) for b in range(4))
    worker = daemon.registry.add(Hello(1, "k", 0, 2, flows), me)

    async def main() -> None:
        await daemon._reconcile()
        assert backend.spec is not None and daemon._reconcile_errors == 0
        # Two bands (SIGHUP): the flows of bands 2 and 3 go with band 1, as the shims'
        # own connections do once they hear of the new table.
        await daemon.reload(dataclasses.replace(daemon.config, bands=(46, 10)))
        await daemon._reconcile()
        assert daemon._reconcile_errors == 0
        job = next(j for j in backend.spec.jobs if j.name == "k")
        assert [f.band for f in job.flows] == [0, 1, 1, 1]
        daemon.registry.record_chunks(worker.id, 1, (ChunkEvent(0, 100, 1, 0.0),))
        # Back to four: a chunk of band 3 from a worker registered under two.
        await daemon.reload(dataclasses.replace(daemon.config, bands=(46, 34, 26, 18)))
        daemon.registry.record_chunks(worker.id, 2, (ChunkEvent(0, 100, 3, 0.0),))
        await daemon._reconcile()
        assert daemon._reconcile_errors == 0
        assert worker.chunk_bytes == [0, 100, 0, 100]

    asyncio.run(main())


class MovingBackend(FakeBackend):
    """An interface whose addresses change while the daemon runs."""

    held: dict[str, set[str]] = {"fake0": {"10.0.0.1"}, "fake1": set()}

    def addresses(self) -> set[str]:
        return set(self.held[self.ifname])


def test_an_address_that_comes_after_the_start_takes_its_flows_to_its_interface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two interfaces: a flow goes to the one that holds its source address. The
    # second gets its address (DHCP, a late NIC) after gradlaned started.
    config = dataclasses.replace(
        fake_config(tmp_path / "gl.sock"),
        interfaces=(InterfaceConfig("fake0", 10**9), InterfaceConfig("fake1", 10**9)))
    now = [0.0]
    daemon = Daemon(config, backend_factory=MovingBackend, clock=lambda: now[0])
    first, second = daemon._backends
    me = Credentials(os.getpid(), os.getuid(), os.getgid())
    flows = (FlowSpec(0, "10.0.0.1", 40000, "10.0.0.2", 5000),
             FlowSpec(0, "10.1.0.1", 40001, "10.1.0.2", 5000))
    daemon.registry.add(Hello(1, "k", 0, 2, flows), me)
    monkeypatch.setitem(MovingBackend.held, "fake1", set())

    def sources(backend: FakeBackend) -> list[str]:
        assert backend.spec is not None
        return [f.src for j in backend.spec.jobs for f in j.flows if f.src is not None]

    async def main() -> None:
        await daemon._reconcile()
        assert (sources(first), sources(second)) == (["10.0.0.1"], [])
        MovingBackend.held["fake1"] = {"10.1.0.1"}
        now[0] += VERIFY_EVERY  # the next verifying reconcile reads the addresses again
        await daemon._reconcile()
        assert (sources(first), sources(second)) == (["10.0.0.1"], ["10.1.0.1"])

    asyncio.run(main())


class SlowToVerify(FakeBackend):
    """A kernel tree whose re-reading takes `took` seconds of the daemon's clock."""

    now = [0.0]
    took = 0.0
    verified: list[float] = []

    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]:
        if verify:
            self.verified.append(self.now[0])
            self.now[0] += self.took
        return super().apply(spec, verify=verify)


def test_a_verification_that_takes_long_comes_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Re-reading a tree of tens of thousands of flows takes seconds (about 0.2 ms a flow):
    # every 30 s, it would keep a core busy on a training host. The pace stretches so that
    # verifying takes at most VERIFY_SHARE of the time, and comes back when it is quick.
    monkeypatch.setattr(SlowToVerify, "now", [0.0])
    monkeypatch.setattr(SlowToVerify, "verified", [])
    daemon = Daemon(fake_config(tmp_path / "gl.sock"), backend_factory=SlowToVerify,
                    clock=lambda: SlowToVerify.now[0])
    caplog.set_level("INFO", logger=service.__name__)

    async def reconcile_at(t: float) -> None:
        SlowToVerify.now[0] = t
        await daemon._reconcile()

    async def main() -> None:
        SlowToVerify.took = 3.0  # 3 s / 0.05: every 60 s
        await reconcile_at(0.0)  # the first reconcile verifies
        assert daemon.status()["reconcile"]["verify_every_s"] == 3.0 / service.VERIFY_SHARE
        assert ("re-reads the kernel's trees every 60s, not every 30s: a re-read took over "
                "5% of that") in status_shown(daemon, monkeypatch)
        await reconcile_at(3.0 + VERIFY_EVERY)  # 30 s on: not yet
        await reconcile_at(3.0 + 59.0)
        assert SlowToVerify.verified == [0.0]
        SlowToVerify.took = 0.5
        await reconcile_at(3.0 + 60.0)
        await reconcile_at(63.5 + VERIFY_EVERY - 1)
        assert daemon.status()["reconcile"]["verify_every_s"] == VERIFY_EVERY
        assert "re-reads" not in status_shown(daemon, monkeypatch)
        await reconcile_at(63.5 + VERIFY_EVERY)
        assert SlowToVerify.verified == [0.0, 63.0, 63.5 + VERIFY_EVERY]

    asyncio.run(main())
    paced = [r.getMessage() for r in caplog.records if "verifying the kernel" in r.getMessage()]
    assert paced == ["verifying the kernel's trees every 60 s (the last verification took "
                     "3.00 s)", "verifying the kernel's trees every 30 s (the last "
                     "verification took 0.50 s)"]


class VanishedBackend(FakeBackend):
    """An interface that is gone by the time gradlaned restores it."""

    def restore(self) -> bool:
        raise TcError(errno.ENODEV, self.ifname, "", "no such interface")


def test_an_interface_gone_at_shutdown_is_a_warning_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _daemon(tmp_path, VanishedBackend)
    asyncio.run(daemon._restore_tc())
    said = [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records]
    assert said == [("WARNING", "fake0: no such interface (ENODEV); nothing to restore", None)]


class UnprivilegedBackend(FakeBackend):
    """The kernel's answer to a daemon without CAP_NET_ADMIN."""

    def apply(self, spec: QdiscSpec, *, verify: bool = False) -> list[str]:
        raise TcError(errno.EPERM, self.ifname, "install root qdisc htb 474c:")


def test_a_daemon_without_cap_net_admin_stops_saying_so(tmp_path: Path) -> None:
    # Retrying could never succeed: it used to log a failed reconcile at every change.
    daemon = _daemon(tmp_path, UnprivilegedBackend)
    with pytest.raises(GradlaneError, match=r"\(EPERM\): gradlaned needs CAP_NET_ADMIN"):
        asyncio.run(daemon._reconcile())


def test_a_reload_that_changes_what_is_set_up_at_start_reloads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The control plane's address, say: its link was made at start. Before, the new
    # config was taken with no word, as if applied.
    daemon = _daemon(tmp_path)
    before = daemon.config
    moved = dataclasses.replace(before, control_url="http://10.0.0.9:7800", bands=(46, 10))
    asyncio.run(daemon.reload(moved))
    assert daemon.config is before and daemon.registry.bands == len(before.bands)
    assert "reload: control_url changed; restart gradlaned to apply it" in caplog.text
    for name in RESTART_FIELDS:  # every one is a field of the config
        assert hasattr(before, name)


def test_a_reload_to_a_policy_not_installed_keeps_the_running_one_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the reload task raised, and asyncio logged "Task exception was never
    # retrieved" with a traceback in place of a word on what was refused.
    daemon = _daemon(tmp_path)
    before, policy = daemon.config, daemon.policy
    asyncio.run(daemon.reload(dataclasses.replace(before, policy="nosuch", bands=(46, 10))))
    assert daemon.config is before and daemon.policy is policy
    assert daemon.registry.bands == len(before.bands)
    assert "reload refused: unknown policy 'nosuch'" in caplog.text


def test_an_interface_claimed_by_another_process_stops_serve_before_anything_is_touched(
        tmp_path: Path) -> None:
    """Both interfaces are opened (claimed) first: the second's refusal closes the first
    and restores nothing, since the tree there is the other gradlaned's."""
    opened: list[str] = []

    class Claimed(FakeBackend):
        def open(self) -> None:
            if self.ifname == "fake1":
                raise TcError(errno.EBUSY, self.ifname, "root qdisc", "gradlaned (pid 1) "
                              "manages it already")
            opened.append(self.ifname)

        def close(self) -> None:
            if self.ifname in opened:
                opened.remove(self.ifname)

    config = dataclasses.replace(
        fake_config(tmp_path / "gl.sock"),
        interfaces=(InterfaceConfig("fake0", 10**9), InterfaceConfig("fake1", 10**9)))
    daemon = Daemon(config, backend_factory=Claimed)
    with pytest.raises(TcError, match=r"fake1: gradlaned \(pid 1\) manages it already"):
        asyncio.run(daemon.serve())
    backends = daemon._backends
    assert not opened and not any(b.restored or b.applied for b in backends)  # type: ignore[attr-defined]
    assert not (tmp_path / "gl.sock").exists()


def test_a_claim_is_one_process_s_until_it_lets_go_and_names_its_pid() -> None:
    name = f"glt{os.getpid()}"  # an abstract name of this test's own: no interface needed
    assert claim_holder(name) is None
    held = Claim(name)
    try:
        assert claim_holder(name) == os.getpid()
        with pytest.raises(TcError, match=rf"root qdisc on {name}: gradlaned \(pid "
                                          rf"{os.getpid()}\) manages it already") as refused:
            Claim(name)
        assert refused.value.errno == errno.EBUSY
        # Askers the holder has not let go of fill its backlog: then the pid is not told,
        # until the holder answers them (gradlaned does at each read of its counters).
        while claim_holder(name):
            pass
        with pytest.raises(TcError, match=rf"{name}: another gradlaned manages it already"):
            Claim(name)
        held.answer()
        assert claim_holder(name) == os.getpid()
    finally:
        held.close()
    assert claim_holder(name) is None
    Claim(name).close()


def test_gradlaned_s_manager_holds_its_interface_s_claim_and_answers_at_each_read(
        tmp_path: Path) -> None:
    manager = QdiscManager("lo", state_file=tmp_path / "state.json", exclusive=True)
    with manager:  # loopback: there everywhere; its counters read, nothing changed
        assert claim_holder("lo") == os.getpid()
        while claim_holder("lo"):  # a backlog of askers not let go of
            pass
        manager.class_stats()
        assert claim_holder("lo") == os.getpid()
    assert claim_holder("lo") is None


class _PlanFrom:
    """A control link whose fresh plan gives job j `rate` for a host link of `link`."""

    def __init__(self, rate: int, link: int | None) -> None:
        self.rate, self.link = rate, link

    def job_classes(self) -> dict[str, JobClassPlan]:
        return {"j": JobClassPlan(self.rate, 4 * self.rate, 1)}

    def planned_link_bps(self) -> int | None:
        return self.link


class _TwoAddresses(FakeBackend):
    def addresses(self) -> set[str]:
        return {"fake0": {"10.0.0.1"}, "fake1": {"10.1.0.1"}}[self.ifname]


@pytest.mark.parametrize(("link", "each"), [
    (2_000_000_000, 250_000_000),  # planned for both NICs: a quarter of it on each
    (None, 500_000_000),  # an older control plane planned for the slowest NIC: half on each
])
def test_a_control_plane_s_classes_are_split_by_the_link_it_planned_for(
    tmp_path: Path, link: int | None, each: int
) -> None:
    config = dataclasses.replace(fake_config(tmp_path / "gl.sock"), interfaces=(
        InterfaceConfig("fake0", 1_000_000_000), InterfaceConfig("fake1", 1_000_000_000)))
    daemon = Daemon(config, backend_factory=_TwoAddresses)
    me = Credentials(os.getpid(), os.getuid(), os.getgid())
    flows = (FlowSpec(0, "10.0.0.1", 40000, "10.0.0.2", 5000),
             FlowSpec(0, "10.1.0.1", 40001, "10.1.0.2", 5000))
    daemon.registry.add(Hello(1, "j", 0, 2, flows), me)
    daemon.link = _PlanFrom(500_000_000, link)  # type: ignore[assignment]

    async def main() -> None:
        await daemon._reconcile()  # reads the interfaces' addresses first
        await daemon._reconcile()

    asyncio.run(main())
    assert daemon.link_bps() == 2_000_000_000  # the flows leave by both NICs
    for backend in daemon._backends:
        assert isinstance(backend, FakeBackend) and backend.spec is not None
        job = next(j for j in backend.spec.jobs if j.name == "j")
        assert job.rate_bps == each and job.flows == tuple(
            FlowMatch(0, f.src, f.sport, f.dst, f.dport) for f in flows
            if f.src in backend.addresses())


@pytest.mark.parametrize(("left_out_from", "link"), [
    ({"10.1.0.1"}, 4_000_000_000),  # its connections leave by the fast NIC
    ({"10.0.0.1", "10.1.0.1"}, 5_000_000_000),  # by both
    (set(), 1_000_000_000),  # an older shim: not said, the slowest as before
])
def test_the_host_link_of_a_worker_whose_connections_were_left_out(
    tmp_path: Path, left_out_from: set[str], link: int
) -> None:
    # A worker of more connections than gradlaned registers registers none; the NICs they
    # leave by (its shim says which) are still this host's link for the plans.
    config = dataclasses.replace(fake_config(tmp_path / "gl.sock"), interfaces=(
        InterfaceConfig("fake0", 1_000_000_000), InterfaceConfig("fake1", 4_000_000_000)))
    daemon = Daemon(config, backend_factory=_TwoAddresses)
    me = Credentials(os.getpid(), os.getuid(), os.getgid())
    worker = daemon.registry.add(Hello(1, "big", 0, 2, ()), me)
    asyncio.run(daemon._reconcile())  # reads the interfaces' addresses
    assert daemon.link_bps() == 1_000_000_000  # nothing said yet: the slowest
    daemon.registry.set_flows(worker.id, (), left_out=8240,
                              left_out_from=frozenset(left_out_from))
    assert daemon.link_bps() == link


class _Word:
    """A stand-in for `RootWatch`: a pipe to wake the loop, and what it says when read."""

    ALL = RootWatch.ALL

    def __init__(self, says: set[int] | OSError) -> None:
        self.says = says
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)

    def fileno(self) -> int:
        return self.r

    def roots_changed(self) -> set[int]:
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 64)
        if isinstance(self.says, OSError):
            raise self.says
        return self.says

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


def test_the_kernel_s_word_of_a_root_gone_makes_the_next_reconcile_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _daemon(tmp_path)
    words: list[_Word] = []

    def watch(says: set[int] | OSError) -> None:
        words.append(_Word(says))
        monkeypatch.setattr(service, "RootWatch", lambda: words[-1])

    async def heard(word: _Word) -> None:
        os.write(word.w, b"x")
        await asyncio.sleep(0.05)

    async def main() -> None:
        # Another interface's root (index 99: not the fake's, which has none): nothing.
        watch({99})
        assert daemon._watch_roots() is words[-1]
        daemon._verified_at, daemon._dirty = 100.0, asyncio.Event()
        await heard(words[-1])
        assert not daemon._dirty.is_set() and daemon._verified_at == 100.0
        asyncio.get_running_loop().remove_reader(words[-1].fileno())
        # Words lost (the socket overflowed): verify at the next reconcile.
        watch({RootWatch.ALL})
        daemon._watch_roots()
        await heard(words[-1])
        assert daemon._dirty.is_set() and daemon._verified_at == -math.inf
        asyncio.get_running_loop().remove_reader(words[-1].fileno())
        # The socket failing: one warning, and it is not read again.
        watch(OSError(errno.EBADF, "Bad file descriptor"))
        daemon._watch_roots()
        await heard(words[-1])
        await heard(words[-1])

    asyncio.run(main())
    for word in words:
        word.close()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["no netlink word of qdisc changes ([Errno 9] Bad file descriptor): "
                      "gradlaned repairs its trees every 30 s only"]


def _stats(role: str, job: str | None, band: int | None, bps: float | None,
           sent: int = 0) -> ClassStats:
    return ClassStats("1:10", role, job, band, 0, 0, sent, 0, 0, 0, 0, bps)


def test_band_throughput_and_metrics_come_from_the_latest_class_samples(
        tmp_path: Path) -> None:
    # What gradlaned reports to a control plane (each job's bands' bit/s, summed over
    # interfaces, bands it has not measured at 0) and what /metrics shows, from the
    # classes' latest reads. A class read once has no rate yet; neither has a band idle.
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    daemon = _daemon(tmp_path)
    daemon._stats = {
        "fake0": [_stats("root", None, None, 9e9), _stats("job", "j", None, 5e6, sent=700),
                  _stats("band", "j", 0, 1e6), _stats("band", "j", 2, 3e6, sent=300),
                  _stats("band", "k", 1, None), _stats("band", "k", 0, 0.0)],
        "fake1": [_stats("band", "j", 0, 2e6), _stats("job", "k", None, None)],
    }
    assert daemon._band_throughput() == {"j": [3e6, 0.0, 3e6]}

    def samples(name: str) -> dict[tuple[str, ...], float]:  # by label values, sorted
        text = generate_latest(daemon.metrics).decode()
        return {tuple(v for _, v in sorted(sample.labels.items())): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == name}

    assert samples("gradlane_job_throughput_bps") == {("fake0", "j"): 5e6}
    sent = samples("gradlane_class_bytes_total")  # by band, classid, interface, job, role
    assert sent[("", "1:10", "fake0", "j", "job")] == 700
    assert sent[("2", "1:10", "fake0", "j", "band")] == 300
    assert samples("gradlane_interface_shaped") == {("fake0",): 1.0}
    daemon._unshaped["fake0"] = "a root qdisc of someone else's"
    assert samples("gradlane_interface_shaped") == {("fake0",): 0.0}


def test_a_class_planned_for_another_link_scales_with_it() -> None:
    cls = JobClassPlan(rate_bps=100, ceil_bps=1000, prio=2)
    assert service._scaled(cls, 1) is cls
    assert service._scaled(cls, 4) == JobClassPlan(400, 4000, 2)
    assert service._scaled(cls, 0.25) == JobClassPlan(25, 250, 2)
    # Never below 1 bit/s, the ceil never below the rate.
    assert service._scaled(JobClassPlan(1, 1, 0), 0.001) == JobClassPlan(1, 1, 0)
    assert service._scaled(JobClassPlan(10, 10, 0), 0.2) == JobClassPlan(2, 2, 0)


def test_status_shows_each_worker_s_last_timing(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)
    (worker,) = daemon.registry.jobs()["j"]
    assert daemon.status()["jobs"][0]["workers"][0]["last_timing"] is None
    for it in (1, 2):
        daemon.registry.record_timing(worker.id, Timing(it, 0.1 * it, 0.01, 32))
    (shown,) = daemon.status()["jobs"][0]["workers"]
    assert shown["last_timing"] == {"iteration": 2, "compute_s": 0.2, "comm_s": 0.01,
                                    "samples": 32}
    assert shown["iteration"] == 2


def test_status_shows_the_daemon_s_uptime_and_its_plan_s_age(tmp_path: Path) -> None:
    now = [100.0]
    started = time.time()
    daemon = Daemon(fake_config(tmp_path / "gl.sock"), backend_factory=FakeBackend,
                    clock=lambda: now[0])
    assert daemon.status()["plan"]["age_s"] is None  # none yet
    daemon._plan, daemon._plan_at = daemon.policy.plan(daemon.state()), now[0]
    now[0] += 2.5
    status = daemon.status()
    assert status["plan"]["age_s"] == 2.5
    assert 0 <= status["uptime_s"] <= time.time() - started + 0.001


@pytest.mark.parametrize(("left_out", "prio"), [
    ("", 0),  # none: marked traffic of shims not registered yet goes first
    ("b", 3),  # b's workers go by their marks: at b's place in the order
    ("ab", 1),  # two such jobs: the first served of them
])
def test_the_dscp_class_is_served_at_the_place_of_the_jobs_left_out(
    tmp_path: Path, left_out: str, prio: int
) -> None:
    # A worker of more connections than gradlaned registers goes by its DSCP marks alone;
    # where bandwidth is borrowed its job must not come before a job the plan put first.
    daemon = _daemon(tmp_path, jobs="abc")
    for worker in daemon.registry.workers():
        if worker.job in left_out:
            daemon.registry.set_flows(worker.id, (), left_out=8240)
    plan = Plan(job_classes={j: JobClassPlan(1_000_000, 100_000_000, p)
                             for j, p in (("a", 1), ("b", 3), ("c", 0))}, source="test")
    dscp = daemon.spec_for(daemon._backends[0], plan).jobs[0]
    assert dscp.name == service.DSCP_JOB and dscp.prio == prio


def test_a_worker_that_starts_or_stops_leaving_flows_out_is_a_change(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)
    worker = daemon.registry.workers()[0]
    versions = [daemon.registry.version]
    for left_out in (8240, 8241, 0):
        daemon.registry.set_flows(worker.id, (), left_out=left_out)
        versions.append(daemon.registry.version)
    assert versions[1] > versions[0] and versions[2] == versions[1] and versions[3] > versions[2]
