"""Frames and typed messages on mesh streams. Pure: bytes in, messages out.

A frame is ``| u32 big-endian length | msgpack map |``. The map carries ``"@"`` (the message type; never a
field name) and the message's fields. :class:`FrameDecoder` never buffers past the cap: a length over it is
refused as soon as the 4-byte header arrives. Decoding raises only :class:`RemoteProtocolError` (the peer
broke the protocol) and returns only registered message types with fields of the declared types (h11's
invariant).
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
from typing import Any, ClassVar, TypeVar, get_args, get_origin

import msgpack

from meshllm.errors import LocalProtocolError, RemoteProtocolError

DEFAULT_MAX_FRAME = 1 << 20
_LEN = struct.Struct(">I")


class Message:
    """Base of every wire message: a frozen dataclass whose subclasses set ``TYPE``."""

    TYPE: ClassVar[str] = ""


_REGISTRY: dict[str, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def message(cls: M) -> M:
    """Class decorator: register a dataclass as a wire message under ``cls.TYPE``."""
    if not cls.TYPE or cls.TYPE in _REGISTRY:
        raise LocalProtocolError(f"message type {cls.TYPE!r} missing or registered twice")
    _REGISTRY[cls.TYPE] = cls
    return cls


def _check(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise RemoteProtocolError."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for alt in get_args(tp):
            if alt is type(None) and value is None:
                return None
        for alt in get_args(tp):
            if alt is type(None):
                continue
            try:
                return _check(value, alt, where)
            except RemoteProtocolError:
                continue
        raise RemoteProtocolError(f"{where}: unexpected {type(value).__name__}")
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            raise RemoteProtocolError(f"{where}: expected a list")
        return [_check(v, item, f"{where}[]") for v in value]
    if origin is dict:
        kt, vt = get_args(tp)
        if not isinstance(value, dict):
            raise RemoteProtocolError(f"{where}: expected a map")
        return {_check(k, kt, f"{where} key"): _check(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RemoteProtocolError(f"{where}: expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RemoteProtocolError(f"{where}: expected an integer")
        return value
    if tp in (str, bytes, bool):
        if not isinstance(value, tp):
            raise RemoteProtocolError(f"{where}: expected {tp.__name__}")
        return value
    if tp is Any:
        return value
    raise LocalProtocolError(f"{where}: unsupported field type {tp!r}")


def _hints(cls: type[Message]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_obj(msg: Message) -> dict[str, Any]:
    if type(msg).TYPE not in _REGISTRY:
        raise LocalProtocolError(f"{type(msg).__name__} is not a registered message")
    obj: dict[str, Any] = {"@": msg.TYPE}
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        obj[f.name] = getattr(msg, f.name)
    return obj


def from_obj(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise RemoteProtocolError("message is not a map")
    t = obj.get("@")
    cls = _REGISTRY.get(t) if isinstance(t, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {t!r}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in obj:
            kwargs[f.name] = _check(obj[f.name], hints[f.name], f"{t}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RemoteProtocolError(f"{t}: missing field {f.name}")
    return cls(**kwargs)


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack(data: bytes, max_len: int = DEFAULT_MAX_FRAME) -> Any:
    """msgpack -> Python, with limits so a small input cannot allocate much. RemoteProtocolError on bad input."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=max(1024, max_len // 8),
            max_map_len=max(1024, max_len // 16),
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise RemoteProtocolError(f"bad msgpack: {type(e).__name__}") from None


def encode(msg: Message, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    body = pack(to_obj(msg))
    if len(body) > max_frame:
        raise LocalProtocolError(f"{msg.TYPE} frame of {len(body)} bytes exceeds the cap of {max_frame}")
    return _LEN.pack(len(body)) + body


def decode_one(frame_body: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Message:
    return from_obj(unpack(frame_body, max_frame))


class FrameDecoder:
    """Incremental decoder: ``feed(data)`` yields complete messages; never holds more than one capped frame."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        """Messages completed by ``data``. After a RemoteProtocolError the stream is unusable: close it."""
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > self.max_frame:
                self._buf.clear()
                raise RemoteProtocolError(f"frame of {n} bytes exceeds the cap of {self.max_frame}")
            if len(self._buf) < _LEN.size + n:
                break
            body = bytes(self._buf[_LEN.size : _LEN.size + n])
            del self._buf[: _LEN.size + n]
            out.append(decode_one(body, self.max_frame))
        return out
