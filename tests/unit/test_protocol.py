import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlane.daemon import protocol
from gradlane.daemon.fields import MAX_NAME
from gradlane.errors import ProtocolError
from tests import examples
from tests.strategies import msgpack_like

FLOW = {"band": 1, "src": "10.0.0.1", "sport": 40000, "dst": "10.0.0.2", "dport": 5201}
HELLO = {"type": "hello", "version": 1, "job": "j", "rank": 1, "world_size": 4, "flows": [FLOW]}


def decode_all(data: bytes) -> list[dict]:
    return list(protocol.FrameDecoder().feed(data))


def test_roundtrip_in_pieces() -> None:
    frames = protocol.encode(HELLO) + protocol.encode({"type": "bye"})
    decoder = protocol.FrameDecoder()
    got = []
    for i in range(len(frames)):  # one byte at a time
        got += decoder.feed(frames[i : i + 1])
    assert got == [HELLO, {"type": "bye"}] and decoder.pending == 0
    hello = protocol.parse(got[0], bands=4)
    assert isinstance(hello, protocol.Hello)
    assert hello.flows == (protocol.FlowSpec(1, "10.0.0.1", 40000, "10.0.0.2", 5201),)


def test_a_worker_of_a_large_flat_job_registers_every_connection_in_one_frame() -> None:
    # The shim's most bands to each of 1,024 peers, with the longest addresses.
    flow = {"band": 7, "src": "192.168.100.200", "sport": 65535, "dst": "192.168.100.201",
            "dport": 65535}
    hello = {**HELLO, "flows": [flow] * protocol.MAX_FLOWS}
    (decoded,) = decode_all(protocol.encode(hello))  # within MAX_FRAME
    assert len(protocol.parse(decoded, bands=8).flows) == 8 * 1024  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match="flows must be a list"):
        protocol.parse({**hello, "flows": [flow] * (protocol.MAX_FLOWS + 1)}, bands=8)


def test_a_band_past_the_daemon_s_last_counts_as_the_last() -> None:
    # A shim with four bands says hello before it hears that this daemon has two.
    flows = [{**FLOW, "band": b} for b in range(4)]
    hello = protocol.parse({**HELLO, "flows": flows}, bands=2)
    assert [f.band for f in hello.flows] == [0, 1, 1, 1]  # type: ignore[union-attr]
    chunks = protocol.parse({"type": "chunks", "iteration": 1, "events": [[0, 1, 3, 0.0]]}, 2)
    assert chunks.events[0].band == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("said", "kind"),
    [({}, None), ({"exchange": "ring"}, "ring"), ({"exchange": "leaf"}, "leaf"),
     ({"exchange": "flat"}, "flat"), ({"exchange": "host"}, "host"),
     # An older shim's flag.
     ({"in_leaf": True}, "leaf"), ({"in_leaf": False}, "flat")],
)
def test_exchange_says_how_the_job_reduces_or_nothing_yet(
    said: dict[str, object], kind: str | None
) -> None:
    assert protocol.parse({**HELLO, **said}, 4).exchange == kind  # type: ignore[union-attr]
    flows = protocol.parse({"type": "flows", "flows": [FLOW], **said}, 4)
    assert flows == protocol.SetFlows((protocol.FlowSpec(1, "10.0.0.1", 40000, "10.0.0.2", 5201),),
                                      exchange=kind)


def test_the_global_batch_the_ranks_agreed_or_nothing_yet() -> None:
    assert protocol.parse(HELLO, 4).global_batch is None  # type: ignore[union-attr]
    assert protocol.parse({**HELLO, "global_batch": 128}, 4).global_batch == 128  # type: ignore[union-attr]
    flows = protocol.parse({"type": "flows", "flows": [], "global_batch": 96}, 4)
    assert flows == protocol.SetFlows((), global_batch=96)
    assert "global_batch" in protocol.FEATURES  # the welcome says so: shims send it


