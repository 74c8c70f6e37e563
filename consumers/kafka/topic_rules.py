"""The settings each topic of a prefix needs for stepstream's guarantees, and a check
of a live cluster against them (``stepstream topics check``, and every worker at start).

Two kinds of topic:

- Journals, kept whole (``cleanup.policy=delete`` with ``retention.ms=-1`` and
  ``retention.bytes=-1``; never compacted, which would keep one record per instance id):
  ``history`` is the journal state is restored from, so a deleted segment loses the
  instances it held; ``commands`` hold acknowledged commands until a worker applies
  them, and a worker outage longer than a finite retention would silently drop them;
  ``timers`` hold scheduled timers until the timer service indexed them, however far
  ahead they fire; ``snapshots`` bound restore time (a deleted newest snapshot means a
  restore folds the whole history); ``dead-letters`` are the only copy of input that
  could not be applied.
- Registers, compacted (``cleanup.policy=compact``, one partition): ``members`` and
  ``definitions`` are read whole by every client and only the newest record per key
  matters; deleted by time they would lose a long-running worker's announcement.

And for every topic: replicated (a replication factor of 1 loses the topic with one
disk), ``min.insync.replicas`` at least 2 when three or more replicas exist (an
acknowledged write on one replica is lost with that broker) and no more than the
replicas, no unclean leader election, the co-partitioned topics with one partition count.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin._config import ConfigResource

from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.topics import (
    COMMANDS,
    DEAD_LETTERS,
    DEFINITIONS,
    HISTORY,
    MEMBERS,
    SNAPSHOTS,
    TIMERS,
    TOPIC_KINDS,
    TopicNames,
)

log = logging.getLogger("stepstream.topics")

# A snapshot chunk holds whole keys: one may hold a value of up to about 1.4x the payload
# limit (a payload inside an instance's JSON state).
SNAPSHOT_MAX_MESSAGE_BYTES = 8 << 20
RECOMMENDED_REPLICATION = 3


@dataclass(frozen=True, slots=True)
class TopicRule:
    kind: str
    compacted: bool
    why: str

    @property
    def config(self) -> dict[str, str]:
        """The topic configuration ``topics create`` sets (before min.insync.replicas)."""
        if self.compacted:
            return {"cleanup.policy": "compact"}
        config = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
        if self.kind == SNAPSHOTS:
            config["max.message.bytes"] = str(SNAPSHOT_MAX_MESSAGE_BYTES)
        if self.kind == COMMANDS:
            # The broker stamps each command as it takes it: a new instance's clock
            # starts there (``LogEntry.accepted_ms``), not at a client's own clock.
            config["message.timestamp.type"] = "LogAppendTime"
        return config


RULES: dict[str, TopicRule] = {
    rule.kind: rule
    for rule in (
        TopicRule(COMMANDS, False, "acknowledged commands must stay until a worker applies them"),
        TopicRule(HISTORY, False, "history is the journal instances are restored from"),
        TopicRule(TIMERS, False, "a scheduled timer must stay until it has been indexed"),
        TopicRule(SNAPSHOTS, False, "snapshots bound restore time"),
        TopicRule(DEAD_LETTERS, False, "dead letters are the only copy of rejected input"),
        TopicRule(MEMBERS, True, "clients read the newest announcement of every worker"),
        TopicRule(DEFINITIONS, True, "clients read the newest registration of every workflow"),
    )
}
CLUSTER_TOPICS = (MEMBERS, DEFINITIONS)


def topic_config(kind: str, min_insync: int | None = None) -> dict[str, str]:
    config = RULES[kind].config
    if min_insync is not None:
        config["min.insync.replicas"] = str(min_insync)
    return config


@dataclass(frozen=True, slots=True)
class Finding:
    """One setting of one topic that breaks a guarantee, and what to run about it."""

    topic: str
    problem: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def check_topics(settings: KafkaSettings, timeout: float = 15.0) -> list[Finding]:
    """What is wrong with the topics of ``settings.prefix`` on its cluster (nothing: an
    empty list). Raises ``StepstreamError`` if the cluster cannot be asked."""
    from stepstream.consumers.kafka.admin import cluster_metadata

    names = TopicNames(settings.prefix)
    admin, metadata = cluster_metadata(settings, timeout)
    brokers = len(metadata.brokers)
    present = {name: topic for name, topic in metadata.topics.items() if topic.error is None}
    kinds = (*TOPIC_KINDS, *CLUSTER_TOPICS)
    findings: list[Finding] = []
    counts = {
        k: len(present[names.name(k)].partitions) for k in TOPIC_KINDS if names.name(k) in present
    }
    usual = Counter(counts.values()).most_common(1)[0][0] if counts else 12
    missing = [names.name(kind) for kind in kinds if names.name(kind) not in present]
    replication = min(RECOMMENDED_REPLICATION, max(brokers, 1))
    create = (
        f"stepstream topics create --bootstrap {settings.bootstrap} --prefix "
        f"{settings.prefix} --partitions {usual} --replication-factor {replication}"
        + (" --min-insync 2" if replication >= 3 else "")
    )
    findings += [Finding(name, "the topic does not exist", create) for name in missing]
    for kind, count in counts.items():
        if count != usual:
            findings.append(
                Finding(
                    names.name(kind),
                    f"{count} partitions where the other co-partitioned topics have {usual}: "
                    "an instance would live on different partitions of different topics",
                    "partition counts cannot change; recreate the prefix's topics with one "
                    "count (or use another --prefix)",
                )
            )
    for kind in CLUSTER_TOPICS:
        name = names.name(kind)
        if name in present and len(present[name].partitions) != 1:
            findings.append(
                Finding(
                    name,
                    f"{len(present[name].partitions)} partitions: clients read it as one partition",
                    f"delete it and run `{create}`",
                )
            )
    existing = [kind for kind in kinds if names.name(kind) in present]
    configs = _describe(admin, [names.name(kind) for kind in existing], timeout)
    for kind in existing:
        name = names.name(kind)
        partitions = present[name].partitions.values()
        # Distinct brokers: a one-node broker may list itself once per replica asked for.
        factor = min((len(set(p.replicas)) for p in partitions), default=0)
        findings += _check_one(settings, name, RULES[kind], factor, configs.get(name, {}), brokers)
    return findings


def replication(settings: KafkaSettings, timeout: float = 15.0) -> dict[str, int]:
    """How the prefix's existing topics are replicated, as the cluster reports it: the
    brokers, the lowest replication factor of any partition and the lowest
    ``min.insync.replicas`` of any topic (what a commit waits for, at worst)."""
    from stepstream.consumers.kafka.admin import cluster_metadata

    names = TopicNames(settings.prefix)
    admin, metadata = cluster_metadata(settings, timeout)
    wanted = {names.name(kind) for kind in (*TOPIC_KINDS, *CLUSTER_TOPICS)}
    present = {
        name: topic
        for name, topic in metadata.topics.items()
        if name in wanted and topic.error is None
    }
    if not present:
        raise StepstreamError(
            f"no topics of prefix {settings.prefix} on {settings.bootstrap}; create them "
            "with `stepstream topics create`"
        )
    configs = _describe(admin, sorted(present), timeout)
    return {
        "brokers": len(metadata.brokers),
        "replication_factor": min(
            len(set(p.replicas)) for topic in present.values() for p in topic.partitions.values()
        ),
        "min_insync_replicas": min(
            int(configs.get(name, {}).get("min.insync.replicas", "1")) for name in present
        ),
    }


def _describe(admin: Any, topics: list[str], timeout: float) -> dict[str, dict[str, str]]:
    if not topics:
        return {}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in topics]
    try:
        futures = admin.describe_configs(resources, request_timeout=timeout)
        return {
            resource.name: {
                key: entry.value for key, entry in future.result(timeout=timeout).items()
            }
            for resource, future in futures.items()
        }
    except KafkaException as exc:
        raise StepstreamError(f"cannot read the topics' configuration: {exc}") from None


def _check_one(
    settings: KafkaSettings,
    name: str,
    rule: TopicRule,
    factor: int,
    config: dict[str, str],
    brokers: int,
) -> list[Finding]:
    found: list[Finding] = []

    def alter(key: str, value: str) -> str:
        return (
            f"kafka-configs.sh --bootstrap-server {settings.bootstrap} --alter --entity-type "
            f"topics --entity-name {name} --add-config {key}={value}"
        )

    policy = set(config.get("cleanup.policy", "delete").replace(" ", "").split(","))
    if rule.compacted and policy != {"compact"}:
        found.append(
            Finding(
                name,
                f"cleanup.policy={','.join(sorted(policy))}, not compact: records would be "
                f"deleted by age ({rule.why})",
                alter("cleanup.policy", "compact"),
            )
        )
    if not rule.compacted:
        if "compact" in policy:
            found.append(
                Finding(
                    name,
                    f"cleanup.policy={','.join(sorted(policy))}: compaction keeps one record "
                    f"per instance and this topic must keep every record ({rule.why})",
                    alter("cleanup.policy", "delete"),
                )
            )
        for key in ("retention.ms", "retention.bytes"):
            value = config.get(key)
            if value is not None and value != "-1":
                found.append(
                    Finding(
                        name,
                        f"{key}={value}: records would be deleted, and this topic must keep "
                        f"every record ({rule.why})",
                        alter(key, "-1"),
                    )
                )
    if rule.kind == SNAPSHOTS:
        limit = config.get("max.message.bytes")
        if limit is not None and int(limit) < SNAPSHOT_MAX_MESSAGE_BYTES:
            found.append(
                Finding(
                    name,
                    f"max.message.bytes={limit}: snapshot chunks of up to "
                    f"{SNAPSHOT_MAX_MESSAGE_BYTES} bytes would be refused",
                    alter("max.message.bytes", str(SNAPSHOT_MAX_MESSAGE_BYTES)),
                )
            )
    if rule.kind == COMMANDS:
        stamped = config.get("message.timestamp.type")
        if stamped is not None and stamped != "LogAppendTime":
            found.append(
                Finding(
                    name,
                    f"message.timestamp.type={stamped}: a new instance's clock (a sleep begun "
                    "at its start) would count from the producing client's clock, which may "
                    "be behind the broker's, not from when the broker took the start",
                    alter("message.timestamp.type", "LogAppendTime"),
                )
            )
    if factor == 1:
        alone = (
            " (a one-broker cluster: fine to develop on, not to keep data)" if brokers == 1 else ""
        )
        found.append(
            Finding(
                name,
                f"replication factor 1: losing one broker's disk loses the topic{alone}",
                "recreate the prefix's topics with `stepstream topics create ... "
                f"--replication-factor {RECOMMENDED_REPLICATION} --min-insync 2` on a cluster "
                f"of at least 3 brokers (this one has {brokers}), or raise it with "
                "kafka-reassign-partitions.sh",
            )
        )
    min_isr = config.get("min.insync.replicas")
    if min_isr is not None:
        if factor >= 3 and int(min_isr) < 2:
            found.append(
                Finding(
                    name,
                    f"min.insync.replicas={min_isr} with {factor} replicas: an acknowledged "
                    "write may exist on one broker only, and be lost with it",
                    alter("min.insync.replicas", "2"),
                )
            )
        if int(min_isr) > factor > 0:
            found.append(
                Finding(
                    name,
                    f"min.insync.replicas={min_isr} exceeds the {factor} replicas: every "
                    "write is refused",
                    alter("min.insync.replicas", str(max(1, factor - 1))),
                )
            )
    if config.get("unclean.leader.election.enable") == "true":
        found.append(
            Finding(
                name,
                "unclean.leader.election.enable=true: an out-of-sync replica may become "
                "leader and drop acknowledged records",
                alter("unclean.leader.election.enable", "false"),
            )
        )
    return found


def log_findings(settings: KafkaSettings, timeout: float = 10.0) -> list[Finding]:
    """Check the prefix's topics and log each finding as a warning (a worker does this at
    start). Never raises: a cluster that cannot answer is a warning too."""
    try:
        findings = check_topics(settings, timeout)
    except Exception as exc:  # an old or partial broker: the check is advice, not a gate
        log.warning(
            "could not check the topics' settings: %s", exc, extra={"prefix": settings.prefix}
        )
        return []
    for finding in findings:
        log.warning(
            "topic setting breaks a guarantee: %s; %s",
            finding.problem,
            finding.fix,
            extra={"topic": finding.topic},
        )
    return findings
