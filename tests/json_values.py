"""Hypothesis strategies for JSON values, shared by the codec and export tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(max_int: int = 2**63) -> st.SearchStrategy[Any]:
    """Values ``json.dumps`` writes: nested lists and objects of null, booleans, integers
    within ``max_int`` (past 64 bits: integers only Python's json keeps whole), finite
    floats and text."""
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-max_int, max_value=max_int)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=20,
    )
