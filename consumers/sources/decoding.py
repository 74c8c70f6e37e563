"""Record values of a source topic, by the ``Source``'s format: JSON text, Avro (see
``consumers.sources.avro``) or raw bytes (base64 text, so the default JSON payload codec
can carry them)."""

from __future__ import annotations

import base64
import json
from typing import Any

from stepstream.consumers.sources.avro import AvroFormatError, AvroReader
from stepstream.engine.api.sources import Source


class UnreadableValue(ValueError):
    """A record value the source's format cannot read; the message says why."""


class ValueDecoder:
    def __init__(self, source: Source) -> None:
        self.format = source.format
        # Schemas are parsed once, when the worker starts: a bad one stops it at once.
        self._avro = AvroReader(source.schemas) if source.format == "avro" else None

    def decode(self, value: bytes | None) -> Any:
        if value is None:
            raise UnreadableValue("the record has no value (a tombstone)")
        if self._avro is not None:
            try:
                return self._avro.decode(value)
            except AvroFormatError as exc:
                raise UnreadableValue(f"bad Avro: {exc}") from None
        if self.format == "bytes":
            return base64.b64encode(value).decode("ascii")
        try:
            return json.loads(value)
        except RecursionError:
            raise UnreadableValue("bad JSON: nested too deep") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise UnreadableValue(f"bad JSON: {exc}") from None
