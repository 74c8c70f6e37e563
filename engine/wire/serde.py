"""Avro single-object encoding of records, and the mapping from record classes to schemas.

Every record is written with the latest schema version of its type as the marker ``C3 01``,
the 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical
Form, then the Avro binary body, so any Avro reader can find the schema that wrote it.
Decoding looks the writer schema up by fingerprint (any known version) and resolves it
against the latest version of that record type; Avro fields a class does not have are
dropped, fields an older writer lacked get the reader schema's default.

This is on the path of every step, so records of the latest version go through plans
compiled once from the schema: a reader of one small function per field, which runs about
twice as fast as fastavro's generic reader plus dict conversion, and a writer generated as
the source of one function per record type with every primitive field written in line
(half the time of a function per field). Older versions go through fastavro's schema
resolution; ``compiled=False`` sends everything through fastavro.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any, Final

import fastavro
import fastavro.validation
from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.wire.records import ALL_TYPES, Payload, Record
from stepstream.schemas import schema_root

MARKER: Final = b"\xc3\x01"
HEADER_SIZE: Final = len(MARKER) + 8

_DOMAIN_OF_TOPIC: Final = {
    "commands": "commands",
    "history": "history",
    "timers": "timers",
    "dead-letters": "deadletters",
    "snapshots": "snapshots",
}
_COMMON: Final = "common"
# Records of the compacted cluster topics (engine.wire.cluster_serde): no envelope, no class.
CLUSTER_DOMAINS: Final = frozenset({"members", "definitions"})
_DOMAINS: Final = frozenset({_COMMON, *_DOMAIN_OF_TOPIC.values(), *CLUSTER_DOMAINS})
_HEADER: Final = "header"
_ENVELOPE_ATTRS: Final = frozenset(f.name for f in fields(Record))
# Records nested inside record types, by Avro name; the envelope is flattened instead.
_NESTED_CLASSES: Final[Mapping[str, type[Any]]] = {"Payload": Payload}
_PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
_NAMED: Final = frozenset({"record", "error", "enum", "fixed"})
_VERSION_DIR: Final = re.compile(r"v([1-9][0-9]*)")
_LONG_MIN: Final = -(1 << 63)
_LONG_MAX: Final = (1 << 63) - 1
_INT_MIN: Final = -(1 << 31)
_INT_MAX: Final = (1 << 31) - 1
_NO_DEFAULT: Final = object()

_Writer = Callable[[bytearray, Any], None]
_Reader = Callable[[bytes, int], tuple[Any, int]]
_Convert = Callable[[Any], Any]
SchemaRoot = str | PathLike[str]


class _Malformed(ValueError):
    """The body does not follow its writer schema; the message says where."""


class _NotCompiled(Exception):
    """A schema construct the compiled plans do not cover; fastavro handles it instead."""


# ---- Avro binary primitives -------------------------------------------------------------


# Encoded big longs seen lately: record times and fire times repeat within a batch.
_LONG_CACHE: dict[int, bytes] = {}
_LONG_CACHE_SIZE = 4096


def _write_long(buf: bytearray, n: int) -> None:
    if -64 <= n <= 63:
        buf.append((n << 1) ^ (n >> 63))
        return
    encoded = _LONG_CACHE.get(n)
    if encoded is None:
        if not _LONG_MIN <= n <= _LONG_MAX:
            raise OverflowError(f"{n} does not fit in an Avro long (64-bit signed)")
        out = bytearray()
        z = (n << 1) ^ (n >> 63)
        while z > 0x7F:
            out.append((z & 0x7F) | 0x80)
            z >>= 7
        out.append(z)
        encoded = bytes(out)
        if len(_LONG_CACHE) >= _LONG_CACHE_SIZE:
            _LONG_CACHE.clear()
        _LONG_CACHE[n] = encoded
    buf += encoded


def _write_int(buf: bytearray, n: int) -> None:
    if not _INT_MIN <= n <= _INT_MAX:
        raise OverflowError(f"{n} does not fit in an Avro int (32-bit signed)")
    _write_long(buf, n)


def _write_string(buf: bytearray, s: str) -> None:
    data = s.encode()
    _write_long(buf, len(data))
    buf += data


def _write_bytes(buf: bytearray, b: bytes) -> None:
    _write_long(buf, len(b))
    buf += b


def _write_boolean(buf: bytearray, v: bool) -> None:
    if v is True:
        buf.append(1)
    elif v is False:
        buf.append(0)
    else:
        raise TypeError(f"expected a bool, got {type(v).__name__}")


def _write_null(buf: bytearray, v: None) -> None:
    if v is not None:
        raise TypeError(f"expected None, got {type(v).__name__}")


def _read_long(b: bytes, i: int) -> tuple[int, int]:
    c = b[i]
    if c < 0x80:
        return (c >> 1) ^ -(c & 1), i + 1
    z = c & 0x7F
    shift = 7
    i += 1
    while True:
        c = b[i]
        i += 1
        z |= (c & 0x7F) << shift
        if c < 0x80:
            break
        shift += 7
        if shift > 63:
            raise _Malformed(f"variable-length integer longer than 10 bytes at byte {i}")
    if z >> 64:
        raise _Malformed(f"variable-length integer ending at byte {i} exceeds 64 bits")
    return (z >> 1) ^ -(z & 1), i


def _read_int(b: bytes, i: int) -> tuple[int, int]:
    n, end = _read_long(b, i)
    if not _INT_MIN <= n <= _INT_MAX:
        raise _Malformed(f"int at byte {i} is {n}, outside 32 bits")
    return n, end


def _read_bytes(b: bytes, i: int) -> tuple[bytes, int]:
    n, i = _read_long(b, i)
    end = i + n
    if n < 0 or end > len(b):
        raise _Malformed(f"bytes length {n} at byte {i}, {len(b) - i} left (truncated?)")
    return b[i:end], end


def _read_string(b: bytes, i: int) -> tuple[str, int]:
    n, i = _read_long(b, i)
    end = i + n
    if n < 0 or end > len(b):
        raise _Malformed(f"string length {n} at byte {i}, {len(b) - i} left (truncated?)")
    return b[i:end].decode(), end


def _read_boolean(b: bytes, i: int) -> tuple[bool, int]:
    c = b[i]
    if c > 1:
        raise _Malformed(f"boolean byte {c} at byte {i} is neither 0 nor 1")
    return c == 1, i + 1


def _read_null(b: bytes, i: int) -> tuple[None, int]:
    return None, i


_WRITERS: Final[Mapping[str, _Writer]] = {
    "null": _write_null,
    "boolean": _write_boolean,
    "int": _write_int,
    "long": _write_long,
    "string": _write_string,
    "bytes": _write_bytes,
}
_READERS: Final[Mapping[str, _Reader]] = {
    "null": _read_null,
    "boolean": _read_boolean,
    "int": _read_int,
    "long": _read_long,
    "string": _read_string,
    "bytes": _read_bytes,
}
_PYTHON_TYPES: Final[Mapping[str, tuple[type[Any], ...]]] = {
    "null": (type(None),),
    "boolean": (bool,),
    "int": (int,),
    "long": (int,),
    "float": (float, int),
    "double": (float, int),
    "string": (str,),
    "bytes": (bytes, bytearray, memoryview),
}


# ---- schema files -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _SchemaFile:
    path: Path
    domain: str
    version: int
    full_name: str
    raw: dict[str, Any]


def _load_tree(root: Path) -> list[_SchemaFile]:
    if not root.is_dir():
        raise ValueError(f"schema root {root} is not a directory")
    found = []
    for path in sorted(root.rglob("*.avsc")):
        parts = path.relative_to(root).parts
        version = _VERSION_DIR.fullmatch(parts[2]) if len(parts) == 4 else None
        if version is None or parts[0] != "stepstream" or parts[1] not in _DOMAINS:
            raise ValueError(
                f"{path}: schema files live at <root>/stepstream/<domain>/v<N>/<Record>.avsc "
                f"with domain one of {sorted(_DOMAINS)}"
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
            _SchemaFile(path, parts[1], int(version.group(1)), f"{namespace}.{path.stem}", raw)
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
class _Schema:
    """One record type version: its standalone schema, parsed, and its fingerprint."""

    file: _SchemaFile
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

    @property
    def header(self) -> bytes:
        return MARKER + self.fingerprint.to_bytes(8, "little")

    def resolve(self, t: Any) -> Any:
        if isinstance(t, str) and t not in _PRIMITIVES:
            return self.names[t]
        if isinstance(t, dict) and t.get("type") in _PRIMITIVES and len(t) == 1:
            return t["type"]
        return t


def _build_schema(file: _SchemaFile, defs: Mapping[str, Mapping[str, Any]]) -> _Schema:
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
    return _Schema(file, standalone, parsed, fingerprint, names)


# ---- mapping records onto schemas -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    """One Avro field and the attribute it maps to. ``attr`` None: the class has no such
    attribute (written as ``default``, dropped when read). ``inline``: the envelope, a
    record whose fields are attributes of the outer object itself."""

    name: str
    attr: str | None
    type: Any
    default: Any = _NO_DEFAULT
    inline: tuple[_Field, ...] = ()


def _flat(plan: Iterable[_Field]) -> Iterator[_Field]:
    for f in plan:
        if f.inline:
            yield from f.inline
        else:
            yield f


def _default_value(schema: _Schema, t: Any, default: Any) -> Any:
    """The Python value of an Avro JSON default (a union's default is of its first branch)."""
    t = schema.resolve(t)
    if isinstance(t, list):
        return _default_value(schema, t[0], default)
    if t == "bytes" or (isinstance(t, dict) and t.get("type") in ("bytes", "fixed")):
        return str(default).encode("latin-1")
    if isinstance(t, dict) and t.get("type") in ("record", "error", "array", "map"):
        raise ValueError(f"{schema.file.path}: defaults of type {t.get('type')} are unsupported")
    return default


def _map_record(
    schema: _Schema, record: Mapping[str, Any], attrs: Collection[str], owner: str
) -> list[_Field]:
    plan = []
    for f in record["fields"]:
        name: str = f["name"]
        if name in attrs:
            plan.append(_Field(name, name, f["type"]))
        elif "default" in f:
            plan.append(
                _Field(name, None, f["type"], _default_value(schema, f["type"], f["default"]))
            )
        else:
            raise ValueError(
                f"{schema.file.path}: field {name!r} has no default and {owner} has no such "
                "attribute, so it cannot be written with this schema"
            )
    return plan


def _check_covered(schema: _Schema, plan: list[_Field], cls: type[Any]) -> None:
    covered = {f.attr for f in _flat(plan)}
    missing = [f.name for f in fields(cls) if f.init and f.name not in covered]
    if missing:
        raise ValueError(
            f"{schema.file.path}: {cls.__name__} attributes {missing} have no field in the "
            "schema and would be lost; add them to a new schema version"
        )


def _record_plan(schema: _Schema, cls: type[Record]) -> list[_Field]:
    own = {f.name for f in fields(cls)} - _ENVELOPE_ATTRS
    plan: list[_Field] = []
    for f in schema.schema["fields"]:
        if f["name"] == _HEADER:
            envelope = schema.resolve(f["type"])
            if not isinstance(envelope, dict) or envelope.get("type") != "record":
                raise ValueError(f"{schema.file.path}: field 'header' must be the envelope record")
            inline = _map_record(schema, envelope, _ENVELOPE_ATTRS, cls.__name__)
            plan.append(_Field(_HEADER, None, f["type"], inline=tuple(inline)))
        else:
            plan.extend(_map_record(schema, {"fields": [f]}, own, cls.__name__))
    _check_covered(schema, plan, cls)
    return plan


def _nested(schema: _Schema, record: Mapping[str, Any]) -> tuple[type[Any], list[_Field]]:
    name = record["name"].rpartition(".")[2]
    cls = _NESTED_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"{schema.file.path}: no Python class for nested record {name!r}")
    plan = _map_record(schema, record, [f.name for f in fields(cls)], cls.__name__)
    _check_covered(schema, plan, cls)
    return cls, plan


