"""Kafka's own command-line tools, run from the jars ``stepstream broker --apache`` uses
(``kafka-tools`` is in its pom): what an operator's ``kafka-consumer-groups.sh`` says."""

from __future__ import annotations

import subprocess

from stepstream.ops.brokers.jars import classpath, find_java, resolve_jars

CONSUMER_GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"


def describe_group(bootstrap: str, group: str) -> list[dict[str, str]]:
    """``kafka-consumer-groups --describe --group GROUP``: one row per partition, keyed
    by the tool's column names (GROUP, TOPIC, PARTITION, CURRENT-OFFSET, LOG-END-OFFSET,
    LAG, CONSUMER-ID, HOST, CLIENT-ID)."""
    command = [
        find_java(),
        "-Xmx256m",
        "-XX:TieredStopAtLevel=1",
        "-cp",
        classpath(resolve_jars()),
        CONSUMER_GROUP_COMMAND,
        "--bootstrap-server",
        bootstrap,
        "--describe",
        "--group",
        group,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    rows: list[dict[str, str]] = []
    header: list[str] | None = None
    for line in done.stdout.splitlines():
        cells = line.split()
        if cells[:2] == ["GROUP", "TOPIC"]:
            header = cells
        elif header is not None and len(cells) == len(header) and cells[0] == group:
            rows.append(dict(zip(header, cells, strict=True)))
    assert rows, f"no table in the tool's output:\n{done.stdout}\n{done.stderr}"
    return rows
