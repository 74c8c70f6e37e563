"""Which version of a workflow a registry gives new instances, and which registrations
it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream.engine.api.context import Context
from stepstream.engine.api.workflow import Registry, ordered_versions, workflow
from stepstream.engine.errors import DuplicateWorkflow, StepstreamError, UnknownWorkflow
from stepstream.engine.wire.settle import error_for
from tests import versioned_workflows as vw


def _versions(name: str, *versions: str) -> list[Any]:
    """A fresh function per version of ``name``, in this order of declaration."""
    made = []
    for version in versions:

        @workflow(name, version=version)
        async def fn(ctx: Context, arg: Any) -> Any:
            return arg

        made.append(fn)
    return made


def test_latest_is_the_highest_number_whatever_the_order() -> None:
    assert Registry(_versions("w", "10", "9")).resolve("w").version == "10"
    assert Registry(_versions("w", "9", "10")).resolve("w").version == "10"
    assert Registry(_versions("w", "2", "10", "1")).resolve("w").version == "10"
    assert Registry(_versions("w", "100", "99", "020")).resolve("w").version == "100"


def test_latest_is_the_last_declared_when_a_version_is_not_a_number() -> None:
    assert Registry(_versions("w", "beta", "alpha")).resolve("w").version == "alpha"
    assert Registry(_versions("w", "2", "1.5")).resolve("w").version == "1.5"
    assert Registry(_versions("w", "10", "9", "v8")).resolve("w").version == "v8"
    # Adding a version later can change which is latest.
    registry = Registry(_versions("w", "3"))
    assert registry.resolve("w").version == "3"
    registry.add(_versions("w", "x")[0])
    assert registry.resolve("w").version == "x"


def test_a_module_declares_the_order() -> None:
    registry = Registry()
    registry.add_module("tests.versioned_workflows")
    assert registry.resolve("pricing").fn is vw.pricing_v2
    assert registry.resolve("rounding").fn is vw.rounding_v10
    assert registry.resolve("tax").fn is vw.tax_alpha
    assert registry.names() == {
        "pricing": ["1", "2"],
        "rounding": ["9", "10"],
        "tax": ["beta", "alpha"],
    }


def test_ordered_versions() -> None:
    assert ordered_versions(["10", "9", "1"]) == ["1", "9", "10"]
    assert ordered_versions(["b", "a", "b"]) == ["b", "a"]
    assert ordered_versions(["1", "01"]) == ["1", "01"]
    assert ordered_versions(["²"]) == ["²"]  # a digit to str.isdigit, not a number here
    assert ordered_versions([]) == []


def test_a_pinned_version_resolves_to_its_own_code() -> None:
    registry = Registry([vw.pricing_v1, vw.pricing_v2])
    assert registry.resolve("pricing", "1").fn is vw.pricing_v1
    assert registry.resolve("pricing", "2").fn is vw.pricing_v2


def test_an_unknown_version_names_the_known_ones() -> None:
    registry = Registry(_versions("w", "10", "9"))
    with pytest.raises(UnknownWorkflow, match=r"'w' version '3' \(registered versions: 9, 10\)"):
        registry.resolve("w", "3")
    with pytest.raises(UnknownWorkflow, match="unknown workflow 'nope'"):
        registry.resolve("nope", "1")


def test_a_start_dead_lettered_for_its_version_reaches_the_client_as_unknown_workflow() -> None:
    """A worker that lacks a pinned version (a rolling deploy) dead-letters the start with
    the registry's words; the publisher turns them back into ``UnknownWorkflow``."""
    with pytest.raises(UnknownWorkflow) as refused:
        Registry(_versions("w", "1")).resolve("w", "2")
    again = error_for(str(refused.value), "i-1", "start")
    assert type(again) is UnknownWorkflow and str(again) == str(refused.value)


def test_two_functions_with_one_name_and_version_are_refused() -> None:
    first, second = _versions("w", "1", "1")
    registry = Registry([first])
    with pytest.raises(DuplicateWorkflow) as refused:
        registry.add(second)
    where = f"{__name__}:_versions.<locals>.fn"
    assert str(refused.value).count(where) == 2, refused.value
    assert "workflow 'w' version '1' is defined twice" in str(refused.value)
    assert isinstance(refused.value, StepstreamError)
    assert isinstance(refused.value, ValueError)
    assert registry.resolve("w").fn is first  # the first registration stands
    with pytest.raises(DuplicateWorkflow, match=r"tests\.versioned_workflows:pricing_v1"):
        Registry([vw.pricing_v1, *_versions("pricing", "1")])


def test_the_same_function_twice_is_not_a_duplicate() -> None:
    registry = Registry([vw.pricing_v1, vw.pricing_v1, vw.pricing_v2])
    registry.add_module("tests.versioned_workflows")
    registry.add_modules("tests.versioned_workflows,tests.versioned_workflows")
    assert registry.names()["pricing"] == ["1", "2"]
    assert registry.resolve("pricing").fn is vw.pricing_v2


@pytest.mark.parametrize("version", ["", "  ", "a\nb", "x" * 300])
def test_a_version_must_be_a_name(version: str) -> None:
    with pytest.raises(ValueError, match="version"):
        workflow("w", version=version)