# ---- compiled plans ---------------------------------------------------------------------


def _writer(schema: _Schema, t: Any) -> _Writer:
    t = schema.resolve(t)
    if isinstance(t, str) and t in _WRITERS:
        return _WRITERS[t]
    if isinstance(t, list):
        return _union_writer(schema, t)
    if isinstance(t, dict) and t.get("type") == "record":
        cls, plan = _nested(schema, t)
        prefix, steps, suffix = _writer_steps(schema, plan)

        def write_record(buf: bytearray, v: Any) -> None:
            if not isinstance(v, cls):
                raise TypeError(f"expected {cls.__name__}, got {type(v).__name__}")
            buf += prefix
            for name, write in steps:
                write(buf, getattr(v, name))
            buf += suffix

        return write_record
    raise _NotCompiled(str(t))


def _branch_types(schema: _Schema, t: Any) -> tuple[type[Any], ...]:
    t = schema.resolve(t)
    if isinstance(t, str) and t in _PYTHON_TYPES:
        return _PYTHON_TYPES[t]
    if isinstance(t, dict) and t.get("type") == "record":
        return (_nested(schema, t)[0],)
    raise _NotCompiled(str(t))


def _union_writer(schema: _Schema, branches: list[Any]) -> _Writer:
    writers = [_writer(schema, b) for b in branches]
    if len(branches) == 2 and "null" in branches:
        null_index = branches.index("null")
        null_byte, value_byte = (0, 2) if null_index == 0 else (2, 0)
        inner = writers[1 - null_index]

        def write_optional(buf: bytearray, v: Any) -> None:
            if v is None:
                buf.append(null_byte)
            else:
                buf.append(value_byte)
                inner(buf, v)

        return write_optional
    options = [
        (index, _branch_types(schema, b), w)
        for index, (b, w) in enumerate(zip(branches, writers, strict=True))
    ]

    def write_union(buf: bytearray, v: Any) -> None:
        for index, types, write in options:
            if isinstance(v, types) and (type(v) is not bool or bool in types):
                _write_long(buf, index)
                write(buf, v)
                return
        raise TypeError(f"{type(v).__name__} matches no branch of union {branches}")

    return write_union


