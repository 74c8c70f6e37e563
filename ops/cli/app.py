"""``main``: the command table of every module of the CLI, parsed, logged and run, and
what an error becomes (a message on stderr and an exit code).

Exit codes: 0 done; 1 stepstream refused or failed (the message is on stderr: a failed
workflow's ``result``, an unknown instance, an unreachable engine); 2 the command line is
wrong and nothing was sent; 3 gave up waiting (``result --timeout``, ``start --wait
--timeout``, ``run --timeout``); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from stepstream.engine.errors import ResultTimeout, StepstreamError
from stepstream.engine.version import version
from stepstream.ops.cli import (
    bench,
    history,
    instances,
    kafka,
    listing,
    repair,
    run,
    schedules,
    serve,
    tools,
)
from stepstream.ops.cli.options import LOGGING
from stepstream.ops.cli.table import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Command,
    Handler,
    UsageError,
    arg,
    build_parser,
)
from stepstream.ops.telemetry import logs

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# In the order `stepstream --help` lists them.
COMMANDS: tuple[Command, ...] = (
    *run.COMMANDS,
    *serve.COMMANDS,
    *instances.COMMANDS,
    *repair.COMMANDS,
    *history.COMMANDS,
    *listing.COMMANDS,
    *schedules.COMMANDS,
    *tools.COMMANDS,
    *kafka.COMMANDS,
    *bench.COMMANDS,
)


class _Version(argparse.Action):
    """``--version``, read only when asked for (reading it is a good part of a start)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"stepstream {version()}")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    return build_parser(
        "stepstream",
        "Durable workflows for Python, event-sourced on Kafka. Commands that talk to a "
        "running engine take --connect URL (default $STEPSTREAM_CONNECT, else "
        "http://127.0.0.1:8233); every command takes --json. `stepstream COMMAND --help` "
        "says more; docs/cli.md has them all.",
        COMMANDS,
        everywhere=LOGGING,
        top=(arg("--version", action=_Version, nargs=0, help="print the version and exit"),),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for hints that repeat it
    if extra:  # said with the usage of the command they were given to, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    default_level = "INFO" if args.serves else "WARNING"
    level = _setting(
        args, args.log_level, "STEPSTREAM_LOG_LEVEL", "--log-level", _LOG_LEVELS, str.upper
    )
    if isinstance(level, int):
        return level
    log_format = _setting(
        args, args.log_format, "STEPSTREAM_LOG_FORMAT", "--log-format", logs.FORMATS, str.lower
    )
    if isinstance(log_format, int):
        return log_format
    logs.configure(level or default_level, log_format or "text", process=_process_index(args))
    handler: Handler = args.handler
    try:
        return handler(args)
    except UsageError as exc:
        return _usage(args, str(exc))
    except ResultTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except StepstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE if exc.retriable else EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``stepstream history ID | head``): not an error of ours.
        # Output still buffered would fail again at exit, so it goes nowhere instead.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_ERROR


def _setting(
    args: argparse.Namespace,
    given: str | None,
    variable: str,
    flag: str,
    allowed: Sequence[str],
    normal: Callable[[str], str],
) -> str | int:
    """A logging setting, from ``flag`` or else ``variable`` ("" when neither is set), or
    the exit code once a value that is not ``allowed`` was reported, naming where it
    came from."""
    value = normal(given or os.environ.get(variable) or "")
    if not value or value in allowed:
        return value
    choices = ", ".join(allowed)
    if given:
        return _usage(args, f"{flag} {given!r} is not one of {choices}")
    print(
        f"error: {variable}={os.environ[variable]!r} (from the environment) is not one of "
        f"{choices}; set it to one of them, or unset it",
        file=sys.stderr,
    )
    return EXIT_USAGE


def _usage(args: argparse.Namespace, message: str) -> int:
    """A usage error: what is wrong, then where the command's options are explained."""
    print(f"error: {message} (see `stepstream {args.command_name} --help`)", file=sys.stderr)
    return EXIT_USAGE


def _process_index(args: argparse.Namespace) -> int | None:
    """Which engine process of `stepstream dev --processes N` this is, if it is one."""
    if args.command_name != "dev" or getattr(args, "processes", 1) <= 1:
        return None
    from stepstream.ops.processes import SPEC_ENV, Spec

    spec = os.environ.get(SPEC_ENV)
    return Spec.from_env(spec).process if spec else 0
