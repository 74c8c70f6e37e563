"""Search attributes: the fold merges each ``AttributesSet`` into the state, the stored
meta keeps them, and ``where`` compares values as documented."""

from __future__ import annotations

import pytest

from stepstream.engine.api.attributes import attribute_problem, parse_where, same_value
from stepstream.engine.reads.listing import ListQuery, where_pairs
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.replay.state_json import meta_json, state_from_storage
from stepstream.engine.wire.records import AttributesSet


def test_the_fold_merges_removes_and_the_meta_keeps_them() -> None:
    state = InstanceState("o-1")
    state.apply(
        AttributesSet(
            instance_id="o-1",
            seq=1,
            key="attributes#1",
            attributes={"customer": "42", "vip": True, "n": 3},
        )
    )
    state.apply(
        AttributesSet(
            instance_id="o-1", seq=2, key="attributes#2", attributes={"vip": None, "stage": "paid"}
        )
    )
    # Applied twice (a restore after a crash): nothing changes.
    state.apply(
        AttributesSet(instance_id="o-1", seq=2, key="attributes#2", attributes={"stage": "other"})
    )
    assert state.attributes == {"customer": "42", "n": 3, "stage": "paid"}
    again = state_from_storage("o-1", meta_json(state), [])
    assert again.attributes == state.attributes
    assert type(again.attributes["n"]) is int


@pytest.mark.parametrize(
    ("stored", "wanted", "match"),
    [
        ("42", "42", True),
        ("42", 42, False),
        (25.0, 25, True),
        (1, True, False),
        (True, True, True),
        (False, 0, False),
        ("a", "b", False),
        # Exactly, past a float's 53 bits: large ids do not collide.
        (9007199254740993, 9007199254740992, False),
        (9007199254740993, 9007199254740993, True),
        (2**53, float(2**53), True),
    ],
)
def test_where_compares_text_numbers_and_bools(stored: object, wanted: object, match: bool) -> None:
    assert same_value(stored, wanted) is match


def test_cli_values_and_any_of() -> None:
    where = parse_where(["customer=42", 'name="42"', "vip=true", "note=hello world"])
    assert where == {
        "customer": [42, "42"],
        "name": "42",
        "vip": [True, "true"],
        "note": "hello world",
    }
    query = ListQuery(where=where_pairs(where | {"note": "hello world"}))
    assert query.has_attributes(
        {"customer": "42", "name": "42", "vip": True, "note": "hello world"}
    )
    assert not query.has_attributes(
        {"customer": "42", "name": 42, "vip": True, "note": "hello world"}
    )
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_where(["customer"])


def test_what_an_attribute_may_not_be() -> None:
    assert attribute_problem("ok", "x") is None
    assert "finite" in (attribute_problem("n", float("inf")) or "")
    assert "lone surrogate" in (attribute_problem("t", "\ud800") or "")
    assert "is a dict" in (attribute_problem("d", {}) or "")
    assert "must fit in 64 bits" in (attribute_problem("n", -(2**63) - 1) or "")
    assert attribute_problem("n", -(2**63)) is None
