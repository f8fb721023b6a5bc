"""Logging shared by the servers."""

from __future__ import annotations

import logging

PROBE_PATHS = ("/health", "/livez", "/metrics", "/v1/models", "/autoscale/demand")


def _not_a_probe(record: logging.LogRecord) -> bool:
    args = record.args  # uvicorn access log: (client, method, path, http_version, status)
    return not (isinstance(args, tuple) and len(args) >= 5 and args[1] == "GET"
                and args[2] in PROBE_PATHS and args[4] in (200, 503))


def quiet_probe_access_logs() -> None:
    """Drop uvicorn access-log lines of answered GET /health, /livez, /metrics, /v1/models
    and /autoscale/demand: the router polls every worker about once a second, kubelets
    probe every pod and ``sluice up``'s autoscaler reads the router twice a second, which
    would flood the logs."""
    logging.getLogger("uvicorn.access").addFilter(_not_a_probe)
