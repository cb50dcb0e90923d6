import subprocess
import time

import pytest

from gradlane.daemon.control_protocol import MAX_CHUNKS
from gradlane.daemon.protocol import ChunkEvent, FlowSpec, Hello, Timing
from gradlane.daemon.registry import Credentials, Registry
from gradlane.errors import ProtocolError

FLOW = FlowSpec(0, "10.0.0.1", 40000, "10.0.0.2", 5201)


def hello(job: str = "j", rank: int = 0) -> Hello:
    return Hello(version=1, job=job, rank=rank, world_size=4, flows=(FLOW,))


def test_add_record_remove_bumps_version() -> None:
    reg = Registry(bands=4)
    w = reg.add(hello(), Credentials(10, 0, 0))
    assert w.iteration == -1  # none reported yet (gradlaned's /status shows it): not step 0
    v = reg.version
    reg.record_chunks(w.id, 5, (ChunkEvent(0, 100, 2, 0.0), ChunkEvent(1, 50, 2, 0.1)))
    reg.record_timing(w.id, Timing(6, 0.1, 0.05, 32))
    assert reg.version == v  # statistics do not touch traffic control
    assert w.chunk_events == 2 and w.chunk_bytes == [0, 0, 150, 0] and w.iteration == 6
    reg.set_flows(w.id, ())
    assert reg.version == v + 1
    reg.set_flows(w.id, (), exchange="ring")  # how its job reduces: the control plane plans by it
    reg.set_flows(w.id, ())  # None keeps what the worker said
    assert reg.version == v + 2 and w.exchange == "ring"
    reg.set_flows(w.id, (), global_batch=128)  # the job's batch: the control plane splits it
    reg.set_flows(w.id, (), global_batch=128)
    assert reg.version == v + 3 and w.global_batch == 128 and w.exchange == "ring"
    assert reg.remove(w.id) is w and len(reg) == 0 and reg.jobs() == {}
    assert reg.version == v + 4  # its flows go: traffic control changes
    assert reg.remove(w.id) is None and reg.version == v + 4  # twice: nothing changes


def test_a_reload_to_fewer_bands_counts_the_bytes_of_those_gone_in_the_last() -> None:
    reg = Registry(bands=4)
    w = reg.add(hello(), Credentials(10, 0, 0))
    reg.record_chunks(w.id, 1, tuple(ChunkEvent(0, 10 ** band, band, 0.0) for band in range(4)))
    reg.set_bands(2)
    assert w.chunk_bytes == [1, 1110]  # band 1's, then bands 2 and 3's: their connections'
    reg.set_bands(3)
    assert w.chunk_bytes == [1, 1110, 0]


def test_whether_a_worker_lives_is_asked_without_signalling_it() -> None:
    """`process_alive` sends signal 0 (a check, no signal): a live worker goes on."""
    from gradlane.daemon.registry import process_alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid)
        time.sleep(0.2)
        assert child.poll() is None  # not hung up, not killed
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)  # reaped: no such process


def test_a_worker_s_demand_is_its_latest_iteration_s_chunks_as_many_as_a_report_carries(
) -> None:
    reg = Registry(bands=4)
    w = reg.add(hello(), Credentials(10, 0, 0))
    reg.record_chunks(w.id, 1, (ChunkEvent(0, 100, 2, 0.0),))
    reg.record_chunks(w.id, 2, (ChunkEvent(3, 50, 1, 0.0),))
    reg.record_chunks(w.id, 2, (ChunkEvent(2, 70, 1, 0.1),))
    reg.record_chunks(w.id, 1, (ChunkEvent(9, 10, 0, 0.2),))  # late: counted, not demand
    assert w.demand == [(3, 50, 1), (2, 70, 1)] and w.chunk_events == 4
    # A shim that never moves on (broken, or not gradlane's) sends chunks of one iteration
    # forever: the demand stops at what a report to the control plane can carry.
    batch = tuple(ChunkEvent(1, 10, 0, 0.0) for _ in range(1000))
    for _ in range(MAX_CHUNKS // 1000 + 2):
        reg.record_chunks(w.id, 2, batch)
    assert len(w.demand) == MAX_CHUNKS and w.demand[:2] == [(3, 50, 1), (2, 70, 1)]
    assert w.chunk_events == 4 + 1000 * (MAX_CHUNKS // 1000 + 2)


def test_rank_conflict_and_takeover_from_dead_process() -> None:
    alive = {10: True}
    reg = Registry(bands=4, alive=lambda pid: alive.get(pid, False))
    reg.add(hello(), Credentials(10, 0, 0))
    with pytest.raises(ProtocolError, match="pid 10") as info:
        reg.add(hello(), Credentials(11, 0, 0))
    assert info.value.code == "conflict"
    alive[10] = False  # the first process died without saying bye
    w = reg.add(hello(), Credentials(11, 0, 0))
    assert [x.id for x in reg.workers()] == [w.id]


def test_expire_removes_dead_workers() -> None:
    alive = {1: True, 2: True}
    reg = Registry(bands=4, alive=lambda pid: alive[pid])
    reg.add(hello(rank=0), Credentials(1, 0, 0))
    keep = reg.add(hello(rank=1), Credentials(2, 0, 0))
    alive[1] = False
    assert [w.rank for w in reg.expire()] == [0]
    assert reg.workers() == [keep]


def test_reserved_job_names() -> None:
    with pytest.raises(ProtocolError, match="reserved"):
        Registry(bands=4).add(hello(job="_dscp"), Credentials(1, 0, 0))


def test_throughput_is_the_median_of_the_latest_steps() -> None:
    reg = Registry(bands=4)
    w = reg.add(hello(), Credentials(10, 0, 0))
    assert w.throughput() == 0.0  # nothing measured yet
    reg.record_timing(w.id, Timing(0, 0.0, 0.0, 32))  # a step without compute is no rate
    assert w.throughput() == 0.0
    for i, compute_s in enumerate([0.1, 0.1, 0.1, 0.1]):
        reg.record_timing(w.id, Timing(i + 1, compute_s, 0.05, 32))
    reg.record_timing(w.id, Timing(5, 0.4, 0.05, 32))  # one step slowed by a busy host
    assert w.throughput() == pytest.approx(320.0)
    for i in range(3):  # the worker really slowed down: seen by the third step
        reg.record_timing(w.id, Timing(6 + i, 0.2, 0.05, 32))
    assert w.throughput() == pytest.approx(160.0)
    reg.record_timing(w.id, Timing(9, 0.1, 0.05, 64))  # a bigger batch, same speed per sample
    assert w.throughput() == pytest.approx(160.0)