def _prepend(constant: bytes, write: _Writer) -> _Writer:
    def write_after_constant(buf: bytearray, v: Any) -> None:
        buf += constant
        write(buf, v)

    return write_after_constant


def _writer_steps(
    schema: _Schema, plan: Iterable[_Field]
) -> tuple[bytes, tuple[tuple[str, _Writer], ...], bytes]:
    """(prefix, steps, suffix): fields the class lacks are their defaults' bytes, folded into
    the constant prefix, the next step or the suffix."""
    prefix = bytearray()
    pending = bytearray()
    steps: list[tuple[str, _Writer]] = []
    for f in _flat(plan):
        write = _writer(schema, f.type)
        if f.attr is None:
            write(pending, f.default)
            continue
        if pending:
            if steps:
                write = _prepend(bytes(pending), write)
            else:
                prefix += pending
            pending.clear()
        steps.append((f.attr, write))
    return bytes(prefix), tuple(steps), bytes(pending)


class _Source:
    """The Python source of one record type's encoder: the compiled plan written out as
    one function, every primitive field's writer in line. A call per field is most of
    what the plan of small functions costs, and this is on the path of every step."""

    def __init__(self, schema: _Schema) -> None:
        self.schema = schema
        self.lines: list[str] = []
        self.names: dict[str, Any] = {
            "_write_long": _write_long,
            "_write_int": _write_int,
            "_write_boolean": _write_boolean,
            "_write_null": _write_null,
        }
        self._count = 0

    def const(self, value: Any) -> str:
        name = f"_c{len(self.names)}"
        self.names[name] = value
        return name

    def var(self) -> str:
        self._count += 1
        return f"v{self._count}"

    def line(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)

    def length(self, indent: int, n: str) -> None:
        self.line(indent, f"if {n} < 64: buf.append({n} << 1)")
        self.line(indent, f"else: _write_long(buf, {n})")

    def value(self, indent: int, t: Any, expr: str) -> None:
        t = self.schema.resolve(t)
        v = expr
        if not expr.isidentifier():  # an attribute: read it once
            v = self.var()
            self.line(indent, f"{v} = {expr}")
        if t in ("long", "int"):
            self.line(indent, f"if -64 <= {v} <= 63: buf.append(({v} << 1) ^ ({v} >> 63))")
            self.line(indent, f"else: _write_{t}(buf, {v})")
        elif t in ("string", "bytes"):
            data = v if t == "bytes" else self.var()
            if t == "string":
                self.line(indent, f"{data} = {v}.encode()")
            n = self.var()
            self.line(indent, f"{n} = len({data})")
            self.length(indent, n)
            self.line(indent, f"buf += {data}")
        elif t in ("boolean", "null"):
            self.line(indent, f"_write_{t}(buf, {v})")
        elif isinstance(t, list) and len(t) == 2 and "null" in t:
            null_byte = 0 if t.index("null") == 0 else 2
            self.line(indent, f"if {v} is None: buf.append({null_byte})")
            self.line(indent, "else:")
            self.line(indent + 1, f"buf.append({2 - null_byte})")
            self.value(indent + 1, t[1 - t.index("null")], v)
        elif isinstance(t, list):
            self.line(indent, f"{self.const(_union_writer(self.schema, t))}(buf, {v})")
        elif isinstance(t, dict) and t.get("type") == "record":
            cls, plan = _nested(self.schema, t)
            name = self.const(cls)
            self.line(indent, f"if not isinstance({v}, {name}):")
            self.line(
                indent + 1,
                f"raise TypeError(f'expected {cls.__name__}, got {{type({v}).__name__}}')",
            )
            self.fields(indent, plan, v)
        else:
            raise _NotCompiled(str(t))

    def fields(self, indent: int, plan: Iterable[_Field], owner: str) -> None:
        """The fields of ``owner``; those its class lacks are their defaults' bytes."""
        pending = bytearray()
        for f in _flat(plan):
            if f.attr is None:
                _writer(self.schema, f.type)(pending, f.default)
                continue
            if pending:
                self.line(indent, f"buf += {self.const(bytes(pending))}")
                pending.clear()
            self.value(indent, f.type, f"{owner}.{f.attr}")
        if pending:
            self.line(indent, f"buf += {self.const(bytes(pending))}")


