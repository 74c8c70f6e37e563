"""Source declarations and the translation of one source record into a command, without
a broker: what a declaration refuses (and says), where instance ids come from, each
format, and the reasons an unreadable record is dead-lettered with."""

from __future__ import annotations

import base64
import datetime
import decimal
import io
import json
import sys
import types
import uuid
from typing import Any

import fastavro
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stepstream import Context, Source, UnknownWorkflow
from stepstream.consumers.sources import RecordTranslator, SourceRecord, Unreadable
from stepstream.consumers.sources.avro import AvroReader
from stepstream.engine.api.sources import declared_sources
from stepstream.engine.api.workflow import Registry, workflow
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import SendEvent, StartWorkflow
from tests.integration.test_sources import PAYMENT, confluent, single_object
from tests.source_workflows import src_order


def command(source: Source, record: SourceRecord, limit: int = 1024) -> Any:
    return RecordTranslator(source, JsonCodec(), limit).command(record, now_ms=5)


def rec(
    value: bytes | None, key: bytes | None = b"k-1", headers: list[Any] | None = None
) -> SourceRecord:
    return SourceRecord("t", 1, 42, key, value, headers or [])


def reason(source: Source, record: SourceRecord) -> str:
    with pytest.raises(Unreadable) as caught:
        command(source, record)
    return caught.value.reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of start=<workflow>"),
        ({"start": "a", "event": "b"}, "exactly one of start=<workflow>"),
        ({"start": "a", "instance_id": "value"}, "not one of 'key', 'header:<name>'"),
        ({"start": "a", "instance_id": "field:a..b"}, "names joined by '.'"),
        ({"start": "a", "format": "xml"}, "format='xml' is not one of json, avro, bytes"),
        ({"start": "a", "format": "bytes", "instance_id": "field:id"}, "raw bytes have no"),
        ({"start": "a", "format": "avro"}, "needs the writer schemas"),
        ({"start": "a", "schemas": [PAYMENT]}, "only for format='avro'"),
        ({"event": "~mine"}, "reserved for the engine's own events"),
    ],
)
def test_a_declaration_that_cannot_work_is_refused_saying_why(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Source("orders", **kwargs)


def test_start_takes_a_workflow_function_or_its_name() -> None:
    assert Source("orders", start=src_order).workflow == "src-order"
    assert Source("orders", start="src-order").workflow == "src-order"
    with pytest.raises(TypeError, match="neither a workflow name nor"):
        Source("orders", start=print)


def test_a_worker_finds_the_sources_of_its_modules_and_checks_them() -> None:
    registry = Registry()
    registry.add_module("tests.source_workflows")
    assert {s.topic for s in declared_sources(registry)} == {"test.src-orders", "test.src-paid"}

    module = types.ModuleType("tests._clashing_sources")

    @workflow("clash")
    async def clash(ctx: Context, value: Any) -> Any:
        return value

    clash.__module__ = module.__name__
    module.clash = clash  # type: ignore[attr-defined]
    module.a = Source("same", start="clash")  # type: ignore[attr-defined]
    module.b = Source("same", event="x")  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(ValueError, match="declare one Source per topic"):
            declared_sources(Registry([clash]))
        del module.b  # type: ignore[attr-defined]
        module.a = Source("same", start="nope")  # type: ignore[attr-defined]
        with pytest.raises(UnknownWorkflow, match="'nope'"):
            declared_sources(Registry([clash]))
    finally:
        del sys.modules[module.__name__]


def test_json_by_key_starts_with_the_coordinates_as_command_id() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    got = command(
        Source("t", start="w"), rec(b'{"n": 1}', headers=[("traceparent", parent.encode())])
    )
    assert isinstance(got, StartWorkflow)
    assert (got.instance_id, got.command_id, got.workflow) == ("k-1", "t/1/42", "w")
    assert json.loads(got.input.data) == {"n": 1}
    assert got.traceparent == parent


def test_instance_ids_from_a_header_the_last_of_its_name_or_a_field() -> None:
    by_header = Source("t", event="paid", instance_id="header:id")
    got = command(by_header, rec(b"1", headers=[("id", b"old"), ("id", b"new")]))
    assert isinstance(got, SendEvent) and (got.instance_id, got.name) == ("new", "paid")
    by_field = Source("t", event="paid", instance_id="field:order.id")
    assert command(by_field, rec(b'{"order": {"id": 17}}')).instance_id == "17"
    assert "no header 'id'" in reason(by_header, rec(b"1"))
    assert "no 'id' at order" in reason(by_field, rec(b'{"order": {}}'))
    assert "no 'order' at the top level" in reason(by_field, rec(b"[1]"))
    assert "is null" in reason(by_field, rec(b'{"order": {"id": null}}'))
    assert "must be a string, not list" in reason(by_field, rec(b'{"order": {"id": [1]}}'))


def test_unreadable_records_say_why() -> None:
    by_key = Source("t", start="w")
    assert "bad JSON" in reason(by_key, rec(b"{nope"))
    assert "tombstone" in reason(by_key, rec(None))
    assert "has no key" in reason(by_key, rec(b"1", key=None))
    assert "not UTF-8" in reason(by_key, rec(b"1", key=b"\xff"))
    assert "control character" in reason(by_key, rec(b"1", key=b"a\x01"))
    assert "PayloadTooLarge" in reason(by_key, rec(json.dumps("x" * 2000).encode()))


def test_bytes_are_handed_over_as_base64_text() -> None:
    raw = bytes(range(256))
    got = command(Source("t", start="w", format="bytes"), rec(raw))
    assert base64.b64decode(json.loads(got.input.data)) == raw


def test_avro_single_object_and_confluent_wire_format() -> None:
    value = {"order_id": "o-1", "amount": 2.5}
    reader = AvroReader({7: PAYMENT})
    assert reader.decode(single_object(value)) == value
    assert reader.decode(confluent(value)) == value
    assert AvroReader((PAYMENT,)).decode(single_object(value)) == value
    source = Source(
        "t", event="paid", instance_id="field:order_id", format="avro", schemas=[PAYMENT]
    )
    assert command(source, rec(single_object(value))).instance_id == "o-1"
    assert "schema id 7, which the Source was not given" in reason(source, rec(confluent(value)))
    assert "neither Avro single-object" in reason(source, rec(b"{}"))
    assert "truncated single-object header" in reason(source, rec(b"\xc3\x01\x00"))
    assert "bytes left over" in reason(source, rec(single_object(value) + b"\x00"))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(PAYMENT), value)
    assert "does not match its writer schema" in reason(
        source, rec(single_object(value)[:10] + body.getvalue()[:3])
    )
    with pytest.raises(ValueError, match="invalid Avro schema"):
        AvroReader(({"type": "record", "name": "X", "fields": [{"name": "a"}]},))


