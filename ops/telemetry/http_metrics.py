"""Metrics of the HTTP API's requests: how many, how they ended, how long they took.

One aiohttp middleware, outermost, so it sees every answer (a refused token, a 404, an
error turned into its JSON body). Requests are labelled by the route's template
(``/v1/instances/{id}``), never the raw path: one series per route, whatever ids
clients send. A request no route matched is ``unmatched``; an unusual method ``other``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from stepstream.consumers.telemetry import LATENCY_BUCKETS_S, Histogram

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

UNMATCHED = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# A client that went away before its answer (a result wait given up), as nginx says it.
CLIENT_CLOSED = "499"


class HttpMetrics(Collector):
    """``stepstream_http_requests_total{route, method, code}`` and
    ``stepstream_http_request_duration_seconds{route, method}``. Counted on the event
    loop by ``middleware``, read by the scrape (which runs on the same loop)."""

    def __init__(self) -> None:
        self._requests: Counter[tuple[str, str, str]] = Counter()
        self._seconds: dict[tuple[str, str], Histogram] = {}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        began = time.perf_counter()
        code = "500"
        try:
            response = await handler(request)
            code = str(response.status)
            return response
        except web.HTTPException as exc:
            code = str(exc.status)
            raise
        except asyncio.CancelledError:
            code = CLIENT_CLOSED
            raise
        finally:
            route = _route(request)
            method = request.method if request.method in _METHODS else "other"
            self._requests[(route, method, code)] += 1
            histogram = self._seconds.get((route, method))
            if histogram is None:
                histogram = self._seconds[(route, method)] = Histogram(LATENCY_BUCKETS_S)
            histogram.observe(time.perf_counter() - began)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "stepstream_http_requests",
            "HTTP API requests answered, by route template, method and status code "
            "(499: the client went away first).",
            labels=["route", "method", "code"],
        )
        for labels, n in self._requests.items():
            requests.add_metric(list(labels), n)
        yield requests
        seconds = HistogramMetricFamily(
            "stepstream_http_request_duration_seconds",
            "How long HTTP API requests took to answer, by route template and method "
            "(the long waits, result, commands and the session websocket, take as long "
            "as they wait).",
            labels=["route", "method"],
        )
        for (route, method), histogram in self._seconds.items():
            buckets = [
                ("+Inf" if bound == float("inf") else repr(float(bound)), n)
                for bound, n in histogram.cumulative()
            ]
            seconds.add_metric([route, method], buckets, histogram.sum)
        yield seconds


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED
