"""The records of the cluster topics (members, definitions): Avro single-object encoded
like every other record, readable by fastavro with the .avsc files alone, evolvable, and
anything else (an old JSON announcement) refused with a reason instead of a crash."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import fastavro
import pytest

from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.wire.cluster_serde import ClusterSerde, cluster_serde
from stepstream.producers.kafka.definitions import Registration, registrations
from stepstream.producers.kafka.members import Member
from stepstream.schemas import schema_root
from tests.conftest import test_registry as workflows_registry

MEMBER = Member("w-1", "http://10.0.0.7:8233", (0, 3), 1795312000123, 12, 1 << 20, 1795312000456)


def test_released_fingerprints() -> None:
    headers = {
        "MemberAnnounced": MEMBER.encode()[:10],
        "WorkflowRegistered": Registration("a", "1", "", 0, True, "w").encode()[:10],
    }
    assert {name: h.hex(" ") for name, h in headers.items()} == {
        "MemberAnnounced": "c3 01 3f fb cf bf e1 e5 00 d7",
        "WorkflowRegistered": "c3 01 0c 75 bf 08 e0 5b 57 36",
    }


def test_round_trips_and_fastavro_reads_them_with_the_schema_file() -> None:
    assert Member.decode("w-1", MEMBER.encode()) == MEMBER
    schema = json.loads((schema_root() / "stepstream/members/v1/MemberAnnounced.avsc").read_text())
    body = fastavro.schemaless_reader(io.BytesIO(MEMBER.encode()[10:]), schema, None)
    assert body == {
        "worker_id": "w-1",
        "url": "http://10.0.0.7:8233",
        "partitions": [0, 3],
        "epoch": 1795312000123,
        "partition_count": 12,
        "max_payload_bytes": 1 << 20,
        "time_ms": 1795312000456,
    }
    registered = registrations(workflows_registry(), "w-1", 42)
    assert {r.name for r in registered} >= {"arith", "gated"}
    for record in registered:
        assert Registration.decode(record.encode()) == record
        assert json.loads(record.key) == [record.name, record.version]
        assert len(record.code_hash) == 64 and record.latest


def test_an_old_json_announcement_is_skipped_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = b'{"url": "http://10.0.0.9:8233", "partitions": [0], "epoch": 1}'
    with pytest.raises(UndecodableRecord, match="not Avro single-object encoding"):
        cluster_serde().decode(old)
    assert Member.decode("old", old) is None
    assert "skipping a members record of worker old" in caplog.text
    with pytest.raises(UndecodableRecord, match="corrupt"):
        cluster_serde().decode(MEMBER.encode()[:-3])


def test_a_v2_reader_reads_v1_records_with_the_new_fields_default(tmp_path: Path) -> None:
    members = tmp_path / "stepstream" / "members"
    shutil.copytree(schema_root() / "stepstream/members", members)
    v2 = json.loads((members / "v1/MemberAnnounced.avsc").read_text())
    v2["namespace"] = "stepstream.members.v2"
    v2["aliases"] = ["stepstream.members.v1.MemberAnnounced"]
    v2["fields"].append({"name": "zone", "type": "string", "default": "", "doc": "Zone."})
    (members / "v2").mkdir()
    (members / "v2/MemberAnnounced.avsc").write_text(json.dumps(v2))
    (tmp_path / "stepstream" / "definitions").mkdir()

    name, body = ClusterSerde(tmp_path).decode(MEMBER.encode())
    assert name == "MemberAnnounced" and body["zone"] == "" and body["partitions"] == [0, 3]
    newer = ClusterSerde(tmp_path).encode("MemberAnnounced", {**body, "zone": "eu-1"})
    assert Member.decode("w-1", newer) is None  # a v1 reader does not know the v2 schema
