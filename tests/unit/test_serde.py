"""Avro single-object encoding of every record type: round trips, the wire header, reading
with fastavro alone, rejection of bad bytes, and schema evolution across versions."""

from __future__ import annotations

import io
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import expand_schema, to_parsing_canonical_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.wire.records import (
    ALL_TYPES,
    AttributesSet,
    CallRemoved,
    CancelWorkflow,
    ChildStarted,
    CommandIgnored,
    DeadLetter,
    EventBuffered,
    ForkWorkflow,
    InstanceForgotten,
    LoopAdvanced,
    MessageCompleted,
    MessageSent,
    MessagesReceived,
    MessageWaitStarted,
    PartitionFenced,
    PauseWorkflow,
    Payload,
    RaceDecided,
    Record,
    ResetWorkflow,
    ResumeWorkflow,
    RetryWorkflow,
    SendEvent,
    SleepElapsed,
    SleepStarted,
    SnapshotTaken,
    StartFork,
    StartWorkflow,
    StateChunk,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    TerminateWorkflow,
    TimerCancelled,
    TimerFired,
    TimerScheduled,
    ValueRecorded,
    WaitSatisfied,
    WaitStarted,
    WaitTimedOut,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowForked,
    WorkflowPaused,
    WorkflowReset,
    WorkflowRestarted,
    WorkflowResumed,
    WorkflowStarted,
    WorkflowTerminatedRecord,
    WorkflowTimeoutSet,
)
from stepstream.engine.wire.serde import CLUSTER_DOMAINS, RecordSerde, default_serde
from stepstream.schemas import schema_root

ROOT = schema_root()
V2 = Path(__file__).parent / "fixtures" / "schemas_v2"
T0 = 1_763_780_000_000
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
JSON = "application/json"
ENVELOPE = {f.name for f in fields(Record)}


def env(seq: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "instance_id": "order-7f3a",
        "seq": seq,
        "time_ms": T0 + seq,
        "command_id": "2b8e4c1e-95d4-4f4e-9d0b-8d0f2f0c5a11",
        "epoch": 3,
        "traceparent": TRACE,
        **extra,
    }


def pl(text: str) -> Payload:
    return Payload(JSON, text.encode())


