"""The ``stepstream`` command line.

``run`` runs one workflow to completion on a throwaway embedded engine, ``dev`` serves
the embedded engine and its HTTP API, and the instance commands (``start``, ``send``,
``cancel``, ``pause``, ``resume``, ``status``, ``history``, ``list``) drive any engine
``Client.connect`` can reach. Exit codes: 0 done, 1 stepstream refused or failed (the
message is on stderr), 2 the command line itself is wrong and nothing was sent.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from stepstream.engine.api.workflow import Registry, WorkflowDefinition, definition_of
from stepstream.engine.errors import InvalidPayload, StepstreamError
from stepstream.engine.reads.listing import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from stepstream.engine.reads.views import InstanceStatus, Wait
from stepstream.engine.replay.state import Status
from stepstream.engine.wire.codec import parse_json_text
from stepstream.ops import event_loop
from stepstream.ops.api.routes import DEFAULT_MAX_BODY_BYTES, make_app
from stepstream.ops.api.security import ApiSecurity, InsecureBind
from stepstream.ops.api.serving import address, api_runner, reachable
from stepstream.ops.api.serving import listen as _listen
from stepstream.ops.api.serving import stop_on_signals as _stop_on_signals
from stepstream.ops.gc_tuning import tune_for_serving
from stepstream.ops.telemetry import logs, tracing
from stepstream.ops.telemetry.metrics import Health, observability_for
from stepstream.ops.tools.timeline import render_timeline
from stepstream.producers.client import DEFAULT_CONNECT, Client
from stepstream.producers.http import wire as _http  # registers http(s):// with Client.connect

log = logging.getLogger("stepstream.cli")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Transports that live outside producers.http and are imported only when asked for:
# the embedded one opens RocksDB, which a client talking HTTP never needs.
_TRANSPORT_MODULES = {"embedded": "stepstream.ops.embedded", "kafka": "stepstream.producers.kafka"}


class _UsageError(Exception):
    """Something on the command line is wrong; nothing was sent (exit 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said with the usage of the command they were given to, not the top level's
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    default_level = "INFO" if args.command in ("dev", "worker") else "WARNING"
    level = (args.log_level or os.environ.get("STEPSTREAM_LOG_LEVEL") or default_level).upper()
    if level not in _LOG_LEVELS:
        print(f"error: log level {level!r} is not one of {', '.join(_LOG_LEVELS)}", file=sys.stderr)
        return EXIT_USAGE
    log_format = (args.log_format or os.environ.get("STEPSTREAM_LOG_FORMAT") or "text").lower()
    if log_format not in logs.FORMATS:
        print(
            f"error: log format {log_format!r} is not one of {', '.join(logs.FORMATS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    logs.configure(level, log_format, process=_process_index(args))
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StepstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``stepstream history ID | head``): not an error of ours.
        # Output still buffered would fail again at exit, so it goes nowhere instead.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_ERROR


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The (sub)parser of the command ``args`` were parsed for (``topics create``'s...)."""
    while True:
        found = next(
            (
                action.choices[chosen]
                for action in parser._actions
                if isinstance(action, argparse._SubParsersAction)
                and isinstance(action.choices, dict)
                and (chosen := getattr(args, action.dest, None)) in action.choices
            ),
            None,
        )
        if found is None:
            return parser
        parser = found


def _log_serving(url: str) -> None:
    """What a serving process logs once it listens at ``url``: where its web UI is (a
    URL a browser can open) and the event loop it runs on."""
    log.info("web UI at %s/ui", reachable(url))
    log.info("event loop=%s", event_loop.running_loop_name())


def _process_index(args: argparse.Namespace) -> int | None:
    """Which engine process of `stepstream dev --processes N` this is, if it is one."""
    if args.command != "dev" or getattr(args, "processes", 1) <= 1:
        return None
    from stepstream.ops.processes import SPEC_ENV, Spec

    spec = os.environ.get(SPEC_ENV)
    return Spec.from_env(spec).process if spec else 0


# ---- run ------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    value = _json_flag(args.input, "--input")
    definition = _load_workflow(args.target)
    return event_loop.run(_run_once(definition, value, args))


async def _run_once(definition: WorkflowDefinition, value: Any, args: argparse.Namespace) -> int:
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
        engine = await open_embedded(registry, config)
        try:
            client = Client(engine.transport)
            instance_id = await client.start(definition.name, value)
            error: StepstreamError | None = None
            result: Any = None
            try:
                result = await client.result(instance_id, timeout=args.timeout)
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
            out.update(_http.error_to_wire(error))
        out["history"] = [entry.to_json() for entry in history]
        _print_json(out)
    else:
        pairs = [
            ("instance", instance_id),
            ("workflow", f"{status.workflow} v{status.version}"),
            ("status", status.status),
        ]
        if error is None:
            pairs.append(("result", _compact(result)))
        print(_key_values(pairs))
        print()
        print(render_timeline(history))
    if error is not None:
        raise error
    return EXIT_OK


def _load_workflow(target: str) -> WorkflowDefinition:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise _UsageError(f"expected MODULE:FUNC (e.g. examples.order:order), got {target!r}")
    _put_cwd_on_path()
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


# ---- dev ------------------------------------------------------------------------------


def _dev(args: argparse.Namespace) -> int:
    _put_cwd_on_path()
    registry = Registry()
    registry.add_modules(args.workflows)
    tune_for_serving()
    return event_loop.run(_serve(registry, args))


async def _serve(registry: Registry, args: argparse.Namespace) -> int:
    from stepstream.ops import processes
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.ops.embedded_sources import start_embedded_sources

    config = EmbeddedConfig.from_env(data_dir=args.data, partitions=args.partitions)
    if args.processes < 1:
        raise _UsageError(f"--processes must be 1 or more, got {args.processes}")
    security = _api_security(args)
    tls = security.ssl_context()
    spec = os.environ.get(processes.SPEC_ENV)
    if spec:  # one of the engine processes of a `stepstream dev --processes N`
        return await processes.serve_child(
            registry,
            config,
            processes.Spec.from_env(spec),
            _public_app(args, config, security),
            tls,
        )
    if args.processes > 1:
        return await _serve_processes(registry, args, config, security)
    sock = _listen(args.host, args.port)
    engine = await open_embedded(registry, config)
    traced = tracing.setup(engine.host, service="stepstream-dev")
    sources = None
    try:
        sources = await start_embedded_sources(registry, engine)
        app = make_app(
            engine.transport,
            registry_names=engine.host.registry.names,
            # Leave room above the payload limit so an oversized payload gets the
            # engine's precise message rather than a bare body-size refusal.
            max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * config.max_payload_bytes),
            security=security,
            served_hosts=(args.host,),
            observability=observability_for(
                engine.host,
                Health(
                    ready=lambda: engine.db.failure is None,
                    reason=lambda: f"the data directory failed: {engine.db.failure}",
                ),
                source_lag=lambda: sources.lag.records() if sources is not None else {},
            ),
        )
        runner = api_runner(app)
        await runner.setup()
        with _stop_on_signals() as stop:
            try:
                await web.SockSite(runner, sock, ssl_context=tls).start()
                url = f"{security.scheme}://{address(sock)}"
                print(
                    f"stepstream dev listening on {url} (data {config.data_dir}, "
                    f"{engine.host.partitions} partitions, workflows: "
                    f"{_workflow_names(registry)})",
                    flush=True,
                )
                _log_serving(url)
                # A full or damaged disk stops the engine: it says why and what to do.
                signalled = asyncio.ensure_future(stop.wait())
                failed = asyncio.ensure_future(engine.db.failed())
                await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
                for task in (signalled, failed):
                    task.cancel()
                if failed.done() and not failed.cancelled():
                    # Requests waiting on the engine (a command being applied, a result)
                    # would wait out the shutdown timeout: end them now (0 is no limit).
                    if runner.server is not None:
                        await runner.server.shutdown(0.5)
                    raise failed.result()
                log.info("shutting down url=%s", url)
            finally:
                await runner.cleanup()
    finally:
        sock.close()
        if sources is not None:
            await sources.stop()
        await engine.close()
        if traced is not None:
            traced.close()  # exports the spans still batched
    return EXIT_OK


def _public_app(
    args: argparse.Namespace, config: Any, security: ApiSecurity
) -> Callable[[Any, Any, Any], web.Application]:
    """How an engine process of `stepstream dev --processes N` makes the API clients use."""

    def public_app(transport: Any, engine: Any, observability: Any) -> web.Application:
        return make_app(
            transport,
            registry_names=engine.host.registry.names,
            max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * config.max_payload_bytes),
            security=security,
            served_hosts=(args.host,),
            observability=observability,
        )

    return public_app


