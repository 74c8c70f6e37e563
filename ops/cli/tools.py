"""Tools on recorded histories: ``stepstream replay`` checks them against the code to
deploy (``ops.replay``); ``stepstream history ID --export FILE`` (in ``reads``) writes
the files it reads."""

from __future__ import annotations

import argparse

from stepstream.ops.cli.options import JSON, codec_from_args, codec_option, put_cwd_on_path
from stepstream.ops.cli.table import ArgGroup, Command, UsageError, arg


def _replay(args: argparse.Namespace) -> int:
    if args.from_offset is not None and args.bootstrap is None:
        raise UsageError("--from-offset only applies with --bootstrap")
    if args.from_offset is not None and args.from_offset < 0:
        raise UsageError(f"--from-offset must be 0 or more, got {args.from_offset}")
    if args.until_seq is not None:
        if args.until_seq < 1:
            raise UsageError(f"--until-seq must be 1 or more, got {args.until_seq}")
        if args.instance is None and (args.file is None or len(args.file) != 1):
            raise UsageError("--until-seq replays one instance: give --instance ID (or one --file)")
    if args.connect is not None and args.connect.startswith("embedded:"):
        raise UsageError(
            "replay reads an embedded data directory read-only with --data DIR; "
            "--connect embedded: would open it for writing"
        )
    from stepstream.ops.tools.replay import command as replay

    put_cwd_on_path()
    return replay.main(args, codec_from_args(args))


_SOURCES = ArgGroup(
    title="where the histories come from (one of)",
    members=(
        ArgGroup(
            exclusive=True,
            required=True,
            members=(
                arg("--data", metavar="DIR", help="an embedded data directory, opened read-only"),
                arg(
                    "--connect",
                    metavar="URL",
                    help="an engine's API: http(s)://HOST:PORT or kafka://...",
                ),
                arg(
                    "--bootstrap",
                    metavar="H:P",
                    help="Kafka: read the <prefix>.history topic itself",
                ),
                arg(
                    "--file",
                    action="append",
                    metavar="FILE",
                    help="a file of `stepstream history ID --export FILE` (repeatable)",
                ),
            ),
        ),
        arg(
            "--prefix",
            help="with --bootstrap: topic prefix (default: $STEPSTREAM_PREFIX or stepstream)",
        ),
        arg(
            "--from-offset",
            type=int,
            metavar="N",
            help="with --bootstrap: read each partition from offset N (instances whose start "
            "is before it are skipped)",
        ),
        arg("--kafka-config", metavar="FILE", help="with --bootstrap: client properties"),
        arg(
            "--kafka-opt",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a client property",
        ),
        arg("--token", metavar="TOKEN", help="with --connect: the API's bearer token"),
        arg("--tls-ca", metavar="FILE", help="with --connect: a CA certificate (PEM)"),
    ),
)

COMMANDS = (
    Command(
        "replay",
        "replay recorded histories against the current workflow code, with no side effects "
        "(no step runs, nothing is written): one line per instance, ok or where it "
        "diverges; exit status 1 on any divergence",
        _replay,
        epilog="example: stepstream replay --workflows examples.order --data ./.stepstream",
        args=(
            arg(
                "--workflows",
                required=True,
                metavar="MODULES",
                help="comma-separated modules with the @workflow functions to check (the "
                "code to deploy)",
            ),
            _SOURCES,
            ArgGroup(
                exclusive=True,
                members=(
                    arg("--instance", metavar="ID", help="replay this instance only"),
                    arg(
                        "--workflow", metavar="NAME", help="replay instances of this workflow only"
                    ),
                ),
            ),
            arg(
                "--until-seq",
                type=int,
                metavar="N",
                help="replay only the first N records of the instance (time travel)",
            ),
            arg(
                "--trace",
                action="store_true",
                help="print what the code saw at each ctx call: the recorded value, in order",
            ),
            *codec_option(
                "The recorded payloads are decoded with it: give the codec the engine that "
                "recorded them ran with (with --connect, the server decoded them and they "
                "are encoded again with this one)"
            ),
            *JSON,
        ),
    ),
)
