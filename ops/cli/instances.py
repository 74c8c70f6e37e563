"""The commands on one instance of a running engine: ``start``, ``send``, ``cancel``,
``terminate``, ``pause``, ``resume`` (each returns once the command is durable), ``status`` and
``result`` (which waits for the outcome). ``history`` and ``list`` are in ``history``
and ``listing``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from stepstream.engine.errors import (
    ResultTimeout,
    StepstreamError,
    WorkflowCancelled,
    WorkflowFailed,
    WorkflowTerminated,
)
from stepstream.engine.wire.names import IF_EXISTS_POLICIES
from stepstream.ops.cli import render
from stepstream.ops.cli.options import CONNECT, JSON, json_flag, timeout_flag, with_client
from stepstream.ops.cli.table import EXIT_OK, Command, UsageError, arg
from stepstream.producers.client import Client
from stepstream.producers.http.wire import error_to_wire

_ID = arg("id", metavar="ID", help="the instance's id")
# Every command here talks to a running engine and can print JSON.
_SHARED = (CONNECT, JSON)


def _start(args: argparse.Namespace) -> int:
    value = json_flag(args.input, "--input")
    if args.id is not None and not args.id.strip():
        raise UsageError("--id is empty; give an instance id, or leave --id out for a new uuid")
    if args.version is not None and not args.version.strip():
        raise UsageError("--version is empty; give a deployed version, or leave it out")
    if args.timeout is not None and not args.wait:
        raise UsageError("--timeout only applies with --wait")
    if args.queue_key is not None and not args.queue_key.strip():
        raise UsageError("--queue-key is empty; give the key (a tenant), or leave it out")
    timeout_flag(args.timeout)

    async def command(client: Client) -> int:
        instance_id = await client.start(
            args.workflow,
            value,
            instance_id=args.id,
            version=args.version,
            if_exists=args.if_exists,
            priority=args.priority,
            queue_key=args.queue_key,
        )
        if not args.wait:
            render.output(args, {"instance_id": instance_id}, instance_id)
            return EXIT_OK
        result = await _outcome(client, args, instance_id)
        out = {"instance_id": instance_id, "status": "completed", "result": result}
        render.output(
            args, out, render.key_values([(k, render.compact(v)) for k, v in out.items()])
        )
        return EXIT_OK

    return with_client(args, command)


def _send(args: argparse.Namespace) -> int:
    value = json_flag(args.payload, "--payload")

    async def command(client: Client) -> int:
        await client.send_event(args.id, args.event, value, event_id=args.event_id)
        done = {"instance_id": args.id, "command": "send", "event": args.event}
        if args.event_id is not None:
            done["event_id"] = args.event_id
        render.output(args, done, f"sent {args.event} to {args.id}")
        return EXIT_OK

    return with_client(args, command)


def control(action: str, said: Callable[[argparse.Namespace], str], **fields: str) -> Any:
    """The handler of a command to one instance: ``client.<action>(args.id, **fields)``
    with each field taken from the argument of that name; prints ``said(args)`` once
    the command is durable (``--json``: the instance, the command and the fields)."""

    def handler(args: argparse.Namespace) -> int:
        given = {name: getattr(args, attribute) for name, attribute in fields.items()}

        async def command(client: Client) -> int:
            await getattr(client, action)(args.id, **given)
            render.output(args, {"instance_id": args.id, "command": action, **given}, said(args))
            return EXIT_OK

        return with_client(args, command)

    return handler


def _status(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        status = await client.status(args.id)
        render.output(args, status.to_json(), render.describe_status(status))
        return EXIT_OK

    return with_client(args, command)


def _result(args: argparse.Namespace) -> int:
    timeout_flag(args.timeout)

    async def command(client: Client) -> int:
        value = await _outcome(client, args, args.id)
        if args.json:
            render.print_json({"instance_id": args.id, "status": "completed", "result": value})
        else:
            print(render.compact(value))
        return EXIT_OK

    return with_client(args, command)


async def _outcome(client: Client, args: argparse.Namespace, instance_id: str) -> Any:
    """The result of ``instance_id`` (``result``, ``start --wait``); with ``--json`` a
    failure or a timeout is printed too, before it is raised (and sets the exit code)."""
    try:
        return await client.result(instance_id, timeout=args.timeout)
    except (WorkflowFailed, WorkflowCancelled) as exc:
        status = (
            "failed"
            if isinstance(exc, WorkflowFailed)
            else "terminated"
            if isinstance(exc, WorkflowTerminated)
            else "cancelled"
        )
        _say_json(args, instance_id, status, exc)
        raise
    except ResultTimeout as exc:
        # The status it is in now says why it has not finished (paused, waiting...).
        status = (await client.status(instance_id)).status
        timeout = ResultTimeout(f"{exc} (status now: {status})")
        _say_json(args, instance_id, status, timeout)
        raise timeout from None


def _say_json(
    args: argparse.Namespace, instance_id: str, status: str, error: StepstreamError
) -> None:
    """With ``--json``, how it ended on stdout too (the message also goes to stderr)."""
    if args.json:
        render.print_json({"instance_id": instance_id, "status": status, **error_to_wire(error)})


_START_HELP = (
    "start an instance; returns once the command is durable (with kafka:// no worker needs "
    "to be running: the workflow name is checked against the workflows workers registered, "
    "and it runs when a worker owns its partition; on a prefix where no worker has "
    "registered yet, it first waits up to 30 s for one). Prints the instance id"
)

COMMANDS = (
    Command(
        "start",
        _START_HELP,
        _start,
        shared=_SHARED,
        epilog='example: stepstream start order --input \'{"card": "x"}\' --id o-1 --wait',
        args=(
            arg("workflow", help="the workflow's name"),
            arg("--input", metavar="JSON", help="the workflow's input (default: null)"),
            arg(
                "--id",
                metavar="ID",
                help="instance id (default: a new uuid); what starting an existing id does "
                "is --if-exists's",
            ),
            arg(
                "--if-exists",
                choices=IF_EXISTS_POLICIES,
                default="return",
                help="when --id exists: 'return' it as it is (default), 'fail' "
                "(InstanceExists, exit 1), or 'restart_if_failed' (a failed, cancelled or "
                "terminated instance starts afresh as its next run; its history keeps the "
                "earlier runs)",
            ),
            arg(
                "--version",
                metavar="V",
                help="run this version of the workflow, one the engine still has (default: "
                "the latest: the highest when versions are whole numbers, else the last "
                "declared)",
            ),
            arg(
                "--priority",
                type=int,
                metavar="N",
                help="for a workflow with a queue: lower numbers are admitted first, then "
                "in order of arrival (default: 0); see docs/queues.md",
            ),
            arg(
                "--queue-key",
                metavar="KEY",
                help="for a workflow whose queue has per_key=True: the key (a tenant) whose "
                "limits this instance counts against",
            ),
            arg("--wait", action="store_true", help="wait for the result and print it"),
            arg(
                "--timeout",
                type=float,
                metavar="S",
                help="with --wait, give up after S seconds (exit 3; default: no limit)",
            ),
        ),
    ),
    Command(
        "send",
        "send an event to an instance; returns once the command is durable (kafka://: "
        "without waiting for a worker); buffered if nothing waits for it yet",
        _send,
        shared=_SHARED,
        epilog='example: stepstream send o-1 approval --payload \'{"by": "ada"}\'',
        args=(
            _ID,
            arg(
                "event", metavar="EVENT", help="the event's name (what ctx.wait_for_event waits on)"
            ),
            arg("--payload", metavar="JSON", help="the event's payload (default: null)"),
            arg(
                "--event-id",
                metavar="ID",
                help="an id of your choosing: sending again with the same id applies the event "
                "once (for retries); no ':' in it",
            ),
        ),
    ),
    Command(
        "cancel",
        "cancel an instance: what it runs and waits for is abandoned, and result() raises "
        "WorkflowCancelled",
        control("cancel", lambda a: f"cancelled {a.id}", reason="reason"),
        shared=_SHARED,
        epilog="example: stepstream cancel o-1 --reason 'ordered twice'",
        args=(_ID, arg("--reason", default="", help="recorded with the cancellation")),
    ),
    Command(
        "terminate",
        "terminate an instance: it ends at once with status terminated; no compensation "
        "runs, running steps are given up, not awaited, and its children are terminated "
        "too; result() raises WorkflowTerminated. A finished instance is refused "
        "(InstanceFinished, exit 1)",
        control("terminate", lambda a: f"terminated {a.id}", reason="reason"),
        shared=_SHARED,
        epilog="example: stepstream terminate o-1 --reason 'stuck on a dead supplier'",
        args=(_ID, arg("--reason", default="", help="recorded with the termination")),
    ),
    Command(
        "pause",
        "pause an instance: it takes no further steps until resumed",
        control("pause", lambda a: f"paused {a.id}"),
        shared=_SHARED,
        epilog="example: stepstream pause o-1",
        args=(_ID,),
    ),
    Command(
        "resume",
        "resume a paused instance",
        control("resume", lambda a: f"resumed {a.id}"),
        shared=_SHARED,
        epilog="example: stepstream resume o-1",
        args=(_ID,),
    ),
    Command(
        "status",
        "show an instance's status and what it waits for; a wait for a queue slot says "
        "where it stands (position 1 is admitted next, of how many waiting)",
        _status,
        shared=_SHARED,
        epilog="example: stepstream status o-1 --json",
        args=(_ID,),
    ),
    Command(
        "result",
        "wait for an instance to finish and print its result: exit 0 with the value, 1 if "
        "it failed or was cancelled (with the error's type and message), 3 if --timeout "
        "passed first (it is still running)",
        _result,
        shared=_SHARED,
        epilog="example: stepstream result o-1 --timeout 30",
        args=(
            _ID,
            arg(
                "--timeout",
                type=float,
                metavar="S",
                help="give up after S seconds (default: no limit)",
            ),
        ),
    ),
)
