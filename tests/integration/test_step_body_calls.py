"""``ctx`` calls made from inside a step body are refused with ``InvalidWorkflowCall``
(docs/workflows.md): what they would record lands between the step's own records, where
no replay of the workflow code reaches it."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream import Context, RetryPolicy, workflow
from stepstream.testing import WorkflowEnvironment

ONCE = RetryPolicy(max_attempts=1)


def _calls(ctx: Context) -> dict[str, Any]:
    return {
        "now": ctx.now,
        "uuid": ctx.uuid,
        "random": ctx.random,
    }


# ctx.messages.send is a coroutine: only an async body can call it.
CASES = [(c, k) for c in ("now", "uuid", "random") for k in ("sync", "async")] + [("send", "async")]


@pytest.mark.parametrize(("call", "body_kind"), CASES)
async def test_a_recorded_ctx_call_in_a_step_body_is_refused(call: str, body_kind: str) -> None:
    def sync_body(ctx: Context) -> Any:
        return str(_calls(ctx)[call]())

    async def async_body(ctx: Context) -> Any:
        if call == "send":
            await ctx.messages.send("elsewhere", "note", 1)
            return "sent"
        return str(_calls(ctx)[call]())

    body = sync_body if body_kind == "sync" else async_body

    @workflow("body-calls")
    async def body_calls(ctx: Context, _: Any) -> Any:
        outcome = await ctx.try_step("work", body, ctx, retry=ONCE)
        assert outcome.failure is not None, outcome
        return [outcome.failure.error_type, outcome.failure.message]

    async with WorkflowEnvironment([body_calls], clock="virtual") as env:
        await env.client.start("body-calls", None, instance_id="b-1")
        error_type, message = await env.client.result("b-1", timeout=30)
        history = await env.client.history("b-1")
    assert error_type == "InvalidWorkflowCall"
    what = "ctx.messages" if call == "send" else f"ctx.{call}"
    assert f"{what} was called inside a step body" in message
    assert [e.type for e in history] == [
        "WorkflowStarted",
        "StepAttemptStarted",
        "StepFailed",
        "WorkflowCompleted",
    ]


async def test_a_step_body_that_calls_ctx_is_not_retried() -> None:
    """Every attempt would make the same call: the step fails at the first, even under
    a policy that retries for ever."""

    def body(ctx: Context) -> Any:
        return str(ctx.now())

    forever = RetryPolicy(max_attempts=None, initial_interval=0.01)

    @workflow("body-call-retries")
    async def body_call_retries(ctx: Context, _: Any) -> Any:
        outcome = await ctx.try_step("work", body, ctx, retry=forever)
        assert outcome.failure is not None, outcome
        return [outcome.failure.error_type, outcome.failure.kind, outcome.failure.attempts]

    async with WorkflowEnvironment([body_call_retries], clock="virtual") as env:
        await env.client.start("body-call-retries", None, instance_id="r-1")
        assert await env.client.result("r-1", timeout=30) == [
            "InvalidWorkflowCall",
            "non_retryable",
            1,
        ]