SAMPLES: list[Record] = [
    StartWorkflow(
        **env(0, tracestate="vendor=abc"), workflow="checkout", version="v2", input=pl('{"a":1}')
    ),
    StartWorkflow(**env(0), workflow="checkout", input=pl("null")),
    SendEvent(**env(0), name="payment-confirmed", payload=pl('{"amount":1299}')),
    CancelWorkflow(**env(0), reason="customer asked"),
    PauseWorkflow(**env(0)),
    ResumeWorkflow(**env(0, traceparent=None)),
    TimerFired(**env(0), timer_id="order-7f3a/sleep/4/nap", fire_at_ms=T0 + 60_000),
    WorkflowStarted(**env(1), workflow="checkout", version="v2", input=pl("{}")),
    StepAttemptStarted(**env(2), key="charge", attempt=1, max_attempts=5, deadline_ms=T0 + 30_000),
    StepAttemptStarted(**env(3), key="charge", attempt=2, max_attempts=5),
    StepSucceeded(**env(4), key="charge", attempt=2, result=pl('{"receipt":"r-1"}')),
    StepFailedRecord(
        **env(5),
        key="ship",
        attempt=1,
        error_type="ConnectionError",
        error_message="carrier API unreachable",
        next_attempt_at_ms=T0 + 2_000,
    ),
    StepFailedRecord(
        **env(6), key="ship", attempt=5, error_type="ValueError", error_message="bad zip"
    ),
    SleepStarted(**env(7), key="nap", wake_at_ms=T0 + 86_400_000),
    SleepElapsed(**env(8), key="nap"),
    WaitStarted(**env(9), key="approval", event_name="approved", timeout_at_ms=T0 + 3_600_000),
    WaitStarted(**env(10), key="approval2", event_name="approved"),
    WaitSatisfied(
        **env(11),
        key="approval",
        event_name="approved",
        payload=pl('{"by":"ana"}'),
        event_command_id="c-9",
    ),
    WaitTimedOut(**env(12), key="approval2"),
    EventBuffered(**env(13), event_name="note", payload=Payload("application/octet-stream", b"")),
    ValueRecorded(**env(14), key="now#1", kind="now", value=pl(str(T0))),
    RaceDecided(**env(14), key="race", winner="paid", losers=["race/late/", "race/busy/"]),
    LoopAdvanced(**env(14), key="poll", iteration=7, state=pl('{"seen":3}'), keep=10),
    ChildStarted(**env(14), key="ship", workflow="ship", child_id="o-1/ship", input=pl("{}")),
    MessageWaitStarted(**env(15), key="line", names=["line", "stop"], max=10, timeout_at_ms=T0),
    MessagesReceived(
        **env(15),
        key="line",
        ids=["c-1", "c-2"],
        names=["line", "stop"],
        content_types=["application/json", "application/json"],
        data=[b'{"n":1}', b"null"],
        sent_ms=[T0, T0 + 5],
    ),
    MessageSent(**env(15), key="send", target="o-2", name="note", payload=pl('"hi"')),
    MessageCompleted(**env(15), message_id="c-1", result=pl('{"ok":true}')),
    WorkflowPaused(**env(15)),
    WorkflowResumed(**env(16)),
    WorkflowCompleted(**env(17), result=pl('{"ok":true,"name":"Zoë ✓"}')),
    WorkflowFailedRecord(**env(17), error_type="StepFailed", error_message="step 'ship' failed"),
    WorkflowCancelledRecord(**env(17), reason=""),
    CommandIgnored(**env(18), command_type="ResumeWorkflow", reason="instance is running"),
    PartitionFenced(**env(0, instance_id="", command_id="fence:4", epoch=4), partition=11),
    TimerScheduled(**env(7), timer_id="order-7f3a/sleep/7/nap", fire_at_ms=T0, purpose="sleep"),
    TimerCancelled(**env(12), timer_id="order-7f3a/wait/10/approval2"),
    DeadLetter(
        **env(0, instance_id="order-7f3a"),
        source_topic="stepstream.commands",
        partition=2,
        offset=123_456_789_012,
        key=b"order-7f3a",
        value=b"\x00\xffnot avro",
        reason="undecodable record: ...",
    ),
    InstanceForgotten(**env(12), finished_ms=1_795_312_000_456),
    StateChunk(
        **env(0, instance_id=""),
        snapshot_id="p3-1795312000123",
        index=2,
        previous_offset=17,
        keys=[b"m\x00order-7f3a", b"e\x00order-7f3a\x00charge", b""],
        values=[b'{"w":"order"}', b"", b"\x00\xff"],
    ),
    SnapshotTaken(
        **env(0, instance_id=""),
        snapshot_id="p3-1795312000123",
        partition=3,
        first_offset=40,
        chunks=3,
        entries=2_000,
        history_offset=123_456,
        history_tail=0xFFFFFFFF,
        commands_offset=7_890,
        timers_offset=456,
    ),
    ResetWorkflow(**env(0), to="charge#2", reason="card fixed"),
    RetryWorkflow(**env(0)),
    ForkWorkflow(**env(0), to="charge#2", new_id="order-7f3a-b"),
    StartFork(**env(0), source_id="order-7f3a", to="charge#2", records=[b"\xc3\x01abc"]),
    WorkflowReset(**env(21), to="charge#2", from_seq=5, reason="card fixed", retry=False),
    WorkflowForked(**env(5), source_id="order-7f3a", to="charge#2", from_seq=5),
    StartWorkflow(**env(0), workflow="checkout", input=pl("1"), if_exists="restart_if_failed"),
    TerminateWorkflow(**env(0), reason="stuck on a dead supplier"),
    WorkflowTerminatedRecord(**env(17), reason="stuck"),
    WorkflowTimeoutSet(**env(2), timeout_at_ms=T0 + 7 * 86_400_000),
    WorkflowRestarted(**env(19), run=2, previous_status="failed"),
    AttributesSet(
        **env(6),
        key="attributes#1",
        attributes={"customer": "42", "amount": 25.0, "items": 3, "vip": True, "old": None},
    ),
    CallRemoved(**env(8), key="audit"),
]

