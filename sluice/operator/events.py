"""Kubernetes Events about an InferenceService (what ``kubectl describe`` lists).

``event`` is pure (tests compare it); ``post`` sends it and only logs a failure: an Event is
a record for people, never worth failing or retrying the action it reports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sluice.operator.kube import ApiError, KubeApi

logger = logging.getLogger(__name__)

COMPONENT = "sluice-operator"


def event(body: Mapping[str, Any], reason: str, message: str, now: str,
          type_: str = "Normal") -> dict[str, Any]:
    """A core/v1 Event about ``body`` (an InferenceService), at ``now`` (RFC 3339)."""
    meta = body["metadata"]
    return {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta.get("uid")},
        "reason": reason, "message": message[:1024], "type": type_,
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


async def post(kube: KubeApi, body: Mapping[str, Any], reason: str, message: str, now: str,
               type_: str = "Normal") -> None:
    try:
        await kube.create_event(body["metadata"]["namespace"],
                                event(body, reason, message, now, type_))
    except ApiError as exc:
        logger.warning("event %s about %s/%s not posted: %s", reason,
                       body["metadata"]["namespace"], body["metadata"]["name"], exc)
