"""Per-tenant request and token limits (``sluice.router.tenants`` says who the tenant is).

    TenantLimits.charge(tenant, estimated tokens, now) ──▶ Charge        (RateLimited: 429)
        … the request runs …
    Charge.settle(status, used tokens, now): the token charge corrected to what was used

Limits are token buckets holding a minute's worth and refilling continuously. A request costs
1 request and its estimated tokens (``estimate_tokens``: prompt characters / 4, or its token
ids, plus ``max_tokens`` × ``n`` per prompt, or the rest of the model's context without
``max_tokens``), at most a minute's worth, taken at admission; when it ends, the token charge
is corrected to the usage the worker reported (plain answers, and streams with
``stream_options.include_usage``), else, for other streams, to the prompt estimate plus one
token per streamed event. A request no worker answered is refunded its tokens, not its
request.

Nothing here reads the clock: ``now`` (seconds, monotonic) comes from the caller, so the same
code runs under a simulator's virtual time. State is bounded by the key file: one entry per
tenant, dropped (its metrics with it) when the tenant leaves the file.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from sluice.api import metrics as names
from sluice.router.tenants import Tenant

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_TOKENS = 4096  # a request without max_tokens may use the rest of the context
CHARS_PER_TOKEN = 4.0


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
        estimate = tokens  # a request past the whole budget waits for a full bucket
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
                needs = f"{amount:g}" if limit == "rpm" or amount == estimate else \
                    f"{estimate:g} (it waits for a full budget)"
                raise RateLimited(limit, retry, (
                    f"Rate limit reached for tenant {tenant.name} on {unit} per minute "
                    f"({limit.upper()}): limit {bucket.capacity:g}, this request needs "
                    f"{needs}. Please try again in {retry}s."))
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
