"""`ShimConfig`'s checks of attach's options: each bad value refused with what it must be,
and the edges of each range taken."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlane.daemon import protocol, registry
from gradlane.errors import ConfigError, ProtocolError
from gradlane.shim.config import ShimConfig

EDGES: dict[str, object] = {"chunk_bytes": 4096, "dscp": tuple(range(56, 64)), "credit_bytes": 1024,
                            "timeout_s": 0.001, "job": "j" * 128, "sndbuf_bytes": 0,
                            "leaf": 65535, "layout": "coarse", "exchange": "ring"}


def test_numpy_numbers_a_list_and_a_path_are_kept_as_plain_python_values() -> None:
    """What a training script computes or writes naturally; kept as the int, float, tuple
    and str the wire format (msgpack) and the comparisons between ranks expect."""
    config = ShimConfig.of({"chunk_bytes": np.int64(1 << 20), "timeout_s": np.float32(2.5),
                            "leaf": np.uint16(3), "dscp": [46, 26],
                            "daemon_socket": Path("/run/gl.sock")})
    assert (config.chunk_bytes, config.timeout_s, config.leaf) == (1 << 20, 2.5, 3)
    assert (type(config.chunk_bytes), type(config.timeout_s), type(config.leaf)) == (
        int, float, int)
    assert config.dscp == (46, 26) and config.bands == 2
    assert config.daemon_socket == "/run/gl.sock"
    assert msgpack.unpackb(msgpack.packb(config.signature())) == config.signature()


def test_the_defaults_are_the_documented_ones() -> None:
    """The README's transport: at most 128 KiB of unsent data per band (the credit); the
    send buffer the kernel's to tune (0: SO_SNDBUF not set)."""
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert "TCP_NOTSENT_LOWAT (128 KiB of unsent data per band at most)" in readme
    assert (ShimConfig().credit_bytes, ShimConfig().sndbuf_bytes) == (128 << 10, 0)


def test_the_edges_of_every_range_are_taken() -> None:
    assert ShimConfig() == ShimConfig.of({})
    for name, value in EDGES.items():
        assert getattr(ShimConfig.of({name: value}), name) == value
    assert ShimConfig.of({"chunk_bytes": 1 << 30, "dscp": (0,), "leaf": 0}).bands == 1
    assert ShimConfig.of({"timeout_s": 86400}).timeout_s == 86400
    assert ShimConfig.of({"credit_bytes": 1 << 30, "sndbuf_bytes": 1 << 30}).credit_bytes == 1 << 30
    assert len(ShimConfig.of({"daemon_socket": "/run/" + "g" * 102}).daemon_socket) == 107
    assert ShimConfig.of({"daemon_socket": "s"}).daemon_socket == "s"  # relative, one byte


