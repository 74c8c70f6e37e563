"""``stepstream history ID``: an instance's history as a timeline, as JSON, exported to
a file (``--export``) or followed as it grows (``--follow``)."""

from __future__ import annotations

import argparse

from stepstream.engine.errors import ResultTimeout, WorkflowCancelled, WorkflowFailed
from stepstream.engine.reads.views import HistoryEntry
from stepstream.ops.cli import render
from stepstream.ops.cli.options import (
    CONNECT,
    JSON,
    client_codec,
    decodes_remotely,
    with_client,
)
from stepstream.ops.cli.payload_codecs import say_undecoded
from stepstream.ops.cli.table import EXIT_OK, Command, UsageError, arg
from stepstream.producers.client import Client

# How long --follow waits for the end before it reads the history again: the web UI's
# refresh. The end itself wakes it at once (the server answers a result when the
# instance's last record is committed, it does not poll either).
FOLLOW_INTERVAL_S = 1.0


def _history(args: argparse.Namespace) -> int:
    if args.follow and args.export is not None:
        raise UsageError("--follow prints records as they come; --export writes a file once")
    codec = client_codec(args)

    async def command(client: Client) -> int:
        if args.follow:
            return await _follow(client, args)
        history = await client.history(args.id)
        say_undecoded(history, codec, by_server=decodes_remotely(args))
        if args.export is not None:
            from stepstream.ops.tools.history_export import records_from_entries, write_export

            # Payloads are written again with the codec that read them, so a file of an
            # encrypted history holds no plaintext (`replay --file F --codec` reads it).
            records = records_from_entries(args.id, history, codec)
            write_export(args.export, args.id, records)
            done = {"instance_id": args.id, "records": len(records), "file": args.export}
            render.output(args, done, f"wrote {len(records)} records of {args.id} to {args.export}")
            return EXIT_OK
        render.output(args, [entry.to_json() for entry in history], render.render_timeline(history))
        return EXIT_OK

    return with_client(args, command, codec)


async def _follow(client: Client, args: argparse.Namespace) -> int:
    """Prints the records there are, then each one appended, until the instance has
    finished and its last record is printed. Between reads it waits for the instance's
    end (``result``) for at most ``FOLLOW_INTERVAL_S``: a finished instance ends the
    command at once, a running one costs a read a second."""
    printed = 0  # the seq of the last record printed
    finished = False
    while True:
        for entry in await client.history(args.id):
            if entry.seq > printed:
                _print_record(args, entry)
                printed = entry.seq
        if finished:
            return EXIT_OK
        try:
            await client.result(args.id, timeout=FOLLOW_INTERVAL_S)
            finished = True
        except (WorkflowFailed, WorkflowCancelled):
            finished = True
        except ResultTimeout:
            pass


def _print_record(args: argparse.Namespace, entry: HistoryEntry) -> None:
    if args.json:
        render.print_json(entry.to_json(), one_line=True)
    else:
        print(render.record_line(entry), flush=True)


COMMANDS = (
    Command(
        "history",
        "show an instance's history as a timeline (--json: its records); --follow keeps "
        "printing records as they are appended until the instance finishes",
        _history,
        shared=(CONNECT, JSON),
        epilog="examples: stepstream history o-1; stepstream history o-1 --follow; "
        "stepstream history o-1 --export o-1.json. With --follow the text is one line per "
        "record (sequence number, time, type, key, details) and --json one JSON object per "
        "line (JSON Lines); it exits 0 once the instance has finished, 130 on Ctrl-C",
        args=(
            arg("id", metavar="ID", help="the instance's id"),
            arg(
                "--follow",
                "-f",
                action="store_true",
                help="after the records there are, print each new one as it is appended, "
                "until the instance finishes (or Ctrl-C)",
            ),
            arg(
                "--export",
                metavar="FILE",
                help="write the raw history as JSON (docs/history-export.md) for `stepstream "
                "replay --file` and stepstream.testing.replay",
            ),
        ),
    ),
)
