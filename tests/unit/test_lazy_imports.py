"""``stepstream`` imports each public name when first asked for: every name resolves, and
importing the package (or starting the CLI) does not import the backends or servers a
process may never use."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import stepstream

# Modules a CLI command that only talks to an engine over HTTP must not pay for, and that
# ``import stepstream`` alone must not import: the RocksDB and Kafka clients, the HTTP
# server, the metrics and tracing SDKs.
HEAVY = ("rocksdict", "confluent_kafka", "aiohttp", "prometheus_client", "opentelemetry.sdk")


def _type_checking_names() -> set[str]:
    """The names ``stepstream/__init__.py`` imports for type checkers."""
    tree = ast.parse(Path(stepstream.__file__).read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    return {
        alias.asname or alias.name
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    assert sorted(stepstream.__all__) == sorted(stepstream._WHERE) == sorted(_type_checking_names())
    for name in stepstream.__all__:
        module = importlib.import_module(stepstream._WHERE[name])
        assert getattr(stepstream, name) is getattr(module, name), name
    assert set(stepstream.__all__) <= set(dir(stepstream))
    assert stepstream.__version__ and "__version__" in dir(stepstream)


def test_subpackages_are_reached_as_attributes_after_import_stepstream() -> None:
    code = "import stepstream\nprint(stepstream.errors.StepstreamError.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "StepstreamError", done.stderr[-2000:]


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        stepstream.Clinet  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError, match="Clinet"):
        exec("from stepstream import Clinet", {})


def _imported_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys\nprint('\\n'.join(m for m in sys.modules if m.startswith({HEAVY!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.split()


@pytest.mark.parametrize(
    "code",
    [
        "import stepstream",
        "from stepstream import Client, workflow, Context, RetryPolicy",
        "from stepstream.ops.cli.app import parser; parser()",
    ],
)
def test_importing_the_product_or_the_cli_leaves_backends_and_servers_alone(code: str) -> None:
    assert _imported_after(code) == []


def test_a_client_connects_to_each_built_in_scheme_without_importing_it_first(
    tmp_path: Path,
) -> None:
    """``from stepstream import Client`` is all a user imports: ``embedded:`` (whose
    transport lives with the engine, in ``ops``) and ``http://`` register on first use."""
    code = (
        "import asyncio, sys\n"
        "from stepstream import Client, ConnectionFailed\n"
        "async def main():\n"
        f"    async with Client.connect('embedded:{tmp_path / 'data'}') as client:\n"
        "        assert await client.list() == []\n"
        "    try:\n"
        "        async with Client.connect('http://127.0.0.1:9') as client:\n"
        "            await client.list()\n"
        "    except ConnectionFailed:\n"
        "        print('http: ConnectionFailed')\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "http: ConnectionFailed"
