"""stepstream's version: one source of truth, the ``version`` of pyproject.toml.

Installed (a wheel, or ``pip install -e``), it is read from the distribution's metadata;
run from a source checkout that was never installed, from the checkout's pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

DISTRIBUTION = "stepstream"
# What a checkout whose version cannot be read at all says (PEP 440: a local version).
UNKNOWN = "0+unknown"


def version() -> str:
    # Imported here: importlib.metadata is most of what asking costs, and a process that
    # never asks (a CLI command other than --version) should not pay for it.
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return _checkout_version()


def _checkout_version() -> str:
    import tomllib

    # stepstream/engine is a symlink to the checkout's engine/: its parent is the checkout.
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return UNKNOWN
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return UNKNOWN
    return str(project["version"])
