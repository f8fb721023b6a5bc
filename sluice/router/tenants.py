"""Tenants on the router: API keys, each mapped to a tenant with a priority ceiling and
requests-per-minute / tokens-per-minute limits (``sluice router --api-keys FILE``).

    Authorization: Bearer KEY ──▶ KeyRing.tenant_for ──▶ Tenant           (401 otherwise)
        ──▶ priority ceiling (``Dispatcher.routing_request``)              (403 beyond it)
        ──▶ TenantLimits.charge(tenant, estimated tokens, now) ──▶ Charge  (429 + Retry-After)
        … the request runs …
        ──▶ Charge.settle(status, used tokens, now): TPM corrected to what was used

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
held only as SHA-256 digests.

Limits are token buckets holding a minute's worth and refilling continuously. A request costs
1 request and its estimated tokens (``estimate_tokens``), at most a minute's worth, taken at
admission; when it ends the token charge is corrected to the usage the worker reported
(plain answers, and streams with ``stream_options.include_usage``), else, for other streams,
to the prompt estimate plus one token per streamed event. A request no worker answered is
refunded its tokens, not its request.

Nothing here reads the clock: ``now`` (seconds, monotonic) comes from the caller, so the
same code runs under a simulator's virtual time. State is bounded by the key file: one entry
per tenant, dropped when the tenant leaves the file.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from prometheus_client.core import CounterMetricFamily, Metric

from sluice.api import metrics as names

logger = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
PRIORITY_LIMIT = 1000  # priorities are integers in [-PRIORITY_LIMIT, PRIORITY_LIMIT]
DEFAULT_CONTEXT_TOKENS = 4096  # a request without max_tokens may use the rest of the context
CHARS_PER_TOKEN = 4.0


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
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
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


# ---------------------------------------------------------------------------- limits

class TokenBucket:
    """Up to ``per_minute`` units, refilled at ``per_minute / 60`` per second.

    The level may go below zero when a charge is corrected upwards; requests then wait
    until it has refilled.
    """

    def __init__(self, per_minute: float, now: float):
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute
        self._at = now

    def _fill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` (at most the capacity) can be taken; 0: now."""
        self._fill(now)
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._fill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self._fill(now)
        self.level = min(self.capacity, self.level + amount)


class RateLimited(Exception):
    """The tenant is over a limit: answer 429 with ``Retry-After``.

    Attributes:
        limit: ``rpm`` or ``tpm``.
        retry_after_s: whole seconds until the request would fit (≥ 1).
    """

    def __init__(self, limit: str, retry_after_s: int, message: str):
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass
class _TenantState:
    tenant: Tenant
    rpm: TokenBucket | None
    tpm: TokenBucket | None
    statuses: dict[str, int] = field(default_factory=dict)  # HTTP status → requests
    tokens: float = 0.0  # tokens charged, after corrections
    limited: dict[str, int] = field(default_factory=dict)  # rpm | tpm → 429s


class Charge:
    """What one admitted request was charged; ``settle`` exactly once when it ends."""

    def __init__(self, limits: TenantLimits, state: _TenantState, tokens: float,
                 prompt_tokens: float):
        self._limits, self._state = limits, state
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self._settled = False

    @property
    def tenant(self) -> str:
        return self._state.tenant.name

    def settle(self, status: int, used_tokens: float | None, now: float,
               served: bool = True) -> None:
        """Count the request's outcome and correct its token charge (idempotent).

        Args:
            status: the HTTP status the client got.
            used_tokens: prompt + completion tokens the worker used, when known.
            now: the current time, seconds.
            served: a worker answered it; False refunds the tokens charged.
        """
        if self._settled:
            return
        self._settled = True
        state = self._state
        state.statuses[str(status)] = state.statuses.get(str(status), 0) + 1
        used = 0.0 if not served else self.tokens if used_tokens is None else used_tokens
        state.tokens += used
        if self._limits.state(state.tenant.name) is not state or state.tpm is None:
            return  # the tenant left the key file or has no TPM limit meanwhile
        if used < self.tokens:
            state.tpm.give(self.tokens - used, now)
        elif used > self.tokens:
            state.tpm.take(used - self.tokens, now)


