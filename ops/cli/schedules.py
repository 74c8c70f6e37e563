"""``stepstream schedule create|list|describe|pause|resume|trigger|delete``: schedules
of a running engine, over the ``Client`` calls (so every transport has them)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from stepstream.engine.api.schedule_spec import (
    DEFAULT_CATCHUP_WINDOW,
    OVERLAP_POLICIES,
    ScheduleSpec,
    check_spec,
)
from stepstream.engine.errors import InvalidPayload
from stepstream.ops.cli import render
from stepstream.ops.cli.options import CONNECT, JSON, json_flag, with_client
from stepstream.ops.cli.table import EXIT_OK, ArgGroup, Command, UsageError, arg
from stepstream.producers.client import Client
from stepstream.producers.schedules import ScheduleInfo

_NAME = arg("name", metavar="NAME", help="the schedule's name")
_SHARED = (CONNECT, JSON)


# How check_spec names a field, and its flag here.
_FLAGS = (
    ("catchup_window=", "--catchup-window "),
    ("every=", "--every "),
    ("cron=", "--cron "),
    ("timezone=", "--timezone "),
    ("overlap=", "--overlap "),
)


def _create(args: argparse.Namespace) -> int:
    value = json_flag(args.input, "--input")
    spec = ScheduleSpec(
        args.name,
        args.workflow,
        value,
        args.cron,
        args.every,
        args.timezone,
        args.overlap,
        args.catchup_window,
    )
    try:
        check_spec(spec)  # before connecting: a wrong command line is a usage error
    except InvalidPayload as bad:
        said = str(bad)
        for field, flag in _FLAGS:
            said = said.replace(field, flag)
        raise UsageError(said) from None

    async def command(client: Client) -> int:
        info = await client.create_schedule(
            args.name,
            args.workflow,
            cron=args.cron,
            every=args.every,
            input=value,
            timezone=args.timezone,
            overlap=args.overlap,
            catchup_window=args.catchup_window,
        )
        render.output(args, info.to_json(), f"schedule {info.name}: {info.spec} -> {info.workflow}")
        return EXIT_OK

    return with_client(args, command)


def _describe(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        info = await client.describe_schedule(args.name)
        render.output(args, info.to_json(), _described(info))
        return EXIT_OK

    return with_client(args, command)


def _list(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        found = await client.list_schedules()
        render.output(args, [i.to_json() for i in found], _table(found))
        return EXIT_OK

    return with_client(args, command)


def _control(action: str, past: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        async def command(client: Client) -> int:
            await getattr(client, f"{action}_schedule")(args.name)
            done = {"schedule": args.name, "command": action}
            render.output(args, done, f"{past} schedule {args.name}")
            return EXIT_OK

        return with_client(args, command)

    return handler


def _described(info: ScheduleInfo) -> str:
    pairs = [
        ("name", info.name),
        ("workflow", info.workflow),
        ("spec", info.spec),
        ("overlap", info.overlap),
        ("catch-up window", f"{info.catchup_window}s"),
        ("state", _state(info)),
        ("next run", info.next_run_at or "-"),
        ("last instance", info.last_instance_id or "-"),
        ("running", ", ".join(info.running) or "-"),
        ("started", str(info.started)),
        ("triggered", str(info.triggered)),
        (
            "skipped",
            f"{info.skipped} ({info.skipped_catchup} past the catch-up window, "
            f"{info.skipped_overlap} by overlap)",
        ),
    ]
    if info.buffered_slot:
        pairs.append(("buffered slot", info.buffered_slot))
    return render.key_values(pairs)


def _state(info: ScheduleInfo) -> str:
    """active, paused, or how its instance ended (cancelled, failed: it runs no slot;
    `schedule create` starts it afresh)."""
    if info.status in ("pending", "running"):
        return "paused" if info.paused else "active"
    return info.status


def _table(found: Sequence[ScheduleInfo]) -> str:
    if not found:
        return "no schedules"
    rows = [("NAME", "WORKFLOW", "SPEC", "STATE", "NEXT RUN", "LAST INSTANCE", "SKIPPED")]
    rows += [
        (
            i.name,
            i.workflow,
            i.spec,
            _state(i),
            i.next_run_at or "-",
            i.last_instance_id or "-",
            str(i.skipped),
        )
        for i in found
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


_CREATE_HELP = (
    "create a schedule (or replace the spec of the one of that name): at each slot of "
    "--cron or --every it starts one instance of --workflow, with id NAME@<slot, UTC "
    "ISO 8601>, exactly once, across restarts and failovers"
)

_ACTIONS = (
    Command(
        "create",
        _CREATE_HELP,
        _create,
        shared=_SHARED,
        epilog=(
            "examples: stepstream schedule create nightly --workflow report --cron '0 2 * * *' "
            "--timezone Europe/Paris; stepstream schedule create poll --workflow poll --every 300"
        ),
        args=(
            _NAME,
            arg("--workflow", required=True, metavar="W", help="the workflow each slot starts"),
            ArgGroup(
                (
                    arg(
                        "--cron",
                        metavar="EXPR",
                        help="a cron expression, five fields: minute hour day-of-month "
                        "month day-of-week (read in --timezone)",
                    ),
                    arg(
                        "--every",
                        type=int,
                        metavar="S",
                        help="every S seconds (slots are multiples of S since the epoch)",
                    ),
                ),
                exclusive=True,
                required=True,
            ),
            arg("--input", metavar="JSON", help="each instance's input (default: null)"),
            arg(
                "--overlap",
                default="skip",
                choices=OVERLAP_POLICIES,
                help="a slot while the previous instance still runs: skip it (default), "
                "buffer_one (start it when that one ends; later ones are skipped), or allow",
            ),
            arg(
                "--timezone",
                default="UTC",
                metavar="TZ",
                help="the IANA time zone --cron is read in (default UTC); on a DST day a "
                "slot in the gap runs just after it, a repeated one runs once",
            ),
            arg(
                "--catchup-window",
                type=int,
                default=DEFAULT_CATCHUP_WINDOW,
                metavar="S",
                help="a slot found due more than S seconds late (no worker ran) is skipped "
                f"and counted (default {DEFAULT_CATCHUP_WINDOW})",
            ),
        ),
    ),
    Command(
        "list",
        "list the schedules: spec, paused, next run, last instance, slots skipped",
        _list,
        shared=_SHARED,
        epilog="example: stepstream schedule list --json",
    ),
    Command(
        "describe",
        "show a schedule: spec, next run, instances it runs, counts of started, triggered "
        "and skipped slots",
        _describe,
        shared=_SHARED,
        epilog="example: stepstream schedule describe nightly",
        args=(_NAME,),
    ),
    Command(
        "pause",
        "pause a schedule: no slot starts until it is resumed (those meanwhile are not run)",
        _control("pause", "paused"),
        shared=_SHARED,
        args=(_NAME,),
    ),
    Command(
        "resume",
        "resume a paused schedule from its next slot after now",
        _control("resume", "resumed"),
        shared=_SHARED,
        args=(_NAME,),
    ),
    Command(
        "trigger",
        "start one instance now, outside the slots (id NAME@<now, UTC, with milliseconds>)",
        _control("trigger", "triggered"),
        shared=_SHARED,
        args=(_NAME,),
    ),
    Command(
        "delete",
        "delete a schedule: no more slots start; instances it started go on",
        _control("delete", "deleted"),
        shared=_SHARED,
        args=(_NAME,),
    ),
)

COMMANDS = (
    Command(
        "schedule",
        "schedules: start a workflow at each slot of a cron expression or an interval",
        subcommands=_ACTIONS,
    ),
)
