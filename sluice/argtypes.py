"""argparse types shared by the components' flags: bad values fail at parsing, with the
flag named, instead of deep inside a server."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit


def port(text: str) -> int:
    """A TCP port, 1..65535 (uvicorn would silently wrap 99999 to 34463)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {value}")
    return value


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host, without a trailing slash."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL with a host: {text!r}")
    return text.strip().rstrip("/")


def seconds(text: str) -> float:
    """A duration in seconds: a finite number ≥ 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be finite and >= 0, got {text}")
    return value
