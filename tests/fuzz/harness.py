"""Descriptor-driven fuzzing of a gRPC service through its generated stubs' descriptors.

For each rpc of a service, messages are drawn with hypothesis from the request's protobuf descriptor (every
field type, nested messages, repeated fields, open enums with unknown values, NaN/inf floats, extreme
integers, any unicode), or mutated from a known-good request (one field replaced by a random value or
cleared, or the serialized bytes flipped, cut or extended and sent raw). Every call must end with a status
code within its deadline; UNKNOWN (an exception escaped a handler) is a failure, and so is INTERNAL except
for raw bytes that do not parse (gRPC's own answer to an undecodable request).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor as d
from google.protobuf.message import Message
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

_F = d.FieldDescriptor
_INTS = {
    _F.TYPE_INT32: (-2**31, 2**31 - 1), _F.TYPE_SINT32: (-2**31, 2**31 - 1), _F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    _F.TYPE_INT64: (-2**63, 2**63 - 1), _F.TYPE_SINT64: (-2**63, 2**63 - 1), _F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 3


def _repeated(f: d.FieldDescriptor) -> bool:
    return f.is_repeated  # (FieldDescriptor.label is gone from the upb runtime)


def _int(lo: int, hi: int) -> SearchStrategy[int]:
    """Small values mostly (what validation must handle), the extremes and a few huge ones."""
    edges = [v for v in (lo, hi, 0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1) if lo <= v <= hi]
    return st.one_of(st.integers(max(lo, -64), min(hi, 4096)), st.sampled_from(edges), st.integers(lo, hi))


def _scalar(f: d.FieldDescriptor) -> SearchStrategy[Any]:
    t = f.type
    if t in _INTS:
        return _int(*_INTS[t])
    if t in (_F.TYPE_DOUBLE, _F.TYPE_FLOAT):
        width = 32 if t == _F.TYPE_FLOAT else 64
        return st.one_of(st.floats(-4.0, 4.0, width=width), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e30]),
                         st.floats(width=width))
    if t == _F.TYPE_BOOL:
        return st.booleans()
    if t == _F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(["", "../../etc/passwd", "a" * 5000, "\x00", "0"]))
    if t == _F.TYPE_BYTES:
        return st.binary(max_size=96)
    if t == _F.TYPE_ENUM:
        values = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(values), st.integers(-5, 1000))  # proto3 enums are open
    raise TypeError(f"no strategy for field {f.full_name} (type {t})")


def field_values(f: d.FieldDescriptor, depth: int) -> SearchStrategy[Any]:
    one = message_strategy(f.message_type, depth + 1) if f.type == _F.TYPE_MESSAGE else _scalar(f)
    if _repeated(f):
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            return st.lists(one, max_size=3)
        return st.lists(one, max_size=4 if depth else 6)
    return one


def message_strategy(desc: d.Descriptor, depth: int = 0) -> SearchStrategy[Message]:
    """Messages of `desc` with a random subset of fields set to random values (nested up to MAX_DEPTH)."""
    cls = _message_class(desc)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    optional = {f.name: st.deferred(lambda f=f: field_values(f, depth)) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: build(cls, values))


def _message_class(desc: d.Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


def build(cls: type[Message], values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        set_field(msg, msg.DESCRIPTOR.fields_by_name[name], value)
    return msg


def set_field(msg: Message, f: d.FieldDescriptor, value: Any) -> None:
    if _repeated(f):
        msg.ClearField(f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            target = getattr(msg, f.name)
            for entry in value:
                key = entry.key
                if f.message_type.fields_by_name["value"].type == _F.TYPE_MESSAGE:
                    target[key].CopyFrom(entry.value)
                else:
                    target[key] = entry.value
            return
        getattr(msg, f.name).extend(value)
    elif f.type == _F.TYPE_MESSAGE:
        getattr(msg, f.name).CopyFrom(value)
    else:
        setattr(msg, f.name, value)


# --- mutations of good requests -----------------------------------------------------------------------


def mutated(good: Message) -> SearchStrategy[Message | bytes]:
    """`good` with one field (at any depth) replaced or cleared, or its serialized bytes damaged."""
    paths = _field_paths(good.DESCRIPTOR)

    @st.composite
    def one_field(draw: Any) -> Message:
        msg = type(good)()
        msg.CopyFrom(good)
        path = draw(st.sampled_from(paths))
        parent = msg
        for f in path[:-1]:
            parent = getattr(parent, f.name)
        last = path[-1]
        if draw(st.booleans()):
            parent.ClearField(last.name)
        else:
            set_field(parent, last, draw(field_values(last, 1)))
        return msg

    @st.composite
    def raw(draw: Any) -> bytes:
        data = bytearray(good.SerializeToString())
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            if op == "flip" and data:
                i = draw(st.integers(0, len(data) - 1))
                data[i] ^= 1 << draw(st.integers(0, 7))
            elif op == "cut" and data:
                i = draw(st.integers(0, len(data) - 1))
                del data[i:i + draw(st.integers(1, 8))]
            else:
                i = draw(st.integers(0, len(data)))
                data[i:i] = draw(st.binary(min_size=1, max_size=8))
        return bytes(data)

    return st.one_of(one_field(), raw()) if paths else raw()


def _field_paths(desc: d.Descriptor, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    out = []
    for f in desc.fields:
        out.append((*prefix, f))
        if f.type == _F.TYPE_MESSAGE and not _repeated(f) and depth < 2:
            out += _field_paths(f.message_type, (*prefix, f), depth + 1)
    return out


# --- calls ------------------------------------------------------------------------------------------


@dataclass
class Rpc:
    """One rpc of a service, as the harness calls it."""

    name: str
    method: d.MethodDescriptor
    path: str

    @property
    def request(self) -> d.Descriptor:
        return self.method.input_type


def rpcs(service: d.ServiceDescriptor) -> list[Rpc]:
    return [Rpc(m.name, m, f"/{service.full_name}/{m.name}") for m in service.methods]


@dataclass
class Outcome:
    rpc: str
    code: grpc.StatusCode
    details: str
    raw: bool


@dataclass
class Report:
    """What the fuzzing got back: codes per rpc, and every reply that broke the rules."""

    codes: Counter = field(default_factory=Counter)
    failures: list[Outcome] = field(default_factory=list)
    sent: int = 0

    def add(self, outcome: Outcome, allowed_deadline: bool) -> None:
        self.sent += 1
        self.codes[(outcome.rpc, outcome.code.name)] += 1
        bad = outcome.code == grpc.StatusCode.UNKNOWN
        bad |= outcome.code == grpc.StatusCode.INTERNAL and not outcome.raw
        bad |= outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED and not allowed_deadline
        if bad:
            self.failures.append(outcome)


def call(channel: grpc.Channel, rpc: Rpc, payload: Message | bytes | list, deadline_s: float,
         max_replies: int = 64) -> Outcome:
    """Sends `payload` (a message, raw bytes, or a list of either for a client stream); the status it ends with."""
    raw = isinstance(payload, bytes) or (isinstance(payload, list) and any(isinstance(p, bytes) for p in payload))

    def serialize(m: Message | bytes) -> bytes:
        return m if isinstance(m, bytes) else m.SerializeToString()

    kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    method = rpc.method
    callable_ = kinds[(method.client_streaming, method.server_streaming)](
        rpc.path, request_serializer=serialize, response_deserializer=_message_class(method.output_type).FromString)
    request = iter(payload if isinstance(payload, list) else [payload]) if method.client_streaming else payload
    try:
        if method.server_streaming:
            replies = callable_(request, timeout=deadline_s)
            for i, _ in enumerate(replies):
                if i + 1 >= max_replies:
                    replies.cancel()
                    break
        else:
            callable_(request, timeout=deadline_s)
    except grpc.RpcError as e:
        return Outcome(rpc.name, e.code(), e.details() or "", raw)
    return Outcome(rpc.name, grpc.StatusCode.OK, "", raw)


@dataclass
class Target:
    """A service under fuzzing: where it is, good requests per rpc, and how the harness must treat its rpcs.

    Args:
        good: rpc name -> good requests (mutated, and one of them sent as is now and then).
        fix: rpc name -> a function applied to each drawn request before it is sent (e.g. a checkpoint dir
            confined to the test's tmp dir: what is fuzzed is the service's validation, not the filesystem).
        skip: rpcs not fuzzed, with the reason (documented in the test).
        slow: rpcs whose valid requests may legitimately run past the deadline (generation of many tokens).
        after: rpc name -> a call made after each fuzzed call of it (e.g. Wake after Sleep, so that the
            other rpcs keep meeting an awake engine).
    """

    channel: grpc.Channel
    service: d.ServiceDescriptor
    good: dict[str, list[Message]]
    fix: dict[str, Callable[[Message], Message]] = field(default_factory=dict)
    skip: dict[str, str] = field(default_factory=dict)
    slow: frozenset[str] = frozenset()
    after: dict[str, Callable[[], None]] = field(default_factory=dict)
    deadline_s: float = 20.0

    def rpcs(self) -> list[Rpc]:
        return [r for r in rpcs(self.service) if r.name not in self.skip]


def payloads(target: Target, rpc: Rpc) -> SearchStrategy[Message | bytes | list]:
    """Random requests, mutations of the good ones, and the good ones themselves; lists for client streams."""
    choices = [message_strategy(rpc.request)]
    good = target.good.get(rpc.name, [])
    if good:
        choices += [st.sampled_from(good).flatmap(mutated), st.sampled_from(good)]
    one = st.one_of(*choices)
    fix = target.fix.get(rpc.name)
    if fix is not None:
        one = one.map(lambda m: m if isinstance(m, bytes) else fix(m))
    return st.lists(one, min_size=0, max_size=3) if rpc.method.client_streaming else one


def fuzz_step(target: Target, data: Any, report: Report) -> None:
    """One hypothesis example: an rpc, a payload, a call, its outcome recorded."""
    rpc = data.draw(st.sampled_from(target.rpcs()))
    payload = data.draw(payloads(target, rpc))
    outcome = call(target.channel, rpc, payload, target.deadline_s)
    report.add(outcome, allowed_deadline=rpc.name in target.slow)
    if rpc.name in target.after:
        target.after[rpc.name]()