def test_the_connections_a_shim_left_out_or_none() -> None:
    # Past MAX_FLOWS a shim registers none and says how many it left out, after the
    # welcome lists the field (a hello comes before it: never there).
    assert protocol.parse({"type": "flows", "flows": []}, 4) == protocol.SetFlows(())
    said = protocol.parse({"type": "flows", "flows": [], "flows_left_out": 8240}, 4)
    assert said == protocol.SetFlows((), flows_left_out=8240)
    assert "flows_left_out" in protocol.FEATURES
    with pytest.raises(ProtocolError, match="unknown fields"):
        protocol.parse({**HELLO, "flows_left_out": 8240}, 4)
    # ... and from which addresses (the NICs its traffic leaves by), each once.
    said = protocol.parse({"type": "flows", "flows": [], "flows_left_out": 8240,
                           "left_out_from": ["10.1.0.1", "10.0.0.1", "10.1.0.1"]}, 4)
    assert said == protocol.SetFlows((), flows_left_out=8240,
                                     left_out_from=frozenset({"10.0.0.1", "10.1.0.1"}))
    assert "left_out_from" in protocol.FEATURES
    most = [f"10.0.{i // 256}.{i % 256}" for i in range(protocol.MAX_SOURCES)]
    said = protocol.parse({"type": "flows", "flows": [], "left_out_from": most}, 4)
    assert said == protocol.SetFlows((), left_out_from=frozenset(most))


def test_chunks_and_timing() -> None:
    chunks = protocol.parse({"type": "chunks", "iteration": 3, "events": [[0, 4096, 0, 1.5]]}, 4)
    assert chunks == protocol.Chunks(3, (protocol.ChunkEvent(0, 4096, 0, 1.5),))
    timing = {"type": "timing", "iteration": 3, "compute_s": 0.2, "comm_s": 0.1, "samples": 32}
    assert protocol.parse(timing, 4) == protocol.Timing(3, 0.2, 0.1, 32)


@pytest.mark.parametrize(
    ("message", "code", "text"),
    [
        ({"type": "nope"}, "bad_message", "unknown message type"),
        ({**HELLO, "version": 2}, "version", "unsupported"),
        ({**HELLO, "rank": 4}, "bad_message", "rank"),
        ({**HELLO, "job": ""}, "bad_message", "job"),
        ({**HELLO, "extra": 1}, "bad_message", "unknown fields"),
        ({k: v for k, v in HELLO.items() if k != "flows"}, "bad_message", "missing field 'flows'"),
        ({**HELLO, "flows": [{**FLOW, "band": 64}]}, "bad_message", "band"),
        ({**HELLO, "flows": [{**FLOW, "band": -1}]}, "bad_message", "band"),
        ({**HELLO, "flows": [{**FLOW, "src": "nowhere"}]}, "bad_message", "IPv4"),
        ({**HELLO, "flows": [{**FLOW, "dport": 0}]}, "bad_message", "dport"),
        ({**HELLO, "rank": True}, "bad_message", "rank"),
        ({**HELLO, "in_leaf": 1}, "bad_message", "in_leaf must be true or false"),
        ({**HELLO, "exchange": "tree"}, "bad_message", "exchange must be one of flat, leaf, ring"),
        ({**HELLO, "exchange": True}, "bad_message", "exchange must be one of"),
        ({**HELLO, "global_batch": 0}, "bad_message", "global_batch must be an integer in 1"),
        ({"type": "flows", "flows": [], "global_batch": "64"}, "bad_message", "global_batch"),
        ({"type": "flows", "flows": [], "global_batch": True}, "bad_message", "global_batch"),
        ({"type": "flows", "flows": [], "flows_left_out": -1}, "bad_message", "flows_left_out"),
        ({"type": "flows", "flows": [], "flows_left_out": (1 << 31) + 1}, "bad_message",
         "flows_left_out"),
        ({"type": "flows", "flows": [], "left_out_from": ["10.0.0.1", "a NIC"]}, "bad_message",
         r"flows: left_out_from\[1\] must be an IPv4 address"),
        ({"type": "flows", "flows": [], "left_out_from": "10.0.0.1"}, "bad_message",
         "left_out_from must be a list of <= 64"),
        ({"type": "flows", "flows": [], "left_out_from": ["10.0.0.1"] * 65}, "bad_message",
         "left_out_from must be a list of <= 64"),
        ({**HELLO, "flows": [{**FLOW, "dst": 5}]}, "bad_message",
         r"hello: flows\[0\]: dst must be an IPv4 address"),
        ({"type": "chunks", "iteration": 1, "events": [[0, 1, 64, 0.0]]}, "bad_message",
         r"events\[0\]"),
        ({"type": "chunks", "iteration": 1, "events": [[0, 1]]}, "bad_message", r"events\[0\]"),
        ({"type": "timing", "iteration": 1, "compute_s": -1, "comm_s": 0, "samples": 1},
         "bad_message", "compute_s"),
    ],
)  # fmt: skip
def test_invalid_messages_name_the_problem(message: dict, code: str, text: str) -> None:
    with pytest.raises(ProtocolError, match=text) as info:
        protocol.parse(message, bands=4)
    assert info.value.code == code


