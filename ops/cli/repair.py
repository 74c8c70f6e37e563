"""The commands that take an instance back to an earlier point of its history: ``reset``
(the same instance goes on from just before a replay key), ``retry`` (a failed instance
goes on from its failed step) and ``fork`` (a new instance with the history up to a
key). Each returns once its command is durable and the instance's owner took it."""

from __future__ import annotations

import argparse

from stepstream.ops.cli import render
from stepstream.ops.cli.instances import control
from stepstream.ops.cli.options import CONNECT, JSON, with_client
from stepstream.ops.cli.table import EXIT_OK, Command, UsageError, arg
from stepstream.producers.client import Client

_ID = arg("id", metavar="ID", help="the instance's id")
_TO = arg(
    "--to",
    required=True,
    metavar="KEY",
    help="a replay key from the instance's history: a step, sleep or wait name, its nth "
    "use as NAME#n (charge#2), inside a scope SCOPE/NAME (`stepstream history ID` shows them)",
)
_REASON = arg("--reason", default="", help="recorded with the reset")
_SHARED = (CONNECT, JSON)


def _fork(args: argparse.Namespace) -> int:
    if args.new_id is not None and not args.new_id.strip():
        raise UsageError("--id is empty; give the new instance's id, or leave --id out")

    async def command(client: Client) -> int:
        new_id = await client.fork(args.id, to=args.to, instance_id=args.new_id)
        done = {"instance_id": new_id, "command": "fork", "forked_from": args.id, "to": args.to}
        render.output(args, done, new_id)
        return EXIT_OK

    return with_client(args, command)


COMMANDS = (
    Command(
        "reset",
        "make an instance go on from just before a replay key: the results recorded before "
        "it replay (those steps do not run again); everything recorded from it on is set "
        "aside (kept in the history, marked reset) and the code runs on from there. Works "
        "on running and finished instances",
        control(
            "reset",
            lambda a: f"reset {a.id} to just before {a.to}",
            to="to",
            reason="reason",
        ),
        shared=_SHARED,
        epilog="example: stepstream reset o-1 --to charge#2 --reason 'card fixed'",
        args=(_ID, _TO, _REASON),
    ),
    Command(
        "retry",
        "make a failed instance go on from its failed step with fresh attempts (if no step "
        "failed, its code runs on from just before the failure); refused for an instance "
        "that has not failed",
        control("retry", lambda a: f"retrying {a.id} from its failed step", reason="reason"),
        shared=_SHARED,
        epilog="example: stepstream retry o-1",
        args=(_ID, arg("--reason", default="", help="recorded with the retry")),
    ),
    Command(
        "fork",
        "start a new instance whose history is another's up to (not including) a replay "
        "key; it runs on from there, and its status says where it came from. Prints the "
        "new instance's id",
        _fork,
        shared=_SHARED,
        epilog="example: stepstream fork o-1 --to charge#2 --id o-1-b",
        args=(
            _ID,
            _TO,
            arg(
                "--id",
                dest="new_id",
                metavar="NEW",
                help="the new instance's id (default: ID-fork-<random>)",
            ),
        ),
    ),
)
