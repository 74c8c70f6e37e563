"""Encode and decode plans compiled once from a record type's latest schema.

This is on the path of every step. The reader is one small function per field, which
runs about twice as fast as fastavro's generic reader plus dict conversion. The writer
is generated as the source of one function per record type with every primitive field
written in line (half the time of a function per field). A schema construct the plans
do not cover raises ``NotCompiled``, and fastavro handles that record type instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from stepstream.engine.wire.avro.binary import (
    PYTHON_TYPES,
    READERS,
    WRITERS,
    Malformed,
    Reader,
    Writer,
    read_long,
    write_boolean,
    write_int,
    write_long,
    write_null,
)
from stepstream.engine.wire.avro.field_map import Field, flat, nested
from stepstream.engine.wire.avro.schema_files import Schema


class NotCompiled(Exception):
    """A schema construct the compiled plans do not cover; fastavro handles it instead."""


def _writer(schema: Schema, t: Any) -> Writer:
    t = schema.resolve(t)
    if isinstance(t, str) and t in WRITERS:
        return WRITERS[t]
    if isinstance(t, list):
        return _union_writer(schema, t)
    if isinstance(t, dict) and t.get("type") == "record":
        cls, plan = nested(schema, t)
        prefix, steps, suffix = writer_steps(schema, plan)

        def write_record(buf: bytearray, v: Any) -> None:
            if not isinstance(v, cls):
                raise TypeError(f"expected {cls.__name__}, got {type(v).__name__}")
            buf += prefix
            for name, write in steps:
                write(buf, getattr(v, name))
            buf += suffix

        return write_record
    raise NotCompiled(str(t))


def _branch_types(schema: Schema, t: Any) -> tuple[type[Any], ...]:
    t = schema.resolve(t)
    if isinstance(t, str) and t in PYTHON_TYPES:
        return PYTHON_TYPES[t]
    if isinstance(t, dict) and t.get("type") == "record":
        return (nested(schema, t)[0],)
    raise NotCompiled(str(t))


def _union_writer(schema: Schema, branches: list[Any]) -> Writer:
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
                write_long(buf, index)
                write(buf, v)
                return
        raise TypeError(f"{type(v).__name__} matches no branch of union {branches}")

    return write_union


def _prepend(constant: bytes, write: Writer) -> Writer:
    def write_after_constant(buf: bytearray, v: Any) -> None:
        buf += constant
        write(buf, v)

    return write_after_constant


def writer_steps(
    schema: Schema, plan: Iterable[Field]
) -> tuple[bytes, tuple[tuple[str, Writer], ...], bytes]:
    """(prefix, steps, suffix): fields the class lacks are their defaults' bytes, folded into
    the constant prefix, the next step or the suffix."""
    prefix = bytearray()
    pending = bytearray()
    steps: list[tuple[str, Writer]] = []
    for f in flat(plan):
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

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.lines: list[str] = []
        self.names: dict[str, Any] = {
            "_write_long": write_long,
            "_write_int": write_int,
            "_write_boolean": write_boolean,
            "_write_null": write_null,
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
            cls, plan = nested(self.schema, t)
            name = self.const(cls)
            self.line(indent, f"if not isinstance({v}, {name}):")
            self.line(
                indent + 1,
                f"raise TypeError(f'expected {cls.__name__}, got {{type({v}).__name__}}')",
            )
            self.fields(indent, plan, v)
        else:
            raise NotCompiled(str(t))

    def fields(self, indent: int, plan: Iterable[Field], owner: str) -> None:
        """The fields of ``owner``; those its class lacks are their defaults' bytes."""
        pending = bytearray()
        for f in flat(plan):
            if f.attr is None:
                _writer(self.schema, f.type)(pending, f.default)
                continue
            if pending:
                self.line(indent, f"buf += {self.const(bytes(pending))}")
                pending.clear()
            self.value(indent, f.type, f"{owner}.{f.attr}")
        if pending:
            self.line(indent, f"buf += {self.const(bytes(pending))}")


def encoder_function(
    schema: Schema, plan: Iterable[Field], header: bytes
) -> Callable[[Any], bytes]:
    """One function that encodes a record of ``plan``'s class, ``header`` first."""
    source = _Source(schema)
    source.line(0, "def encode(record):")
    source.line(1, f"buf = bytearray({source.const(header)})")
    source.fields(1, plan, "record")
    source.line(1, "return bytes(buf)")
    namespace = dict(source.names)
    exec(compile("\n".join(source.lines), f"<encoder {schema.full_name}>", "exec"), namespace)
    encode: Callable[[Any], bytes] = namespace["encode"]
    return encode


def _reader(schema: Schema, t: Any) -> Reader:
    t = schema.resolve(t)
    if isinstance(t, str) and t in READERS:
        return READERS[t]
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
                raise Malformed(
                    f"union branch {(c >> 1) ^ -(c & 1)} at byte {i}; the union has 2 branches"
                )

            return read_optional

        def read_union(b: bytes, i: int) -> tuple[Any, int]:
            index, end = read_long(b, i)
            if not 0 <= index < count:
                raise Malformed(f"union branch {index} at byte {i}; the union has {count} branches")
            return readers[index](b, end)

        return read_union
    if isinstance(t, dict) and t.get("type") == "record":
        cls, plan = nested(schema, t)
        steps, discards = reader_steps(schema, plan)
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
    raise NotCompiled(str(t))


def reader_steps(
    schema: Schema, plan: Iterable[Field]
) -> tuple[tuple[tuple[str, Reader], ...], bool]:
    steps = tuple((f.attr or "", _reader(schema, f.type)) for f in flat(plan))
    return steps, any(name == "" for name, _ in steps)
