"""The Kubernetes API calls the operator makes (kubernetes.aio), each with a timeout.

Objects go in and come out as plain JSON dicts (camelCase keys), so the pure builders and
status code never see client model classes. Children are written with server-side apply
under one field manager, so applying twice is a no-op, an existing child is adopted (its
ownerReference added) rather than duplicated, and fields other managers own (an HPA on
the Deployment, say) are left alone unless they conflict.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from sluice.api.names import GROUP, PLURAL, VERSION
from sluice.operator.resources import FIELD_MANAGER

logger = logging.getLogger(__name__)

AUTOSCALER_FIELD_MANAGER = "sluice-autoscaler"  # who wrote spec.replicas, in managedFields
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


class ApiError(RuntimeError):
    """A call failed. ``status`` is the HTTP status (0: no answer); ``message`` the API
    server's own message when it sent one."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class KubeApi(Protocol):
    """What the controller, the autoscaler and the drainer need; ``Kube`` is the real one,
    tests pass a fake."""

    async def apply(self, obj: dict[str, Any]) -> None: ...
    async def delete_child(self, namespace: str, api_version: str, kind: str,
                           name: str) -> None: ...
    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> bool: ...
    async def scale_isvc(self, namespace: str, name: str, replicas: int) -> bool: ...
    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: dict[str, str | None]) -> None: ...
    async def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...
    async def get_isvc(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def list_isvcs(self, namespace: str | None) -> list[dict[str, Any]]: ...
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...
    async def get_endpoints(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def patch_isvc_status(self, namespace: str, name: str,
                                status: dict[str, Any]) -> None: ...


class Kube:
    """``KubeApi`` over kubernetes.aio.

    Args:
        api_client: a configured ``kubernetes.aio.client.ApiClient``.
        timeout: seconds allowed for each request.
    """

    def __init__(self, api_client: Any, timeout: float = 15.0):
        from kubernetes.aio import client

        self._client = api_client
        self._timeout = timeout
        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    @classmethod
    async def connect(cls, timeout: float = 15.0) -> Kube:
        """In a pod: its service account; elsewhere: ``$KUBECONFIG`` or ~/.kube/config."""
        from kubernetes.aio import client, config

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        api_client = client.ApiClient()
        # The API server names a writer that gives no fieldManager after its user agent
        # (status patches; the scale subresource before 1.22 ignores fieldManager).
        api_client.user_agent = f"{FIELD_MANAGER}/{_version()}"
        return cls(api_client, timeout)

    async def close(self) -> None:
        await self._client.close()

    async def _call(self, method: Any, *args: Any, missing_ok: bool = False,
                    **kwargs: Any) -> Any:
        import aiohttp
        from kubernetes.aio.client.exceptions import ApiException

        try:
            result = await method(*args, _request_timeout=self._timeout, **kwargs)
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            raise ApiError(exc.status or 0, _message(exc.body) or str(exc.reason)) from None
        except (OSError, TimeoutError, aiohttp.ClientError) as exc:  # no answer, or a cut one
            raise ApiError(0, f"{type(exc).__name__}: {exc}") from None
        return result if isinstance(result, dict | list | None) else \
            self._client.sanitize_for_serialization(result)

    async def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply (force: the operator owns its children's fields)."""
        meta = obj["metadata"]
        if obj["kind"] == "PodDisruptionBudget":  # policy/v1 or v1beta1: a generic path
            group, version = obj["apiVersion"].split("/")
            await self._call(self._custom.patch_namespaced_custom_object, group, version,
                             meta["namespace"], "poddisruptionbudgets", meta["name"], obj,
                             field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)
            return
        method = {"Deployment": self._apps.patch_namespaced_deployment,
                  "Service": self._core.patch_namespaced_service}[obj["kind"]]
        await self._call(method, meta["name"], meta["namespace"], obj,
                         field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)

    async def delete_child(self, namespace: str, api_version: str, kind: str,
                           name: str) -> None:
        """Delete a child (a Deployment, Service or PodDisruptionBudget of ``api_version``)
        and, in the background, what it owns; gone already is fine."""
        body = {"propagationPolicy": "Background"}
        if kind == "PodDisruptionBudget":  # policy/v1 or v1beta1: a generic path, as apply
            group, version = api_version.split("/")
            await self._call(self._custom.delete_namespaced_custom_object, group, version,
                             namespace, "poddisruptionbudgets", name, body=body,
                             missing_ok=True)
            return
        method = {"Deployment": self._apps.delete_namespaced_deployment,
                  "Service": self._core.delete_namespaced_service}[kind]
        await self._call(method, name, namespace, body=body, missing_ok=True)

    async def pdb_api_version(self) -> str:
        """``policy/v1`` where the API server serves it (1.21+), else ``policy/v1beta1``
        (1.20; removed in 1.25). Discovery, which every authenticated user may read."""
        from kubernetes.aio import client

        group = await self._call(client.PolicyApi(self._client).get_api_group)
        versions = {v.get("version") for v in (group or {}).get("versions") or ()}
        return "policy/v1" if "v1" in versions or not versions else "policy/v1beta1"

    async def scale_isvc(self, namespace: str, name: str, replicas: int) -> bool:
        """Set ``spec.replicas`` through the scale subresource (what ``kubectl scale``, HPA
        and KEDA write); False when the InferenceService is gone."""
        result = await self._call(self._custom.patch_namespaced_custom_object_scale, GROUP,
                                  VERSION, namespace, PLURAL, name,
                                  {"spec": {"replicas": replicas}}, missing_ok=True,
                                  field_manager=AUTOSCALER_FIELD_MANAGER, _content_type=MERGE)
        return result is not None

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: dict[str, str | None]) -> None:
        """Set (or, with None, remove) annotations of a pod; a pod that is gone is fine."""
        await self._call(self._core.patch_namespaced_pod, name, namespace,
                         {"metadata": {"annotations": annotations}}, missing_ok=True,
                         field_manager=FIELD_MANAGER, _content_type=MERGE)

    async def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        """Post a core/v1 Event (the object ``kubectl describe`` shows)."""
        from kubernetes.aio.client import CoreV1Event

        await self._call(self._core.create_namespaced_event, namespace,
                         CoreV1Event.from_dict(event))

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> bool:
        """Set only ``spec.replicas``; False when the Deployment does not exist."""
        result = await self._call(self._apps.patch_namespaced_deployment, name, namespace,
                                  {"spec": {"replicas": replicas}}, missing_ok=True,
                                  field_manager=AUTOSCALER_FIELD_MANAGER, _content_type=MERGE)
        return result is not None

    async def get_isvc(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call(self._custom.get_namespaced_custom_object, GROUP, VERSION,
                                namespace, PLURAL, name, missing_ok=True)

    async def list_isvcs(self, namespace: str | None) -> list[dict[str, Any]]:
        if namespace is None:
            result = await self._call(self._custom.list_cluster_custom_object, GROUP, VERSION,
                                      PLURAL)
        else:
            result = await self._call(self._custom.list_namespaced_custom_object, GROUP,
                                      VERSION, namespace, PLURAL)
        return list(result.get("items") or [])

    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call(self._apps.read_namespaced_deployment, name, namespace,
                                missing_ok=True)

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        result = await self._call(self._core.list_namespaced_pod, namespace,
                                  label_selector=selector)
        return list(result.get("items") or [])

    async def get_endpoints(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call(self._core.read_namespaced_endpoints, name, namespace,
                                missing_ok=True)

    async def patch_isvc_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._call(self._custom.patch_namespaced_custom_object_status, GROUP, VERSION,
                         namespace, PLURAL, name, {"status": status}, missing_ok=True,
                         _content_type=MERGE)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sluice")
    except PackageNotFoundError:
        return "dev"


def _message(body: Any) -> str:
    """The ``message`` of a Kubernetes Status body, if it is one."""
    import json

    try:
        data = json.loads(body) if isinstance(body, str | bytes) else body
    except ValueError:
        return str(body or "")[:500]
    return str(data.get("message", "")) if isinstance(data, dict) else ""