@pytest.mark.parametrize("options, says", [
    ({"chunk_bytes": 4095}, "chunk_bytes must be 4 KiB..1 GiB, got 4095"),
    ({"chunk_bytes": (1 << 30) + 1}, "chunk_bytes must be 4 KiB..1 GiB"),
    ({"dscp": ()}, "dscp must list 1..8 bands, got 0"),
    ({"dscp": tuple(range(9))}, "dscp must list 1..8 bands, got 9"),
    ({"dscp": (46, 64)}, r"dscp values must be integers 0..63, got \(46, 64\)"),
    ({"dscp": (46, -1)}, "dscp values must be integers 0..63"),
    ({"dscp": (46.0,)}, "dscp values must be integers 0..63"),
    ({"credit_bytes": 1023}, "credit_bytes must be 1 KiB..1 GiB, got 1023"),
    # A socket option, a C int: 2 GiB failed at the first connect (TypeError).
    ({"credit_bytes": 1 << 31}, "credit_bytes must be 1 KiB..1 GiB, got 2147483648"),
    ({"timeout_s": 0}, r"timeout_s must be positive, at most 86400 \(a day\), got 0"),
    ({"timeout_s": float("nan")}, "timeout_s must be positive, at most 86400 .*, got nan"),
    ({"timeout_s": float("inf")}, "timeout_s must be positive, at most 86400 .*, got inf"),
    ({"timeout_s": 86400.5}, "timeout_s must be positive, at most 86400 .*, got 86400.5"),
    ({"job": ""}, "job must be 1..128 printable characters, not starting with '_': ''"),
    ({"job": "j" * 129}, "job must be 1..128 printable characters"),
    ({"job": "_hidden"}, "job must be 1..128 printable characters, not starting with '_': "
                         "'_hidden'"),
    ({"job": "train\n"}, "job must be 1..128 printable characters, not starting with '_': "
                         "'train"),
    ({"sndbuf_bytes": -1}, "sndbuf_bytes must be 0..1 GiB, got -1"),
    # Past the kernel's limit, connect() failed every 2 s for as long as the job ran.
    ({"daemon_socket": "/run/" + "g" * 103}, "daemon_socket must be a path of 1..107 bytes "
                                            r"\(the kernel's limit for a Unix socket\), got"),
    ({"daemon_socket": ""}, "daemon_socket must be a path of 1..107 bytes"),
    ({"sndbuf_bytes": 1 << 31}, "sndbuf_bytes must be 0..1 GiB, got 2147483648"),
    ({"leaf": -1}, "leaf must be an integer 0..65535 or None, got -1"),
    ({"leaf": 65536}, "leaf must be an integer 0..65535 or None, got 65536"),
    ({"leaf": "1"}, "leaf must be an integer 0..65535 or None, got '1'"),
    ({"layout": "huge"}, "layout must be one of auto, fine, coarse, got 'huge'"),
    ({"exchange": "tree"}, "exchange must be one of auto, flat, ring, got 'tree'"),
    ({"credit": 4096}, "unknown option 'credit': did you mean 'credit_bytes'"),
    # Of the wrong kind: what it must be, not a TypeError from a comparison (or, for
    # overlap, any text taken as True).
    ({"chunk_bytes": "1mb"}, "chunk_bytes must be a whole number of bytes, got '1mb'"),
    ({"chunk_bytes": 65536.5}, "chunk_bytes must be a whole number of bytes, got 65536.5"),
    ({"credit_bytes": True}, "credit_bytes must be a whole number of bytes, got True"),
    ({"timeout_s": "5"}, "timeout_s must be a number of seconds, got '5'"),
    ({"overlap": "no"}, "overlap must be True or False, got 'no'"),
    ({"dscp": 46}, r"dscp must be a tuple \(or list\) of DSCP values, got 46"),
    ({"job": 5}, "job must be text, got 5"),
    ({"daemon_socket": None}, "daemon_socket must be a path, got None"),
    ({"sndbuf_bytes": None}, "sndbuf_bytes must be a whole number of bytes, got None"),
    ({"leaf": True}, "leaf must be an integer 0..65535 or None, got True"),
    ({"layout": None}, "layout must be text, got None"),
    ({"exchange": 2}, "exchange must be text, got 2"),
])
def test_a_bad_option_is_refused_saying_what_it_must_be(options: dict[str, object],
                                                        says: str) -> None:
    with pytest.raises(ConfigError, match=f"^{says}"):
        ShimConfig.of(options)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=140)
       | st.sampled_from(["j" * 128, "j" * 129, "_x", "a\tb", "\u00e9t\u00e9"]))
def test_the_shim_takes_the_job_names_gradlaned_takes(job: str) -> None:
    # A name the shim took and gradlaned refused (a tab in it, say) left every rank
    # unregistered, asking again for as long as the job ran.
    hello = {"type": "hello", "version": protocol.VERSION, "job": job, "rank": 0,
             "world_size": 1, "flows": []}
    try:
        protocol.parse(hello, bands=4)
        registry.Registry(bands=4).add(protocol.parse(hello, bands=4),  # type: ignore[arg-type]
                                       registry.Credentials(1, 0, 0))
        taken = True
    except ProtocolError:
        taken = False
    try:
        ShimConfig(job=job)
    except ConfigError:
        assert not taken
    else:
        assert taken
