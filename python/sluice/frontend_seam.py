"""Messages between the Rust frontend and the engine core, and their msgpack encoding.

docs/protocol.md is the contract; this module is its Python half. Each message is a slots
dataclass. `encode` writes the canonical bytes (`v` and `type` first, then the keys in the
table's order, floats as float64, logit_bias keys ascending, nil for absent values) so that
equal values give equal bytes in both languages. `decode` checks every key and type and
raises ProtocolError, never anything else, whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from sluice.errors import SluiceError
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import Logprobs

PROTOCOL_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort", "error")
UTILITY_METHODS = ("health", "stats")


class ProtocolError(SluiceError, ValueError):
    """Bytes that are not a well-formed message, or a message that cannot be encoded.

    `request_id` is set when a malformed `add_request` still named its request, so the
    engine core can answer it with an error instead of leaving it hanging.
    """

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class UnknownVersionError(ProtocolError):
    """The message's `v` is not a protocol version this side speaks."""


class UnknownMessageTypeError(ProtocolError):
    """The message's `type` is not one the protocol defines."""


# frontend -> engine core


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    # n is never on the wire (the frontend fans n > 1 out): encode refuses n != 1.
    params: SamplingParams
    arrival_time: float
    priority: int = 0


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class UtilityCall:
    call_id: int
    # "health" or "stats"; an unknown method is decodable so that it can be answered with an error.
    method: str


# engine core -> frontend


@dataclass(slots=True)
class Ready:
    max_model_len: int
    num_kv_blocks: int
    block_size: int


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    # Tokens, running totals since start.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Set exactly when finish_reason is "error".
    error: str | None = None


@dataclass(slots=True)
class Outputs:
    outputs: list[EngineOutput]
    stats: EngineStats
    timestamp: float


@dataclass(slots=True)
class UtilityResult:
    call_id: int
    # {"ok": True} for health; the stats map (stats_to_wire) for stats.
    result: dict[str, Any] | None = None
    error: str | None = None


Message = AddRequest | Abort | UtilityCall | Ready | Outputs | UtilityResult


# Codecs: each is a pair of functions that check one wire value and return it. Failures name the
# path to the bad value (so a log line says what was wrong); the path is worked out only on
# failure, by re-running the failed container's items, so the hot path builds no strings.