async def _serve_processes(
    registry: Registry, args: argparse.Namespace, config: Any, security: ApiSecurity
) -> int:
    from stepstream.ops import processes

    public_app = _public_app(args, config, security)

    def announce(address: str, layout: processes.ProcessLayout) -> None:
        print(
            f"stepstream dev listening on {security.scheme}://{address} (data "
            f"{config.data_dir}, {layout.partitions} partitions in {layout.processes} "
            f"processes, workflows: {_workflow_names(registry)})",
            flush=True,
        )
        _log_serving(f"{security.scheme}://{address}")

    sock = _listen(args.host, args.port)
    try:
        return await processes.serve_parent(
            registry, config, args.processes, sock, public_app, security.ssl_context(), announce
        )
    finally:
        sock.close()


def _workflow_names(registry: Registry) -> str:
    return ", ".join(f"{name} v{'/'.join(versions)}" for name, versions in registry.names().items())


def _api_security(args: argparse.Namespace) -> ApiSecurity:
    """The API's access settings from the server flags and STEPSTREAM_* variables;
    refused (exit 2) when they would open the API to anyone."""
    security = ApiSecurity.from_env(
        token=args.api_token,
        insecure=True if args.insecure else None,
        allowed_hosts=args.allowed_host,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    try:
        security.check_bind(args.host)
    except InsecureBind as exc:
        raise _UsageError(str(exc)) from None
    return security


# ---- commands on a running engine ------------------------------------------------------


def _with_client(args: argparse.Namespace, command: Callable[[Client], Awaitable[int]]) -> int:
    scheme = args.connect.split(":", 1)[0]
    module = _TRANSPORT_MODULES.get(scheme)
    if module is not None:
        importlib.import_module(module)
    options: dict[str, Any] = {}
    if scheme in ("http", "https", "kafka"):
        # Without the flags the transports read STEPSTREAM_API_TOKEN / STEPSTREAM_TLS_CA.
        options = {"token": args.token, "tls_ca": args.tls_ca}

    async def go() -> int:
        async with Client.connect(args.connect, **options) as client:
            return await command(client)

    return event_loop.run(go())


def _start(args: argparse.Namespace) -> int:
    value = _json_flag(args.input, "--input")
    if args.id is not None and not args.id.strip():
        raise _UsageError("--id is empty; give an instance id, or leave --id out for a new uuid")
    if args.version is not None and not args.version.strip():
        raise _UsageError("--version is empty; give a deployed version, or leave it out")
    if args.timeout is not None and not args.wait:
        raise _UsageError("--timeout only applies with --wait")
    if args.timeout is not None and args.timeout <= 0:
        raise _UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")

    async def command(client: Client) -> int:
        instance_id = await client.start(
            args.workflow, value, instance_id=args.id, version=args.version
        )
        if not args.wait:
            _output(args, {"instance_id": instance_id}, instance_id)
            return EXIT_OK
        result = await client.result(instance_id, timeout=args.timeout)
        out = {"instance_id": instance_id, "status": "completed", "result": result}
        _output(args, out, _key_values([(k, _compact(v)) for k, v in out.items()]))
        return EXIT_OK

    return _with_client(args, command)


def _send(args: argparse.Namespace) -> int:
    value = _json_flag(args.payload, "--payload")

    async def command(client: Client) -> int:
        await client.send_event(args.id, args.event, value, event_id=args.event_id)
        print(f"sent {args.event} to {args.id}")
        return EXIT_OK

    return _with_client(args, command)


def _cancel(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        await client.cancel(args.id, reason=args.reason)
        print(f"cancelled {args.id}")
        return EXIT_OK

    return _with_client(args, command)


def _pause(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        await client.pause(args.id)
        print(f"paused {args.id}")
        return EXIT_OK

    return _with_client(args, command)


def _resume(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        await client.resume(args.id)
        print(f"resumed {args.id}")
        return EXIT_OK

    return _with_client(args, command)


def _status(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        status = await client.status(args.id)
        _output(args, status.to_json(), _describe_status(status))
        return EXIT_OK

    return _with_client(args, command)


def _history(args: argparse.Namespace) -> int:
    async def command(client: Client) -> int:
        history = await client.history(args.id)
        if args.export is not None:
            from stepstream.ops.tools.history_export import records_from_entries, write_export

            records = records_from_entries(args.id, history)
            write_export(args.export, args.id, records)
            done = {"instance_id": args.id, "records": len(records), "file": args.export}
            _output(args, done, f"wrote {len(records)} records of {args.id} to {args.export}")
            return EXIT_OK
        _output(args, [entry.to_json() for entry in history], render_timeline(history))
        return EXIT_OK

    return _with_client(args, command)


def _list(args: argparse.Namespace) -> int:
    paged = args.limit is not None or args.after or args.workflow or args.prefix
    if args.limit is not None and not 1 <= args.limit <= MAX_PAGE_SIZE:
        raise _UsageError(f"--limit must be from 1 to {MAX_PAGE_SIZE}, got {args.limit}")

    async def command(client: Client) -> int:
        cursor = None
        if not paged:
            instances = await client.list(status=args.status)
        else:
            page = await client.list_page(
                status=args.status,
                workflow=args.workflow,
                prefix=args.prefix or "",
                after=args.after,
                limit=args.limit or DEFAULT_PAGE_SIZE,
            )
            instances, cursor = page.instances, page.next
        if args.diverged:
            instances = [i for i in instances if i.diverged]
        text = _table(instances)
        if cursor is not None:
            text += f"\nnext page: --after {cursor}"
        out: Any = [i.to_json() for i in instances]
        if paged:
            out = {"instances": out, "next": cursor}
        _output(args, out, text)
        return EXIT_OK

    return _with_client(args, command)


def _replay(args: argparse.Namespace) -> int:
    if args.from_offset is not None and args.bootstrap is None:
        raise _UsageError("--from-offset only applies with --bootstrap")
    if args.from_offset is not None and args.from_offset < 0:
        raise _UsageError(f"--from-offset must be 0 or more, got {args.from_offset}")
    if args.until_seq is not None:
        if args.until_seq < 1:
            raise _UsageError(f"--until-seq must be 1 or more, got {args.until_seq}")
        if args.instance is None and (args.file is None or len(args.file) != 1):
            raise _UsageError(
                "--until-seq replays one instance: give --instance ID (or one --file)"
            )
    if args.connect is not None and args.connect.startswith("embedded:"):
        raise _UsageError(
            "replay reads an embedded data directory read-only with --data DIR; "
            "--connect embedded: would open it for writing"
        )
    from stepstream.ops.tools.replay import command as replay

    _put_cwd_on_path()
    return replay.main(args)


# ---- Kafka mode -------------------------------------------------------------------------


def _kafka_settings(args: argparse.Namespace) -> Any:
    from stepstream.engine.config.kafka import KafkaSettings

    return KafkaSettings.load(
        args.bootstrap, args.prefix, config_file=args.kafka_config, options=args.kafka_opt
    )


def _worker(args: argparse.Namespace) -> int:
    _put_cwd_on_path()
    registry = Registry()
    registry.add_modules(args.workflows)
    tune_for_serving()
    return event_loop.run(_run_worker(registry, args))


async def _run_worker(registry: Registry, args: argparse.Namespace) -> int:
    from stepstream.ops.kafka_worker import KafkaWorker, KafkaWorkerConfig

    settings = _kafka_settings(args)
    traced = tracing.from_env(service="stepstream-worker")
    config = KafkaWorkerConfig.from_env(
        settings,
        state_dir=args.state_dir,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        api=_api_security(args),
        span_sink=traced.exporter if traced is not None else None,
    )
    worker = KafkaWorker(registry, config)
    await worker.start()
    with _stop_on_signals() as signalled:
        try:
            workflows = ", ".join(
                f"{name} v{'/'.join(versions)}" for name, versions in registry.names().items()
            )
            print(
                f"stepstream worker listening on {worker.url} (prefix {settings.prefix}, "
                f"{worker.host.partitions} partitions, state {config.state_dir}, "
                f"workflows: {workflows})",
                flush=True,
            )
            _log_serving(worker.url)
            stop = asyncio.ensure_future(signalled.wait())
            failed = asyncio.ensure_future(worker.run())
            await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (stop, failed):
                task.cancel()
            if failed.done() and not failed.cancelled() and failed.exception() is not None:
                raise StepstreamError(str(failed.exception()))
            log.info("shutting down url=%s", worker.url)
        finally:
            await worker.stop()
            if traced is not None:
                traced.close()  # exports the spans still batched
    return EXIT_OK


def _topics_create(args: argparse.Namespace) -> int:
    from stepstream.consumers.kafka import create_topics

    settings = _kafka_settings(args)
    states = create_topics(settings, args.partitions, replication=args.replication)
    rows = [{"topic": t.name, "partitions": t.partitions, "created": t.created} for t in states]
    human = "\n".join(
        f"{'created' if t.created else 'exists '} {t.name} ({t.partitions} "
        f"partition{'' if t.partitions == 1 else 's'})"
        for t in states
    )
    _output(args, rows, human)
    return EXIT_OK


_BENCH_DESCRIPTION = """\
measure throughput and latency through a real client path; prints one JSON object.

clients:
  inprocess  the embedded engine in the bench process, the in-process client
  http       `stepstream dev` (embedded) as a subprocess, driven by an http:// client
  kafka      `stepstream worker` subprocess(es) on fresh topics, driven by a kafka://
             client (the test broker is started unless --bootstrap is given)

workloads (all three unless --workload):
  W1      N x 10 sequential steps started at once, results awaited (N=2000):
          steps_per_s, workflows_per_s, latency_p50_ms, latency_p99_ms, and
          burst_cpu_s (each process's CPU seconds during the timed burst: which one
          bound it); with --input-bytes B each instance's input carries B more bytes
  W2      N one-second sleepers started at once (N=2000): lateness_p50_ms,
          lateness_p99_ms and early_fires (timers fired before due; must be 0)
  W3      N instances waiting for an event a client sends (N=500)
  timers  --pending N timers on one engine, due 1/--rate s apart (1,000,000 at
          2,000/s): lateness and the engine's resident memory (rss_mb_*)
  buffer  N events sent in turn to one instance that asks for none yet (N=1000),
          then taken at once: events_per_s, send_first_tenth_p50_ms against
          send_last_tenth_p50_ms (--input-bytes B: B more bytes per event)
  fanout  one instance running N steps at once, one N sleeps, one N child
          workflows (N=4000): steps_per_s, sleeps_elapsed_s, children_per_s
  loop    one instance running a ctx.loop of N one-step iterations, one running
          2N steps first (N=1000): iterations_per_s_alone against
          iterations_per_s_after_steps (an iteration must not cost more later)

examples:
  stepstream bench --client http --workload W1 --json
  stepstream bench --client kafka --workers 2 --workload W1
  stepstream bench --workload timers --pending 100000 --rate 2000

Every workload's JSON has cpu_s: the CPU seconds each process (client, engine or
worker<i>, broker) used on it, follow-up measurements included.

The bench and the servers it starts run on uvloop unless STEPSTREAM_EVENT_LOOP=asyncio
(the standard library's loop, to compare); the JSON says which ("event_loop").
"""


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the benchmark registers its own workflows, which no other command needs.
    from stepstream.ops import bench

    tune_for_serving()
    return bench.main(args)


# ---- output ---------------------------------------------------------------------------


def _output(args: argparse.Namespace, as_json: Any, human: str) -> None:
    if args.json:
        _print_json(as_json)
    else:
        print(human)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _key_values(pairs: Sequence[tuple[str, str]]) -> str:
    width = max(len(key) for key, _ in pairs) + 1
    lines = []
    for key, value in pairs:
        label = f"{key}:"
        for line in value.splitlines() or [""]:
            lines.append(f"{label:<{width}} {line}".rstrip())
            label = ""
    return "\n".join(lines)


def _describe_status(status: InstanceStatus) -> str:
    pairs = [
        ("instance", status.instance_id),
        ("workflow", status.workflow),
        ("version", status.version),
        ("status", status.status),
        ("created", status.created_at),
        ("updated", status.updated_at),
        ("waits", "\n".join(_describe_wait(w) for w in status.waits) or "none"),
    ]
    if status.buffered_events:
        pairs.append(("buffered", f"{status.buffered_events} event(s) nobody waits for yet"))
    if status.error:
        pairs.append(("error", status.error))
    return _key_values(pairs)


def _describe_wait(wait: Wait) -> str:
    details = [wait.state]
    if wait.event:
        details.append(f"event {wait.event}")
    if wait.attempt:
        details.append(f"attempt {wait.attempt}")
    if wait.until:
        details.append(f"until {wait.until}")
    return f"{wait.kind} {wait.key} ({', '.join(details)})"


def _table(instances: Sequence[InstanceStatus]) -> str:
    if not instances:
        return "no instances"
    header = ("INSTANCE", "WORKFLOW", "VERSION", "STATUS", "CREATED", "UPDATED")
    rows = [header] + [
        (i.instance_id, i.workflow, i.version, i.status, i.created_at, i.updated_at)
        for i in instances
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# ---- plumbing -------------------------------------------------------------------------


def _json_flag(text: str | None, flag: str) -> Any:
    if text is None:
        return None
    try:
        return parse_json_text(text, what=flag)
    except InvalidPayload as exc:
        raise _UsageError(
            f'{exc}; pass JSON quoted for the shell, e.g. {flag} \'{{"key": "value"}}\''
        ) from None


def _put_cwd_on_path() -> None:
    # `stepstream run mymod:fn` from a project directory must find mymod, as `python -m`
    # would; a console script does not put the working directory on sys.path by itself.
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


_PROCESS_TUNING = (
    "It runs on uvloop, libuv's event loop ($STEPSTREAM_EVENT_LOOP=asyncio: the standard "
    "library's), with the garbage collector's thresholds raised ($STEPSTREAM_GC=default: "
    "Python's own)."
)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        help="DEBUG, INFO, WARNING or ERROR (default: $STEPSTREAM_LOG_LEVEL, "
        "else INFO for dev and WARNING otherwise)",
    )
    common.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        help="text (key=value) or json: one object per line with instance_id, workflow, "
        "step, attempt, partition and trace_id as fields when a line concerns them "
        "(default: $STEPSTREAM_LOG_FORMAT, else text)",
    )
    connect = argparse.ArgumentParser(add_help=False)
    connect.add_argument(
        "--connect",
        default=os.environ.get("STEPSTREAM_CONNECT", DEFAULT_CONNECT),
        metavar="URL",
        help="engine to talk to: http://HOST:PORT, https://HOST:PORT, embedded:PATH or "
        "kafka://HOST:PORT (default: $STEPSTREAM_CONNECT or %(default)s)",
    )
    connect.add_argument(
        "--token",
        metavar="TOKEN",
        help="the API's bearer token, for servers started with one "
        "(default: $STEPSTREAM_API_TOKEN)",
    )
    connect.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="a CA certificate (PEM) to trust for https:// besides the system's "
        "(default: $STEPSTREAM_TLS_CA)",
    )
    serving = argparse.ArgumentParser(add_help=False)
    serving.add_argument(
        "--api-token",
        "--token",
        dest="api_token",
        metavar="TOKEN",
        help="bearer token every API request must carry (default: $STEPSTREAM_API_TOKEN; "
        "prefer the variable: flags show in ps). Required to serve beyond loopback",
    )
    serving.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without a token (a trusted network only; also "
        "STEPSTREAM_INSECURE=1)",
    )
    serving.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients reach the API by, besides loopback, IP addresses, --host "
        "and the advertised URL (repeatable; also $STEPSTREAM_ALLOWED_HOSTS, comma-separated; "
        "* for any). Requests for other names are refused (DNS rebinding)",
    )
    serving.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve https with this certificate chain, PEM (default: $STEPSTREAM_TLS_CERT)",
    )
    serving.add_argument(
        "--tls-key",
        metavar="FILE",
        help="the certificate's private key, PEM (default: $STEPSTREAM_TLS_KEY)",
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON only")

    parser = argparse.ArgumentParser(
        prog="stepstream", description="Durable workflows for Python, event-sourced on Kafka."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str,
        handler: Callable[[argparse.Namespace], int],
        help: str,
        parents: Sequence[argparse.ArgumentParser] = (),
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, parents=[common, *parents])
        sub.set_defaults(handler=handler)
        return sub

    run = command(
        "run", _run, "run one workflow to completion on a throwaway embedded engine", [as_json]
    )
    run.add_argument(
        "target",
        metavar="MODULE:FUNC",
        help="the @workflow function to run (its ctx.publish(...) records go to the Kafka "
        "cluster named by STEPSTREAM_OUTBOX_BOOTSTRAP, HOST:PORT)",
    )
    run.add_argument("--input", metavar="JSON", help="the workflow's input (default: null)")
    run.add_argument("--data", metavar="DIR", help="data directory (default: a temporary one)")
    run.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds")

    dev = command(
        "dev",
        _dev,
        "serve the embedded engine, its HTTP API and the web UI (at /ui; it asks for the "
        "API token when one is set)",
        [serving],
    )
    dev.epilog = _PROCESS_TUNING
    dev.add_argument(
        "--workflows",
        required=True,
        metavar="MODULES",
        help="comma-separated modules whose @workflow functions are served; the topics "
        "they declare as Source(...) are read from the Kafka cluster named by "
        "STEPSTREAM_SOURCES_BOOTSTRAP (HOST:PORT; prefix from STEPSTREAM_PREFIX); their "
        "ctx.publish(...) records are produced to the Kafka cluster named by "
        "STEPSTREAM_OUTBOX_BOOTSTRAP (HOST:PORT; without it a publish fails)",
    )
    dev.add_argument(
        "--data", metavar="DIR", help="data directory (default: $STEPSTREAM_DATA or ./.stepstream)"
    )
    dev.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (%(default)s); beyond loopback it needs --api-token "
        "or --insecure",
    )
    dev.add_argument("--port", type=int, default=8233, help="port, 0 for any (%(default)s)")
    dev.add_argument(
        "--partitions",
        type=int,
        metavar="N",
        help="partitions of a new data directory (default: 4, or twice --processes)",
    )
    dev.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="engine processes sharing the partitions, to use N cores (default: 1). Each "
        "keeps its partitions in DATA/process-K and serves their API on a port of its own "
        "(GET /v1/processes lists them; the http:// client uses them); this process serves "
        "the API for all of them and starts the others again if they die. A data "
        "directory keeps the count it was made with",
    )

    start = command(
        "start",
        _start,
        "start an instance; returns once the command is durable (with kafka:// no worker "
        "needs to be running: the workflow name is checked against the workflows workers "
        "registered, and it runs when a worker owns its partition)",
        [connect, as_json],
    )
    start.add_argument("workflow", help="the workflow's name")
    start.add_argument("--input", metavar="JSON", help="the workflow's input (default: null)")
    start.add_argument(
        "--id",
        metavar="ID",
        help="instance id (default: a new uuid); starting an existing id does nothing",
    )
    start.add_argument(
        "--version",
        metavar="V",
        help="run this version of the workflow, one the engine still has (default: the "
        "latest: the highest when versions are whole numbers, else the last declared)",
    )
    start.add_argument("--wait", action="store_true", help="wait for the result and print it")
    start.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="with --wait, give up after S seconds (default: no limit)",
    )

    send = command(
        "send",
        _send,
        "send an event to an instance; returns once the command is durable (kafka://: "
        "without waiting for a worker)",
        [connect],
    )
    send.add_argument("id", metavar="ID")
    send.add_argument("event", metavar="EVENT")
    send.add_argument("--payload", metavar="JSON", help="the event's payload (default: null)")
    send.add_argument(
        "--event-id",
        metavar="ID",
        help="an id of your choosing: sending again with the same id applies the event once "
        "(for retries); no ':' in it",
    )

    cancel = command("cancel", _cancel, "cancel an instance", [connect])
    cancel.add_argument("id", metavar="ID")
    cancel.add_argument("--reason", default="", help="recorded with the cancellation")

    for name, handler, help in (
        ("pause", _pause, "pause an instance: it takes no further steps until resumed"),
        ("resume", _resume, "resume a paused instance"),
    ):
        command(name, handler, help, [connect]).add_argument("id", metavar="ID")

    command(
        "status", _status, "show an instance's status and what it waits for", [connect, as_json]
    ).add_argument("id", metavar="ID")
    history = command(
        "history", _history, "show an instance's history as a timeline", [connect, as_json]
    )
    history.add_argument("id", metavar="ID")
    history.add_argument(
        "--export",
        metavar="FILE",
        help="write the raw history as JSON (docs/history-export.md) for `stepstream replay "
        "--file` and stepstream.testing.replay",
    )
    listing = command("list", _list, "list instances", [connect, as_json])
    listing.add_argument("--status", choices=[s.value for s in Status])
    listing.add_argument("--workflow", metavar="NAME", help="only instances of this workflow")
    listing.add_argument("--prefix", metavar="TEXT", help="only instances whose id starts so")
    listing.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help=f"one page of at most N instances in id order (default {DEFAULT_PAGE_SIZE} "
        "once any of --workflow, --prefix, --after is given); prints the cursor of the next",
    )
    listing.add_argument(
        "--after", metavar="ID", help="the page after this instance id (the last page's cursor)"
    )
    listing.add_argument(
        "--diverged",
        action="store_true",
        help="only instances parked because their history no longer matches the deployed "
        "code (they stay running; deploy matching code and they go on)",
    )

    _replay_parser(command)

    kafka = argparse.ArgumentParser(add_help=False)
    kafka.add_argument(
        "--bootstrap",
        metavar="H:P",
        help="Kafka bootstrap servers (default: $STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS)",
    )
    kafka.add_argument("--prefix", help="topic prefix (default: $STEPSTREAM_PREFIX or stepstream)")
    kafka.add_argument(
        "--kafka-config",
        metavar="FILE",
        help="client properties, key=value lines with librdkafka names "
        "(default: $STEPSTREAM_KAFKA_CONFIG)",
    )
    kafka.add_argument(
        "--kafka-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a client property, e.g. security.protocol=SASL_SSL (repeatable; also "
        "STEPSTREAM_KAFKA_<NAME> variables, e.g. STEPSTREAM_KAFKA_SASL_MECHANISM)",
    )

    worker = command(
        "worker",
        _worker,
        "run workflows in a Kafka consumer group, and serve their reads and the web UI (at "
        "/ui, covering every worker's instances); on start it registers its workflows on "
        "<prefix>.definitions, so clients accept them from then on, even while no worker runs",
        [kafka, serving],
    )
    worker.epilog = (
        "Workers with one --prefix form one consumer group and share its partitions. "
        "Rebalances are incremental: a worker joining, or leaving on SIGTERM, moves only "
        "the partitions that change hands (their running steps finish first, up to "
        "$STEPSTREAM_DRAIN_TIMEOUT_S); the others keep running. Workers of a stepstream "
        "version with eager rebalancing cannot share the group: stop them all first. "
        + _PROCESS_TUNING
    )
    worker.add_argument(
        "--workflows",
        required=True,
        metavar="MODULES",
        help="comma-separated modules whose @workflow functions are run; the topics they "
        "declare as Source(...) are read as event sources (consumer group PREFIX.sources; "
        "STEPSTREAM_SOURCES_COMMIT_INTERVAL_S); their ctx.publish(...) records are "
        "produced to this cluster, or to STEPSTREAM_OUTBOX_BOOTSTRAP (HOST:PORT) if set",
    )
    worker.add_argument(
        "--state-dir",
        metavar="DIR",
        help="local state, one RocksDB per owned partition (default: $STEPSTREAM_STATE_DIR "
        "or ./.stepstream-worker)",
    )
    worker.add_argument(
        "--host",
        default="127.0.0.1",
        help="API address (%(default)s); beyond loopback it needs --api-token or --insecure",
    )
    worker.add_argument("--port", type=int, default=8233, help="API port, 0 for any (%(default)s)")
    worker.add_argument(
        "--advertise",
        metavar="URL",
        help="the API's URL as clients reach it (default: http://HOST:PORT as bound, "
        "https with --tls-cert); its host is allowed in Host headers",
    )

    topics = commands.add_parser("topics", help="manage the Kafka topics of a prefix")
    topic_commands = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION")
    create = topic_commands.add_parser(
        "create",
        help="create the topics of a prefix (idempotent); says what exists",
        description="create the topics of a prefix (idempotent; run it again after an "
        "upgrade that adds topics, such as <prefix>.definitions); says what exists",
        parents=[common, kafka, as_json],
    )
    create.set_defaults(handler=_topics_create)
    create.add_argument(
        "--partitions",
        type=int,
        required=True,
        metavar="N",
        help="partitions of each topic; every topic of a prefix has as many, and workers "
        "refuse topics whose counts differ. Instances are spread over them: more "
        "partitions, more workers can share the load",
    )
    create.add_argument(
        "--replication", type=int, default=1, metavar="R", help="replication factor (1)"
    )

    bench = command("bench", _bench, "measure throughput and latency (see docs)", [as_json])
    bench.formatter_class = argparse.RawDescriptionHelpFormatter
    bench.description = _BENCH_DESCRIPTION
    bench.add_argument(
        "--client",
        choices=("inprocess", "http", "kafka"),
        help="the client path to measure (default: inprocess, or kafka with --backend kafka)",
    )
    bench.add_argument(
        "--backend",
        choices=("embedded", "kafka"),
        help="embedded (clients inprocess, http) or kafka (client kafka); implied by --client",
    )
    bench.add_argument(
        "--bootstrap",
        metavar="H:P",
        help="Kafka bootstrap servers (default: start the test broker)",
    )
    bench.add_argument(
        "--workload",
        choices=("W1", "W2", "W3", "timers", "buffer", "fanout", "loop"),
        help="run only this one",
    )
    bench.add_argument("--n", type=int, metavar="N", help="instances per workload")
    bench.add_argument(
        "--data", metavar="DIR", help="where the engines keep their state (default: temp)"
    )
    bench.add_argument(
        "--sync-steps", action="store_true", help="W1 with sync step functions (thread pool)"
    )
    bench.add_argument(
        "--input-bytes",
        type=int,
        metavar="B",
        help="a string of B bytes in each W1 instance's input and each buffer event (0)",
    )
    bench.add_argument(
        "--partitions", type=int, metavar="N", help="partitions of the Kafka topics (4)"
    )
    bench.add_argument(
        "--workers",
        type=int,
        metavar="K",
        help="engine processes sharing the partitions: workers with --client kafka, "
        "`stepstream dev --processes K` with --client http (1)",
    )
    bench.add_argument(
        "--pending", type=int, metavar="N", help="timers pending at once, --workload timers"
    )
    bench.add_argument(
        "--rate", type=float, metavar="R", help="timers fired per second, --workload timers"
    )
    bench.add_argument(
        "--profile",
        metavar="DIR",
        help="sample every bench process with py-spy into DIR (collapsed stacks)",
    )
    return parser


