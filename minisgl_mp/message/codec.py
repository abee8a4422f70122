"""Typed msgpack records with a strict decoder. Never pickle.

A message is a frozen dataclass registered under a type tag. On the wire it is a msgpack map
{"t": tag, "v": PROTOCOL_VERSION, <fields>}. Decoding checks the tag, the version, that every
field is present with the declared type and that no unknown field is there; anything else is
a `WireError` that says what was wrong. Token ids travel as packed little-endian int32 bytes
(`TokenIds`), not as lists of Python ints.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from array import array
from typing import Annotated, Any, Callable, Union

import msgpack

PROTOCOL_VERSION = 1


class WireError(ValueError):
    """A message that cannot be decoded; the text says why."""


class _Packed:
    """Marks a list[int] field that is packed as int32 bytes on the wire."""


TokenIds = Annotated[list[int], _Packed]

_LITTLE = sys.byteorder == "little"


def pack_ids(ids: list[int]) -> bytes:
    a = array("i", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise WireError(f"packed token ids have {len(data)} bytes, not a multiple of 4")
    a = array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def _ext_hook(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} is not accepted")


_TIMESTAMP_ERROR = "msgpack extension type -1 (timestamp) is not accepted"


def _has_timestamp(value: Any) -> bool:
    """msgpack decodes extension type -1 (timestamp) itself, without asking ext_hook: look for
    one anywhere in a decoded value (a loop, not recursion: nesting is the sender's choice)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, msgpack.Timestamp):
            return True
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return False


class _FieldError(WireError):
    """A field that fails its check; the path from the message down to it is prepended as the
    error travels up, so the hot path builds no path strings."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.path = path

    def under(self, segment: str) -> _FieldError:
        self.path = segment + self.path
        return self

    def at(self, root: str) -> WireError:
        return WireError(f"{root}{self.path}: {self.problem}")


Decoder = Callable[[Any], Any]
Encoder = Callable[[Any], Any]


def _got(value: Any) -> str:
    return type(value).__name__


def _scalar_decoder(tp: Any) -> Decoder:
    if tp is bool:
        def dec(v: Any) -> Any:
            if v is True or v is False:
                return v
            raise _FieldError(f"expected a boolean, got {_got(v)}")
    elif tp is int:
        def dec(v: Any) -> Any:
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            raise _FieldError(f"expected an integer, got {_got(v)}")
    elif tp is float:
        def dec(v: Any) -> Any:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            raise _FieldError(f"expected a number, got {_got(v)}")
    elif tp in (str, bytes):
        def dec(v: Any) -> Any:
            if isinstance(v, tp):
                return v
            raise _FieldError(f"expected {tp.__name__}, got {_got(v)}")
    else:
        raise TypeError(f"unsupported field type {tp!r}")
    return dec


def _decode_packed(v: Any) -> list[int]:
    if not isinstance(v, bytes):
        raise _FieldError(f"expected packed int32 bytes, got {_got(v)}")
    try:
        return unpack_ids(v)
    except WireError as e:
        raise _FieldError(str(e)) from None


def _decode_any(v: Any) -> Any:
    if _has_timestamp(v):
        raise _FieldError(_TIMESTAMP_ERROR)
    return v


def _decode_map(v: Any) -> Any:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _FieldError(f"expected a map with string keys, got {_got(v)}")
    return _decode_any(v)


def _list_decoder(item: Decoder) -> Decoder:
    def dec(v: Any) -> Any:
        if not isinstance(v, list):
            raise _FieldError(f"expected a list, got {_got(v)}")
        try:
            return [item(x) for x in v]
        except _FieldError as e:
            index = next(i for i, x in enumerate(v) if not _passes(item, x))
            raise e.under(f"[{index}]") from None
    return dec


def _passes(dec: Decoder, value: Any) -> bool:
    try:
        dec(value)
    except _FieldError:
        return False
    return True


def _union_decoder(args: tuple[Any, ...]) -> Decoder:
    optional = type(None) in args
    arms = [_decoder(a) for a in args if a is not type(None)]
    names = " or ".join(getattr(a, "__name__", str(a)) for a in args)

    def dec(v: Any) -> Any:
        if v is None and optional:
            return None
        for arm in arms:
            try:
                return arm(v)
            except _FieldError:
                pass
        raise _FieldError(f"expected {names}, got {_got(v)}")
    return dec


def _decoder(tp: Any) -> Decoder:
    """The check of one annotation, built once per message class: the value in Python form,
    or a _FieldError that says what is wrong."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        return _decode_packed if _Packed in meta else _decoder(base)
    if origin in (Union, types.UnionType):
        return _union_decoder(typing.get_args(tp))
    if tp is Any:
        return _decode_any
    if origin is list:
        (item,) = typing.get_args(tp)
        return _list_decoder(_decoder(item))
    if origin is dict or tp is dict:
        return _decode_map
    if dataclasses.is_dataclass(tp):
        return _codec(tp).decode_fields
    return _scalar_decoder(tp)


def _encoder(tp: Any) -> Encoder | None:
    """How one annotation's value goes on the wire; None where it goes as it is."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        return pack_ids if _Packed in meta else _encoder(base)
    if origin in (Union, types.UnionType):
        arms = [e for e in (_encoder(a) for a in typing.get_args(tp) if a is not type(None)) if e is not None]
        if not arms:
            return None
        if len(arms) > 1:
            raise TypeError(f"a union of several encoded types is not supported: {tp!r}")
        (arm,) = arms
        return lambda v: None if v is None else arm(v)
    if origin is list:
        item = _encoder(typing.get_args(tp)[0])
        return None if item is None else (lambda v: [item(x) for x in v])
    if dataclasses.is_dataclass(tp):
        return _codec(tp).encode_fields
    return None


class _ClassCodec:
    """One message class's decode and encode, compiled from its annotations."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        fields = dataclasses.fields(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        self.names = frozenset(f.name for f in fields) | {"t", "v"}
        # What a field left out of the map gets: name -> a maker of its default.
        self.defaults: dict[str, Callable[[], Any]] = {
            f.name: f.default_factory if f.default_factory is not dataclasses.MISSING
            else (lambda value=f.default: value)
            for f in fields if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        # A decoded message is built without calling __init__ (a frozen dataclass's sets each
        # field through object.__setattr__, which costs more than all the checks): only for
        # classes whose __init__ does nothing else.
        self.direct = not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
        self._decoders = [(f.name, _decoder(hints[f.name])) for f in fields]
        self._encoders = [(f.name, _encoder(hints[f.name])) for f in fields]

    def decode_fields(self, d: Any) -> Any:
        if not isinstance(d, dict):
            raise _FieldError(f"expected a map, got {_got(d)}")
        if not self.names.issuperset(d):
            unknown = sorted(str(k) for k in d if k not in self.names)
            raise _FieldError(f"unknown field(s) {', '.join(unknown)}")
        try:  # every field present: what every message the engine encodes has
            values = {name: dec(d[name]) for name, dec in self._decoders}
        except (KeyError, _FieldError):
            values = self._decode_slowly(d)
        if not self.direct:
            return self.cls(**values)
        obj = object.__new__(self.cls)
        obj.__dict__.update(values)
        return obj

    def _decode_slowly(self, d: dict[str, Any]) -> dict[str, Any]:
        """Field by field, naming the one that is missing or wrong."""
        values = {}
        for name, dec in self._decoders:
            if name not in d:
                if name not in self.defaults:
                    raise _FieldError(f"missing field {name!r}")
                values[name] = self.defaults[name]()
                continue
            try:
                values[name] = dec(d[name])
            except _FieldError as e:
                raise e.under(f".{name}") from None
        return values

    def encode_fields(self, msg: Any) -> dict[str, Any]:
        return {name: getattr(msg, name) if enc is None else enc(getattr(msg, name))
                for name, enc in self._encoders}


def _codec(cls: type) -> _ClassCodec:
    """The class's compiled codec; built at first use, when every class its annotations name
    exists. A class that refers to itself would recurse here: no message does."""
    codec = cls.__dict__.get("_wire_codec")
    if codec is None:
        codec = _ClassCodec(cls)
        cls._wire_codec = codec  # type: ignore[attr-defined]
    return codec


class Channel:
    """The messages one receiver accepts, with their one encode/decode pair."""

    def __init__(self, name: str, *message_types: type, max_bytes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self._by_tag = {cls.TAG: cls for cls in message_types}  # type: ignore[attr-defined]

    def encode(self, msg: Any) -> bytes:
        tag = type(msg).TAG
        if tag not in self._by_tag:
            raise TypeError(f"{type(msg).__name__} is not a message of channel {self.name}")
        body = _codec(type(msg)).encode_fields(msg)
        body["t"], body["v"] = tag, PROTOCOL_VERSION
        return msgpack.packb(body, use_bin_type=True)

    def decode(self, data: bytes) -> Any:
        if len(data) > self.max_bytes:
            raise WireError(f"message of {len(data)} bytes exceeds the {self.max_bytes}-byte bound")
        d = _unpack(data)
        tag, version = d.get("t"), d.get("v")
        if version != PROTOCOL_VERSION:
            raise WireError(f"protocol version {version!r} is not supported (expected {PROTOCOL_VERSION})")
        cls = self._by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise WireError(f"unknown message type {tag!r} on channel {self.name}")
        try:
            return _codec(cls).decode_fields(d)
        except _FieldError as e:
            raise e.at(tag) from None


def unpack_map(data: bytes, max_bytes: int) -> dict[str, Any]:
    """msgpack bytes -> a map, refusing extension types and anything that is not a map."""
    d = _unpack(data)
    if _has_timestamp(d):
        raise WireError(_TIMESTAMP_ERROR)
    return d


def _unpack(data: bytes) -> dict[str, Any]:
    """Timestamps are left to the caller: a channel's typed fields refuse them by type and its
    free-form fields (Any, maps) look for them, so the hot path runs no Python per container."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several types for malformed input
        raise WireError(f"malformed msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise WireError(f"expected a msgpack map, got {type(d).__name__}")
    return d


def message(tag: str) -> Any:
    """Class decorator: a frozen dataclass registered under `tag`."""

    def wrap(cls: type) -> type:
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.TAG = tag  # type: ignore[attr-defined]
        return cls

    return wrap
