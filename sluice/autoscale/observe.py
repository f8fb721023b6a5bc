"""From routers' demand snapshots to the policy's ``Observation``.

Each router serves ``GET /autoscale/demand`` (``sluice.router.demand``): per model,
cumulative counters (``arrivals``, ``rejected``, ``invalid``, ``ttft_met``, ``ttft_total``,
``itl_met``, ``itl_total``) and gauges (``held``, ``in_flight``, ``queued``). A driver keeps
the last snapshot of every router and calls ``observe`` with the new ones; counts are the sum over
routers of each one's increase, gauges the sum of their current values. A router seen for
the first time contributes its gauges only (its counters cover an unknown span); a counter
that fell means the router restarted, and its new value is the increase. Requests the workers
refused as invalid are no demand: they are taken off the arrivals.
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice.autoscale.policy import Observation

COUNTERS = ("arrivals", "rejected", "invalid", "ttft_met", "ttft_total", "itl_met",
            "itl_total")
GAUGES = ("held", "in_flight", "queued")

Snapshot = Mapping[str, Mapping[str, int]]  # model → field → value (one router)


def observe(model: str, previous: Mapping[str, Snapshot], current: Mapping[str, Snapshot],
            window_s: float, ready: int, starting: int) -> Observation:
    """The observation of ``model`` over the last ``window_s`` seconds.

    Args:
        model: served model name.
        previous: router id (pod name, URL) → its snapshot at the window's start.
        current: router id → its snapshot now (routers that did not answer are left out:
            they contribute nothing this window).
        window_s: seconds between the two sets of snapshots (> 0).
        ready: replicas ready now; starting: replicas asked for and not ready yet.
    """
    counts = dict.fromkeys(COUNTERS, 0)
    gauges = dict.fromkeys(GAUGES, 0)
    for router, snapshot in current.items():
        now = snapshot.get(model) or {}
        for name in GAUGES:
            gauges[name] += int(now.get(name, 0))
        if router not in previous:
            continue
        before = previous[router].get(model) or {}
        for name in COUNTERS:
            value, old = int(now.get(name, 0)), int(before.get(name, 0))
            counts[name] += value - old if value >= old else value
    arrivals = max(0, counts["arrivals"] - counts["invalid"])
    return Observation(window_s=window_s, arrivals=arrivals,
                       rejected=counts["rejected"], ttft_met=counts["ttft_met"],
                       ttft_total=counts["ttft_total"], itl_met=counts["itl_met"],
                       itl_total=counts["itl_total"], queued=gauges["queued"],
                       held=gauges["held"], in_flight=gauges["in_flight"], ready=ready,
                       starting=starting)
