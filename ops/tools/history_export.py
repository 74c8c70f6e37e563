"""The history export file: one instance's raw history records as a JSON document.

``stepstream history ID --export F`` writes it; ``stepstream replay --file F`` and
``stepstream.testing.replay(F, workflows)`` read it back into the very records that were
written. The format is documented in ``docs/history-export.md``:

    {"format": "stepstream.history", "format_version": 1,
     "instance_id": ..., "workflow": ..., "version": ...,
     "records": [{"type": ..., "seq": ..., "time_ms": ..., "command_id": ..., "epoch": ...,
                  "attributes": {...}}, ...]}

A payload attribute is ``{"content_type": ..., "json": value}`` when it holds JSON that
the JSON codec writes back byte for byte, else ``{"content_type": ..., "base64": ...}``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import os
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from stepstream.engine.errors import InvalidPayload, StepstreamError
from stepstream.engine.reads.views import SHOWN_WHEN_SET, HistoryEntry
from stepstream.engine.wire.codec import JSON, JsonCodec, PayloadCodec, encode_safely
from stepstream.engine.wire.records import (
    HISTORY_TYPES,
    HistoryRecord,
    MessagesReceived,
    Payload,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde

FORMAT = "stepstream.history"
FORMAT_VERSION = 1
_ENVELOPE = ("seq", "time_ms", "command_id", "epoch")
_OPTIONAL_ENVELOPE = ("traceparent", "tracestate")
_NOT_ATTRIBUTES = frozenset({"instance_id", *_ENVELOPE, *_OPTIONAL_ENVELOPE})
_CLASSES: dict[str, type[HistoryRecord]] = {cls.type_name: cls for cls in HISTORY_TYPES}
_CODEC = JsonCodec()


class InvalidHistoryFile(StepstreamError):
    """A history export file that cannot be read: not JSON, not this format, a newer
    format version, or records this version of stepstream does not know."""


@dataclass(frozen=True, slots=True)
class ExportedHistory:
    """One instance's history, as an export file holds it."""

    instance_id: str
    workflow: str
    version: str
    records: list[HistoryRecord]


# ---- records -> document ----------------------------------------------------------------


# Fields that later schema versions added (StepFailed and WorkflowFailed v2, WorkflowStarted
# v2), written only when set: an older history exports as it did, and older readers skip
# them anyway.
_LATER_FIELDS = frozenset({"traceback", *SHOWN_WHEN_SET})


def to_document(instance_id: str, records: Sequence[HistoryRecord]) -> dict[str, Any]:
    """The export document of ``records``, the history of ``instance_id``."""
    started = next((r for r in records if isinstance(r, WorkflowStarted)), None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "instance_id": instance_id,
        "workflow": started.workflow if started is not None else "",
        "version": started.version if started is not None else "",
        "records": [record_to_json(r) for r in records],
    }


def record_to_json(record: HistoryRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"type": record.type}
    out.update({name: getattr(record, name) for name in _ENVELOPE})
    for name in _OPTIONAL_ENVELOPE:
        value = getattr(record, name)
        if value is not None:
            out[name] = value
    out["attributes"] = {
        f.name: _attribute_json(getattr(record, f.name))
        for f in dataclasses.fields(record)
        if f.name not in _NOT_ATTRIBUTES
        and not (f.name in _LATER_FIELDS and getattr(record, f.name) is None)
    }
    return out


def _attribute_json(value: Any) -> Any:
    if isinstance(value, Payload):
        return payload_to_json(value)
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, list | tuple):
        return [_attribute_json(v) for v in value]
    return value


def payload_to_json(payload: Payload) -> dict[str, Any]:
    """Readable JSON where that reads back to the same bytes, base64 otherwise."""
    if payload.content_type == JSON:
        try:
            value = json.loads(payload.data)
            if _CODEC.encode(value).data == payload.data:
                return {"content_type": JSON, "json": value}
        except (ValueError, InvalidPayload, RecursionError):
            pass
    return {
        "content_type": payload.content_type,
        "base64": base64.b64encode(payload.data).decode(),
    }


