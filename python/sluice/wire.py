"""Canonical msgpack for Sluice's seams: checked codecs for each wire type, and message sets.

Both ZeroMQ seams (frontend <-> engine core, engine core <-> workers) encode with these rules: a
message is a map whose first keys are `v` (the seam's protocol version) and `type`, then its
fields in a fixed order, every key present, floats as float64, maps keyed by token id in
ascending key order. Equal values give equal bytes, which the golden vectors check. Decoding
checks every key and type and raises ProtocolError, never anything else, whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from sluice.errors import SluiceError


class ProtocolError(SluiceError, ValueError):
    """Bytes that are not a well-formed message, or a message that cannot be encoded.

    `request_id` is set when a malformed message (an `add_request`) still named its request, so
    the receiver can answer it with an error instead of leaving it hanging.
    """

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class UnknownVersionError(ProtocolError):
    """The message's `v` is not a protocol version this side speaks."""


class UnknownMessageTypeError(ProtocolError):
    """The message's `type` is not one the protocol defines."""


# Codecs: each is a pair of functions that check one wire value and return it. Failures name the
# path to the bad value (so a log line says what was wrong); the path is worked out only on
# failure, by re-running the failed container's items, so the hot path builds no strings.


class Invalid(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []

    def at(self, segment: str) -> Invalid:
        self.path.insert(0, segment)
        return self

    def __str__(self) -> str:
        path = "".join(self.path).lstrip(".")
        return f"{path}: {self.message}" if path else self.message


def _locate(fn: Callable[[Any], Any], items: Iterable[tuple[str, Any]]) -> None:
    """Re-run fn over (segment, value) pairs; raise the first failure with its segment."""
    for segment, value in items:
        try:
            fn(value)
        except Invalid as exc:
            raise exc.at(segment) from None


@dataclass(frozen=True, slots=True)
class Codec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _check_int(value: Any) -> int:
    # bool is an int in Python but a distinct msgpack type.
    if type(value) is not int:
        raise Invalid(f"expected an int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**64:
        raise Invalid("int out of msgpack's 64-bit range")
    return value


def _encode_float(value: Any) -> float:
    if type(value) is not float and type(value) is not int:
        raise Invalid(f"expected a float, got {type(value).__name__}")
    return float(value)


def _decode_float(value: Any) -> float:
    if type(value) is not float:
        raise Invalid(f"expected a float64, got {type(value).__name__}")
    return value


def _check_of(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise Invalid(f"expected a {kind.__name__}, got {type(value).__name__}")
        return value

    return check


INT = Codec(_check_int, _check_int)
FLOAT = Codec(_encode_float, _decode_float)
STR = Codec(_check_of(str), _check_of(str))
BOOL = Codec(_check_of(bool), _check_of(bool))
BYTES = Codec(_check_of(bytes), _check_of(bytes))


def optional(inner: Codec) -> Codec:
    return Codec(
        lambda v: None if v is None else inner.encode(v),
        lambda v: None if v is None else inner.decode(v),
    )


def list_of(inner: Codec) -> Codec:
    def walk(fn: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
        def run(value: Any) -> list[Any]:
            if type(value) is not list and type(value) is not tuple:
                raise Invalid(f"expected an array, got {type(value).__name__}")
            try:
                return [fn(item) for item in value]
            except Invalid:
                _locate(fn, ((f"[{i}]", item) for i, item in enumerate(value)))
                raise

        return run

    return Codec(walk(inner.encode), walk(inner.decode))


def _int_list_decode(value: Any) -> list[int]:
    # The hot path of the worker seam (token and block ids): one type check per item, no closures.
    if type(value) is not list:
        raise Invalid(f"expected an array, got {type(value).__name__}")
    for item in value:
        if type(item) is not int:
            _locate(_check_int, ((f"[{i}]", v) for i, v in enumerate(value)))
    return value


INT_LIST = Codec(list_of(INT).encode, _int_list_decode)


def token_map(inner: Codec) -> Codec:
    """A map keyed by token id, written with its keys ascending."""

    def walk(fn: Callable[[Any], Any]) -> Callable[[Any], dict[int, Any]]:
        def run(value: Any) -> dict[int, Any]:
            if type(value) is not dict:
                raise Invalid(f"expected a map, got {type(value).__name__}")
            _locate(_check_int, ((".<key>", key) for key in value))
            try:
                return {key: fn(value[key]) for key in sorted(value)}
            except Invalid:
                _locate(fn, ((f"[{key}]", item) for key, item in value.items()))
                raise

        return run

    return Codec(walk(inner.encode), walk(inner.decode))


def _check_scalar(value: Any) -> Any:
    if type(value) is int:
        return _check_int(value)
    if value is not None and type(value) not in (bool, float, str):
        raise Invalid(f"expected a scalar, got {type(value).__name__}")
    return value


def _check_scalar_map(value: Any) -> dict[str, Any]:
    """str keys, scalar values, kept in the order given."""
    if type(value) is not dict:
        raise Invalid(f"expected a map, got {type(value).__name__}")
    _locate(STR.decode, ((".<key>", key) for key in value))
    _locate(_check_scalar, ((f".{key}", item) for key, item in value.items()))
    return dict(value)


SCALAR_MAP = Codec(_check_scalar_map, _check_scalar_map)


def one_of(inner: Codec, allowed: tuple[str, ...]) -> Codec:
    def check(value: Any) -> Any:
        value = inner.decode(value)
        if value not in allowed:
            raise Invalid(f"expected one of {', '.join(allowed)}, got {value!r}")
        return value

    return Codec(check, check)


@dataclass(frozen=True, slots=True)
class Record:
    """A dataclass (or, with make=dict, a plain dict) as a msgpack map: every key present, in `fields` order."""

    make: Callable[..., Any]
    fields: tuple[tuple[str, Codec], ...]

    def encode(self, obj: Any) -> dict[str, Any]:
        get = _item if self.make is dict else getattr
        try:
            return {name: codec.encode(get(obj, name)) for name, codec in self.fields}
        except (Invalid, KeyError, AttributeError):
            for name, codec in self.fields:
                try:
                    value = get(obj, name)
                except (KeyError, AttributeError):
                    raise Invalid(f"missing {name!r}") from None
                _locate(codec.encode, [(f".{name}", value)])
            raise

    def decode(self, value: Any) -> Any:
        if type(value) is not dict:
            raise Invalid(f"expected a map, got {type(value).__name__}")
        if len(value) != len(self.fields) or any(name not in value for name, _ in self.fields):
            names = [name for name, _ in self.fields]
            missing = [name for name in names if name not in value]
            if missing:
                raise Invalid(f"missing key(s) {', '.join(missing)}")
            raise Invalid(f"unknown key(s) {', '.join(repr(k) for k in value if k not in names)}")
        try:
            return self.make(**{name: codec.decode(value[name]) for name, codec in self.fields})
        except Invalid:
            for name, codec in self.fields:
                _locate(codec.decode, [(f".{name}", value[name])])
            raise

    @property
    def codec(self) -> Codec:
        return Codec(self.encode, self.decode)


def _item(obj: Any, name: str) -> Any:
    if type(obj) is not dict:
        raise Invalid(f"expected a map, got {type(obj).__name__}")
    return obj[name]


class MessageSet:
    """One seam's messages: a version, and a type tag per message dataclass."""

    def __init__(self, version: int, records: dict[type, tuple[str, Record]]) -> None:
        self.version = version
        self._by_class = records
        self._by_tag = {tag: record for tag, record in records.values()}

    def encode(self, message: Any) -> bytes:
        """The canonical msgpack bytes of `message`; ProtocolError if it breaks the seam's types."""
        entry = self._by_class.get(type(message))
        if entry is None:
            raise ProtocolError(f"not a protocol message: {type(message).__name__}")
        tag, record = entry
        try:
            body = {"v": self.version, "type": tag, **record.encode(message)}
            return msgpack.packb(body, use_bin_type=True, use_single_float=False)
        except Invalid as exc:
            raise ProtocolError(f"cannot encode {tag}: {exc}") from None

    def decode(self, data: bytes) -> Any:
        """The message in `data`; ProtocolError (or a subclass) for anything that is not one."""
        try:
            # int map keys (logit_bias) need strict_map_key off; nothing but a map is accepted below.
            body = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
        # msgpack raises many types on garbage (ValueError, TypeError, ...): all mean "not a message".
        except Exception as exc:  # noqa: BLE001
            raise ProtocolError(f"not a msgpack body: {type(exc).__name__}: {exc}") from None
        if type(body) is not dict:
            raise ProtocolError(f"a message is a msgpack map, got {type(body).__name__}")
        version = body.get("v")
        if type(version) is not int or version != self.version:
            raise UnknownVersionError(f"unknown protocol version {version!r}")
        tag = body.get("type")
        record = self._by_tag.get(tag) if type(tag) is str else None
        if record is None:
            raise UnknownMessageTypeError(f"unknown message type {tag!r}")
        fields = {key: value for key, value in body.items() if key not in ("v", "type")}
        try:
            return record.decode(fields)
        except Invalid as exc:
            # A malformed message that still names its request can be answered instead of left hanging.
            request_id = fields.get("request_id")
            raise ProtocolError(
                f"malformed {tag}: {exc}", request_id=request_id if type(request_id) is str else None
            ) from None
