import pytest

from gradlane.errors import ConfigError
from gradlane.units import first_of, format_rate, parse_rate


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 1_000_000_000),
        ("200mbit", 200_000_000),
        ("200Mbit", 200_000_000),
        ("1.5gbit", 1_500_000_000),
        ("64kbit", 64_000),
        ("10000", 10_000),  # a bare number is bit/s
        ("8kbit", 8_000),  # the slowest HTB shapes at
        ("10mbps", 80_000_000),  # tc: bps = bytes per second
        ("8000bit", 8_000),
        ("1tbit", 10**12),
        ("1000bps", 8_000),
        ("1kbps", 8_000),
        ("2.5mbps", 20_000_000),
        ("1gbps", 8_000_000_000),
        (" 3 GBit ", 3_000_000_000),  # tc's case and spacing
        (2_000_000, 2_000_000),
    ],
)
def test_parse_rate(text: str | int, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize("bad", ["", "fast", "10 furlongs", "-5mbit", "0", 0, -1, True, "1e9bit"])
def test_parse_rate_rejects_bad_input_with_a_clear_message(bad: object) -> None:
    with pytest.raises(ConfigError, match="rate"):
        parse_rate(bad)  # type: ignore[arg-type]


def test_a_rate_htb_cannot_shape_is_refused() -> None:
    # Slower than 8 kbit/s, HTB's time per burst overflows netlink's 32 bits (pyroute2
    # raised struct.error deep in building the testbed or the daemon's tree).
    with pytest.raises(ConfigError, match=r"at least 8Kbit \(HTB shapes nothing slower\), "
                                          r"got '1bit'"):
        parse_rate("1bit")


def test_format_rate() -> None:
    assert format_rate(192_500_000) == "192.5Mbit"
    assert format_rate(1e9) == "1Gbit"
    assert format_rate(500) == "500bit"
    assert format_rate(64_000) == "64Kbit"
    assert format_rate(999_999) == "1000Kbit"  # 4 significant digits, in the lower unit
    assert format_rate(2.5e12) == "2500Gbit"


@pytest.mark.parametrize(("items", "most", "said"), [
    ([], 3, ""),
    (["a", "b"], 3, "a, b"),
    (["a", "b", "c"], 3, "a, b, c"),
    (["a", "b", "c", "d"], 3, "a, b, c and 1 more"),
    (["a", "b", "c", "d", "e"], 3, "a, b, c and 2 more"),
])
def test_a_list_for_a_line_names_the_first_and_counts_the_rest(
        items: list[str], most: int, said: str) -> None:
    assert first_of(items, most) == said