# CRC-64-AVRO of the schema each record type is written with. A change here means a
# released schema was edited (records already on the topics would no longer decode) or a
# new version was added: then its older fingerprint goes to OLDER_FINGERPRINTS.
RELEASED_FINGERPRINTS = {
    "StartWorkflow": 0xAA961E12158457F2,  # v3 (priority, queue_key)
    "SendEvent": 0xDF93966B91E95BD6,
    "CancelWorkflow": 0x67507C0717C05534,
    "PauseWorkflow": 0xF5C9E883908E6DFA,
    "ResumeWorkflow": 0x90EBAF673A12714D,
    "TimerFired": 0xF0EA7C601BD750C2,
    "WorkflowStarted": 0xB7AA8E4164A8AC18,  # v2: priority, queue_key
    "StepAttemptStarted": 0x44A09FFFD6C426F9,
    "StepSucceeded": 0xD1FA5079AD23317B,
    "StepFailed": 0x6DC6D236DBD60821,
    "SleepStarted": 0x36AC2F871277A115,
    "SleepElapsed": 0x7EB644C35155BFB1,
    "WaitStarted": 0xEF693B9D631EF672,
    "WaitSatisfied": 0x478C2237437A9BF5,
    "WaitTimedOut": 0x7C5DCDF955CEA3E3,
    "EventBuffered": 0x07859BE56224BEED,
    "ValueRecorded": 0x0A718C0E09799E85,
    "RaceDecided": 0xC68F842E324D03CF,
    "MessageWaitStarted": 0xAFEEC5F5B386A014,
    "MessagesReceived": 0xB82A33DC095CD221,
    "MessageSent": 0x659CC8BD663E4209,
    "MessageCompleted": 0xE28139E3C634EB7C,
    "ChildStarted": 0x233C1FD2A294688D,
    "LoopAdvanced": 0xED02B388961365D9,
    "WorkflowPaused": 0xB3B46E1326F4E289,
    "WorkflowResumed": 0x0583DC6A6145B1E9,
    "WorkflowCompleted": 0x2A10E4A3CCB962DB,
    "WorkflowFailed": 0x440B00E9C26AF6F6,
    "WorkflowCancelled": 0xE0B8D35159E48AAF,
    "CommandIgnored": 0x86EC1ADBBC01BD16,
    "PartitionFenced": 0x093A9B81DAC9A2BD,
    "TimerScheduled": 0xB4AE2FC2C4B99D4A,
    "TimerCancelled": 0x7D2D600A77336189,
    "InstanceForgotten": 0xDC666A14987A6A01,
    "DeadLetter": 0x7957B60467690570,
    "StateChunk": 0x0FE98AA0F413F858,
    "SnapshotTaken": 0xA785D6253084131F,
    "ResetWorkflow": 0xC24D81FC150CCF3D,
    "RetryWorkflow": 0x37986EE9824BF9F6,
    "ForkWorkflow": 0x0F65679B6531EAE3,
    "StartFork": 0x44BEAB10A90F91E3,
    "WorkflowReset": 0x7B15A6FF2A74876F,
    "WorkflowForked": 0xA511583C0942133A,
    "TerminateWorkflow": 0x6198398C37021FFE,
    "WorkflowTerminated": 0x57C726EFE283EAF9,
    "WorkflowTimeoutSet": 0x536E56028E32FA5E,
    "WorkflowRestarted": 0x114BCDF3671A8B34,
    "AttributesSet": 0x8789D377EC0AB2C9,
    "CallRemoved": 0xDC6776F06A0FD6AF,
}
# Released versions that a newer one replaced for writing; records of them still decode.
OLDER_FINGERPRINTS = {
    "StartWorkflow v1": 0x1FF2187003F97F90,
    "StartWorkflow v2": 0xAFF10D7732366A21,
    "WorkflowStarted v1": 0x8E783271B0CCB3DA,
    "StepFailed v1": 0xB6A4BD9DA433C091,
    "WorkflowFailed v1": 0x5F30228D4DFFB81F,
}


@pytest.fixture(params=[True, False], ids=["compiled", "fastavro"], scope="module")
def serde(request: pytest.FixtureRequest) -> RecordSerde:
    return RecordSerde(compiled=request.param)


def sample_id(record: Record) -> str:
    return f"{record.type}-{record.seq}"


# ---- independent oracles: the spec's CRC-64-AVRO and fastavro fed the .avsc files only ----


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO exactly as the Avro specification gives it."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def plain_fastavro_schemas() -> dict[str, Any]:
    """Every record schema, parsed by fastavro from the files alone and expanded."""
    named: dict[str, Any] = {}
    out = {}
    for path in sorted(ROOT.rglob("*.avsc"), key=lambda p: p.parts[-3] != "common"):
        parsed = fastavro.parse_schema(json.loads(path.read_text()), named)
        if path.parts[-3] != "common":
            out[path.stem] = expand_schema(parsed)
    return out


