"""``stepstream list``: instances, filtered, newest first (or oldest first, or in id
order), a page at a time with the cursor of the next.

The engine pages instances in every order (``engine.reads.listing``: each partition reads
its state from the cursor on, in id order or from its index by created time), a page
of the engine at a time; the cursor of ``--order newest`` and ``oldest`` is the created
time and id of the last row shown, so a page does not shift when instances start
meanwhile.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from stepstream.engine.api.attributes import AttributeValue, parse_where
from stepstream.engine.errors import InvalidPayload
from stepstream.engine.reads.listing import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    parse_instant,
)
from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.replay.state import Status
from stepstream.ops.cli import render
from stepstream.ops.cli.options import CONNECT, JSON, with_client
from stepstream.ops.cli.table import EXIT_OK, Command, UsageError, arg
from stepstream.producers.client import Client

ORDERS = ("newest", "oldest", "id")


def _list(args: argparse.Namespace) -> int:
    limit = DEFAULT_PAGE_SIZE if args.limit is None else args.limit
    if limit < 0:
        raise UsageError(f"--limit must be 0 (all) or more, got {limit}")
    order = args.order or "newest"
    since, until = (
        None if given is None else _instant(given, flag)
        for given, flag in ((args.since, "--since"), (args.until, "--until"))
    )
    after = args.after or None
    if after is not None and order != "id":
        _check_created_cursor(after)
    try:
        where = parse_where(args.where or [])
    except ValueError as bad:
        raise UsageError(str(bad)) from None
    # A command line that asks for a page gets the page's cursor with it; the plain
    # `stepstream list --json` keeps printing an array, as it always did.
    paged = any(
        given is not None and given != ""
        for given in (
            args.limit,
            args.after,
            args.workflow,
            args.prefix,
            args.order,
            args.since,
            args.until,
            where or None,
        )
    )

    async def command(client: Client) -> int:
        instances, cursor = await _pages(client, args, order, after, limit, since, until, where)
        text = render.instance_table(instances)
        if cursor is not None:
            text += (
                f"\nmore instances than the {len(instances)} shown (--limit 0 lists them all); "
                f"next page: {_next_page(args, cursor)}"
            )
        rows: Any = [i.to_json() for i in instances]
        if paged:
            rows = {"instances": rows, "next": cursor, "order": order}
        elif args.json and cursor is not None:
            print(
                f"stepstream list: {len(instances)} instances shown, more exist; "
                f"next page: {_next_page(args, cursor)} (or --limit 0 for all)",
                file=sys.stderr,
            )
        render.output(args, rows, text)
        return EXIT_OK

    return with_client(args, command)


async def _pages(
    client: Client,
    args: argparse.Namespace,
    order: str,
    after: str | None,
    limit: int,
    since: str | None,
    until: str | None,
    where: dict[str, AttributeValue | list[AttributeValue]],
) -> tuple[list[InstanceStatus], str | None]:
    """Up to ``limit`` instances (0: all) in ``order`` from the cursor ``after`` on, a
    page of the engine at a time, and the cursor after them (None: there are no more)."""
    found: list[InstanceStatus] = []
    cursor = after
    while True:
        want = MAX_PAGE_SIZE if limit == 0 else min(MAX_PAGE_SIZE, limit - len(found))
        page = await client.list_page(
            status=args.status,
            workflow=args.workflow,
            prefix=args.prefix or "",
            after=cursor,
            limit=want,
            since=since,
            until=until,
            order=order,
            where=where,
        )
        found += [i for i in page.instances if i.diverged or not args.diverged]
        cursor = page.next
        # A partition may answer a short page (in id order it reads a bounded number of
        # keys per call); its cursor says where to go on.
        if cursor is None or (limit and len(found) >= limit):
            return found, cursor


def _next_page(args: argparse.Namespace, cursor: str) -> str:
    """The command line that lists the next page: this one (its order, filters and
    limit) with ``--after`` the cursor instead of any it had. A ``--token`` given is not
    printed back: it shows as the word TOKEN."""
    words: list[str] = []
    value_of = ""
    for word in getattr(args, "argv", ["list"]):
        if value_of:
            if value_of == "--token":
                words.append("TOKEN")
            value_of = ""
        elif word in ("--after", "--token"):
            value_of = word
            if word == "--token":
                words.append(word)
        elif word.startswith("--token="):
            words.append("--token=TOKEN")
        elif not word.startswith("--after="):
            words.append(word)
    return shlex.join(["stepstream", *words, "--after", cursor])


def _instant(text: str, flag: str) -> str:
    try:
        return parse_instant(text, flag)
    except InvalidPayload as bad:
        raise UsageError(str(bad).replace(f"{flag}=", f"{flag} ", 1)) from None


def _check_created_cursor(text: str) -> None:
    """Refuse what is not a cursor a ``--order newest|oldest`` page printed."""
    created, slash, instance_id = text.partition("/")
    if not slash or not instance_id or not created[:4].isdigit():
        raise UsageError(
            f"--after {text!r} is not a cursor of --order newest/oldest (CREATED/ID); pass "
            "the one the previous page printed, or add --order id for an instance id"
        )


_STATUSES: Sequence[str] = [s.value for s in Status]

COMMANDS = (
    Command(
        "list",
        f"list instances, newest first, {DEFAULT_PAGE_SIZE} at a time; says when there "
        "are more and how to get the next page",
        _list,
        shared=(CONNECT, JSON),
        epilog="examples: stepstream list; stepstream list --status failed --limit 0; "
        "stepstream list --since 1h --order newest; "
        "stepstream list --where customer=42 --where vip=true; "
        "stepstream list --order oldest --after CURSOR. With --json it prints an array of "
        "instances; once any of --limit, --after, --order, --workflow, --prefix, --since, "
        "--until, --where is given, "
        'an object {"instances": [...], "next": CURSOR or null, "order": ...}',
        args=(
            arg("--status", choices=_STATUSES, help="only instances in this status"),
            arg("--workflow", metavar="NAME", help="only instances of this workflow"),
            arg("--prefix", metavar="TEXT", help="only instances whose id starts so"),
            arg(
                "--limit",
                type=int,
                metavar="N",
                help=f"at most N instances (default {DEFAULT_PAGE_SIZE}; 0 for all)",
            ),
            arg(
                "--order",
                choices=ORDERS,
                help="newest first by created time (the default), oldest first, or in id "
                "order; each pages from an index without reading every instance (a rare "
                "--status, --workflow or --where reads them all in the time orders)",
            ),
            arg(
                "--after",
                metavar="CURSOR",
                help="the page after this cursor, as the previous page printed it (an "
                "instance id with --order id)",
            ),
            arg(
                "--since",
                metavar="WHEN",
                help="only instances created at or after WHEN: an ISO 8601 time "
                "(2026-01-31T08:00:00Z; UTC when it names no zone) or how long ago (90s, "
                "30m, 1h, 2d, 1w)",
            ),
            arg(
                "--until",
                metavar="WHEN",
                help="only instances created before WHEN (the same forms as --since)",
            ),
            arg(
                "--where",
                action="append",
                metavar="KEY=VALUE",
                help="only instances whose search attribute KEY (ctx.set_attributes) equals "
                "VALUE; repeat it for other keys, every one must match. A number, true or "
                'false matches that value or the same text (customer=42 finds "42" and '
                "42); a quoted JSON string only that text (customer='\"42\"'); anything "
                "else is text",
            ),
            arg(
                "--diverged",
                action="store_true",
                help="only instances parked because the deployed code cannot run them: "
                "their history no longer matches it, their version is not deployed, or the "
                "payload codec cannot read them (`stepstream status ID` says which; they "
                "stay running, and go on once code that can is deployed)",
            ),
        ),
    ),
)
