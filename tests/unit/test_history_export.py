"""The history export file (docs/history-export.md): records -> JSON -> the same records."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from stepstream.engine.reads.views import HistoryEntry
from stepstream.engine.wire.codec import JSON, JsonCodec
from stepstream.engine.wire.records import (
    CommandIgnored,
    HistoryRecord,
    MessagesReceived,
    Payload,
    RaceDecided,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    ValueRecorded,
    WaitSatisfied,
    WorkflowCompleted,
    WorkflowStarted,
)
from stepstream.ops.tools.history_export import (
    FORMAT,
    FORMAT_VERSION,
    InvalidHistoryFile,
    from_document,
    read_export,
    records_from_entries,
    to_document,
    write_export,
)
from tests.json_values import json_values

CODEC = JsonCodec()
T0 = 1_700_000_000_000


def sample(instance_id: str = "o-1") -> list[HistoryRecord]:
    def env(seq: int, **more: Any) -> dict[str, Any]:
        return {"instance_id": instance_id, "seq": seq, "time_ms": T0 + seq, "epoch": 3, **more}

    return [
        WorkflowStarted(
            **env(1, command_id="start-1", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
            workflow="order",
            version="2",
            input=CODEC.encode({"card": "4242", "note": "naïve ✓", "n": [1, 2.5, None]}),
        ),
        StepAttemptStarted(**env(2, command_id="start-1"), key="charge", attempt=1, max_attempts=0),
        StepFailedRecord(
            **env(3, command_id="step:o-1/charge/1"),
            key="charge",
            attempt=1,
            error_type="IOError",
            error_message="boom",
            next_attempt_at_ms=T0 + 200,
        ),
        StepSucceeded(
            **env(4, command_id="step:o-1/charge/2"),
            key="charge",
            attempt=2,
            # A codec of its own: kept as bytes.
            result=Payload("application/x-sealed", b"\x00\x01sealed\xff"),
        ),
        WaitSatisfied(
            **env(5, command_id="e-1"),
            key="approval",
            event_name="approval",
            # JSON, but not as the JSON codec writes it (spaces): kept byte for byte.
            payload=Payload(JSON, b'{"by": "ada"}'),
            event_command_id="e-1",
        ),
        ValueRecorded(
            **env(6, command_id="e-1"), key="uuid#1", kind="uuid", value=CODEC.encode("x")
        ),
        RaceDecided(**env(7, command_id="e-1"), key="race", winner="a", losers=["race/b/"]),
        CommandIgnored(**env(8, command_id="c-9"), command_type="ResumeWorkflow", reason="running"),
        WorkflowCompleted(**env(9, command_id="e-1"), result=CODEC.encode({"ok": True})),
    ]


def test_records_survive_the_file_exactly(tmp_path: Path) -> None:
    records = sample()
    path = tmp_path / "o-1.json"
    write_export(path, "o-1", records)
    exported = read_export(path)
    assert exported.records == records
    assert (exported.instance_id, exported.workflow, exported.version) == ("o-1", "order", "2")
    # Reading and writing again gives the same document.
    again = tmp_path / "again.json"
    write_export(again, "o-1", exported.records)
    assert again.read_text() == path.read_text()


def test_the_document_is_readable_json() -> None:
    document = to_document("o-1", sample())
    assert (document["format"], document["format_version"]) == (FORMAT, FORMAT_VERSION)
    started, *_, sealed, odd_json, _, _, _, _ = document["records"]
    assert started["type"] == "WorkflowStarted" and started["seq"] == 1
    assert started["traceparent"].startswith("00-")
    assert started["attributes"]["input"] == {
        "content_type": JSON,
        "json": {"card": "4242", "note": "naïve ✓", "n": [1, 2.5, None]},
    }
    assert "traceparent" not in document["records"][1]
    assert sealed["attributes"]["result"] == {
        "content_type": "application/x-sealed",
        "base64": "AAFzZWFsZWT/",
    }
    assert "base64" in odd_json["attributes"]["payload"]


@settings(max_examples=200, deadline=None)
@given(json_values())
def test_any_json_payload_round_trips_byte_for_byte(value: Any) -> None:
    payload = CODEC.encode(value)
    record = WorkflowCompleted(instance_id="i", seq=2, time_ms=T0, result=payload)
    document = json.loads(json.dumps(to_document("i", [record]), ensure_ascii=False))
    (back,) = from_document(document).records
    assert back == record


def test_records_rebuilt_from_a_clients_view_are_the_records_but_epoch_and_trace() -> None:
    records = sample()
    # What the API serves: payloads decoded by the server's codec, as JSON.
    entries = [HistoryEntry.from_json(HistoryEntry.of(r, CODEC).to_json()) for r in records]
    rebuilt = records_from_entries("o-1", entries)
    assert len(rebuilt) == len(records)
    for got, want in zip(rebuilt, records, strict=True):
        assert type(got) is type(want)
        assert (got.epoch, got.traceparent) == (0, None)  # the view does not show them
        for name in want.__dataclass_fields__:
            if name in ("epoch", "traceparent", "tracestate"):
                continue
            mine, theirs = getattr(got, name), getattr(want, name)
            if theirs == Payload(JSON, b'{"by": "ada"}'):
                # JSON not written by the JSON codec: the same value, the codec's bytes.
                assert mine == CODEC.encode({"by": "ada"})
            else:
                assert mine == theirs, name


def test_messages_a_wait_took_survive_the_file_and_a_clients_view() -> None:
    """A ``ctx.messages`` wait's record keeps its payloads in two lists (content types,
    bytes); the API shows them as one decoded list. Both ways back give the record."""
    taken = MessagesReceived(
        instance_id="d-1",
        seq=4,
        time_ms=T0,
        key="stories",
        ids=["m-1", "m-2"],
        names=["story", "story"],
        content_types=[JSON, JSON],
        data=[CODEC.encode("rain").data, CODEC.encode({"n": 2}).data],
        sent_ms=[T0 - 2, T0 - 1],
    )
    document = json.loads(json.dumps(to_document("d-1", [taken])))
    assert from_document(document).records == [taken]
    entry = HistoryEntry.from_json(HistoryEntry.of(taken, CODEC).to_json())
    assert entry.attributes["payloads"] == ["rain", {"n": 2}]
    assert records_from_entries("d-1", [entry]) == [replace(taken, epoch=0)]


def test_an_undecodable_payload_in_a_view_is_kept_as_bytes() -> None:
    record = sample()[3]  # the sealed result
    entry = HistoryEntry.of(record, CODEC)
    (rebuilt,) = records_from_entries("o-1", [entry])
    assert isinstance(rebuilt, StepSucceeded) and rebuilt.result == record.result


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "is not JSON"),
        ('{"records": []}', "is not a stepstream history export"),
        (json.dumps({"format": FORMAT, "format_version": 99}), "format_version 99"),
        (
            json.dumps(
                {
                    "format": FORMAT,
                    "format_version": 1,
                    "instance_id": "i",
                    "records": [{"type": "Nope", "seq": 1}],
                }
            ),
            "unknown record type 'Nope'",
        ),
        (
            json.dumps(
                {
                    "format": FORMAT,
                    "format_version": 1,
                    "instance_id": "i",
                    "records": [{"type": "WorkflowPaused"}],
                }
            ),
            "record 0 cannot be read",
        ),
    ],
)
def test_a_bad_file_says_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidHistoryFile, match=says):
        read_export(path)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(InvalidHistoryFile, match="cannot read history file"):
        read_export(tmp_path / "nope.json")


def test_a_null_payload_in_a_view_is_json_null_not_a_missing_payload() -> None:
    record = WorkflowStarted(
        instance_id="n", seq=1, time_ms=T0, workflow="w", version="1", input=CODEC.encode(None)
    )
    (rebuilt,) = records_from_entries("n", [HistoryEntry.of(record, CODEC)])
    assert rebuilt == record


def _damaged(record: int, change: Any) -> dict[str, Any]:
    """The sample's export document with ``change(raw)`` applied to one record."""
    document = to_document("o-1", sample())
    change(document["records"][record])
    return document


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda r: r.update(attributes=[]), "attributes must be a JSON object"),
        (lambda r: r.update(attributes=None), "attributes must be a JSON object"),
        (lambda r: r.update(epoch="x"), "attribute epoch='x'"),
        (lambda r: r.update(seq=None), "attribute seq=None"),
        (lambda r: r["attributes"].update(workflow=5), "attribute workflow=5"),
    ],
)
def test_a_record_the_engine_could_not_have_written_is_refused_naming_its_field(
    tmp_path: Path, change: Any, says: str
) -> None:
    """What a replay would trip over later (a field of the wrong type) is refused when
    the file is read, with the record's number and the field."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_damaged(0, change)))
    with pytest.raises(InvalidHistoryFile, match=f"record 0 cannot be read.*{re.escape(says)}"):
        read_export(path)


def test_a_file_that_is_not_text_or_of_another_format_version_says_so(tmp_path: Path) -> None:
    path = tmp_path / "packed.json"
    path.write_bytes(b"\x1f\x8b\x08\x00 not text")
    with pytest.raises(InvalidHistoryFile, match="is not UTF-8 text"):
        read_export(path)
    document = to_document("o-1", sample())
    with pytest.raises(InvalidHistoryFile, match="format_version True"):
        from_document({**document, "format_version": True})
    with pytest.raises(InvalidHistoryFile, match="record 1 cannot be read"):
        from_document({**document, "records": [document["records"][0], 7]})