PLAIN = plain_fastavro_schemas()


def as_avro_dict(record: Record) -> dict[str, Any]:
    def value(v: Any) -> Any:
        return {"content_type": v.content_type, "data": v.data} if isinstance(v, Payload) else v

    own = {f.name: value(getattr(record, f.name)) for f in fields(record) if f.name not in ENVELOPE}
    return {"header": {name: getattr(record, name) for name in ENVELOPE}, **own}


def test_crc64_oracle_matches_the_avro_published_vectors() -> None:
    def signed(v: int) -> int:
        return v - (1 << 64) if v >> 63 else v

    assert signed(crc64_avro(b'"null"')) == 7195948357588979594
    assert signed(crc64_avro(b'"int"')) == 8247732601305521295
    assert signed(crc64_avro(b'"long"')) == -3434872931120570953
    assert signed(crc64_avro(b'"string"')) == -8142146995180207161
    record = b'{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}'
    assert signed(crc64_avro(record)) == 7843277075252814651


# ---- the schema files ---------------------------------------------------------------------


def test_every_record_type_has_one_documented_schema_file() -> None:
    files = sorted(ROOT.rglob("*.avsc"))
    records = [p for p in files if p.parts[-3] not in ("common", *CLUSTER_DOMAINS)]
    assert {p.stem for p in records} == {cls.type_name for cls in ALL_TYPES}
    # The cluster topics' records (members, definitions) describe workers: no envelope.
    assert {p.stem for p in files if p.parts[-3] in CLUSTER_DOMAINS} == {
        "MemberAnnounced",
        "WorkflowRegistered",
    }
    for path in files:
        schema = json.loads(path.read_text())
        domain, version = path.parts[-3], path.parts[-2]
        assert schema["namespace"] == f"stepstream.{domain}.{version}", path
        assert schema["name"] == path.stem, path
        assert schema.get("doc"), f"{path}: record has no doc"
        for field in schema["fields"]:
            assert field.get("doc"), f"{path}: field {field['name']} has no doc"
        if domain not in ("common", *CLUSTER_DOMAINS):
            assert schema["fields"][0] == {
                "name": "header",
                "type": "stepstream.common.v1.Envelope",
                "doc": schema["fields"][0]["doc"],
            }, path


def test_released_schemas_keep_their_fingerprints() -> None:
    serde = default_serde()
    assert {cls.type_name: serde.fingerprint(cls) for cls in ALL_TYPES} == RELEASED_FINGERPRINTS
    assert set(OLDER_FINGERPRINTS.values()) <= set(serde.writer_schemas())


def test_failures_written_with_v1_read_without_a_traceback() -> None:
    """StepFailed and WorkflowFailed v2 add ``traceback``: a v1 record (as any Avro
    writer made it before) reads with None there."""
    serde = default_serde()
    schemas = serde.writer_schemas()
    records: list[StepFailedRecord | WorkflowFailedRecord] = [
        StepFailedRecord(**env(3), key="pay", attempt=2, error_type="E", error_message="no"),
        WorkflowFailedRecord(**env(4), error_type="E", error_message="no"),
    ]
    for record in records:
        with_trace = replace(record, traceback="Traceback (most recent call last):\n  ...")
        new = serde.encode(with_trace)
        assert serde.decode(new) == with_trace
        # The same record as a v1 writer wrote it: no traceback field at all.
        v2 = fastavro.parse_schema(schemas[int.from_bytes(new[2:10], "little")])
        raw = fastavro.schemaless_reader(io.BytesIO(new[10:]), v2, None)
        assert isinstance(raw, dict) and raw.pop("traceback").startswith("Traceback")
        fingerprint = OLDER_FINGERPRINTS[f"{record.type_name} v1"]
        body = io.BytesIO()
        fastavro.schemaless_writer(body, fastavro.parse_schema(schemas[fingerprint]), raw)
        old = b"\xc3\x01" + fingerprint.to_bytes(8, "little") + body.getvalue()
        assert serde.decode(old) == record and record.traceback is None


