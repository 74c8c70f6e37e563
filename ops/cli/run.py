"""``stepstream run``: one workflow to completion on a throwaway embedded engine."""

from __future__ import annotations

import argparse
import importlib
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stepstream.engine.api.workflow import Registry, WorkflowDefinition, definition_of
from stepstream.engine.errors import ResultTimeout, StepstreamError
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.ops import event_loop
from stepstream.ops.cli import render
from stepstream.ops.cli.options import (
    CODEC,
    JSON,
    codec_from_args,
    json_flag,
    put_cwd_on_path,
    timeout_flag,
)
from stepstream.ops.cli.table import EXIT_OK, Command, UsageError, arg
from stepstream.producers.client import Client
from stepstream.producers.http.wire import error_to_wire


def _run(args: argparse.Namespace) -> int:
    value = json_flag(args.input, "--input")
    timeout_flag(args.timeout)
    definition = load_workflow(args.target)
    codec = codec_from_args(args)
    return event_loop.run(_run_once(definition, value, args, codec))


async def _run_once(
    definition: WorkflowDefinition,
    value: Any,
    args: argparse.Namespace,
    codec: PayloadCodec | None,
) -> int:
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded

    with _data_dir(args.data) as data_dir:
        # A throwaway directory holds one instance: one partition opens fastest.
        config = EmbeddedConfig.from_env(
            data_dir=data_dir, partitions=1 if args.data is None else None
        )
        # Every workflow of the target's module, so children and messages it starts or
        # sends to other workflows of that module run too.
        registry = Registry([definition])
        registry.add_module(definition.fn.__module__)
        engine = await open_embedded(registry, config, codec=codec)
        try:
            client = Client(engine.transport)
            instance_id = await client.start(definition.name, value)
            error: StepstreamError | None = None
            result: Any = None
            try:
                result = await client.result(instance_id, timeout=args.timeout)
            except ResultTimeout:
                error = _unfinished(instance_id, args)
            except StepstreamError as exc:
                error = exc
            status = await client.status(instance_id)
            history = await client.history(instance_id)
        finally:
            await engine.close()

    if args.json:
        out: dict[str, Any] = {
            "instance_id": instance_id,
            "workflow": status.workflow,
            "version": status.version,
            "status": status.status,
        }
        if error is None:
            out["result"] = result
        else:
            out.update(error_to_wire(error))
        out["history"] = [entry.to_json() for entry in history]
        render.print_json(out)
    else:
        pairs = [
            ("instance", instance_id),
            ("workflow", f"{status.workflow} v{status.version}"),
            ("status", status.status),
        ]
        if error is None:
            pairs.append(("result", render.compact(result)))
        print(render.key_values(pairs))
        print()
        print(render.render_timeline(history))
    if error is not None:
        raise error
    return EXIT_OK


def _unfinished(instance_id: str, args: argparse.Namespace) -> ResultTimeout:
    """What `run` says of an instance it stops unfinished: the engine it ran on stops
    with the command, so where the instance can go on, if it can."""
    said = f"instance {instance_id} did not finish within {args.timeout} s"
    if args.data is None:
        return ResultTimeout(
            f"{said}; it ended with the run's throwaway data directory: give a longer "
            "--timeout, or --data DIR to keep it"
        )
    module = args.target.partition(":")[0]
    return ResultTimeout(
        f"{said}; it waits in {args.data}: `stepstream dev --data {args.data} --workflows "
        f"{module}` runs it on, and `stepstream status {instance_id} --connect "
        f"embedded:{args.data}` shows where it stands"
    )


def load_workflow(target: str) -> WorkflowDefinition:
    """The ``@workflow`` function ``MODULE:FUNC`` names, imported from the working
    directory as ``python -m`` would."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"expected MODULE:FUNC (e.g. examples.order:order), got {target!r}")
    put_cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise StepstreamError(
            f"cannot import {module_name!r}: {exc}; check the name and that it is on PYTHONPATH"
        ) from None
    found = getattr(module, attribute, None)
    definition = definition_of(found)
    if definition is None:
        what = "has no attribute" if found is None else "has no @workflow function"
        raise StepstreamError(f"module {module_name!r} {what} {attribute!r}")
    return definition


@contextmanager
def _data_dir(given: str | None) -> Iterator[str]:
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="stepstream-run-") as temporary:
        yield temporary


COMMANDS = (
    Command(
        "run",
        "run one workflow to completion on a throwaway embedded engine; prints its "
        "result and timeline (exit 1 if it failed)",
        _run,
        shared=(CODEC, JSON),
        args=(
            arg(
                "target",
                metavar="MODULE:FUNC",
                help="the @workflow function to run (its ctx.publish(...) records go to the "
                "Kafka cluster named by STEPSTREAM_OUTBOX_BOOTSTRAP, HOST:PORT)",
            ),
            arg("--input", metavar="JSON", help="the workflow's input (default: null)"),
            arg(
                "--data",
                metavar="DIR",
                help="data directory (default: a temporary one); keep one to read the "
                "instance afterwards with --connect embedded:DIR",
            ),
            arg(
                "--timeout",
                type=float,
                metavar="S",
                help="give up after S seconds (exit 3): the engine stops with the command, "
                "so an unfinished instance ends with the throwaway directory, or waits in "
                "--data DIR for `stepstream dev --data DIR` to run it on",
            ),
        ),
        epilog='example: stepstream run examples.order:order --input \'{"card": "x"}\'',
    ),
)