def test_avro_bytes_and_logical_types_reach_the_workflow_as_json() -> None:
    schema = {
        "type": "record",
        "name": "Shipment",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "blob", "type": "bytes"},
            {"name": "hash", "type": {"type": "fixed", "name": "H", "size": 4}},
            {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "day", "type": {"type": "int", "logicalType": "date"}},
            {
                "name": "price",
                "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2},
            },
            {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
            {"name": "tags", "type": {"type": "array", "items": "bytes"}},
        ],
    }
    parsed = fastavro.parse_schema(schema)
    value = {
        "id": "s-1",
        "blob": b"\x01\x02",
        "hash": b"abcd",
        "at": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "day": datetime.date(2026, 1, 2),
        "price": decimal.Decimal("1234567.89"),
        "ref": uuid.UUID(int=1),
        "tags": [b"\xff"],
    }
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parsed, value)
    canonical = to_parsing_canonical_form(parsed)
    framed = b"\xc3\x01" + bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")) + body.getvalue()
    source = Source("t", start="w", instance_id="field:id", format="avro", schemas=[schema])
    got = command(source, rec(framed))
    assert json.loads(got.input.data) == {
        "id": "s-1",
        "blob": "AQI=",
        "hash": "YWJjZA==",
        "at": "2026-01-02T03:04:05+00:00",
        "day": "2026-01-02",
        "price": "1234567.89",
        "ref": "00000000-0000-0000-0000-000000000001",
        "tags": ["/w=="],
    }
