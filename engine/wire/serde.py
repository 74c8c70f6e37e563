"""Avro single-object encoding of records: the ``RecordSerde`` facade over ``engine.wire.avro``.

Every record is written with the latest schema version of its type as the marker ``C3 01``,
the 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical
Form, then the Avro binary body, so any Avro reader can find the schema that wrote it.
Decoding looks the writer schema up by fingerprint (any known version) and resolves it
against the latest version of that record type; Avro fields a class does not have are
dropped, fields an older writer lacked get the reader schema's default.

Records of the latest version go through plans compiled once from the schema
(``engine.wire.avro.plans``); older versions go through fastavro's schema resolution
(``engine.wire.avro.conversion``); ``compiled=False`` sends everything through fastavro.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Final

import fastavro
import fastavro.validation

from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.wire.avro.binary import Malformed, Reader, Writer
from stepstream.engine.wire.avro.conversion import dict_converters
from stepstream.engine.wire.avro.field_map import record_plan
from stepstream.engine.wire.avro.plans import (
    NotCompiled,
    encoder_function,
    reader_steps,
    writer_steps,
)
from stepstream.engine.wire.avro.schema_files import Schema, SchemaFile, build_schema, load_tree
from stepstream.engine.wire.records import ALL_TYPES, Record
from stepstream.schemas import schema_root

MARKER: Final = b"\xc3\x01"
HEADER_SIZE: Final = len(MARKER) + 8

_DOMAIN_OF_TOPIC: Final = {
    "commands": "commands",
    "history": "history",
    "timers": "timers",
    "dead-letters": "deadletters",
    "snapshots": "snapshots",
}
_COMMON: Final = "common"
# Records of the compacted cluster topics (engine.wire.cluster_serde): no envelope, no class.
CLUSTER_DOMAINS: Final = frozenset({"members", "definitions"})
_DOMAINS: Final = frozenset({_COMMON, *_DOMAIN_OF_TOPIC.values(), *CLUSTER_DOMAINS})

SchemaRoot = str | PathLike[str]


def _header(schema: Schema) -> bytes:
    """The single-object header of a record ``schema`` wrote."""
    return MARKER + schema.fingerprint.to_bytes(8, "little")


@dataclass(frozen=True, slots=True, eq=False)
class _Encoder:
    schema: Schema
    header: bytes
    # The compiled plan, one function per field: where a failed encoding went wrong.
    steps: tuple[tuple[str, Writer], ...] | None
    to_dict: Callable[[Any], dict[str, Any]]
    # The compiled plan as one function (None: fastavro encodes).
    function: Callable[[Any], bytes] | None


@dataclass(frozen=True, slots=True, eq=False)
class _Decoder:
    cls: type[Record]
    writer: Schema
    reader: Schema
    steps: tuple[tuple[str, Reader], ...] | None
    discards: bool
    from_dict: Callable[[Mapping[str, Any]], dict[str, Any]]


class RecordSerde:
    """Encodes records to Avro single-object bytes and back.

    ``extra_roots`` add schema trees whose versions may become the latest of a record type
    (written and used as reader schema). ``writer_roots`` add schemas known only as writers,
    as a consumer that learned a newer writer's schemas would. Each root holds
    ``stepstream/<domain>/v<N>/<Record>.avsc``; the packaged ``schemas/`` always comes first.
    ``compiled=False`` encodes and decodes everything through fastavro.
    """

    def __init__(
        self,
        extra_roots: Iterable[SchemaRoot] = (),
        *,
        writer_roots: Iterable[SchemaRoot] = (),
        compiled: bool = True,
    ) -> None:
        reader_roots = [schema_root(), *map(Path, extra_roots)]
        self._roots = [*reader_roots, *map(Path, writer_roots)]
        files: dict[str, SchemaFile] = {}
        readable: set[str] = set()
        for index, root in enumerate(self._roots):
            for file in load_tree(root, _DOMAINS):
                known = files.setdefault(file.full_name, file)
                if known.raw != file.raw:
                    raise ValueError(
                        f"{file.path} and {known.path} define {file.full_name} differently; "
                        "a released schema is never edited, add a new version instead"
                    )
                if index < len(reader_roots):
                    readable.add(file.full_name)
        defs = {name: file.raw for name, file in files.items()}
        self._schemas: dict[int, Schema] = {}
        for file in files.values():
            if file.domain == _COMMON or file.domain in CLUSTER_DOMAINS:
                continue
            schema = build_schema(file, defs)
            clash = self._schemas.setdefault(schema.fingerprint, schema)
            if clash is not schema:
                raise ValueError(f"{file.path} and {clash.file.path} share a fingerprint")

        self._encoders: dict[type[Record], _Encoder] = {}
        self._decoders: dict[bytes, _Decoder] = {}
        for cls in ALL_TYPES:
            domain = _DOMAIN_OF_TOPIC[cls.topic_kind]
            versions = [
                s
                for s in self._schemas.values()
                if s.record_name == cls.type_name and s.file.domain == domain
            ]
            readers = [s for s in versions if s.full_name in readable]
            if not readers:
                raise ValueError(
                    f"no schema for {cls.type_name}: expected "
                    f"stepstream/{domain}/v1/{cls.type_name}.avsc under {reader_roots}"
                )
            latest = max(readers, key=lambda s: s.file.version)
            plan = record_plan(latest, cls)
            to_dict, from_dict = dict_converters(latest, plan)
            header = _header(latest)
            writes = reads = function = None
            discards = False
            if compiled:
                try:
                    writes = writer_steps(latest, plan)[1]
                    reads, discards = reader_steps(latest, plan)
                    function = encoder_function(latest, plan, header)
                except NotCompiled:
                    writes = reads = function = None
            self._encoders[cls] = _Encoder(latest, header, writes, to_dict, function)
            for schema in versions:
                steps = reads if schema is latest else None
                decoder = _Decoder(cls, schema, latest, steps, discards, from_dict)
                self._decoders[_header(schema)[len(MARKER) :]] = decoder

    # ---- encoding -----------------------------------------------------------------------

    def encode(self, record: Record) -> bytes:
        """The single-object encoding of ``record`` with the latest schema of its type.

        Raises TypeError for an object that is not a known record type and ValueError for
        attribute values the schema cannot hold (wrong type, integer out of range).
        """
        encoder = self._encoders.get(type(record))
        if encoder is None:
            raise TypeError(f"{type(record).__qualname__} is not a record type with a schema")
        try:
            if encoder.function is not None:
                return encoder.function(record)
            out = io.BytesIO()
            out.write(encoder.header)
            fastavro.schemaless_writer(out, encoder.schema.parsed, encoder.to_dict(record))
            return out.getvalue()
        except Exception as exc:
            raise ValueError(_encode_failure(record, encoder, exc)) from exc

    # ---- decoding -----------------------------------------------------------------------

    def decode(self, data: bytes) -> Record:
        """The record in ``data``, read with the latest schema of its type.

        Raises UndecodableRecord, saying why, for anything that is not a record some known
        schema wrote: another format, an unknown fingerprint, a truncated or corrupt body.
        """
        if type(data) is not bytes:
            try:
                data = bytes(data)
            except TypeError as exc:
                raise UndecodableRecord(f"expected bytes, got {type(data).__name__}") from exc
        decoder = self._decoders.get(data[len(MARKER) : HEADER_SIZE])
        if decoder is None or data[: len(MARKER)] != MARKER:
            raise UndecodableRecord(self._header_problem(data))
        try:
            steps = decoder.steps
            if steps is not None:
                kw: dict[str, Any] = {}
                end = HEADER_SIZE
                for name, read in steps:
                    kw[name], end = read(data, end)
                if decoder.discards:
                    del kw[""]
            else:
                body = io.BytesIO(data)
                body.seek(HEADER_SIZE)
                reader = None if decoder.reader is decoder.writer else decoder.reader.parsed
                raw: Any = fastavro.schemaless_reader(body, decoder.writer.parsed, reader)
                end = body.tell()
                kw = decoder.from_dict(raw)
            if end != len(data):
                raise Malformed(f"{len(data) - end} bytes left over after the record")
            return decoder.cls(**kw)
        except Exception as exc:
            raise UndecodableRecord(_decode_failure(data, decoder, exc)) from exc

    def _header_problem(self, data: bytes) -> str:
        if len(data) < HEADER_SIZE:
            return (
                f"{len(data)} bytes is shorter than the {HEADER_SIZE}-byte Avro single-object "
                "header (marker c3 01, 8-byte schema fingerprint): not a stepstream record"
            )
        if data[: len(MARKER)] != MARKER:
            return (
                f"starts with {data[:2].hex(' ')}, not the Avro single-object marker c3 01: "
                "not a stepstream record (plain JSON, or another producer's format?)"
            )
        fingerprint = int.from_bytes(data[len(MARKER) : HEADER_SIZE], "little")
        known = self._schemas.get(fingerprint)
        if known is not None:
            return (
                f"schema {known.full_name} (fingerprint 0x{fingerprint:016x}) is a record type "
                "this version of stepstream does not have: upgrade stepstream to read it"
            )
        return (
            f"unknown schema fingerprint 0x{fingerprint:016x}: written by a newer stepstream, "
            f"or by a producer with schemas of its own? This reader knows {len(self._schemas)} "
            f"schemas under {[str(r) for r in self._roots]}; upgrade stepstream or add the "
            "writer's schema root"
        )

    # ---- schemas for other readers ------------------------------------------------------

    def writer_schemas(self) -> dict[int, dict[str, Any]]:
        """Every known writer schema by fingerprint (the 64-bit value whose little-endian
        bytes follow ``c3 01``). Each is standalone: hand it to ``fastavro.parse_schema``."""
        return {fp: _copy(s.schema) for fp, s in self._schemas.items()}

    def fingerprint(self, record_type: type[Record]) -> int:
        """Fingerprint of the schema ``encode`` writes ``record_type`` with."""
        return self._encoders[record_type].schema.fingerprint

    def schema(self, record_type: type[Record]) -> dict[str, Any]:
        """The standalone schema ``encode`` writes ``record_type`` with."""
        return _copy(self._encoders[record_type].schema.schema)


def _copy(schema: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(schema))
    return copied


def _encode_failure(record: Record, encoder: _Encoder, exc: Exception) -> str:
    """The failure, naming the attribute at fault (found again off the hot path)."""
    where = ""
    if encoder.steps is None:
        try:
            fastavro.validation.validate(
                encoder.to_dict(record), encoder.schema.parsed, raise_errors=True
            )
        except Exception as invalid:
            where = f" {' '.join(str(invalid).split())}:"
    for name, write in encoder.steps or ():
        try:
            write(bytearray(), getattr(record, name))
        except Exception:
            where = f" attribute {name}={getattr(record, name)!r:.80}:"
            break
    return (
        f"cannot encode {record.type} of instance {record.instance_id!r} with schema "
        f"{encoder.schema.full_name}:{where} {type(exc).__name__}: {exc}"
    )


def _decode_failure(data: bytes, decoder: _Decoder, exc: Exception) -> str:
    if isinstance(exc, Malformed):
        reason = str(exc)
    elif isinstance(exc, IndexError) and not decoder.steps and "list index" in str(exc):
        # fastavro indexes its list of union branches; running off the body is a string index.
        reason = f"a union branch index is out of range ({exc})"
    elif isinstance(exc, IndexError | EOFError):
        reason = f"the body ends early, truncated? ({str(exc) or 'no more bytes'})"
    elif isinstance(exc, UnicodeDecodeError):
        reason = f"a string is not valid UTF-8 ({exc})"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return (
        f"{len(data)}-byte {decoder.cls.type_name} record written with "
        f"{decoder.writer.full_name} (fingerprint 0x{decoder.writer.fingerprint:016x}) "
        f"is corrupt: {reason}"
    )


@functools.cache
def default_serde() -> RecordSerde:
    """The serde over the packaged schemas, built once per process."""
    return RecordSerde()
