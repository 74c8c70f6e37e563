"""Avro record values of a source topic: single-object encoding and Confluent's wire
format, decoded with the writer schemas the ``Source`` was given (no schema registry).

- single-object: ``C3 01``, the writer schema's 8-byte little-endian CRC-64-AVRO
  fingerprint of its Parsing Canonical Form, then the binary body;
- Confluent wire format: ``00``, the 4-byte big-endian schema id, then the binary body.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any
from uuid import UUID

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stepstream.engine.api.sources import AvroSchema

SINGLE_OBJECT_MARKER = b"\xc3\x01"
CONFLUENT_MAGIC = 0


class AvroFormatError(ValueError):
    """A record value these schemas cannot decode; the message says why."""


def _fingerprint(parsed: Any) -> bytes:
    # fastavro gives the fingerprint's 8 bytes little-endian, the order the spec writes.
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


class AvroReader:
    """Decodes values written with any of the given writer schemas."""

    def __init__(self, schemas: Mapping[int, AvroSchema] | tuple[AvroSchema, ...]) -> None:
        given = schemas.items() if isinstance(schemas, Mapping) else enumerate(schemas)
        self._by_id: dict[int, Any] = {}
        self._by_fingerprint: dict[bytes, Any] = {}
        for key, schema in given:
            try:
                parsed = fastavro.parse_schema(dict(schema))
            except Exception as exc:
                raise ValueError(f"invalid Avro schema {key}: {exc}") from None
            if isinstance(schemas, Mapping):
                self._by_id[key] = parsed
            self._by_fingerprint[_fingerprint(parsed)] = parsed

    def decode(self, value: bytes) -> Any:
        if value[:2] == SINGLE_OBJECT_MARKER:
            if len(value) < 10:
                raise AvroFormatError("truncated single-object header (needs 10 bytes)")
            schema = self._by_fingerprint.get(value[2:10])
            if schema is None:
                raise AvroFormatError(
                    f"single-object record with schema fingerprint {value[2:10].hex()}, "
                    "which none of the Source's schemas has; add its writer schema to "
                    "schemas="
                )
            return _read(value[10:], schema)
        if value[:1] == bytes([CONFLUENT_MAGIC]):
            if len(value) < 5:
                raise AvroFormatError("truncated Confluent wire-format header (needs 5 bytes)")
            schema_id = int.from_bytes(value[1:5], "big")
            schema = self._by_id.get(schema_id)
            if schema is None:
                known = ", ".join(map(str, sorted(self._by_id))) or "none"
                raise AvroFormatError(
                    f"Confluent wire-format record with schema id {schema_id}, which the "
                    f"Source was not given (ids given: {known}); pass schemas={{{schema_id}: "
                    "<writer schema>}"
                )
            return _read(value[5:], schema)
        raise AvroFormatError(
            f"value starts with {value[:2].hex() or 'nothing'}: neither Avro single-object "
            "encoding (c3 01) nor Confluent's wire format (00)"
        )


def _read(body: bytes, schema: Any) -> Any:
    stream = io.BytesIO(body)
    try:
        decoded = fastavro.schemaless_reader(stream, schema, None)
    except Exception as exc:
        raise AvroFormatError(
            f"Avro body does not match its writer schema: {type(exc).__name__}: {exc}"
        ) from None
    if stream.tell() != len(body):
        raise AvroFormatError(
            f"Avro body has {len(body) - stream.tell()} bytes left over after the record; "
            "it was written with another schema"
        )
    return _as_json(decoded)


def _as_json(value: Any) -> Any:
    """fastavro's Python values for Avro's ``bytes``, ``fixed`` and logical types as the
    JSON a workflow gets: bytes as base64 text (as ``format="bytes"`` hands them over),
    times and dates as ISO 8601 text, decimals as text (no digit lost to a float), UUIDs
    as text."""
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    return value
