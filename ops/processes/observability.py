"""Metrics and readiness over every engine process: ``/metrics`` with each process's
series labelled ``process``, ``/readyz`` ready when every process is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from stepstream.ops.telemetry.metrics import CONTENT_TYPE, Observability
from stepstream.producers.http.security import client_headers

# How long a process has to answer a probe (``/readyz``, ``/metrics``): its listening
# socket is the parent's, so a process that died or hangs does not refuse the connection,
# the call would wait in the backlog.
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ProcessesObservability(Observability):
    """``/metrics`` with every process's series, labelled ``process``; ``/readyz`` ready
    when every process is."""

    peers: Sequence[str] = ()  # the other processes' API URLs, process 1 first
    token: str = ""
    restarts: Callable[[], Mapping[int, int]] = dict  # process -> times started again
    hangs: Callable[[], Mapping[int, int]] = dict  # process -> times killed for hanging

    async def metrics(self, request: web.Request) -> web.Response:
        texts = [(await self.render()).body.decode()]
        async with aiohttp.ClientSession(headers=client_headers(self.token)) as http:
            for url in self.peers:
                try:
                    async with asyncio.timeout(PROBE_TIMEOUT_S):
                        async with http.get(url + "/metrics") as response:
                            texts.append(await response.text())
                except (aiohttp.ClientError, TimeoutError):
                    texts.append("")  # a process starting again: its series come back with it
        restarts = _per_process(
            "stepstream_engine_process_restarts",
            "Times an engine process of `stepstream dev --processes` died and was started "
            "again, by process.",
            self.restarts(),
            len(self.peers),
        )
        hangs = _per_process(
            "stepstream_engine_process_hangs",
            "Times an engine process of `stepstream dev --processes` did not answer its "
            "health probe for --hang-timeout and was killed to be started again (each is "
            "also a restart), by process.",
            self.hangs(),
            len(self.peers),
        )
        body = generate_latest(_labelled(texts, restarts, hangs))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def readyz(self, request: web.Request) -> web.Response:
        if not self.health.ready():
            return web.json_response({"ready": False, "reason": self.health.reason()}, status=503)
        async with aiohttp.ClientSession(headers=client_headers(self.token)) as http:
            for index, url in enumerate(self.peers, start=1):
                reason = await not_ready(http, url)
                if reason:
                    return web.json_response(
                        {"ready": False, "reason": f"engine process {index}: {reason}"},
                        status=503,
                    )
        return web.json_response({"ready": True})


async def not_ready(http: aiohttp.ClientSession, url: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Why the process at ``url`` is not ready ("" when it is)."""
    try:
        async with asyncio.timeout(timeout):
            async with http.get(url + "/readyz") as response:
                if response.status == 200:
                    return ""
                answer = await response.json(content_type=None)
                return str(answer.get("reason", f"HTTP {response.status}"))
    except TimeoutError:
        return (
            f"not answering within {timeout:g} s (it died and is being started again, is "
            "still restoring, or hangs)"
        )
    except aiohttp.ClientError as exc:
        return f"not answering ({exc}); it is being started again"


def _per_process(name: str, doc: str, counts: Mapping[int, int], peers: int) -> Metric:
    """A counter with one sample for each of processes 1..``peers``."""
    metric = Metric(name, doc, "counter")
    for process in range(1, peers + 1):
        metric.add_sample(name + "_total", {"process": str(process)}, counts.get(process, 0))
    return metric


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _labelled(texts: Sequence[str], *more: Metric) -> CollectorRegistry:
    """One registry of every process's families, each sample labelled with its process,
    and ``more``."""
    merged: dict[str, Metric] = {m.name: m for m in more}
    for process, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            into.samples += [
                Sample(s.name, {**s.labels, "process": str(process)}, s.value, s.timestamp)
                for s in family.samples
            ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return registry
