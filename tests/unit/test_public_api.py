"""The public surface: one import path, pinned, and the connect strings it accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

import stepstream
from stepstream import Client, StepstreamError, Worker
from tests.workflows import arith


def test_public_names_are_pinned() -> None:
    assert sorted(stepstream.__all__) == sorted(
        [
            "Client",
            "ConnectionFailed",
            "Context",
            "EventTimeout",
            "HistoryDiverged",
            "HistoryEntry",
            "InstanceFinished",
            "InstanceNotPaused",
            "InstanceStatus",
            "InvalidPayload",
            "JsonCodec",
            "NonRetryableError",
            "PayloadCodec",
            "PayloadTooLarge",
            "ResultTimeout",
            "RetryPolicy",
            "StepFailed",
            "StepTimeout",
            "StepstreamError",
            "UnknownInstance",
            "UnknownWorkflow",
            "WorkflowCancelled",
            "WorkflowFailed",
            "Worker",
            "workflow",
        ]
    )
    assert not [name for name in stepstream.__all__ if name.startswith("_")]


def test_every_user_error_is_a_stepstream_error() -> None:
    for name in stepstream.__all__:
        obj = getattr(stepstream, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and name != "NonRetryableError":
            assert issubclass(obj, StepstreamError), name


async def test_connect_embedded_runs_in_process(tmp_path: Path) -> None:
    async with Client.connect(f"embedded:{tmp_path / 'data'}", workflows=[arith]) as client:
        instance = await client.start("arith", 1, instance_id="a-1")
        assert await client.result(instance, timeout=10) == {"total": 2, "doubled": 4}
    # The data is durable: a new client on the same directory reads the finished instance.
    async with Client.connect(f"embedded:{tmp_path / 'data'}", workflows=[arith]) as client:
        assert (await client.status("a-1")).status == "completed"


async def test_worker_with_in_process_client(tmp_path: Path) -> None:
    async with Worker([arith], connect=f"embedded:{tmp_path / 'w'}") as worker:
        client = worker.client()
        instance = await client.start("arith", 5)
        assert await client.result(instance, timeout=10) == {"total": 6, "doubled": 12}


async def test_unknown_connect_scheme_says_what_is_supported() -> None:
    with pytest.raises(StepstreamError, match="embedded:PATH, http://HOST:PORT"):
        Client.connect("ftp://x")


def test_workflow_must_be_async() -> None:
    with pytest.raises(TypeError, match="must be an 'async def'"):

        @stepstream.workflow("sync")
        def not_async(ctx: stepstream.Context, x: int) -> int:  # type: ignore[type-var]
            return x