def _encoder_function(schema: _Schema, plan: Iterable[_Field]) -> Callable[[Any], bytes]:
    """One function that encodes a record of ``plan``'s class, header included."""
    source = _Source(schema)
    source.line(0, "def encode(record):")
    source.line(1, f"buf = bytearray({source.const(schema.header)})")
    source.fields(1, plan, "record")
    source.line(1, "return bytes(buf)")
    namespace = dict(source.names)
    exec(compile("\n".join(source.lines), f"<encoder {schema.full_name}>", "exec"), namespace)
    encode: Callable[[Any], bytes] = namespace["encode"]
    return encode


def _reader(schema: _Schema, t: Any) -> _Reader:
    t = schema.resolve(t)
    if isinstance(t, str) and t in _READERS:
        return _READERS[t]
    if isinstance(t, list):
        readers = [_reader(schema, b) for b in t]
        count = len(readers)
        if count == 2 and "null" in t:
            null_byte = 2 * t.index("null")
            value_byte = 2 - null_byte
            inner = readers[1 - t.index("null")]

            def read_optional(b: bytes, i: int) -> tuple[Any, int]:
                c = b[i]
                if c == null_byte:
                    return None, i + 1
                if c == value_byte:
                    return inner(b, i + 1)
                raise _Malformed(
                    f"union branch {(c >> 1) ^ -(c & 1)} at byte {i}; the union has 2 branches"
                )

            return read_optional

        def read_union(b: bytes, i: int) -> tuple[Any, int]:
            index, end = _read_long(b, i)
            if not 0 <= index < count:
                raise _Malformed(
                    f"union branch {index} at byte {i}; the union has {count} branches"
                )
            return readers[index](b, end)

        return read_union
    if isinstance(t, dict) and t.get("type") == "record":
        cls, plan = _nested(schema, t)
        steps, discards = _reader_steps(schema, plan)
        init = [f.name for f in fields(cls) if f.init and not f.kw_only]
        if len(steps) == 2 and [name for name, _ in steps] == init:
            # Payload, inside most records: positional construction, no keyword dict.
            (_, read_first), (_, read_second) = steps

            def read_pair(b: bytes, i: int) -> tuple[Any, int]:
                first, i = read_first(b, i)
                second, i = read_second(b, i)
                return cls(first, second), i

            return read_pair

        def read_record(b: bytes, i: int) -> tuple[Any, int]:
            kw: dict[str, Any] = {}
            for name, read in steps:
                kw[name], i = read(b, i)
            if discards:
                del kw[""]
            return cls(**kw), i

        return read_record
    raise _NotCompiled(str(t))


