"""Hypothesis strategies the property tests share."""

from __future__ import annotations

from hypothesis import strategies as st


def _values(integers: st.SearchStrategy[int]) -> st.SearchStrategy[object]:
    return st.recursive(
        st.none() | st.booleans() | integers | st.floats() | st.text(max_size=4),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=6,
    )


# What a message can hold: what a peer of another version, or a broken one, can send in
# place of any field. JSON carries integers of any size (the strategy draws few past 64
# bits by itself: some are added), msgpack those of 64 bits.
json_like = _values(st.integers() | st.sampled_from([2**64, -(2**63) - 1, 2**100]))
msgpack_like = _values(st.integers(-(2**63), 2**64 - 1))
