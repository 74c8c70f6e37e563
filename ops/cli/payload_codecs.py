"""The payload codec ``--codec MODULE:OBJECT`` names (``ops.cli.options`` declares the
flag), loaded; and the note a reading command prints when payloads reached it undecoded
(written by a codec the reader was not given).

OBJECT is a ``PayloadCodec`` (anything with ``encode(value) -> Payload`` and
``decode(payload) -> value``), or a class or function taking no arguments that returns
one: a factory runs when the command starts, so a codec that reads its keys from the
environment fails there, with its own message, rather than when its module is imported.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterable
from typing import Any

from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.views import HistoryEntry
from stepstream.engine.wire.codec import JsonCodec, PayloadCodec, decode_safely
from stepstream.engine.wire.records import Payload
from stepstream.ops.cli.table import UsageError


def load_codec(spec: str, flag: str = "--codec") -> PayloadCodec:
    """The ``PayloadCodec`` ``MODULE:OBJECT`` names, called first if it is a class or a
    function. Every way this can fail is a usage error that says what to change. The
    caller puts the working directory on the import path first; ``flag`` is where
    ``spec`` came from, as the messages say it."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(
            f"{flag} expects MODULE:OBJECT (e.g. examples.aes_gcm_codec:codec), got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"{flag} {spec}: cannot import {module_name!r} ({exc}); check the name, and run "
            "from the directory that holds it or put it on PYTHONPATH"
        ) from None
    except Exception as exc:
        raise UsageError(
            f"{flag} {spec}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise UsageError(f"{flag} {spec}: module {module_name!r} has no {attribute!r}")
        found = getattr(found, part)
    codec = found
    if isinstance(found, type) or not _is_codec(found):
        if not callable(found) or not _takes_no_arguments(found):
            raise UsageError(_not_a_codec(flag, spec, found))
        try:
            codec = found()
        except Exception as exc:
            raise UsageError(
                f"{flag} {spec}: making the codec failed: {type(exc).__name__}: {exc}"
            ) from None
    if not _is_codec(codec):
        raise UsageError(_not_a_codec(flag, spec, codec))
    return codec


def _takes_no_arguments(factory: Any) -> bool:
    try:
        inspect.signature(factory).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to look at (some builtins): try calling it
        pass
    return True


def _is_codec(value: Any) -> bool:
    return (
        not isinstance(value, type)
        and callable(getattr(value, "encode", None))
        and callable(getattr(value, "decode", None))
    )


def _not_a_codec(flag: str, spec: str, value: Any) -> str:
    return (
        f"{flag} {spec}: {type(value).__name__} {value!r:.80} is not a payload codec; it "
        "must be an object with encode(value) -> stepstream.Payload and decode(payload) -> "
        "value (stepstream.PayloadCodec), or a class or function of no arguments that "
        "returns one"
    )


# ---- payloads a reader could not decode -------------------------------------------------


def undecoded_payloads(entries: Iterable[HistoryEntry]) -> list[Payload]:
    """The payloads a history view holds as stored (``HistoryEntry.undecoded``): the
    codec that read them could not decode them."""
    found: list[Payload] = []
    for entry in entries:
        for where in entry.undecoded:
            payload = entry.shown_as_stored(where)
            if payload is not None:
                found.append(payload)
    return found


def say_undecoded(
    entries: Iterable[HistoryEntry], codec: PayloadCodec | None, *, by_server: bool
) -> None:
    """On stderr, when some payloads could not be decoded: how many, why (the codec's own
    refusal of the first one: its content type names the codec and, for the AES-GCM
    example, the key id), and what to do."""
    payloads = undecoded_payloads(entries)
    if not payloads:
        return
    reason = _refusal(codec or JsonCodec(), payloads[0])
    if by_server:
        fix = (
            "the engine that served them (stepstream dev or the workers) does not have "
            "the codec that wrote them: start it with --codec MODULE:OBJECT (or "
            "$STEPSTREAM_CODEC)"
        )
    elif codec is None:
        fix = "pass --codec MODULE:OBJECT (or set $STEPSTREAM_CODEC), the codec that wrote them"
    else:
        fix = ""  # the codec's own refusal says what it lacks
    count = len(payloads)
    print(
        f"warning: {count} payload{'s' if count != 1 else ''} shown as stored "
        f"(content_type, base64), not decoded: {reason}{'; ' + fix if fix else ''}",
        file=sys.stderr,
    )


def _refusal(codec: PayloadCodec, payload: Payload) -> str:
    try:
        decode_safely(codec, payload)
    except StepstreamError as exc:
        return str(exc)
    return f"content type {payload.content_type!r}"
