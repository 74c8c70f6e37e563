"""When Kafka's JVMs get the class-data archive: made once, then mapped; never with
``STEPSTREAM_BROKER_CDS=0``; skipped with a warning when it cannot be made. The JVM side
(a node maps it) is in tests/integration/test_apache_broker.py."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from stepstream.ops.brokers import BrokerError
from stepstream.ops.brokers.class_archive import ENV_CDS, archive_options, archive_path

JVM = ("-Xmx512m",)


def test_made_once_then_mapped(tmp_path: Path) -> None:
    made: list[Sequence[str]] = []

    def make(options: Sequence[str]) -> None:
        made.append(options)
        Path(options[0].split("=", 1)[1]).write_bytes(b"archive")  # as the JVM does at exit

    path = archive_path(tmp_path, sys.executable, JVM)
    assert archive_options(tmp_path, sys.executable, JVM, make) == [f"-XX:SharedArchiveFile={path}"]
    assert path.read_bytes() == b"archive"
    assert [o[0].startswith("-XX:ArchiveClassesAtExit=") for o in made] == [True]
    archive_options(tmp_path, sys.executable, JVM, make)
    assert len(made) == 1  # found, not made again
    # Other JVM flags, another archive: the JVM maps one only for what made it.
    assert archive_path(tmp_path, sys.executable, ("-Xmx1g",)) != path


def test_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CDS, "0")

    def make(options: Sequence[str]) -> None:
        raise AssertionError("nothing is made when turned off")

    assert archive_options(tmp_path, sys.executable, JVM, make) == []


def test_one_that_cannot_be_made_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def make(options: Sequence[str]) -> None:
        raise BrokerError("Apache Kafka node 0 exited with code 1 while starting")

    with caplog.at_level(logging.WARNING, logger="stepstream.broker"):
        assert archive_options(tmp_path, sys.executable, JVM, make) == []
    assert "starts without a class-data archive" in caplog.text
    assert f"{ENV_CDS}=0" in caplog.text
    assert list(tmp_path.glob("*.jsa*")) == [] and list(tmp_path.glob(".*.jsa*")) == []
