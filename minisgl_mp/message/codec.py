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
from typing import Annotated, Any, Union

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


# msgpack decodes extension type -1 (timestamp) itself, without asking ext_hook: catch it in
# the containers it can only appear in (a bare timestamp is no map, so it fails anyway).
def _no_timestamp_list(items: list[Any]) -> list[Any]:
    if any(isinstance(x, msgpack.Timestamp) for x in items):
        raise WireError("msgpack extension type -1 (timestamp) is not accepted")
    return items


def _no_timestamp_map(d: dict[str, Any]) -> dict[str, Any]:
    _no_timestamp_list(list(d.values()))
    return d


def _check(value: Any, tp: Any, path: str) -> Any:
    """Validate `value` against annotation `tp`; returns it in Python form."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        if _Packed in meta:
            if not isinstance(value, bytes):
                raise WireError(f"{path}: expected packed int32 bytes, got {type(value).__name__}")
            return unpack_ids(value)
        return _check(value, base, path)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(value, arm, path)
            except WireError:
                pass
        names = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(tp))
        raise WireError(f"{path}: expected {names}, got {type(value).__name__}")
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{path}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise WireError(f"{path}: expected a map with string keys, got {type(value).__name__}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise WireError(f"{path}: expected a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError(f"{path}: expected an integer, got {type(value).__name__}")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise WireError(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp in (str, bytes):
        if not isinstance(value, tp):
            raise WireError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if dataclasses.is_dataclass(tp):
        return _from_fields(tp, value, path)
    raise TypeError(f"unsupported field type {tp!r} at {path}")


def _hints(cls: type) -> dict[str, Any]:
    cached = cls.__dict__.get("_wire_hints")
    if cached is None:
        cached = typing.get_type_hints(cls, include_extras=True)
        cls._wire_hints = cached  # type: ignore[attr-defined]
    return cached


def _from_fields(cls: type, d: Any, path: str) -> Any:
    if not isinstance(d, dict):
        raise WireError(f"{path}: expected a map, got {type(d).__name__}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in d if k not in names and k not in ("t", "v"))
    if unknown:
        raise WireError(f"{path}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise WireError(f"{path}: missing field {f.name!r}")
        kwargs[f.name] = _check(d[f.name], hints[f.name], f"{path}.{f.name}")
    return cls(**kwargs)


def _to_wire(value: Any, tp: Any) -> Any:
    if typing.get_origin(tp) is Annotated and _Packed in typing.get_args(tp)[1:]:
        return pack_ids(value)
    if dataclasses.is_dataclass(value):
        hints = _hints(type(value))
        return {f.name: _to_wire(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        args = typing.get_args(tp)
        item = args[0] if typing.get_origin(tp) is list and args else Any
        return [_to_wire(v, item) for v in value]
    return value


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
        body = _to_wire(msg, type(msg))
        body["t"], body["v"] = tag, PROTOCOL_VERSION
        return msgpack.packb(body, use_bin_type=True)

    def decode(self, data: bytes) -> Any:
        if len(data) > self.max_bytes:
            raise WireError(f"message of {len(data)} bytes exceeds the {self.max_bytes}-byte bound")
        d = unpack_map(data, self.max_bytes)
        tag, version = d.get("t"), d.get("v")
        if version != PROTOCOL_VERSION:
            raise WireError(f"protocol version {version!r} is not supported (expected {PROTOCOL_VERSION})")
        cls = self._by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise WireError(f"unknown message type {tag!r} on channel {self.name}")
        return _from_fields(cls, d, tag)


def unpack_map(data: bytes, max_bytes: int) -> dict[str, Any]:
    """msgpack bytes -> a map, refusing extension types and anything that is not a map."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook,
                            list_hook=_no_timestamp_list, object_hook=_no_timestamp_map)
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
