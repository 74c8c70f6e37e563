"""The Kafka side of the command line: ``stepstream broker`` (a local broker),
``stepstream topics create|check`` (the topics of a prefix and their settings) and
``stepstream topics lag`` (how far the workers' consumer group is behind)."""

from __future__ import annotations

import argparse
from typing import Any

from stepstream.ops.cli import render
from stepstream.ops.cli.options import JSON, KAFKA, kafka_settings
from stepstream.ops.cli.table import EXIT_ERROR, EXIT_OK, Command, UsageError, arg


def _topics_create(args: argparse.Namespace) -> int:
    from stepstream.consumers.kafka import create_topics

    settings = kafka_settings(args)
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout} is not a number of seconds > 0")
    for flag, value in (
        ("--partitions", args.partitions),
        ("--replication-factor", args.replication),
        ("--min-insync", args.min_insync),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be 1 or more, got {value}")
    states = create_topics(
        settings,
        args.partitions,
        replication=args.replication,
        min_insync=args.min_insync,
        timeout=args.timeout,
    )
    rows = [{"topic": t.name, "partitions": t.partitions, "created": t.created} for t in states]
    human = "\n".join(
        f"{'created' if t.created else 'exists '} {t.name} ({t.partitions} "
        f"partition{'' if t.partitions == 1 else 's'})"
        for t in states
    )
    if any(not t.created for t in states) and not args.json:
        human += (
            "\nsome topics existed already, with the settings they had: `stepstream topics "
            "check` says whether those keep stepstream's guarantees"
        )
    render.output(args, rows, human)
    return EXIT_OK


def _topics_check(args: argparse.Namespace) -> int:
    from stepstream.consumers.kafka.topic_rules import check_topics

    settings = kafka_settings(args)
    findings = check_topics(settings)
    human = "\n".join(f"{f.topic}: {f.problem}\n  fix: {f.fix}" for f in findings) or (
        f"the topics of prefix {settings.prefix} keep every guarantee"
    )
    render.output(args, [f.as_dict() for f in findings], human)
    return EXIT_ERROR if findings else EXIT_OK


def _topics_lag(args: argparse.Namespace) -> int:
    from stepstream.consumers.kafka.group_lag import group_lag

    lag = group_lag(kafka_settings(args), args.group)
    render.output(args, lag.as_dict(), _lag_table(lag))
    return EXIT_OK


def _lag_table(lag: Any) -> str:
    head = (
        f"group {lag.group}: {lag.state}, {lag.protocol} protocol"
        + (f", assignor {lag.assignor}" if lag.assignor else "")
        + f", {lag.members} member{'' if lag.members == 1 else 's'}, total lag {lag.total}"
    )
    rows = [("TOPIC", "PARTITION", "COMMITTED", "END", "LAG", "OWNER")]
    for p in lag.partitions:
        owner = f"{p.client_id} {p.host}" if p.member else "-"
        committed = "-" if p.committed is None else str(p.committed)
        rows.append(
            (p.topic, str(p.partition), committed, str(p.end), _or_dash(p.lag), owner.strip())
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([head, *(line.rstrip() for line in lines)])


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _broker(args: argparse.Namespace) -> int:
    from stepstream.ops.brokers.foreground import BrokerOptions, run

    if not args.apache and (args.nodes != 1 or args.prepare):
        raise UsageError(
            "--nodes and --prepare need --apache (the development broker has "
            "one node and downloads nothing)"
        )
    options = BrokerOptions(args.apache, args.nodes, args.port, args.data, args.prepare, args.json)
    return run(options)


TOPIC_ACTIONS = (
    Command(
        "create",
        "create the topics of a prefix (idempotent); says what exists",
        _topics_create,
        shared=(KAFKA, JSON),
        description="create the topics of a prefix (idempotent; run it again after an "
        "upgrade that adds topics, such as <prefix>.definitions); says what exists",
        epilog="example: stepstream topics create --bootstrap kafka:9092 --partitions 12 "
        "--replication 3",
        args=(
            arg(
                "--partitions",
                type=int,
                required=True,
                metavar="N",
                help="partitions of each topic; every topic of a prefix has as many, and "
                "workers refuse topics whose counts differ. Instances are spread over them: "
                "more partitions, more workers can share the load",
            ),
            arg(
                "--replication-factor",
                "--replication",
                dest="replication",
                type=int,
                default=1,
                metavar="R",
                help="copies of each partition, on R brokers; 3 in production (%(default)s)",
            ),
            arg(
                "--min-insync",
                type=int,
                metavar="M",
                help="min.insync.replicas of each topic: replicas that must have a write "
                "before it is acknowledged (default: 2 with 3 or more replicas, else 1)",
            ),
            arg(
                "--timeout",
                type=float,
                default=60.0,
                metavar="S",
                help="seconds to wait for the cluster to answer, a broker started just "
                "before included, then give up with an error (%(default)s)",
            ),
        ),
    ),
    Command(
        "check",
        "list every topic of a prefix whose settings break a guarantee; exit 1 if any",
        _topics_check,
        shared=(KAFKA, JSON),
        description="list every topic of a prefix whose settings break a guarantee (missing "
        "topics, partition counts that differ, records deleted by age or compaction where "
        "every record must stay, replication factor 1, min.insync.replicas below 2 with 3 "
        "replicas...), each with what to run to fix it; exit status 1 if any, 0 if none",
        epilog="example: stepstream topics check --bootstrap kafka:9092 --prefix stepstream",
    ),
    Command(
        "lag",
        "how far the workers' consumer group is behind, per partition, and who owns each",
        _topics_lag,
        shared=(KAFKA, JSON),
        description="the lag of the workers' consumer group (<prefix>.workers) per partition "
        "of the commands and timers topics: the offset the group committed, the partition's "
        "end, their difference, and the member (client id, host) that owns it, with the "
        "group's state, protocol (classic or consumer, KIP-848) and assignor. Read from the "
        "brokers with the admin API, so it works with every worker down; Kafka's own "
        "kafka-consumer-groups --describe --group <prefix>.workers shows the same offsets. "
        "Workers commit offsets a few times a second, after the state covering them is "
        "written, so the lag shown is never less than the true one",
        epilog="example: stepstream topics lag --bootstrap kafka:9092 --prefix stepstream; "
        "--group stepstream.sources shows the group that reads Source topics",
        args=(
            arg(
                "--group",
                metavar="G",
                help="another consumer group, e.g. <prefix>.sources (default: <prefix>.workers)",
            ),
        ),
    ),
)

BROKER = Command(
    "broker",
    "run a local Kafka broker in the foreground until Ctrl-C or SIGTERM",
    _broker,
    shared=(JSON,),
    description="run a local Kafka broker in the foreground until Ctrl-C or SIGTERM; prints "
    "its bootstrap servers on stdout once every node serves (see docs/brokers.md)",
    epilog="examples: stepstream broker --apache --data ./kafka-data; "
    "stepstream broker --apache --nodes 3 --port 19092",
    args=(
        arg(
            "--apache",
            action="store_true",
            help="Apache Kafka (KRaft, from its Maven Central jars; needs Java 17+, and mvn "
            "the first time) instead of the development broker (Tansu: one node, records in "
            "memory only)",
        ),
        arg(
            "--nodes",
            type=int,
            default=1,
            metavar="N",
            help="with --apache: a cluster of N nodes, each broker and controller, on client "
            "ports PORT..PORT+N-1 and controller ports PORT+N..PORT+2N-1 (%(default)s)",
        ),
        arg("--port", type=int, default=9092, help="the (first) client port (%(default)s)"),
        arg(
            "--data",
            metavar="DIR",
            help="keep the broker's files in DIR (default: a temporary directory, removed on "
            "stop). Apache Kafka keeps its topics and records there across starts; the "
            "development broker only its log",
        ),
        arg(
            "--prepare",
            action="store_true",
            help="with --apache: only check Java, fetch the jars into the cache "
            "($STEPSTREAM_BROKER_JARS, default ~/.cache/stepstream/kafka-VERSION-DIGEST) and "
            "archive the broker's classes there for faster starts "
            "($STEPSTREAM_BROKER_CDS=0: no archive), then exit",
        ),
    ),
)

COMMANDS = (
    BROKER,
    Command("topics", "manage the Kafka topics of a prefix", subcommands=TOPIC_ACTIONS),
)
