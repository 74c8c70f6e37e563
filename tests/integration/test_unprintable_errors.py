"""User exceptions whose ``__str__`` itself fails (a code kept as an int, a bug in the
method): the engine records the failure with what can be shown of it, once, instead of
losing the outcome that carried it."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream import Context, RetryPolicy, WorkflowFailed, workflow
from stepstream.testing import WorkflowEnvironment


class CodedError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return self.code  # type: ignore[return-value]  # the bug under test: not a str


async def test_a_workflow_raising_an_unprintable_error_fails_once_and_keeps_its_steps() -> None:
    charged: list[int] = []

    def charge() -> str:
        charged.append(1)
        return "charged"

    @workflow("coded-order")
    async def coded_order(ctx: Context, _: Any) -> Any:
        await ctx.step("charge", charge)
        raise CodedError(402)

    async with WorkflowEnvironment([coded_order], clock="virtual") as env:
        await env.client.start("coded-order", None, instance_id="o-1")
        with pytest.raises(WorkflowFailed) as failed:
            await env.client.result("o-1", timeout=30)
        history = await env.client.history("o-1")
    assert "CodedError: CodedError(402)" in str(failed.value)
    assert charged == [1]  # the step's success was kept, not retried as lost
    assert [e.type for e in history] == [
        "WorkflowStarted",
        "StepAttemptStarted",
        "StepSucceeded",
        "WorkflowFailed",
    ]


async def test_a_step_raising_an_unprintable_error_fails_and_is_retried() -> None:
    def call_api() -> None:
        raise CodedError(503)

    @workflow("coded-call")
    async def coded_call(ctx: Context, _: Any) -> Any:
        policy = RetryPolicy(max_attempts=2, initial_interval=1.0)
        outcome = await ctx.try_step("call", call_api, retry=policy)
        assert outcome.failure is not None
        return [outcome.failure.kind, outcome.failure.attempts, outcome.failure.message]

    async with WorkflowEnvironment([coded_call], clock="virtual") as env:
        await env.client.start("coded-call", None, instance_id="c-1")
        await env.advance(5)  # the retry's backoff
        result = await env.client.result("c-1", timeout=30)
    assert result == ["exhausted", 2, "CodedError(503)"]
