"""Reward requests off the wire: a parse that never raises, and the name of the field that broke it.

gRPC's own deserializer turns a message that protobuf refuses (most often a `string` field that is not
UTF-8, which proto3 forbids) into INTERNAL with no detail. The servicer registers its methods with
`lenient(...)` instead, so such a request arrives as an `Undecodable` saying which field is wrong
(`requests[3].response is not valid UTF-8`), and the call ends with INVALID_ARGUMENT.
"""

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Undecodable:
    """A request protobuf could not parse; `problem` names the field when it can be found."""

    problem: str


def lenient(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer for `message_class` that returns `Undecodable` instead of raising."""
    name = message_class.DESCRIPTOR.name

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except DecodeError:
            field = invalid_utf8_field(message_class.DESCRIPTOR, data)
            if field is not None:
                return Undecodable(f"{name}.{field} is not valid UTF-8: string fields must be UTF-8 "
                                   "(send bytes you cannot decode as text in some other way)")
            return Undecodable(f"the request is not a valid {name} message")

    return parse


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise IndexError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def invalid_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path (`requests[2].response`) of the first string field in `data` that is not UTF-8.

    Walks the wire format with the message's descriptor; None when every string decodes or the bytes
    are malformed in some other way.
    """
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, pos = _varint(data, pos)
                continue
            if wire_type in (_FIXED64, _FIXED32):
                pos += 8 if wire_type == _FIXED64 else 4
                continue
            if wire_type != _LENGTH_DELIMITED:
                return None  # groups: not in our protos
            length, pos = _varint(data, pos)
            chunk, pos = data[pos : pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            path = f"{prefix}{field.name}" + (f"[{index}]" if field.is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                chunk.decode("utf-8")  # raises for the field we are looking for
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                inner = invalid_utf8_field(field.message_type, chunk, f"{path}.")
                if inner is not None:
                    return inner
    except UnicodeDecodeError:
        return path
    except IndexError:
        return None
    return None
