"""The collector's pauses are recorded per generation, as /metrics serves them."""

from __future__ import annotations

import gc

from stepstream.ops.telemetry.gc_pauses import GC_BUCKETS_S, recording


def test_a_full_collection_is_counted_timed_and_kept_as_the_longest() -> None:
    pauses = recording()
    assert recording() is pauses  # one hook per process
    before = pauses.seconds[2].count
    gc.collect()
    assert pauses.seconds[2].count == before + 1
    assert pauses.longest[2] > 0 and pauses.seconds[2].sum >= pauses.longest[2]
    figures = pauses.figures()
    assert figures["gen2"]["collections"] == before + 1
    assert figures["gen2"]["longest_ms"] == round(pauses.longest[2] * 1000, 1)
    assert len(pauses.seconds[2].cumulative()) == len(GC_BUCKETS_S) + 1
