"""The CLI's command table: every command documented in docs/cli.md, a usage error said
with the usage of the command it was given to, and a table that refuses mistakes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stepstream.ops.cli.app import COMMANDS, parser
from stepstream.ops.cli.table import Command, build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _paths(commands: tuple[Command, ...] | list[Command], above: str = "") -> list[str]:
    found = []
    for command in commands:
        name = f"{above} {command.name}".strip()
        found += _paths(list(command.subcommands), name) if command.subcommands else [name]
    return found


def test_every_command_is_in_docs_cli_md() -> None:
    manual = DOCS.read_text()
    for path in _paths(COMMANDS):
        assert f"stepstream {path} " in manual, f"docs/cli.md has no example of {path!r}"
        assert f"`{path.split()[0]}`" in manual, f"docs/cli.md's table lacks {path!r}"


def test_every_command_takes_json_and_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    for path in _paths(COMMANDS):
        with pytest.raises(SystemExit) as done:
            parser().parse_args([*path.split(), "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: stepstream {path} " in text
        assert "--json" in text, f"stepstream {path} has no --json"


def test_an_unknown_flag_is_refused_with_its_commands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args, extra = parser().parse_known_args(["topics", "create", "--partitions", "1", "--nope"])
    assert extra == ["--nope"] and args.command_name == "topics create"
    with pytest.raises(SystemExit):
        args.command_parser.error("unrecognized arguments: --nope")
    assert "usage: stepstream topics create " in capsys.readouterr().err


def test_the_table_refuses_a_name_twice_and_a_command_without_a_handler() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        build_parser("x", "", [Command("a", "", lambda a: 0), Command("a", "", lambda a: 0)])
    with pytest.raises(ValueError, match="neither a handler nor subcommands"):
        build_parser("x", "", [Command("a", "")])


def test_the_next_page_hint_repeats_the_command_with_the_new_cursor_and_no_token() -> None:
    from stepstream.ops.cli.listing import _next_page

    argv = ["list", "--order", "oldest", "--after", "old/c", "--token", "s3cret", "--limit", "5"]
    hint = _next_page(argparse.Namespace(argv=argv), "2024-05-01T10:00:00+00:00/o 1")
    assert hint == (
        "stepstream list --order oldest --token TOKEN --limit 5 "
        "--after '2024-05-01T10:00:00+00:00/o 1'"
    )
    equals = _next_page(argparse.Namespace(argv=["list", "--token=s3cret", "--after=x"]), "y")
    assert equals == "stepstream list --token=TOKEN --after y"
