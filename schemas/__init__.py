"""The Avro schemas of every stepstream record, shipped as package data (see README.md)."""

from __future__ import annotations

from pathlib import Path


def schema_root() -> Path:
    """The directory holding ``stepstream/<domain>/v<N>/<Record>.avsc``."""
    return Path(__file__).parent
