"""A payload codec of the user's that returns the wrong thing from ``encode`` (bytes, or a
``Payload`` of str data): a clear ``InvalidPayload`` where it is used, and no step or
instance left hanging."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stepstream import Context, InvalidPayload, JsonCodec, Payload, RetryPolicy, workflow
from stepstream.testing import WorkflowEnvironment


class BytesForSecrets:
    """Returns bytes, not a Payload, for any value that mentions "secret"."""

    def __init__(self) -> None:
        self._json = JsonCodec()

    def encode(self, value: Any) -> Payload:
        if "secret" in json.dumps(value):
            return json.dumps(value).encode()  # type: ignore[return-value]  # the bug
        return self._json.encode(value)

    def decode(self, payload: Payload) -> Any:
        return self._json.decode(payload)


def reveal() -> str:
    return "the secret"


@workflow("reveal")
async def reveal_flow(ctx: Context, _: Any) -> Any:
    outcome = await ctx.try_step("reveal", reveal, retry=RetryPolicy(max_attempts=1))
    assert outcome.failure is not None, outcome
    return [outcome.failure.error_type, outcome.failure.message]


async def test_a_step_result_the_codec_returns_as_bytes_fails_the_step() -> None:
    async with WorkflowEnvironment([reveal_flow], clock="virtual", codec=BytesForSecrets()) as env:
        await env.client.start("reveal", None, instance_id="r-1")
        error_type, message = await env.client.result("r-1", timeout=30)
    assert error_type == "InvalidPayload"
    assert "the payload codec BytesForSecrets returned a bytes from encode" in message
    assert "it must return stepstream.Payload(content_type=str, data=bytes)" in message


async def test_an_input_the_codec_returns_as_bytes_is_refused_at_the_client() -> None:
    async with WorkflowEnvironment([reveal_flow], clock="virtual", codec=BytesForSecrets()) as env:
        with pytest.raises(InvalidPayload, match="returned a bytes from encode"):
            await env.client.start("reveal", {"a": "secret"}, instance_id="r-2")
        assert await env.client.list() == []