def _replay_parser(command: Callable[..., argparse.ArgumentParser]) -> None:
    replay = command(
        "replay",
        _replay,
        "replay recorded histories against the current workflow code, with no side effects "
        "(no step runs, nothing is written): one line per instance, ok or where it diverges; "
        "exit status 1 on any divergence",
    )
    replay.add_argument(
        "--workflows",
        required=True,
        metavar="MODULES",
        help="comma-separated modules with the @workflow functions to check (the code to deploy)",
    )
    source = replay.add_argument_group("where the histories come from (one of)")
    sources = source.add_mutually_exclusive_group(required=True)
    sources.add_argument(
        "--data", metavar="DIR", help="an embedded data directory, opened read-only"
    )
    sources.add_argument(
        "--connect", metavar="URL", help="an engine's API: http(s)://HOST:PORT or kafka://..."
    )
    sources.add_argument(
        "--bootstrap", metavar="H:P", help="Kafka: read the <prefix>.history topic itself"
    )
    sources.add_argument(
        "--file",
        action="append",
        metavar="FILE",
        help="a file of `stepstream history ID --export FILE` (repeatable)",
    )
    source.add_argument(
        "--prefix",
        help="with --bootstrap: topic prefix (default: $STEPSTREAM_PREFIX or stepstream)",
    )
    source.add_argument(
        "--from-offset",
        type=int,
        metavar="N",
        help="with --bootstrap: read each partition from offset N (instances whose start "
        "is before it are skipped)",
    )
    source.add_argument(
        "--kafka-config", metavar="FILE", help="with --bootstrap: client properties"
    )
    source.add_argument(
        "--kafka-opt", action="append", default=[], metavar="KEY=VALUE", help="a client property"
    )
    source.add_argument("--token", metavar="TOKEN", help="with --connect: the API's bearer token")
    source.add_argument("--tls-ca", metavar="FILE", help="with --connect: a CA certificate (PEM)")
    which = replay.add_mutually_exclusive_group()
    which.add_argument("--instance", metavar="ID", help="replay this instance only")
    which.add_argument("--workflow", metavar="NAME", help="replay instances of this workflow only")
    replay.add_argument(
        "--until-seq",
        type=int,
        metavar="N",
        help="replay only the first N records of the instance (time travel)",
    )
    replay.add_argument(
        "--trace",
        action="store_true",
        help="print what the code saw at each ctx call: the recorded value, in order",
    )
    replay.add_argument("--json", action="store_true", help="print JSON only")


if __name__ == "__main__":
    sys.exit(main())
