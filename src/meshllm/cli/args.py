"""The values of mesh-llm's options, each read by one function that argparse calls: a bad value is one line that
names the option (``cli.Parser``), before anything starts."""

from __future__ import annotations

import argparse
import re
import socket

from meshllm import sockets
from meshllm.proto import token as tok
from meshllm.serve.split.serving_flags import int_in as _int_in  # a whole number in a range, or one line naming it


def parse_duration(text: str) -> float:
    """'1d', '12h', '30m', '45s' or plain seconds; more than zero."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([dhms]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 1d, 12h, 30m or seconds")
    seconds = float(m.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}[m.group(2)]
    if not 0 < seconds <= 10 * 365 * 86400:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be more than 0 and at most 10 years")
    return seconds


def admission(text: str) -> float:
    seconds = parse_duration(text)
    if seconds > tok.MAX_ADMIT_S:
        raise argparse.ArgumentTypeError(f"--admission {text!r}: at most {tok.MAX_ADMIT_S // 86400}d")
    return seconds


def relay_rate(text: str) -> float:
    """--relay-rate in MB/s (2**20 bytes), as bytes/s; 0: no cap."""
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= 1e6:
        raise argparse.ArgumentTypeError(f"--relay-rate {text!r}: a number of MB/s, 0 (no cap) to 1000000")
    return mb * 2**20


def tcp_port(text: str) -> int:
    return _int_in(text, 1, 65535, "a port")


def rpc_port(text: str) -> int:
    return _int_in(text, 1, 65534, "a port below 65535 (the next one is taken too)")


def udp_port_or_zero(text: str) -> int:
    return _int_in(text, 0, 65535, "a port (0: any free one)")


def positive_int(text: str) -> int:
    return _int_in(text, 1, 1 << 20, "the number")


def scope(text: str) -> object:
    from meshllm.proto.token import Scope

    try:
        return Scope.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def events_n(text: str) -> int:
    return _int_in(text, 0, 50, "the number of events")


def draft_max(text: str) -> int:
    return _int_in(text, 1, 64, "--draft-max")


def gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not 0 < value < 1e6:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be more than 0 GB, got {text}")
    return value


def ram_gigabytes(text: str) -> float:
    """--max-ram: as --max-vram, and 0 (offer no RAM: the model stays on accelerators)."""
    return 0.0 if text.strip() in ("0", "0.0") else gigabytes(text)


def ip_address(text: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address (e.g. 0.0.0.0 or ::)") from None


def host_port(text: str) -> str:
    """HOST:PORT or [IPv6]:PORT with a port of 1-65535; a host name is resolved here, once (the mesh passes IP
    addresses only)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536 or " " in host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (port 1-65535)")
    if tok.ip_port(text):
        return text
    try:
        ip = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0][4][0]
    except (OSError, UnicodeError):
        raise argparse.ArgumentTypeError(f"cannot resolve {host!r} to an IP address") from None
    return sockets.host_port(str(ip), int(port))


def python_versions(text: str) -> tuple[str, ...]:
    out = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in out if not re.fullmatch(r"3\.(1[1-9]|[2-9][0-9])", v)]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give Python versions >= 3.11 like 3.11,3.12")
    return out


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def parse_name(text: str) -> str:
    from meshllm.proto.record import MAX_NAME

    if not text or len(text) > MAX_NAME or not text.isprintable():
        raise argparse.ArgumentTypeError(f"a node name is 1-{MAX_NAME} printable characters, got {text!r}")
    return text


def parse_split(text: str) -> list[float]:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --tensor-split {text!r}: use proportions like 1,1,2") from None
    if not parts or any(not 0 <= p < 1e6 for p in parts) or sum(parts) <= 0:
        raise argparse.ArgumentTypeError("--tensor-split needs non-negative proportions with a positive sum")
    return parts
