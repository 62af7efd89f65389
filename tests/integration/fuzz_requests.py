"""Hostile requests, generated deterministically from valid seed requests.

Two random generators, both seeded (a case is reproducible from its seed):

- `byte_cases(seed_bytes, rng)`: the serialized seed mutated at the byte level: random bytes,
  truncations, bit flips, inserted, deleted and duplicated runs.
- `field_cases(seed_message, rng)`: the seed with some fields (at any depth, found through the
  message descriptors) set to boundary or hostile values: integer extremes, NaN and infinities,
  huge, empty and NUL-bearing strings, unknown enum values, long repeated fields, and
  google.protobuf.Struct values holding NaN or nested hundreds deep.

And one exhaustive sweep, with no randomness at all:

- `field_sweep(seed_message)`: every field the request's descriptors declare, one at a time, at
  any depth (sub-messages, repeated and map fields, oneof members, set in the seed or not),
  cleared, zero or empty, and set to each extreme of its type (integer limits, NaN and
  infinities, 100,000-character strings, NUL bytes, strings and bytes that are not UTF-8, unknown
  enum numbers, 10,000-element lists). Where `field_cases` samples, this misses no field: a
  field a caller may leave out is left out once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

INT32 = (0, 1, -1, 2**31 - 1, -(2**31))
UINT32 = (0, 1, 2**31, 2**32 - 1)
INT64 = (0, -1, 2**63 - 1, -(2**63))
UINT64 = (0, 1, 2**63, 2**64 - 1)
FLOATS = (0.0, -0.0, math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 1e-45, -1.0, 0.5)
STRINGS = ("", "\x00", "x" * 20_000, "é" * 3000, "<|im_end|>", "<|im_start|>system", "{{ 7 * 7 }}",
           "{% if %}", "../../../etc/passwd", "null", "\u202e", "🎉" * 500, " " * 100, "a\x00b")
BYTES = (b"", b"\x00" * 16, bytes(range(256)), b"\x89PNG\r\n\x1a\n" + b"\x00" * 32, b"GIF89a")
INTS_BY_TYPE = {F.TYPE_INT32: INT32, F.TYPE_SINT32: INT32, F.TYPE_SFIXED32: INT32,
                F.TYPE_UINT32: UINT32, F.TYPE_FIXED32: UINT32,
                F.TYPE_INT64: INT64, F.TYPE_SINT64: INT64, F.TYPE_SFIXED64: INT64,
                F.TYPE_UINT64: UINT64, F.TYPE_FIXED64: UINT64}


def byte_cases(seed_bytes: bytes, rng: random.Random) -> bytes:
    """One byte-level mutation of `seed_bytes`."""
    data = bytearray(seed_bytes)
    kind = rng.randrange(6)
    if kind == 0 or not data:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 256)))
    if kind == 1:
        return bytes(data[:rng.randrange(len(data))])
    if kind == 2:
        for _ in range(rng.randint(1, 8)):
            position = rng.randrange(len(data))
            data[position] ^= 1 << rng.randrange(8)
        return bytes(data)
    position = rng.randrange(len(data) + 1)
    if kind == 3:
        return bytes(data[:position] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[position:])
    if kind == 4:
        end = min(len(data), position + rng.randint(1, 16))
        return bytes(data[:position] + data[end:])
    end = min(len(data), position + rng.randint(1, 64))
    return bytes(data[:end] + data[position:end] * rng.randint(1, 20) + data[end:])


def hostile_struct(rng: random.Random) -> struct_pb2.Struct:
    kind = rng.randrange(4)
    if kind == 0:
        return _nan_struct(rng.choice((math.nan, math.inf, -math.inf)))
    if kind == 1:
        return _deep_struct(rng.choice((10, 25, 40)))
    if kind == 2:
        struct = struct_pb2.Struct()
        struct.update({rng.choice(STRINGS): rng.choice(STRINGS)[:1000] for _ in range(3)})
        return struct
    return _wide_struct()


def _nan_struct(value: float) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update({"x": value})
    return struct


def _deep_struct(depth: int) -> struct_pb2.Struct:
    """A Struct nested `depth` lists deep (two message levels each). protobuf parses at most 100
    levels: deeper requests are refused as malformed before any code of ours runs
    (test_core_malformed.py), so 40 is as deep as a request can carry."""
    value = struct_pb2.Value(string_value="deep")
    for _ in range(depth):
        outer = struct_pb2.Value()
        outer.list_value.values.append(value)
        value = outer
    struct = struct_pb2.Struct()
    struct.fields["deep"].CopyFrom(value)
    return struct


def _wide_struct() -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update({f"k{i}": i for i in range(2000)})
    return struct


def _scalar(field, rng: random.Random):
    if field.type in INTS_BY_TYPE:
        return rng.choice(INTS_BY_TYPE[field.type])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice(FLOATS)
    if field.type == F.TYPE_BOOL:
        return rng.choice((True, False))
    if field.type == F.TYPE_STRING:
        return rng.choice(STRINGS)
    if field.type == F.TYPE_BYTES:
        return rng.choice(BYTES)
    if field.type == F.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        return rng.choice((*known, max(known) + 1, 99, -1))
    raise AssertionError(f"unexpected field type {field.type}")


def _fields(message: Message) -> list:
    return list(message.DESCRIPTOR.fields)


def _mutate_one(message: Message, rng: random.Random, depth: int) -> None:
    field = rng.choice(_fields(message))
    if field.message_type is not None and field.message_type.full_name == "google.protobuf.Struct":
        target = getattr(message, field.name).add() if _is_repeated(field) else getattr(message, field.name)
        target.CopyFrom(hostile_struct(rng))
        return
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        container = getattr(message, field.name)
        key = rng.choice(STRINGS)[:200]
        value_field = field.message_type.fields_by_name["value"]
        if value_field.message_type is None:
            container[key] = _scalar(value_field, rng)
        else:
            container[key].SetInParent()
        return
    if field.message_type is not None:
        if _is_repeated(field):
            container = getattr(message, field.name)
            child = container.add() if not container or rng.random() < 0.5 else rng.choice(container)
        else:
            child = getattr(message, field.name)
        if depth < 6 and _fields(child):
            _mutate_one(child, rng, depth + 1)
        else:
            child.SetInParent()
        return
    if _is_repeated(field):
        container = getattr(message, field.name)
        value = _scalar(field, rng)
        if isinstance(value, (str, bytes)) and len(value) > 100:
            value = value[:100]
        del container[:]
        container.extend([value] * rng.choice((0, 1, 1000, 5000)))
        return
    setattr(message, field.name, _scalar(field, rng))


def _is_repeated(field) -> bool:
    return field.is_repeated


def field_cases(seed_message: Message, rng: random.Random) -> Message:
    """`seed_message` with one to four fields, at any depth, set to hostile values."""
    message = type(seed_message)()
    message.CopyFrom(seed_message)
    if not _fields(message):
        return message
    for _ in range(rng.randint(1, 4)):
        try:
            _mutate_one(message, rng, 0)
        except (ValueError, TypeError, OverflowError):
            pass  # a value the Python API itself refuses (e.g. an int out of an enum's range): skip it
    return message


# ---------------------------------------------------------------- the exhaustive sweep

#: What a string field is set to where the case needs bytes that are not UTF-8: protobuf's Python
#: API refuses those in a string, so the serialized request has this marker replaced, byte for
#: byte (the length prefix stays right), by NOT_UTF8 bytes.
_NOT_UTF8_MARKER = "\x01not-utf8-marker\x01"
_NOT_UTF8 = b"\xff" * len(_NOT_UTF8_MARKER.encode())
_LONG = 100_000
_LONG_LIST = 10_000
_SWEEP_INTS = {"int32": (-1, -(2**31), 2**31 - 1), "uint32": (2**31, 2**32 - 1),
               "int64": (-1, -(2**63), 2**63 - 1), "uint64": (2**63, 2**64 - 1)}
_INT_KIND = {F.TYPE_INT32: "int32", F.TYPE_SINT32: "int32", F.TYPE_SFIXED32: "int32",
             F.TYPE_UINT32: "uint32", F.TYPE_FIXED32: "uint32",
             F.TYPE_INT64: "int64", F.TYPE_SINT64: "int64", F.TYPE_SFIXED64: "int64",
             F.TYPE_UINT64: "uint64", F.TYPE_FIXED64: "uint64"}
_SWEEP_FLOATS = (-1.0, math.nan, math.inf, -math.inf, 3.4e38, 1e-45)
_SWEEP_STRINGS = ("x" * _LONG, "a\x00b", _NOT_UTF8_MARKER)
_SWEEP_BYTES = (b"\xff\xfe\xfd", b"\x00" * 16, b"x" * _LONG)
_STRUCT_TYPES = ("google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue")


@dataclass(frozen=True)
class SweepCase:
    """One request of the sweep: the seed with one field changed."""

    path: str  # the field as tito's error messages name it, e.g. "mm_features.items[0].placeholder"
    change: str  # what was done to it: "cleared", "= -1", "+ empty element", ...
    payload: bytes  # the request, serialized

    def __str__(self) -> str:
        return f"{self.path or '(the seed)'} {self.change}"


#: Finds, in a fresh copy of the seed, the (sub-)message a case changes (creating it if unset).
_Locate = Callable[[Message], Message]


def field_sweep(seed: Message) -> Iterator[SweepCase]:
    """Every field-level case of `seed`, in descriptor order; the first is the seed unchanged."""
    yield SweepCase("", "unchanged", seed.SerializeToString())
    yield from _Sweep(seed).cases(seed, lambda root: root, "", ())


class _Sweep:
    """The cases of one seed. A sub-message type the seed leaves empty is swept where it first
    occurs only: its fields start from the same zero values wherever it sits (a chat's four
    messages would otherwise sweep an empty ContentPart four times)."""

    def __init__(self, seed: Message):
        self.seed = seed
        self.empty_types_swept: set[str] = set()

    def cases(self, view: Message, locate: _Locate, path: str, outer_types: tuple) -> Iterator[SweepCase]:
        """The cases of each field of `view` (the seed's sub-message `locate` finds, or an empty
        one where the seed has none), then of the fields of its sub-messages."""
        for field in view.DESCRIPTOR.fields:
            field_path = f"{path}.{field.name}" if path else field.name
            for change, apply in _changes(field):
                yield self._case(field_path, change, locate, apply)
            for sub_path, sub_view, sub_locate in _children(field, view, locate, field_path):
                if self._enters(sub_view, outer_types):
                    yield from self.cases(sub_view, sub_locate, sub_path, (*outer_types, sub_view.DESCRIPTOR.full_name))

    def _enters(self, view: Message, outer_types: tuple) -> bool:
        type_name = view.DESCRIPTOR.full_name
        if type_name in outer_types:  # a recursive type: its fields were swept one level up
            return False
        if view.ByteSize():
            return True
        if type_name in self.empty_types_swept:
            return False
        self.empty_types_swept.add(type_name)
        return True

    def _case(self, path: str, change: str, locate: _Locate, apply: Callable[[Message], None]) -> SweepCase:
        root = type(self.seed)()
        root.CopyFrom(self.seed)
        apply(locate(root))
        return SweepCase(path, change, root.SerializeToString().replace(_NOT_UTF8_MARKER.encode(), _NOT_UTF8))


def _children(field, view: Message, locate: _Locate, field_path: str) -> Iterator[tuple[str, Message, _Locate]]:
    """The sub-messages of `field` to sweep in turn: (path, the seed's value, its locator)."""
    if field.message_type is None or field.message_type.full_name in _STRUCT_TYPES:
        return
    name = field.name
    if field.message_type.GetOptions().map_entry:
        if field.message_type.fields_by_name["value"].message_type is None:
            return
        for key in sorted(getattr(view, name)):
            yield (f"{field_path}[{key!r}]", getattr(view, name)[key],
                   lambda root, key=key: getattr(locate(root), name)[key])
    elif field.is_repeated:
        elements = getattr(view, name)
        for index in _distinct_elements(elements):
            yield (f"{field_path}[{index}]", elements[index] if elements else GetMessageClass(field.message_type)(),
                   lambda root, index=index: _element(getattr(locate(root), name), index))
    else:
        yield field_path, getattr(view, name), lambda root: getattr(locate(root), name)


def _distinct_elements(elements) -> list[int]:
    """The index of each element whose set fields differ from every earlier one's (a chat's
    system, user, assistant and tool messages), or [0] for an empty list (an element is added)."""
    shapes: dict[tuple, int] = {}
    for index, element in enumerate(elements):
        shapes.setdefault(tuple(f.name for f, _ in element.ListFields()), index)
    return list(shapes.values()) or [0]


def _element(container, index: int) -> Message:
    while len(container) <= index:
        container.add()
    return container[index]


def _changes(field) -> list[tuple[str, Callable[[Message], None]]]:
    """(what, how) for every change of `field` alone."""
    name = field.name
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _map_changes(field)
    if field.message_type is not None and field.is_repeated:
        return [("cleared", lambda m: m.ClearField(name)),
                ("+ empty element", lambda m: getattr(m, name).add()),
                ("first element twice", lambda m: _repeat_first(getattr(m, name)))]
    if field.message_type is not None:
        changes = [("cleared", lambda m: m.ClearField(name)), ("empty", lambda m: _set_empty(m, name))]
        if field.message_type.full_name == "google.protobuf.Struct":
            changes += [(f"= Struct {what}", lambda m, make=make: getattr(m, name).CopyFrom(make()))
                        for what, make in _HOSTILE_STRUCTS.items()]
        return changes
    if field.is_repeated:
        return [("cleared", lambda m: m.ClearField(name)),
                (f"x {_LONG_LIST}", lambda m: _lengthen(getattr(m, name), _zero(field)))] + \
            [(f"[0] = {_shown(value)}", lambda m, value=value: _set_first(getattr(m, name), value))
             for value in _values(field)]
    changes = [("cleared", lambda m: m.ClearField(name))] if field.has_presence else []
    return changes + [(f"= {_shown(value)}", lambda m, value=value: setattr(m, name, value))
                      for value in _values(field)]


def _map_changes(field) -> list[tuple[str, Callable[[Message], None]]]:
    name = field.name
    value_field = field.message_type.fields_by_name["value"]

    def put(message: Message, key) -> None:
        container = getattr(message, name)
        if value_field.message_type is None:
            container[key] = _zero(value_field)
        else:
            container[key].SetInParent()

    key_field = field.message_type.fields_by_name["key"]
    keys = ("", "k" * _LONG) if key_field.type == F.TYPE_STRING else (_zero(key_field),)
    return [("cleared", lambda m: m.ClearField(name))] + \
        [(f"+ entry {_shown(key)}", lambda m, key=key: put(m, key)) for key in keys]


def _values(field) -> tuple:
    """Zero, then the extremes, of a scalar field's type."""
    if field.type in _INT_KIND:
        return (0, *_SWEEP_INTS[_INT_KIND[field.type]])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return (0.0, *_SWEEP_FLOATS)
    if field.type == F.TYPE_BOOL:
        return (False, True)
    if field.type == F.TYPE_STRING:
        return ("", *_SWEEP_STRINGS)
    if field.type == F.TYPE_BYTES:
        return (b"", *_SWEEP_BYTES)
    if field.type == F.TYPE_ENUM:
        return (0, max(value.number for value in field.enum_type.values) + 1, -1)
    raise AssertionError(f"unexpected field type {field.type}")


def _zero(field):
    return _values(field)[0]


def _shown(value) -> str:
    if isinstance(value, (str, bytes)) and len(value) > 20:
        return f"{type(value).__name__} of {len(value)}"
    return "not UTF-8" if value == _NOT_UTF8_MARKER else repr(value)


def _set_empty(message: Message, name: str) -> None:
    message.ClearField(name)
    getattr(message, name).SetInParent()


def _repeat_first(container) -> None:
    if container:
        container.add().CopyFrom(container[0])


def _set_first(container, value) -> None:
    if container:
        container[0] = value
    else:
        container.append(value)


def _lengthen(container, zero) -> None:
    values = list(container) or [zero]
    container.extend(values * (_LONG_LIST // len(values)))


_HOSTILE_STRUCTS = {"holding NaN": lambda: _nan_struct(math.nan), "40 lists deep": lambda: _deep_struct(40),
                    "of 2000 keys": _wide_struct}