class _Invalid(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []

    def at(self, segment: str) -> _Invalid:
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
        except _Invalid as exc:
            raise exc.at(segment) from None


@dataclass(frozen=True, slots=True)
class _Codec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _check_int(value: Any) -> int:
    # bool is an int in Python but a distinct msgpack type.
    if type(value) is not int:
        raise _Invalid(f"expected an int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**64:
        raise _Invalid("int out of msgpack's 64-bit range")
    return value


def _encode_float(value: Any) -> float:
    if type(value) is not float and type(value) is not int:
        raise _Invalid(f"expected a float, got {type(value).__name__}")
    return float(value)


def _decode_float(value: Any) -> float:
    if type(value) is not float:
        raise _Invalid(f"expected a float64, got {type(value).__name__}")
    return value


def _check_of(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise _Invalid(f"expected a {kind.__name__}, got {type(value).__name__}")
        return value

    return check


_INT = _Codec(_check_int, _check_int)
_FLOAT = _Codec(_encode_float, _decode_float)
_STR = _Codec(_check_of(str), _check_of(str))
_BOOL = _Codec(_check_of(bool), _check_of(bool))


def _optional(inner: _Codec) -> _Codec:
    return _Codec(
        lambda v: None if v is None else inner.encode(v),
        lambda v: None if v is None else inner.decode(v),
    )


def _list_of(inner: _Codec) -> _Codec:
    def walk(fn: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
        def run(value: Any) -> list[Any]:
            if type(value) is not list and type(value) is not tuple:
                raise _Invalid(f"expected an array, got {type(value).__name__}")
            try:
                return [fn(item) for item in value]
            except _Invalid:
                _locate(fn, ((f"[{i}]", item) for i, item in enumerate(value)))
                raise

        return run

    return _Codec(walk(inner.encode), walk(inner.decode))


def _token_map(inner: _Codec) -> _Codec:
    """A map keyed by token id, written with its keys ascending."""

    def walk(fn: Callable[[Any], Any]) -> Callable[[Any], dict[int, Any]]:
        def run(value: Any) -> dict[int, Any]:
            if type(value) is not dict:
                raise _Invalid(f"expected a map, got {type(value).__name__}")
            _locate(_check_int, ((".<key>", key) for key in value))
            try:
                return {key: fn(value[key]) for key in sorted(value)}
            except _Invalid:
                _locate(fn, ((f"[{key}]", item) for key, item in value.items()))
                raise

        return run

    return _Codec(walk(inner.encode), walk(inner.decode))


def _check_scalar(value: Any) -> Any:
    if type(value) is int:
        return _check_int(value)
    if value is not None and type(value) not in (bool, float, str):
        raise _Invalid(f"expected a scalar, got {type(value).__name__}")
    return value


def _check_scalar_map(value: Any) -> dict[str, Any]:
    """A utility result: str keys, scalar values, kept in the order given."""
    if type(value) is not dict:
        raise _Invalid(f"expected a map, got {type(value).__name__}")
    _locate(_STR.decode, ((".<key>", key) for key in value))
    _locate(_check_scalar, ((f".{key}", item) for key, item in value.items()))
    return dict(value)


_SCALAR_MAP = _Codec(_check_scalar_map, _check_scalar_map)


def _one_of(inner: _Codec, allowed: tuple[str, ...]) -> _Codec:
    def check(value: Any) -> Any:
        value = inner.decode(value)
        if value not in allowed:
            raise _Invalid(f"expected one of {', '.join(allowed)}, got {value!r}")
        return value

    return _Codec(check, check)


@dataclass(frozen=True, slots=True)
class _Record:
    """A dataclass as a msgpack map: every key present, in `fields` order."""

    make: Callable[..., Any]
    fields: tuple[tuple[str, _Codec], ...]

    def encode(self, obj: Any) -> dict[str, Any]:
        try:
            return {name: codec.encode(getattr(obj, name)) for name, codec in self.fields}
        except _Invalid:
            for name, codec in self.fields:
                _locate(codec.encode, [(f".{name}", getattr(obj, name))])
            raise

    def decode(self, value: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        if len(value) != len(self.fields) or any(name not in value for name, _ in self.fields):
            names = [name for name, _ in self.fields]
            missing = [name for name in names if name not in value]
            if missing:
                raise _Invalid(f"missing key(s) {', '.join(missing)}")
            raise _Invalid(f"unknown key(s) {', '.join(repr(k) for k in value if k not in names)}")
        try:
            return self.make(**{name: codec.decode(value[name]) for name, codec in self.fields})
        except _Invalid:
            for name, codec in self.fields:
                _locate(codec.decode, [(f".{name}", value[name])])
            raise

    @property
    def codec(self) -> _Codec:
        return _Codec(self.encode, self.decode)


def _params_from_fields(**fields: Any) -> SamplingParams:
    return SamplingParams(n=1, **fields)


_PARAMS = _Record(
    _params_from_fields,
    (
        ("max_tokens", _INT),
        ("temperature", _FLOAT),
        ("top_p", _FLOAT),
        ("top_k", _INT),
        ("min_p", _FLOAT),
        ("repetition_penalty", _FLOAT),
        ("presence_penalty", _FLOAT),
        ("frequency_penalty", _FLOAT),
        ("logit_bias", _optional(_token_map(_FLOAT))),
        ("seed", _optional(_INT)),
        ("logprobs", _optional(_INT)),
        ("stop_token_ids", _list_of(_INT)),
        ("ignore_eos", _BOOL),
        ("min_tokens", _INT),
    ),
)

_STATS = _Record(
    EngineStats,
    (
        ("num_running", _INT),
        ("num_waiting", _INT),
        ("kv_cache_usage", _FLOAT),
        ("prefix_cache_queries", _INT),
        ("prefix_cache_hits", _INT),
        ("num_preemptions", _INT),
    ),
)

_LOGPROBS = _Record(
    Logprobs,
    (("token_ids", _list_of(_INT)), ("logprobs", _list_of(_FLOAT)), ("sampled_rank", _INT)),
)

_OUTPUT = _Record(
    EngineOutput,
    (
        ("request_id", _STR),
        ("new_token_ids", _list_of(_INT)),
        ("new_logprobs", _optional(_list_of(_LOGPROBS.codec))),
        ("finish_reason", _optional(_one_of(_STR, FINISH_REASONS))),
        ("stop_reason", _optional(_INT)),
        ("num_cached_tokens", _INT),
        ("error", _optional(_STR)),
    ),
)

_MESSAGES: dict[str, _Record] = {
    "add_request": _Record(
        AddRequest,
        (
            ("request_id", _STR),
            ("prompt_token_ids", _list_of(_INT)),
            ("params", _PARAMS.codec),
            ("arrival_time", _FLOAT),
            ("priority", _INT),
        ),
    ),
    "abort": _Record(Abort, (("request_ids", _list_of(_STR)),)),
    "utility": _Record(UtilityCall, (("call_id", _INT), ("method", _STR))),
    "ready": _Record(Ready, (("max_model_len", _INT), ("num_kv_blocks", _INT), ("block_size", _INT))),
    "outputs": _Record(
        Outputs,
        (("outputs", _list_of(_OUTPUT.codec)), ("stats", _STATS.codec), ("timestamp", _FLOAT)),
    ),
    "utility_result": _Record(
        UtilityResult, (("call_id", _INT), ("result", _optional(_SCALAR_MAP)), ("error", _optional(_STR)))
    ),
}

_TYPE_OF: dict[type, str] = {
    AddRequest: "add_request",
    Abort: "abort",
    UtilityCall: "utility",
    Ready: "ready",
    Outputs: "outputs",
    UtilityResult: "utility_result",
}


def encode(message: Message) -> bytes:
    """The canonical msgpack bytes of `message`; ProtocolError if it breaks the protocol's types."""
    tag = _TYPE_OF.get(type(message))
    if tag is None:
        raise ProtocolError(f"not a protocol message: {type(message).__name__}")
    if isinstance(message, AddRequest) and message.params.n != 1:
        raise ProtocolError(f"n is not on the wire: fan n={message.params.n} out into n requests")
    try:
        body = {"v": PROTOCOL_VERSION, "type": tag, **_MESSAGES[tag].encode(message)}
        return msgpack.packb(body, use_bin_type=True, use_single_float=False)
    except _Invalid as exc:
        raise ProtocolError(f"cannot encode {tag}: {exc}") from None


def decode(data: bytes) -> Message:
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
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise UnknownVersionError(f"unknown protocol version {version!r}")
    tag = body.get("type")
    record = _MESSAGES.get(tag) if type(tag) is str else None
    if record is None:
        raise UnknownMessageTypeError(f"unknown message type {tag!r}")
    fields = {key: value for key, value in body.items() if key not in ("v", "type")}
    try:
        return record.decode(fields)
    except _Invalid as exc:
        request_id = fields.get("request_id") if tag == "add_request" else None
        raise ProtocolError(
            f"malformed {tag}: {exc}", request_id=request_id if type(request_id) is str else None
        ) from None


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The `params` map of an add_request, in wire order; n must be 1."""
    if params.n != 1:
        raise ProtocolError(f"n is not on the wire: fan n={params.n} out into n requests")
    try:
        return _PARAMS.encode(params)
    except _Invalid as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """SamplingParams (n=1) from a `params` map; ProtocolError if it is malformed."""
    try:
        return _PARAMS.decode(data)
    except _Invalid as exc:
        raise ProtocolError(f"malformed params: {exc}") from None


def stats_to_wire(stats: EngineStats) -> dict[str, Any]:
    """The stats map, in wire order: the `result` of a stats utility call."""
    try:
        return _STATS.encode(stats)
    except _Invalid as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None


def stats_from_wire(data: dict[str, Any]) -> EngineStats:
    try:
        return _STATS.decode(data)
    except _Invalid as exc:
        raise ProtocolError(f"malformed stats: {exc}") from None
