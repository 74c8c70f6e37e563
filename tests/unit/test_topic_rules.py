"""What each topic needs (``consumers.kafka.topic_rules``), checked without a broker:
the configuration ``topics create`` sets passes its own check, and each way of breaking
a guarantee is named with a fix."""

from __future__ import annotations

import pytest

from stepstream.consumers.kafka.topic_rules import RULES, Finding, _check_one, topic_config
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.topics import (
    COMMANDS,
    DEFINITIONS,
    HISTORY,
    MEMBERS,
    SNAPSHOTS,
    TOPIC_KINDS,
)

SETTINGS = KafkaSettings("b:9092", "p")


def check(kind: str, config: dict[str, str], factor: int = 3) -> list[Finding]:
    return _check_one(SETTINGS, f"p.{kind}", RULES[kind], factor, config, brokers=3)


@pytest.mark.parametrize("kind", [*TOPIC_KINDS, MEMBERS, DEFINITIONS])
def test_what_create_sets_passes_the_check(kind: str) -> None:
    assert check(kind, topic_config(kind, 2)) == []


def test_journals_keep_every_record_and_registers_are_compacted() -> None:
    assert not any(RULES[kind].compacted for kind in TOPIC_KINDS)
    assert RULES[MEMBERS].compacted and RULES[DEFINITIONS].compacted
    assert topic_config(HISTORY)["retention.ms"] == "-1"
    assert topic_config(HISTORY)["retention.bytes"] == "-1"
    assert topic_config(MEMBERS) == {"cleanup.policy": "compact"}


def test_the_broker_stamps_commands_as_it_takes_them() -> None:
    # A new instance's clock starts there (docs/workflows.md, "Workflow time").
    assert topic_config(COMMANDS)["message.timestamp.type"] == "LogAppendTime"
    assert "message.timestamp.type" not in topic_config(HISTORY)


@pytest.mark.parametrize(
    ("kind", "change", "problem", "fix"),
    [
        (HISTORY, {"cleanup.policy": "compact"}, "cleanup.policy=compact", "cleanup.policy=delete"),
        (HISTORY, {"retention.ms": "604800000"}, "retention.ms=604800000", "retention.ms=-1"),
        (HISTORY, {"retention.bytes": "1000"}, "retention.bytes=1000", "retention.bytes=-1"),
        (MEMBERS, {"cleanup.policy": "compact,delete"}, "not compact", "cleanup.policy=compact"),
        (HISTORY, {"min.insync.replicas": "1"}, "min.insync.replicas=1", "min.insync.replicas=2"),
        (SNAPSHOTS, {"max.message.bytes": "1048588"}, "max.message.bytes", "max.message.bytes="),
        (
            COMMANDS,
            {"message.timestamp.type": "CreateTime"},
            "message.timestamp.type=CreateTime",
            "message.timestamp.type=LogAppendTime",
        ),
        (
            HISTORY,
            {"unclean.leader.election.enable": "true"},
            "unclean.leader.election.enable=true",
            "unclean.leader.election.enable=false",
        ),
    ],
)
def test_each_broken_setting_is_named_with_its_fix(
    kind: str, change: dict[str, str], problem: str, fix: str
) -> None:
    (finding,) = check(kind, {**topic_config(kind, 2), **change})
    assert finding.topic == f"p.{kind}"
    assert finding.problem.startswith(problem) or problem in finding.problem
    assert f"--entity-name p.{kind} --add-config {fix}" in finding.fix


def test_one_replica_and_an_unreachable_min_insync_are_named() -> None:
    found = check(HISTORY, topic_config(HISTORY, 2), factor=1)
    assert [f.problem.split(":")[0] for f in found] == [
        "replication factor 1",
        "min.insync.replicas=2 exceeds the 1 replicas",
    ]