class TenantLimits:
    """Per-tenant token buckets and counters (one per router).

    ``update`` follows the key file: a tenant whose limits did not change keeps its buckets
    and counters; one that left is dropped (its metrics with it).
    """

    def __init__(self) -> None:
        self._states: dict[str, _TenantState] = {}

    def update(self, tenants: Mapping[str, Tenant], now: float) -> None:
        states = {}
        for name, tenant in tenants.items():
            old = self._states.get(name)
            if old is not None and old.tenant == tenant:
                states[name] = old
                continue
            states[name] = _TenantState(
                tenant, TokenBucket(tenant.rpm, now) if tenant.rpm else None,
                TokenBucket(tenant.tpm, now) if tenant.tpm else None,
                *((old.statuses, old.tokens, old.limited) if old is not None else ()))
        self._states = states

    def state(self, name: str) -> _TenantState | None:
        return self._states.get(name)

    def count(self, tenant: Tenant, status: int) -> None:
        """A request of ``tenant`` answered ``status`` before reaching its limits (a 400)."""
        state = self._states.get(tenant.name)
        if state is not None:
            state.statuses[str(status)] = state.statuses.get(str(status), 0) + 1

    def charge(self, tenant: Tenant, tokens: float, now: float,
               prompt_tokens: float = 0.0) -> Charge:
        """Admit one request of ``tenant`` costing ``tokens`` (estimated), or refuse it.

        Raises:
            RateLimited: its RPM or TPM bucket cannot cover the request now.
        """
        state = self._states.get(tenant.name)
        if state is None:  # a tenant the limits were not updated for yet
            self.update({**{s.tenant.name: s.tenant for s in self._states.values()},
                         tenant.name: tenant}, now)
            state = self._states[tenant.name]
        tokens = min(tokens, state.tpm.capacity) if state.tpm else tokens
        for limit, bucket, amount, unit in (("rpm", state.rpm, 1.0, "requests"),
                                            ("tpm", state.tpm, tokens, "tokens")):
            if bucket is None:
                continue
            wait = bucket.wait_s(amount, now)
            if wait > 0:
                state.limited[limit] = state.limited.get(limit, 0) + 1
                state.statuses["429"] = state.statuses.get("429", 0) + 1
                retry = max(1, math.ceil(wait))
                raise RateLimited(limit, retry, (
                    f"Rate limit reached for tenant {tenant.name} on {unit} per minute "
                    f"({limit.upper()}): limit {bucket.capacity:g}, this request needs "
                    f"{amount:g}. Please try again in {retry}s."))
        if state.rpm is not None:
            state.rpm.take(1.0, now)
        if state.tpm is not None:
            state.tpm.take(tokens, now)
        return Charge(self, state, tokens, prompt_tokens)

    def collect(self) -> Iterator[Metric]:
        """Per-tenant counters for Prometheus (labels: tenants of the key file only)."""
        requests = CounterMetricFamily(names.ROUTER_TENANT_REQUESTS, "Requests of each API-key "
                                       "tenant, by HTTP status.", labels=["tenant", "status"])
        tokens = CounterMetricFamily(names.ROUTER_TENANT_TOKENS, "Tokens (prompt + completion) "
                                     "charged to each tenant, corrected to the usage when "
                                     "known.", labels=["tenant"])
        limited = CounterMetricFamily(names.ROUTER_TENANT_RATE_LIMITED, "Requests refused "
                                      "(429) by a tenant's limit, by limit (rpm, tpm).",
                                      labels=["tenant", "limit"])
        for name, state in sorted(self._states.items()):
            for status, count in sorted(state.statuses.items()):
                requests.add_metric([name, status], count)
            tokens.add_metric([name], state.tokens)
            for limit, count in sorted(state.limited.items()):
                limited.add_metric([name, limit], count)
        yield from (requests, tokens, limited)


class TenantCollector:
    """Exports ``TenantLimits.collect`` at scrape time."""

    def __init__(self, limits: TenantLimits):
        self.limits = limits

    def collect(self) -> Iterator[Metric]:
        yield from self.limits.collect()


# ---------------------------------------------------------------------------- cost

def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def prompt_tokens(body: Mapping[str, Any]) -> tuple[float, int]:
    """Estimated prompt tokens of all of a request's prompts, and the number of prompts.

    Text counts ``CHARS_PER_TOKEN`` characters a token; token-id prompts count exactly.
    Chat messages count their text (content parts' text included).
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p["text"]) for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        return chars / CHARS_PER_TOKEN + 4 * len(messages), 1
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt) / CHARS_PER_TOKEN, 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return float(len(prompt)), 1
        total = 0.0
        for p in prompt:
            total += len(p) / CHARS_PER_TOKEN if isinstance(p, str) \
                else len(p) if isinstance(p, list) else 0
        return total, len(prompt)
    return 0.0, 1


def estimate_tokens(body: Mapping[str, Any], context_tokens: int | None) -> tuple[float, float]:
    """What a request may use: (prompt + completion tokens, prompt tokens), estimated.

    Completion tokens are ``max_completion_tokens`` or ``max_tokens`` per choice (``n``) per
    prompt; without either, the rest of ``context_tokens`` (the model's ``max_model_len``,
    else ``DEFAULT_CONTEXT_TOKENS``), as the worker allows.
    """
    prompt, prompts = prompt_tokens(body)
    n = _count(body.get("n")) or 1
    cap = _count(body.get("max_completion_tokens"))
    cap = cap if cap is not None else _count(body.get("max_tokens"))
    if cap is None:
        context = context_tokens or DEFAULT_CONTEXT_TOKENS
        cap = max(0.0, context - prompt / prompts)
    return prompt + float(cap) * n * prompts, prompt


_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def usage_in(data: bytes) -> int | None:
    """``usage.total_tokens`` in a response body or SSE chunk, if it has one (the last)."""
    if b"total_tokens" not in data:
        return None
    found = _TOTAL_TOKENS.findall(data)
    return int(found[-1]) if found else None
