"""Shared fixtures: a client over each backend, with the test workflows registered."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.workflow import Registry
from ops.embedded import EmbeddedConfig, open_embedded
from producers.client import Client


def test_registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.workflows")
    return registry


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ledger"
    root.mkdir()
    monkeypatch.setenv("STEPSTREAM_TEST_LEDGER", str(root))
    return root


@pytest.fixture(params=["embedded"])
async def client(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Client]:
    engine = await open_embedded(
        test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    async with Client(engine.make_transport(owns_engine=True)) as c:
        yield c
