"""Routing a ``kafka://`` client's reads to the worker that owns the instance's partition.

The owner comes from the members view. A call is made of the current owner; when the
owner moves (rebalance, crash) while it is in flight, it is abandoned and made again of
the new owner; an owner that cannot be reached is asked again once the view has moved on.
Nothing polls in a loop: between attempts the router waits for the view to change.

A read of a partition that nobody owns does not wait for a worker: with no worker running
it fails at once saying which partition and since when; while other workers run (the
partition is changing hands) it waits for the hand-over at most ``HANDOVER_GRACE_S``. An
owner where nothing listens (killed, its announcement left behind; or restarting, soon
to announce its new address) fails the read at once, naming it, if nothing listens at
any other announced worker's address either (all killed; those that own no partition,
standing by or restoring, count too); while another may be running, that one takes the
partition over and the read is asked again of it, until the request timeout. Waits for
an outcome (``result``) do wait for an owner, until their timeout. A list asks every
worker: it fails at once the same way when none listens, and otherwise once the
hand-over has not come within the request timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp

from stepstream.engine.errors import ConnectionFailed, StepstreamError
from stepstream.engine.reads.listing import (
    InstancePage,
    ListQuery,
    Overview,
    merge_overviews,
    merge_pages,
)
from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.wire.topics import TopicNames
from stepstream.producers.http.session import NotListening
from stepstream.producers.kafka.members import Member, MembersView
from stepstream.producers.kafka.session import WorkerSession

T = TypeVar("T")
RETRY_S = 1.0  # longest wait for the members view to move on before asking again
# How long a worker has to accept a probe (is anything listening at its address?); one
# that takes longer is taken to be alive, only slow.
PROBE_S = 2.0
# The workers found not listening during one call, by id and address (a worker that
# restarts under its id announces another address): what each refused with.
Gone = dict[tuple[str, str], ConnectionFailed]
# A rebalance leaves a partition without an announced owner for a moment: join time
# (about half of session.timeout.ms) plus restore; a read waits that long at most.
HANDOVER_GRACE_S = 5.0


class Router:
    """Calls on the owners of partitions; ``close()`` ends every worker's session."""

    def __init__(
        self,
        members: MembersView,
        session: aiohttp.ClientSession,
        topics: TopicNames,
        partitions: int,
        request_timeout: float,
    ) -> None:
        self._members = members
        self._session = session
        self._topics = topics
        self._partitions = partitions
        self._request_timeout = request_timeout
        self._apis: dict[str, WorkerSession] = {}
        self._watched: dict[asyncio.Future[Any], tuple[int, str, str]] = {}
        members.on_change(self._owners_changed)

    def api(self, url: str) -> WorkerSession:
        api = self._apis.get(url)
        if api is None:
            api = self._apis[url] = WorkerSession(
                url, self._session, request_timeout=self._request_timeout
            )
        return api

    async def routed(
        self,
        partition: int,
        call: Callable[[WorkerSession, float | None], Awaitable[T]],
        timeout: float | None,
        what: str,
        expired: Callable[[], StepstreamError] | None = None,
        *,
        wait_for_owner: bool = False,
    ) -> T:
        """``call`` the owner of ``partition``; ask again, of the new owner, when the owner
        moves or cannot be reached, until ``timeout`` seconds have passed (then raise
        ``expired()``, or ``ConnectionFailed``). Without ``wait_for_owner``, a partition
        with no owner raises ``ConnectionFailed`` at once (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        handover_deadline = loop.time() + HANDOVER_GRACE_S
        synced = False
        problem = "no worker owns it"
        unreachable: tuple[Member, ConnectionFailed] | None = None
        gone: Gone = {}
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                if expired is not None:
                    raise expired()
                if unreachable is not None and self._all_gone(gone):
                    raise self.unreachable(what, partition, *unreachable, gone) from None
                raise ConnectionFailed(
                    f"{what}: the owner of partition {partition} did not answer within "
                    f"{timeout} s ({problem}); is a worker of prefix {self._topics.prefix!r} "
                    "running?"
                )
            owner = self._members.owner(partition)
            if owner is None:
                if not wait_for_owner and not synced:
                    # The view may lag a worker that just started: catch up once.
                    synced = True
                    await self._members.synced(self._request_timeout)
                    continue
                if not wait_for_owner and (
                    not self._members.live() or loop.time() >= handover_deadline
                ):
                    raise self.unowned(what, [partition])
                await self._members.changed(
                    RETRY_S if remaining is None else min(remaining, RETRY_S)
                )
                continue
            request = asyncio.ensure_future(call(self.api(owner.url), remaining))
            # Cancelled by _owners_changed if the partition gets another owner meanwhile.
            self._watched[request] = (partition, owner.worker_id, owner.url)
            try:
                await asyncio.wait((request,), timeout=remaining)
            finally:
                self._watched.pop(request, None)
                if not request.done():
                    request.cancel()
                    with contextlib.suppress(BaseException):
                        await request
            if request.cancelled():
                continue  # the owner moved (or the deadline passed): the loop decides
            try:
                return request.result()
            except ConnectionFailed as exc:
                # Gone, or no longer the owner: let the view catch up, then ask again (a
                # survivor takes the partition over; a worker restarting under the same id
                # announces its new address soon).
                problem = str(exc)
                unreachable = (owner, exc) if isinstance(exc, NotListening) else None
                if unreachable is not None:
                    gone[owner.worker_id, owner.url] = exc
                    if not wait_for_owner and await self._none_listens(gone, remaining):
                        # Its announcement outlived it (killed) and no other worker runs
                        # to take the partition over: say so now, not at the deadline.
                        raise self.unreachable(what, partition, *unreachable, gone) from None
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                wait = RETRY_S if remaining is None else min(remaining, RETRY_S)
                await self._members.changed(wait)

    async def list(self, status: str | None) -> list[InstanceStatus]:
        """Every owner's instances (each worker lists the partitions it owns)."""

        async def ask(api: WorkerSession) -> list[InstanceStatus]:
            return await api.list(status)

        answers = await self.every_worker(ask, "list instances")
        merged = {view.instance_id: view for answer in answers for view in answer}
        return sorted(merged.values(), key=lambda v: (v.created_at, v.instance_id))

    async def list_page(self, query: ListQuery) -> InstancePage:
        """One page merged from every worker's page of the partitions it owns."""

        async def ask(api: WorkerSession) -> InstancePage:
            return await api.list_page(query)

        pages = await self.every_worker(ask, "list instances")
        return merge_pages(pages, query.limit, query)

    async def overview(self) -> Overview:
        async def ask(api: WorkerSession) -> Overview:
            return await api.overview()

        return merge_overviews(await self.every_worker(ask, "read the overview"))

    async def every_worker(
        self, call: Callable[[WorkerSession], Awaitable[T]], what: str
    ) -> Sequence[T]:
        """``call`` every live worker once every partition has one; again while some
        cannot be reached, until the request timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._request_timeout
        handover_deadline = loop.time() + min(HANDOVER_GRACE_S, self._request_timeout)
        synced = False
        problem = ""
        while loop.time() < deadline:
            orphans = [p for p in range(self._partitions) if self._members.owner(p) is None]
            members = self._members.live()
            if orphans and not synced:
                synced = True  # the view may lag a worker that just started
                await self._members.synced(self._request_timeout)
                continue
            if orphans and (not members or loop.time() >= handover_deadline):
                raise self.unowned(f"cannot {what}", orphans)
            if orphans:
                problem = f"partitions {orphans} have no worker"
            else:
                answers = await asyncio.gather(
                    *(call(self.api(m.url)) for m in members), return_exceptions=True
                )
                failed = [a for a in answers if isinstance(a, BaseException)]
                if not failed:
                    return [a for a in answers if not isinstance(a, BaseException)]
                if not all(isinstance(a, ConnectionFailed) for a in failed):
                    raise failed[0]
                gone: Gone = {
                    (m.worker_id, m.url): a
                    for m, a in zip(members, answers, strict=True)
                    if isinstance(a, NotListening)
                }
                if len(gone) == len(members) and await self._none_listens(
                    gone, deadline - loop.time()
                ):
                    raise self.none_answer(what, gone)  # no one to hand the partitions to
                problem = str(failed[0])
                if gone:
                    problem = self._gone_list(gone)
            await self._members.changed(min(RETRY_S, max(deadline - loop.time(), 0)))
        raise ConnectionFailed(
            f"cannot {what}: {problem}; is every worker of prefix {self._topics.prefix!r} "
            "running? A killed worker's partitions go to the others once the group misses "
            "its heartbeats (the session timeout): start `stepstream worker`, then ask again"
        )

    def _all_gone(self, gone: Gone) -> bool:
        return all((m.worker_id, m.url) in gone for m in self._members.announced())

    async def _none_listens(self, gone: Gone, remaining: float | None) -> bool:
        """Whether nothing listens at any announced worker's address: not at those in
        ``gone``, and the others are probed now. Only a refused connection counts: a
        worker that is slow to accept (or frozen) may still take the partition over, so
        the first probe that does not end in a refusal answers False."""
        others = [m for m in self._members.announced() if (m.worker_id, m.url) not in gone]
        limit = PROBE_S if remaining is None else max(0.0, min(remaining, PROBE_S))
        probes = {
            asyncio.ensure_future(asyncio.wait_for(self.api(m.url).probe(), limit)): m
            for m in others
        }
        try:
            pending = set(probes)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for probe in done:
                    failure = None if probe.cancelled() else probe.exception()
                    if not isinstance(failure, NotListening):
                        return False  # it answered, or may yet
                    member = probes[probe]
                    gone[member.worker_id, member.url] = failure
        finally:
            for probe in probes:
                probe.cancel()
        return self._all_gone(gone)

    def _gone_list(self, gone: Gone) -> str:
        owned = {m.worker_id: list(m.partitions) for m in self._members.announced()}
        return "; ".join(
            f"worker {worker} at {url} (partitions {owned.get(worker, [])}) did not answer ({exc})"
            for (worker, url), exc in sorted(gone.items(), key=lambda item: item[0])
        )

    def none_answer(self, what: str, gone: Gone) -> ConnectionFailed:
        """The error for a call on every worker when nothing listens at any of them."""
        return ConnectionFailed(
            f"cannot {what}: no announced worker of prefix {self._topics.prefix!r} answers "
            f"(were they killed?): {self._gone_list(gone)}. Commands sent meanwhile are "
            f"kept on {self._topics.commands} and run when a worker owns the partition: "
            "start `stepstream worker`, then ask again"
        )

    def unowned(self, what: str, partitions: Sequence[int]) -> ConnectionFailed:
        """The error for a read of ``partitions`` that no live worker owns."""
        # Partitions in the same plight are one clause: with no worker left, every
        # partition of a 24-partition prefix has the same last owner and time.
        plights: dict[str, list[int]] = {}
        for partition in partitions:
            vacancy = self._members.vacancy(partition)
            if vacancy is None:
                plight = "no worker has announced owning it"
            else:
                since = datetime.fromtimestamp(vacancy.since_ms / 1000, UTC)
                plight = (
                    f"no live owner since {since.isoformat(timespec='seconds')} (last "
                    f"owner: worker {vacancy.worker_id})"
                )
            plights.setdefault(plight, []).append(partition)
        details = [f"{_partitions_named(found)}: {plight}" for plight, found in plights.items()]
        state = (
            "no worker of prefix {p!r} is running"
            if not self._members.live()
            else "the partition has not been handed over to a running worker of prefix {p!r}"
        ).format(p=self._topics.prefix)
        return ConnectionFailed(
            f"{what}: {'; '.join(details)}; {state}. Commands sent meanwhile are kept on "
            f"{self._topics.commands} and run when a worker owns the partition: start "
            "`stepstream worker`, then ask again"
        )

    def unreachable(
        self,
        what: str,
        partition: int,
        owner: Member,
        exc: ConnectionFailed,
        gone: Gone,
    ) -> ConnectionFailed:
        """The error for a read whose owner did not answer, with no other worker that
        does (``gone``: the workers found not listening)."""
        announced = datetime.fromtimestamp(owner.time_ms / 1000, UTC)
        others = [f"worker {w}" for w, _ in sorted(gone) if w != owner.worker_id]
        running = (
            f"nothing listens at the other announced workers either ({', '.join(others)}): "
            "were they killed?"
            if others
            else f"no other worker of prefix {self._topics.prefix!r} is running: was it killed?"
        )
        return ConnectionFailed(
            f"{what}: partition {partition}: its owner, worker {owner.worker_id} at {owner.url} "
            f"(announced {announced.isoformat(timespec='seconds')}), did not answer ({exc}), "
            f"and {running} Commands sent meanwhile are kept on {self._topics.commands} and "
            "run when a worker owns the partition: start `stepstream worker`, then ask again"
        )

    async def close(self) -> None:
        for api in self._apis.values():
            await api.close()
        await self._session.close()

    def _owners_changed(self) -> None:
        for request, (partition, worker_id, url) in list(self._watched.items()):
            owner = self._members.owner(partition)
            if owner is None or (owner.worker_id, owner.url) != (worker_id, url):
                request.cancel()


def _partitions_named(partitions: Sequence[int]) -> str:
    """``partition 3``, or ``partitions 0-2, 5`` (runs of consecutive ones as ranges)."""
    ordered = sorted(set(partitions))
    if len(ordered) == 1:
        return f"partition {ordered[0]}"
    runs: list[list[int]] = []
    for partition in ordered:
        if runs and partition == runs[-1][-1] + 1:
            runs[-1].append(partition)
        else:
            runs.append([partition])
    named = (f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)
    return f"partitions {', '.join(named)}"
