"""argparse types shared by the components' flags: bad values fail at parsing, with the
flag named, instead of deep inside a server."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
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


def nonblank(text: str) -> str:
    """A non-blank name (a model name clients send)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host, without a trailing slash."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL with a host: {text!r}")
    return text.strip().rstrip("/")


def worker_url(text: str) -> str:
    """A worker's base URL for the router (``http_url``, ``http://`` only: the router
    speaks plain HTTP/1.1 to its workers)."""
    url = http_url(text)
    if urlsplit(url).scheme != "http":
        raise argparse.ArgumentTypeError(f"the router reaches workers over http:// only, "
                                         f"not {text.strip()!r}")
    return url


def server_url(text: str) -> str:
    """An OpenAI server's base URL (``http_url``) for a client command; the ``.../v1`` that
    ``sluice up`` and OpenAI SDKs use as the base is taken too (the client adds ``/v1/...``)."""
    return http_url(text).removesuffix("/v1")


def number(unit: str = "", minimum: float = 0.0, strict: bool = False,
           maximum: float = math.inf, below: bool = False) -> Callable[[str], float]:
    """An argparse type for a finite number (of ``unit``) ≥ ``minimum`` (> it when
    ``strict``) and ≤ ``maximum`` (< it when ``below``); NaN and infinities are refused."""
    of = f" of {unit}" if unit else ""
    bound = f"{'>' if strict else '>='} {minimum:g}"
    if maximum != math.inf:
        bound += f" and {'<' if below else '<='} {maximum:g}"
    bound += f" {unit}" if unit else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number{of}: {text!r}") from None
        low_ok = value > minimum if strict else value >= minimum
        high_ok = value < maximum if below else value <= maximum
        if not (low_ok and high_ok and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be finite and {bound}, got {text}")
        return value

    return parse


seconds = number("seconds")  # a duration, 0 allowed (0: none, no wait)
positive_seconds = number("seconds", strict=True)  # a timeout, an interval
milliseconds = number("milliseconds")  # an objective (0: none)
positive_milliseconds = number("milliseconds", strict=True)
positive = number(strict=True)  # a rate, a scale
factor = number(minimum=1.0)  # a load factor
fraction = number(maximum=1.0, below=True)  # a spread, [0, 1)
percent = number(strict=True, maximum=100.0)  # a percentile, an attainment target, (0, 100]


def whole(minimum: int = 0, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type for a whole number ≥ ``minimum`` (and ≤ ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" + (f" and <= {maximum:,}" if maximum is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


count = whole(0)  # a queue length, a replica count
positive_count = whole(1)  # a size, a number of characters


def json_object(text: str) -> dict:
    """A JSON object (``{...}``), e.g. fields merged into every request."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text}")
    return value


def _no_constant(name: str) -> None:
    """NaN and Infinity are not JSON (Python's json reads them; servers refuse them)."""
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    """A JSON number that is a finite float (1e999 would read as inf)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


def output_file(text: str) -> str:
    """A file this process can write, checked now rather than after a run of minutes (a
    folder, /proc, a read-only file system); its directory must exist. Nothing is left
    behind by the check."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory does not exist")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot write it ({exc.strerror})") from None
    return text


def output_dir(text: str) -> str:
    """A directory to write files into: one that exists, or one that can be made (its
    parent exists and it is not a file); checked now by writing a file there (and making
    the directory), which is removed again, like ``output_file``."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    if not path.exists() and not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its parent directory does not exist")
    made = not path.exists()
    try:
        if made:
            path.mkdir()
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot write into it ({exc.strerror})") \
            from None
    finally:
        if made and path.is_dir():
            path.rmdir()
    return text
