"""The engine's own metric families as Prometheus text (format 0.0.4), written straight
from its counters and histograms.

A scrape is served on the engine's event loop, where every millisecond it takes delays
timers and commits. prometheus_client renders a family by building a ``Sample`` per line
(a dict of labels each) and then validating, escaping and sorting every label of every
line again on each scrape. Here each series' line starts (name, labels, and for a
histogram every bucket's ``le``) are rendered once and kept (``SeriesText``), so a scrape
only formats numbers. The text is the same, byte for byte, as prometheus_client's for the
same families (``tests/unit/test_exposition.py``), and ``Family.metric`` gives the
prometheus_client family for callers of ``Collector.collect``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString as _untyped_float_text

from stepstream.consumers.telemetry import Histogram

Kind = Literal["counter", "gauge", "histogram"]
# A number as prometheus_client writes it (Go's notation: 1e+06, +Inf, NaN).
_float_text: Callable[[float], str] = _untyped_float_text
# Series whose line starts are kept; past it the cache starts again (label sets are
# bounded, but partitions and workflows can come and go over a long life).
SERIES_KEPT = 20_000


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: ``name`` as prometheus_client takes it (a counter's without
    ``_total``), its label names, and its series by label values."""

    kind: Kind
    name: str
    doc: str
    labels: Sequence[str]
    values: Mapping[Any, float] | Mapping[Any, Histogram]

    def metric(self) -> Metric:
        """The same family as a prometheus_client ``Metric``."""
        labels = list(self.labels)
        if self.kind == "histogram":
            histograms = HistogramMetricFamily(self.name, self.doc, labels=labels)
            for key, histogram in list(self.values.items()):
                assert isinstance(histogram, Histogram)
                buckets = [(_bound(bound), n) for bound, n in histogram.cumulative()]
                histograms.add_metric(list(key), buckets, histogram.sum)
            return histograms
        family: CounterMetricFamily | GaugeMetricFamily
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.doc, labels=labels)
        else:
            family = GaugeMetricFamily(self.name, self.doc, labels=labels)
        for key, value in self.values.items():
            assert not isinstance(value, Histogram)
            family.add_metric(list(key), value)
        return family


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    # Sorted by label name, as prometheus_client writes them.
    inner = ",".join(f'{name}="{_escape_value(value)}"' for name, value in sorted(pairs))
    return "{" + inner + "}" if inner else ""


class SeriesText:
    """Kept line starts of the series rendered so far, and the rendering."""

    def __init__(self) -> None:
        self._headers: dict[tuple[str, str, str], str] = {}
        self._series: dict[tuple[str, tuple[str, ...]], str] = {}
        self._histograms: dict[tuple[str, tuple[str, ...], int], tuple[str, ...]] = {}

    def render(self, families: Iterable[Family]) -> str:
        out: list[str] = []
        append = out.append
        if len(self._series) + len(self._histograms) > SERIES_KEPT:
            self._series.clear()
            self._histograms.clear()
        for family in families:
            append(self._header(family))
            if family.kind == "histogram":
                self._histogram_lines(family, out)
                continue
            series = self._series
            name, labels = family.name, family.labels
            suffix = "_total" if family.kind == "counter" else ""
            values = cast("Mapping[Any, float]", family.values)
            for key, value in values.items():
                start = series.get((name, key))
                if start is None:
                    start = series[(name, key)] = (
                        f"{name}{suffix}{_labels(zip(labels, key, strict=True))} "
                    )
                append(start + _float_text(value) + "\n")
        return "".join(out)

    def _header(self, family: Family) -> str:
        key = (family.name, family.kind, family.doc)
        header = self._headers.get(key)
        if header is None:
            name = family.name + ("_total" if family.kind == "counter" else "")
            doc = family.doc.replace("\\", r"\\").replace("\n", r"\n")
            header = self._headers[key] = f"# HELP {name} {doc}\n# TYPE {name} {family.kind}\n"
        return header

    def _histogram_lines(self, family: Family, out: list[str]) -> None:
        kept = self._histograms
        name, labels = family.name, family.labels
        for key, histogram in list(family.values.items()):
            assert isinstance(histogram, Histogram)
            counts = histogram.counts
            starts = kept.get((name, key, len(counts)))
            if starts is None:
                starts = kept[(name, key, len(counts))] = _histogram_starts(
                    name, labels, key, histogram.bounds
                )
            total = 0
            for start, total in zip(starts, accumulate(counts), strict=False):
                out.append(start + _count(total))
            # The bucket lines, then _count and _sum, as HistogramMetricFamily adds them.
            out.append(starts[-2] + _count(total))
            out.append(f"{starts[-1]}{_float_text(histogram.sum)}\n")


def _count(n: int) -> str:
    # floatToGoString's text for a whole number, without its float() and repr() below a
    # million (from there Go's notation has an exponent).
    return f"{n}.0\n" if n < 1_000_000 else _float_text(n) + "\n"


def _histogram_starts(
    name: str, labels: Sequence[str], key: tuple[str, ...], bounds: tuple[float, ...]
) -> tuple[str, ...]:
    pairs = list(zip(labels, key, strict=True))
    buckets = [
        f"{name}_bucket{_labels([*pairs, ('le', _bound(bound))])} "
        for bound in (*bounds, float("inf"))
    ]
    plain = _labels(pairs)
    return (*buckets, f"{name}_count{plain} ", f"{name}_sum{plain} ")