def test_samples_cover_every_record_type() -> None:
    assert {type(r) for r in SAMPLES} == set(ALL_TYPES)


# ---- round trips and the wire format ------------------------------------------------------


@pytest.mark.parametrize("record", SAMPLES, ids=sample_id)
def test_round_trip(serde: RecordSerde, record: Record) -> None:
    data = serde.encode(record)
    decoded = serde.decode(data)
    assert type(decoded) is type(record)
    assert decoded == record


@pytest.mark.parametrize("record", SAMPLES, ids=sample_id)
def test_header_is_marker_and_little_endian_crc64_of_the_canonical_form(
    serde: RecordSerde, record: Record
) -> None:
    canonical = to_parsing_canonical_form(PLAIN[record.type])
    assert '"stepstream.common.v1.Envelope"' in canonical  # full names, types inlined
    expected = crc64_avro(canonical.encode())
    data = serde.encode(record)
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == expected.to_bytes(8, "little")
    assert serde.fingerprint(type(record)) == expected


@pytest.mark.parametrize("record", SAMPLES, ids=sample_id)
def test_body_is_what_plain_fastavro_writes_and_reads(serde: RecordSerde, record: Record) -> None:
    schema = PLAIN[record.type]
    data = serde.encode(record)
    expected = io.BytesIO()
    fastavro.schemaless_writer(expected, schema, as_avro_dict(record))
    assert data[10:] == expected.getvalue()
    assert fastavro.schemaless_reader(io.BytesIO(data[10:]), schema, None) == as_avro_dict(record)


def test_readme_snippet_decodes_with_fastavro_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet is not None
    monkeypatch.chdir(ROOT.parent)
    namespace: dict[str, Any] = {}
    exec(snippet.group(1), namespace)
    for record in SAMPLES:
        assert namespace["decode"](default_serde().encode(record)) == as_avro_dict(record)


def test_writer_schemas_are_standalone_for_plain_consumers() -> None:
    serde = default_serde()
    record = SAMPLES[10]
    data = serde.encode(record)
    schema = serde.writer_schemas()[int.from_bytes(data[2:10], "little")]
    assert schema == serde.schema(StepSucceeded)
    parsed = fastavro.parse_schema(schema)
    assert fastavro.schemaless_reader(io.BytesIO(data[10:]), parsed, None) == as_avro_dict(record)
    schema["fields"].clear()  # a copy: callers cannot corrupt the serde
    assert serde.decode(data) == record


def test_compiled_and_fastavro_paths_write_identical_bytes() -> None:
    compiled, generic = RecordSerde(), RecordSerde(compiled=False)
    for record in SAMPLES:
        assert compiled.encode(record) == generic.encode(record), record.type


def test_default_serde_is_built_once() -> None:
    assert default_serde() is default_serde()


def test_decode_accepts_bytes_like_values() -> None:
    data = default_serde().encode(SAMPLES[10])
    assert default_serde().decode(memoryview(data)) == SAMPLES[10]  # type: ignore[arg-type]
    decoded = default_serde().decode(bytearray(data))  # type: ignore[arg-type]
    assert isinstance(decoded, StepSucceeded) and type(decoded.result.data) is bytes


# ---- property tests -------------------------------------------------------------------------

longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)
texts = st.text(max_size=300)
payloads = st.builds(Payload, content_type=texts, data=st.binary(max_size=2_000))
envelopes = {
    "instance_id": texts,
    "seq": longs,
    "time_ms": longs,
    "command_id": texts,
    "epoch": longs,
    "traceparent": st.none() | texts,
    "tracestate": st.none() | texts,
}
arbitrary_records = st.one_of(
    st.builds(StepSucceeded, **envelopes, key=texts, attempt=longs, result=payloads),
    st.builds(
        StartWorkflow,
        **envelopes,
        workflow=texts,
        version=st.none() | texts,
        input=payloads,
    ),
    st.builds(
        StepFailedRecord,
        **envelopes,
        key=texts,
        attempt=longs,
        error_type=texts,
        error_message=texts,
        next_attempt_at_ms=st.none() | longs,
    ),
    st.builds(
        DeadLetter,
        **envelopes,
        source_topic=texts,
        partition=longs,
        offset=longs,
        key=st.binary(),
        value=st.binary(),
        reason=texts,
    ),
)
COMPILED, GENERIC = RecordSerde(), RecordSerde(compiled=False)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(arbitrary_records)
def test_arbitrary_values_round_trip_and_match_plain_fastavro(record: Record) -> None:
    data = COMPILED.encode(record)
    assert COMPILED.decode(data) == record
    assert GENERIC.encode(record) == data
    assert GENERIC.decode(data) == record
    expected = io.BytesIO()
    fastavro.schemaless_writer(expected, PLAIN[record.type], as_avro_dict(record))
    assert data[10:] == expected.getvalue()


