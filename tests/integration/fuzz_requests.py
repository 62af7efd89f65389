"""Hostile requests, generated deterministically from valid seed requests.

Two generators, both seeded (a case is reproducible from its seed):

- `byte_cases(seed_bytes, rng)`: the serialized seed mutated at the byte level: random bytes,
  truncations, bit flips, inserted, deleted and duplicated runs.
- `field_cases(seed_message, rng)`: the seed with some fields (at any depth, found through the
  message descriptors) set to boundary or hostile values: integer extremes, NaN and infinities,
  huge, empty and NUL-bearing strings, unknown enum values, long repeated fields, and
  google.protobuf.Struct values holding NaN or nested hundreds deep.
"""

from __future__ import annotations

import math
import random

from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message

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
    struct = struct_pb2.Struct()
    if kind == 0:
        struct.update({"x": rng.choice((math.nan, math.inf, -math.inf))})
    elif kind == 1:
        value = struct_pb2.Value(string_value="deep")
        # protobuf parses at most 100 levels: deeper requests are refused as malformed before any
        # code of ours runs (test_core_malformed.py), so go as deep as a request can carry.
        for _ in range(rng.choice((10, 25, 40))):  # two message levels each
            outer = struct_pb2.Value()
            outer.list_value.values.append(value)
            value = outer
        struct.fields["deep"].CopyFrom(value)
    elif kind == 2:
        struct.update({rng.choice(STRINGS): rng.choice(STRINGS)[:1000] for _ in range(3)})
    else:
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
