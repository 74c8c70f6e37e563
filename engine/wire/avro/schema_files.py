"""Schema files and their loading: the tree ``<root>/stepstream/<domain>/v<N>/<Record>.avsc``,
each record type version made standalone (named types of other files inlined, as Parsing
Canonical Form requires), parsed by fastavro, and fingerprinted with CRC-64-AVRO.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import fastavro
from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form

_PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
_NAMED: Final = frozenset({"record", "error", "enum", "fixed"})
_VERSION_DIR: Final = re.compile(r"v([1-9][0-9]*)")


@dataclass(frozen=True, slots=True)
class SchemaFile:
    path: Path
    domain: str
    version: int
    full_name: str
    raw: dict[str, Any]


def load_tree(root: Path, domains: Collection[str]) -> list[SchemaFile]:
    """The schema files under ``root``, each checked to sit where its name says, in one
    of ``domains``."""
    if not root.is_dir():
        raise ValueError(f"schema root {root} is not a directory")
    found = []
    for path in sorted(root.rglob("*.avsc")):
        parts = path.relative_to(root).parts
        version = _VERSION_DIR.fullmatch(parts[2]) if len(parts) == 4 else None
        if version is None or parts[0] != "stepstream" or parts[1] not in domains:
            raise ValueError(
                f"{path}: schema files live at <root>/stepstream/<domain>/v<N>/<Record>.avsc "
                f"with domain one of {sorted(domains)}"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable JSON schema: {exc}") from exc
        namespace = f"stepstream.{parts[1]}.{parts[2]}"
        if (
            not isinstance(raw, dict)
            or raw.get("type") != "record"
            or raw.get("name") != path.stem
            or raw.get("namespace") != namespace
        ):
            raise ValueError(
                f"{path}: must hold one record named {path.stem!r} in namespace {namespace!r}"
            )
        found.append(
            SchemaFile(path, parts[1], int(version.group(1)), f"{namespace}.{path.stem}", raw)
        )
    return found


def _full_name(schema: Mapping[str, Any], enclosing: str) -> tuple[str, str]:
    """(namespace, full name) of a named schema, per the Avro naming rules."""
    name: str = schema["name"]
    if "." in name:
        return name.rpartition(".")[0], name
    namespace: str = schema.get("namespace", enclosing)
    return namespace, f"{namespace}.{name}" if namespace else name


def _standalone(top: str, defs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``top`` with every referenced named type from other files inlined at its first use
    (later uses by full name), as the Avro spec requires for Parsing Canonical Form: the
    schema any Avro tool computes the same fingerprint from."""
    defined: set[str] = set()

    def named(schema: Mapping[str, Any], enclosing: str) -> dict[str, Any]:
        namespace, full = _full_name(schema, enclosing)
        if full in defined:
            raise ValueError(f"{top}: {full} is defined twice")
        defined.add(full)
        out = {k: v for k, v in schema.items() if k not in ("name", "namespace", "fields")}
        out["name"] = full.rpartition(".")[2]
        if namespace:
            out["namespace"] = namespace
        if "fields" in schema:
            out["fields"] = [{**f, "type": expand(f["type"], namespace)} for f in schema["fields"]]
        return out

    def expand(t: Any, namespace: str) -> Any:
        if isinstance(t, str):
            if t in _PRIMITIVES:
                return t
            full = t if "." in t or not namespace else f"{namespace}.{t}"
            if full in defined:
                return full
            if full not in defs:
                raise ValueError(f"{top}: unknown type {full!r}")
            return named(defs[full], "")
        if isinstance(t, list):
            return [expand(branch, namespace) for branch in t]
        kind = t.get("type")
        if kind in _NAMED:
            return named(t, namespace)
        if kind == "array":
            return {**t, "items": expand(t["items"], namespace)}
        if kind == "map":
            return {**t, "values": expand(t["values"], namespace)}
        return dict(t)

    return named(defs[top], "")


def _collect_names(schema: Any, names: dict[str, dict[str, Any]]) -> None:
    """Index the named types of a standalone schema by full name (all carry namespaces)."""
    if isinstance(schema, list):
        for branch in schema:
            _collect_names(branch, names)
    elif isinstance(schema, dict):
        if schema.get("type") in _NAMED:
            names[_full_name(schema, "")[1]] = schema
        for f in schema.get("fields", ()):
            _collect_names(f["type"], names)
        for key in ("items", "values"):
            if key in schema:
                _collect_names(schema[key], names)


@dataclass(frozen=True, slots=True, eq=False)
class Schema:
    """One record type version: its standalone schema, parsed, and its fingerprint."""

    file: SchemaFile
    schema: dict[str, Any]
    parsed: Any
    fingerprint: int
    names: dict[str, dict[str, Any]]

    @property
    def full_name(self) -> str:
        return self.file.full_name

    @property
    def record_name(self) -> str:
        return self.file.path.stem

    def resolve(self, t: Any) -> Any:
        if isinstance(t, str) and t not in _PRIMITIVES:
            return self.names[t]
        if isinstance(t, dict) and t.get("type") in _PRIMITIVES and len(t) == 1:
            return t["type"]
        return t


def build_schema(file: SchemaFile, defs: Mapping[str, Mapping[str, Any]]) -> Schema:
    standalone = _standalone(file.full_name, defs)
    try:
        parsed = fastavro.parse_schema(standalone)
        canonical = to_parsing_canonical_form(standalone)
    except Exception as exc:
        raise ValueError(f"{file.path}: invalid Avro schema: {exc}") from exc
    # fastavro returns the fingerprint's 8 bytes little-endian, as Java and the spec do.
    fingerprint = int.from_bytes(
        bytes.fromhex(_fastavro_fingerprint(canonical, "CRC-64-AVRO")), "little"
    )
    names: dict[str, dict[str, Any]] = {}
    _collect_names(standalone, names)
    return Schema(file, standalone, parsed, fingerprint, names)