@settings(max_examples=500)
@given(st.sampled_from(SAMPLES), st.data())
def test_corrupted_bytes_raise_undecodable_or_decode_like_fastavro(
    record: Record, data: st.DataObject
) -> None:
    """Differential fuzzing: whatever is after a valid header, the compiled reader either
    raises UndecodableRecord or returns what fastavro reads from the same bytes."""
    good = bytearray(COMPILED.encode(record))
    mutation = data.draw(st.sampled_from(["flip", "truncate", "append", "replace"]))
    if mutation == "flip":
        at = data.draw(st.integers(10, len(good) - 1))
        good[at] ^= data.draw(st.integers(1, 255))
    elif mutation == "truncate":
        del good[data.draw(st.integers(10, len(good) - 1)) :]
    elif mutation == "append":
        good += data.draw(st.binary(min_size=1, max_size=20))
    else:
        good[10:] = data.draw(st.binary(max_size=300))
    bad = bytes(good)
    outcomes: list[Record | None] = []
    for serde in (COMPILED, GENERIC):
        try:
            outcomes.append(serde.decode(bad))
        except UndecodableRecord as exc:
            assert record.type in str(exc)
            outcomes.append(None)
    if outcomes[0] is not None:
        assert outcomes[0] == outcomes[1]


# ---- rejection ----------------------------------------------------------------------------


def undecodable(serde: RecordSerde, data: Any) -> str:
    with pytest.raises(UndecodableRecord) as caught:
        serde.decode(data)
    return str(caught.value)


def test_short_and_foreign_bytes_are_rejected_with_the_reason(serde: RecordSerde) -> None:
    assert "shorter than the 10-byte Avro single-object header" in undecodable(serde, b"")
    assert "shorter" in undecodable(serde, b"\xc3\x01\x00")
    message = undecodable(serde, b'{"instance_id": "order-1", "type": "StartWorkflow"}')
    assert "not the Avro single-object marker c3 01" in message
    assert "7b 22" in message
    assert "expected bytes, got str" in undecodable(serde, "c3 01")


def test_unknown_fingerprint_says_a_newer_writer_may_have_written_it(serde: RecordSerde) -> None:
    data = b"\xc3\x01" + (0x0123456789ABCDEF).to_bytes(8, "little") + b"\x02"
    message = undecodable(serde, data)
    assert "unknown schema fingerprint 0x0123456789abcdef" in message
    assert "newer stepstream" in message


@pytest.mark.parametrize("record", SAMPLES[9:12], ids=sample_id)
def test_every_truncation_is_rejected(serde: RecordSerde, record: Record) -> None:
    data = serde.encode(record)
    for cut in range(10, len(data)):
        message = undecodable(serde, data[:cut])
        assert f"{record.type} record written with stepstream." in message
        assert "truncated" in message, (cut, message)


def test_trailing_bytes_are_rejected(serde: RecordSerde) -> None:
    message = undecodable(serde, serde.encode(SAMPLES[10]) + b"\x00\x01")
    assert "2 bytes left over after the record" in message


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        # instance_id: length 2, then an invalid UTF-8 sequence
        (b"\x04\xff\xfe", "UTF-8"),
        # instance_id: negative length
        (b"\x03", "-2"),
        # instance_id "", seq: an 11-byte varint
        (b"\x00" + b"\xff" * 10 + b"\x01", ""),
    ],
)
def test_corrupt_bodies_are_rejected(serde: RecordSerde, body: bytes, reason: str) -> None:
    header = serde.encode(SAMPLES[10])[:10]
    message = undecodable(serde, header + body + b"\x00" * 40)
    assert "StepSucceeded record written with stepstream.history.v1.StepSucceeded" in message
    assert reason in message


