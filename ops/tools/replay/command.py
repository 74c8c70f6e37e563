"""``stepstream replay``: the histories its arguments name, replayed, each result
printed as it comes (text or JSON) and a summary; the exit status says whether any
failed."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.ops import event_loop
from stepstream.ops.tools.replay.replayer import replay_all
from stepstream.ops.tools.replay.results import ReplayResult, render_trace
from stepstream.ops.tools.replay.sources import (
    History,
    read_client,
    read_data_dir,
    read_files,
    read_kafka,
)


def main(args: Any, codec: PayloadCodec | None = None) -> int:
    """``stepstream replay``; the arguments were checked by ``ops.cli``. Returns the exit
    status: 0 when every history replays, 1 when any diverges (or has no code, or fails).
    ``codec`` decodes the recorded payloads (JSON by default)."""
    registry = Registry()
    registry.add_modules(args.workflows)
    known = registry.names()
    if args.workflow is not None and args.workflow not in known:
        # A misspelt name would replay nothing and pass the gate.
        raise StepstreamError(
            f"--workflow {args.workflow!r} is not a workflow of {args.workflows}; it has "
            f"{', '.join(sorted(known)) or 'none'}"
        )
    histories, total = _histories(args, codec)
    single = args.instance is not None or (args.file is not None and len(args.file) == 1)
    results: list[dict[str, Any]] = []
    found = False

    def show(result: ReplayResult) -> None:
        nonlocal found
        found = True
        if args.json:
            results.append(result.to_json())
            return
        print(result.line(), flush=not single)
        if result.outcome == "diverged" and single:
            print(f"  {result.message}")
        if args.trace:
            print(render_trace(result))

    summary = replay_all(
        histories,
        registry,
        codec=codec,
        workflow=args.workflow,
        until_seq=args.until_seq,
        trace=args.trace,
        on_result=show,
        progress=None if single else sys.stderr,
        total=total,
    )
    if args.instance is not None and not found:
        raise StepstreamError(f"no history of instance {args.instance!r} in {_where(args)}")
    if args.json:
        print(json.dumps({"instances": results, "summary": summary.to_json()}, indent=2))
    else:
        print(
            f"replayed {summary.replayed} {'history' if summary.replayed == 1 else 'histories'} "
            f"in {summary.seconds:.2f} s"
            f"{': ' + summary.describe() if summary.replayed else ''}",
            file=sys.stderr,
        )
    return 1 if summary.failed else 0


def _where(args: Any) -> str:
    if args.data is not None:
        return f"data directory {args.data}"
    if args.connect is not None:
        return str(args.connect)
    if args.bootstrap is not None:
        return f"the history topic of prefix {args.prefix or 'stepstream'}"
    return ", ".join(args.file)


def _histories(args: Any, codec: PayloadCodec | None) -> tuple[Iterable[History], int | None]:
    """The histories the arguments name, and how many there are when that is known."""
    found: list[History]
    if args.data is not None:
        return read_data_dir(args.data, instance_id=args.instance), None
    if args.file is not None:
        found = read_files(args.file)
    elif args.bootstrap is not None:
        from stepstream.engine.config.kafka import KafkaSettings

        settings = KafkaSettings.load(
            args.bootstrap, args.prefix, config_file=args.kafka_config, options=args.kafka_opt
        )
        found, unreadable = read_kafka(settings, from_offset=args.from_offset or 0)
        if unreadable:
            print(f"skipped {unreadable} unreadable history records", file=sys.stderr)
    else:
        found = event_loop.run(_from_client(args, codec))
    if args.instance is not None:
        found = [h for h in found if h.instance_id == args.instance]
    return found, len(found)


async def _from_client(args: Any, codec: PayloadCodec | None) -> list[History]:
    import importlib

    from stepstream.producers.client import Client

    scheme = args.connect.split(":", 1)[0]
    if scheme == "kafka":
        importlib.import_module("stepstream.producers.kafka")
    options = {"token": args.token, "tls_ca": args.tls_ca}
    async with Client.connect(args.connect, **options) as client:
        return await read_client(
            client, instance_id=args.instance, workflow=args.workflow, codec=codec
        )
