"""Records of the compacted cluster topics, ``<prefix>.members`` (``MemberAnnounced``)
and ``<prefix>.definitions`` (``WorkflowRegistered``), in Avro single-object encoding.

They are written like every other record (marker ``C3 01``, the 8-byte little-endian
CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form, the Avro body),
with the schemas in ``schemas/stepstream/{members,definitions}/v<N>/``, so any Kafka tool
with those files reads them. They describe workers, not instances, so unlike the records
of ``engine.wire.serde`` they have no envelope and map to plain dicts, not record classes.
Decoding resolves any known writer version against the latest one of the record.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.wire.serde import CLUSTER_DOMAINS, HEADER_SIZE, MARKER
from stepstream.schemas import schema_root

MEMBER_ANNOUNCED: Final = "MemberAnnounced"
WORKFLOW_REGISTERED: Final = "WorkflowRegistered"


@dataclass(frozen=True, slots=True)
class _Version:
    name: str
    version: int
    parsed: Any
    header: bytes


class ClusterSerde:
    """``encode(record_name, fields)`` and ``decode(data) -> (record_name, fields)``."""

    def __init__(self, root: Path | None = None) -> None:
        base = (root or schema_root()) / "stepstream"
        self._by_header: dict[bytes, _Version] = {}
        self._latest: dict[str, _Version] = {}
        for domain in sorted(CLUSTER_DOMAINS):
            for path in sorted((base / domain).glob("v*/*.avsc")):
                raw = json.loads(path.read_text(encoding="utf-8"))
                parsed = fastavro.parse_schema(raw)
                canonical = to_parsing_canonical_form(parsed)
                header = MARKER + bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
                found = _Version(path.stem, int(path.parent.name[1:]), parsed, header)
                self._by_header[header] = found
                latest = self._latest.get(found.name)
                if latest is None or found.version > latest.version:
                    self._latest[found.name] = found

    def encode(self, name: str, fields: dict[str, Any]) -> bytes:
        schema = self._latest[name]
        out = io.BytesIO()
        out.write(schema.header)
        fastavro.schemaless_writer(out, schema.parsed, fields)
        return out.getvalue()

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """The record's name and fields; ``UndecodableRecord`` saying why for anything
        else (an old JSON announcement, an unknown schema, a corrupt body)."""
        writer = self._by_header.get(bytes(data[:HEADER_SIZE]))
        if writer is None:
            start = bytes(data[:2])
            what = (
                "not Avro single-object encoding (a JSON record of an older stepstream?)"
                if start != MARKER
                else f"unknown schema fingerprint {bytes(data[2:HEADER_SIZE]).hex()}"
            )
            raise UndecodableRecord(f"{len(data)}-byte cluster record: {what}")
        reader = self._latest[writer.name]
        try:
            body = io.BytesIO(data)
            body.seek(HEADER_SIZE)
            value = fastavro.schemaless_reader(
                body, writer.parsed, None if reader is writer else reader.parsed
            )
        except Exception as exc:
            raise UndecodableRecord(
                f"{len(data)}-byte {writer.name} record is corrupt: {type(exc).__name__}: {exc}"
            ) from exc
        assert isinstance(value, dict)
        return writer.name, value


@functools.cache
def cluster_serde() -> ClusterSerde:
    """The serde over the packaged schemas, built once per process."""
    return ClusterSerde()