def _reader_steps(
    schema: _Schema, plan: Iterable[_Field]
) -> tuple[tuple[tuple[str, _Reader], ...], bool]:
    steps = tuple((f.attr or "", _reader(schema, f.type)) for f in _flat(plan))
    return steps, any(name == "" for name, _ in steps)


# ---- fastavro dict conversion -----------------------------------------------------------


def _converters(schema: _Schema, t: Any) -> tuple[_Convert | None, _Convert | None]:
    """(to fastavro, from fastavro) for values of type ``t``; None where values pass as is."""
    t = schema.resolve(t)
    if isinstance(t, list):
        pairs = [(b, _converters(schema, b)) for b in t]
        converted = [(b, conv) for b, conv in pairs if conv != (None, None)]
        if not converted:
            return None, None
        if len(converted) > 1:
            raise ValueError(f"{schema.file.path}: unions of several records are unsupported")
        branch, (to, back) = converted[0]
        cls = _nested(schema, schema.resolve(branch))[0]
        assert to is not None and back is not None
        return (
            lambda v: to(v) if isinstance(v, cls) else v,
            lambda v: back(v) if isinstance(v, dict) else v,
        )
    if isinstance(t, dict) and t.get("type") == "record":
        cls, plan = _nested(schema, t)
        to_dict, from_dict = _dict_converters(schema, plan)
        return to_dict, lambda d: cls(**from_dict(d))
    if isinstance(t, dict) and t.get("type") in ("array", "map"):
        inner = _converters(schema, t.get("items", t.get("values")))
        if inner != (None, None):
            raise ValueError(f"{schema.file.path}: records inside {t['type']}s are unsupported")
    return None, None


