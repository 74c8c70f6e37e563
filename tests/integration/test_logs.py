"""`--log-format json`: one JSON object per line, with the instance, workflow, step,
attempt, partition and trace id as fields on a line about a step attempt."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

from stepstream.producers.client import Client
from tests.dev_server import run_cli, start_dev

WORKFLOWS = textwrap.dedent(
    """
    from stepstream import Context, RetryPolicy, workflow

    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient")
        return "ok"

    @workflow("shaky")
    async def shaky(ctx: Context, _: None) -> str:
        return await ctx.step("call", flaky, retry=RetryPolicy(initial_interval=0.01))
    """
)


async def test_json_lines_carry_the_instance_and_its_trace(tmp_path: Path) -> None:
    server = start_dev(tmp_path, "shaky", WORKFLOWS, "--log-format", "json")
    tracer = TracerProvider().get_tracer("test")
    try:
        async with Client.connect(server.url) as client:
            with tracer.start_as_current_span("order") as span:
                instance_id = await client.start("shaky", None, instance_id="s1")
            assert await client.result(instance_id, timeout=30) == "ok"
    finally:
        server.stop()
    lines = [json.loads(line) for line in server.log.read_text().splitlines() if line]
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    (failed,) = [line for line in lines if line["msg"].startswith("step failed")]
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert failed["level"] == "INFO"
    assert {k: failed[k] for k in ("instance_id", "workflow", "step", "attempt", "trace_id")} == {
        "instance_id": "s1",
        "workflow": "shaky",
        "step": "call",
        "attempt": 1,
        "trace_id": trace_id,
    }
    assert isinstance(failed["partition"], int)


def test_a_bad_log_format_is_refused(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "list", "--log-format", "xml")
    assert result.returncode == 2
    assert "invalid choice: 'xml'" in result.stderr
