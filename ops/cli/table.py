"""The command table: each command declared once (name, help, arguments, handler), and
the argparse parser built from it.

A module of ``stepstream.ops.cli`` declares its commands as ``Command`` values; a
command with ``subcommands`` is a group (``stepstream topics create``). The parser is
built from the table alone, and each parsed namespace carries the parser of its own
command, so a usage error is said with that command's usage rather than the top
level's (no argparse internals are looked into).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_ERROR = 1  # stepstream refused or failed; the message is on stderr
EXIT_USAGE = 2  # the command line is wrong; nothing was sent
EXIT_TIMEOUT = 3  # gave up waiting (``result --timeout``, ``start --wait --timeout``)
# The engine could not take the call now (the error is ``retriable``: not reached, the
# connection broke, HTTP 503): the same call may work later; a command cut off by a
# broken connection may have been applied.
EXIT_UNAVAILABLE = 4
EXIT_INTERRUPTED = 130  # Ctrl-C

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Something on the command line is wrong; nothing was sent (exit 2)."""


@dataclass(frozen=True)
class Arg:
    """One argument: the names and keywords of ``ArgumentParser.add_argument``."""

    flags: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


def arg(*flags: str, **options: Any) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class ArgGroup:
    """Arguments shown under a title in ``--help``, or of which at most one (exactly one
    if ``required``) may be given (``exclusive``)."""

    members: tuple[Arg | ArgGroup, ...]
    title: str | None = None
    exclusive: bool = False
    required: bool = False


Member = Arg | ArgGroup


@dataclass(frozen=True)
class Command:
    """A command: what ``stepstream NAME --help`` says, its arguments, and the function
    that runs it (returning the exit code). A group has ``subcommands`` instead of a
    handler. ``shared`` are option sets several commands take (``--connect``...), added
    before the command's own ``args``."""

    name: str
    help: str
    handler: Handler | None = None
    args: Sequence[Member] = ()
    shared: Sequence[Sequence[Member]] = ()
    description: str | None = None
    epilog: str | None = None
    # Keep the description's line breaks (a long text with lists, like bench's).
    verbatim: bool = False
    subcommands: Sequence[Command] = ()
    # Servers log at INFO unless told otherwise; other commands at WARNING.
    serves: bool = False


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown option, a bad value, a missing argument) end
    as ours do: naming the command's ``--help``. Subcommands' parsers are of this class
    too (``add_subparsers`` makes them of the parser's own)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(
    prog: str,
    description: str,
    commands: Sequence[Command],
    *,
    everywhere: Sequence[Member] = (),
    top: Sequence[Member] = (),
) -> argparse.ArgumentParser:
    """The parser of ``commands``; ``everywhere`` are added to every command that runs
    (``--log-level``...), ``top`` to the top level alone (``--version``)."""
    parser = _Parser(prog=prog, description=description)
    for member in top:
        _add(parser, member)
    _add_commands(parser, commands, "COMMAND", everywhere, path=())
    return parser


def _add_commands(
    parser: argparse.ArgumentParser,
    commands: Sequence[Command],
    metavar: str,
    everywhere: Sequence[Member],
    path: tuple[str, ...],
) -> None:
    dest = "_".join(("command", *path))
    chosen = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
    names = [c.name for c in commands]
    if len(set(names)) != len(names):
        raise ValueError(f"a command is declared twice in {names}")
    for command in commands:
        formatter = (
            argparse.RawDescriptionHelpFormatter if command.verbatim else argparse.HelpFormatter
        )
        sub = chosen.add_parser(
            command.name,
            help=command.help,
            description=command.description or command.help,
            epilog=command.epilog,
            formatter_class=formatter,
        )
        full = (*path, command.name)
        if command.subcommands:
            _add_commands(sub, command.subcommands, "ACTION", everywhere, full)
            continue
        if command.handler is None:
            raise ValueError(f"command {' '.join(full)!r} has neither a handler nor subcommands")
        for member in (*everywhere, *(m for group in command.shared for m in group), *command.args):
            _add(sub, member)
        sub.set_defaults(
            handler=command.handler,
            command_parser=sub,
            command_name=" ".join(full),
            serves=command.serves,
        )


def _add(parser: Any, member: Member) -> None:
    """Adds ``member`` to ``parser`` (a parser, or a group of one)."""
    if isinstance(member, Arg):
        parser.add_argument(*member.flags, **member.options)
        return
    if member.exclusive:
        group = parser.add_mutually_exclusive_group(required=member.required)
    else:
        group = parser.add_argument_group(member.title)
    for inner in member.members:
        _add(group, inner)