@pytest.mark.parametrize(
    ("seq", "reason"),
    [
        (b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\xff" * 9 + b"\x7f", "exceeds 64 bits"),
    ],
)
def test_compiled_reader_rejects_varints_beyond_64_bits(seq: bytes, reason: str) -> None:
    # fastavro's reader wraps these silently; the compiled reader (the latest version's
    # path) refuses them.
    good = COMPILED.encode(StepSucceeded(instance_id="", key="k", attempt=1, result=pl("1")))
    assert good[11] == 0  # seq 0 after instance_id ""
    assert reason in undecodable(COMPILED, good[:11] + seq + good[12:])


def test_bad_union_branch_is_rejected(serde: RecordSerde) -> None:
    good = serde.encode(StepSucceeded(instance_id="", key="k", attempt=1, result=pl("1")))
    traceparent_at = 10 + 5  # instance_id "", seq 0, time_ms 0, command_id "", epoch 0
    assert good[traceparent_at] == 0
    bad = good[:traceparent_at] + b"\x08" + good[traceparent_at + 1 :]
    assert "union" in undecodable(serde, bad).lower()


def test_encode_rejects_values_the_schema_cannot_hold(serde: RecordSerde) -> None:
    with pytest.raises(ValueError, match="seq"):
        serde.encode(StepSucceeded(instance_id="i", seq="7", key="k", attempt=1, result=pl("1")))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"StepSucceeded of instance 'i'.*key"):
        serde.encode(StepSucceeded(instance_id="i", key=5, attempt=1, result=pl("1")))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time_ms"):
        serde.encode(TimerFired(instance_id="i", time_ms=2**64, timer_id="t", fire_at_ms=0))
    with pytest.raises(TypeError, match="not a record type"):
        serde.encode(pl("1"))  # type: ignore[arg-type]


# ---- schema evolution ---------------------------------------------------------------------


def evolution_serdes(compiled: bool) -> tuple[RecordSerde, RecordSerde, RecordSerde]:
    """(v1 only, v2 as latest, v1 reader that knows the v2 writer schemas)."""
    return (
        RecordSerde(compiled=compiled),
        RecordSerde([V2], compiled=compiled),
        RecordSerde(writer_roots=[V2], compiled=compiled),
    )


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
def test_v2_reader_reads_v1_writer_filling_the_default(compiled: bool) -> None:
    v1, v2, _ = evolution_serdes(compiled)
    record = SAMPLES[10]
    old = v1.encode(record)
    assert v2.decode(old) == record  # duration_ms is not on the class: dropped
    # The default is really filled in: what a plain fastavro v2 reader sees.
    writer = fastavro.parse_schema(v1.schema(StepSucceeded))
    reader = fastavro.parse_schema(v2.schema(StepSucceeded))
    seen: Any = fastavro.schemaless_reader(io.BytesIO(old[10:]), writer, reader)
    assert seen["duration_ms"] == -1 and seen["key"] == "charge"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
def test_v2_serde_writes_v2_with_defaults_for_fields_the_class_lacks(compiled: bool) -> None:
    v1, v2, _ = evolution_serdes(compiled)
    record = SAMPLES[10]
    new = v2.encode(record)
    assert new[2:10] != v1.encode(record)[2:10]
    assert v2.schema(StepSucceeded)["namespace"] == "stepstream.history.v2"
    assert v2.decode(new) == record
    parsed = fastavro.parse_schema(v2.schema(StepSucceeded))
    seen: Any = fastavro.schemaless_reader(io.BytesIO(new[10:]), parsed, None)
    assert seen["duration_ms"] == -1


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
def test_v1_reader_that_knows_the_v2_writer_ignores_the_new_field(compiled: bool) -> None:
    v1, v2, v1_knowing_v2 = evolution_serdes(compiled)
    record = SAMPLES[10]
    # A newer writer that sets the field (the v1 class cannot): plain fastavro with v2.
    body = io.BytesIO()
    fastavro.schemaless_writer(
        body,
        fastavro.parse_schema(v2.schema(StepSucceeded)),
        {**as_avro_dict(record), "duration_ms": 1234},
    )
    new = v2.encode(record)[:10] + body.getvalue()
    assert v1_knowing_v2.decode(new) == record
    assert v1_knowing_v2.encode(record) == v1.encode(record)  # still writes v1
    assert "unknown schema fingerprint" in undecodable(v1, new)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