@pytest.mark.parametrize(
    "frame, code, says",
    [
        (b"\x00\x00\x00\x00", "bad_frame", "frame length 0 not in 1.."),  # empty frame
        # oversized, refused before buffering
        ((protocol.MAX_FRAME + 1).to_bytes(4, "big"), "bad_frame",
         f"frame length {protocol.MAX_FRAME + 1} not in 1.."),
        (b"\x00\x00\x00\x01\xc1", "bad_frame", "not a msgpack message"),  # never-used byte
        (b"\x00\x00\x00\x01\x05", "bad_message", "a message is a map, got int"),  # an int
        (b"\x00\x00\x00\x03\x81\x01\x02", "bad_frame", "not a msgpack message: int is not "
         "allowed for map key"),  # a map with an int key
        (b"\x00\x00\x00\x09\x81\xa4type\xd4\x01x", "bad_frame", "not a msgpack message: 2 "
         "exceeds max_ext_len"),  # an extension type: no field is one
    ],
)
def test_bad_frames(frame: bytes, code: str, says: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{says}") as refused:
        decode_all(frame)
    assert refused.value.code == code


def test_each_limit_takes_its_last_value_and_refuses_the_next() -> None:
    def event(layer: int, nbytes: int) -> protocol.Message:
        return protocol.parse({"type": "chunks", "iteration": 1,
                               "events": [[layer, nbytes, 0, 0.0]]}, 4)

    assert event((1 << 20) - 1, 0) == protocol.Chunks(1, (protocol.ChunkEvent((1 << 20) - 1, 0,
                                                                             0, 0.0),))
    assert event(0, (1 << 40) - 1) == protocol.Chunks(1, (protocol.ChunkEvent(0, (1 << 40) - 1,
                                                                             0, 0.0),))
    for layer, nbytes in ((1 << 20, 1), (0, 1 << 40), (0, -1)):
        with pytest.raises(ProtocolError, match=r"events\[0\] has a bad value"):
            event(layer, nbytes)

    def timing(seconds: float, iteration: int = 1, samples: int = 1) -> protocol.Message:
        return protocol.parse({"type": "timing", "iteration": iteration, "compute_s": seconds,
                               "comm_s": 0, "samples": samples}, 4)

    assert timing(999_999_999.9) == protocol.Timing(1, 999_999_999.9, 0.0, 1)
    assert timing(0.1, iteration=0, samples=0) == protocol.Timing(0, 0.1, 0.0, 0)  # the first
    assert protocol.parse({"type": "chunks", "iteration": 0, "events": []}, 4) == \
        protocol.Chunks(0, ())
    with pytest.raises(ProtocolError, match=r"^hello: flows\[0\]: sport must be an integer"):
        protocol.parse({**HELLO, "flows": [{**FLOW, "sport": 0}]}, 4)
    with pytest.raises(ProtocolError, match=r"^hello: world_size must be an integer in 1\.\."):
        protocol.parse({**HELLO, "rank": 0, "world_size": 0}, 4)
    with pytest.raises(ProtocolError, match="^timing: compute_s must be a number >= 0"):
        timing(1e9)
    longest = "j" * MAX_NAME
    assert protocol.parse({**HELLO, "job": longest}, 4).job == longest  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match=f"^hello: job must be printable text of 1..{MAX_NAME}"):
        protocol.parse({**HELLO, "job": longest + "j"}, 4)
    with pytest.raises(ProtocolError, match=r"^hello: version must be an integer in 1\.\.") as old:
        protocol.parse({**HELLO, "version": 0}, 4)
    assert old.value.code == "bad_message"
    exact = protocol.encode({"type": "x", "pad": "a" * 100}, max_frame=1000)
    assert protocol.encode({"type": "x", "pad": "a" * 100}, max_frame=len(exact) - 4) == exact
    assert list(protocol.FrameDecoder(max_frame=len(exact) - 4).feed(exact)) == \
        [{"type": "x", "pad": "a" * 100}]


