"""The options several commands share, and how the commands read them: logging, the
engine to talk to (``--connect``), the payload codec (``--codec``), the API a server
offers, Kafka's settings, JSON flags and the working directory on the import path."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.codec import PayloadCodec, parse_json_text
from stepstream.ops import event_loop
from stepstream.ops.api.limits import DEFAULT_MAX_PENDING, MAX_PENDING_ENV
from stepstream.ops.cli.payload_codecs import load_codec
from stepstream.ops.cli.table import Arg, UsageError, arg
from stepstream.ops.telemetry import logs
from stepstream.producers.client import DEFAULT_CONNECT, Client, known_schemes

# Transports that live outside producers.http and are imported only when asked for:
# the embedded one opens RocksDB, which a client talking HTTP never needs.
_TRANSPORT_MODULES = {"embedded": "stepstream.ops.embedded", "kafka": "stepstream.producers.kafka"}

LOGGING = (
    arg(
        "--log-level",
        help="DEBUG, INFO, WARNING or ERROR (default: $STEPSTREAM_LOG_LEVEL, "
        "else INFO for dev and worker, WARNING otherwise)",
    ),
    arg(
        "--log-format",
        type=str.lower,  # as $STEPSTREAM_LOG_FORMAT and --log-level take any case
        choices=logs.FORMATS,
        help="text (key=value) or json: one object per line with instance_id, workflow, "
        "step, attempt, partition, trace_id and span_id as fields when a line concerns "
        "them, and a failure's traceback in exception; see docs/operations.md#logs "
        "(default: $STEPSTREAM_LOG_FORMAT, else text)",
    ),
)

JSON = (arg("--json", action="store_true", help="print JSON only (machine-readable)"),)


CODEC_ENV = "STEPSTREAM_CODEC"


def codec_option(what_it_does: str) -> tuple[Arg, ...]:
    """``--codec``, its help saying what the command does with the codec."""
    return (
        arg(
            "--codec",
            metavar="MODULE:OBJECT",
            help="the payload codec: MODULE:OBJECT names a stepstream.PayloadCodec, or a "
            "class or function of no arguments that returns one, imported from the working "
            f"directory (e.g. examples.aes_gcm_codec:codec; default: ${CODEC_ENV}, else "
            f"JSON; docs/encryption.md). {what_it_does}",
        ),
    )


# For the commands that run workflows: dev, worker, run.
CODEC = codec_option(
    "Every input, step result, event and result is encoded with it before it is recorded "
    "and decoded with it when read; the HTTP API and the web UI serve decoded values"
)

CONNECT = (
    arg(
        "--connect",
        metavar="URL",
        help="engine to talk to: http://HOST:PORT, https://HOST:PORT, embedded:PATH or "
        "kafka://HOST:PORT?prefix=P, whose Kafka client properties (TLS, SASL) come from "
        "the STEPSTREAM_KAFKA_* variables and $STEPSTREAM_KAFKA_CONFIG as a worker's do "
        f"(default: $STEPSTREAM_CONNECT, else {DEFAULT_CONNECT})",
    ),
    arg(
        "--token",
        metavar="TOKEN",
        help="the API's bearer token, for servers started with one "
        "(default: $STEPSTREAM_API_TOKEN)",
    ),
    arg(
        "--tls-ca",
        metavar="FILE",
        help="a CA certificate (PEM) to trust for https:// besides the system's "
        "(default: $STEPSTREAM_TLS_CA)",
    ),
    *codec_option(
        "With --connect embedded:DIR it encodes what is sent and decodes what is read; with "
        "kafka:// it encodes what is sent (the workers decode what is read, with theirs); "
        "over http(s):// the server's codec applies (start the server with --codec), so the "
        f"flag is refused there and ${CODEC_ENV} ignored"
    ),
)

SERVING = (
    arg(
        "--api-token",
        "--token",
        dest="api_token",
        metavar="TOKEN",
        help="bearer token every API request must carry (default: $STEPSTREAM_API_TOKEN; "
        "prefer the variable: flags show in ps). Required to serve beyond loopback",
    ),
    arg(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without a token (a trusted network only; also "
        "STEPSTREAM_INSECURE=1)",
    ),
    arg(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients reach the API by, besides loopback, IP addresses, --host "
        "and the advertised URL (repeatable; also $STEPSTREAM_ALLOWED_HOSTS, comma-separated; "
        "*.example.com for any name below example.com, * for any). Requests for other "
        "names are refused (DNS rebinding)",
    ),
    arg(
        "--public-url",
        action="append",
        default=[],
        metavar="URL",
        help="a URL browsers reach the API and UI at through a proxy, e.g. "
        "https://flows.example.com behind an Ingress that terminates TLS: pages under it "
        "may call the API (their Origin is this server's own) and its host is allowed "
        "(repeatable; also $STEPSTREAM_PUBLIC_URL, comma-separated). Without it a plain-"
        "http server refuses https:// origins",
    ),
    arg(
        "--tls-cert",
        metavar="FILE",
        help="serve https with this certificate chain, PEM (default: $STEPSTREAM_TLS_CERT)",
    ),
    arg(
        "--tls-key",
        metavar="FILE",
        help="the certificate's private key, PEM (default: $STEPSTREAM_TLS_KEY)",
    ),
    arg(
        "--max-pending",
        type=int,
        metavar="N",
        help="calls and result waits the API holds at once, over all its clients (about "
        "3 KB each); more are refused at once with ServerBusy, HTTP 503 with Retry-After "
        f"(default: ${MAX_PENDING_ENV} or {DEFAULT_MAX_PENDING})",
    ),
)

KAFKA = (
    arg(
        "--bootstrap",
        metavar="H:P",
        help="Kafka bootstrap servers (default: $STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS)",
    ),
    arg("--prefix", help="topic prefix (default: $STEPSTREAM_PREFIX or stepstream)"),
    arg(
        "--kafka-config",
        metavar="FILE",
        help="client properties, key=value lines with librdkafka names "
        "(default: $STEPSTREAM_KAFKA_CONFIG)",
    ),
    arg(
        "--kafka-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a client property by its librdkafka name, e.g. security.protocol=SASL_SSL "
        "(repeatable). Each is also read from STEPSTREAM_KAFKA_<NAME> (. as _): TLS and "
        "SASL/SCRAM take STEPSTREAM_KAFKA_SECURITY_PROTOCOL (SSL or SASL_SSL), "
        "_SSL_CA_LOCATION, _SASL_MECHANISM (e.g. SCRAM-SHA-512), _SASL_USERNAME and "
        "_SASL_PASSWORD (prefer the variables for secrets: flags show in ps); see "
        "docs/kafka.md#security-tls-and-saslscram",
    ),
)


def with_client(
    args: argparse.Namespace,
    command: Callable[[Client], Awaitable[int]],
    codec: PayloadCodec | None = None,
) -> int:
    """Runs ``command`` with a client of ``--connect`` on the servers' event loop, with
    ``codec`` (else the one ``client_codec`` loads)."""
    url = connect_url(args)
    scheme = url.split(":", 1)[0]
    module = _TRANSPORT_MODULES.get(scheme)
    if module is not None:
        importlib.import_module(module)  # registers its scheme: checked next
    if scheme not in known_schemes():
        given = "--connect" if args.connect else "$STEPSTREAM_CONNECT"
        raise UsageError(
            f"{given} {url!r} has no scheme stepstream knows ({scheme!r}); use "
            "embedded:PATH, http://HOST:PORT, https://HOST:PORT or kafka://HOST:PORT?prefix=P"
        )
    if scheme == "embedded":
        if args.command_name not in _CREATE_DATA:
            _check_data_dir(url)
        put_cwd_on_path()  # it imports $STEPSTREAM_WORKFLOWS, as `run` and `dev` would
    options: dict[str, Any] = {}
    if scheme in ("http", "https", "kafka"):
        # Without the flags the transports read STEPSTREAM_API_TOKEN / STEPSTREAM_TLS_CA.
        options = {"token": args.token, "tls_ca": args.tls_ca}
    codec = codec or client_codec(args)
    if codec is not None:
        options["codec"] = codec

    async def go() -> int:
        async with Client.connect(url, **options) as client:
            return await command(client)

    return event_loop.run(go())


# The client commands that may make an embedded data directory; the others need one.
_CREATE_DATA = frozenset({"start", "schedule create"})


def _check_data_dir(url: str) -> None:
    """Refuse an ``embedded:PATH`` with nothing at PATH: opening it would make an empty
    data directory (a typo becomes a second engine's data) and find nothing there."""
    from stepstream.ops.embedded import DEFAULT_DATA_DIR

    path = url.split(":", 1)[1] or DEFAULT_DATA_DIR
    if not os.path.isdir(path):
        raise UsageError(
            f"there is no data directory at {path!r} (from {url!r}); check the path, or "
            f"make one with `stepstream start WORKFLOW --connect {url}`"
        )


def connect_url(args: argparse.Namespace) -> str:
    """``--connect``, else STEPSTREAM_CONNECT, else the local ``stepstream dev``."""
    return str(args.connect or os.environ.get("STEPSTREAM_CONNECT") or DEFAULT_CONNECT)


def kafka_settings(args: argparse.Namespace) -> Any:
    from stepstream.engine.config.kafka import KafkaSettings

    return KafkaSettings.load(
        args.bootstrap, args.prefix, config_file=args.kafka_config, options=args.kafka_opt
    )


def json_flag(text: str | None, flag: str) -> Any:
    """The JSON value of ``flag`` (None if not given); a usage error saying how to quote."""
    if text is None:
        return None
    try:
        return parse_json_text(text, what=flag)
    except InvalidPayload as exc:
        raise UsageError(
            f'{exc}; pass JSON quoted for the shell, e.g. {flag} \'{{"key": "value"}}\''
        ) from None


def timeout_flag(value: float | None, flag: str = "--timeout") -> float | None:
    if value is not None and not 0 < value < math.inf:
        raise UsageError(f"{flag} must be a positive number of seconds, got {value:g}")
    return value


def decodes_remotely(args: argparse.Namespace) -> bool:
    """Whether the engine ``--connect`` names decodes what this client reads (http(s)://,
    and kafka://, whose reads the workers answer) rather than this process (embedded:)."""
    return connect_url(args).split(":", 1)[0] in ("http", "https", "kafka")


def client_codec(args: argparse.Namespace) -> PayloadCodec | None:
    """The codec a client command encodes and decodes with: ``codec_from_args``, except
    over http(s), where the server's applies (the flag is refused, the variable ignored)."""
    url = connect_url(args)
    if url.split(":", 1)[0] not in ("http", "https"):
        return codec_from_args(args)
    if getattr(args, "codec", None):
        raise UsageError(
            f"--codec does not apply to {url}: over http(s) the server encodes and decodes "
            "payloads with its own codec; start the server (stepstream dev or worker) with "
            "--codec, or connect with embedded:DIR or kafka://"
        )
    return None


def codec_from_args(args: argparse.Namespace) -> PayloadCodec | None:
    """The codec ``--codec`` (else STEPSTREAM_CODEC) names, loaded; None for neither (the
    JSON codec). A name that does not load is a usage error saying why."""
    if getattr(args, "codec", None):
        spec, flag = str(args.codec), "--codec"
    else:
        spec, flag = os.environ.get(CODEC_ENV, "").strip(), f"${CODEC_ENV}"
    if not spec:
        return None
    put_cwd_on_path()
    return load_codec(spec, flag)


def put_cwd_on_path() -> None:
    # `stepstream run mymod:fn` from a project directory must find mymod, as `python -m`
    # would; a console script does not put the working directory on sys.path by itself.
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
