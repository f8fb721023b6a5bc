"""Routing policies: which ready endpoint gets the next request.

A policy is an object with one async method, ``choose``, chosen by name from ``POLICIES`` and
created once in the router's lifespan. The decision itself is a pure function of the
observed loads, so it is unit-tested without servers and reusable by a simulator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.router.endpoints import Endpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at: the served model name, whether the client streams, and
    the parsed JSON body (read-only; prompt-aware policies such as prefix affinity use it)."""

    model: str
    stream: bool = False
    body: Mapping[str, Any] = field(default_factory=dict)


class RoutingPolicy(Protocol):
    """Picks one endpoint for a request.

    Implementations must not block and must not await I/O: the router increments the chosen
    endpoint's in-flight count right after ``choose`` returns, and concurrent requests must
    see each other's choices.
    """

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        """Return one of ``candidates``.

        Args:
            candidates: non-empty, ready endpoints that serve ``request.model``, in a stable
                order (sorted by URL).
            request: the request being routed.
        """
        ...


def least_load(loads: Sequence[int], start: int = 0) -> int:
    """Index of the smallest load; ties go to the first one at or after ``start``, cyclically.

    Rotating ``start`` between calls spreads ties (an idle fleet) round-robin instead of
    sending every burst to index 0.

    Args:
        loads: in-flight request counts, one per candidate; must be non-empty.
        start: where the tie-breaking scan begins (any int; taken modulo ``len(loads)``).

    Returns:
        an index into ``loads``.

    Raises:
        ValueError: ``loads`` is empty.

    Example: loads [2, 1, 0, 0], start 3 → 3; start 0 → 2.
    """
    if not loads:
        raise ValueError("least_load needs at least one candidate")
    n = len(loads)
    order = [(start + k) % n for k in range(n)]
    return min(order, key=lambda i: loads[i])  # min keeps the first minimum in scan order


class LeastLoadPolicy:
    """Fewest in-flight requests wins; ties broken by a rotating start index."""

    def __init__(self) -> None:
        self._turn = 0

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        index = least_load([e.in_flight for e in candidates], self._turn)
        self._turn = (self._turn + 1) % 1_000_003  # bounded; only its value modulo n matters
        return candidates[index]


POLICIES: dict[str, type] = {
    "least-load": LeastLoadPolicy,
}


def make_policy(name: str) -> RoutingPolicy:
    """Create the policy registered under ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
