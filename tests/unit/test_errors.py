"""One error tree: every error a user can meet is importable from ``stepstream.errors``
and drawn both there and in docs/errors.md."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import stepstream
import stepstream.errors
from stepstream.errors import NonRetryableError, StepstreamError

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def _every_error_class() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(stepstream.__path__, "stepstream."):
        if ".ui.static" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, (StepstreamError, NonRetryableError))
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[name] = obj
    return found


def test_every_error_class_of_the_product_is_importable_from_stepstream_errors() -> None:
    every = _every_error_class()
    assert len(every) > 40, sorted(every)  # the walk found the product's modules
    missing = sorted(n for n in every if getattr(stepstream.errors, n, None) is not every[n])
    assert not missing, f"add these to stepstream/errors.py (and the trees): {missing}"
    assert sorted(stepstream.errors.__all__) == sorted(every)


def test_the_tree_is_drawn_in_the_module_and_in_the_docs() -> None:
    drawn = stepstream.errors.__doc__ or ""
    page = DOC.read_text()
    for name in stepstream.errors.__all__:
        assert f" {name} " in drawn or f"{name} (" in drawn, f"{name} not in the docstring tree"
        assert name in page, f"{name} not in docs/errors.md"
    for name, cls in vars(stepstream.errors).items():
        if name in stepstream.errors.__all__ and cls is not StepstreamError:
            parent = cls.__mro__[1].__name__
            assert parent in stepstream.errors.__all__ or parent == "Exception", (name, parent)


def test_no_class_name_is_both_an_error_and_a_record() -> None:
    from stepstream.engine.wire.records import ALL_TYPES, StepFailedRecord

    clashes = sorted({t.__name__ for t in ALL_TYPES} & set(stepstream.errors.__all__))
    assert not clashes, clashes
    # The wire keeps its names: the record class StepFailedRecord is a "StepFailed".
    record = StepFailedRecord(
        instance_id="o-1", key="k", attempt=1, error_type="E", error_message=""
    )
    assert record.type == "StepFailed"
