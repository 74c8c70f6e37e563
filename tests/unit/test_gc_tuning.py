"""The server processes' garbage-collector settings, read from STEPSTREAM_GC."""

from __future__ import annotations

import gc

import pytest

from stepstream.engine.config.environ import ConfigError
from stepstream.ops.gc_tuning import (
    SERVING_THRESHOLDS,
    WORKER_THRESHOLDS,
    thresholds_from_env,
    tune_for_serving,
)


def test_serving_thresholds_by_default_and_python_defaults_on_request() -> None:
    assert thresholds_from_env({}) == SERVING_THRESHOLDS
    assert thresholds_from_env({"STEPSTREAM_GC": "default"}) is None
    assert thresholds_from_env({"STEPSTREAM_GC": " 5000,5,5 "}) == (5000, 5, 5)


def test_a_worker_takes_its_own_default_and_the_variable_still_wins() -> None:
    assert WORKER_THRESHOLDS[0] > SERVING_THRESHOLDS[0]
    assert thresholds_from_env({}, WORKER_THRESHOLDS) == WORKER_THRESHOLDS
    assert thresholds_from_env({"STEPSTREAM_GC": "5000,5,5"}, WORKER_THRESHOLDS) == (5000, 5, 5)
    assert thresholds_from_env({"STEPSTREAM_GC": "default"}, WORKER_THRESHOLDS) is None


@pytest.mark.parametrize("raw", ["fast", "1,2", "0,10,10", "1,2,x"])
def test_a_bad_setting_names_the_variable_and_what_to_set(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"STEPSTREAM_GC=.*three positive whole numbers"):
        thresholds_from_env({"STEPSTREAM_GC": raw})


def test_tuning_sets_the_thresholds_and_freezes_the_start_up_heap() -> None:
    before = gc.get_threshold()
    try:
        tune_for_serving({"STEPSTREAM_GC": "12345,7,9"})
        assert gc.get_threshold() == (12345, 7, 9)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_default_leaves_the_process_alone() -> None:
    before = gc.get_threshold()
    tune_for_serving({"STEPSTREAM_GC": "default"})
    assert gc.get_threshold() == before
