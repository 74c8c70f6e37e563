"""One record of a source topic -> the command it stands for, or why it cannot be read.

The command id is the record's coordinates, ``topic/partition/offset``: a record
delivered again (a worker died before committing its offset) becomes the very same
command, which the instance's processor applies once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stepstream.consumers.sources.decoding import UnreadableValue, ValueDecoder
from stepstream.engine.api.sources import Source
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.codec import PayloadCodec, check_size, encode_safely
from stepstream.engine.wire.names import name_problem
from stepstream.engine.wire.records import Command, DeadLetter, SendEvent, StartWorkflow

TRACEPARENT_HEADER = "traceparent"


@dataclass(frozen=True, slots=True)
class SourceRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]] = ()

    @property
    def command_id(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"

    def header(self, name: str) -> bytes | None:
        """The last header of that name (Kafka allows repeats; the latest wins)."""
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found


class Unreadable(Exception):
    """A record that cannot become a command; ``reason`` says why and what to do."""

    def __init__(self, reason: str, instance_id: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.instance_id = instance_id


class RecordTranslator:
    """Turns the records of one ``Source`` into commands."""

    def __init__(self, source: Source, codec: PayloadCodec, max_payload_bytes: int) -> None:
        self.source = source
        self._decoder = ValueDecoder(source)
        self._codec = codec
        self._max_payload_bytes = max_payload_bytes

    def command(self, record: SourceRecord, now_ms: int) -> Command:
        """The record's command; raises ``Unreadable``."""
        source = self.source
        try:
            value = self._decoder.decode(record.value)
        except UnreadableValue as exc:
            raise Unreadable(str(exc)) from None
        instance_id = self._instance_id(record, value)
        what = "workflow input" if source.workflow is not None else f"event {source.event!r}"
        try:
            payload = check_size(
                encode_safely(self._codec, value), self._max_payload_bytes, what=what
            )
        except StepstreamError as exc:
            raise Unreadable(f"{type(exc).__name__}: {exc}", instance_id) from None
        envelope: dict[str, Any] = {
            "instance_id": instance_id,
            "command_id": record.command_id,
            "time_ms": now_ms,
            "traceparent": _text(record.header(TRACEPARENT_HEADER)),
        }
        if source.workflow is not None:
            return StartWorkflow(workflow=source.workflow, input=payload, **envelope)
        assert source.event is not None
        return SendEvent(name=source.event, payload=payload, **envelope)

    def _instance_id(self, record: SourceRecord, value: Any) -> str:
        correlation = self.source.correlation
        found: object
        if correlation.kind == "key":
            if record.key is None:
                raise Unreadable("the record has no key, where this Source reads instance ids")
            found = _text(record.key)
            where = "the key"
        elif correlation.kind == "header":
            raw = record.header(correlation.name)
            if raw is None:
                raise Unreadable(f"the record has no header {correlation.name!r} (instance id)")
            found = _text(raw)
            where = f"header {correlation.name!r}"
        else:
            found = _field(value, correlation.path, correlation.name)
            where = f"field {correlation.name!r}"
            if found is None:
                raise Unreadable(f"the correlation field {correlation.name!r} is null")
        if found is None:
            raise Unreadable(f"the instance id in {where} is not UTF-8 text")
        if isinstance(found, int) and not isinstance(found, bool):
            found = str(found)  # numeric ids (order 42) are common in upstream records
        problem = name_problem(found)
        if problem is not None:
            raise Unreadable(f"invalid instance id in {where}: {problem}")
        assert isinstance(found, str)
        return found


def _field(value: Any, path: tuple[str, ...], dotted: str) -> object:
    node = value
    for depth, part in enumerate(path):
        if not isinstance(node, dict) or part not in node:
            at = ".".join(path[:depth]) or "the top level"
            raise Unreadable(
                f"missing correlation field {dotted!r}: no {part!r} at {at} of the value"
            )
        node = node[part]
    return node


def _text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


# What a dead letter leaves for its key, reason and envelope under the payload limit:
# the dead-letters topic takes records about as large as the commands topic does.
DEAD_LETTER_HEADROOM = 64 * 1024


def dead_letter(
    record: SourceRecord, problem: Unreadable, now_ms: int, max_bytes: int
) -> DeadLetter:
    """The record kept as it came, with its coordinates and the reason. A record too large
    to be kept whole (over ``max_bytes`` less the headroom) is kept without its value, and
    the reason says so: the dead-letters topic would refuse it, and stop the sources."""
    key, value, reason = record.key or b"", record.value or b"", problem.reason
    if len(key) + len(value) > max(max_bytes - DEAD_LETTER_HEADROOM, 0):
        reason = (
            f"{reason} (the record, {len(key) + len(value)} bytes, is too large to keep "
            f"here: read it at {record.command_id} while the topic still holds it)"
        )
        key, value = key[:256], b""
    return DeadLetter(
        instance_id=problem.instance_id,
        time_ms=now_ms,
        command_id=record.command_id,
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=key,
        value=value,
        reason=reason,
    )
