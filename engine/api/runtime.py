"""``WorkflowRuntime``: what ``Context`` (and the messages and sagas behind it) needs from
the runtime that drives a workflow. A protocol, so that the API imports nothing of the
runtime; ``engine.replay`` implements it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.records import Payload


class WorkflowRuntime(Protocol):
    """What ``Context`` needs from the runtime that drives the workflow."""

    @property
    def instance_id(self) -> str: ...

    @property
    def workflow(self) -> str: ...

    @property
    def version(self) -> str: ...

    def key_for(self, name: str) -> str: ...

    def step_future(
        self,
        key: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        timeout: float | None,
        ephemeral: bool = False,
    ) -> asyncio.Future[Any]: ...

    def queued_attempt_future(
        self,
        key: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        timeout: float | None,
        ephemeral: bool,
        after: int,
    ) -> asyncio.Future[Any]: ...

    def sleep_future(
        self, key: str, *, delay_ms: int | None = None, wake_at_ms: int | None = None
    ) -> asyncio.Future[Any]: ...

    def wait_future(
        self, key: str, event_name: str, timeout_ms: int | None
    ) -> asyncio.Future[Any]: ...

    def record_value(self, kind: str, produce: Callable[[], Any]) -> Any: ...

    def race_decided(self, key: str) -> tuple[str, list[str]] | None: ...

    def recorded_at(self, key: str) -> int: ...

    def decode_recorded(self, payload: Payload, what: str) -> Any: ...

    def loop_resume(self, key: str, initial: Any) -> tuple[int, Any]: ...

    def start_child(self, key: str, workflow: str, input: Any, instance_id: str | None) -> str: ...

    def child_result(self, key: str) -> asyncio.Future[Any]: ...

    def message_future(
        self, key: str, names: list[str], max_messages: int, timeout_ms: int | None
    ) -> asyncio.Future[Any]: ...

    def send_message(self, key: str, target: str, name: str, payload: Any) -> None: ...

    def given_back(self, slot_key: str) -> int: ...

    def complete_message(self, message_id: str, value: Any) -> None: ...

    def patched(self, patch_id: str) -> bool: ...

    def removed(self, key: str) -> None: ...

    @property
    def codec(self) -> PayloadCodec: ...

    def loop_advanced(self, key: str, iteration: int, state: Any, keep: int) -> Any: ...

    def decide_race(self, key: str, winner: str, losers: list[str]) -> None: ...

    def race_lost(self, task_path: str) -> None: ...

    def now_ms(self) -> int: ...

    @property
    def queue_request(self) -> tuple[int, str | None]: ...

    @property
    def run(self) -> int: ...

    def set_attributes(self, attributes: dict[str, Any]) -> None: ...
