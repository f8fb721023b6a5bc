"""The Kubernetes names Sluice's parts agree on: the custom resource's group, version and
plural, the labels on what the operator creates, and its worker Service's name and port.

The operator (``sluice/operator/resources.py``) writes them and the router's Kubernetes
discovery (``sluice/router/discovery.py``) selects by them: changing one here changes what
the router finds, and both move together.
"""

from __future__ import annotations

API_VERSION = "serving.sluice.dev/v1alpha1"
GROUP, VERSION = API_VERSION.split("/")
KIND = "InferenceService"
PLURAL = "inferenceservices"

NAME_LABEL = "app.kubernetes.io/name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
WORKER_APP = "sluice-worker"
MANAGED_BY = "sluice-operator"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY},{NAME_LABEL}={WORKER_APP}"

WORKER_SUFFIX = "-worker"  # the worker Service (and Endpoints) of InferenceService NAME
WORKER_PORT_NAME = "http"  # the worker Service's port the router sends to