def _dict_converters(
    schema: _Schema, plan: list[_Field]
) -> tuple[Callable[[Any], dict[str, Any]], Callable[[Mapping[str, Any]], dict[str, Any]]]:
    """(object -> fastavro dict, fastavro dict -> constructor keywords) for a record plan."""
    out: list[tuple[str, str | None, Any, _Convert | None, Any]] = []
    back: list[tuple[str, str, _Convert | None]] = []
    inline: list[tuple[str, Callable[[Any], dict[str, Any]]]] = []
    inline_back: list[tuple[str, Callable[[Mapping[str, Any]], dict[str, Any]]]] = []
    for f in plan:
        if f.inline:
            to_inner, from_inner = _dict_converters(schema, list(f.inline))
            inline.append((f.name, to_inner))
            inline_back.append((f.name, from_inner))
            continue
        to, frm = _converters(schema, f.type)
        out.append((f.name, f.attr, f.default, to, None))
        if f.attr is not None:
            back.append((f.name, f.attr, frm))

    def to_dict(obj: Any) -> dict[str, Any]:
        d: dict[str, Any] = {name: conv(obj) for name, conv in inline}
        for name, attr, default, to, _ in out:
            if attr is None:
                d[name] = default
            else:
                value = getattr(obj, attr)
                d[name] = value if to is None else to(value)
        return d

    def from_dict(d: Mapping[str, Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        for name, conv in inline_back:
            kw.update(conv(d[name]))
        for name, attr, frm in back:
            value = d[name]
            kw[attr] = value if frm is None else frm(value)
        return kw

    return to_dict, from_dict


# ---- the serde ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Encoder:
    schema: _Schema
    # The compiled plan, one function per field: where a failed encoding went wrong.
    steps: tuple[tuple[str, _Writer], ...] | None
    to_dict: Callable[[Any], dict[str, Any]]
    # The compiled plan as one function (None: fastavro encodes).
    function: Callable[[Any], bytes] | None


@dataclass(frozen=True, slots=True, eq=False)
class _Decoder:
    cls: type[Record]
    writer: _Schema
    reader: _Schema
    steps: tuple[tuple[str, _Reader], ...] | None
    discards: bool
    from_dict: Callable[[Mapping[str, Any]], dict[str, Any]]


class RecordSerde:
    """Encodes records to Avro single-object bytes and back.

    ``extra_roots`` add schema trees whose versions may become the latest of a record type
    (written and used as reader schema). ``writer_roots`` add schemas known only as writers,
    as a consumer that learned a newer writer's schemas would. Each root holds
    ``stepstream/<domain>/v<N>/<Record>.avsc``; the packaged ``schemas/`` always comes first.
    ``compiled=False`` encodes and decodes everything through fastavro.
    """

    def __init__(
        self,
        extra_roots: Iterable[SchemaRoot] = (),
        *,
        writer_roots: Iterable[SchemaRoot] = (),
        compiled: bool = True,
    ) -> None:
        reader_roots = [schema_root(), *map(Path, extra_roots)]
        self._roots = [*reader_roots, *map(Path, writer_roots)]
        files: dict[str, _SchemaFile] = {}
        readable: set[str] = set()
        for index, root in enumerate(self._roots):
            for file in _load_tree(root):
                known = files.setdefault(file.full_name, file)
                if known.raw != file.raw:
                    raise ValueError(
                        f"{file.path} and {known.path} define {file.full_name} differently; "
                        "a released schema is never edited, add a new version instead"
                    )
                if index < len(reader_roots):
                    readable.add(file.full_name)
        defs = {name: file.raw for name, file in files.items()}
        self._schemas: dict[int, _Schema] = {}
        for file in files.values():
            if file.domain == _COMMON or file.domain in CLUSTER_DOMAINS:
                continue
            schema = _build_schema(file, defs)
            clash = self._schemas.setdefault(schema.fingerprint, schema)
            if clash is not schema:
                raise ValueError(f"{file.path} and {clash.file.path} share a fingerprint")

        self._encoders: dict[type[Record], _Encoder] = {}
        self._decoders: dict[bytes, _Decoder] = {}
        for cls in ALL_TYPES:
            domain = _DOMAIN_OF_TOPIC[cls.topic_kind]
            versions = [
                s
                for s in self._schemas.values()
                if s.record_name == cls.__name__ and s.file.domain == domain
            ]
            readers = [s for s in versions if s.full_name in readable]
            if not readers:
                raise ValueError(
                    f"no schema for {cls.__name__}: expected "
                    f"stepstream/{domain}/v1/{cls.__name__}.avsc under {reader_roots}"
                )
            latest = max(readers, key=lambda s: s.file.version)
            plan = _record_plan(latest, cls)
            to_dict, from_dict = _dict_converters(latest, plan)
            writer_steps = reader_steps = function = None
            discards = False
            if compiled:
                try:
                    writer_steps = _writer_steps(latest, plan)[1]
                    reader_steps, discards = _reader_steps(latest, plan)
                    function = _encoder_function(latest, plan)
                except _NotCompiled:
                    writer_steps = reader_steps = function = None
            self._encoders[cls] = _Encoder(latest, writer_steps, to_dict, function)
            for schema in versions:
                steps = reader_steps if schema is latest else None
                decoder = _Decoder(cls, schema, latest, steps, discards, from_dict)
                self._decoders[schema.header[len(MARKER) :]] = decoder

    # ---- encoding -----------------------------------------------------------------------

    def encode(self, record: Record) -> bytes:
        """The single-object encoding of ``record`` with the latest schema of its type.

        Raises TypeError for an object that is not a known record type and ValueError for
        attribute values the schema cannot hold (wrong type, integer out of range).
        """
        encoder = self._encoders.get(type(record))
        if encoder is None:
            raise TypeError(f"{type(record).__qualname__} is not a record type with a schema")
        try:
            if encoder.function is not None:
                return encoder.function(record)
            out = io.BytesIO()
            out.write(encoder.schema.header)
            fastavro.schemaless_writer(out, encoder.schema.parsed, encoder.to_dict(record))
            return out.getvalue()
        except Exception as exc:
            raise ValueError(_encode_failure(record, encoder, exc)) from exc

    # ---- decoding -----------------------------------------------------------------------

    def decode(self, data: bytes) -> Record:
        """The record in ``data``, read with the latest schema of its type.

        Raises UndecodableRecord, saying why, for anything that is not a record some known
        schema wrote: another format, an unknown fingerprint, a truncated or corrupt body.
        """
        if type(data) is not bytes:
            try:
                data = bytes(data)
            except TypeError as exc:
                raise UndecodableRecord(f"expected bytes, got {type(data).__name__}") from exc
        decoder = self._decoders.get(data[len(MARKER) : HEADER_SIZE])
        if decoder is None or data[: len(MARKER)] != MARKER:
            raise UndecodableRecord(self._header_problem(data))
        try:
            steps = decoder.steps
            if steps is not None:
                kw: dict[str, Any] = {}
                end = HEADER_SIZE
                for name, read in steps:
                    kw[name], end = read(data, end)
                if decoder.discards:
                    del kw[""]
            else:
                body = io.BytesIO(data)
                body.seek(HEADER_SIZE)
                reader = None if decoder.reader is decoder.writer else decoder.reader.parsed
                raw: Any = fastavro.schemaless_reader(body, decoder.writer.parsed, reader)
                end = body.tell()
                kw = decoder.from_dict(raw)
            if end != len(data):
                raise _Malformed(f"{len(data) - end} bytes left over after the record")
            return decoder.cls(**kw)
        except Exception as exc:
            raise UndecodableRecord(_decode_failure(data, decoder, exc)) from exc

    def _header_problem(self, data: bytes) -> str:
        if len(data) < HEADER_SIZE:
            return (
                f"{len(data)} bytes is shorter than the {HEADER_SIZE}-byte Avro single-object "
                "header (marker c3 01, 8-byte schema fingerprint): not a stepstream record"
            )
        if data[: len(MARKER)] != MARKER:
            return (
                f"starts with {data[:2].hex(' ')}, not the Avro single-object marker c3 01: "
                "not a stepstream record (plain JSON, or another producer's format?)"
            )
        fingerprint = int.from_bytes(data[len(MARKER) : HEADER_SIZE], "little")
        known = self._schemas.get(fingerprint)
        if known is not None:
            return (
                f"schema {known.full_name} (fingerprint 0x{fingerprint:016x}) is a record type "
                "this version of stepstream does not have: upgrade stepstream to read it"
            )
        return (
            f"unknown schema fingerprint 0x{fingerprint:016x}: written by a newer stepstream, "
            f"or by a producer with schemas of its own? This reader knows {len(self._schemas)} "
            f"schemas under {[str(r) for r in self._roots]}; upgrade stepstream or add the "
            "writer's schema root"
        )

    # ---- schemas for other readers ------------------------------------------------------

    def writer_schemas(self) -> dict[int, dict[str, Any]]:
        """Every known writer schema by fingerprint (the 64-bit value whose little-endian
        bytes follow ``c3 01``). Each is standalone: hand it to ``fastavro.parse_schema``."""
        return {fp: _copy(s.schema) for fp, s in self._schemas.items()}

    def fingerprint(self, record_type: type[Record]) -> int:
        """Fingerprint of the schema ``encode`` writes ``record_type`` with."""
        return self._encoders[record_type].schema.fingerprint

    def schema(self, record_type: type[Record]) -> dict[str, Any]:
        """The standalone schema ``encode`` writes ``record_type`` with."""
        return _copy(self._encoders[record_type].schema.schema)


def _copy(schema: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(schema))
    return copied


def _encode_failure(record: Record, encoder: _Encoder, exc: Exception) -> str:
    """The failure, naming the attribute at fault (found again off the hot path)."""
    where = ""
    if encoder.steps is None:
        try:
            fastavro.validation.validate(
                encoder.to_dict(record), encoder.schema.parsed, raise_errors=True
            )
        except Exception as invalid:
            where = f" {' '.join(str(invalid).split())}:"
    for name, write in encoder.steps or ():
        try:
            write(bytearray(), getattr(record, name))
        except Exception:
            where = f" attribute {name}={getattr(record, name)!r:.80}:"
            break
    return (
        f"cannot encode {record.type} of instance {record.instance_id!r} with schema "
        f"{encoder.schema.full_name}:{where} {type(exc).__name__}: {exc}"
    )


def _decode_failure(data: bytes, decoder: _Decoder, exc: Exception) -> str:
    if isinstance(exc, _Malformed):
        reason = str(exc)
    elif isinstance(exc, IndexError) and not decoder.steps and "list index" in str(exc):
        # fastavro indexes its list of union branches; running off the body is a string index.
        reason = f"a union branch index is out of range ({exc})"
    elif isinstance(exc, IndexError | EOFError):
        reason = f"the body ends early, truncated? ({str(exc) or 'no more bytes'})"
    elif isinstance(exc, UnicodeDecodeError):
        reason = f"a string is not valid UTF-8 ({exc})"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return (
        f"{len(data)}-byte {decoder.cls.__name__} record written with "
        f"{decoder.writer.full_name} (fingerprint 0x{decoder.writer.fingerprint:016x}) "
        f"is corrupt: {reason}"
    )


@functools.cache
def default_serde() -> RecordSerde:
    """The serde over the packaged schemas, built once per process."""
    return RecordSerde()
