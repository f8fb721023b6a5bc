"""Tenants on the router: API keys, each mapped to a tenant with a priority ceiling and
requests-per-minute / tokens-per-minute limits (``sluice router --api-keys FILE``).

    Authorization: Bearer KEY ──▶ KeyRing.tenant_for ──▶ Tenant           (401 otherwise)
        ──▶ its priority ceiling (``Dispatcher.routing_request``)          (403 beyond it)
        ──▶ its RPM/TPM limits (``sluice.router.limits``)                  (429 + Retry-After)

The key file is YAML (or JSON)::

    tenants:
      - name: team-a              # [A-Za-z0-9][A-Za-z0-9_.-]*, ≤ 63 characters: a metric label
        keys: [sk-team-a-1]       # and/or keySha256: [<hex SHA-256 of a key>]
        maxPriority: -10          # the most urgent priority it may ask for (lower is served
                                  # first, vLLM's convention); absent: the router's public one
        rpm: 600                  # requests per minute; absent: no limit
        tpm: 200000               # tokens (prompt + completion) per minute; absent: no limit

It is re-read when it changes (its inode, size or mtime: a Kubernetes Secret mounted as a
directory swaps a symlink, which counts), checked at most once per ``check_interval`` seconds
on the request path; an edit that does not parse keeps the last good set (logged). Keys are
held only as SHA-256 digests, so lookups compare digests, never the keys themselves.

Nothing here reads the clock: ``now`` (seconds, monotonic) comes from the caller.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

logger = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
PRIORITY_LIMIT = 1000  # priorities are integers in [-PRIORITY_LIMIT, PRIORITY_LIMIT]


@dataclass(frozen=True)
class Tenant:
    """One tenant of the key file.

    Attributes:
        name: its name (metric label value).
        max_priority: the most urgent (lowest) priority value it may ask for; None: the
            router's ``--public-priority``.
        rpm: requests per minute; None: unlimited.
        tpm: tokens per minute (prompt + completion); None: unlimited.
    """

    name: str
    max_priority: int | None = None
    rpm: float | None = None
    tpm: float | None = None


class KeyFileError(ValueError):
    """The key file is malformed (the message names the entry and field)."""


class Unauthorized(Exception):
    """No usable API key: answer 401.

    Attributes:
        code: ``None`` when no key was given (as OpenAI), else ``invalid_api_key``.
    """

    def __init__(self, message: str, code: str | None):
        super().__init__(message)
        self.code = code


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _limit(entry: Mapping[str, Any], field_: str, where: str) -> float | None:
    value = entry.get(field_)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (math.isfinite(value) and value > 0):
        raise KeyFileError(f"{where}: {field_} must be a number > 0")
    return float(value)


def parse_key_file(data: Any) -> tuple[dict[str, Tenant], dict[bytes, str]]:
    """The tenants and key digests of a parsed key file (see the module docstring).

    Returns:
        (tenants by name, tenant name by key digest).

    Raises:
        KeyFileError: a malformed file, a duplicate tenant or key.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("tenants"), list):
        raise KeyFileError("expected a mapping with a `tenants` list")
    tenants: dict[str, Tenant] = {}
    keys: dict[bytes, str] = {}
    for i, entry in enumerate(data["tenants"]):
        where = f"tenants[{i}]"
        if not isinstance(entry, Mapping):
            raise KeyFileError(f"{where}: expected a mapping")
        unknown = set(entry) - {"name", "keys", "keySha256", "maxPriority", "rpm", "tpm"}
        if unknown:
            raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        name = entry.get("name")
        if not isinstance(name, str) or not TENANT_NAME.match(name):
            raise KeyFileError(f"{where}: name must match {TENANT_NAME.pattern}")
        if name in tenants:
            raise KeyFileError(f"{where}: tenant {name} is listed twice")
        priority = entry.get("maxPriority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                     or abs(priority) > PRIORITY_LIMIT):
            raise KeyFileError(f"{where}: maxPriority must be an integer from "
                               f"{-PRIORITY_LIMIT} to {PRIORITY_LIMIT}")
        tenants[name] = Tenant(name, priority, _limit(entry, "rpm", where),
                               _limit(entry, "tpm", where))
        found = []
        for field_ in ("keys", "keySha256"):
            values = entry.get(field_, [])
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise KeyFileError(f"{where}: {field_} must be a list of strings")
            for value in values:
                if field_ == "keys" and (not value or value != value.strip() or " " in value):
                    raise KeyFileError(f"{where}: a key is empty or has spaces")
                if field_ == "keySha256" and not SHA256_HEX.match(value.lower()):
                    raise KeyFileError(f"{where}: keySha256 entries are 64 hex digits")
                found.append(digest(value) if field_ == "keys" else bytes.fromhex(value))
        if not found:
            raise KeyFileError(f"{where}: tenant {name} has no keys")
        for d in found:
            if d in keys:
                raise KeyFileError(f"{where}: a key of {name} is also {keys[d]}'s")
            keys[d] = name
    return tenants, keys


class KeyRing:
    """The API keys of one router, from a file that may change while it runs.

    Args:
        path: the key file (YAML or JSON).
        now: the current time (seconds); the first change check is due ``check_interval``
            after it.
        check_interval: seconds between checks of the file for a change.

    Raises:
        OSError, KeyFileError: the file cannot be read or is malformed (at start only; a
            later bad edit keeps the last good set).
    """

    def __init__(self, path: str, now: float, check_interval: float = 1.0):
        self.path = path
        self.check_interval = check_interval
        self.reloads = 0  # successful loads after the first
        self._stamp = self._stat()
        self.tenants, self._keys = self._load()
        self._next_check = now + check_interval

    def _stat(self) -> tuple[int, int, int]:
        stat = os.stat(self.path)  # follows symlinks: a Secret's ..data swap changes the inode
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def _load(self) -> tuple[dict[str, Tenant], dict[bytes, str]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise KeyFileError("not UTF-8 text") from None
        try:
            data = yaml.safe_load(text)  # JSON is YAML
        except yaml.YAMLError as exc:
            raise KeyFileError(f"not YAML or JSON: {str(exc).splitlines()[0]}") from None
        return parse_key_file(data)

    def refresh(self, now: float) -> bool:
        """Re-read the file if a check is due and it changed; True when a new set is in use."""
        if now < self._next_check:
            return False
        self._next_check = now + self.check_interval
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            self.tenants, self._keys = self._load()
        except (OSError, KeyFileError, UnicodeDecodeError) as exc:
            logger.warning("API key file %s not reloaded (the last good one stays): %s",
                           self.path, exc)
            return False
        self.reloads += 1
        logger.info("API key file %s reloaded: %d tenants", self.path, len(self.tenants))
        return True

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer KEY`` header value.

        Raises:
            Unauthorized: no header, another scheme, or an unknown key.
        """
        if not authorization:
            raise Unauthorized("You didn't provide an API key. You need to provide your API "
                               "key in an Authorization header using Bearer auth (i.e. "
                               "Authorization: Bearer YOUR_KEY).", None)
        scheme, _, key = authorization.strip().partition(" ")
        name = self._keys.get(digest(key.strip())) if scheme.lower() == "bearer" else None
        if name is None:
            raise Unauthorized("Incorrect API key provided.", "invalid_api_key")
        return self.tenants[name]
