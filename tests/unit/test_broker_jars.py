"""Which jar directory counts as resolved: the one the pom lists now, so a directory
named by STEPSTREAM_BROKER_JARS and resolved from an older pom is resolved again."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepstream.ops.brokers import jars


def test_a_directory_resolved_from_another_pom_is_resolved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(jars.ENV_JARS, str(tmp_path))
    assert jars.jar_dir() == tmp_path
    assert not jars.is_resolved(tmp_path)  # nothing there yet
    (tmp_path / ".complete").write_text("kafka_2.13-4.3.1.jar\n")  # an older pom's marker
    assert not jars.is_resolved(tmp_path)
    (tmp_path / ".complete").write_text(jars._marker_head() + "kafka_2.13-4.3.1.jar\n")
    assert jars.is_resolved(tmp_path)