@pytest.mark.parametrize("version", ["2025.11", None])
def test_added_union_branch_reads_old_writers(compiled: bool, version: str | None) -> None:
    v1, v2, v1_knowing_v2 = evolution_serdes(compiled)
    assert v2.schema(StartWorkflow)["fields"][2]["type"] == ["null", "string", "long"]
    assert v2.schema(StartWorkflow)["namespace"] == "stepstream.commands.v4"
    record = StartWorkflow(**env(0), workflow="checkout", version=version, input=pl("{}"))
    assert v2.decode(v1.encode(record)) == record
    assert v1_knowing_v2.decode(v2.encode(record)) == record
    assert v2.decode(v2.encode(record)) == record


def test_a_v1_start_reads_as_if_exists_return(serde: RecordSerde) -> None:
    """Producers that write the v1 StartWorkflow (wire-contract.md) keep working: the
    field v2 added reads as its default."""
    named: dict[str, Any] = {}
    for common in sorted((ROOT / "stepstream/common/v1").glob("*.avsc"), reverse=True):
        fastavro.parse_schema(json.loads(common.read_text()), named)  # Payload first
    v1 = fastavro.parse_schema(
        json.loads((ROOT / "stepstream/commands/v1/StartWorkflow.avsc").read_text()), named
    )
    body = io.BytesIO()
    fastavro.schemaless_writer(
        body,
        v1,
        {
            "header": {**env(0), "tracestate": None},
            "workflow": "checkout",
            "version": None,
            "input": {"content_type": JSON, "data": b"{}"},
        },
    )
    value = b"\xc3\x01" + (0x1FF2187003F97F90).to_bytes(8, "little") + body.getvalue()
    record = serde.decode(value)
    assert isinstance(record, StartWorkflow)
    assert (record.workflow, record.if_exists) == ("checkout", "return")


# ---- schema trees that must be refused ------------------------------------------------------


def tree(tmp_path: Path, relative: str, schema: dict[str, Any]) -> Path:
    path = tmp_path / relative
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(schema))
    return tmp_path


def v2_of(name: str, edit: Callable[[list[dict[str, Any]]], object]) -> dict[str, Any]:
    schema = json.loads((ROOT / f"stepstream/history/v1/{name}.avsc").read_text())
    schema["namespace"] = "stepstream.history.v2"
    edit(schema["fields"])
    return dict(schema)


def test_latest_schema_missing_a_class_attribute_is_refused(tmp_path: Path) -> None:
    schema = v2_of("StepSucceeded", lambda fs: fs.pop(2))  # drops "attempt"
    root = tree(tmp_path, "stepstream/history/v2/StepSucceeded.avsc", schema)
    with pytest.raises(ValueError, match=r"\['attempt'\] have no field"):
        RecordSerde([root])
    RecordSerde(writer_roots=[root])  # as a writer schema only, it is fine


def test_latest_schema_with_a_required_unknown_field_is_refused(tmp_path: Path) -> None:
    schema = v2_of("StepSucceeded", lambda fs: fs.append({"name": "x", "type": "long"}))
    root = tree(tmp_path, "stepstream/history/v2/StepSucceeded.avsc", schema)
    with pytest.raises(ValueError, match="'x' has no default"):
        RecordSerde([root])


def test_edited_released_schema_is_refused(tmp_path: Path) -> None:
    schema = json.loads((ROOT / "stepstream/history/v1/StepSucceeded.avsc").read_text())
    schema["fields"][1]["type"] = "bytes"
    root = tree(tmp_path, "stepstream/history/v1/StepSucceeded.avsc", schema)
    with pytest.raises(ValueError, match="differently"):
        RecordSerde([root])


def test_misplaced_schema_files_are_refused(tmp_path: Path) -> None:
    source = ROOT / "stepstream/history/v1/StepSucceeded.avsc"
    (tmp_path / "stepstream/history/v3").mkdir(parents=True)
    shutil.copy(source, tmp_path / "stepstream/history/v3/StepSucceeded.avsc")
    with pytest.raises(ValueError, match=r"namespace 'stepstream\.history\.v3'"):
        RecordSerde([tmp_path])
    other = tmp_path / "other"
    (other / "history/v1").mkdir(parents=True)
    shutil.copy(source, other / "history/v1/StepSucceeded.avsc")
    with pytest.raises(ValueError, match="stepstream/<domain>/v<N>"):
        RecordSerde([other])