def dumps(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"


def write_export(
    path: str | os.PathLike[str], instance_id: str, records: Sequence[HistoryRecord]
) -> None:
    """Write the export file atomically (a reader never sees half a file)."""
    target = Path(path)
    text = dumps(to_document(instance_id, records))
    temporary = target.with_name(f".{target.name}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        reason = exc.strerror or exc
        raise StepstreamError(f"cannot write history file {target}: {reason}") from None


# ---- document -> records ----------------------------------------------------------------


def read_export(path: str | os.PathLike[str]) -> ExportedHistory:
    where = os.fspath(path)
    try:
        text = Path(where).read_text(encoding="utf-8")
    except OSError as exc:
        reason = exc.strerror or exc
        raise InvalidHistoryFile(f"cannot read history file {where}: {reason}") from None
    except UnicodeDecodeError as exc:
        raise InvalidHistoryFile(
            f"history file {where} is not UTF-8 text ({exc.reason} at byte {exc.start}): an "
            "export is JSON, as `stepstream history ID --export FILE` writes it (unpack a "
            "compressed one first)"
        ) from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise InvalidHistoryFile(f"history file {where} is not JSON: {exc}") from None
    return from_document(document, where=where)


def from_document(document: Any, *, where: str = "history document") -> ExportedHistory:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise InvalidHistoryFile(
            f'{where} is not a stepstream history export (no "format": "{FORMAT}"); '
            "write one with `stepstream history ID --export FILE`"
        )
    version = document.get("format_version")
    if type(version) is not int or version > FORMAT_VERSION or version < 1:
        raise InvalidHistoryFile(
            f"{where} has format_version {version!r}; this stepstream reads versions 1 to "
            f"{FORMAT_VERSION}: upgrade stepstream to read it"
        )
    instance_id = document.get("instance_id")
    raw_records = document.get("records")
    if not isinstance(instance_id, str) or not isinstance(raw_records, list):
        raise InvalidHistoryFile(f"{where} lacks a string instance_id and a list of records")
    records = []
    for n, raw in enumerate(raw_records):
        try:
            record = record_from_json(instance_id, raw)
            # What the engine could not have written (a field of the wrong type) is
            # refused here, naming the field, rather than failing whoever reads it.
            default_serde().encode(record)
            records.append(record)
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as exc:
            raise InvalidHistoryFile(
                f"{where}: record {n} cannot be read ({type(exc).__name__}: {exc})"
            ) from None
    return ExportedHistory(
        instance_id=instance_id,
        workflow=str(document.get("workflow", "")),
        version=str(document.get("version", "")),
        records=records,
    )


def record_from_json(instance_id: str, raw: Mapping[str, Any]) -> HistoryRecord:
    if not isinstance(raw, dict):
        raise ValueError(f"a record must be a JSON object, got {raw!r:.60}")
    type_name = raw["type"]
    cls = _CLASSES.get(type_name)
    if cls is None:
        raise ValueError(
            f"unknown record type {type_name!r} (written by a newer stepstream? this one "
            f"knows {', '.join(sorted(_CLASSES))})"
        )
    payloads = _PAYLOAD_FIELDS[type_name]
    known = _ATTRIBUTES[type_name]
    attributes: dict[str, Any] = {}
    given = raw.get("attributes", {})
    if not isinstance(given, dict):
        raise ValueError(f"attributes must be a JSON object, got {given!r:.60}")
    for name, value in given.items():
        if name not in known:
            continue  # a field a newer writer added; this version has no place for it
        attributes[name] = _payload_from(value) if name in payloads and value is not None else value
    if cls is MessagesReceived and isinstance(attributes.get("data"), list):
        # The messages' bytes, written as {"base64": ...} each (``_attribute_json``).
        attributes["data"] = [_bytes_from(item) for item in attributes["data"]]
    envelope = {name: raw[name] for name in _ENVELOPE}
    for name in _OPTIONAL_ENVELOPE:
        envelope[name] = raw.get(name)
    return cls(instance_id=instance_id, **envelope, **attributes)


def _bytes_from(raw: Any) -> bytes:
    if not isinstance(raw, dict) or not isinstance(raw.get("base64"), str):
        raise ValueError(f"bytes must be {{base64}}, got {raw!r}")
    return base64.b64decode(raw["base64"], validate=True)


def _payload_from(raw: Any) -> Payload:
    if not isinstance(raw, dict) or "content_type" not in raw:
        raise ValueError(f"a payload must be {{content_type, json|base64}}, got {raw!r}")
    if "json" in raw:
        payload = _CODEC.encode(raw["json"])
        return Payload(raw["content_type"], payload.data)
    return Payload(raw["content_type"], base64.b64decode(raw["base64"], validate=True))


def _payload_fields_of(cls: type[HistoryRecord], *, optional: bool) -> frozenset[str]:
    hints = typing.get_type_hints(cls)
    if optional:
        return frozenset(n for n, hint in hints.items() if Payload in typing.get_args(hint))
    return frozenset(n for n, hint in hints.items() if hint is Payload)


# Record type name -> the attributes that hold payloads (always, or maybe), and every
# attribute it has.
_PAYLOAD_FIELDS = {
    name: _payload_fields_of(cls, optional=False) | _payload_fields_of(cls, optional=True)
    for name, cls in _CLASSES.items()
}
_REQUIRED_PAYLOADS = {
    name: _payload_fields_of(cls, optional=False) for name, cls in _CLASSES.items()
}
_ATTRIBUTES = {
    name: frozenset(f.name for f in dataclasses.fields(cls) if f.name not in _NOT_ATTRIBUTES)
    for name, cls in _CLASSES.items()
}


# ---- what a client reads -> records -------------------------------------------------------


def records_from_entries(
    instance_id: str, entries: Iterable[HistoryEntry], codec: PayloadCodec | None = None
) -> list[HistoryRecord]:
    """Records rebuilt from a client's history view (``Client.history``). The server
    decoded each payload with its codec; it is encoded again with ``codec`` (JSON by
    default, which gives back the bytes the JSON codec wrote). What the server could not
    decode it sent as ``{content_type, base64}``, kept as it is. The view does not carry
    the writer's epoch or trace context: those are left empty."""
    codec = codec or _CODEC
    records = []
    for entry in entries:
        cls = _CLASSES.get(entry.type)
        if cls is None:
            raise InvalidHistoryFile(
                f"instance {instance_id}: the server sent a {entry.type!r} record, which this "
                "stepstream does not know; upgrade it"
            )
        payloads = _PAYLOAD_FIELDS[entry.type]
        required = _REQUIRED_PAYLOADS[entry.type]
        known = _ATTRIBUTES[entry.type]
        attributes: dict[str, Any] = {}
        if cls is MessagesReceived:
            # Shown as one decoded list (``HistoryEntry.of``), stored as two.
            viewed = [
                _viewed_payload(entry, f"payloads.{i}", p, codec)
                for i, p in enumerate(entry.attributes.get("payloads", []))
            ]
            attributes["content_types"] = [p.content_type for p in viewed]
            attributes["data"] = [p.data for p in viewed]
        for name, value in entry.attributes.items():
            if name not in known:
                continue
            # A payload that must be there and reads None held JSON null.
            if name in required or (name in payloads and value is not None):
                value = _viewed_payload(entry, name, value, codec)
            attributes[name] = value
        records.append(
            cls(
                instance_id=instance_id,
                seq=entry.seq,
                time_ms=_ms(entry.time),
                command_id=entry.command_id,
                **attributes,
            )
        )
    return records


def _viewed_payload(entry: HistoryEntry, where: str, value: Any, codec: PayloadCodec) -> Payload:
    """The payload ``entry`` shows at ``where``: as it is stored where the server could
    not decode it, else ``value`` encoded again."""
    stored = entry.shown_as_stored(where)
    return stored if stored is not None else encode_safely(codec, value)


def _ms(iso: str) -> int:
    return round(datetime.fromisoformat(iso).timestamp() * 1000)