FLOWS = {"type": "flows", "flows": [FLOW]}
CHUNKS = {"type": "chunks", "iteration": 1, "events": []}
TIMING = {"type": "timing", "iteration": 1, "compute_s": 0.1, "comm_s": 0, "samples": 1}


def _with(message: dict, field: str, value: int) -> dict:
    """`message` with `field` (``flows.x``: of its flow) set to `value`."""
    if field.startswith("flows."):
        return {**message, "flows": [{**FLOW, field[6:]: value}]}
    return {**message, field: value}


@pytest.mark.parametrize(("message", "field", "low", "high"), [
    ({**HELLO, "rank": 0}, "world_size", 1, 1 << 20),
    (HELLO, "flows.sport", 1, 65535),
    (HELLO, "flows.dport", 1, 65535),
    (HELLO, "flows.band", 0, protocol.BAND_NUMBERS - 1),
    (HELLO, "global_batch", 1, 1 << 31),
    (FLOWS, "global_batch", 1, 1 << 31),
    (FLOWS, "flows_left_out", 0, 1 << 31),
    (CHUNKS, "iteration", 0, 1 << 62),
    (TIMING, "iteration", 0, 1 << 62),
    (TIMING, "samples", 0, 1 << 31),
])
def test_each_whole_number_field_takes_its_range_and_refuses_either_side(
        message: dict, field: str, low: int, high: int) -> None:
    for value in (low, high):
        protocol.parse(_with(message, field, value), 64)
    name = field.removeprefix("flows.")
    for value in (low - 1, high + 1):
        with pytest.raises(ProtocolError, match=f"{name} must be an integer in {low}..{high}$"):
            protocol.parse(_with(message, field, value), 64)


def test_the_counted_limits_take_their_last_and_refuse_the_next() -> None:
    event = [0, 1, 0, 0.0]
    most = protocol.parse({**CHUNKS, "events": [event] * protocol.MAX_EVENTS}, 4)
    assert len(most.events) == protocol.MAX_EVENTS  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match="events must be a list"):
        protocol.parse({**CHUNKS, "events": [event] * (protocol.MAX_EVENTS + 1)}, 4)
    sources = [f"10.0.{i}.1" for i in range(protocol.MAX_SOURCES + 1)]
    said = protocol.parse({**FLOWS, "left_out_from": sources[:-1]}, 4)
    assert len(said.left_out_from) == protocol.MAX_SOURCES  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match="left_out_from must be a list"):
        protocol.parse({**FLOWS, "left_out_from": sources}, 4)
    # A frame's map of 64 keys decodes; one of 65 is refused before any field is read.
    wide = {"type": "x", **{f"k{i}": i for i in range(63)}}
    assert decode_all(protocol.encode(wide)) == [wide]
    with pytest.raises(ProtocolError, match="^not a msgpack message: 65 exceeds max_map_len"):
        decode_all(protocol.encode({**wide, "k63": 63}))


def test_the_default_marks_are_ef_then_af41_af31_af21() -> None:
    # RFC 3246's EF, then RFC 2597's assured forwarding classes 4, 3 and 2 at the lowest
    # drop precedence (AFxy = 8x + 2y): the needed-first band in the highest class.
    assert protocol.DEFAULT_BAND_DSCP == (46, 8 * 4 + 2, 8 * 3 + 2, 8 * 2 + 2)


def test_encode_refuses_oversized() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.encode({"type": "x", "pad": "a" * 100}, max_frame=50)


@settings(max_examples=examples(400))
@given(st.binary(max_size=300))
def test_garbage_only_ever_raises_protocol_error(data: bytes) -> None:
    try:
        for raw in protocol.FrameDecoder().feed(data):
            protocol.parse(raw, bands=4)
    except ProtocolError:
        pass


@settings(max_examples=examples(400))
@given(
    st.sampled_from(["hello", "flows", "chunks", "timing", "bye", "x"]),
    st.dictionaries(
        st.sampled_from(["version", "job", "rank", "world_size", "flows", "events", "iteration",
                         "global_batch"]),
        msgpack_like,
        max_size=5,
    ),
)
def test_wrongly_typed_messages_only_ever_raise_protocol_error(kind: str, fields: dict) -> None:
    body = msgpack.packb({"type": kind, **fields})
    try:
        for raw in protocol.FrameDecoder().feed(len(body).to_bytes(4, "big") + body):
            protocol.parse(raw, bands=4)
    except ProtocolError:
        pass
