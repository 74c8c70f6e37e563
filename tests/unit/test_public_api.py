"""The public surface: one import path, pinned, and the connect strings it accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import stepstream
from stepstream import (
    Client,
    InvalidPayload,
    JsonCodec,
    Payload,
    StepstreamError,
    Worker,
)
from stepstream.engine.api.workflow import Registry
from stepstream.engine.seams import Append
from stepstream.engine.wire.records import SendEvent
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import COMMANDS, DEAD_LETTERS, HISTORY
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from tests.workflows import arith


def test_public_names_are_pinned() -> None:
    assert sorted(stepstream.__all__) == sorted(
        [
            "AccessDenied",
            "Break",
            "ChildFailed",
            "ChildHandle",
            "Client",
            "Continue",
            "ConnectionFailed",
            "Context",
            "EventTimeout",
            "HistoryDiverged",
            "HistoryEntry",
            "InstanceExists",
            "InstanceFinished",
            "InstanceNotPaused",
            "InstanceStatus",
            "InvalidPayload",
            "InvalidWorkflowCall",
            "JoinError",
            "JsonCodec",
            "NonRetryableError",
            "Payload",
            "PayloadCodec",
            "PayloadTooLarge",
            "Queue",
            "Published",
            "RaceError",
            "ResultTimeout",
            "RetryPolicy",
            "RolledBack",
            "ScheduleInfo",
            "Source",
            "StatusChangeEvent",
            "StepErrorEvent",
            "StepFailure",
            "StepResult",
            "StepFailed",
            "StepTimeout",
            "StepstreamError",
            "UnknownInstance",
            "UnknownWorkflow",
            "WorkflowCancelled",
            "WorkflowFailed",
            "WorkflowTerminated",
            "WorkflowTimeout",
            "Worker",
            "attempt_cancelled",
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


@pytest.mark.parametrize("modules", ["tests.workflows", ["tests.workflows"]])
async def test_connect_embedded_loads_modules_named_as_text_or_a_list(
    tmp_path: Path, modules: str | list[str]
) -> None:
    async with Client.connect(f"embedded:{tmp_path / 'data'}", modules=modules) as client:
        instance = await client.start("arith", 1)
        assert (await client.result(instance, timeout=10))["total"] == 2
    with pytest.raises(TypeError, match="modules are named by strings"):
        async with Client.connect(f"embedded:{tmp_path / 'other'}", modules=[object()]):
            pass


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


class SealedCodec:
    """A codec hook as a user would write one: JSON, then sealed (a toy XOR here), under
    its own content type so readers know what they hold."""

    content_type = "application/x-sealed+json"

    def __init__(self) -> None:
        self._json = JsonCodec()

    @staticmethod
    def _xor(data: bytes) -> bytes:
        return bytes(b ^ 0x5A for b in data)

    def encode(self, value: Any) -> Payload:
        return Payload(self.content_type, self._xor(self._json.encode(value).data))

    def decode(self, payload: Payload) -> Any:
        if payload.content_type != self.content_type:
            raise InvalidPayload(f"not sealed: {payload.content_type}")
        return self._json.decode(Payload("application/json", self._xor(payload.data)))


async def test_a_codec_hook_seals_every_user_payload(tmp_path: Path) -> None:
    registry = Registry()
    registry.add_module("tests.workflows")
    engine = await open_embedded(
        registry, EmbeddedConfig(data_dir=str(tmp_path / "data")), codec=SealedCodec()
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        done = await client.start("arith", 20, instance_id="sealed-1")
        assert await client.result(done, timeout=10) == {"total": 21, "doubled": 42}
        waiting = await client.start("waiter", None, instance_id="sealed-2")
        await client.send_event(waiting, "approval", {"secret": "swordfish"})
        assert await client.result(waiting, timeout=10) == {"secret": "swordfish"}
        # The history reads back decoded, through the same hook.
        history = await client.history(waiting)
        assert [h.attributes.get("payload") for h in history if h.type == "WaitSatisfied"] == [
            {"secret": "swordfish"}
        ]
        log = engine.db.log
        raw = [
            entry.value
            for partition in range(log.partitions)
            for entry in log.read(HISTORY, partition, 0, 10_000)
        ]
    sealed = b"application/x-sealed+json"
    assert sum(sealed in value for value in raw) == 7  # inputs, step results, event, results
    assert not any(b"swordfish" in value or b'"total"' in value for value in raw)


class FussyCodec(SealedCodec):
    """A codec whose decode raises what a library raises (not InvalidPayload) for data
    it does not like, as an encryption library does for a bad token."""

    def decode(self, payload: Payload) -> Any:
        if payload.content_type != self.content_type:
            raise ValueError("bad token")
        return super().decode(payload)


async def test_a_codec_that_raises_anything_is_treated_as_invalid_payload(tmp_path: Path) -> None:
    registry = Registry()
    registry.add_module("tests.workflows")
    engine = await open_embedded(
        registry, EmbeddedConfig(data_dir=str(tmp_path / "data")), codec=FussyCodec()
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        waiting = await client.start("waiter", None, instance_id="fussy")
        # An event in plain JSON reaches the processor past the client (a foreign
        # producer): dead-lettered with the codec's complaint; the instance still waits.
        plain = SendEvent(
            instance_id="fussy",
            command_id="plain",
            name="approval",
            payload=JsonCodec().encode({"x": 1}),
        )
        await engine.db.log.append([Append(COMMANDS, b"fussy", default_serde().encode(plain))])
        await client.send_event(waiting, "approval", "sealed")
        assert await client.result(waiting, timeout=10) == "sealed"
        letters = [
            default_serde().decode(e.value)
            for p in range(engine.db.log.partitions)
            for e in engine.db.log.read(DEAD_LETTERS, p, 0, 100)
        ]
        assert [getattr(d, "reason", "") for d in letters] == [
            "InvalidPayload: the payload codec cannot decode a 'application/json' payload: "
            "ValueError: bad token"
        ]
        # History still reads: what the codec cannot decode is shown as stored.
        history = await client.history(waiting)
        assert [h.type for h in history][-1] == "WorkflowCompleted"


def test_an_unknown_scheme_names_every_scheme_there_is() -> None:
    """kafka:// and http:// register on first use; an unknown scheme still names them."""
    from stepstream import Client, StepstreamError

    with pytest.raises(StepstreamError, match=r"known: embedded:, http:, https:, kafka:\)"):
        Client.connect("foo://x")
