"""Commands for stepstream from a program that does not use stepstream.

Only confluent-kafka, fastavro and the ``.avsc`` files in ``schemas/`` (what a producer in
any language has: a Kafka client, an Avro library, the schema files). The contract it
follows is docs/wire-contract.md::

    python examples/wire_producer.py --bootstrap localhost:9092 --prefix shop \\
        start order --id o-7 --input '{"card": "x"}'
    python examples/wire_producer.py --bootstrap localhost:9092 --prefix shop \\
        send o-7 approval --payload '{"by": "ada"}' --event-id approval-o-7
"""

from __future__ import annotations

import argparse
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka import Producer
from fastavro.schema import expand_schema, fingerprint, to_parsing_canonical_form

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
MARKER = b"\xc3\x01"  # Avro single-object encoding


def load_schemas(root: Path = SCHEMAS) -> dict[str, tuple[dict[str, Any], bytes]]:
    """Record name -> (standalone schema, the 10-byte single-object header)."""
    named: dict[str, Any] = {}
    out = {}
    # The shared types (Envelope, Payload) first: the other schemas refer to them.
    for path in sorted(root.rglob("*.avsc"), key=lambda p: p.parts[-3] != "common"):
        schema = expand_schema(fastavro.parse_schema(json.loads(path.read_text()), named))
        canonical = to_parsing_canonical_form(schema)
        header = MARKER + bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
        out[path.stem] = (schema, header)
    return out


def encode(schemas: dict[str, tuple[dict[str, Any], bytes]], name: str, body: Any) -> bytes:
    schema, header = schemas[name]
    out = io.BytesIO()
    out.write(header)
    fastavro.schemaless_writer(out, schema, body)
    return out.getvalue()


def envelope(instance_id: str, command_id: str) -> dict[str, Any]:
    """The header of a command: sequence and epoch are 0, the workers set their own."""
    return {
        "instance_id": instance_id,
        "seq": 0,
        "time_ms": int(time.time() * 1000),
        "command_id": command_id,
        "epoch": 0,
        "traceparent": None,
        "tracestate": None,
    }


def json_payload(value: Any) -> dict[str, Any]:
    return {"content_type": "application/json", "data": json.dumps(value).encode()}


class CommandProducer:
    """Publishes to ``<prefix>.commands``, keyed by instance id, partitioned by murmur2."""

    def __init__(self, bootstrap: str, prefix: str, schemas: Path = SCHEMAS) -> None:
        self.topic = f"{prefix}.commands"
        self.schemas = load_schemas(schemas)
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                # Kafka's (Java) default partitioner: the partition of every instance.
                "partitioner": "murmur2_random",
            }
        )

    def _produce(self, instance_id: str, record: str, body: dict[str, Any]) -> None:
        failures: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        value = encode(self.schemas, record, body)
        self.producer.produce(self.topic, value, instance_id.encode(), on_delivery=delivered)
        if self.producer.flush(30) or failures:
            raise RuntimeError(f"{record} for {instance_id} was not acknowledged: {failures}")

    def start(
        self,
        workflow: str,
        input: Any,
        instance_id: str,
        version: str | None = None,
        if_exists: str = "return",
    ) -> None:
        """Starting an id that exists changes nothing (``if_exists="return"``): a retry
        may reuse the id."""
        body = {
            "header": envelope(instance_id, str(uuid.uuid4())),
            "workflow": workflow,
            "version": version,
            "input": json_payload(input),
            "if_exists": if_exists,
        }
        self._produce(instance_id, "StartWorkflow", body)

    def send(self, instance_id: str, name: str, payload: Any, event_id: str) -> None:
        """``event_id`` is the command id: a retry with the same id applies once."""
        body = {
            "header": envelope(instance_id, event_id),
            "name": name,
            "payload": json_payload(payload),
        }
        self._produce(instance_id, "SendEvent", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--prefix", default="stepstream")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start")
    start.add_argument("workflow")
    start.add_argument("--id", default=None)
    start.add_argument("--input", default="null")
    send = commands.add_parser("send")
    send.add_argument("id")
    send.add_argument("event")
    send.add_argument("--payload", default="null")
    send.add_argument("--event-id", default=None)
    args = parser.parse_args()
    producer = CommandProducer(args.bootstrap, args.prefix)
    if args.command == "start":
        instance_id = args.id or str(uuid.uuid4())
        producer.start(args.workflow, json.loads(args.input), instance_id)
        print(instance_id)
    else:
        producer.send(
            args.id, args.event, json.loads(args.payload), args.event_id or str(uuid.uuid4())
        )


if __name__ == "__main__":
    main()
