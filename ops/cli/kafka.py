"""The Kafka side of the command line: ``stepstream topics ACTION`` (the topics of a
prefix). Commands about brokers and topics belong here: a ``broker`` command is one more
``Command`` in ``COMMANDS``, a ``topics check`` one more in ``TOPIC_ACTIONS``."""

from __future__ import annotations

import argparse

from stepstream.ops.cli import render
from stepstream.ops.cli.options import JSON, KAFKA, kafka_settings
from stepstream.ops.cli.table import EXIT_OK, Command, arg


def _topics_create(args: argparse.Namespace) -> int:
    from stepstream.consumers.kafka import create_topics

    settings = kafka_settings(args)
    states = create_topics(settings, args.partitions, replication=args.replication)
    rows = [{"topic": t.name, "partitions": t.partitions, "created": t.created} for t in states]
    human = "\n".join(
        f"{'created' if t.created else 'exists '} {t.name} ({t.partitions} "
        f"partition{'' if t.partitions == 1 else 's'})"
        for t in states
    )
    render.output(args, rows, human)
    return EXIT_OK


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
            arg("--replication", type=int, default=1, metavar="R", help="replication factor (1)"),
        ),
    ),
)

COMMANDS = (Command("topics", "manage the Kafka topics of a prefix", subcommands=TOPIC_ACTIONS),)
